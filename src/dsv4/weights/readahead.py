"""Disk reads of a checkpoint issued ahead of the loader, so that a cold load waits on the disk once.

A load alternates reads with work on what it read (validation, conversion, and the model build before the
first read). The kernel's own readahead keeps about one window (`read_ahead_kb`) in flight past the last
read, so while the loader works the disk goes idle, and each read then waits for it again. A `Readahead`
faults the files' pages into the page cache from a thread of its own (madvise MADV_POPULATE_READ on a
mapping of the file, released again at once: the pages stay cached, none stays mapped), in file order, from
before the model build on and at most LEAD_BYTES past what the loader has consumed, so the disk stays busy
through the build and the loader's own work, and the loader's reads copy out of the page cache.

Why faults and not posix_fadvise(WILLNEED) / readahead(2): those fill the page cache with single 4 KiB
pages, where the fault path's readahead allocates large folios; every later read of such a file then costs
~3x (measured on the development VM: a warm read(2) of the 1.6 GiB benchmark checkpoint 3.2-3.4 s after
WILLNEED hints, 1.1 s after populating, which read the cold file in ~1.0 s against 3.5-4.1 s for read(2)).

The lead bounds the page cache a load claims ahead of itself (the kernel's memory, not the process's), so
a checkpoint larger than memory is not read ahead into eviction of its own unread bytes; the process holds
at most one chunk's page-table entries at a time. On a warm page cache each chunk is a walk of pages already
there, unless mincore(2) reports every page of an extent cached already: then the extent is skipped (a warm
load's thread only asks, where faulting cached pages in and releasing them again cost the small benchmark
model's warm load ~15 ms of CPU). It asks cachestat(2) first (Linux 6.5+: one walk of the file's cached folios,
~0.05 ms for the 1.6 GiB benchmark checkpoint), and mincore only where the kernel does not answer that: mincore
answers page by page, ~12 ms of that checkpoint's warm load (4-7 ms of CPU), which on two shared cores came out of
the model build it overlaps (the large build 12 -> 20 ms). The test is per extent, not per chunk: skipping the chunks
the kernel's own readahead had just cached left its next window unasked for (the faults on a window's marked
page start the next one), and the loader then read the rest itself (the small cold load ~45 ms more CPU).
mincore may under-report (Linux answers for unmapped pages only for files the caller may write), and an extent
it does not vouch for is read as before. Where the kernel lacks MADV_POPULATE_READ (before Linux 5.14) the
thread stops: hints only.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

# Bytes faulted in per call: a few of the kernel's readahead windows, so each call keeps the disk busy.
CHUNK_BYTES = 8 * 1024 * 1024
# How far past the loader's position the reads may run.
LEAD_BYTES = 256 * 1024 * 1024
# <linux/mman.h>: fault every page of the range in for reading (Python's mmap module does not name it).
MADV_POPULATE_READ = 22
# cachestat(2)'s system call number (Python's os module does not wrap it): 451 in x86-64's table and in
# <asm-generic/unistd.h>, which arm64 and riscv64 use. Other architectures number it otherwise (a wrong number
# would be another system call), so there the mincore path answers.
SYS_CACHESTAT = 451
CACHESTAT_MACHINES = ("x86_64", "aarch64", "arm64", "riscv64")


class _CachestatRange(ctypes.Structure):
    """<linux/mman.h> struct cachestat_range: the byte range asked about."""

    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    """<linux/mman.h> struct cachestat: the range's page counts (pages of the system's page size)."""

    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    """libc's madvise(2), called without the interpreter lock (ctypes releases it)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.restype = ctypes.c_int
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


@functools.cache
def _mincore() -> Callable[[int, int, ctypes.Array], int]:
    """libc's mincore(2), called without the interpreter lock."""
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.restype = ctypes.c_int
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return mincore


@functools.cache
def _cachestat() -> Callable[[int, int, ctypes.c_void_p, ctypes.c_void_p, int], int]:
    """libc's syscall(2) for cachestat(2), called without the interpreter lock."""
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    return syscall


