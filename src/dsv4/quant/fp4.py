"""MXFP4-style e2m1 routed-expert weights (architecture notes, section 10.5).

A weight ``W`` [out, in] is stored as:
  * ``packed``: int8 [out, in / 2], two 4-bit codes per byte. The LOW nibble holds the even input index ``2j`` and the
    HIGH nibble holds ``2j + 1``.
  * ``scale``: e8m0 bytes [out, in / group] (``float8_e8m0fnu`` on disk, or uint8), one per ``group`` consecutive
    inputs of a row; ``group`` is 32 in DeepSeek-V4.

Dequantisation: ``W[i, k] = E2M1[code[i, k]] * 2^(scale[i, k // group] - 127)``.

E2M1 codes: bit 3 is the sign, bits 0-2 index the magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``.
"""

from __future__ import annotations

import torch

from .e8m0 import as_e8m0_bytes, e8m0_ceil_pow2, e8m0_to_float32

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP4_GROUP_SIZE",
    "dequantize_fp4",
    "pack_e2m1",
    "quantize_fp4",
    "unpack_e2m1",
]

# Code -> value. Codes 8..15 mirror 0..7 with the sign bit set (code 8 is -0.0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
E2M1_MAX = 6.0
# Inputs sharing one e8m0 scale (the OCP MX block size DeepSeek-V4 uses).
FP4_GROUP_SIZE = 32

_E2M1_NUM_CODES = 16
_E2M1_SIGN_BIT = 0x8
_E2M1_MAGNITUDE_CODES = 8
_NIBBLE_BITS = 4
_NIBBLE_MASK = 0x0F
_BYTE_VALUES = 256
# Elements quantized per step: the temporaries of one step (float32 values, int64 bucket indices) stay a few
# MiB whatever the weight's size, so quantizing a large tensor on the fly needs no memory proportional to it,
# and each step's passes run in cache.
_CHUNK_ELEMENTS = 1 << 18

# Positive magnitudes (codes 0..7) and the midpoints between neighbours: the decision boundaries for rounding.
_E2M1_MAGNITUDES = E2M1_VALUES[:_E2M1_MAGNITUDE_CODES]
_E2M1_MIDPOINTS = (_E2M1_MAGNITUDES[:-1] + _E2M1_MAGNITUDES[1:]) / 2
_E2M1_MIDPOINT_VALUES = tuple(_E2M1_MIDPOINTS.tolist())
_E2M1_SIGN_SHIFT = 3  # the sign bit's position in a code (_E2M1_SIGN_BIT = 1 << 3)

