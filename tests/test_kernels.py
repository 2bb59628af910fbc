"""Every fast path against its torch reference (fp32), plus the registry's fallback behaviour."""

import pytest
import torch

from dsv4.config import ModelConfig
from dsv4.embedded import EMBEDDED_MODELS
from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.kernels.mhc_cpu import MhcCpuKernel, build_library
from dsv4.kernels.registry import (
    _BACKENDS,
    GRAPH_OPS,
    MHC_COEFFICIENTS,
    MOE_EXPERTS,
    REFERENCE,
    Choice,
    KernelRegistry,
    default_registry,
    describe_backends,
)
from dsv4.model import mhc
from dsv4.model.batch import ForwardBatch
from dsv4.model.deepseek_v4 import DeepseekV4

HC = 4
MIX = 2 * HC + HC * HC


@pytest.fixture(scope="module")
def mhc_kernel() -> MhcCpuKernel:
    return MhcCpuKernel(build_library())


@pytest.mark.parametrize("tokens, iters, hc_eps", [(1, 20, 1e-6), (37, 20, 1e-6), (5, 1, 1e-3), (8, 7, 0.0)])
def test_mhc_cpu_kernel_matches_reference(mhc_kernel, tokens, iters, hc_eps):
    g = torch.Generator().manual_seed(tokens * 100 + iters)
    logits = torch.randn(tokens, MIX, generator=g) * 3
    base = torch.randn(MIX, generator=g)
    scale = torch.rand(3, generator=g) * 2
    assert mhc_kernel.supports(logits, base, scale, HC, iters, hc_eps)
    fast = mhc_kernel(logits, base, scale, HC, iters, hc_eps)
    ref = mhc.coefficients_reference(logits, base, scale, HC, iters, hc_eps)
    for got, want in zip(fast, ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_mhc_cpu_kernel_declines_what_it_cannot_run(mhc_kernel):
    base, scale = torch.zeros(MIX), torch.ones(3)
    assert not mhc_kernel.supports(torch.zeros(2, MIX, dtype=torch.float64), base, scale, HC, 20, 1e-6)
    assert not mhc_kernel.supports(torch.zeros(2, MIX), base, scale, HC, 0, 1e-6)


def test_dispatching_coefficients_equals_reference():
    """A block's coefficients (the registry's C kernel, which must serve them) against the reference formula."""
    from dsv4.model.block import Block

    cfg = ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])
    block = Block(cfg, cfg.layer_types[0], cfg.mlp_layer_types[0], "dense", torch.float32, KernelRegistry())
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, cfg.hc_mix, generator=g)
    block.hc_ffn_base.copy_(torch.randn(cfg.hc_mix, generator=g))
    block.hc_ffn_scale.copy_(torch.rand(3, generator=g))
    args = (logits, block.hc_ffn_base, block.hc_ffn_scale, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    assert block.kernels.kernel(MHC_COEFFICIENTS, *args) is not None
    for got, want in zip(block._coefficients(logits, "ffn"), mhc.coefficients_reference(*args)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_registry_falls_back_with_reason(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("DSV4_KERNEL_CACHE", "/nonexistent-cache-dir")
    choice = KernelRegistry().choose(MHC_COEFFICIENTS)
    assert choice.backend == REFERENCE and choice.impl is None
    assert "no C compiler" in choice.reason


def test_registry_forced_reference_and_description():
    assert KernelRegistry(force_reference=True).choose(MHC_COEFFICIENTS).is_reference
    text = describe_backends()
    assert MHC_COEFFICIENTS in text
    with pytest.raises(KeyError):
        KernelRegistry().choose("no_such_op")


class _SpyKernel:
    """An implementation that records each `supports` question and answers yes."""

    def __init__(self):
        self.asked = 0

    def supports(self, *args) -> bool:
        self.asked += 1
        return True


def test_registry_declines_c_kernel_ops_inside_a_captured_graph(monkeypatch):
    """While a graph is captured, a C kernel's op is declined before its choice or `supports` is read (a
    compiled step then guards nothing of the kernel objects); the ops whose fast paths are torch code
    (GRAPH_OPS) still ask theirs."""
    registry = KernelRegistry()
    spies = {op: _SpyKernel() for op in _BACKENDS}
    for op, spy in spies.items():
        registry._choices[op] = Choice(op, "spy", spy, "test")
    assert MOE_EXPERTS in GRAPH_OPS and all(registry.kernel(op) is spies[op] for op in _BACKENDS)  # eager: asked
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for op, spy in spies.items():
        asked = spy.asked
        got = registry.kernel(op)
        assert (got is spy, spy.asked - asked) == ((True, 1) if op in GRAPH_OPS else (False, 0)), op


def _random_routing(tokens: int, k: int, seed: int):
    """Dense tiny-config experts with unit-scale random weights, and a random routing of `tokens` rows to
    k distinct experts each: (experts, x [T, D], ids [T, k], weights [T, k])."""
    from dsv4.model.moe import RoutedExperts

    cfg = ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])
    experts = RoutedExperts(cfg, "dense", None, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for name in ("w1", "w2", "w3"):
        getattr(experts, name).data.copy_(torch.randn(getattr(experts, name).shape, generator=g))
    x = torch.randn(tokens, cfg.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(tokens)])
    return experts, x, ids, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("tokens, k", [(1, 2), (16, 2), (5, 4)])
def test_gathered_experts_match_reference_loop(tokens, k):
    from dsv4.kernels.gathered_experts import GatheredExperts, swiglu

    experts, x, ids, weights = _random_routing(tokens, k, seed=tokens + k)
    kernel = GatheredExperts()
    args = (x, ids, weights, experts.w1, experts.w3, experts.w2, experts.limit, swiglu)
    assert kernel.supports(*args)
    got = kernel(*args)
    # Unit-scale random weights give outputs of size ~10: 1e-5 is fp32 accumulation-order noise.
    torch.testing.assert_close(got, experts.forward_reference(x, ids, weights), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts(x, ids, weights), got, rtol=1e-5, atol=1e-5)  # forward's fast path


def test_gathered_experts_decline_large_batches_and_large_experts():
    from dsv4.kernels.gathered_experts import MAX_GATHERED_ELEMENTS, GatheredExperts, swiglu

    def supports(picks: int, w1: torch.Tensor) -> bool:
        ids = torch.zeros(1, picks, dtype=torch.long)
        return GatheredExperts().supports(torch.zeros(1, 64), ids, ids.float(), w1, w1, w1.transpose(1, 2), 1.0, swiglu)

    w1 = torch.zeros(4, 32, 64)
    assert supports(MAX_GATHERED_ELEMENTS // (3 * 32 * 64), w1)
    assert not supports(MAX_GATHERED_ELEMENTS // (3 * 32 * 64) + 1, w1)
    assert not supports(1, torch.zeros(4, 256, 512))  # the small config's experts: loop


@pytest.mark.parametrize("tokens, k", [(1, 2), (16, 2), (37, 4)])
def test_grouped_experts_match_reference_loop(tokens, k):
    from dsv4.kernels.gathered_experts import build_grouped_experts, swiglu

    experts, x, ids, weights = _random_routing(tokens, k, seed=tokens * 3 + k)
    kernel = build_grouped_experts()
    assert kernel.supports(x, ids, weights, experts.w1, experts.w3, experts.w2, experts.limit, swiglu)
    want = experts.forward_reference(x, ids, weights)
    # Both of the kernel's paths, whichever __call__ would pick for this batch.
    for path in (kernel.grouped, kernel.all_experts, kernel):
        got = path(x, ids, weights, experts.w1, experts.w3, experts.w2, experts.limit, swiglu)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unaligned = torch.zeros(4, 30, 64)  # unaligned expert width: not for _grouped_mm
    assert not kernel.supports(x, ids, weights, unaligned, unaligned, unaligned.transpose(1, 2), 1.0, swiglu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_chunked_paths_equal_unchunked(monkeypatch, dtype):
    """With chunks of a few rows (a ragged last one included), the grouped experts' in-place SwiGLU and
    weighting, the bf16 expert weighting and the mix GEMM give what one pass over all rows gives."""
    from dsv4.kernels import row_chunks as row_chunks_module
    from dsv4.kernels.gathered_experts import _weighted, build_grouped_experts
    from dsv4.kernels.mhc_cpu import mix_gemm
    from dsv4.model.moe import swiglu

    experts, x, ids, weights = _random_routing(37, 2, seed=5)
    experts.to(dtype)
    x = x.to(dtype)
    g = torch.Generator().manual_seed(6)
    streams = torch.randn(29, HC, 48, generator=g).to(dtype)
    fn = torch.randn(MIX, HC * 48, generator=g)
    rows = torch.randn(3, 29, 40, generator=g).to(dtype)
    row_weights = torch.rand(3, 29, 1, generator=g)
    kernel = build_grouped_experts()

    def run():
        grouped = kernel.grouped(x, ids, weights, experts.w1, experts.w3, experts.w2, experts.limit, swiglu)
        return (grouped, mix_gemm(streams, fn), _weighted(rows, row_weights),
                _weighted(rows.clone(), row_weights, out=rows.clone()))

    whole = run()
    monkeypatch.setattr(row_chunks_module, "ROW_CHUNK_ELEMENTS", 7 * 48)
    assert len(row_chunks_module.row_chunks(74, 48)) == 11  # 10 chunks of 7 rows and one of 4
    chunked = run()
    assert torch.equal(chunked[0], whole[0])
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-5, atol=1e-4)  # |logits| ~ 15; GEMM blocking may differ
    assert torch.equal(chunked[2], (rows.float() * row_weights).to(dtype))
    assert torch.equal(chunked[3], chunked[2])


def test_grouped_experts_use_all_experts_only_for_small_experts_at_covering_batches():
    from dsv4.kernels.gathered_experts import MAX_ALL_EXPERTS_FLOPS, GroupedExperts

    tiny, small = torch.zeros(8, 32, 64), torch.zeros(16, 256, 512)  # the tiny / small bench configs' w1
    assert GroupedExperts.uses_all_experts(64, 2, tiny)
    assert not GroupedExperts.uses_all_experts(3, 2, tiny)  # 6 picks cannot cover 8 experts
    assert not GroupedExperts.uses_all_experts(16, 2, small)  # 16x the routed FLOPs of 131k-element experts
    flops_per_token = 2 * 3 * 8 * 32 * 64
    assert not GroupedExperts.uses_all_experts(MAX_ALL_EXPERTS_FLOPS // flops_per_token + 1, 2, tiny)


@pytest.fixture(scope="module")
def fused_kernels():
    from dsv4.kernels import norm_rope_cpu
    from dsv4.kernels.mhc_cpu import MhcFusedKernel

    return MhcFusedKernel(build_library()), norm_rope_cpu.NormRopeKernel(norm_rope_cpu.build_library())


# Token counts: below one Sinkhorn lane block (8 tokens), and two full blocks plus a partial one.
# (hc, D): the released hc (the kernel's unrolled path) with D a multiple of the 16 partial sums and not
# (their tail), and another hc (the run-time-hc path).
@pytest.mark.parametrize("T", [7, 19, 70])  # 70: past MAX_MIX_ROWS, torch's GEMM takes the mix
@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("hc, D", [(HC, 48), (HC, 50), (3, 37)])
def test_fused_mhc_pre_post_match_reference(fused_kernels, broadcast, T, hc, D):
    fused, _ = fused_kernels
    g = torch.Generator().manual_seed(11 + broadcast + T + D)
    iters, rms_eps, hc_eps = 20, 1e-6, 1e-3
    mix = 2 * hc + hc * hc
    hc_in = 1 if broadcast else hc
    streams = torch.randn(T, hc_in, D, generator=g)
    fn = torch.randn(mix, hc_in * D, generator=g) * 0.1
    base, scale = torch.randn(mix, generator=g), torch.rand(3, generator=g) * 2
    norm_w = 1 + 0.1 * torch.randn(D, generator=g)
    out = torch.randn(T, D, generator=g)
    assert fused.supports(streams, fn, base, scale, hc, iters, rms_eps, hc_eps, norm_w, 1e-5)
    coef, y = fused.pre(streams, fn, base, scale, hc, iters, rms_eps, hc_eps, norm_w, 1e-5)
    got_streams = fused.post(streams, out, coef, hc)

    from dsv4.model.norm import rms_norm

    if broadcast:
        e = streams[:, 0]
        pre, post, comb = mhc.coefficients_reference(
            mhc.mix_logits_broadcast(e, fn, rms_eps), base, scale, hc, iters, hc_eps
        )
        want_y = rms_norm((pre.sum(dim=-1, keepdim=True) * e).to(e.dtype), 1e-5, norm_w)
        want_streams = mhc.expand_broadcast(e, out, post, comb)
    else:
        pre, post, comb = mhc.coefficients_reference(
            mhc.mix_logits(streams, fn, rms_eps), base, scale, hc, iters, hc_eps
        )
        want_y = rms_norm(mhc.collapse(streams, pre), 1e-5, norm_w)
        want_streams = mhc.expand(streams, out, post, comb)
    for got, want in zip(coef.split([hc, hc, hc * hc], dim=-1), (pre, post, comb.flatten(1))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_streams, want_streams, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 19, 70])  # 70: past MAX_MIX_ROWS, torch's GEMM takes the mix
@pytest.mark.parametrize("hc, D", [(HC, 48), (3, 37)])
def test_mhc_head_kernel_matches_reference(dtype, T, hc, D):
    """The final pre-only collapse (MHC_HEAD) against `mhc.head_collapse`: fp32 to rounding, bf16 streams to a bf16
    rounding of the result; it declines fp32 streams with bf16 coefficients' parameters."""
    from dsv4.kernels.mhc_cpu import MhcHeadKernel

    kernel = MhcHeadKernel(build_library())
    g = torch.Generator().manual_seed(13 + T + D)
    rms_eps, hc_eps = 1e-6, 1e-3
    streams = torch.randn(T, hc, D, generator=g).to(dtype)
    fn = torch.randn(hc, hc * D, generator=g) * 0.1
    base, scale = torch.randn(hc, generator=g), torch.rand(1, generator=g) * 2
    assert kernel.supports(streams, fn, base, scale, rms_eps, hc_eps)
    assert not kernel.supports(streams, fn, base.bfloat16(), scale, rms_eps, hc_eps)
    got = kernel(streams, fn, base, scale, rms_eps, hc_eps)
    want = mhc.head_collapse(streams, fn, base, scale, rms_eps, hc_eps)
    assert got.dtype == want.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_token_mix_on_the_pool_equals_one_thread_and_each_token_alone(dtype):
    """The mix GEMM of a decode step's tokens (MAX_MIX_ROWS of them, and fewer tokens than threads, whose outputs are
    cut over the threads) spread over the few-row kernels' pool: bit for bit what the caller's thread alone gives,
    and each token's logits what that token alone gives (a dot product per output, whatever the batch or the
    threads)."""
    from dsv4.kernels.mhc_cpu import MAX_MIX_ROWS, MhcFusedKernel
    from dsv4.kernels.registry import MHC_FUSED, KernelRegistry

    pooled = KernelRegistry().choose(MHC_FUSED).impl
    assert pooled._pool is not None, "the fused mHC kernel got no worker pool"
    alone = MhcFusedKernel(build_library(), None)
    g = torch.Generator().manual_seed(23)
    streams = torch.randn(MAX_MIX_ROWS, HC, 96, generator=g).to(dtype)
    fn = torch.randn(MIX, HC * 96, generator=g)
    with pooled._pool.pinned_threads(4):
        got = pooled._few_token_mix(streams, fn)
        few = {rows: pooled._few_token_mix(streams[:rows], fn) for rows in (1, 3)}
    assert torch.equal(got, alone._few_token_mix(streams, fn))
    for rows, mix in few.items():
        assert torch.equal(mix, alone._few_token_mix(streams[:rows], fn)), rows
    for t in (0, 17, MAX_MIX_ROWS - 1):
        assert torch.equal(got[t], alone._few_token_mix(streams[t : t + 1], fn)[0]), t
    torch.testing.assert_close(got, streams.flatten(1).float() @ fn.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("broadcast", [False, True])
def test_fused_pre_and_post_on_the_pool_equal_one_thread(dtype, broadcast):
    """The fused pre-step (its Sinkhorn lanes included) and post-step of 21 tokens spread over the few-row kernels'
    pool (chunks that cut the 8-token lane blocks): bit for bit what the caller's thread alone gives, the post in
    place too."""
    from dsv4.kernels.mhc_cpu import MhcFusedKernel
    from dsv4.kernels.registry import MHC_FUSED, KernelRegistry

    pooled = KernelRegistry().choose(MHC_FUSED).impl
    alone = MhcFusedKernel(build_library(), None)
    g = torch.Generator().manual_seed(29)
    T, D, hc_in = 21, 96, 1 if broadcast else HC
    streams = torch.randn(T, hc_in, D, generator=g).to(dtype)
    fn = torch.randn(MIX, hc_in * D, generator=g) * 0.1
    base, scale, norm_w = torch.randn(MIX, generator=g), torch.rand(3, generator=g) * 2, torch.rand(D, generator=g)
    out = torch.randn(T, D, generator=g).to(dtype)
    args = (streams, fn, base, scale, HC, 20, 1e-6, 1e-3, norm_w, 1e-5)
    with pooled._pool.pinned_threads(4):
        coef, y = pooled.pre(*args)
        new = pooled.post(streams, out, coef, HC)
        in_place = pooled.post(streams.clone(), out, coef, HC, in_place=not broadcast)
    coef_alone, y_alone = alone.pre(*args)
    assert torch.equal(coef, coef_alone) and torch.equal(y, y_alone)
    assert torch.equal(new, alone.post(streams, out, coef, HC)) and torch.equal(in_place, new)


def test_few_token_mix_without_avx512_equals_the_vector_build():
    """A build for a CPU without AVX-512 (one dot product at a time, plain C) gives what this CPU's build gives,
    to fp32 rounding (it rounds each product where the vector build fuses them)."""
    import platform

    from dsv4.kernels.mhc_cpu import MhcFusedKernel

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-march names a CPU without AVX-512 on x86-64 only")
    g = torch.Generator().manual_seed(31)
    streams, fn = torch.randn(5, HC, 96, generator=g), torch.randn(MIX, HC * 96, generator=g)
    plain = MhcFusedKernel(build_library(march="x86-64-v2"), None)._few_token_mix(streams, fn)
    native = MhcFusedKernel(build_library(), None)._few_token_mix(streams, fn)
    torch.testing.assert_close(plain, native, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("norm", [None, "plain", "weighted"])
def test_norm_rope_kernel_odd_head_dim_matches_reference(fused_kernels, norm):
    """A head dim that is not a multiple of the kernel's 16 partial sums (their tail) and G > 1 heads."""
    from dsv4.model.norm import rms_norm, rms_normalize
    from dsv4.model.rope import RotaryTable, apply_rotary

    _, kernel = fused_kernels
    cfg = ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])
    table = RotaryTable(cfg.rope_main)
    g = torch.Generator().manual_seed(13)
    hd = 2 * table.inv_freq.numel() + 23  # 16 rotary channels and 23 others: 39
    x = torch.randn(6, 5, hd, generator=g) * 2
    positions = torch.randint(0, 500, (6,), generator=g)
    weight = 1 + 0.1 * torch.randn(hd, generator=g)
    want = x
    if norm == "plain":
        want = rms_normalize(want, 1e-6)
    elif norm == "weighted":
        want = rms_norm(want, 1e-6, weight)
    want = apply_rotary(want, *table.cos_sin(positions))
    got = kernel(x.clone(), None if norm is None else 1e-6, weight if norm == "weighted" else None,
                 positions, table.inv_freq)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm, inverse", [(None, False), ("plain", False), ("weighted", False), (None, True)])
def test_norm_rope_kernel_matches_reference(fused_kernels, norm, inverse):
    from dsv4.model.norm import rms_norm, rms_normalize
    from dsv4.model.rope import RotaryTable, apply_rotary

    _, kernel = fused_kernels
    cfg = ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])
    table = RotaryTable(cfg.rope_compress)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 3, cfg.head_dim, generator=g) * 2
    positions = torch.randint(0, 1000, (9,), generator=g)
    weight = 1 + 0.1 * torch.randn(cfg.head_dim, generator=g)
    want = x
    if norm == "plain":
        want = rms_normalize(want, 1e-6)
    elif norm == "weighted":
        want = rms_norm(want, 1e-6, weight)
    cos, sin = table.cos_sin(positions)
    want = apply_rotary(want, cos, sin, inverse=inverse)
    args = (None if norm is None else 1e-6, weight if norm == "weighted" else None, positions, table.inv_freq, inverse)
    assert kernel.supports(x, *args)
    got = kernel(x.clone(), *args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # And the model's entry point (registry fast path) equals its torch reference.
    from dsv4.model.rope import norm_rope_

    assert not kernel.supports(x.double(), *args)
    ref64 = norm_rope_(x.double(), None if norm is None else 1e-6, weight.double() if norm == "weighted" else None,
                       positions, table, inverse)  # float64: the reference path
    torch.testing.assert_close(got.double(), ref64, rtol=1e-5, atol=1e-5)


# bf16 through the fp32 kernel vs the bf16 reference, which rounds to bf16 after the norm and again after
# the rotation (the kernel rounds once): they differ by about two bf16 ulps (2^-8 relative) of values of
# size ~2, far below the O(1) error of a wrong norm, angle or channel.
BF16_TOL = dict(rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("norm, inverse", [(None, False), ("plain", False), ("weighted", False), ("weighted", True)])
def test_norm_rope_kernel_bf16_matches_reference(fused_kernels, norm, inverse):
    from dsv4.model.rope import RotaryTable, norm_rope_

    _, kernel = fused_kernels
    cfg = ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])
    table = RotaryTable(cfg.rope_compress, KernelRegistry(force_reference=True))  # norm_rope_'s reference path
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(9, 3, cfg.head_dim, generator=g) * 2).bfloat16()
    positions = torch.randint(0, 1000, (9,), generator=g)
    weight = 1 + 0.1 * torch.randn(cfg.head_dim, generator=g)
    eps, w = (None if norm is None else 1e-6), (weight if norm == "weighted" else None)
    assert kernel.supports(x, eps, w, positions, table.inv_freq, inverse)
    want = norm_rope_(x.clone(), eps, w, positions, table, inverse)
    got = kernel(x.clone(), eps, w, positions, table.inv_freq, inverse)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, **BF16_TOL)
    # bf16 rows are widened and rounded once: bit for bit the fp32 kernel on the widened values.
    assert torch.equal(got, kernel(x.float(), eps, w, positions, table.inv_freq, inverse).bfloat16())
    # The rotation-free part of each head (norm off) passes through the fp32 round trip bit-exactly.
    if norm is None:
        nope = cfg.head_dim - 2 * table.inv_freq.numel()
        torch.testing.assert_close(got[..., :nope], x[..., :nope], rtol=0, atol=0)


