"""The few-row CPU kernels of dsv4/kernels/gemv_cpu.py against their torch references.

References: `F.linear` on the same (input-major) weight; FP8 / FP4 products against the dequantised weight
(dsv4.quant, itself checked against the independent formulas in test_quant.py) times the fp32 input;
routed experts against `loop_experts`, the model's reference loop. The kernels sum in a different order
than the references, so fp32 results agree to fp32 rounding and bf16 results to one bf16 rounding of
that. Shapes include widths that are not multiples of the vector width, the thread split or the blocks.
"""

import collections
import contextlib
import platform

import pytest
import torch
import torch.nn.functional as F

from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.kernels import gemv_cpu
from dsv4.kernels.gathered_experts import loop_experts
from dsv4.kernels.gemv_cpu import (
    MAX_BF16_DECODE_ROWS,
    MAX_BF16_ROWS,
    MAX_F32_DECODE_ROWS,
    MAX_F32_ROWS,
    MAX_PICKS_PER_EXPERT,
    MAX_WIDENING_ROWS,
    DenseGemv,
    FusedExperts,
    FusedQuantExperts,
    QuantGemv,
    SharedInputGemv,
    WorkerPool,
    build_library,
    describe,
)
from dsv4.kernels.registry import FEW_ROW_EXPERTS, LINEAR, QUANT_EXPERTS, SHARED_INPUT_LINEAR, KernelRegistry
from dsv4.model.attention import Attention
from dsv4.model.batch import ForwardBatch
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.linear import Linear, SharedInputLinears, input_major
from dsv4.model.moe import RoutedExperts, swiglu
from dsv4.quant import dequantize_fp4, dequantize_fp8_blockwise, quantize_fp4, quantize_fp8_blockwise

FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)  # FP4: one ue8m0 scale per 32 inputs of a row
LIMIT = 10.0
# fp32: the kernels' sums run in another order than MKL's; relative to the result's scale.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _cpu_flags() -> set[str]:
    try:
        return set(open("/proc/cpuinfo").read().split())
    except OSError:
        return set()


CPU_FLAGS = _cpu_flags()
X86 = platform.machine() in ("x86_64", "AMD64")
# This CPU's instruction set, a baseline x86-64 one (no AVX: the FP8/FP4 rows take the per-byte table paths,
# which this machine would otherwise never run) and, where this CPU runs it, x86-64-v3 (AVX2 + FMA: the
# 8-wide decode paths, which an AVX-512 machine would otherwise never run).
MARCHES = ["native", *(["x86-64-v2"] if X86 else []), *(["x86-64-v3"] if X86 and {"avx2", "fma"} <= CPU_FLAGS else [])]


@pytest.fixture(scope="module", params=MARCHES)
def lib(request):
    return build_library(march=request.param)


def test_builds_pick_the_decode_path_of_their_instruction_set(pool):
    """A native build decodes with AVX-512 on an AVX-512 CPU, with AVX2 shuffles on an AVX2 + FMA + F16C CPU, a
    baseline x86-64 build with tables, and the description (`dsv4 env`) says which."""
    native = build_library()
    want = 512 if "avx512f" in CPU_FLAGS else 256 if {"avx2", "fma", "f16c"} <= CPU_FLAGS else 0
    assert native.vector_isa() == want
    assert {512: "AVX-512", 256: "AVX2", 0: "per-byte tables"}[want] in describe(native, pool)
    if "x86-64-v2" in MARCHES:
        assert "per-byte tables" in describe(build_library(march="x86-64-v2"), pool)
    if "x86-64-v3" in MARCHES:
        assert build_library(march="x86-64-v3").vector_isa() == 256


@pytest.fixture(scope="module")
def pool(lib):
    workers = WorkerPool(lib, workers=1)  # calls use up to torch.get_num_threads() threads: 1 or 2 here
    yield workers
    workers.close()


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def _weight(out_features: int, in_features: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = input_major(out_features, in_features, dtype)
    w.copy_(torch.randn(out_features, in_features, generator=g) / in_features**0.5)
    return w


def _rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_fp32_product_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """fp32 results of x @ w.T against the exact (fp64) product, within the error bound of fp32 summation
    in any order: K * 2^-24 * sum_k |x_k w_k| per output. A bound on the result's own scale (rtol/atol)
    fails wherever terms cancel to near zero; a wrongly decoded weight is off by a whole term, far above."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.t()
    bound = x.shape[-1] * 2.0**-24 * (x64.abs() @ w64.abs().t())
    err = (got.double() - exact).abs()
    worst = (err / bound).argmax()
    assert bool((err <= bound).all()), f"error {err.flatten()[worst]:.3g} over its bound {bound.flatten()[worst]:.3g}"


def _assert_bf16_close(got: torch.Tensor, want_fp32: torch.Tensor) -> None:
    """bf16 results: within one bf16 rounding (2^-8 relative) of the fp32 product of the same values."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want_fp32, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 16384, 512), (1, 37, 33), (3, 1000, 7),
                                                             (8, 257, 130), (5, 2048, 64)])
def test_dense_gemv_fp32_matches_linear(lib, pool, two_threads, rows, out_features, in_features):
    """fp32 (the path the fused dense experts run; `supports` leaves fp32 projections to MKL)."""
    w = _weight(out_features, in_features, torch.float32, seed=out_features)
    x = _rows(rows, in_features, torch.float32, seed=rows)
    kernel = DenseGemv(lib, pool)
    _assert_fp32_product_close(kernel(x, w), x, w)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 4096, 512), (4, 301, 96)])
def test_dense_gemv_bf16_matches_linear(lib, pool, two_threads, rows, out_features, in_features):
    w = _weight(out_features, in_features, torch.bfloat16, seed=1)
    x = _rows(rows, in_features, torch.bfloat16, seed=2)
    got = DenseGemv(lib, pool)(x, w)
    _assert_bf16_close(got, F.linear(x.float(), w.float()))


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 4096, 512), (4, 301, 96), (3, 37, 33)])
def test_dense_gemv_fp32_rows_on_bf16_weight_match_widened_linear(lib, pool, two_threads, rows, out_features,
                                                                   in_features):
    """`LLM(dtype="bfloat16", activation_dtype="float32")`'s decode products: fp32 results of the fp32 rows
    times the exactly widened bf16 weight, as `F.linear(x, compute_weight(w))` computes them."""
    w = _weight(out_features, in_features, torch.bfloat16, seed=3)
    x = _rows(rows, in_features, torch.float32, seed=4)
    got = DenseGemv(lib, pool)(x, w)
    assert got.dtype == torch.float32
    _assert_fp32_product_close(got, x, w.float())


