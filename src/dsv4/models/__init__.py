"""Models that ship inside the package, by name. They load through the same path as any checkpoint."""

from pathlib import Path

from dsv4.errors import ConfigError

_HERE = Path(__file__).parent
# name -> (directory, load format). The dummy model has a config only; its weights are seeded values.
EMBEDDED_MODELS = {
    "dsv4-tiny-dummy": (_HERE / "dsv4-tiny-dummy", "dummy"),
}
DEFAULT_MODEL = "dsv4-tiny-dummy"


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
