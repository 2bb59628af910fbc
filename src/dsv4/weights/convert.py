"""Incoming tensor (any supported dtype/layout) -> the resident tensor's layout and dtype, validated.

Incoming forms:
  float      fp32 / bf16 / fp16 values in the logical [out, in] layout
  fp8        float8_e4m3fn + its block `.scale` (fp32, or ue8m0 as float8_e8m0fnu / uint8)
  fp4        int8 / uint8 packed e2m1 [out, in/2] + ue8m0 `.scale` [out, in/group]
Resident forms: a float parameter (model dtype or fp32), an int32 table, or stacked experts in the
dense / fp8 / fp4 layout. ue8m0 bytes are only ever reinterpreted (`.view(uint8)`), never cast.

Every check reads its tensor at most once, in memory order, and allocates nothing the size of it:
finiteness is one sum (a NaN or infinity anywhere makes the sum non-finite; a finite sum proves every
value finite, and only a non-finite one is looked at element by element, which also tells a real NaN from
an overflowing sum of large values); FP8 NaN codes are integer max reductions over the raw bytes, and ue8m0
NaN bytes a memchr (a max reduction off the CPU). Counting the bad values (for the message) runs only once a
check has failed.

Nothing here enters `torch.no_grad()` per tensor (that costs more than copying a small tensor): resident
parameters never require grad and the writer detaches incoming tensors that do, so autograd records nothing.
"""

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4.quant import (
    E2M1_MAX,
    E4M3_MAX,
    E8M0_BIAS,
    E8M0_NAN_BYTE,
    as_e8m0_bytes,
    dequantize_fp4,
    dequantize_fp8_blockwise,
    e8m0_to_float32,
    fp8_scale_grid_shape,
    quantize_fp4,
    quantize_fp8_blockwise,
)
from dsv4.weights.layout_copy import copy_checking_finite, dequantize_fp8_into, in_memory_order, transpose_into

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
PACKED_DTYPES = (torch.int8, torch.uint8)
E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.int8)
E4M3 = torch.float8_e4m3fn
# e4m3fn has no infinity; its NaN codes are S.1111.111: 0x7F (127 as int8) and 0xFF (255 as uint8), which are
# exactly the maxima of the two integer views of the bytes.
_E4M3_NAN_INT8 = 0x7F
_E4M3_NAN_UINT8 = 0xFF
# Transposing copies (row-major [out, in] into an input-major resident weight) run tile by tile: each tile
# writes runs of _TILE_ROWS contiguous elements while its _TILE_ROWS source rows stay in L1, and the source
# tile (_TILE_ROWS x _TILE_COLS fp32 = 256 KiB) stays in L2. torch's own copy of a whole transposed matrix
# strides through memory (~10x a memcpy on this CPU, its blocked-transpose kernel ~4-8x); tiles measured
# ~3x, and convert dtypes in the same pass.
_TILE_ROWS = 64
_TILE_COLS = 1024


class ConversionError(ValueError):
    """Raised with a message that the loader prefixes with the tensor name and its origin."""


@dataclass(frozen=True)
class QuantLayout:
    fp8_block: tuple[int, int]
    fp4_group: int
    scale_fmt: str  # rounding rule used when quantizing float input on the fly


# ---- checks (one read pass each, nothing allocated the size of the tensor) ----
def check_shape(got: torch.Size, want: tuple[int, ...], what: str) -> None:
    if tuple(got) != tuple(want):
        raise ConversionError(f"{what} shape {tuple(got)} does not match the model's {tuple(want)}")


def check_finite(t: torch.Tensor) -> None:
    """Raise unless every value of a float tensor is finite (one sum; see the module docstring)."""
    if t.numel() == 0 or math.isfinite(in_memory_order(t).sum().item()):
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ConversionError(f"contains {bad} non-finite value(s)")