def test_rms_norm_bf16_fast_path_matches_reference(fused_kernels):
    from dsv4.model.norm import RMSNorm

    _, kernel = fused_kernels
    g = torch.Generator().manual_seed(8)
    norm = RMSNorm(64, 1e-6, KernelRegistry(force_reference=True))
    norm.weight.data.copy_(1 + 0.1 * torch.randn(64, generator=g))
    x = (torch.randn(5, 64, generator=g) * 3).bfloat16()
    got = kernel(x.clone(), norm.eps, norm.weight)
    # One rounding each (the reference normalises and weights in fp32 too): at most one bf16 ulp apart.
    torch.testing.assert_close(got, norm(x), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("broadcast", [False, True])
def test_fused_mhc_bf16_matches_reference(fused_kernels, broadcast):
    """bf16 streams are read and written as bf16 with fp32 arithmetic: bit for bit what widening them,
    running the fp32 kernel and rounding with torch's `.to(torch.bfloat16)` gives, and within bf16 rounding
    of the fp32 reference on the same values."""
    fused, _ = fused_kernels
    g = torch.Generator().manual_seed(29 + broadcast)
    T, D, iters, rms_eps, hc_eps = 11, 48, 20, 1e-6, 1e-3
    hc_in = 1 if broadcast else HC
    streams = torch.randn(T, hc_in, D, generator=g).to(torch.bfloat16)
    fn = torch.randn(MIX, hc_in * D, generator=g) * 0.1
    base, scale = torch.randn(MIX, generator=g), torch.rand(3, generator=g) * 2
    norm_w = 1 + 0.1 * torch.randn(D, generator=g)
    out = torch.randn(T, D, generator=g).to(torch.bfloat16)
    assert fused.supports(streams, fn, base, scale, HC, iters, rms_eps, hc_eps, None, 1e-5)
    coef, y = fused.pre(streams, fn, base, scale, HC, iters, rms_eps, hc_eps, None, 1e-5)
    got_streams = fused.post(streams, out, coef, HC)
    assert y.dtype == torch.bfloat16 and got_streams.dtype == torch.bfloat16
    s32 = streams.float()
    coef32, y32 = fused.pre(s32, fn, base, scale, HC, iters, rms_eps, hc_eps, None, 1e-5)
    assert torch.equal(coef, coef32)
    assert torch.equal(y, y32.to(torch.bfloat16))
    assert torch.equal(got_streams, fused.post(s32, out.float(), coef32, HC).to(torch.bfloat16))
    _, y_normed = fused.pre(streams, fn, base, scale, HC, iters, rms_eps, hc_eps, norm_w, 1e-5)
    _, y32_normed = fused.pre(s32, fn, base, scale, HC, iters, rms_eps, hc_eps, norm_w, 1e-5)
    assert torch.equal(y_normed, y32_normed.to(torch.bfloat16))
    if broadcast:
        e = s32[:, 0]
        pre, post, comb = mhc.coefficients_reference(
            mhc.mix_logits_broadcast(e, fn, rms_eps), base, scale, HC, iters, hc_eps
        )
        want_y = pre.sum(dim=-1, keepdim=True) * e
        want_streams = mhc.expand_broadcast(e, out.float(), post, comb)
    else:
        pre, post, comb = mhc.coefficients_reference(mhc.mix_logits(s32, fn, rms_eps), base, scale, HC, iters, hc_eps)
        want_y = mhc.collapse(s32, pre)
        want_streams = mhc.expand(s32, out.float(), post, comb)
    for got, want in zip(coef.split([HC, HC, HC * HC], dim=-1), (pre, post, comb.flatten(1))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bf16_tol = dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), want_y, **bf16_tol)
    torch.testing.assert_close(got_streams.float(), want_streams, **bf16_tol)


