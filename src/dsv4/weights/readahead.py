"""Disk reads of a checkpoint issued ahead of the loader, so that a cold load waits on the disk once.

A load alternates reads with work on what it read (validation, conversion, the model build before the
first read). The kernel's own readahead keeps about one window (`read_ahead_kb`) in flight past the last
read, so while the loader works the disk goes idle, and each read then waits for it again: a cold load of
the large benchmark model spent ~1.5 s more waiting than reading the same files back to back took. A
`Readahead` asks for the files' bytes from a thread of its own (posix_fadvise WILLNEED: the kernel
submits the reads and returns, the pages land in the page cache), in file order, from before the model
build on, at most LEAD_BYTES past what the loader has consumed, so the disk stays busy through the build
and the loader's own work, and the loader's reads copy out of the page cache.

The lead bounds the page cache a load claims ahead of itself (those pages are the kernel's, not the
process's: the load's RSS is unchanged), so a checkpoint larger than memory is not read ahead into
eviction of its own unread bytes. On a warm page cache each hint is a walk of pages already there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

# Bytes asked for per hint: a few of the kernel's readahead windows, so each call keeps the disk queue fed.
CHUNK_BYTES = 16 * 1024 * 1024
# How far past the loader's position the hints may run.
LEAD_BYTES = 256 * 1024 * 1024


class Readahead:
    """Reads of `extents` ((file, start, end) byte ranges, in the order the loader consumes them) issued
    ahead of the loader from a background thread, until `close()`.

    Args:
        extents: the byte ranges the loader will read, in its order.
        lead_bytes: how far ahead of the loader's reported position (`advance`) the reads may run.
        chunk_bytes: bytes per hint.
    """

    def __init__(self, extents: Sequence[tuple[Path, int, int]], lead_bytes: int = LEAD_BYTES,
                 chunk_bytes: int = CHUNK_BYTES):
        self._extents = list(extents)
        self._lead = lead_bytes
        self._chunk = chunk_bytes
        self._consumed = 0  # bytes of the extents, in order, the loader has reported consumed
        self._issued = 0  # bytes of the extents hinted so far
        self._waiting = False  # the thread waits for room under the lead
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dsv4-readahead", daemon=True)
        self._thread.start()

    def advance(self, nbytes: int) -> None:
        """The loader consumed `nbytes` more of the extents. The thread is woken only once a whole chunk
        fits under the lead again (a wake per call would hand the interpreter lock back and forth for
        nothing)."""
        with self._changed:
            self._consumed += nbytes
            if self._waiting and self._room():
                self._changed.notify()

    def _room(self) -> bool:
        """Whether the next chunk keeps the hints within the lead of the loader."""
        return self._issued + self._chunk - self._consumed <= self._lead

    def close(self) -> None:
        """Stop issuing reads and wait for the thread (idempotent)."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def __enter__(self) -> Readahead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        for file, start, end in self._extents:
            try:
                fd = os.open(file, os.O_RDONLY)
            except OSError:
                continue  # the loader's own read reports it
            try:
                offset = start
                while offset < end:
                    with self._changed:
                        self._waiting = True
                        while not self._closed and not self._room():
                            self._changed.wait()
                        self._waiting = False
                        if self._closed:
                            return
                    length = min(self._chunk, end - offset)
                    try:
                        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                    except OSError:
                        return  # hints only: the loader's reads are what count
                    offset += length
                    with self._changed:
                        self._issued += length
            finally:
                os.close(fd)