# Byte -> (value of low nibble, value of high nibble), [256, 2] float32. Dequantisation becomes one gather of this
# table by the packed bytes, which already yields the values in input order (low = even index first).
_BYTE_TO_PAIR = torch.stack(
    (
        E2M1_VALUES[torch.arange(_BYTE_VALUES) & _NIBBLE_MASK],
        E2M1_VALUES[torch.arange(_BYTE_VALUES) >> _NIBBLE_BITS],
    ),
    dim=1,
).contiguous()
# The same table with each row's two float32 reinterpreted as one 8-byte element, [256]. A 1-D index_select of 8-byte
# elements is ~2x faster on CPU than gathering [256, 2] rows, and ~5x faster than advanced indexing; viewing the result
# back as float32 restores the pairs (a pure reinterpretation: the bits are never used as float64 values).
_BYTE_TO_PAIR_BITS64 = _BYTE_TO_PAIR.view(torch.float64).squeeze(-1)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte: low nibble = even input index, high nibble = odd.

    Args:
        codes: integer tensor [out, in] with values in 0..15; ``in`` must be even.

    Returns:
        int8 [out, in / 2] (the on-disk dtype).
    """
    if codes.dim() != 2 or codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"pack_e2m1 expects 2-D integer codes [out, in]; got {tuple(codes.shape)} {codes.dtype}")
    if codes.shape[1] % 2:
        raise ValueError(f"pack_e2m1: input dim must be even to pack two codes per byte; got {tuple(codes.shape)}")
    if codes.numel() and bool(((codes < 0) | (codes >= _E2M1_NUM_CODES)).any()):
        raise ValueError("pack_e2m1: codes must be in 0..15")
    return _pack_codes(codes.to(torch.uint8)).view(torch.int8)


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., in] (already valid) -> uint8 bytes [..., in / 2], low nibble = even input."""
    return codes[..., 0::2] | (codes[..., 1::2] << _NIBBLE_BITS)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`.

    Args:
        packed: int8 or uint8 [out, in / 2].

    Returns:
        uint8 codes [out, in].
    """
    p = _packed_bytes(packed)
    low = p & _NIBBLE_MASK
    high = p >> _NIBBLE_BITS
    return torch.stack((low, high), dim=-1).reshape(p.shape[0], 2 * p.shape[1])


def _packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"packed e2m1 weights must be int8 or uint8; got {packed.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"packed e2m1 weights must be 2-D [out, in/2]; got shape {tuple(packed.shape)}")
    # Bytes, not values: int8 -> uint8 must be a reinterpretation so that high nibbles >= 8 are not sign-extended.
    return packed.view(torch.uint8)


def _check_group(group: int) -> None:
    if not isinstance(group, int) or group <= 0:
        raise ValueError(f"group must be a positive int; got {group!r}")


def _nearest_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to the nearest E2M1 code.

    Ties go to the even code (round-half-to-even on the code grid; the code's LSB is the e2m1 mantissa bit, so this is
    IEEE round-to-nearest-even, the same as hardware conversions): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4. Magnitudes above 6 saturate to 6. The sign is kept, also for values that round to zero
    (they become code 8, -0.0), using ``signbit`` so that -0.0 re-quantizes to the same code.
    """
    mag = x.abs()
    # The code is the number of midpoints below the magnitude. Midpoint k lies between codes k and k+1; on a tie
    # the even one wins: stay at k when k is even (count it only when strictly above), move up when k is odd.
    # Seven comparisons of the values are far cheaper on CPU than a bucketize / binary search; a bool tensor is
    # reinterpreted as its 0/1 bytes, because converting it is ~10x slower than comparing.
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for k, midpoint in enumerate(_E2M1_MIDPOINT_VALUES):
        codes += ((mag >= midpoint) if k % 2 else (mag > midpoint)).view(torch.uint8)
    return codes | (torch.signbit(x).view(torch.uint8) << _E2M1_SIGN_SHIFT)


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to packed e2m1 with one e8m0 scale per ``group`` inputs of a row.

    Per group: ``s = 2^ceil(log2(max(amax / 6, 2^-126)))``; ``code = nearest E2M1 value of w / s`` (ties to even, see
    :func:`_nearest_e2m1_codes`). Division by a power of two is exact, so the only rounding is the grid rounding.

    Args:
        w: [out, in], floating, finite; ``in`` must be a multiple of ``group`` and even.
        group: inputs per scale.

    Returns:
        ``(packed, scale)``: packed int8 [out, in / 2]; scale uint8 e8m0 bytes [out, in / group].

    Raises:
        ValueError: a bad ``group`` or shape, or a NaN or inf in ``w`` (the count is reported).

    Note:
        Dequantized output is a fixed point in *value* (``dequantize . quantize`` is a projection), but not always in
        bytes: a group whose max lands in (3, 3.5)*s rounds to 3*s, and re-quantizing that gives scale s/2 with doubled
        codes (same values). After one such re-quantization the bytes are stable.
    """
    _check_group(group)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp4 expects a 2-D floating weight [out, in]; got {tuple(w.shape)} {w.dtype}")
    out_features, in_features = w.shape
    if in_features % group or in_features % 2:
        raise ValueError(f"quantize_fp4: input dim {in_features} must be even and a multiple of group={group}")
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(out_features, in_features // group, dtype=torch.uint8, device=w.device)
    rows = max(1, _CHUNK_ELEMENTS // in_features)
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        if not _quantize_fp4_rows(w[start:stop], group, packed[start:stop], scale[start:stop]):
            bad = int((~torch.isfinite(w)).sum())
            raise ValueError(f"quantize_fp4: weight contains {bad} non-finite value(s) (NaN or inf)")
    return packed.view(torch.int8), scale


def _quantize_fp4_rows(w: torch.Tensor, group: int, packed_out: torch.Tensor, scale_out: torch.Tensor) -> bool:
    """Quantize some rows of a weight into ``packed_out`` / ``scale_out`` (see quantize_fp4); False (nothing
    written) when the rows hold a NaN or inf."""
    rows, in_features = w.shape
    grouped = w.to(torch.float32).contiguous().view(rows, in_features // group, group)  # row-major groups
    amax = grouped.abs().amax(dim=-1)
    # amax is NaN / inf exactly when its group holds a NaN / inf: the finiteness check costs no extra pass.
    if not bool(torch.isfinite(amax).all()):
        return False
    scale_out.copy_(e8m0_ceil_pow2(amax / E2M1_MAX))
    codes = _nearest_e2m1_codes(grouped / e8m0_to_float32(scale_out).unsqueeze(-1))
    packed_out.copy_(_pack_codes(codes.view(rows, in_features)))
    return True


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int = FP4_GROUP_SIZE,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``W[i, k] = E2M1[code[i, k]] * 2^(scale[i, k // group] - 127)``.

    Args:
        packed: int8 or uint8 [out, in / 2] (low nibble = even input index).
        scale: e8m0 bytes [out, in / group] as uint8 or float8_e8m0fnu (int8 also accepted as raw bytes).
        group: inputs per scale.
        out_dtype: result dtype; the product is exact in float32 and cast once.

    Returns:
        [out, in] tensor of ``out_dtype``. A NaN scale (byte 255) yields NaN for its group.

    Raises:
        TypeError: wrong dtypes (e.g. a float32 scale, which would be decoded values rather than e8m0 bytes).
        ValueError: bad ranks, or a scale shape that does not match ``[out, in / group]``.
    """
    _check_group(group)
    p = _packed_bytes(packed)
    scale_bytes = as_e8m0_bytes(scale)
    out_features, in_features = p.shape[0], 2 * p.shape[1]
    if in_features % group:
        raise ValueError(
            f"dequantize_fp4: input dim {in_features} (= 2 * {p.shape[1]}) is not a multiple of group={group}"
        )
    expected = (out_features, in_features // group)
    if tuple(scale_bytes.shape) != expected:
        raise ValueError(
            f"FP4 scale shape {tuple(scale_bytes.shape)} does not match packed weight shape {tuple(p.shape)} "
            f"(logical [{out_features}, {in_features}]) with group={group}: expected scale shape {expected}"
        )
    # One gather: [out, in/2] bytes -> [out * in/2] pairs -> [out, in] values, already in input order.
    pairs = _BYTE_TO_PAIR_BITS64.to(p.device).index_select(0, p.reshape(-1).to(torch.int32))
    values = pairs.view(torch.float32)
    scaled = values.view(out_features, in_features // group, group) * e8m0_to_float32(scale_bytes).unsqueeze(-1)
    return scaled.view(out_features, in_features).to(out_dtype)