def test_bf16_rounding_matches_torch(fused_kernels):
    """The kernel's fp32 -> bf16 store rounds like torch's `.to(torch.bfloat16)`: ties to even (both ways),
    a tie at the largest finite value to inf, subnormals, inf and NaN."""
    fused, _ = fused_kernels
    bf16_max = torch.finfo(torch.bfloat16).max
    # New stream j = R_0 + R_1 (comb rows 0 and 1 are 1, post is 0): sums of two bf16 values, exact in fp32,
    # that land on or near a bf16 rounding boundary.
    r0 = [1.0, 1.0, -1.0, 1.0, bf16_max, bf16_max, 1e-40, float("inf"), float("nan"), 2.5, 0.1, 7.0]
    r1 = [2**-8, 3 * 2**-8, -(2**-8), 2**-9, 2.0**119, 2.0**118, 3e-41, 1.0, 1.0, 2**-7 + 2**-8, 1e-3, -(2**-6)]
    D = len(r0)
    streams = torch.zeros(1, HC, D, dtype=torch.bfloat16)
    streams[0, 0], streams[0, 1] = torch.tensor(r0).bfloat16(), torch.tensor(r1).bfloat16()
    coef = torch.zeros(1, MIX)
    comb = coef[0, 2 * HC :].view(HC, HC)
    comb[0], comb[1] = 1.0, 1.0
    got = fused.post(streams, torch.zeros(1, D, dtype=torch.bfloat16), coef, HC)[0, 0]
    want = (streams[0, 0].float() + streams[0, 1].float()).to(torch.bfloat16)
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any() and want.isinf().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mhc_post_in_place(fused_kernels, dtype):
    """in_place writes the new streams over the old ones (same storage), bit-identical to a fresh result."""
    fused, _ = fused_kernels
    g = torch.Generator().manual_seed(41)
    T, D = 13, 48
    streams = torch.randn(T, HC, D, generator=g).to(dtype)
    out = torch.randn(T, D, generator=g).to(dtype)
    coef, _ = fused.pre(streams, torch.randn(MIX, HC * D, generator=g) * 0.1,
                        torch.randn(MIX, generator=g), torch.rand(3, generator=g), HC, 20, 1e-6, 1e-3, None, 1e-5)
    want = fused.post(streams, out, coef, HC)
    buffer = streams.clone()
    got = fused.post(buffer, out, coef, HC, in_place=True)
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(got, want) and not torch.equal(got, streams)
    with pytest.raises(ValueError, match="in-place mHC post"):
        fused.post(streams[:, :1].contiguous(), out, coef, HC, in_place=True)


