"""The errors dsv4 raises for bad input. Each message names the file, tensor, field, argument or request at
fault and the bad value.

Every class derives from `Dsv4Error` (catch that to catch them all) and from the built-in exception a Python
user expects for the same mistake (`ValueError` for a bad value, `TypeError` for a wrong type), so code
written against either keeps working. The command line turns any of them into one line and exit status 2.
"""


class Dsv4Error(Exception):
    """Base class of every dsv4 error."""


class ConfigError(Dsv4Error, ValueError):
    """An invalid or unsupported config value or engine option; the message names the file or argument."""


class CheckpointError(Dsv4Error, ValueError):
    """A checkpoint that cannot be loaded: missing, unexpected, mis-shaped or corrupt tensors or files."""


class WeightsNotReadyError(Dsv4Error, RuntimeError):
    """Forward was called on a model whose weights were not finalized (or a failed refit left it unusable)."""


class WeightUpdateError(Dsv4Error, ValueError):
    """A refit bucket or session that was rejected; nothing of it was applied in atomic mode."""


class RequestError(Dsv4Error, ValueError):
    """A request that cannot be served (too long, bad parameters or token ids); other requests are unaffected."""


class ArgumentTypeError(Dsv4Error, TypeError):
    """An argument of a public function with the wrong Python type; the message names the argument (and the
    request or list position within it) and shows the value received."""


class WeightTransferError(Dsv4Error, RuntimeError):
    """A weight transfer between processes that broke: a peer unreachable, dead or too slow (timeout), or a
    transfer group whose members disagree (world size, rank, backend). The message names the group and peer."""


class AgreementError(Dsv4Error, ValueError):
    """Log-probabilities the agreement metrics cannot compare (shapes that differ, no token selected by the
    mask, non-finite values) or an unreadable agreement file; the message names the argument or file."""


class ParallelError(Dsv4Error, RuntimeError):
    """A tensor / expert parallel group that cannot form (wrong world size, a rank that never arrives) or
    breaks (a rank that died, a collective past its timeout); the message names the group, rank and timeout."""