# (activation, weight) dtypes the shared-input kernel runs: each pair DenseGemv runs.
SHARED_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("act, wdtype", SHARED_DTYPES, ids=["fp32", "bf16", "fp32-on-bf16"])
@pytest.mark.parametrize("rows", [1, 3])
def test_shared_input_gemv_gives_each_weights_own_product_bit_for_bit(lib, pool, act, wdtype, rows):
    """Several weights of one input in one call (a decode layer's projections of its normed input): each
    output equals that weight's own DenseGemv call bit for bit, at 1 and 2 threads, for widths below the
    vector width, the split alignment and the parallel threshold and above them (so the call's chunks span
    weights of very different sizes)."""
    widths, in_features = [37, 512, 16, 4096, 300], 96
    weights = [_weight(n, in_features, wdtype, seed=i) for i, n in enumerate(widths)]
    x = _rows(rows, in_features, act, seed=rows)
    single, shared = DenseGemv(lib, pool), SharedInputGemv(lib, pool).bind(*weights)
    want = [single(x, w) for w in weights]
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = shared(x)
            assert [g.shape for g in got] == [(rows, n) for n in widths]
            assert all(g.dtype == act and torch.equal(g, w) for g, w in zip(got, want))
    finally:
        torch.set_num_threads(saved)


def test_shared_input_gemv_binds_only_weights_of_one_input_it_runs(lib, pool):
    """No kernel for one weight (that is DenseGemv's), weights of different input widths, a weight DenseGemv
    does not run (FP8 bytes, a row-major layout) or more than the call takes; rows: up to MAX_SHARED_ROWS that
    every weight's own product takes."""
    kernel = SharedInputGemv(lib, pool)
    a, b = _weight(40, 48, torch.float32, 0), _weight(24, 48, torch.float32, 1)
    assert kernel.bind(a) is None
    assert kernel.bind(a, _weight(40, 32, torch.float32, 2)) is None
    assert kernel.bind(a, torch.zeros(24, 48).to(torch.float8_e4m3fn)) is None
    assert kernel.bind(a, torch.zeros(24, 48)) is None  # row-major: not the resident layout
    assert kernel.bind(*[a] * (gemv_cpu.MAX_SHARED_WEIGHTS + 1)) is None
    bound = kernel.bind(a, b)
    assert bound is not None
    assert bound.supports(_rows(1, 48, torch.float32, 0))
    assert not bound.supports(_rows(MAX_F32_ROWS + 1, 48, torch.float32, 0))  # the rows DenseGemv leaves to MKL
    assert not bound.supports(_rows(gemv_cpu.MAX_SHARED_ROWS + 1, 48, torch.float32, 0), decode_rows=True)
    assert not bound.supports(_rows(1, 32, torch.float32, 0))


def test_shared_input_linears_bind_at_finalize_and_otherwise_run_each_linear(monkeypatch):
    """`SharedInputLinears` runs one kernel call once bound (finalize) and each Linear otherwise: before the
    bind, for rows the kernel does not take, and inside a graph being captured; every way gives the same
    values, and a refit's in-place copy is what the bound call reads."""
    registry = KernelRegistry()
    linears = [Linear(48, n, torch.float32, registry) for n in (40, 24, 8)]
    for i, linear in enumerate(linears):
        with torch.no_grad():
            linear.weight.copy_(_weight(linear.weight.shape[0], 48, torch.float32, seed=i))
        linear.bind_kernels()
    shared = SharedInputLinears(*linears)
    x = _rows(1, 48, torch.float32, seed=3)
    hits = collections.Counter()
    for linear in linears:
        linear.product = _CountedKernel(linear.product, hits, LINEAR)
    want = shared(x)  # not bound yet: one Linear (its own kernel) each
    assert hits[LINEAR] == 3
    shared.bind_kernels(registry)
    shared.product = _CountedKernel(shared.product, hits, SHARED_INPUT_LINEAR)
    got = shared(x)
    assert hits == {LINEAR: 3, SHARED_INPUT_LINEAR: 1}
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with torch.no_grad():
        linears[1].weight.copy_(_weight(24, 48, torch.float32, seed=9))  # a refit: same storage, new values
    _assert_fp32_product_close(shared(x)[1], x, linears[1].weight)
    assert hits[SHARED_INPUT_LINEAR] == 2
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert all(torch.equal(g, F.linear(x, linear.weight)) for g, linear in zip(shared(x), linears))
    monkeypatch.undo()
    more = _rows(MAX_F32_ROWS + 1, 48, torch.float32, seed=4)
    assert all(torch.equal(g, F.linear(more, linear.weight)) for g, linear in zip(shared(more), linears))
    assert hits[SHARED_INPUT_LINEAR] == 2


def test_dense_gemv_declines_what_it_cannot_run_or_loses(lib, pool):
    kernel = DenseGemv(lib, pool)
    bf16 = torch.bfloat16
    w = _weight(64, 32, bf16, seed=0)
    x = _rows(1, 32, bf16, seed=0)
    assert kernel.supports(x, w)
    assert not kernel.supports(x, w.t().contiguous().t().contiguous())  # output-major storage
    assert not kernel.supports(_rows(MAX_BF16_ROWS + 1, 32, bf16, 0), w)  # measured slower than the GEMM
    assert kernel.supports(x.float(), w.float())  # one fp32 row: as fast as MKL's GEMV, and not on OpenMP
    assert not kernel.supports(_rows(MAX_F32_ROWS + 1, 32, torch.float32, 0), w.float())  # MKL's GEMM
    assert kernel.supports(x.float(), w)  # fp32 rows on a bf16 weight: no widened copy of the weight
    assert kernel.supports(_rows(MAX_WIDENING_ROWS, 32, torch.float32, 0), w)
    assert not kernel.supports(_rows(MAX_WIDENING_ROWS + 1, 32, torch.float32, 0), w)  # measured slower
    assert not kernel.supports(x, w.float())  # bf16 rows on an fp32 weight: never built that way
    assert not kernel.supports(_rows(1, 64, bf16, 0)[:, ::2], w)  # row not contiguous
    assert not kernel.supports(_rows(1, 31, bf16, 0), w)  # width mismatch


