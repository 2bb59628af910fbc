"""Models that ship inside the package, by name. They load through the same path as any checkpoint, and every
command and API that takes a checkpoint directory also takes one of these names.

  dsv4-sort        the default: a small DeepSeek-V4 trained to sort digits ("sort 31402=" -> "01234"),
                   in DeepSeek's native release layout (FP8 e4m3 dense weights with ue8m0 128x128 block
                   scales, FP4 routed experts with ue8m0 scales) plus its MTP layer
  dsv4-sort-bf16   the same training run's bf16 weights, in transformers' HF layout
  dsv4-sort-dspark dsv4-sort's target (the same bytes) with a DSpark drafter instead of its MTP layer,
                   native layout; `LLM("dsv4-sort-dspark", draft="dspark")`
  dsv4-tiny-dummy  a config only; its weights are seeded dummy values

Both dsv4-sort folders carry the task's character-level tokenizer and a chat template
(tokenizer_config.json). `scripts/train_embedded.py` writes them (`scripts/train_dspark.py` the DSpark
variant); `dsv4 eval` scores them.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from dsv4.errors import ConfigError

_HERE = Path(__file__).parent
DEFAULT_MODEL = "dsv4-sort"
BF16_MODEL = "dsv4-sort-bf16"
DUMMY_MODEL = "dsv4-tiny-dummy"
DSPARK_MODEL = "dsv4-sort-dspark"


class EmbeddedModel(NamedTuple):
    """One shipped model: its folder, the load format it needs, and what it is, in one line."""

    path: Path
    load_format: str
    summary: str


EMBEDDED_MODELS = {
    DEFAULT_MODEL: EmbeddedModel(_HERE / DEFAULT_MODEL, "auto",
                                 "sorts digits; native FP8 dense + FP4 experts + MTP layer (the default)"),
    BF16_MODEL: EmbeddedModel(_HERE / BF16_MODEL, "auto", "the same weights in bf16, transformers' HF layout"),
    DSPARK_MODEL: EmbeddedModel(_HERE / DSPARK_MODEL, "auto",
                                "dsv4-sort's target with a DSpark drafter (native layout; draft=\"dspark\")"),
    DUMMY_MODEL: EmbeddedModel(_HERE / DUMMY_MODEL, "dummy", "a tiny config with seeded dummy weights, no tokenizer"),
}


def resolve_model(model: str | Path | None, load_format: str = "auto") -> tuple[Path, str]:
    """A checkpoint directory or an embedded model's name -> (directory, load format).

    Args:
        model: a directory, an embedded model's name, or None for the default model.
        load_format: the caller's choice; "auto" becomes what an embedded model needs.

    Returns:
        The checkpoint directory and the load format to use.

    Raises:
        ConfigError: neither an existing directory nor an embedded model's name.
    """
    if model is None:
        model = DEFAULT_MODEL
    embedded = EMBEDDED_MODELS.get(str(model))
    if embedded is not None:
        return embedded.path, embedded.load_format if load_format == "auto" else load_format
    path = Path(model)
    if not path.is_dir():
        names = ", ".join(EMBEDDED_MODELS)
        problem = "is a file, not a checkpoint directory" if path.exists() else "no such directory"
        raise ConfigError(f"model {str(model)!r}: {problem}, and not an embedded model's name ({names})")
    return path, load_format
