"""Row-major [out, in] values -> an input-major resident weight, at about the cost of a copy.

Resident dense weights are stored input-major: the parameter is the transposed view of a contiguous
[in, out] buffer. Checkpoints and trainers hold them row-major, so every load and refit of such a weight is
a transposing copy, and torch's strided copy of a whole transposed matrix runs ~10-20x a memcpy on CPU (its
inner loop strides through the source a row apart). The C kernels here (`layout_copy_cpu.c`, compiled for
this CPU) transpose 8x8 blocks in AVX2 registers, panel by panel so that the source lines a panel shares
stay in cache, converting bf16 <-> fp32 (torch's round-to-nearest-even) in the same pass; without AVX2 (and
on the ragged edges) they copy tile by tile through an L1 buffer. FP8 e4m3 codes are dequantized times
their block scales (fp32 values or ue8m0 bytes; torch's fp32 product, one rounding) and checked for NaN
codes in the same pass: with AVX2 eight codes a step into a row-major band that the register-block
transposes then place, else through the tiled walk. A load of an FP8 linear into an fp32 or bf16 weight
reads each code once and writes each value once.

Stores stream (non-temporal: whole lines to memory, none read into the cache first) into fp32 destinations
too large for the cache, or wherever the caller says nothing reads the destination soon (`stream=True`: a
refit's staging buffers and its commit, whose lines are evicted by the rest of the update before anything
reads them; a cached store first reads every destination line, three memory transfers per line for two).

Each function returns False when it does not apply (another device, layout or dtype pair, or no C
compiler on this machine): the caller then takes torch's path, which gives the same bytes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

import dsv4.kernels
from dsv4.kernels.c_library import NATIVE, compile_library, cpu_features
from dsv4.weights.work_split import cut_points, part_count, run_parts

SOURCE = Path(__file__).with_name("layout_copy_cpu.c")
# The kernels' shared header (bf16 conversions), in the kernels package.
HEADER = Path(dsv4.kernels.__file__).with_name("bf16.h")
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
# (source dtype, destination dtype) -> the kernels' suffix (transpose_*, copy_*); same-size pairs copy the
# raw elements.
_PAIRS = {
    (torch.float32, torch.float32): "b32",
    (torch.bfloat16, torch.bfloat16): "b16",
    (torch.float16, torch.float16): "b16",
    (torch.bfloat16, torch.float32): "bf16_f32",
    (torch.float32, torch.bfloat16): "f32_bf16",
}
# The exponent field of each destination format: a value with all of its bits set is an infinity or a NaN.
_EXPONENT_MASKS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_NO_CHECK = 0
_DEQUANT_FP8 = {torch.float32: "dequant_fp8_f32", torch.bfloat16: "dequant_fp8_bf16"}
# Transposes into fp32 destinations of at least this share of the last-level cache use streaming stores
# (layout_copy_cpu.c, `stream`): measured faster from half the cache up, slower at a quarter and below.
STREAM_CACHE_SHARE = 0.5
_STREAMED_ITEMSIZE = 4
# Copies split across threads (`work_split.py`) are cut at multiples of these many rows / elements: every
# part's first destination address then keeps the 32-byte alignment streaming stores need.
_PART_ROWS = 64
_PART_ELEMENTS = 64


# vector_isa() of a library whose transposes move 8x8 blocks through AVX2 registers (0: the tiled scalar walk).
VECTOR_ISAS = {256: "AVX2 8x8 blocks", 0: "tiled scalar"}


def build_library(march: str = NATIVE) -> ctypes.CDLL:
    """Compile layout_copy_cpu.c for `march` (cached per source, flags and CPU) and load it.

    Args:
        march: the compiler's -march target ("native": this CPU; the tests build an older one to run the
            scalar path).

    Raises:
        RuntimeError: no C compiler, or the compilation failed. OSError: the library could not be loaded.
    """
    # The header's text joins the cache key: compile_library only keys headers beside the source.
    lib = compile_library(SOURCE, (f"-I{HEADER.parent}", f"-march={march}"), HEADER.read_text() + cpu_features())
    lib.vector_isa.restype = ctypes.c_int
    lib.vector_isa.argtypes = []
    for suffix in set(_PAIRS.values()):
        transpose, copy = getattr(lib, f"transpose_{suffix}"), getattr(lib, f"copy_{suffix}")
        transpose.restype = copy.restype = ctypes.c_int
        transpose.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_int, ctypes.c_uint32]
        copy.argtypes = [_PTR, _PTR, _I64, ctypes.c_uint32, ctypes.c_int]
    lib.copy_many_streamed.restype = None
    lib.copy_many_streamed.argtypes = [_PTR, _PTR, _PTR, _I64]
    for name in _DEQUANT_FP8.values():
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_PTR, _PTR, ctypes.c_int, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64]
    return lib


_CACHE_INFO = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


@functools.cache
def stream_bytes() -> int | None:
    """The smallest fp32 destination the transposes stream into: a share of the largest cache this CPU's
    first core reaches (sysfs: the C library's figure can be a whole socket's), None where unknown."""
    largest = 0
    for size in _CACHE_INFO.glob("index*/size"):
        try:
            text = size.read_text().strip()
        except OSError:
            continue
        scale = _SIZE_UNITS.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in _SIZE_UNITS else text
        if digits.isdigit():
            largest = max(largest, int(digits) * scale)
    return int(largest * STREAM_CACHE_SHARE) if largest else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernels compiled for this CPU, or None where no C compiler works (built once per process)."""
    try:
        return build_library()
    except (RuntimeError, OSError):
        return None


