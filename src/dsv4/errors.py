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


class WeightTransferError(Dsv4Error, RuntimeError):
    """A weight transfer between processes that broke: a peer unreachable, dead or too slow (timeout), or a
    transfer group whose members disagree (world size, rank, backend). The message names the group and peer."""


class AgreementError(Dsv4Error, ValueError):
    """Log-probabilities the agreement metrics cannot compare (shapes that differ, no token selected by the
    mask, non-finite values) or an unreadable agreement file; the message names the argument or file."""
