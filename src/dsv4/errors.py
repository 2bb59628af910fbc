"""The errors dsv4 raises. Each message names the file, tensor, field or request at fault."""


class Dsv4Error(Exception):
    """Base class of every dsv4 error."""


class ConfigError(Dsv4Error, ValueError):
    """An invalid or unsupported config value; the message names the file and field."""


class CheckpointError(Dsv4Error, ValueError):
    """A checkpoint that cannot be loaded: missing, unexpected, mis-shaped or corrupt tensors or files."""


class WeightsNotReadyError(Dsv4Error, RuntimeError):
    """Forward was called on a model whose weights were not finalized (or a failed refit left it unusable)."""


class WeightUpdateError(Dsv4Error, ValueError):
    """A refit bucket or session that was rejected; nothing of it was applied in atomic mode."""


class RequestError(Dsv4Error, ValueError):
    """A request that cannot be served (too long, bad parameters); other requests are unaffected."""