def input_major(dest: torch.Tensor) -> bool:
    """Whether `dest` is a CPU matrix stored input-major: the transpose of a contiguous buffer."""
    return (dest.device.type == "cpu" and dest.dim() == 2 and dest.stride(0) == 1
            and dest.stride(1) == max(1, dest.shape[0]) and dest.shape[0] > 1 and dest.shape[1] > 1)


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """The same elements as a contiguous view when `t` is a permuted contiguous tensor (an input-major
    weight), so that reductions and copies over it stream memory instead of striding through it; else `t`."""
    if t.is_contiguous():
        return t
    permuted = t.permute(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return permuted if permuted.is_contiguous() else t


def _streams(dest: torch.Tensor, stream: bool | None) -> bool:
    """Whether a copy into `dest` uses streaming stores: the caller's word, else (None) the size rule."""
    if stream is not None:
        return stream
    threshold = stream_bytes()
    return dest.element_size() == _STREAMED_ITEMSIZE and threshold is not None and dest.nbytes >= threshold


def _transpose(dest: torch.Tensor, value: torch.Tensor, lib: ctypes.CDLL | None, mask: int,
               stream: bool | None) -> bool | None:
    """Run the transposing kernel: None where it does not apply (nothing written), else whether a written
    value has every bit of `mask` set."""
    suffix = _PAIRS.get((value.dtype, dest.dtype))
    if (suffix is None or not input_major(dest) or value.device.type != "cpu" or not value.is_contiguous()
            or value.shape != dest.shape):
        return None
    lib = _library() if lib is None else lib
    if lib is None:
        return None
    rows, cols = value.shape
    kernel = getattr(lib, f"transpose_{suffix}")
    streams, src, dst = _streams(dest, stream), value.data_ptr(), dest.data_ptr()
    src_row, dst_row = cols * value.element_size(), dest.element_size()  # a source row's step in each

    def rows_range(first: int, stop: int) -> bool:
        return bool(kernel(src + first * src_row, dst + first * dst_row, stop - first, cols, cols, dest.stride(1),
                           streams, mask))

    return any(run_parts(rows_range, cut_points(rows, part_count(dest.nbytes), _PART_ROWS)))


def laid_out_alike(dest: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether two CPU tensors have the same shape and strides, dense in memory order: a straight copy
    between them is one run of elements."""
    return (dest.device.type == "cpu" and value.device.type == "cpu" and value.shape == dest.shape
            and value.stride() == dest.stride() and in_memory_order(dest).is_contiguous())


def _straight(dest: torch.Tensor, value: torch.Tensor, lib: ctypes.CDLL | None, mask: int,
              stream: bool | None) -> bool | None:
    """The straight kernel for two tensors laid out alike."""
    suffix = _PAIRS.get((value.dtype, dest.dtype))
    if suffix is None or not laid_out_alike(dest, value):
        return None
    lib = _library() if lib is None else lib
    if lib is None:
        return None
    kernel = getattr(lib, f"copy_{suffix}")
    streams, src, dst = _streams(dest, stream), value.data_ptr(), dest.data_ptr()
    src_size, dst_size = value.element_size(), dest.element_size()

    def elements(first: int, stop: int) -> bool:
        return bool(kernel(src + first * src_size, dst + first * dst_size, stop - first, mask, streams))

    return any(run_parts(elements, cut_points(dest.numel(), part_count(dest.nbytes), _PART_ELEMENTS)))


def transpose_into(dest: torch.Tensor, value: torch.Tensor, lib: ctypes.CDLL | None = None, *,
                   stream: bool | None = None) -> bool:
    """dest[...] = value for an input-major `dest` and a row-major contiguous `value` of the same shape.

    Args:
        lib: the kernels to use (default: those built for this CPU).
        stream: streaming stores (True: nothing reads `dest` soon), cached ones (False), or the size rule
            (None: fp32 destinations of at least `stream_bytes()`).

    Returns:
        Whether it was done (False: not this layout or dtype pair, or no compiler; nothing written).
    """
    return _transpose(dest, value, lib, _NO_CHECK, stream) is not None


def copy_checking_finite(dest: torch.Tensor, value: torch.Tensor, lib: ctypes.CDLL | None = None, *,
                         stream: bool | None = None) -> bool | None:
    """dest[...] = value (a transposing copy into an input-major `dest`, or a straight one between tensors
    laid out alike), checking in the same pass that every value written is finite: one read of `value`.

    `dest` is written before the answer is known, so this is for a destination nothing reads yet (an atomic
    update's staging buffer).

    Args:
        lib: the kernels to use (default: those built for this CPU).
        stream: as `transpose_into` (a straight copy streams only between equal dtypes).

    Returns:
        None where no kernel applies (nothing written); else whether every value written is finite (an
        infinity or NaN in `value`, or an fp32 value beyond bf16's range rounded to infinity, is not).
    """
    mask = _EXPONENT_MASKS.get(dest.dtype)
    if mask is None:
        return None
    seen = _transpose(dest, value, lib, mask, stream)
    if seen is None:
        seen = _straight(dest, value, lib, mask, stream)
    return None if seen is None else not seen


def copy_bytes_streamed(copies: Sequence[tuple[int, int, int]], lib: ctypes.CDLL | None = None) -> bool:
    """Raw copies of CPU memory, (source address, destination address, bytes) each, with streaming stores,
    in one call: for destinations nothing reads soon (a refit's commit of its staging buffers). The caller
    vouches for the addresses (each a tensor laid out like its source: `laid_out_alike`).

    Args:
        copies: the copies; their regions must not overlap.
        lib: the kernels to use (default: those built for this CPU).

    Returns:
        Whether they were done (False: no compiler; nothing written).
    """
    lib = _library() if lib is None else lib
    if lib is None:
        return False
    count = len(copies)
    if count:
        columns = [(_I64 * count)(*column) for column in zip(*copies, strict=True)]
        lib.copy_many_streamed(*columns, count)
    return True


@functools.cache
def _e4m3_values() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3fn codes (torch's own decoding of each)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def dequantize_fp8_into(dest: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int]) -> bool | None:
    """dest[i, j] = table[codes[i, j]] * scale[i // block[0], j // block[1]] for an input-major `dest`, checking
    in the same pass whether any code is an e4m3fn NaN code (one read of the codes).

    Args:
        dest: the input-major fp32 / bf16 weight [out, in].
        codes: float8_e4m3fn [out, in], contiguous.
        scale: the block scales [ceil(out / b0), ceil(in / b1)], contiguous: float32 values, or ue8m0 bytes
            (uint8, decoded in the kernel; the NaN byte already refused).
        block: (b0, b1).

    Returns:
        None where it does not apply (nothing written); else whether a code was a NaN code (every value is
        written all the same: a caller that has not checked the codes first must discard `dest` then).
    """
    kernel = _DEQUANT_FP8.get(dest.dtype)
    e8m0 = scale.dtype == torch.uint8
    if (kernel is None or not input_major(dest) or codes.device.type != "cpu" or not codes.is_contiguous()
            or scale.dtype not in (torch.float32, torch.uint8) or not scale.is_contiguous()):
        return None
    lib = _library()
    if lib is None:
        return None
    rows, cols = codes.shape
    run, lut, src, scales, dst = getattr(lib, kernel), _e4m3_values().data_ptr(), codes.data_ptr(), \
        scale.data_ptr(), dest.data_ptr()
    scale_row = scale.shape[1] * scale.element_size()  # one block row of scales

    def rows_range(first: int, stop: int) -> bool:  # `first` starts a block row
        return bool(run(src + first * cols, scales + first // block[0] * scale_row, e8m0, lut,
                        dst + first * dest.element_size(), stop - first, cols, block[0], block[1], scale.shape[1],
                        dest.stride(1)))

    return any(run_parts(rows_range, cut_points(rows, part_count(dest.nbytes), block[0])))
