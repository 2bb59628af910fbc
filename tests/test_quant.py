"""Tests for dsv4.quant against independent pure-Python references.

The references below decode and round formats from their bit-level definitions (sign/exponent/mantissa fields), not
from the tables or tricks used in the implementation, and loop element by element.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsv4.quant import (
    E2M1_VALUES,
    E4M3_MAX,
    as_e8m0_bytes,
    dequantize_fp4,
    dequantize_fp8_blockwise,
    e8m0_ceil_pow2,
    e8m0_to_float32,
    float32_to_e8m0,
    pack_e2m1,
    quantize_fp4,
    quantize_fp8_blockwise,
    unpack_e2m1,
)

# --------------------------------------------------------------------------------------------------------------------
# Pure-Python references (no torch arithmetic, no lookup tables shared with the implementation).
# --------------------------------------------------------------------------------------------------------------------

MIN_NORMAL = 2.0**-126


def ref_e8m0(b: int) -> float:
    """Spec decode: 2^(b-127), except byte 0 -> 0.0 (shift trick) and 255 -> NaN (OCP MX)."""
    if b == 255:
        return math.nan
    if b == 0:
        return 0.0
    return math.ldexp(1.0, b - 127)


def ref_e2m1(code: int) -> float:
    """E2M1 from its bit fields: 1 sign, 2 exponent (bias 1), 1 mantissa; exponent 0 is subnormal (m * 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp = (code >> 1) & 0b11
    man = code & 0b1
    mag = man * 0.5 if exp == 0 else math.ldexp(1.0 + man / 2, exp - 1)
    return sign * mag


def ref_e4m3(byte: int) -> float:
    """float8_e4m3fn from its bit fields: 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 is NaN, no inf."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * math.ldexp(man / 8, -6)
    return sign * math.ldexp(1.0 + man / 8, exp - 7)


def ref_round_to_grid(x: float, codes: range, decode) -> int:
    """Nearest code by |value - x|, ties to the even code; clamps to the largest magnitude. Sign follows x."""
    positive = [c for c in codes if decode(c) >= 0 and not math.isnan(decode(c)) and math.copysign(1, decode(c)) > 0]
    mag = abs(x)
    best = min(positive, key=lambda c: (abs(decode(c) - mag), c % 2))
    return best


def ref_ceil_pow2(x: float) -> float:
    """Smallest power of two >= max(x, 2^-126), by doubling/halving (no log2)."""
    target = max(x, MIN_NORMAL)
    s = 1.0
    while s < target:
        s *= 2
    while s / 2 >= target:
        s /= 2
    return s


def f32(x: float) -> float:
    """Round a Python float to float32 (the implementation computes amax / max in float32)."""
    return torch.tensor(x, dtype=torch.float32).item()


E2M1_SIGN = 0b1000
E4M3_SIGN = 0x80


def ref_quant_e2m1(x: float) -> int:
    mag_code = ref_round_to_grid(x, range(8), ref_e2m1)
    return mag_code | (E2M1_SIGN if math.copysign(1.0, x) < 0 else 0)


def ref_quant_e4m3_byte(x: float) -> int:
    mag_code = ref_round_to_grid(max(-E4M3_MAX, min(E4M3_MAX, x)), range(0x7F), ref_e4m3)
    return mag_code | (E4M3_SIGN if math.copysign(1.0, x) < 0 else 0)


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# --------------------------------------------------------------------------------------------------------------------
# e8m0
# --------------------------------------------------------------------------------------------------------------------


def test_e8m0_bytes_survive_float8_e8m0fnu_roundtrip():
    raw = [0, 1, 120, 126, 127, 128, 200, 254, 255]
    as_e8m0 = torch.tensor(raw, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    back = as_e8m0_bytes(as_e8m0)
    assert back.dtype == torch.uint8
    assert back.tolist() == raw
    decoded = e8m0_to_float32(as_e8m0).tolist()
    for b, v in zip(raw, decoded):
        assert same_float(v, ref_e8m0(b)), (b, v)
    # Spot values from the notes: 2^-7 is byte 120 (the value a numeric cast to an integer would zero).
    assert decoded[2] == 2.0**-7
    assert decoded[0] == 0.0
    assert math.isnan(decoded[-1])  # NaN, not inf


def test_e8m0_numeric_values_go_through_bytes_untouched():
    # Encode 2^-7 with torch's own float -> e8m0 cast, then read the bytes back.
    t = torch.tensor([2.0**-7, 1.0, 2.0**-126], dtype=torch.float32).to(torch.float8_e8m0fnu)
    assert as_e8m0_bytes(t).tolist() == [120, 127, 1]
    assert e8m0_to_float32(t).tolist() == [2.0**-7, 1.0, 2.0**-126]


def test_as_e8m0_bytes_accepts_int8_as_raw_bits():
    t = torch.tensor([200, 127], dtype=torch.uint8).view(torch.int8)
    assert t.tolist() == [-56, 127]
    assert as_e8m0_bytes(t).tolist() == [200, 127]
    assert e8m0_to_float32(t).tolist() == [2.0**73, 1.0]


def test_as_e8m0_bytes_refuses_float32():
    with pytest.raises(TypeError, match="float32"):
        as_e8m0_bytes(torch.ones(3, dtype=torch.float32))
    with pytest.raises(TypeError, match="bfloat16"):
        e8m0_to_float32(torch.ones(3, dtype=torch.bfloat16))


def test_float32_to_e8m0_inverts_decode_on_all_finite_bytes():
    raw = torch.arange(1, 255, dtype=torch.uint8)
    assert torch.equal(float32_to_e8m0(e8m0_to_float32(raw)), raw)
    assert float32_to_e8m0(torch.tensor([0.5, 8.0, 2.0**-126, 2.0**127])).tolist() == [126, 130, 1, 254]


@pytest.mark.parametrize("bad", [3.0, 0.0, -2.0, math.inf, math.nan, 2.0**-127, 1.5])
def test_float32_to_e8m0_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError):
        float32_to_e8m0(torch.tensor([1.0, bad]))


def test_float32_to_e8m0_rejects_integer_input():
    with pytest.raises(TypeError):
        float32_to_e8m0(torch.tensor([127], dtype=torch.uint8))


def test_e8m0_ceil_pow2_matches_reference():
    xs = [0.0, 1e-45, 2.0**-130, 2.0**-126, 1.0, f32(1.0 + 2.0**-23), 3.0, 448.0 / 448, 0.75, 1e30]
    got = e8m0_ceil_pow2(torch.tensor(xs, dtype=torch.float32)).tolist()
    for x, b in zip(xs, got):
        assert ref_e8m0(b) == ref_ceil_pow2(x), (x, b)
    with pytest.raises(ValueError):
        e8m0_ceil_pow2(torch.tensor([math.inf]))


# --------------------------------------------------------------------------------------------------------------------
# FP8 (e4m3fn, block scales)
# --------------------------------------------------------------------------------------------------------------------


def random_e4m3_bytes(rng: random.Random, rows: int, cols: int) -> list[list[int]]:
    nan_codes = {0x7F, 0xFF}
    return [[rng.choice([b for b in range(256) if b not in nan_codes]) for _ in range(cols)] for _ in range(rows)]


@pytest.mark.parametrize("scale_kind", ["float32", "e8m0_uint8", "e8m0_float8"])
def test_fp8_dequant_hand_built_ragged_grid(scale_kind):
    rng = random.Random(0)
    rows, cols, block = 5, 7, (2, 3)  # grid 3 x 3, last block row has 1 row, last block col has 1 col
    qbytes = random_e4m3_bytes(rng, rows, cols)
    q = torch.tensor(qbytes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    if scale_kind == "float32":
        scale_vals = [[0.5, 3.0, 10.25], [1e-3, 7.0, 0.125], [2.0, 1.0, 96.5]]
        scale = torch.tensor(scale_vals, dtype=torch.float32)
        scale_ref = [[f32(v) for v in row] for row in scale_vals]
    else:
        scale_bytes = [[120, 127, 130], [1, 100, 126], [140, 127, 64]]
        scale = torch.tensor(scale_bytes, dtype=torch.uint8)
        if scale_kind == "e8m0_float8":
            scale = scale.view(torch.float8_e8m0fnu)
        scale_ref = [[ref_e8m0(b) for b in row] for row in scale_bytes]

    w = dequantize_fp8_blockwise(q, scale, block)
    assert w.shape == (rows, cols) and w.dtype == torch.float32
    for i in range(rows):
        for j in range(cols):
            expected = f32(ref_e4m3(qbytes[i][j]) * scale_ref[i // 2][j // 3])
            assert w[i, j].item() == expected, (i, j)


def test_fp8_dequant_default_block_and_out_dtype():
    q = torch.full((130, 257), 1.5).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 128, 129], [126, 125, 124]], dtype=torch.uint8)  # grid [2, 3] for 128x128
    w = dequantize_fp8_blockwise(q, scale, out_dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16
    assert w[0, 0].item() == 1.5 and w[0, 128].item() == 3.0 and w[0, 256].item() == 6.0
    assert w[129, 0].item() == 0.75 and w[128, 255].item() == 0.375 and w[129, 256].item() == 1.5 / 8


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
@pytest.mark.parametrize("shape,block", [((300, 260), (128, 128)), ((67, 45), (16, 32)), ((8, 8), (8, 8))])
def test_fp8_quantize_matches_reference_and_error_bound(scale_fmt, shape, block):
    gen = torch.Generator().manual_seed(1)
    rows, cols = shape
    # Per-row and per-column magnitude spread so that blocks get very different scales.
    w = torch.randn(shape, generator=gen) * torch.logspace(-6, 3, rows)[:, None] * torch.logspace(0, 2, cols)[None, :]
    w[: block[0], : block[1]] = 0.0  # an all-zero block exercises the scale floor
    q, scale = quantize_fp8_blockwise(w, block, scale_fmt)
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert scale.shape == grid
    assert scale.dtype == (torch.uint8 if scale_fmt == "ue8m0" else torch.float32)

    # Scales against the scalar formula, block by block.
    wl = w.tolist()
    s_ref = {}
    for bi in range(grid[0]):
        for bj in range(grid[1]):
            amax = max(
                abs(wl[i][j])
                for i in range(bi * block[0], min(rows, (bi + 1) * block[0]))
                for j in range(bj * block[1], min(cols, (bj + 1) * block[1]))
            )
            if scale_fmt == "ue8m0":
                s_ref[bi, bj] = ref_ceil_pow2(f32(amax / E4M3_MAX))
                assert ref_e8m0(scale[bi, bj].item()) == s_ref[bi, bj]
            else:
                s_ref[bi, bj] = max(f32(amax / E4M3_MAX), MIN_NORMAL)
                assert scale[bi, bj].item() == s_ref[bi, bj]

    # Codes against scalar round-to-nearest-even e4m3, on a sample of elements.
    qbytes = q.view(torch.uint8)
    rng = random.Random(2)
    for _ in range(200):
        i, j = rng.randrange(rows), rng.randrange(cols)
        x = f32(wl[i][j] / s_ref[i // block[0], j // block[1]])
        assert qbytes[i, j].item() == ref_quant_e4m3_byte(x), (i, j, x)

    # Error bound: 3 mantissa bits -> relative error <= 2^-4 for normal e4m3, absolute <= 2^-10 * s for subnormal.
    # That implies the looser per-block bound |err| <= 2^-3 * amax_block used as the headline guarantee.
    s_full = torch.tensor([[s_ref[i // block[0], j // block[1]] for j in range(cols)] for i in range(rows)])
    err = (dequantize_fp8_blockwise(q, scale, block) - w).abs()
    assert bool((err <= 2.0**-4 * w.abs() + 2.0**-10 * s_full).all())
    assert bool((err <= 2.0**-3 * E4M3_MAX * s_full).all())


def test_fp8_quantize_saturates_and_keeps_block_max_exact():
    w = torch.tensor([[448.0, -448.0, 1.0, 0.0]])
    q, scale = quantize_fp8_blockwise(w, (1, 4), "ue8m0")
    assert scale.tolist() == [[127]]
    assert q.float().tolist() == [[448.0, -448.0, 1.0, 0.0]]


def test_fp8_ue8m0_idempotence():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 300, generator=gen)
    block = (64, 64)
    q1, s1 = quantize_fp8_blockwise(w, block)
    d1 = dequantize_fp8_blockwise(q1, s1, block)
    q2, s2 = quantize_fp8_blockwise(d1, block)
    d2 = dequantize_fp8_blockwise(q2, s2, block)
    # dequantize . quantize is a projection: values are a fixed point, bit for bit.
    assert torch.equal(d2, d1)
    # After one re-quantization the bytes are a fixed point too.
    q3, s3 = quantize_fp8_blockwise(d2, block)
    assert torch.equal(q3.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s3, s2)


def test_fp8_ue8m0_requantize_can_halve_scale_but_keeps_values():
    # Block max 228 rounds to e4m3 224 with s = 1; 224 / 448 = 1/2 then requantizes with s = 1/2 and code 448.
    w = torch.tensor([[228.0, 1.0]])
    q1, s1 = quantize_fp8_blockwise(w, (1, 2))
    assert s1.tolist() == [[127]] and q1.float().tolist() == [[224.0, 1.0]]
    d1 = dequantize_fp8_blockwise(q1, s1, (1, 2))
    q2, s2 = quantize_fp8_blockwise(d1, (1, 2))
    assert s2.tolist() == [[126]] and q2.float().tolist() == [[448.0, 2.0]]
    assert torch.equal(dequantize_fp8_blockwise(q2, s2, (1, 2)), d1)


def test_fp8_float_scale_idempotent_bitwise():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(130, 200, generator=gen) * 37.0
    q1, s1 = quantize_fp8_blockwise(w, (64, 64), "float")
    q2, s2 = quantize_fp8_blockwise(dequantize_fp8_blockwise(q1, s1, (64, 64)), (64, 64), "float")
    assert torch.equal(q2.view(torch.uint8), q1.view(torch.uint8))
    assert torch.equal(s2, s1)


def test_fp8_scale_shape_mismatch_names_both_shapes():
    q = torch.zeros(300, 260).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError) as exc:
        dequantize_fp8_blockwise(q, torch.ones(2, 3), (128, 128))
    msg = str(exc.value)
    assert "(2, 3)" in msg and "(300, 260)" in msg and "(3, 3)" in msg
    # The same scale is fine with a block that produces a [2, 3] grid.
    assert dequantize_fp8_blockwise(q, torch.ones(2, 3), (256, 128)).shape == (300, 260)


def test_fp8_argument_errors():
    q = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError):
        dequantize_fp8_blockwise(torch.zeros(4, 4), torch.ones(1, 1))  # not e4m3
    with pytest.raises(TypeError):
        dequantize_fp8_blockwise(q, torch.ones(1, 1, dtype=torch.int32), (4, 4))
    with pytest.raises(ValueError):
        dequantize_fp8_blockwise(q, torch.ones(1, 1), (0, 4))
    with pytest.raises(ValueError):
        quantize_fp8_blockwise(torch.zeros(4, 4), (4, 4), "e4m3")
    with pytest.raises(ValueError):
        quantize_fp8_blockwise(torch.tensor([[math.nan, 0.0]]), (1, 2))


# --------------------------------------------------------------------------------------------------------------------
# FP4 (e2m1, per-32 e8m0 scales)
# --------------------------------------------------------------------------------------------------------------------


def test_e2m1_table_matches_bit_fields():
    assert [ref_e2m1(c) for c in range(16)] == E2M1_VALUES.tolist()
    # Code 8 is negative zero.
    assert math.copysign(1.0, E2M1_VALUES[8].item()) == -1.0


def test_nibble_order_low_nibble_is_even_input():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x71  # low nibble 1 -> input 0; high nibble 7 -> input 1
    packed[0, 1] = 0xF8  # low nibble 8 (-0) -> input 2; high nibble 15 (-6) -> input 3; negative as int8
    packed = packed.view(torch.int8)
    assert packed[0, 1].item() < 0
    scale = torch.tensor([[130]], dtype=torch.uint8)  # 2^3
    w = dequantize_fp4(packed, scale)
    assert w.shape == (1, 32)
    assert w[0, :4].tolist() == [0.5 * 8, 6.0 * 8, -0.0, -6.0 * 8]
    assert math.copysign(1.0, w[0, 2].item()) == -1.0
    assert w[0, 4:].abs().sum().item() == 0.0
    assert unpack_e2m1(packed)[0, :4].tolist() == [1, 7, 8, 15]
    assert pack_e2m1(torch.tensor([[1, 7, 8, 15]], dtype=torch.uint8)).view(torch.uint8).tolist() == [[0x71, 0xF8]]


def test_pack_unpack_all_bytes_roundtrip():
    all_bytes = torch.arange(256, dtype=torch.uint8).view(4, 64)
    codes = unpack_e2m1(all_bytes)
    assert codes.dtype == torch.uint8 and codes.shape == (4, 128)
    for r in range(4):
        for j in range(64):
            b = r * 64 + j
            assert codes[r, 2 * j].item() == b & 0xF and codes[r, 2 * j + 1].item() == b >> 4
    repacked = pack_e2m1(codes)
    assert repacked.dtype == torch.int8
    assert torch.equal(repacked.view(torch.uint8), all_bytes)
    assert torch.equal(unpack_e2m1(all_bytes.view(torch.int8)), codes)


@pytest.mark.parametrize("group", [32, 16])
def test_fp4_dequant_matches_scalar_reference(group):
    rng = random.Random(5)
    rows, cols = 3, 64
    pbytes = [[rng.randrange(256) for _ in range(cols // 2)] for _ in range(rows)]
    sbytes = [[rng.choice([1, 60, 119, 120, 127, 133, 200]) for _ in range(cols // group)] for _ in range(rows)]
    packed = torch.tensor(pbytes, dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor(sbytes, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = dequantize_fp4(packed, scale, group)
    for i in range(rows):
        for k in range(cols):
            byte = pbytes[i][k // 2]
            code = byte & 0xF if k % 2 == 0 else byte >> 4
            expected = ref_e2m1(code) * ref_e8m0(sbytes[i][k // group])
            got = w[i, k].item()
            assert got == expected and math.copysign(1, got) == math.copysign(1, expected), (i, k)


def test_fp4_dequant_bf16_and_nan_scale():
    packed = torch.full((2, 16), 0x22, dtype=torch.uint8)  # all codes 2 (= 1.0)
    scale = torch.tensor([[120], [255]], dtype=torch.uint8)
    w = dequantize_fp4(packed, scale, out_dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16
    assert bool((w[0] == 2.0**-7).all())
    assert bool(torch.isnan(w[1]).all())


def test_fp4_quantize_ties_and_signs():
    # One group with max 6 so s = 1; values at every midpoint and a few negatives.
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -6.0, 0.1, -0.1, 5.9, 0.0]
    w = torch.tensor([vals + [0.0] * 16])
    packed, scale = quantize_fp4(w)
    assert scale.tolist() == [[127]]
    codes = unpack_e2m1(packed)[0, : len(vals)].tolist()
    # Hand-written expectations (ties to the even code): 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4.
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 14, 15, 0, 8, 7, 0]
    assert codes == [ref_quant_e2m1(x) for x in vals]


@pytest.mark.parametrize("group", [32, 16])
def test_fp4_quantize_matches_reference_and_error_bound(group):
    gen = torch.Generator().manual_seed(6)
    rows, cols = 8, 128
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-30, 20, rows)[:, None]
    w[0, :group] = 0.0  # all-zero group -> floor scale 2^-126
    w[1, :group] = torch.linspace(-3.0, 3.0, group) * 2.0**-126  # amax / 6 below the floor -> s = 2^-126, codes up to 3
    packed, scale = quantize_fp4(w, group)
    assert packed.dtype == torch.int8 and packed.shape == (rows, cols // 2)
    assert scale.dtype == torch.uint8 and scale.shape == (rows, cols // group)
    assert scale[0, 0].item() == 1 and scale[1, 0].item() == 1

    codes = unpack_e2m1(packed)
    wl = w.tolist()
    for i in range(rows):
        for g in range(cols // group):
            amax = max(abs(v) for v in wl[i][g * group : (g + 1) * group])
            s = ref_ceil_pow2(f32(amax / 6.0))
            assert ref_e8m0(scale[i, g].item()) == s, (i, g)
            for k in range(g * group, (g + 1) * group):
                assert codes[i, k].item() == ref_quant_e2m1(wl[i][k] / s), (i, k)

    # 1 mantissa bit: relative error <= 2^-2 on normal e2m1 values, absolute <= 0.25 * s in the subnormal range.
    s_full = e8m0_to_float32(scale).repeat_interleave(group, dim=1)
    err = (dequantize_fp4(packed, scale, group) - w).abs()
    assert bool((err <= 0.25 * w.abs() + 0.25 * s_full).all())


def grid_weight(rows: int, cols: int, group: int, seed: int, max_codes=(7, 15)) -> torch.Tensor:
    """Weights exactly on the e2m1 grid, each group with its own power-of-two scale and a max of +-6 (or given)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        row = []
        for _ in range(cols // group):
            s = 2.0 ** rng.randrange(-20, 20)
            codes = [rng.randrange(16) for _ in range(group)]
            codes[rng.randrange(group)] = rng.choice(max_codes)
            row += [ref_e2m1(c) * s for c in codes]
        out.append(row)
    return torch.tensor(out, dtype=torch.float32)


def test_fp4_grid_values_come_back_exactly_and_bitwise_idempotent():
    w = grid_weight(4, 128, 32, seed=7)
    packed, scale = quantize_fp4(w)
    d = dequantize_fp4(packed, scale)
    assert torch.equal(d, w)
    # Every group holds +-6, so the scale is the generating power of two and the bytes are a fixed point.
    packed2, scale2 = quantize_fp4(d)
    assert torch.equal(packed2, packed) and torch.equal(scale2, scale)


def test_fp4_grid_values_with_smaller_max_still_come_back_exactly():
    # Group max 3 or 4: the scale may differ from the generating one (max 3 -> s/2), but values are exact.
    w = grid_weight(4, 64, 32, seed=8, max_codes=(5, 6, 13, 14))
    assert torch.equal(dequantize_fp4(*quantize_fp4(w)), w)


def test_fp4_idempotence():
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(16, 256, generator=gen)
    p1, s1 = quantize_fp4(w)
    d1 = dequantize_fp4(p1, s1)
    p2, s2 = quantize_fp4(d1)
    d2 = dequantize_fp4(p2, s2)
    # dequantize . quantize is a projection: the values are a fixed point, bit for bit (including -0.0).
    assert torch.equal(d2.view(torch.int32), d1.view(torch.int32))
    # After one re-quantization the stored bytes are a fixed point as well.
    p3, s3 = quantize_fp4(d2)
    assert torch.equal(p3, p2) and torch.equal(s3, s2)


def test_fp4_requantize_can_halve_scale_but_keeps_values():
    # Group max 3.2 with s = 1 rounds to 3; 3 / 6 = 1/2, so re-quantizing picks s = 1/2 and code 6 (same values).
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 3.2, 0.5
    p1, s1 = quantize_fp4(w)
    assert s1.tolist() == [[127]] and unpack_e2m1(p1)[0, :2].tolist() == [5, 1]
    d1 = dequantize_fp4(p1, s1)
    p2, s2 = quantize_fp4(d1)
    assert s2.tolist() == [[126]] and unpack_e2m1(p2)[0, :2].tolist() == [7, 2]
    assert torch.equal(dequantize_fp4(p2, s2), d1)


def test_fp4_shape_and_dtype_errors():
    packed = torch.zeros(4, 32, dtype=torch.int8)  # logical [4, 64]
    with pytest.raises(ValueError) as exc:
        dequantize_fp4(packed, torch.zeros(4, 3, dtype=torch.uint8))
    assert "(4, 3)" in str(exc.value) and "(4, 2)" in str(exc.value)
    with pytest.raises(ValueError):
        dequantize_fp4(packed, torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        dequantize_fp4(torch.zeros(4, 20, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8))  # 40 % 32
    with pytest.raises(TypeError):
        dequantize_fp4(packed, torch.ones(4, 2, dtype=torch.float32))  # decoded values, not e8m0 bytes
    with pytest.raises(TypeError):
        dequantize_fp4(packed.to(torch.int32), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        quantize_fp4(torch.zeros(4, 48))  # not a multiple of 32
    with pytest.raises(ValueError):
        quantize_fp4(torch.tensor([[math.inf] * 32]))
    with pytest.raises(ValueError):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))  # odd input dim
    with pytest.raises(ValueError):
        pack_e2m1(torch.full((2, 2), 16, dtype=torch.uint8))  # not a 4-bit code


# --------------------------------------------------------------------------------------------------------------------
# Kernel structure: chunked quantization, fused finiteness check, table decode
# --------------------------------------------------------------------------------------------------------------------


def test_e4m3_decode_table_matches_bit_fields_on_every_byte():
    from dsv4.quant import e4m3_to_float32

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    values = e4m3_to_float32(codes)
    assert values.shape == (16, 16) and values.dtype == torch.float32
    for byte, value in enumerate(values.flatten().tolist()):
        expected = ref_e4m3(byte)
        assert (math.isnan(value) and math.isnan(expected)) or value == expected, byte
    # A non-contiguous view decodes the elements it shows.
    assert torch.equal(e4m3_to_float32(codes.t()).view(torch.int32), values.t().view(torch.int32))


@pytest.mark.parametrize("kind", ["fp4", "fp8_ue8m0", "fp8_float"])
def test_quantizers_give_the_same_bytes_whatever_the_chunking(kind, monkeypatch):
    """Large weights are quantized a few rows at a time (bounded temporaries); the rows a step covers must
    not change a byte. One chunk vs one row (fp4) / one tile row (fp8) per step, ragged tiles included."""
    from dsv4.quant import fp4 as fp4_module
    from dsv4.quant import fp8 as fp8_module

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 96, generator=gen) * torch.logspace(-3, 3, 300)[:, None]
    block = (64, 64)

    def run():
        if kind == "fp4":
            return quantize_fp4(w.bfloat16(), 32)
        return quantize_fp8_blockwise(w, block, kind.removeprefix("fp8_"))

    module = fp4_module if kind == "fp4" else fp8_module
    monkeypatch.setattr(module, "_CHUNK_ELEMENTS", 1 << 30)
    whole = run()
    monkeypatch.setattr(module, "_CHUNK_ELEMENTS", 1)
    chunked = run()
    for a, b in zip(whole, chunked, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                           if b.element_size() == 1 else b)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantizers_refuse_non_finite_values_in_any_chunk(bad, monkeypatch):
    """The finiteness check rides on the per-block maximum: a bad value in the last chunk is still found, and
    the message counts every bad value of the weight."""
    from dsv4.quant import fp4 as fp4_module
    from dsv4.quant import fp8 as fp8_module

    monkeypatch.setattr(fp4_module, "_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(fp8_module, "_CHUNK_ELEMENTS", 64)
    w = torch.ones(40, 64)
    w[39, 5] = bad
    w[38, 0] = bad
    with pytest.raises(ValueError, match="2 non-finite"):
        quantize_fp4(w)
    with pytest.raises(ValueError, match="2 non-finite"):
        quantize_fp8_blockwise(w, (8, 32))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_kind", ["float32", "e8m0"])
def test_fp8_dequant_into_a_narrow_dtype_rounds_like_float32_then_cast(out_dtype, scale_kind):
    """Codes decoded straight into bf16 / fp16 and scaled in place give the bits of the float32 product cast once
    (float scales that are not powers of two make the rounding visible), NaN codes included."""
    gen = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (300, 260), generator=gen, dtype=torch.int32).to(torch.uint8)
    q = raw.view(torch.float8_e4m3fn)
    if scale_kind == "float32":
        scale = torch.rand(3, 3, generator=gen) * 3 + 0.1
    else:
        scale = torch.randint(110, 140, (3, 3), generator=gen, dtype=torch.int32).to(torch.uint8)
    narrow = dequantize_fp8_blockwise(q, scale, (128, 128), out_dtype)
    reference = dequantize_fp8_blockwise(q, scale, (128, 128), torch.float32).to(out_dtype)
    assert narrow.dtype == out_dtype and narrow.is_contiguous()
    assert torch.equal(narrow.view(torch.int16), reference.view(torch.int16))
    assert bool(torch.isnan(narrow).any())  # the random bytes include NaN codes
