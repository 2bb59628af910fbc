"""A load's large byte work (a read into resident memory, a transposing or dequantizing copy) cut into parts
that run on the machine's cores at once.

One core does not saturate the memory system: on the 2-core development VM a read(2) of the 0.5 GiB
benchmark checkpoint into fresh memory took 38 ms on one thread and 29.5 ms split over two (the page faults
and the zeroing of fresh pages are per-core work), and a transposing copy is bound by one core's loads and
stores. Every part is a C call that runs without the interpreter lock (ctypes' foreign calls, os.preadv), so
plain threads run them in parallel; each part writes its own bytes, so the result is the same bytes whatever
the split. Work under MIN_PART_BYTES a part stays on the caller's thread: starting a thread costs tens of
microseconds.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from dsv4.kernels.gemv_cpu import usable_cpus

# The smallest share of the work worth a thread of its own (starting one costs ~50-100 us; a core copies
# 4 MiB in ~0.4 ms).
MIN_PART_BYTES = 4 * 1024 * 1024
# Parts at most: past a few cores a copy is bound by the memory system, not by the cores.
MAX_PARTS = 8


def part_count(nbytes: int) -> int:
    """How many parts `nbytes` of work is cut into: one per usable core, each at least MIN_PART_BYTES."""
    return max(1, min(usable_cpus(), MAX_PARTS, nbytes // MIN_PART_BYTES))


def cut_points(total: int, parts: int, align: int) -> list[int]:
    """[0, ..., total]: `parts` near-equal pieces of [0, total) whose inner bounds are multiples of `align`
    (pieces that round to nothing are dropped)."""
    bounds = [0]
    for k in range(1, parts):
        cut = total * k // parts
        cut -= cut % align
        if bounds[-1] < cut < total:
            bounds.append(cut)
    bounds.append(total)
    return bounds


def run_parts(work: Callable[[int, int], object], bounds: list[int]) -> list[object]:
    """work(bounds[i], bounds[i + 1]) for every piece, the first on the caller's thread and the others on
    threads of their own, all at once; their results in piece order. The caller's piece is the first because
    it reads its bytes next: what the caller checks after a split read (a run of checkpoint tensors starts with
    its scales) is then in its own core's cache, where bytes another core wrote cost a transfer per line (the
    medium benchmark load's e8m0 scale checks took ~4x as long when another thread had read the scales).

    Raises:
        whatever a piece raised (the first piece's first), once every piece has ended: no thread is left
        writing when this returns or raises.
    """
    pieces = list(itertools.pairwise(bounds))
    results: list[object] = [None] * len(pieces)
    errors: list[BaseException | None] = [None] * len(pieces)

    def run(i: int) -> None:
        try:
            results[i] = work(*pieces[i])
        except BaseException as exc:  # re-raised on the caller's thread below
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name="dsv4-load-part", daemon=True)
               for i in range(1, len(pieces))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results
