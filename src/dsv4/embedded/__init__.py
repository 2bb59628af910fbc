"""Models that ship inside the package, by name. They load through the same path as any checkpoint.

  dsv4-sort        the default: a small DeepSeek-V4 trained to sort digits ("sort 31402=" -> "01234"),
                   in DeepSeek's native release layout (FP8 e4m3 dense weights with ue8m0 128x128 block
                   scales, FP4 routed experts with ue8m0 scales) plus its MTP layer
  dsv4-sort-bf16   the same training run's bf16 weights, in transformers' HF layout
  dsv4-tiny-dummy  a config only; its weights are seeded dummy values

`scripts/train_embedded.py` writes both dsv4-sort folders; `dsv4 eval` scores them.
"""

from pathlib import Path

from dsv4.errors import ConfigError

_HERE = Path(__file__).parent
DEFAULT_MODEL = "dsv4-sort"
BF16_MODEL = "dsv4-sort-bf16"
DUMMY_MODEL = "dsv4-tiny-dummy"
# name -> (directory, load format).
EMBEDDED_MODELS = {
    DEFAULT_MODEL: (_HERE / DEFAULT_MODEL, "auto"),
    BF16_MODEL: (_HERE / BF16_MODEL, "auto"),
    DUMMY_MODEL: (_HERE / DUMMY_MODEL, "dummy"),
}


def resolve_model(model: str | Path | None, load_format: str) -> tuple[Path, str]:
    """A checkpoint directory or an embedded model's name -> (directory, load format)."""
    if model is None:
        model = DEFAULT_MODEL
    if str(model) in EMBEDDED_MODELS:
        path, embedded_format = EMBEDDED_MODELS[str(model)]
        return path, embedded_format if load_format == "auto" else load_format
    path = Path(model)
    if not path.is_dir():
        names = ", ".join(EMBEDDED_MODELS)
        raise ConfigError(f"model {str(model)!r}: not a checkpoint directory nor an embedded model ({names})")
    return path, load_format
