"""Incoming tensor (any supported dtype/layout) -> the resident tensor's layout and dtype, validated.

Incoming forms:
  float      fp32 / bf16 / fp16 values in the logical [out, in] layout
  fp8        float8_e4m3fn + its block `.scale` (fp32, or ue8m0 as float8_e8m0fnu / uint8)
  fp4        int8 / uint8 packed e2m1 [out, in/2] + ue8m0 `.scale` [out, in/group]
Resident forms: a float parameter (model dtype or fp32), an int32 table, or stacked experts in the
dense / fp8 / fp4 layout. ue8m0 bytes are only ever reinterpreted (`.view(uint8)`), never cast.

Tensors on the meta device carry a shape and a dtype but no values: the checks that read values (finite,
NaN codes, ue8m0 bytes, expert-id tables) skip them, so converting meta tensors checks everything else
without reading data (`dsv4 inspect` stages a checkpoint's headers this way).
"""

from dataclasses import dataclass

import torch

from dsv4.config import DENSE, FP4, FP8
from dsv4.quant import (
    as_e8m0_bytes,
    dequantize_fp4,
    dequantize_fp8_blockwise,
    e8m0_to_float32,
    quantize_fp4,
    quantize_fp8_blockwise,
)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
PACKED_DTYPES = (torch.int8, torch.uint8)
E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.int8)
E4M3 = torch.float8_e4m3fn


class ConversionError(ValueError):
    """Raised with a message that the loader prefixes with the tensor name and its origin."""


@dataclass(frozen=True)
class QuantLayout:
    fp8_block: tuple[int, int]
    fp4_group: int
    scale_fmt: str  # rounding rule used when quantizing float input on the fly


def needs_scale(weight: torch.Tensor, is_expert: bool) -> bool:
    """Whether an incoming weight is only meaningful together with its `.scale` partner."""
    return weight.dtype == E4M3 or (is_expert and weight.dtype in PACKED_DTYPES)


def _check_shape(got: torch.Size, want: tuple[int, ...], what: str) -> None:
    if tuple(got) != tuple(want):
        raise ConversionError(f"{what} shape {tuple(got)} does not match the model's {tuple(want)}")


def _has_values(t: torch.Tensor) -> bool:
    return not t.is_meta


def _check_finite(t: torch.Tensor) -> None:
    if not _has_values(t):
        return
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ConversionError(f"contains {bad} non-finite value(s)")