def test_in_place_streams_leave_captured_layers_intact():
    """The fused mHC path overwrites a layer's input streams unless the caller keeps them: the layers a
    drafter captures (0 and 2 here, of 4) must come out as the reference path computes them, in their own
    buffers, while the uncaptured layer 1 is updated in place by layer 2."""
    llm = LLM("dsv4-tiny-dummy", load_format="dummy", dtype="float32", seed=8)
    target = llm.loaded.target
    assert not default_registry().choose("mhc_fused").is_reference
    batch = ForwardBatch.build([(0, list(range(3, 40)), 0), (1, list(range(50, 61)), 0)])

    def forward(capture):
        return target(batch, target.allocate_cache(2, 64), capture_layers=capture)

    streams, captured = forward((0, 2))
    _, layer1 = forward((1,))
    # The same weights in a model built with a reference-only registry.
    reference = DeepseekV4(target.cfg, target.layers[0].ffn.experts.format, target.dtype,
                           kernels=KernelRegistry(force_reference=True))
    reference.load_state_dict(target.state_dict())
    reference.process_weights_after_loading()
    want_streams, want = reference(batch, reference.allocate_cache(2, 64), capture_layers=(0, 1, 2))
    # The paths round differently (streams grow to ~40 over the layers): compare at 1e-4 of the scale.
    close = dict(rtol=1e-4, atol=1e-4 * want_streams.abs().max().item())
    for i in (0, 2):
        torch.testing.assert_close(captured[i], want[i], **close)
    torch.testing.assert_close(layer1[1], want[1], **close)
    torch.testing.assert_close(streams, want_streams, **close)
    assert len({captured[0].data_ptr(), captured[2].data_ptr(), streams.data_ptr()}) == 3


