"""dsv4/kernels/bf16_products.py: bf16 products widened to fp32 on CPUs without bf16 matrix units.

Reference: each product computed in fp64 on the same bf16 values (exact up to fp64 rounding) and rounded to
bf16 once. The widened path sums in fp32 and rounds once, so it is within one bf16 rounding of that (half
a unit in the last place, 2^-8 relative; the fp32 sums' own error is ~2^-20 relative). torch's own bf16 ops (fp32
accumulation, one rounding) obey the same bound, so both paths are also compared with each other. The
widened path is forced with `WIDENS_BF16` set for the test (it is the default on a CPU without AMX-BF16 /
AVX512-BF16), and the passthrough checked to be torch's op exactly.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from dsv4.kernels import bf16_products
from dsv4.kernels.bf16_products import PANEL_ELEMENTS
from dsv4.kernels.registry import describe_backends

BF16_STEP = 2.0**-8  # one bf16 rounding (half a unit in the last place), relative bound (8 significant bits)
BF16_ULP = 2.0**-7  # one unit in the last place of a bf16 value, relative bound


def _bf16(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).bfloat16()


def _assert_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got (bf16) is `exact` (fp64) rounded once, up to one bf16 step either way."""
    assert got.dtype == torch.bfloat16
    scale = exact.abs().max().item()
    torch.testing.assert_close(got.double(), exact, rtol=BF16_STEP, atol=BF16_STEP * scale * 2**-6)


@pytest.fixture(params=[True, False], ids=["widened", "torch"])
def widening(request, monkeypatch):
    """Runs the test with bf16 products widened, and with torch's bf16 ops (the bf16-unit CPUs' path)."""
    monkeypatch.setattr(bf16_products, "WIDENS_BF16", request.param)
    return request.param


def test_rule_follows_the_cpu_and_takes_only_bf16_cpu_operands():
    a = _bf16(2, 3, seed=0)
    assert bf16_products.WIDENS_BF16 == (not bf16_products.BF16_MATRIX_UNITS)
    assert bf16_products.widens(a, a) == bf16_products.WIDENS_BF16
    assert not bf16_products.widens(a.float(), a.float())  # fp32 products: always torch's
    assert not bf16_products.widens(a, a.float())
    assert bf16_products.describe() in describe_backends()  # `dsv4 env` names the choice


def test_bmm_and_out(widening):
    a, b = _bf16(5, 7, 33, seed=1), _bf16(5, 19, 33, seed=2).transpose(1, 2)  # a transposed operand, as attention
    exact = torch.bmm(a.double(), b.double())
    got = bf16_products.bmm(a, b)
    _assert_one_rounding(got, exact)
    out = torch.empty(5, 7, 19, dtype=torch.bfloat16)
    assert bf16_products.bmm(a, b, out=out) is out and torch.equal(out, got)
    if not widening:
        assert torch.equal(got, torch.bmm(a, b))


def test_baddbmm(widening):
    bias, a, b = _bf16(3, 4, 9, seed=3), _bf16(3, 4, 40, seed=4), _bf16(3, 40, 9, seed=5)
    got = bf16_products.baddbmm(bias, a, b)
    _assert_one_rounding(got, torch.baddbmm(bias.double(), a.double(), b.double()))
    f32 = [t.float() for t in (bias, a, b)]  # fp32 operands take torch's op whatever the rule
    assert torch.equal(bf16_products.baddbmm(*f32, alpha=0.5), torch.baddbmm(*f32, alpha=0.5))


def test_matmul(widening):
    x, w = _bf16(6, 48, seed=6), _bf16(4, 24, 48, seed=7)
    exact = torch.matmul(x.double(), w.double().transpose(1, 2))
    _assert_one_rounding(bf16_products.matmul(x, w.transpose(1, 2)), exact)


@pytest.mark.parametrize("out_features", [40, PANEL_ELEMENTS // 64 + 37])  # one panel; two, the last partial
def test_linear_on_an_input_major_weight(widening, out_features):
    x = _bf16(3, 5, 64, seed=10)
    weight = _bf16(64, out_features, seed=11).t()  # [out, in] stored input-major, as model.linear does
    got = bf16_products.linear(x, weight)
    assert got.shape == (3, 5, out_features)
    _assert_one_rounding(got, F.linear(x.double(), weight.double()))
    if not widening:
        assert torch.equal(got, F.linear(x, weight))


def test_widened_products_agree_with_torch_bf16_ops(monkeypatch):
    """Both are fp32 sums rounded once: at most one unit in the last place apart, element by element."""
    x, weight = _bf16(70, 96, seed=12), _bf16(96, 50, seed=13).t()
    want = F.linear(x, weight)
    monkeypatch.setattr(bf16_products, "WIDENS_BF16", True)
    got = bf16_products.linear(x, weight)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * BF16_ULP).all()


def test_grouped_mm_with_empty_groups(widening):
    """Rows grouped by expert (offsets = each group's end), an expert without rows included."""
    x, w = _bf16(10, 32, seed=14), _bf16(4, 32, 24, seed=15)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    got = bf16_products.grouped_mm(x, w, offsets)
    bounds = [0, *offsets.tolist()]
    exact = torch.cat([x[s:e].double() @ w[g].double() for g, (s, e) in enumerate(itertools.pairwise(bounds))])
    _assert_one_rounding(got, exact)
    if not widening:
        assert torch.equal(got, torch._grouped_mm(x, w, offs=offsets))


def test_fp32_grouped_mm_is_torchs(widening):
    x, w = _bf16(6, 16, seed=16).float(), _bf16(2, 16, 8, seed=17).float()
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    assert torch.equal(bf16_products.grouped_mm(x, w, offsets), torch._grouped_mm(x, w, offs=offsets))
