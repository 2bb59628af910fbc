"""Zero-filled CPU buffers whose memory is taken only where they are written.

`torch.zeros` writes every byte up front: a per-sequence cache sized for max_num_seqs x max_model_len costs
its full size in RSS (and a page fault per 4 KiB) at start-up, however little of it requests use. A private
anonymous mapping is zero by definition: the kernel supplies a zeroed page on the first write to it, and a
read of a page never written maps the shared zero page, which costs no memory. `lazy_zeros` wraps one such
mapping in a tensor, so cache rows no sequence ever writes are never resident.

Use `lazy_zeros(shape, dtype, device)` in place of `torch.zeros(shape, ...)` for buffers that are large and
mostly unwritten. Only CPU memory is lazy; on other devices (and for buffers under LAZY_MIN_BYTES) it is a
plain `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

# Below this size a mapping of its own is not worth its page-granular rounding and its system calls.
LAZY_MIN_BYTES = 64 * 1024


def lazy_zeros(shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zero tensor whose CPU memory is taken page by page as it is written.

    Args:
        shape: the tensor's shape.
        dtype: element type.
        device: "cpu" for lazily taken memory; any other device (e.g. "meta", "cuda") gets `torch.zeros`.

    Returns:
        A contiguous tensor of zeros that owns its storage (not a view), at a fixed address for its lifetime.
    """
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        # Where transparent huge pages are on for every mapping, one write would take 2 MiB (a few hundred
        # unrelated cache rows) instead of 4 KiB; the promise is that unwritten rows cost nothing.
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    # The storage holds a reference to the mapping: it is unmapped when the last tensor on it is gone.
    storage = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
