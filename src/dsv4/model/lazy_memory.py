"""Zero-filled CPU buffers whose memory is taken only where they are written.

`torch.zeros` writes every byte up front: a per-sequence cache sized for max_num_seqs x max_model_len costs
its full size in RSS (and a page fault per 4 KiB) at start-up, however little of it requests use. A private
anonymous mapping is zero by definition: the kernel supplies a zeroed page on the first write to it, and a
read of a page never written maps the shared zero page, which costs no memory. `LazyZeros` wraps one mapping
in a tensor, so cache rows a sequence never writes are never resident, and `release` gives rows back (they
read as zeros again) when their sequence ends.

Use: `LazyZeros((slots, max_len, ...), dtype)` in place of `torch.zeros(...)` for cache buffers, `.tensor`
where the buffer was used, and `release(slot)` when the slot's sequence finishes. Only CPU memory is lazy;
on other devices (and for buffers under a page or so) this is a plain `torch.zeros`.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

# Below this size a mapping of its own is not worth its page-granular rounding and its system calls.
LAZY_MIN_BYTES = 64 * 1024


class LazyZeros:
    """A zero tensor of `shape` and `dtype`, backed on CPU by an anonymous mapping taken page by page on write.

    Args:
        shape: tensor shape; rows (dim 0) are what `release` gives back.
        dtype: element type.
        device: "cpu" for lazily taken memory; any other device gets `torch.zeros`.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.shape = tuple(shape)
        numel = 1
        for dim in self.shape:
            numel *= dim
        self.nbytes = numel * dtype.itemsize
        self._mapping: mmap.mmap | None = None
        if torch.device(device).type != "cpu" or self.nbytes < LAZY_MIN_BYTES:
            self.tensor = torch.zeros(self.shape, dtype=dtype, device=device)
            return
        self._mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # The tensor holds a reference to the mapping: it is unmapped when the last view of it is gone.
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8).view(dtype).view(self.shape)

    @property
    def lazy(self) -> bool:
        """Whether the memory is taken on write (CPU, large enough) rather than up front."""
        return self._mapping is not None

    def release(self, rows: int | slice) -> None:
        """Give back the memory of some rows (dim 0): afterwards they read as zeros and cost nothing until
        written again. Only whole pages inside the rows are returned; partial pages at their edges are zeroed
        in place.

        Args:
            rows: a row index or a slice of rows (step 1).
        """
        start, stop, step = (rows, rows + 1, 1) if isinstance(rows, int) else rows.indices(self.shape[0])
        if step != 1:
            raise ValueError(f"release: rows must be contiguous (step 1), got step {step}")
        if stop <= start:
            return
        if self._mapping is None:
            self.tensor[start:stop].zero_()
            return
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        begin, end = start * row_bytes, stop * row_bytes
        first_page = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
        last_page = end // mmap.PAGESIZE * mmap.PAGESIZE
        if last_page <= first_page:
            self._bytes(begin, end).zero_()
            return
        self._bytes(begin, first_page).zero_()
        self._bytes(last_page, end).zero_()
        self._mapping.madvise(mmap.MADV_DONTNEED, first_page, last_page - first_page)

    def _bytes(self, begin: int, end: int) -> torch.Tensor:
        return self.tensor.view(-1).view(torch.uint8)[begin:end]