def file_cached(fd: int, start: int, length: int) -> bool | None:
    """Whether cachestat(2) counts every page of bytes [start, start + length) of an open file (`start`
    page-aligned) in the page cache; None where it does not answer (a kernel before 6.5, or one that refuses
    the caller this file, an architecture not in CACHESTAT_MACHINES): then ask `cached` on a mapping of it."""
    if platform.machine() not in CACHESTAT_MACHINES:
        return None
    if length <= 0:
        return True
    asked, counts = _CachestatRange(start, length), _Cachestat()
    if _cachestat()(SYS_CACHESTAT, fd, ctypes.addressof(asked), ctypes.addressof(counts), 0) != 0:
        return None
    return counts.nr_cache >= -(-length // mmap.PAGESIZE)


def cached(address: int, length: int) -> bool:
    """Whether mincore(2) reports every page of [address, address + length) (page-aligned, in a file
    mapping) in the page cache (bit 0 of each page's byte; the other bits are reserved)."""
    pages = -(-length // mmap.PAGESIZE)
    resident = ctypes.create_string_buffer(pages)
    if _mincore()(address, length, resident) != 0:
        return False
    raw = resident.raw
    # All ones (what a cached chunk answers) is one scan in C; reserved bits set take the byte-by-byte test.
    return not raw.strip(b"\x01") or all(byte & 1 for byte in raw)


def populate(address: int, length: int) -> bool:
    """Fault [address, address + length) of a file mapping into the page cache, then release the mapping's
    pages (they stay cached); False where the kernel refuses (no MADV_POPULATE_READ, an I/O error)."""
    if _madvise()(address, length, MADV_POPULATE_READ) != 0:
        return False
    _madvise()(address, length, mmap.MADV_DONTNEED)
    return True


class Readahead:
    """Reads of `extents` ((file, start, end) byte ranges, in the order the loader consumes them) issued
    ahead of the loader from a background thread, until `close()`.

    Args:
        extents: the byte ranges the loader will read, in its order.
        lead_bytes: how far ahead of the loader's reported progress (`advance`) the reads may run.
        chunk_bytes: bytes per read request.
    """

    def __init__(self, extents: Sequence[tuple[Path, int, int]], lead_bytes: int = LEAD_BYTES,
                 chunk_bytes: int = CHUNK_BYTES):
        self._extents = list(extents)
        self._lead = lead_bytes
        self._chunk = chunk_bytes
        self._consumed = 0  # bytes of the extents the loader has reported consumed
        self._issued = 0  # bytes of the extents read ahead so far
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
        """Whether the next chunk keeps the reads within the lead of the loader."""
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
            first = start - start % mmap.PAGESIZE
            try:
                with open(file, "rb") as f:
                    stop = min(os.fstat(f.fileno()).st_size, end + -end % mmap.PAGESIZE)
                    known = file_cached(f.fileno(), first, stop - first)
                    if known:
                        self._skip(start, end)
                        continue
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                continue  # the loader's own read reports it
            anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address (released before it closes)
            try:
                base = ctypes.addressof(anchor)
                if known is None and cached(base + first, stop - first):
                    self._skip(start, end)
                    continue
                if not self._read_extent(base, len(mapping), start, end):
                    return
            finally:
                del anchor
                mapping.close()

    def _skip(self, start: int, end: int) -> None:
        """An extent already cached: nothing to read, counted as read (the lead counts from the loader on)."""
        with self._changed:
            self._issued += end - start

    def _read_extent(self, base: int, size: int, start: int, end: int) -> bool:
        """Read [start, end) of a file mapped at `base` ahead, chunk by chunk within the lead (page-aligned
        requests); False once closed or refused."""
        offset = start - start % mmap.PAGESIZE
        while offset < end:
            with self._changed:
                self._waiting = True
                while not self._closed and not self._room():
                    self._changed.wait()
                self._waiting = False
                if self._closed:
                    return False
            stop = min(size, offset + self._chunk, end + -end % mmap.PAGESIZE)
            if not populate(base + offset, stop - offset):
                return False
            with self._changed:
                self._issued += min(stop, end) - max(offset, start)
            offset = stop
        return True
