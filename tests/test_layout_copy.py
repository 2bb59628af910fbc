"""The C kernels that write input-major resident weights (weights/layout_copy.py) give exactly the bytes of
torch's own path: a transposing copy (same dtype, bf16 <-> fp32; AVX2 register blocks, their streaming
stores, and the scalar walk of a build without AVX2) and FP8 dequantization with block scales, on shapes
with several panels, ragged edges and odd sizes; and where no kernel applies, the caller's torch path runs."""

import platform
from pathlib import Path

import pytest
import torch

from dsv4.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise
from dsv4.weights import layout_copy
from dsv4.weights.convert import QuantLayout, copy_into, dequantize

SHAPES = [(130, 2050), (256, 128), (3000, 70), (2, 5), (129, 33)]
# Register blocks are 16 or 32 rows x 8 or 16 columns inside 128 x 64 panels: exact multiples, one short of
# them and one over, and shapes no block covers.
TRANSPOSE_SHAPES = [*SHAPES, (32, 16), (31, 15), (33, 17), (128, 64), (161, 97), (7, 300), (300, 7), (48, 40)]
BLOCK = (128, 128)
# The scalar walk: a build for a CPU without AVX2.
SCALAR_MARCH = "x86-64-v2"


def _input_major(shape, dtype):
    return torch.zeros(shape[1], shape[0], dtype=dtype).t()


def _on_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(scope="module", params=["native", "scalar"])
def kernels(request):
    """The library built for this CPU, and one built without AVX2 (its scalar walk)."""
    if request.param == "native":
        lib = layout_copy._library()
        if lib is None:
            pytest.fail("no C compiler: the layout kernels cannot be built")
        return lib
    if not _on_x86():
        return layout_copy._library()  # -march names differ elsewhere; the native build is the one there
    lib = layout_copy.build_library(march=SCALAR_MARCH)
    assert lib.vector_isa() == 0
    return lib


def test_native_build_uses_avx2_where_the_cpu_has_it():
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    expected = 256 if _on_x86() and " avx2" in flags else 0
    assert layout_copy._library().vector_isa() == expected


def _awkward_values(shape, dtype, nan: bool):
    """Random values with rounding ties, signed zeros, infinities (and NaN) scattered in."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e3
    special = [0.0, -0.0, float("inf"), -float("inf"), 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8)]
    special += [float("nan")] if nan else []  # the ties: bf16 rounds them to even
    spots = values.view(-1)[:: max(1, values.numel() // 37)]
    spots.copy_(torch.tensor(special).repeat(spots.numel())[: spots.numel()])
    return values.to(dtype)


@pytest.mark.parametrize("stream", [False, True], ids=["cached_stores", "streaming_stores"])
@pytest.mark.parametrize("shape", TRANSPOSE_SHAPES)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16)])
def test_transpose_matches_torch(kernels, shape, dtypes, stream, monkeypatch):
    incoming, resident = dtypes
    # Every fp32 destination streams when the threshold is 0 (the kernel still checks alignment).
    monkeypatch.setattr(layout_copy, "stream_bytes", lambda: 0 if stream else None)
    # NaN never reaches a narrowing copy (validation refuses it first), and torch's own fp32 -> bf16 paths
    # disagree on its bytes (0x7FC0 scalar, 0xFFFF vectorised); copies that keep the bits are checked with it.
    value = _awkward_values(shape, incoming, nan=resident.itemsize >= incoming.itemsize)
    dest = _input_major(shape, resident)
    ptr = dest.data_ptr()
    assert layout_copy.transpose_into(dest, value, kernels)
    assert dest.data_ptr() == ptr
    bits = torch.int16 if resident.itemsize == 2 else torch.int32  # bit for bit: rounding ties, signed zeros, NaN
    assert torch.equal(dest.contiguous().view(bits), value.to(resident).view(bits))


def test_stream_threshold_is_a_share_of_the_cache():
    threshold = layout_copy.stream_bytes()
    assert threshold is None or threshold > 0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"], ids=["e8m0", "fp32_scale"])
@pytest.mark.parametrize("resident", [torch.float32, torch.bfloat16])
def test_fp8_dequantization_matches_torch(shape, scale_fmt, resident):
    values = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3
    codes, scale = quantize_fp8_blockwise(values, BLOCK, scale_fmt)
    layout = QuantLayout(fp8_block=BLOCK, fp4_group=32, scale_fmt=scale_fmt)
    expected = dequantize_fp8_blockwise(codes, scale, BLOCK, resident)
    dest = _input_major(shape, resident)
    ptr = dest.data_ptr()
    assert dequantize(codes, scale, layout, shape, resident, out=dest) is dest
    assert dest.data_ptr() == ptr
    bits = torch.int16 if resident.itemsize == 2 else torch.int32
    assert torch.equal(dest.contiguous().view(bits), expected.view(bits))


@pytest.mark.parametrize("block", [(128, 128), (24, 64), (64, 36)], ids=["direct", "banded", "scalar_walk"])
def test_fp8_dequantization_of_every_kernel_path_matches_torch(block):
    """Into fp32, blocks of a multiple of 16 rows and 8 columns take the AVX2 direct path (register blocks
    straight from the codes), other multiples of 8 columns the band path (bf16 always), the rest the tiled
    table walk: same bytes. 200 x 300 leaves ragged rows and columns to the direct path's edges."""
    shape = (200, 300)
    codes, scale = quantize_fp8_blockwise(torch.randn(shape, generator=torch.Generator().manual_seed(3)), block,
                                          "ue8m0")
    layout = QuantLayout(fp8_block=block, fp4_group=32, scale_fmt="ue8m0")
    for resident in (torch.float32, torch.bfloat16):
        dest = _input_major(shape, resident)
        dequantize(codes, scale, layout, shape, resident, out=dest, check_as_written=True)
        bits = torch.int16 if resident.itemsize == 2 else torch.int32
        expected = dequantize_fp8_blockwise(codes, scale, block, resident)
        assert torch.equal(dest.contiguous().view(bits), expected.view(bits))


