"""Zero-filled CPU memory that nothing writes up front: the kernel zeroes each page on its first write.

`torch.zeros` writes every byte up front: a per-sequence cache sized for max_num_seqs x max_model_len costs
its full size in RSS (and a page fault per 4 KiB) at start-up, however little of it requests use. A private
anonymous mapping is zero by definition: the kernel supplies a zeroed page on the first write to it, and a
read of a page never written maps the shared zero page, which costs no memory. `lazy_zeros` wraps one such
mapping in a tensor, so cache rows no sequence ever writes are never resident.

Use `lazy_zeros(shape, dtype, device)` in place of `torch.zeros(shape, ...)` for buffers that are large and
mostly unwritten. Only CPU memory is lazy; on other devices (and for buffers under LAZY_MIN_BYTES) it is a
plain `torch.zeros`.

Weights are the opposite case: every byte is written (by the load, or by a refit's staging copy), soon after
allocation. `torch.zeros` would write each byte twice and take a 4 KiB page fault per page (~2-4 us each on a
VM, 4-5x the cost of the copy that follows). A `WeightArena` hands out tensors carved from large anonymous
mappings marked for transparent huge pages: nothing is written at allocation, and the first write takes one
fault per 2 MiB, so filling fresh memory costs about what a copy into memory already touched costs.
`ArenaAllocation(arena)` routes the CPU factory calls (`torch.zeros`, `empty`, `ones`, `full`) of the
code it wraps (a model build) into an arena, so model code allocates its parameters the ordinary way.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch
from torch.overrides import TorchFunctionMode

# Below this size a mapping of its own is not worth its page-granular rounding and its system calls.
LAZY_MIN_BYTES = 64 * 1024
# Transparent huge pages on x86-64 and most arm64 kernels: arena chunks start on this boundary.
HUGE_PAGE_BYTES = 2 * 1024 * 1024
# An arena maps memory in chunks of this size (address space: only what is written is ever resident); a
# tensor larger than a quarter of a chunk gets a mapping of its own, so chunks are not left mostly empty.
ARENA_CHUNK_BYTES = 64 * 1024 * 1024
# Where each arena tensor starts: a cache line, the alignment torch's own CPU allocator gives.
ARENA_ALIGN_BYTES = 64
# Factory calls below this size stay with torch's allocator (its small blocks are reused, not faulted in).
ARENA_MIN_BYTES = 16 * 1024


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


def _fresh_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping of at least `nbytes` past its first huge-page boundary, marked for huge
    pages; returns it and that boundary's offset in it."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    return mapping, -address % HUGE_PAGE_BYTES


class WeightArena:
    """Fresh zero CPU memory for tensors that are about to be written in full (weights, staged values).

    Each tensor owns a storage of its own (a slice of a shared mapping); a mapping is unmapped once the
    last tensor carved from it is gone, so an arena only has to outlive its allocations' use by nobody.

    Args:
        chunk_bytes: size of the mappings small tensors are carved from.
    """

    def __init__(self, chunk_bytes: int = ARENA_CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: mmap.mmap | None = None
        self._next = 0  # offset of the next free byte of the current chunk
        self.mapped_bytes = 0  # address space mapped so far (not memory: only written pages are resident)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype, stride: Sequence[int] | None = None) -> torch.Tensor:
        """A zero tensor of never-written memory.

        Args:
            shape: its shape.
            dtype: element type.
            stride: element strides of a dense (non-overlapping, gap-free) layout, e.g. a transposed matrix's;
                None: contiguous.
        """
        shape = tuple(shape)
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        buffer, start = self._place(numel * dtype.itemsize)
        flat = torch.frombuffer(buffer, dtype=dtype, count=numel, offset=start)  # a storage of its own
        return flat.view(shape) if stride is None else flat.as_strided(shape, tuple(stride))

    def zeros_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A zero tensor of `tensor`'s shape, dtype and (when contiguous or a transposed contiguous matrix)
        strides: copying between the two then streams both in the same order."""
        transposed = tensor.dim() == 2 and tensor.stride() == (1, tensor.shape[0])
        return self.zeros(tensor.shape, tensor.dtype, tensor.stride() if transposed else None)

    def release(self) -> None:
        """Stop carving from the current chunk, so that its memory goes with the last tensor carved from it
        (the arena stays usable: the next tensor starts a new chunk)."""
        self._chunk = None
        self._next = 0

    def _place(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """(mapping, offset) of `nbytes` never handed out before."""
        if nbytes > self.chunk_bytes // 4:
            mapping, start = _fresh_mapping(nbytes)
            self.mapped_bytes += len(mapping)
            return mapping, start
        start = -(-self._next // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES
        if self._chunk is None or start + nbytes > len(self._chunk):
            self._chunk, start = _fresh_mapping(self.chunk_bytes)
            self.mapped_bytes += len(self._chunk)
        self._next = start + nbytes
        return self._chunk, start


# Factory function -> how its fill value is found (None: the memory's own zeros serve).
_FACTORIES = {
    torch.zeros: None,
    torch.empty: None,
    torch.ones: lambda args, kwargs: 1,
    torch.full: lambda args, kwargs: kwargs["fill_value"] if "fill_value" in kwargs else args[1],
}
# The keyword arguments an arena honours; a call with any other (out=, layout=, pin_memory=...) is torch's.
_ARENA_KWARGS = {"dtype", "device", "requires_grad", "fill_value"}


class ArenaAllocation(TorchFunctionMode):
    """Within this context, CPU `torch.zeros / empty / ones / full` calls of at least ARENA_MIN_BYTES take
    their memory from `arena` (an `empty` then reads zeros). Calls for other devices, other layouts or with
    an `out=` tensor go to torch unchanged.

    Args:
        arena: where the tensors are carved from.
    """

    def __init__(self, arena: WeightArena):
        super().__init__()
        self.arena = arena

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.keys() <= _ARENA_KWARGS:
            placed = self._place(func, args, kwargs)
            if placed is not None:
                return placed
        return func(*args, **kwargs)

    def _place(self, func, args: tuple, kwargs: dict) -> torch.Tensor | None:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return None
        sizes = args[:1] if func is torch.full else args
        shape = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], Sequence) else tuple(sizes)
        if not all(isinstance(d, int) for d in shape):
            return None
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        if math.prod(shape) * dtype.itemsize < ARENA_MIN_BYTES:
            return None
        if func is torch.full and "dtype" not in kwargs:
            return None  # full infers its dtype from the fill value: torch's rule, not restated here
        tensor = self.arena.zeros(shape, dtype)
        fill = _FACTORIES[func]
        if fill is not None:
            tensor.fill_(fill(args, kwargs))
        if kwargs.get("requires_grad"):
            tensor.requires_grad_(True)
        return tensor
