"""`dsv4::quant_experts` (kernels/quant_experts.py), the op a compiled graph calls for FP8 / FP4 routed experts,
against the eager forward's reference (`RoutedExperts.forward_reference`: each used expert dequantized with
dsv4.quant, itself checked against independent formulas in test_quant.py, then the reference loop), at few
and many rows per expert (the fused kernel takes any count) and on a call the kernel declines; it runs the
fused kernel exactly where the registry's `supports` takes the call, and passes torch's custom-op checks
(schema, fake shapes)."""

import pytest
import torch

from dsv4.config import ModelConfig, QuantConfig
from dsv4.embedded import EMBEDDED_MODELS
from dsv4.kernels import quant_experts as quant_experts_module
from dsv4.kernels.quant_experts import quant_experts
from dsv4.model.moe import RoutedExperts
from dsv4.quant import quantize_fp4, quantize_fp8_blockwise

K = 2  # picks per token
# Unit-scale random weights give outputs of size ~1-10; the fused kernel sums in another order than the
# reference's GEMMs: fp32 rounding noise.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _experts(fmt: str, seed: int) -> RoutedExperts:
    """Tiny-config FP8 (128x128 blocks, fp32 scales) or FP4 experts holding quantized random weights."""
    cfg = ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])
    experts = RoutedExperts(cfg, fmt, QuantConfig(), torch.float32)
    g = torch.Generator().manual_seed(seed)
    for name in ("w1", "w3", "w2"):
        weight, scale = getattr(experts, name), getattr(experts, f"{name}_scale")
        for e in range(experts.num_experts):
            in_features = weight.shape[2] * (2 if fmt == "fp4" else 1)  # FP4: two codes per byte
            dense = torch.randn(weight.shape[1], in_features, generator=g)
            q, s = (quantize_fp8_blockwise(dense, experts.block, scale_fmt="float") if fmt == "fp8"
                    else quantize_fp4(dense, experts.group))
            weight[e].copy_(q)
            scale[e].copy_(s.float() if fmt == "fp8" else s)
    return experts


def _routing(experts: RoutedExperts, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts.w2.shape[1], generator=g)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:K] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, K, generator=g) + 0.1


def _op_args(experts: RoutedExperts, x, ids, weights, fused: bool) -> tuple:
    return (x, ids, weights, experts.w1, experts.w1_scale, experts.w3, experts.w3_scale, experts.w2,
            experts.w2_scale, list(experts.quant_block), experts.limit, fused)


class _SpyKernel:
    """Wraps the process's FusedQuantExperts and counts the calls it ran."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def supports(self, *args) -> bool:
        return self.kernel.supports(*args)

    def __call__(self, *args):
        self.calls += 1
        return self.kernel(*args)


@pytest.fixture
def spy(monkeypatch) -> _SpyKernel:
    spy = _SpyKernel(quant_experts_module._process_kernel())
    monkeypatch.setattr(quant_experts_module, "_process_kernel", lambda: spy)
    return spy


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_op_equals_reference_and_runs_the_fused_kernel_where_it_supports_the_call(spy, fmt):
    experts = _experts(fmt, seed=3)
    many = 16 * experts.num_experts // K  # 16 picks per expert on average: the kernel's many-row panel path
    for tokens, int32_ids in ((1, False), (3, False), (many, False), (3, True)):
        x, ids, weights = _routing(experts, tokens, seed=tokens)
        ids = ids.int() if int32_ids else ids  # int32 ids: a call the kernel declines (the loop runs it)
        want = experts.forward_reference(x, ids, weights)
        before = spy.calls
        got = quant_experts(*_op_args(experts, x, ids, weights, fused=True))
        assert spy.calls - before == (not int32_ids), tokens
        torch.testing.assert_close(got, want, **FP32_TOL)
        # The eager forward's own choice gives the same values.
        torch.testing.assert_close(experts(x, ids, weights), got, **FP32_TOL)
        # fused=False (a registry that resolved QUANT_EXPERTS to the reference): the reference itself.
        assert torch.equal(quant_experts(*_op_args(experts, x, ids, weights, fused=False)), want)
        assert spy.calls - before == (not int32_ids)


def test_op_takes_rows_of_any_strides():
    """A compiled graph may hand the op non-contiguous rows: the same result as contiguous ones."""
    experts = _experts("fp4", seed=4)
    x, ids, weights = _routing(experts, 5, seed=4)
    strided = torch.cat([x, x], dim=1)[:, : x.shape[1]]
    assert not strided.is_contiguous()
    torch.testing.assert_close(quant_experts(*_op_args(experts, strided, ids, weights, fused=True)),
                               quant_experts(*_op_args(experts, x, ids, weights, fused=True)), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_op_passes_torch_custom_op_checks(fmt):
    """Schema (no input mutated or aliased), the fake's shape and dtype against the real output, and the op
    traced with symbolic shapes. The schema check compares values with ops torch lacks for float8 (its
    `mul` on float8_e4m3fn), so FP8 stacks get the other checks only."""
    experts = _experts(fmt, seed=5)
    x, ids, weights = _routing(experts, 4, seed=5)
    checks = ("test_faketensor", "test_aot_dispatch_dynamic") + (("test_schema",) if fmt == "fp4" else ())
    torch.library.opcheck(quant_experts, _op_args(experts, x, ids, weights, fused=True), test_utils=checks)