def copy_finite_into(dest: torch.Tensor, value: torch.Tensor, *, stream: bool | None = None) -> None:
    """dest[...] = value (as `copy_into`), raising unless every value is finite, for a destination nothing
    reads yet (a staging buffer): where a kernel applies the values are checked as they are copied, one read
    of `value` for both (`layout_copy.copy_checking_finite`, whose `stream` this passes on); elsewhere
    checked first, then copied."""
    finite = copy_checking_finite(dest, value, stream=stream)
    if finite is None:
        check_finite(value)
        copy_into(dest, value)
    elif not finite:
        raise ConversionError(f"contains {int((~torch.isfinite(dest)).sum())} non-finite value(s)")


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scale -> its uint8 bytes (a view; uint8 bytes themselves: a load checks thousands of scales, and
    a view costs ~0.4 us), refusing other dtypes and the NaN byte 0xFF."""
    dtype = scale.dtype
    if dtype not in E8M0_DTYPES:
        raise ConversionError(f"ue8m0 scale must be float8_e8m0fnu or uint8 bytes, got {dtype}")
    raw = scale if dtype == torch.uint8 else as_e8m0_bytes(scale)
    if raw.numel() and _holds_nan_byte(raw):
        raise ConversionError("ue8m0 scale holds the NaN byte 0xFF")
    return raw


@functools.cache
def _memchr() -> Callable[[int, int, int], int | None]:
    memchr = ctypes.CDLL(None).memchr
    memchr.restype = ctypes.c_void_p
    memchr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return memchr


def _holds_nan_byte(raw: torch.Tensor) -> bool:
    """Whether uint8 `raw` holds the e8m0 NaN byte. Contiguous CPU bytes are scanned by libc's memchr
    (vectorized, with no torch dispatch: ~2 us against ~5-12 us for a reduction of a 16 KiB expert scale, and
    a load checks thousands); elsewhere a max reduction (0xFF is the largest byte)."""
    if raw.is_cpu and raw.is_contiguous():  # is_cpu: no device object built (~0.2 us a scale)
        return _memchr()(raw.data_ptr(), E8M0_NAN_BYTE, raw.numel()) is not None
    return int(raw.max()) == E8M0_NAN_BYTE


def check_fp8_codes(weight: torch.Tensor) -> None:
    """Raise if an e4m3fn tensor holds a NaN code (two integer max reductions over its bytes)."""
    if weight.numel() == 0:
        return
    if int(weight.view(torch.int8).max()) == _E4M3_NAN_INT8 or int(weight.view(torch.uint8).max()) == _E4M3_NAN_UINT8:
        raise _fp8_nan_codes(weight)


def _fp8_nan_codes(weight: torch.Tensor) -> ConversionError:
    """The error of an e4m3fn tensor known to hold NaN codes, counting them."""
    return ConversionError(f"fp8 weight holds {int(torch.isnan(weight.float()).sum())} NaN code(s) "
                           f"(non-finite values)")


def check_expert_table(table: torch.Tensor, n_experts: int) -> None:
    """A hash-routing table row must name k distinct experts in [0, n_experts)."""
    if table.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(table))
    if low < 0 or high >= n_experts:
        raise ConversionError(f"expert ids must lie in [0, {n_experts}), found values in [{low}, {high}]")
    repeated = (table.sort(dim=-1).values.diff(dim=-1) == 0).any(dim=-1)
    if bool(repeated.any()):
        row = int(repeated.nonzero()[0, 0])
        raise ConversionError(f"row {row} repeats an expert id ({table[row].tolist()}); each row needs distinct ids")


def _check_products_finite(scale_max: float, value_max: float, dtype: torch.dtype) -> None:
    """A dequantized value is at most value_max * scale_max: bound it instead of scanning the product."""
    if not value_max * scale_max <= torch.finfo(dtype).max:
        raise ConversionError(f"scale up to {scale_max:g} times codes up to {value_max:g} overflows {dtype}: "
                              f"the dequantized values would hold non-finite values")


# ---- in-place copy ----
def copy_into(dest: torch.Tensor, value: torch.Tensor) -> None:
    """dest[...] = value in dest's storage, converting dtype; dest's address never changes.

    Resident dense weights are stored input-major (dest is the transposed view of a contiguous [in, out]
    buffer) while trainers and checkpoints send row-major [out, in]: that copy goes through the tiled C
    kernel (`layout_copy`), or where it does not apply, torch's copy tile by tile."""
    if dest.is_contiguous() or value.dim() != 2 or dest.stride() != (1, dest.shape[0]) or not value.is_contiguous():
        dest.copy_(value)
        return
    if transpose_into(dest, value):
        return
    rows, cols = dest.shape
    for r in range(0, rows, _TILE_ROWS):
        for c in range(0, cols, _TILE_COLS):
            dest[r : r + _TILE_ROWS, c : c + _TILE_COLS].copy_(value[r : r + _TILE_ROWS, c : c + _TILE_COLS])