def _check_e8m0(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype not in E8M0_DTYPES:
        raise ConversionError(f"ue8m0 scale must be float8_e8m0fnu or uint8 bytes, got {scale.dtype}")
    raw = as_e8m0_bytes(scale)
    if _has_values(raw) and bool((raw == 255).any()):
        raise ConversionError("ue8m0 scale holds the NaN byte 0xFF")
    return raw


def _dequantize(
    weight: torch.Tensor, scale: torch.Tensor | None, layout: QuantLayout, logical: tuple[int, int]
) -> torch.Tensor:
    """Any incoming form -> fp32 values [out, in], validated."""
    if weight.dtype in FLOAT_DTYPES:
        _check_shape(weight.shape, logical, "weight")
        _check_finite(weight)
        return weight.float()
    if scale is None:
        raise ConversionError(f"a {weight.dtype} weight needs its .scale tensor")
    if weight.dtype == E4M3:
        _check_shape(weight.shape, logical, "fp8 weight")
        if scale.dtype in FLOAT_DTYPES:
            _check_finite(scale)
        else:
            scale = _check_e8m0(scale)
        try:
            values = dequantize_fp8_blockwise(weight, scale, layout.fp8_block, torch.float32)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
    elif weight.dtype in PACKED_DTYPES:
        _check_shape(weight.shape, (logical[0], logical[1] // 2), "packed fp4 weight")
        try:
            values = dequantize_fp4(weight, _check_e8m0(scale), layout.fp4_group, torch.float32)
        except ValueError as exc:
            raise ConversionError(str(exc)) from None
    else:
        raise ConversionError(f"unsupported weight dtype {weight.dtype}")
    _check_finite(values)
    return values


def check_expert_table(table: torch.Tensor, n_experts: int) -> None:
    """A hash-routing table row must name k distinct experts in [0, n_experts)."""
    if table.numel() == 0 or not _has_values(table):
        return
    low, high = int(table.min()), int(table.max())
    if low < 0 or high >= n_experts:
        raise ConversionError(f"expert ids must lie in [0, {n_experts}), found values in [{low}, {high}]")
    repeated = (table.sort(dim=-1).values.diff(dim=-1) == 0).any(dim=-1)
    if bool(repeated.any()):
        row = int(repeated.nonzero()[0, 0])
        raise ConversionError(f"row {row} repeats an expert id ({table[row].tolist()}); each row needs distinct ids")


def to_plain(
    weight: torch.Tensor, scale: torch.Tensor | None, resident: torch.Tensor, layout: QuantLayout, n_experts: int
) -> torch.Tensor:
    """Value for a non-expert resident tensor (float parameter, or an expert-id table)."""
    if resident.dtype in INT_DTYPES:
        if weight.dtype not in INT_DTYPES or scale is not None:
            raise ConversionError(f"integer table expects int32/int64 values, got {weight.dtype}")
        _check_shape(weight.shape, tuple(resident.shape), "table")
        check_expert_table(weight, n_experts)
        return weight.to(resident.dtype)
    if weight.dtype in INT_DTYPES:
        raise ConversionError(f"expected floating values, got {weight.dtype}")
    if resident.dim() != 2 and weight.dtype not in FLOAT_DTYPES:
        raise ConversionError(f"a {weight.dtype} tensor cannot feed a {resident.dim()}-D parameter")
    if weight.dtype in FLOAT_DTYPES:
        _check_shape(weight.shape, tuple(resident.shape), "tensor")
        _check_finite(weight)
        return weight.to(resident.dtype)
    return _dequantize(weight, scale, layout, tuple(resident.shape)).to(resident.dtype)


def to_expert(
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    fmt: str,
    resident: torch.Tensor,
    resident_scale: torch.Tensor | None,
    layout: QuantLayout,
    logical: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, scale) for one expert matrix in the resident layout `fmt`. Native bytes of the same
    format are copied as raw bits; anything else goes through fp32 values and dsv4's quantizer."""
    if fmt == FP4 and weight.dtype in PACKED_DTYPES and scale is not None:
        _check_shape(weight.shape, tuple(resident.shape), "packed fp4 weight")
        raw_scale = _check_e8m0(scale)
        _check_shape(raw_scale.shape, tuple(resident_scale.shape), "fp4 scale")
        return weight.view(torch.int8), raw_scale
    if fmt == FP8 and weight.dtype == E4M3 and scale is not None:
        _check_shape(weight.shape, tuple(resident.shape), "fp8 weight")
        if scale.dtype in FLOAT_DTYPES:
            _check_finite(scale)
            scale32 = scale.float()
        else:
            scale32 = e8m0_to_float32(_check_e8m0(scale))
        _check_shape(scale32.shape, tuple(resident_scale.shape), "fp8 scale")
        if _has_values(weight) and bool(torch.isnan(weight.float()).any()):
            raise ConversionError("fp8 weight holds NaN codes")
        return weight, scale32
    values = _dequantize(weight, scale, layout, logical)
    if fmt == DENSE:
        return values.to(resident.dtype), None
    if fmt == FP8:
        q, s = quantize_fp8_blockwise(values, layout.fp8_block, layout.scale_fmt)
        return q, (e8m0_to_float32(s) if s.dtype == torch.uint8 else s.float())
    packed, s = quantize_fp4(values, layout.fp4_group)
    return packed.view(torch.int8), s
