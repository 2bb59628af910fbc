"""The C kernels that write input-major resident weights (weights/layout_copy.py) give exactly the bytes of
torch's own path: a transposing copy (same dtype, bf16 <-> fp32) and FP8 dequantization with block scales,
on shapes with several tiles and ragged edges; and where no kernel applies, the caller's torch path runs."""

import pytest
import torch

from dsv4.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise
from dsv4.weights import layout_copy
from dsv4.weights.convert import QuantLayout, copy_into, dequantize

SHAPES = [(130, 2050), (256, 128), (3000, 70), (2, 5), (129, 33)]
BLOCK = (128, 128)


def _input_major(shape, dtype):
    return torch.zeros(shape[1], shape[0], dtype=dtype).t()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16)])
def test_transpose_matches_torch(shape, dtypes):
    incoming, resident = dtypes
    value = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e3).to(incoming)
    dest = _input_major(shape, resident)
    ptr = dest.data_ptr()
    assert layout_copy.transpose_into(dest, value)
    assert dest.data_ptr() == ptr
    bits = torch.int16 if resident.itemsize == 2 else torch.int32  # bit for bit: rounding ties, signed zeros
    assert torch.equal(dest.contiguous().view(bits), value.to(resident).view(bits))


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