# ---- conversions ----
def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, layout: QuantLayout, logical: tuple[int, int], dtype: torch.dtype,
    out: torch.Tensor | None = None, *, check_as_written: bool = False,
) -> torch.Tensor:
    """An FP8 (e4m3 + block scale) or FP4 (packed + ue8m0) weight -> validated values [out, in] of `dtype`.

    Args:
        out: where to write the values (of `dtype`; returned): every check passes before its first byte is
            written, unless `check_as_written`. An FP8 weight goes into an input-major `out` in one pass
            (`layout_copy`).
        check_as_written: nothing reads `out` before this returns and a failure discards it (a fresh load's
            weight, a staging buffer): an FP8 weight's codes are then checked inside the pass that writes
            them (one read of the codes, not three).
    """
    if weight.dtype == E4M3:
        check_shape(weight.shape, logical, "fp8 weight")
        fused = check_as_written and out is not None
        if not fused:
            check_fp8_codes(weight)
        if scale.dtype in FLOAT_DTYPES:
            check_finite(scale)
            scale_max = float(scale.abs().max()) if scale.numel() else 0.0
        else:
            raw = e8m0_bytes(scale)
            scale_max = 2.0 ** (int(raw.max()) - E8M0_BIAS) if raw.numel() else 0.0
            scale = raw
        _check_products_finite(scale_max, E4M3_MAX, dtype)
        if out is not None:
            check_shape(scale.shape, fp8_scale_grid_shape(weight.shape, layout.fp8_block), "fp8 scale")
            # ue8m0 bytes are decoded inside the kernel (their decode here cost more than the kernel on small
            # linears); float scales go as fp32
            grid = (scale if scale.dtype == torch.uint8 else scale.to(torch.float32)).contiguous()
            nan_codes = dequantize_fp8_into(out, weight, grid, layout.fp8_block)
            if nan_codes:
                raise _fp8_nan_codes(weight)
            if nan_codes is not None:
                return out
            if fused:  # no kernel: checked before torch's path writes anything
                check_fp8_codes(weight)
        try:
            values = dequantize_fp8_blockwise(weight, scale, layout.fp8_block, dtype)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
        return values if out is None else _copied(out, values)
    if weight.dtype in PACKED_DTYPES:
        check_shape(weight.shape, (logical[0], logical[1] // 2), "packed fp4 weight")
        raw = e8m0_bytes(scale)
        scale_max = 2.0 ** (int(raw.max()) - E8M0_BIAS) if raw.numel() else 0.0
        _check_products_finite(scale_max, E2M1_MAX, dtype)
        try:
            values = dequantize_fp4(weight, raw, layout.fp4_group, dtype)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
        return values if out is None else _copied(out, values)
    raise ConversionError(f"unsupported weight dtype {weight.dtype}")


def _copied(dest: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    copy_into(dest, values)
    return dest


def quantize_expert(values: torch.Tensor, fmt: str, layout: QuantLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Float values [out, in] -> (weight, scale) in the resident FP8 (e4m3, fp32 scale) or FP4 (int8, ue8m0
    bytes) layout, with the checkpoint's rounding rule. The quantizer's own finiteness check is fused into
    its per-block maximum."""
    try:
        if fmt == "fp8":
            q, scale = quantize_fp8_blockwise(values, layout.fp8_block, layout.scale_fmt)
            return q, e8m0_to_float32(scale) if scale.dtype == torch.uint8 else scale
        packed, scale = quantize_fp4(values, layout.fp4_group)
        return packed, scale
    except ValueError as exc:
        raise ConversionError(str(exc)) from None


def fp8_scale_values(scale: torch.Tensor) -> torch.Tensor:
    """An incoming FP8 block scale, already validated (float values, or ue8m0 bytes) -> its values."""
    return scale if scale.dtype in FLOAT_DTYPES else e8m0_to_float32(as_e8m0_bytes(scale))