def _fp8_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    q, scale = quantize_fp8_blockwise(w, FP8_BLOCK, scale_fmt="float")
    return q, scale.float()


def _fp4_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return quantize_fp4(w)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 512, 256), (3, 200, 300), (17, 129, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemv_matches_dequantized_product(lib, pool, two_threads, rows, out_features, in_features, dtype):
    q, scale = _fp8_weight(out_features, in_features, seed=in_features)
    x = _rows(rows, in_features, dtype, seed=3)
    kernel = QuantGemv(lib, pool)
    assert kernel.supports(x, q, scale, FP8_BLOCK)
    dequantized = dequantize_fp8_blockwise(q, scale, FP8_BLOCK)
    want = x.float() @ dequantized.t()
    got = kernel(x, q, scale, FP8_BLOCK)
    if dtype == torch.float32:
        _assert_fp32_product_close(got, x, dequantized)
    else:
        _assert_bf16_close(got, want)


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 256, 512), (2, 77, 96), (20, 512, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_gemv_matches_dequantized_product(lib, pool, two_threads, rows, out_features, in_features, dtype):
    packed, scale = _fp4_weight(out_features, in_features, seed=out_features)
    x = _rows(rows, in_features, dtype, seed=4)
    kernel = QuantGemv(lib, pool)
    assert kernel.supports(x, packed, scale, FP4_BLOCK)
    dequantized = dequantize_fp4(packed, scale)
    want = x.float() @ dequantized.t()
    got = kernel(x, packed, scale, FP4_BLOCK)
    if dtype == torch.float32:
        _assert_fp32_product_close(got, x, dequantized)
    else:
        _assert_bf16_close(got, want)


@pytest.mark.parametrize("pad", [0, 2])  # 254 inputs: the per-byte table path; 256: the vector path
def test_fp8_decode_covers_every_code(lib, pool, pad):
    """All 254 finite e4m3 codes (subnormals, both zeros, the largest normal) decode exactly: one-hot rows of x
    read the weight's values back one by one."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(pad, dtype=torch.uint8)])
    q = finite.view(torch.float8_e4m3fn).reshape(1, -1)
    scale = torch.ones(1, -(-q.shape[1] // 128))
    eye = torch.eye(q.shape[1])
    got = QuantGemv(lib, pool)(eye, q, scale, FP8_BLOCK)
    assert torch.equal(got[:, 0], q.float()[0])


def test_fp4_decode_covers_every_code(lib, pool):
    """All 16 e2m1 codes in both nibbles, and scales 2^-20 .. 2^20, decode exactly."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes.flip(0) << 4)).repeat(2).reshape(1, 32).view(torch.int8)  # 64 inputs
    scale = torch.tensor([[127 - 20, 127 + 20]], dtype=torch.uint8)
    eye = torch.eye(64)
    got = QuantGemv(lib, pool)(eye, packed, scale, FP4_BLOCK)
    assert torch.equal(got[:, 0], dequantize_fp4(packed, scale)[0])


def test_quant_gemv_declines_what_it_cannot_run(lib, pool):
    kernel = QuantGemv(lib, pool)
    packed, scale = _fp4_weight(64, 64, seed=0)
    x = _rows(1, 64, torch.float32, seed=0)
    assert kernel.supports(x, packed, scale, FP4_BLOCK)
    assert not kernel.supports(x, packed, scale, (1, 16))  # scale grid does not match the group
    assert not kernel.supports(_rows(1, 62, torch.float32, 0), packed, scale, FP4_BLOCK)
    assert not kernel.supports(x, packed, scale.float(), FP4_BLOCK)  # decoded scales, not e8m0 bytes
    q, s8 = _fp8_weight(200, 300, seed=0)  # scale grid 2 x 3 of 128-blocks
    x = _rows(1, 300, torch.float32, seed=0)
    assert kernel.supports(x, q, s8, FP8_BLOCK)
    assert not kernel.supports(x, q, s8, (64, 64))


# ---- routed experts ----
E, DIM, INTER = 8, 96, 64


def _routing(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g) + 0.1
    return ids, weights


def _dense_stacks(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    stacks = {}
    for name, (out_features, in_features) in (("w1", (INTER, DIM)), ("w3", (INTER, DIM)), ("w2", (DIM, INTER))):
        w = input_major(out_features, in_features, dtype, stack=(E,))
        w.copy_(torch.randn(E, out_features, in_features, generator=g) * 2 / in_features**0.5)
        stacks[name] = w
    return stacks


def _reference(x, ids, weights, expert_weight):
    return loop_experts(x, ids, weights, expert_weight, E, LIMIT, swiglu)


@pytest.mark.parametrize("tokens, k", [(1, 2), (5, 3), (64, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dense_experts_match_loop(lib, pool, two_threads, tokens, k, dtype):
    s = _dense_stacks(dtype, seed=tokens)
    x = _rows(tokens, DIM, dtype, seed=5)
    ids, weights = _routing(tokens, k, seed=tokens + k)
    kernel = FusedExperts(lib, pool)
    args = (x, ids, weights, s["w1"], s["w3"], s["w2"], LIMIT)
    # supports: only where the fused kernel was measured faster; the kernel itself runs any count
    assert kernel.supports(*args) == (tokens * k <= MAX_PICKS_PER_EXPERT[dtype] * E)
    got = kernel(*args)
    want = _reference(x, ids, weights, lambda name, e: s[name][e])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
    else:
        # The bf16 reference rounds the hidden rows and every product to bf16; the kernel keeps them fp32 and
        # rounds the sum: it must be at least as close to the exact (fp32) result as the reference is.
        exact = _reference(x.float(), ids, weights, lambda name, e: s[name][e].float())
        kernel_error, reference_error = (got.float() - exact).abs(), (want.float() - exact).abs()
        assert kernel_error.max() <= reference_error.max() and kernel_error.mean() <= reference_error.mean()


@pytest.mark.parametrize("tokens, k", [(1, 2), (5, 3)])
def test_fused_experts_fp32_rows_on_bf16_stacks_match_widened_loop(lib, pool, two_threads, tokens, k):
    """fp32 activations on bf16 expert stacks: the loop over the widened experts (what the model runs
    without the kernel) to fp32 tolerance."""
    s = _dense_stacks(torch.bfloat16, seed=tokens)
    x = _rows(tokens, DIM, torch.float32, seed=7)
    ids, weights = _routing(tokens, k, seed=tokens + k)
    kernel = FusedExperts(lib, pool)
    args = (x, ids, weights, s["w1"], s["w3"], s["w2"], LIMIT)
    assert kernel.supports(*args) == (tokens * k <= MAX_PICKS_PER_EXPERT[torch.bfloat16] * E)
    got = kernel(*args)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(x, ids, weights, lambda name, e: s[name][e].float()), **FP32_TOL)
    assert not kernel.supports(x.bfloat16(), ids, weights, s["w1"].float(), s["w3"].float(), s["w2"].float(), LIMIT)


def _quant_stacks(fmt: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    stacks = {}
    for name, (out_features, in_features) in (("w1", (INTER, DIM)), ("w3", (INTER, DIM)), ("w2", (DIM, INTER))):
        dense = torch.randn(E, out_features, in_features, generator=g) * 2 / in_features**0.5
        if fmt == "fp8":
            pairs = [quantize_fp8_blockwise(w, FP8_BLOCK, scale_fmt="float") for w in dense]
            stacks[name] = torch.stack([q for q, _ in pairs])
            stacks[f"{name}_scale"] = torch.stack([sc.float() for _, sc in pairs])
        else:
            pairs = [quantize_fp4(w) for w in dense]
            stacks[name] = torch.stack([q for q, _ in pairs])
            stacks[f"{name}_scale"] = torch.stack([sc for _, sc in pairs])
    return stacks


def _dequantized(stacks, fmt: str, block):
    def expert_weight(name: str, e: int) -> torch.Tensor:
        if fmt == "fp8":
            return dequantize_fp8_blockwise(stacks[name][e], stacks[f"{name}_scale"][e], block)
        return dequantize_fp4(stacks[name][e], stacks[f"{name}_scale"][e])
    return expert_weight


@pytest.mark.parametrize("fmt, block", [("fp8", FP8_BLOCK), ("fp4", FP4_BLOCK)])
@pytest.mark.parametrize("tokens, k", [(1, 2), (7, 2), (64, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_quant_experts_match_loop(lib, pool, two_threads, fmt, block, tokens, k, dtype):
    s = _quant_stacks(fmt, seed=tokens)
    x = _rows(tokens, DIM, dtype, seed=6)
    ids, weights = _routing(tokens, k, seed=tokens * k)
    kernel = FusedQuantExperts(lib, pool)
    args = (x, ids, weights, s["w1"], s["w1_scale"], s["w3"], s["w3_scale"], s["w2"], s["w2_scale"], block, LIMIT)
    assert kernel.supports(*args)  # any number of picks per expert (64 tokens: the panel path)
    got = kernel(*args)
    exact = _reference(x.float(), ids, weights, _dequantized(s, fmt, block))
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, **FP32_TOL)
    else:
        # As for dense bf16 experts: at least as close to the fp32 result as the bf16 reference loop is.
        def bf16_weight(name, e):
            return _dequantized(s, fmt, block)(name, e).to(torch.bfloat16)

        want = _reference(x, ids, weights, bf16_weight)
        kernel_error, reference_error = (got.float() - exact).abs(), (want.float() - exact).abs()
        assert kernel_error.max() <= reference_error.max() and kernel_error.mean() <= reference_error.mean()


def test_fused_quant_experts_slice_long_calls_without_changing_values(lib, pool, two_threads, monkeypatch):
    """A call whose scratch rows would pass MAX_EXPERT_SCRATCH_BYTES runs a slice of tokens at a time: the
    same bits as one call (each token's result is computed alone)."""
    s = _quant_stacks("fp4", seed=8)
    x = _rows(23, DIM, torch.float32, seed=8)
    ids, weights = _routing(23, 2, seed=8)
    args = (x, ids, weights, s["w1"], s["w1_scale"], s["w3"], s["w3_scale"], s["w2"], s["w2_scale"], FP4_BLOCK,
            LIMIT)
    kernel = FusedQuantExperts(lib, pool)
    whole = kernel(*args)
    per_token = 2 * (2 * DIM + 3 * INTER) * 4
    monkeypatch.setattr(gemv_cpu, "MAX_EXPERT_SCRATCH_BYTES", 5 * per_token)  # slices of 5 tokens, then 3
    assert torch.equal(kernel(*args), whole)


def test_fused_experts_decline_what_they_cannot_run(lib, pool):
    s = _dense_stacks(torch.float32, seed=0)
    x = _rows(4, DIM, torch.float32, seed=0)
    ids, weights = _routing(4, 2, seed=0)
    kernel = FusedExperts(lib, pool)
    assert kernel.supports(x, ids, weights, s["w1"], s["w3"], s["w2"], LIMIT)
    assert not kernel.supports(x, ids.int(), weights, s["w1"], s["w3"], s["w2"], LIMIT)
    assert not kernel.supports(x, ids, weights, s["w1"].contiguous(), s["w3"], s["w2"], LIMIT)  # output-major
    many = MAX_PICKS_PER_EXPERT[torch.float32] * E // 2 + 1  # k=2: more picks than measured to win
    big_ids, big_w = _routing(many, 2, seed=1)
    assert not kernel.supports(_rows(many, DIM, torch.float32, 0), big_ids, big_w, s["w1"], s["w3"], s["w2"], LIMIT)
    q = _quant_stacks("fp4", seed=0)
    quant = FusedQuantExperts(lib, pool)
    args = [x, ids, weights, q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"], FP4_BLOCK, LIMIT]
    assert quant.supports(*args)
    args[4] = q["w1_scale"][:, :, :1]  # scale grid of another group size
    assert not quant.supports(*args)


def test_fused_experts_reject_out_of_range_ids(lib, pool):
    s = _dense_stacks(torch.float32, seed=0)
    x = _rows(2, DIM, torch.float32, seed=0)
    ids, weights = _routing(2, 2, seed=0)
    ids[1, 0] = E
    with pytest.raises(ValueError, match="moe_experts"):
        FusedExperts(lib, pool)(x, ids, weights, s["w1"], s["w3"], s["w2"], LIMIT)


@pytest.mark.parametrize("rows", [48, 53])
def test_register_blocked_dense_rows_equal_each_row_alone(lib, pool, rows):
    """From 48 rows on (gemv_cpu.c BLOCKED_MIN_ROWS) fp32 weights take the register-blocked pass, a row alone the
    tile pass; both sum each output in the same spelled-out order, so every row equals itself computed alone, bit
    for bit, across the pass's row groups of 8 (53: a remainder of 5), its column blocks (300 columns: a second
    panel of 256 and a tail of 12) and its input panels (70 inputs: a second panel of 64, and two inputs after the
    groups of four); and each is the exact product within fp32 rounding."""
    w = _weight(300, 70, torch.float32, seed=11)
    x = _rows(rows, 70, torch.float32, seed=12)
    dense = DenseGemv(lib, pool)
    batched = dense(x, w)
    for r in range(rows):
        assert torch.equal(batched[r : r + 1], dense(x[r : r + 1], w))
    _assert_fp32_product_close(batched, x, w)


@pytest.mark.parametrize("rows", [6, 41])  # 41: FP8 / FP4 products and experts take the many-row panel path
def test_results_do_not_depend_on_threads_or_batch(lib, pool, rows):
    """Each output element is summed by one thread in a fixed order: 1 or 2 threads, and a row alone or with
    others, give bit-identical results (batch invariance), also where many rows per weight (or expert) run the
    quantized products' panel path and the row alone runs the one-weight-row pass."""
    saved = torch.get_num_threads()
    w = _weight(3000, 512, torch.float32, seed=9)
    packed, scale = _fp4_weight(1000, 512, seed=9)
    fp8, fp8_scale = quantize_fp8_blockwise(torch.randn(301, 256, generator=torch.Generator().manual_seed(9)),
                                            FP8_BLOCK, scale_fmt="float")
    s = _dense_stacks(torch.float32, seed=9)
    q4, q8 = _quant_stacks("fp4", seed=9), _quant_stacks("fp8", seed=9)
    x, x8 = _rows(rows, 512, torch.float32, seed=9), _rows(rows, 256, torch.float32, seed=10)
    xe = _rows(rows, DIM, torch.float32, seed=9)
    ids, weights = _routing(rows, 2, seed=9)
    dense, quant, experts = DenseGemv(lib, pool), QuantGemv(lib, pool), FusedExperts(lib, pool)
    quant_experts = FusedQuantExperts(lib, pool)

    def products(keep: slice) -> tuple[torch.Tensor, ...]:
        routed = (xe[keep], ids[keep], weights[keep])
        return (dense(x[keep], w), quant(x[keep], packed, scale, FP4_BLOCK),
                quant(x8[keep], fp8, fp8_scale.float(), FP8_BLOCK),
                experts(*routed, s["w1"], s["w3"], s["w2"], LIMIT),
                *(quant_experts(*routed, q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"],
                                block, LIMIT) for q, block in ((q4, FP4_BLOCK), (q8, FP8_BLOCK))))

    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((products(slice(None)), products(slice(2, 3))))
    finally:
        torch.set_num_threads(saved)
    for one, two in zip(*results):
        for a, b in zip(one, two):
            assert torch.equal(a, b)
    for batched, alone in zip(*results[0]):
        assert torch.equal(batched[2:3], alone)


def test_results_are_complete_when_the_call_returns(lib, pool, two_threads):
    """The caller waits for the chunks the worker took: a copy taken the moment a call returns (before a
    late worker could finish its chunk) always equals the full product, over many calls."""
    kernel = DenseGemv(lib, pool)
    w = _weight(16384, 512, torch.float32, seed=12)  # 32 MiB: 8 chunks of ~4 MiB for two threads
    x = _rows(1, 512, torch.float32, seed=12)
    want = F.linear(x, w)
    copies = [kernel(x, w).clone() for _ in range(20)]
    for got in copies:
        torch.testing.assert_close(got, want, **FP32_TOL)


def _forked_product(conn, kernel, x, w) -> None:
    conn.send(kernel(x, w).numpy().tobytes())  # bytes: tensors would travel through shared-memory handles
    conn.close()


def test_forked_child_computes_on_its_own_thread(lib, pool, two_threads):
    """A fork inherits the pool's handle but not its threads: the child's calls run on the calling thread
    alone and give the parent's results."""
    import multiprocessing

    kernel = DenseGemv(lib, pool)
    w = _weight(4096, 512, torch.float32, seed=11)  # 8 MiB: split into chunks for two threads
    x = _rows(1, 512, torch.float32, seed=11)
    parent_end, child_end = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(target=_forked_product, args=(child_end, kernel, x, w))
    child.start()
    assert parent_end.poll(60), "the forked child did not answer"
    got = parent_end.recv()
    child.join(10)
    assert got == kernel(x, w).numpy().tobytes()



def test_projection_binds_its_kernel_at_finalize_only(monkeypatch):
    """`Linear.bind_kernels` (finalize) binds the few-row kernel to the weight; forward never binds. A refit's
    in-place copy is what the bound product reads; rows it does not take (bf16 rows on an fp32 weight, more
    than MAX_F32_ROWS rows) run `F.linear`, and so does every call inside a graph being captured."""
    proj = Linear(48, 40, torch.float32, KernelRegistry())
    x = _rows(1, 48, torch.float32, seed=5)
    proj(x)
    assert proj.product is None  # forward did not bind
    proj.bind_kernels()
    assert proj.product is not None and proj.product.supports(x)
    assert not proj.product.supports(_rows(MAX_F32_ROWS + 1, 48, torch.float32, 0))
    assert not proj.product.supports(x.bfloat16())
    with torch.no_grad():
        proj.weight.copy_(_weight(40, 48, torch.float32, seed=6))  # a refit: same storage, new values
    hits = collections.Counter()
    proj.product = _CountedKernel(proj.product, hits, LINEAR)
    _assert_fp32_product_close(proj(x), x, proj.weight)
    assert hits[LINEAR] == 1  # the bound kernel served it
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(proj(x), F.linear(x, proj.weight)) and hits[LINEAR] == 1
    monkeypatch.undo()
    assert torch.equal(proj(_rows(3, 48, torch.float32, 7)), F.linear(_rows(3, 48, torch.float32, 7), proj.weight))
    assert Linear(48, 40, torch.float32, KernelRegistry(force_reference=True)).product is None


def test_projection_takes_more_rows_of_a_decode_step_only():
    """A decode step's rows (`decode_rows`) go to the few-row kernel up to MAX_F32_DECODE_ROWS, any other rows
    (a prompt's, a verify span's) only up to MAX_F32_ROWS; the model passes its step plan's flag down, so the
    rows of a prefill never do, and a prompt sums alike alone and in a shared batch."""
    proj = Linear(48, 40, torch.float32, KernelRegistry())
    proj.bind_kernels()
    hits = collections.Counter()
    proj.product = _CountedKernel(proj.product, hits, LINEAR)
    rows = _rows(MAX_F32_DECODE_ROWS, 48, torch.float32, seed=8)
    assert MAX_F32_DECODE_ROWS > MAX_F32_ROWS
    assert torch.equal(proj(rows), F.linear(rows, proj.weight)) and hits[LINEAR] == 0  # not decode rows: torch
    _assert_fp32_product_close(proj(rows, decode_rows=True), rows, proj.weight)
    assert hits[LINEAR] == 1
    more = _rows(MAX_F32_DECODE_ROWS + 1, 48, torch.float32, seed=9)
    assert torch.equal(proj(more, decode_rows=True), F.linear(more, proj.weight)) and hits[LINEAR] == 1
    decode = ForwardBatch.build([(slot, [3], 5) for slot in range(4)])
    prefill = ForwardBatch.build([(0, [3, 4, 5], 0), (1, [6], 9)])
    verify = ForwardBatch.build([(0, [3, 4], 5), (1, [6], 9)], decode_span=2)  # a verify span: decode path
    assert decode.decode_rows and not prefill.decode_rows and not verify.decode_rows


def test_bf16_projection_takes_a_decode_steps_rows_up_to_its_own_limit():
    """bf16 rows of a decode step go to the few-row kernel up to MAX_BF16_DECODE_ROWS (so a bf16 decode step is kernel
    calls only, and replayed), other bf16 rows only up to MAX_BF16_ROWS; the product is torch's to a bf16 rounding."""
    proj = Linear(48, 40, torch.bfloat16, KernelRegistry())
    proj.weight.copy_(torch.randn(40, 48, generator=torch.Generator().manual_seed(11)))
    proj.bind_kernels()
    rows = _rows(MAX_BF16_DECODE_ROWS, 48, torch.bfloat16, seed=12)
    assert MAX_BF16_DECODE_ROWS >= MAX_BF16_ROWS
    assert proj.product.supports(rows, decode_rows=True)
    assert proj.product.supports(rows, decode_rows=False) == (MAX_BF16_DECODE_ROWS <= MAX_BF16_ROWS)
    assert not proj.product.supports(_rows(MAX_BF16_DECODE_ROWS + 1, 48, torch.bfloat16, seed=13), decode_rows=True)
    got = proj(rows, decode_rows=True)
    want = rows.float() @ proj.weight.float().t()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


# ---- wired into the model: kernels on vs the reference registry ----


class CountingRegistry(KernelRegistry):
    """The default backends, counting the calls each op's fast implementation took (a registry of the test's
    own, handed to the model at build)."""

    def __init__(self):
        super().__init__()
        self.hits = collections.Counter()

    def kernel(self, op, *args):
        impl = super().kernel(op, *args)
        if impl is not None:
            self.hits[op] += 1
        return impl

    def count_bound(self, model) -> None:
        """Count the calls of the kernels the finalized `model`'s projections (LINEAR) and routed experts
        (FEW_ROW_EXPERTS, QUANT_EXPERTS) bound to their weights."""
        for module in model.modules():
            if isinstance(module, Linear) and module.product is not None:
                module.product = _CountedKernel(module.product, self.hits, LINEAR)
            if isinstance(module, Attention):
                for shared in (module.from_x, module.from_q):
                    if shared.product is not None:
                        shared.product = _CountedKernel(shared.product, self.hits, SHARED_INPUT_LINEAR)
            if isinstance(module, RoutedExperts) and module.fused is not None:
                op = FEW_ROW_EXPERTS if module.format == "dense" else QUANT_EXPERTS
                module.fused = _CountedKernel(module.fused, self.hits, op)


class _CountedKernel:
    """A kernel bound to weights (`DenseGemv.bind`, `FusedExperts.bind`, ...) that counts the calls it serves
    as hits of `op`."""

    def __init__(self, bound, hits: collections.Counter, op: str):
        self.bound, self.hits, self.op = bound, hits, op

    def supports(self, *args):
        return self.bound.supports(*args)

    def __call__(self, *args):
        self.hits[self.op] += 1
        return self.bound(*args)

    def supports_grouped(self, *args):
        return self.bound.supports_grouped(*args)

    def grouped(self, *args):
        self.hits[self.op] += 1
        return self.bound.grouped(*args)


# expert format, model dtype -> the few-row ops that must serve its calls
WIRED = {("dense", torch.float32): {FEW_ROW_EXPERTS, LINEAR, SHARED_INPUT_LINEAR},
         ("dense", torch.bfloat16): {FEW_ROW_EXPERTS, LINEAR, SHARED_INPUT_LINEAR},
         ("fp8", torch.float32): {QUANT_EXPERTS, LINEAR, SHARED_INPUT_LINEAR},
         ("fp4", torch.float32): {QUANT_EXPERTS, LINEAR, SHARED_INPUT_LINEAR}}
# (bf16 activations on FP8/FP4 experts: test_fused_quant_experts_match_loop. In the tiny dummy model's bf16
# FP4 forward, near-tied routing makes either bf16 path differ from the fp32 one by up to half the logit scale.)


@pytest.mark.parametrize("fmt, dtype", list(WIRED), ids=[f"{f}-{str(d)[6:]}" for f, d in WIRED])
def test_wired_kernels_match_the_reference_model(fmt, dtype):
    """The tiny model with the few-row kernels (its default registry) and the same weights with a
    reference-only registry: a two-sequence prefill and five batch-1 decode steps give the same logits (fp32:
    to fp32 summation order; bf16: within the bf16 rounding the two paths place differently), and the kernels
    really served the calls (counted by the model's own registry). Quantized experts stay quantized."""
    llm = LLM("dsv4-tiny-dummy", load_format="dummy", dtype=str(dtype)[6:], expert_dtype=fmt, seed=3)
    source = llm.loaded.target
    models = {}
    for name, kernels in (("wired", CountingRegistry()), ("reference", KernelRegistry(force_reference=True))):
        model = DeepseekV4(source.cfg, fmt, dtype, kernels=kernels)
        model.load_state_dict(source.state_dict())
        model.process_weights_after_loading()
        models[name] = model
    wired = models["wired"]
    wired.kernels.count_bound(wired)
    assert wired.layers[2].ffn.experts.w1.dtype == {"dense": dtype, "fp8": torch.float8_e4m3fn, "fp4": torch.int8}[fmt]
    caches = {name: model.allocate_cache(2, 64) for name, model in models.items()}
    prompt_a, prompt_b = list(range(3, 9)), list(range(40, 43))
    steps = [ForwardBatch.build([(0, prompt_a, 0), (1, prompt_b, 0)])]
    steps += [ForwardBatch.build([(0, [50 + i], len(prompt_a) + i)]) for i in range(5)]
    scale_tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for batch in steps:
        logits = {name: model.logits(model(batch, caches[name])[0]) for name, model in models.items()}
        want = logits["reference"]
        torch.testing.assert_close(logits["wired"], want, rtol=scale_tol, atol=scale_tol * want.abs().max().item())
    few_row_ops = {LINEAR, SHARED_INPUT_LINEAR, FEW_ROW_EXPERTS, QUANT_EXPERTS}
    assert set(wired.kernels.hits) & few_row_ops == WIRED[(fmt, dtype)]


class RowsRecordingRegistry(KernelRegistry):
    """The default backends, recording the torch and few-row kernel-pool threads each forward's rows ran with
    (at every kernel the registry hands out inside it: the projections' are bound at finalize, not asked)."""

    def __init__(self):
        super().__init__()
        self.steps: list[tuple[int, int, int]] = []  # (rows, torch threads, pool threads) inside the block
        self.forwards: list[tuple[int, bool, int]] = []  # (rows, decode rows, torch threads) of each forward
        self.rows: int | None = None  # the rows of the forward running now

    def kernel(self, op, *args):
        impl = super().kernel(op, *args)
        if impl is not None and self.rows is not None:
            self.steps.append((self.rows, torch.get_num_threads(), self.choose(LINEAR).impl.pool.threads()))
        return impl

    @contextlib.contextmanager
    def threads_for_rows(self, rows, decode_rows=False, dtypes=(torch.float32, torch.float32)):
        self.rows = rows
        with super().threads_for_rows(rows, decode_rows, dtypes):
            self.forwards.append((rows, decode_rows, torch.get_num_threads()))
            yield
        self.rows = None


def test_one_row_steps_run_torch_on_one_thread_and_the_kernels_on_the_rest(two_threads):
    """A co-running process must not cost a batch-1 step a scheduler slice per OpenMP region: inside a one-row
    forward, or a decode step of rows whose products the few-row kernels take for its dtypes, torch runs one
    intra-op thread while the few-row kernels keep the two torch had; wider forwards, a prompt's rows and a
    reference-only registry change nothing; the count comes back even when the block raises. A replayed decode
    step that samples greedily runs no torch op at all, so it leaves torch's count alone."""
    registry = KernelRegistry()
    pool = registry.choose(LINEAR).impl.pool
    with registry.threads_for_rows(1):
        assert (torch.get_num_threads(), pool.threads()) == (1, 2)
    assert (torch.get_num_threads(), pool.threads(), pool.pinned) == (2, 2, None)
    with registry.threads_for_rows(2):
        assert torch.get_num_threads() == 2
    with registry.threads_for_rows(MAX_F32_DECODE_ROWS, decode_rows=True):
        assert (torch.get_num_threads(), pool.threads()) == (1, 2)
    with registry.threads_for_rows(MAX_F32_DECODE_ROWS + 1, decode_rows=True):
        assert torch.get_num_threads() == 2
    with registry.threads_for_rows(MAX_BF16_DECODE_ROWS, decode_rows=True, dtypes=(torch.bfloat16, torch.bfloat16)):
        assert torch.get_num_threads() == 1
    with registry.threads_for_rows(MAX_BF16_DECODE_ROWS + 1, decode_rows=True, dtypes=(torch.bfloat16, torch.bfloat16)):
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), registry.threads_for_rows(1):
        raise RuntimeError("a failed forward")
    assert (torch.get_num_threads(), pool.pinned) == (2, None)
    with KernelRegistry(force_reference=True).threads_for_rows(1):
        assert torch.get_num_threads() == 2

    recording = RowsRecordingRegistry()
    llm = LLM("dsv4-tiny-dummy", load_format="dummy", seed=3, kernels=recording)
    reference = LLM("dsv4-tiny-dummy", load_format="dummy", seed=3, kernels=KernelRegistry(force_reference=True))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 8]]
    got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [out.outputs[0].token_ids for out in reference.generate(prompts, params, use_tqdm=False)]
    assert (5, False, 2) in recording.forwards, recording.forwards  # the two prompts' rows: torch keeps its threads
    # The greedy 2-row decode steps were recorded and replayed (C calls and their argmax): torch's count untouched.
    assert llm.engine.runner.replay.replayed_steps > 0
    assert not [forward for forward in recording.forwards if forward[1]], recording.forwards
    recording.forwards.clear()
    sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
    llm.generate(prompts, sampled, use_tqdm=False)  # the sampler's torch ops on the replayed step's logits
    assert {threads for rows, decode, threads in recording.forwards if decode and rows == 2} == {1}, recording.forwards
    assert torch.get_num_threads() == 2


def _stored_input_major(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] as an input-major parameter of its own (storage [K, N])."""
    param = input_major(weight.shape[0], weight.shape[1], weight.dtype)
    param.data.copy_(weight)
    return param


@pytest.mark.parametrize("rows", [1, 3, 16, 53])
@pytest.mark.parametrize("wdtype, xdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)])
def test_grouped_product_is_each_groups_own_product(rows, wdtype, xdtype):
    """A grouped product (the attention's grouped low-rank output: group g's inputs through its own block of the
    weight's rows) gives, group by group, exactly what the group's block as a weight of its own gives its inputs
    (every pass: one row, the tile pass's several rows, the register-blocked pass from 48 rows; bf16 rows rounded
    once, as that product rounds them), and the torch product to fp32 summation order (and a bf16 rounding)."""
    groups, k, n = 4, 96, 48
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(groups * n, k, generator=g).to(wdtype)
    x = torch.randn(rows, groups * k, generator=g).to(xdtype)
    bound = DenseGemv(gemv_cpu.build_library(), gemv_cpu.WorkerPool(gemv_cpu.build_library(), 1)).bind(
        _stored_input_major(weight))
    # The rows it takes are the rows the weight's own product takes (fp32 rows on bf16 weights: a few).
    takes = bound.supports(x[:, :k].contiguous(), True)
    assert bound.supports_grouped(x, groups, decode_rows=True) == takes
    y = bound.grouped(x, groups)  # the call itself runs any rows
    for i in range(groups):
        block = DenseGemv(gemv_cpu.build_library(), bound._pool).bind(_stored_input_major(weight[i * n:(i + 1) * n]))
        own = block(x[:, i * k:(i + 1) * k].contiguous())
        assert torch.equal(y[:, i * n:(i + 1) * n], own), i
        want = x[:, i * k:(i + 1) * k].float() @ weight[i * n:(i + 1) * n].float().t()
        tol = 1e-5 if xdtype == torch.float32 else 2**-7
        torch.testing.assert_close(y[:, i * n:(i + 1) * n].float(), want, rtol=tol, atol=tol * 10)


def test_grouped_product_declines_what_it_cannot_run():
    weight = _stored_input_major(torch.randn(64, 32))
    bound = DenseGemv(gemv_cpu.build_library(), gemv_cpu.WorkerPool(gemv_cpu.build_library(), 1)).bind(weight)
    x = torch.randn(2, 4 * 32)
    assert bound.supports_grouped(x, 4, decode_rows=True)
    assert not bound.supports_grouped(x.to(torch.bfloat16), 4, decode_rows=True)  # bf16 rows on fp32: not its own
    assert not bound.supports_grouped(x.to(torch.float16), 4, decode_rows=True)
    assert not bound.supports_grouped(torch.randn(2, 3 * 32), 4, decode_rows=True)  # not groups x in_features
    assert not bound.supports_grouped(torch.randn(2, 3 * 32), 3, decode_rows=True)  # groups must divide outputs
    assert not bound.supports_grouped(torch.randn(2, 32 * 32), 32, decode_rows=True)  # more than one dispatch takes
    assert not bound.supports_grouped(torch.randn(MAX_F32_DECODE_ROWS + 1, 4 * 32), 4, decode_rows=True)


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 100, 16384])
def test_greedy_argmax_is_torch_max_indices(cols):
    """Every row's first largest value, as torch.max(dim=-1) picks it: random rows, ties at the front, the back
    and in between (the lowest index wins), infinities, all-equal rows, and rows holding NaN (the first NaN)."""
    from dsv4.kernels.registry import GREEDY_ARGMAX

    g = torch.Generator().manual_seed(cols)
    rows = torch.randn(24, cols, generator=g)
    rows[1] = 0.5  # all equal
    rows[2, -1] = rows[2].max() + 1  # the last column
    if cols > 2:
        top = rows[3].max() + 1
        rows[3, [1, cols - 1]] = top  # a tie: the first wins
        rows[4, cols // 2] = float("inf")
        rows[4, cols - 1] = float("inf")
        rows[5, cols // 3] = float("nan")
        rows[5, cols - 1] = float("nan")
        rows[6] = -float("inf")
        rows[7, 0] = float("nan")
        rows[8, :] = -3.0
        rows[8, cols - 2] = -2.0
    kernel = KernelRegistry().kernel(GREEDY_ARGMAX, rows)
    assert kernel is not None
    want = rows.max(dim=-1).indices
    assert torch.equal(kernel(rows), want)
    with kernel.pool.pinned_threads(4):  # rows over several chunks
        assert torch.equal(kernel(rows), want)
    assert torch.equal(kernel(rows[:1].contiguous()), want[:1])


def test_greedy_argmax_declines_what_it_cannot_run():
    from dsv4.kernels.registry import GREEDY_ARGMAX

    registry = KernelRegistry()
    assert registry.kernel(GREEDY_ARGMAX, torch.zeros(2, 8)) is not None
    assert registry.kernel(GREEDY_ARGMAX, torch.zeros(2, 8, dtype=torch.bfloat16)) is None
    assert registry.kernel(GREEDY_ARGMAX, torch.zeros(8, 2).t()) is None  # not contiguous
    assert registry.kernel(GREEDY_ARGMAX, torch.zeros(8)) is None


def test_greedy_argmax_without_avx512_is_torch_max_indices():
    """The plain-C passes of a build for a CPU without AVX-512 pick what torch.max picks too."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-march names a CPU without AVX-512 on x86-64 only")
    from dsv4.kernels.gemv_cpu import RowArgmax

    lib = build_library(march="x86-64-v2")
    kernel = RowArgmax(lib, WorkerPool(lib, 0))
    rows = torch.randn(6, 37, generator=torch.Generator().manual_seed(3))
    rows[1, [3, 30]] = 9.0
    rows[2, 20] = float("nan")
    rows[3] = -float("inf")
    assert torch.equal(kernel(rows), rows.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_tables_rows(dtype):
    """The replay's gather call returns what F.embedding returns, bit for bit (repeated and edge ids included), and
    an id outside the table is refused by name, not read."""
    from dsv4.kernels.registry import EMBEDDING_ROWS

    g = torch.Generator().manual_seed(5)
    table = torch.randn(37, 24, generator=g).to(dtype)
    table[3, 0] = float("nan")  # bits, not values: a NaN row comes back as it is
    ids = torch.tensor([0, 36, 3, 3, 17])
    kernel = KernelRegistry().kernel(EMBEDDING_ROWS, table, ids)
    assert kernel is not None
    got = kernel(table, ids)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)

    assert got.dtype == dtype and torch.equal(bits(got), bits(F.embedding(ids, table)))
    assert kernel(table, ids[:0]).shape == (0, 24)
    for bad in (37, -1):
        with pytest.raises(ValueError, match="gather_rows: arguments outside"):
            kernel(table, torch.tensor([1, bad]))
    registry = KernelRegistry()
    assert registry.kernel(EMBEDDING_ROWS, table.t(), ids) is None  # not contiguous
    assert registry.kernel(EMBEDDING_ROWS, table, ids.int()) is None  # int32 ids