@pytest.mark.parametrize("shape", [(256, 512), (61, 133)], ids=["whole_blocks", "ragged"])
def test_fp8_dequantization_decodes_every_code_exactly(shape):
    """Every e4m3fn code but the NaN ones (subnormals, both zeros, the largest), in every position of the
    register blocks and the ragged edges, times scales across the ue8m0 range: the table walk's fp32 product."""
    codes = torch.arange(shape[0] * shape[1], dtype=torch.int64).remainder(256).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes).view(shape)
    codes = codes[torch.randperm(shape[0], generator=torch.Generator().manual_seed(4))].contiguous()
    grid = (-(-shape[0] // BLOCK[0]), -(-shape[1] // BLOCK[1]))
    scale = torch.randint(1, 254, grid, dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    layout = QuantLayout(fp8_block=BLOCK, fp4_group=32, scale_fmt="ue8m0")
    fp8 = codes.view(torch.float8_e4m3fn)
    dest = _input_major(shape, torch.float32)
    dequantize(fp8, scale.view(torch.float8_e8m0fnu), layout, shape, torch.float32, out=dest, check_as_written=True)
    expected = dequantize_fp8_blockwise(fp8, scale.view(torch.float8_e8m0fnu), BLOCK, torch.float32)
    assert torch.equal(dest.contiguous().view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("check_as_written", [False, True], ids=["checked_first", "checked_in_the_kernel"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no_compiler"])
def test_fp8_nan_codes_are_refused_wherever_they_are_checked(check_as_written, kernel, monkeypatch):
    """A NaN code (either sign; the last one of a ragged edge too) fails the dequantization, whether the codes
    are checked before the copy or inside it, with the kernel or torch's path."""
    from dsv4.weights.convert import ConversionError

    if not kernel:
        monkeypatch.setattr(layout_copy, "_library", lambda: None)
    shape = (70, 300)
    codes, scale = quantize_fp8_blockwise(torch.randn(shape), BLOCK, "ue8m0")
    layout = QuantLayout(fp8_block=BLOCK, fp4_group=32, scale_fmt="ue8m0")
    # the first code (a register block), one inside the last whole block row, and the ragged edge's last one
    for index, code in ((0, 0x7F), (63 * shape[1] + 17, 0xFF), (shape[0] * shape[1] - 1, 0xFF)):
        bad = codes.view(torch.uint8).clone()
        bad.view(-1)[index] = code
        out = _input_major(shape, torch.float32)
        with pytest.raises(ConversionError, match="1 NaN code"):
            dequantize(bad.view(torch.float8_e4m3fn), scale, layout, shape, torch.float32, out=out,
                       check_as_written=check_as_written)
        if not check_as_written:
            assert not out.any()  # refused before the first write


def test_other_layouts_and_no_compiler_take_torch_path(monkeypatch):
    """Not input-major, or no C compiler: the kernels decline (write nothing) and copy_into / dequantize still
    give torch's bytes."""
    value = torch.randn(70, 300)
    row_major = torch.zeros(70, 300)
    assert not layout_copy.transpose_into(row_major, value) and not row_major.any()
    monkeypatch.setattr(layout_copy, "_library", lambda: None)
    dest = _input_major((70, 300), torch.bfloat16)
    assert not layout_copy.transpose_into(dest, value) and not dest.any()
    copy_into(dest, value)
    assert torch.equal(dest, value.to(torch.bfloat16))
    codes, scale = quantize_fp8_blockwise(value, BLOCK, "ue8m0")
    layout = QuantLayout(fp8_block=BLOCK, fp4_group=32, scale_fmt="ue8m0")
    out = _input_major((70, 300), torch.float32)
    dequantize(codes, scale, layout, (70, 300), torch.float32, out=out)
    assert torch.equal(out, dequantize_fp8_blockwise(codes, scale, BLOCK, torch.float32))


def _laid_out_like(dest: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` with `dest`'s strides (a resident-format tensor another engine hands over)."""
    out = torch.empty_strided(dest.shape, dest.stride(), dtype=value.dtype)
    out.copy_(value)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["cached_stores", "streaming_stores"])
@pytest.mark.parametrize("layout", ["transposing", "straight"])
@pytest.mark.parametrize("shape", [(130, 70), (48, 40), (31, 15), (2, 5)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16)])
def test_copy_checking_finite_finds_every_nonfinite_value(kernels, layout, shape, dtypes, stream):
    """The fused check: a finite tensor is copied bit for bit and reported finite; one infinity or NaN
    anywhere (register blocks, the ragged columns, the ragged rows; a streamed straight copy's unaligned
    head, its streamed lines and its tail) is reported."""
    incoming, resident = dtypes
    values = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(incoming)
    dest = _input_major(shape, resident)

    def run(v: torch.Tensor) -> bool | None:
        return layout_copy.copy_checking_finite(dest, v if layout == "transposing" else _laid_out_like(dest, v),
                                                kernels, stream=stream)

    assert run(values) is True
    bits = torch.int16 if resident.itemsize == 2 else torch.int32
    assert torch.equal(dest.contiguous().view(bits), values.to(resident).view(bits))
    rows, cols = shape
    for r, c in {(0, 0), (rows // 2, cols // 2), (rows - 1, cols - 1), (0, cols - 1), (rows - 1, 0)}:
        for bad in (float("nan"), float("inf"), -float("inf")):
            corrupt = values.clone()
            corrupt[r, c] = bad
            assert run(corrupt) is False, (r, c, bad)


def test_copy_checking_finite_refuses_values_that_overflow_the_resident_dtype(kernels):
    values = torch.ones(40, 48)
    values[3, 5] = torch.finfo(torch.float32).max  # finite in fp32, infinite once rounded to bf16
    dest = _input_major((40, 48), torch.bfloat16)
    assert layout_copy.copy_checking_finite(dest, values, kernels) is False


def test_copy_checking_finite_declines_what_it_cannot_check():
    """Integer destinations, mismatched layouts: nothing written, the caller checks and copies itself."""
    table = torch.zeros(8, 4, dtype=torch.int32)
    assert layout_copy.copy_checking_finite(table, torch.ones(8, 4, dtype=torch.int32)) is None
    dest = torch.zeros(6, 10)[:, ::2]  # neither input-major nor dense
    assert layout_copy.copy_checking_finite(dest, torch.ones(6, 5)) is None and not dest.any()


@pytest.mark.parametrize("stream", [False, True], ids=["cached_stores", "streaming_stores"])
@pytest.mark.parametrize("offset", [0, 1, 3, 31])  # elements into a 64-byte aligned buffer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_straight_copy_checks_every_position_at_any_alignment(kernels, dtype, offset, stream):
    """A straight copy starting off the stores' alignment: the unaligned head, the aligned lines and the tail
    are all copied bit for bit and all checked."""
    n = 1000
    base = torch.zeros(n + 64, dtype=dtype)
    dest = base[offset : offset + n]
    values = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert layout_copy.copy_checking_finite(dest, values, kernels, stream=stream) is True
    assert torch.equal(dest, values) and not base[:offset].any() and not base[offset + n :].any()
    for position in (0, 1, 7, 8, 63, 64, 500, n - 2, n - 1):
        corrupt = values.clone()
        corrupt[position] = float("inf")
        assert layout_copy.copy_checking_finite(dest, corrupt, kernels, stream=stream) is False, position


def test_streamed_byte_copies_are_exact_at_any_alignment_and_size(kernels):
    """copy_bytes_streamed: many copies in one call, each from and to any byte offset, of any length
    (empty, under one store, under one line, several lines plus a tail), bytes outside untouched."""
    generator = torch.Generator().manual_seed(5)
    sizes = [0, 1, 31, 32, 127, 128, 129, 1000, 4096 + 17]
    pairs = []
    for i, size in enumerate(sizes):
        src = torch.randint(0, 256, (size + 80,), dtype=torch.uint8, generator=generator)[i % 7 :][:size]
        dst_base = torch.zeros(size + 80, dtype=torch.uint8)
        pairs.append((src, dst_base, (3 * i) % 33))
    copies = [(src.data_ptr(), base.data_ptr() + at, src.numel()) for src, base, at in pairs]
    assert layout_copy.copy_bytes_streamed(copies, kernels)
    for src, base, at in pairs:
        n = src.numel()
        assert torch.equal(base[at : at + n], src)
        assert not base[:at].any() and not base[at + n :].any()
    assert layout_copy.copy_bytes_streamed([], kernels)


def test_streamed_byte_copies_decline_without_a_compiler(monkeypatch):
    monkeypatch.setattr(layout_copy, "_library", lambda: None)
    dest = torch.zeros(64, dtype=torch.uint8)
    assert not layout_copy.copy_bytes_streamed([(torch.ones(64, dtype=torch.uint8).data_ptr(), dest.data_ptr(), 64)])
    assert not dest.any()
