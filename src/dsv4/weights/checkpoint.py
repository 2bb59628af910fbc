"""A checkpoint directory on disk: config.json plus safetensors (one file, or sharded with an index).

Headers are validated up front so a corrupt or truncated file fails before any weight is written. Only
safetensors are read: never pickle.

Tensors stream one at a time, in file order, and reading costs the one copy into resident storage. A tensor
whose bytes go into the model as they are (FP4 expert bytes and scales, float tensors in the resident dtype
and layout: `WeightWriter.destination`) is read with preadv(2) straight into its destination: the kernel
copies it out of the page cache, and none of its pages is ever mapped (a mapped copy also pays a fault per
mapped page and the release of the mapping). They are read in the caller's thread: a reader thread running
ahead of the validation (tried) cost more CPU than it overlapped on the shared 2-core development VM (a warm
large load ~0.5-1 s more CPU, in paired runs against main). Every other tensor is a zero-copy view of the
memory-mapped file, which the loader converts from. safetensors' own reader keeps every page of a file
mapped until the file is closed (RSS would grow by a whole shard); here the mapped pages already read are
released from the process every few MiB (they stay in the page cache), so a load holds the resident model
plus about one tensor.

What a streamed tensor costs beyond its bytes, kept to a few microseconds: one `as_strided` of a per-dtype
view of the whole file (slicing and re-viewing the bytes took three tensor ops, ~10 us), and one `madvise`
per _RELEASE_BYTES instead of one per tensor (each call unmaps pages and flushes their TLB entries; with
the per-tensor calls, a copy-only replay of the small benchmark model's ~1000 tensors ran ~1.4x slower
warm). A cold file's pages are faulted into the page cache ahead of the loader by `readahead()`
(`weights/readahead.py`: from a thread, from before the model build on; by faults, which the kernel reads
into large folios, where WILLNEED hints left 4 KiB pages that slowed every later read of the file ~3x).
"""

import contextlib
import ctypes
import functools
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from dsv4.errors import CheckpointError
from dsv4.weights.collection import collection_paused
from dsv4.weights.readahead import Readahead
from dsv4.weights.work_split import cut_points, part_count, run_parts

INDEX_FILE = "model.safetensors.index.json"
_HEADER_LEN_BYTES = 8  # safetensors: little-endian u64 header size, then the JSON header
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# safetensors dtype strings -> torch dtypes (the format stores raw little-endian elements).
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}
# Mapped pages already streamed are released from the process in whole 2 MiB stretches, once one has been
# read past: the kernel maps a cached file's large folios with 2 MiB page-table entries, and releasing part
# of one splits it into 512 small entries first (a release per tensor split ~500 of them per large load).
# It bounds the RSS a load holds beyond its current tensor to about two of them, in few system calls.
_RELEASE_BYTES = 2 * 1024 * 1024
# Placed tensors back to back in a file are read by one preadv(2) of at most this many buffers (the system's
# limit on one call's) or, once past this many bytes, the next tensor starts a new read (reads of the
# baseline's size: the progress bar moves, the cold read-ahead is the same).
_RUN_TENSORS = os.sysconf("SC_IOV_MAX")
_RUN_BYTES = 64 * 1024 * 1024
# A run split across threads (`work_split.py`) is cut at page boundaries of the file: each part's read starts
# where the page cache's pages do.
_READ_PART_ALIGN = mmap.PAGESIZE
_F4_MESSAGE = ("{path}: tensor {name} is stored as F4 (float4_e2m1fn_x2), which safetensors cannot slice; store FP4 "
               "experts as I8 packed bytes (two e2m1 codes per byte) as DeepSeek's releases do")
# (name, dtype, shape) -> the tensor a checkpoint tensor's bytes may be read straight into, or None.
Destination = Callable[[str, torch.dtype, tuple[int, ...]], torch.Tensor | None]


class TensorInfo(NamedTuple):
    """One tensor of a safetensors header (immutable; a named tuple: a header parses into thousands of them,
    and a frozen dataclass cost ~1.5 us more each to build)."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    file: Path
    offset: int = 0  # where its bytes start in the file
    nbytes: int = 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header without reading tensor data (a header parses into ~3
    containers per tensor: `collection.py`)."""
    with collection_paused():
        return _parse_header(path)