@pytest.mark.parametrize("draft", ["mtp", "dspark"])
def test_the_registry_given_to_llm_serves_every_module_and_leaves_the_default_alone(draft):
    """LLM(kernels=...) reaches every module of the target and its drafter (a drafter uses its target's),
    and building with a reference-only registry changes nothing in the process-wide one: another model built
    next still gets the fast paths (training builds its models this way while an engine may be serving)."""
    model = "dsv4-sort-dspark" if draft == "dspark" else "dsv4-sort"
    reference = KernelRegistry(force_reference=True)
    llm = LLM(model, kernels=reference, draft=draft, max_num_seqs=2, max_model_len=64)
    registries = {id(m.kernels) for role in llm.loaded.models.values() for m in role.modules() if hasattr(m, "kernels")}
    assert registries == {id(reference)}
    assert all(reference.choose(op).is_reference for op in ("mhc_fused", "norm_rope", "moe_experts"))
    fast = LLM("dsv4-tiny-dummy", load_format="dummy", dtype="float32", max_num_seqs=2, max_model_len=64)
    assert fast.loaded.target.kernels is default_registry()
    assert not default_registry().choose("mhc_fused").is_reference
    # the reference-path engine computes what the fast one does (greedy, same model)
    plain = LLM(model, max_num_seqs=2, max_model_len=64)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["3 1 2", "9 8 7 6"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
