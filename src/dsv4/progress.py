"""Progress of long work (eval, convert, large generate batches): a tqdm bar when stderr is a terminal,
otherwise a log line (logger "dsv4", level INFO) at most every `LOG_INTERVAL_S` seconds and one at the
end of work that lasted that long, so that a log file or CI output shows the work is alive without a bar's
control characters.

The command line sends INFO records to stderr; a library user sees them once they configure logging.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

LOGGER = logging.getLogger("dsv4")
# Often enough to show a long job is alive, rarely enough not to flood a log.
LOG_INTERVAL_S = 10.0

T = TypeVar("T")


class Progress:
    """Counts finished units of one piece of work and shows it.

    Args:
        total: units expected (None: unknown).
        desc: what is being done, e.g. "generate".
        unit: the name of one unit, e.g. "req".
        stream: where the bar goes, and whose isatty() picks bar vs log lines (default: sys.stderr at
            construction).
        log_interval_s: least time between two log lines.
        enabled: False shows nothing (the caller asked for quiet).
    """

    def __init__(
        self, total: int | None, desc: str, unit: str = "it", *, stream: TextIO | None = None,
        log_interval_s: float = LOG_INTERVAL_S, enabled: bool = True,
    ):
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self._interval = log_interval_s
        self._start = self._last_log = time.monotonic()
        stream = sys.stderr if stream is None else stream
        self._bar = None
        self._logging = False
        if not enabled:
            return
        if _isatty(stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=stream)
        else:
            self._logging = True

    def update(self, n: int = 1) -> None:
        """Count `n` more finished units."""
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._logging and time.monotonic() - self._last_log >= self._interval:
            self._log()

    def close(self) -> None:
        """End the display: close the bar, or log the final count."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._logging:
            # Work shorter than one interval needs no progress line at all.
            if time.monotonic() - self._start >= self._interval:
                self._log()
            self._logging = False

    def _log(self) -> None:
        self._last_log = now = time.monotonic()
        elapsed = now - self._start
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate = f", {self.done / elapsed:.1f} {self.unit}/s" if elapsed > 0 else ""
        LOGGER.info("%s: %s %s%s, %.1f s%s", self.desc, count, self.unit, share, elapsed, rate)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def track(items: Iterable[T], total: int | None, desc: str, unit: str = "it") -> Iterator[T]:
    """Iterate over `items`, counting each one as a finished unit of a `Progress`."""
    with Progress(total, desc, unit) as progress:
        for item in items:
            yield item
            progress.update()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
