"""Step workspace: the memory a forward step's temporaries take stays with the process between steps.

A step allocates its activations (projections, logits tiles, expert buffers: megabytes each in a prefill)
through torch's CPU allocator, which is glibc's malloc. Left to its defaults, glibc gives large freed blocks
back to the kernel (a block above its mmap threshold is unmapped when freed; free memory above its trim
threshold at the top of the heap is released), so the next step takes the same memory again as fresh pages:
one page fault and a zero-fill per 4 KiB, every step. On the tiny benchmark config a 64 x 64-token prefill
took ~19,000 such faults (~74 MiB) and ran ~7% slower for them than with the workspace kept.

`keep_step_memory` sets two malloc parameters once, for the process that serves steps:

- the mmap threshold to its largest value (MMAP_THRESHOLD_MAX_BYTES): blocks up to that size come from the
  heap, whose freed memory the next step reuses (larger blocks are mapped and unmapped as before);
- the trim threshold out of reach: the heap keeps its peak (the largest step's temporaries, bounded by
  max_num_batched_tokens) instead of shrinking after each step.

Weights and caches are not malloc memory (`lazy_memory.py` maps them itself), so they are unaffected. This is
what a caching allocator does for a GPU engine, and what a preloaded jemalloc / tcmalloc does for a CPU one.
Only glibc has these parameters; with another C library nothing changes.
"""

from __future__ import annotations

import ctypes

# mallopt parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above half its largest heap (HEAP_MAX_SIZE / 2: 32 MiB on 64-bit).
MMAP_THRESHOLD_MAX_BYTES = 32 * 1024 * 1024
# Free memory at the top of the heap beyond this is given back: never, in practice (the parameter is an int).
TRIM_THRESHOLD_BYTES = 2**31 - 1


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (the one with mallopt's parameters above), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_step_memory() -> bool:
    """Keep freed step temporaries in the process (module docstring). Idempotent.

    Returns:
        Whether both parameters were set (False: not glibc, or glibc refused one).
    """
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success. Fixing the mmap threshold also stops glibc's dynamic adjustment of both.
    mapped = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES) == 1
    trimmed = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mapped and trimmed