def _parse_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw_len = f.read(_HEADER_LEN_BYTES)
            if len(raw_len) < _HEADER_LEN_BYTES:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(size, _MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: corrupt safetensors header length {header_len}")
            header = json.loads(f.read(header_len))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    data_start = _HEADER_LEN_BYTES + header_len
    data_len = size - data_start
    infos = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        itemsize = DTYPE_BYTES.get(dtype)
        if itemsize is None:
            raise CheckpointError(_F4_MESSAGE.format(path=path, name=name) if dtype == "F4" else
                                  f"{path}: tensor {name} has unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * itemsize or end > data_len or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name} data [{begin}, {end}) does not fit its shape {list(shape)} {dtype} "
                f"or the file ({data_len} data bytes): truncated or corrupt"
            )
        infos[name] = TensorInfo(name, dtype, shape, path, data_start + begin, end - begin)
    return infos


class CheckpointDir:
    """The safetensors files of a checkpoint directory and the tensors they hold."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            problem = "is a file, not a checkpoint directory" if self.path.exists() else "no such directory"
            raise CheckpointError(f"{self.path}: {problem}")
        self.files = self._files()
        self.tensors: dict[str, TensorInfo] = {}
        self._in_file_order: dict[Path, list[TensorInfo]] | None = None  # `_wanted_by_file(None)`, once built
        for file in self.files:
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise CheckpointError(f"{file}: tensor {name} also appears in {self.tensors[name].file}")
                self.tensors[name] = info
        self._check_index()

    def _files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: invalid index ({exc})") from None
            files = sorted({self.path / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.path}: no *.safetensors files (dsv4 loads safetensors only); to run this config with "
                f'seeded dummy weights, load it with load_format="dummy" (--load-format dummy on the command line)'
            )
        return files

    def _check_index(self) -> None:
        index = self.path / INDEX_FILE
        if not index.exists():
            return
        weight_map = json.loads(index.read_text())["weight_map"]
        for name, file in weight_map.items():
            info = self.tensors.get(name)
            if info is None or info.file.name != file:
                raise CheckpointError(f"{index}: tensor {name} is listed in {file} but not found there")

    def _wanted_by_file(self, wanted: Callable[[str], bool] | None) -> dict[Path, list[TensorInfo]]:
        """The wanted tensors of each file (None: all of them, ordered once per checkpoint), in file order."""
        if self._in_file_order is None:
            by_file: dict[Path, list[TensorInfo]] = {file: [] for file in self.files}
            for info in self.tensors.values():
                by_file[info.file].append(info)
            for infos in by_file.values():
                infos.sort(key=_file_offset)
            self._in_file_order = by_file
        if wanted is None:
            return self._in_file_order
        return {file: [info for info in infos if wanted(info.name)] for file, infos in self._in_file_order.items()}

    def readahead(self, wanted: Callable[[str], bool] | None = None) -> Readahead:
        """Disk reads of the wanted tensors' bytes, issued from now on ahead of `iter_tensors` (given it as
        `readahead`): a context manager that stops them (`weights/readahead.py`)."""
        extents: list[tuple[Path, int, int]] = []
        for file, infos in self._wanted_by_file(wanted).items():
            start = end = -1
            for info in infos:  # back-to-back tensors coalesced: other ranks' bytes are never asked for
                if info.offset == end:
                    end += info.nbytes
                    continue
                if end > start:
                    extents.append((file, start, end))
                start, end = info.offset, info.offset + info.nbytes
            if end > start:
                extents.append((file, start, end))
        return Readahead(extents)

    def iter_tensors(
        self, wanted: Callable[[str], bool] | None = None, destination: Destination | None = None,
        readahead: Readahead | None = None,
    ) -> Iterator[tuple[str, torch.Tensor, str]]:
        """Yield (name, tensor, file) one tensor at a time, file by file, in file order.

        Each tensor is a read-only-by-contract view of the mapped file: copy out of it, never write into
        it. Its pages leave the process within _RELEASE_BYTES of the iterator moving past it; a view kept
        longer still reads the right bytes (they fault back in from the file).

        Args:
            wanted: which names to read (the others' bytes are never touched); None: every tensor.
            destination: where a tensor's bytes may go as they are, given (name, dtype, shape): a contiguous
                tensor of that dtype and shape, or None. A tensor given one is read from the file straight
                into it (one kernel copy out of the page cache: no mapping of its pages, no copy out of a
                view) and yielded as that tensor.

            readahead: the `readahead(wanted)` of the same `wanted`, told how far the stream has got.

        Raises:
            CheckpointError: a read failed, or the file ends inside a tensor's data (naming both).
        """
        for file, infos in self._wanted_by_file(wanted).items():
            for info, tensor in _stream(file, infos, destination, readahead):
                yield info.name, tensor, str(file)


def _file_offset(info: TensorInfo) -> int:
    return info.offset


def map_file(path: Path) -> mmap.mmap | None:
    """The one place tensor data is opened: a private, never-written mapping of the whole file (None when
    the file is empty). Private (copy-on-write) rather than read-only because torch wraps writable buffers."""
    try:
        with path.open("rb") as f:
            if path.stat().st_size == 0:
                return None
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read tensors ({exc})") from None


def _stream(
    file: Path, infos: list[TensorInfo], destination: Destination | None, readahead: Readahead | None
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    mapping = map_file(file) if infos else None
    if mapping is None:
        for info in infos:
            yield info, torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])
        return
    views = _FileViews(mapping)
    with _open_for_reads(file) as fd:
        yield from _streamed(file, fd, mapping, views, infos, destination, readahead)


@contextlib.contextmanager
def _open_for_reads(file: Path) -> Iterator[int]:
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read tensors ({exc})") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _streamed(
    file: Path, fd: int, mapping: mmap.mmap, views: "_FileViews", infos: list[TensorInfo],
    destination: Destination | None, readahead: Readahead | None,
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    released_to = 0  # the mapping's pages below this offset are not held by the process
    run: list[tuple[TensorInfo, torch.Tensor]] = []  # placed tensors that follow each other in the file, unread
    run_end = run_bytes = 0
    for info in infos:
        dest = None if destination is None or info.nbytes == 0 else destination(
            info.name, TORCH_DTYPES[info.dtype], info.shape)
        if dest is not None and run and info.offset == run_end and len(run) < _RUN_TENSORS and run_bytes < _RUN_BYTES:
            run.append((info, dest))
            run_end += info.nbytes
            run_bytes += info.nbytes
            continue
        if run:
            yield from _read_run(file, fd, run, run_end)
            released_to = _consumed(mapping, released_to, run_end, run_bytes, readahead)
            run = []
        if dest is not None:
            run = [(info, dest)]
            run_end = info.offset + info.nbytes
            run_bytes = info.nbytes
            continue
        yield info, views.tensor(info)
        released_to = _consumed(mapping, released_to, info.offset + info.nbytes, info.nbytes, readahead)
    if run:
        yield from _read_run(file, fd, run, run_end)
        if readahead is not None:
            readahead.advance(run_bytes)
    if len(mapping) > released_to:
        mapping.madvise(mmap.MADV_DONTNEED, released_to, len(mapping) - released_to)


def _consumed(mapping: mmap.mmap, released_to: int, read_to: int, nbytes: int, readahead: Readahead | None) -> int:
    """The stream moved past `nbytes` more tensor bytes, up to `read_to`: tell the readahead, and release the
    mapping's whole _RELEASE_BYTES stretches below `read_to` not released yet; the new floor."""
    if readahead is not None:
        readahead.advance(nbytes)
    release_to = _release_floor(read_to)
    if release_to <= released_to:
        return released_to
    mapping.madvise(mmap.MADV_DONTNEED, released_to, release_to - released_to)
    return release_to


def _read_run(
    file: Path, fd: int, run: list[tuple[TensorInfo, torch.Tensor]], end: int
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """Read placed tensors lying back to back in the file [run[0].offset, end) with one preadv(2) that scatters
    them into their destinations, then yield them. A short or failed read is redone tensor by tensor from the
    first one it left incomplete (which names the tensor at fault)."""
    start = run[0][0].offset
    buffers = [_writable_bytes(info, dest) for info, dest in run]
    bounds = cut_points(end - start, part_count(end - start), _READ_PART_ALIGN)
    if len(bounds) == 2:
        gaps = _read_part(fd, buffers, start, 0, end - start)
    else:  # large runs: a part per core, each one preadv(2) of its byte range
        gaps = [gap for part in run_parts(functools.partial(_read_part, fd, buffers, start), bounds) for gap in part]
    for info, dest in run:
        if any(info.offset < gap_end and gap_start < info.offset + info.nbytes for gap_start, gap_end in gaps):
            _read_into(file, fd, info, dest)
    yield from run


def _read_part(fd: int, buffers: list[ctypes.Array], start: int, first: int, stop: int) -> list[tuple[int, int]]:
    """One preadv(2) of bytes [first, stop) of a run starting at file offset `start` and scattered into
    `buffers` (back to back); the file range it left unread ([] when none: a short or failed read leaves it
    to the caller)."""
    views, skip, wanted = [], first, stop - first
    for buffer in buffers:
        size = len(buffer)
        if skip >= size:
            skip -= size
            continue
        if wanted <= 0:
            break
        take = min(size - skip, wanted)
        views.append(buffer if skip == 0 and take == size else memoryview(buffer).cast("B")[skip:skip + take])
        skip, wanted = 0, wanted - take
    try:
        done = first + os.preadv(fd, views, start + first)
    except OSError:
        done = first
    return [] if done >= stop else [(start + done, start + stop)]


def _writable_bytes(info: TensorInfo, dest: torch.Tensor) -> ctypes.Array:
    """A buffer over `dest`'s memory (no copy; dest outlives the read), the cheapest one to build (~1 us: a
    ctypes array of the tensor's bytes, which preadv(2) takes as it is; a memoryview cast of it cost ~2 us
    more, and ~25 us a tensor in loads whose readahead thread held the interpreter lock meanwhile)."""
    if dest.nbytes != info.nbytes or not dest.is_contiguous():
        raise ValueError(f"{info.name}: a destination of {dest.nbytes} bytes (contiguous: {dest.is_contiguous()}) "
                         f"cannot take its {info.nbytes} bytes")
    return (ctypes.c_char * info.nbytes).from_address(dest.data_ptr())


def _read_into(file: Path, fd: int, info: TensorInfo, dest: torch.Tensor) -> None:
    """The tensor's bytes from the file into `dest` (contiguous, info.nbytes long) with preadv(2): the kernel
    copies them out of the page cache (reading them in first when cold), a short read is continued."""
    buffer = memoryview(_writable_bytes(info, dest)).cast("B")  # sliceable without a copy
    done = 0
    while done < info.nbytes:
        try:
            n = os.preadv(fd, [buffer[done:]], info.offset + done)
        except OSError as exc:
            raise CheckpointError(f"{file}: tensor {info.name}: read failed ({exc})") from None
        if n == 0:
            raise CheckpointError(f"{file}: tensor {info.name}: the file ends inside its data (truncated)")
        done += n


def _release_floor(offset: int) -> int:
    return offset - offset % _RELEASE_BYTES


class _FileViews:
    """Tensors viewing a mapped file: one whole-file view per dtype (the mapping starts page-aligned, so each
    is aligned), and each tensor one `as_strided` of it."""

    def __init__(self, mapping: mmap.mmap):
        self._bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        dtype = TORCH_DTYPES[info.dtype]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        size = dtype.itemsize
        if info.offset % size:
            # safetensors does not align data; torch kernels expect aligned elements
            raw = self._bytes[info.offset : info.offset + info.nbytes].clone()
            return raw.view(dtype).view(info.shape)
        typed = self._typed.get(dtype)
        if typed is None:
            whole = self._bytes[: len(self._bytes) - len(self._bytes) % size]
            typed = self._typed[dtype] = whole.view(dtype)
        return typed.as_strided(info.shape, _contiguous_strides(info.shape), info.offset // size)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of `shape`."""
    if len(shape) <= 1:
        return (1,) * len(shape)
    if len(shape) == 2:
        return (shape[1], 1)
    strides = [1] * len(shape)
    for d in range(len(shape) - 1, 0, -1):
        strides[d - 1] = strides[d] * shape[d]
    return tuple(strides)
