"""Block-scaled FP8 (e4m3fn) linear weights (architecture notes, section 10.4).

A weight ``W`` [out, in] is stored as ``q`` (``float8_e4m3fn`` [out, in]) plus one scale per ``block`` tile, giving a
scale grid ``S`` [ceil(out / b0), ceil(in / b1)]. Dequantisation is ``W[i, j] = q[i, j] * S[i // b0, j // b1]``; the
scale is a multiplier even where checkpoints call it ``scale_inv``. Edge tiles may be ragged (smaller than ``block``).

Scale formats (``scale_fmt`` in ``quantization_config``):
  * ``"ue8m0"``: power-of-two scales stored as e8m0 bytes (instruct releases);
  * ``"float"``: plain float32 scales (``-Base`` releases).

The block shape is a parameter everywhere. The scale grid itself does not encode the block size when edges are
ragged, so callers must pass the block that was used to write the file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .e8m0 import E8M0_MIN_NORMAL_SCALE, as_e8m0_bytes, e8m0_ceil_pow2, e8m0_to_float32

__all__ = [
    "DEFAULT_FP8_BLOCK",
    "E4M3_MAX",
    "FLOAT_SCALE_FLOOR",
    "FP8_SCALE_FMTS",
    "dequantize_fp8_blockwise",
    "e4m3_to_float32",
    "fp8_scale_grid_shape",
    "quantize_fp8_blockwise",
]

# Largest finite float8_e4m3fn magnitude (the format has no infinities; 0x7F/0xFF are NaN).
E4M3_MAX = 448.0
# DeepSeek's tile: 128 output rows x 128 input columns per scale.
DEFAULT_FP8_BLOCK = (128, 128)
FP8_SCALE_FMTS = ("ue8m0", "float")
# Floor for "float" scales so an all-zero block gets a usable (non-zero) scale instead of 0 and a 0/0 on quantize.
# The same smallest-normal value as the ue8m0 floor keeps the two formats' behaviour on empty blocks alike.
FLOAT_SCALE_FLOOR = E8M0_MIN_NORMAL_SCALE
# Elements quantized per step: the float32 temporaries of one step (a few per element) stay a few MiB whatever
# the weight's size, so quantizing a large tensor on the fly needs no memory proportional to it, and each
# step's passes run in cache.
_CHUNK_ELEMENTS = 1 << 18
# Byte -> float32 value of every e4m3fn code (NaN for 0x7F / 0xFF). Decoding is one gather of this table by the raw
# bytes: torch's own float8 -> float32 cast is scalar code on CPU (~13x a memcpy), the gather about 1x.
_E4M3_BYTE_VALUES = 256
_E4M3_TO_FLOAT32 = torch.arange(_E4M3_BYTE_VALUES, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
# Dtypes that hold every e4m3 value exactly (3 mantissa bits, magnitudes 2^-9 .. 448): dequantization can decode
# straight into them and scale in place, the product still formed in float32 and rounded once.
_E4M3_EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_block(block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols); got {block!r}")
    return int(block[0]), int(block[1])


def fp8_scale_grid_shape(weight_shape: Sequence[int], block: Sequence[int] = DEFAULT_FP8_BLOCK) -> tuple[int, int]:
    """Scale-grid shape ``(ceil(out / b0), ceil(in / b1))`` for a weight of shape ``(out, in)``."""
    b0, b1 = _check_block(block)
    out_features, in_features = weight_shape
    return math.ceil(out_features / b0), math.ceil(in_features / b1)


def _tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[out, in] -> [nb0, b0, nb1, b1] tiles, zero-padded to whole tiles when an edge is ragged. A scale grid
    [nb0, nb1] then applies per tile as ``scale[:, None, :, None]`` (broadcast, nothing expanded)."""
    out_features, in_features = x.shape
    b0, b1 = block
    nb0, nb1 = -(-out_features // b0), -(-in_features // b1)
    pad_rows, pad_cols = nb0 * b0 - out_features, nb1 * b1 - in_features
    if pad_rows or pad_cols:
        x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
    return x.reshape(nb0, b0, nb1, b1)


def _untile(tiles: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`_tiles`: the [out, in] view of the tiles, padding cropped."""
    nb0, b0, nb1, b1 = tiles.shape
    return tiles.reshape(nb0 * b0, nb1 * b1)[: shape[0], : shape[1]]


def _rows_per_chunk(in_features: int, b0: int) -> int:
    """Whole tile rows per quantization step, about _CHUNK_ELEMENTS elements (at least one tile row)."""
    return max(1, _CHUNK_ELEMENTS // max(1, in_features * b0)) * b0


def quantize_fp8_blockwise(
    w: torch.Tensor,
    block: Sequence[int] = DEFAULT_FP8_BLOCK,
    scale_fmt: str = "ue8m0",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to e4m3fn with one scale per ``block`` tile.

    Per tile with ``amax = max |w|``:
      * ``"ue8m0"``: ``s = 2^ceil(log2(max(amax / 448, 2^-126)))``, returned as ``uint8`` e8m0 bytes;
      * ``"float"``: ``s = max(amax / 448, FLOAT_SCALE_FLOOR)``, returned as float32.
    Then ``q = e4m3(clamp(w / s, -448, 448))`` with torch's round-to-nearest-even cast. The clamp only matters for
    float32 rounding at the very top of the range, but makes saturation explicit instead of relying on cast behaviour.

    Args:
        w: [out, in], any floating dtype, finite. Computed in float32.
        block: tile shape (rows, cols); ``out``/``in`` need not be multiples of it.
        scale_fmt: ``"ue8m0"`` or ``"float"``.

    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn [out, in]; ``scale`` [ceil(out/b0), ceil(in/b1)], uint8 (ue8m0) or
        float32 (float).

    Raises:
        ValueError: bad ``block`` / ``scale_fmt`` / shape, or a NaN or inf in ``w`` (the count is reported).

    Note:
        With ``"ue8m0"`` the map is *value*-idempotent (dequantize . quantize is a projection), but re-quantizing
        dequantized output need not reproduce the same bytes: if a tile's max lands in (224, 232)*s it rounds to 224*s,
        whose requantized scale is s/2 (codes doubled, identical values).
    """
    b0, b1 = _check_block(block)
    if scale_fmt not in FP8_SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {FP8_SCALE_FMTS}; got {scale_fmt!r}")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(
            f"quantize_fp8_blockwise expects a 2-D floating weight [out, in]; got {tuple(w.shape)} {w.dtype}"
        )
    out_features, in_features = w.shape
    nb0, nb1 = fp8_scale_grid_shape(w.shape, (b0, b1))
    q = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=w.device)
    scale_out = torch.empty(nb0, nb1, dtype=torch.uint8 if scale_fmt == "ue8m0" else torch.float32, device=w.device)
    rows = _rows_per_chunk(in_features, b0)
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        tile_rows = slice(start // b0, -(-stop // b0))
        if not _quantize_fp8_rows(w[start:stop], (b0, b1), scale_fmt, q[start:stop], scale_out[tile_rows]):
            bad = int((~torch.isfinite(w)).sum())
            raise ValueError(f"quantize_fp8_blockwise: weight contains {bad} non-finite value(s) (NaN or inf)")
    return q, scale_out


def _quantize_fp8_rows(
    w: torch.Tensor, block: tuple[int, int], scale_fmt: str, q_out: torch.Tensor, scale_out: torch.Tensor
) -> bool:
    """Quantize whole tile rows of a weight into ``q_out`` / ``scale_out`` (see quantize_fp8_blockwise);
    False (nothing written) when the rows hold a NaN or inf."""
    tiles = _tiles(w.to(torch.float32), block)  # zero padding cannot change any tile's amax
    amax = tiles.abs().amax(dim=(1, 3))
    # amax is NaN / inf exactly when its tile holds a NaN / inf: the finiteness check costs no extra pass.
    if not bool(torch.isfinite(amax).all()):
        return False
    if scale_fmt == "ue8m0":
        scale_out.copy_(e8m0_ceil_pow2(amax / E4M3_MAX))
        scale_f32 = e8m0_to_float32(scale_out)
    else:
        scale_out.copy_((amax / E4M3_MAX).clamp_min(FLOAT_SCALE_FLOOR))
        scale_f32 = scale_out
    # Out of place: `tiles` may be a view of the caller's weight. One chunk-sized temporary.
    scaled = (tiles / scale_f32[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q_out.copy_(_untile(scaled, tuple(w.shape)))
    return True


def e4m3_to_float32(q: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of float8_e4m3fn codes, any shape (a table gather by the raw bytes)."""
    return _e4m3_values(q, torch.float32)


def _e4m3_values(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact values of e4m3 codes in `dtype`, one of _E4M3_EXACT_DTYPES."""
    codes = q.view(torch.uint8).reshape(-1).to(torch.int32)
    return _E4M3_TO_FLOAT32.to(device=q.device, dtype=dtype).index_select(0, codes).view(q.shape)


def _decode_fp8_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scale grid as float32: e8m0 byte dtypes are decoded bit-exactly, float dtypes are value-converted."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8, torch.int8):
        return e8m0_to_float32(as_e8m0_bytes(scale))
    if scale.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return scale.to(torch.float32)
    raise TypeError(
        f"FP8 scale must be float32 (or another float dtype) or e8m0 bytes (float8_e8m0fnu/uint8); got {scale.dtype}"
    )


def dequantize_fp8_blockwise(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: Sequence[int] = DEFAULT_FP8_BLOCK,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``W[i, j] = q[i, j] * S[i // b0, j // b1]``.

    Args:
        q: float8_e4m3fn [out, in].
        scale: [ceil(out/b0), ceil(in/b1)]; float32 (or other float) values, or e8m0 as float8_e8m0fnu/uint8 bytes.
        block: tile shape (rows, cols) the file was written with.
        out_dtype: result dtype. The product is formed in float32 and cast once; with e8m0 scales it is exact (a
            4-bit significand times a power of two), with float32 scales it is rounded to float32 and then to
            ``out_dtype``.

    Returns:
        [out, in] tensor of ``out_dtype``. An e8m0 NaN scale (byte 255) yields NaN in its tile.

    Raises:
        TypeError: ``q`` not float8_e4m3fn, or an unsupported scale dtype.
        ValueError: bad ranks or a scale grid that does not match ``q``'s shape under ``block``.
    """
    b0, b1 = _check_block(block)
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn; got {q.dtype}")
    if q.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"FP8 weight and scale must be 2-D; got weight {tuple(q.shape)}, scale {tuple(scale.shape)}")
    expected = fp8_scale_grid_shape(q.shape, (b0, b1))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight shape {tuple(q.shape)} with block "
            f"{(b0, b1)}: expected scale shape {expected}"
        )
    scale_f32 = _decode_fp8_scale(scale)
    # Decoded in out_dtype when it holds the codes exactly: the in-place product with the float32 scale is still
    # computed in float32 (type promotion) and rounded once into out_dtype, with half the bytes moved for bf16.
    decoded = _e4m3_values(q, out_dtype if out_dtype in _E4M3_EXACT_DTYPES else torch.float32)
    tiles = _tiles(decoded, (b0, b1)).mul_(scale_f32[:, None, :, None])
    return _untile(tiles, tuple(q.shape)).to(out_dtype).contiguous()  # (cropping ragged tiles leaves a view)
