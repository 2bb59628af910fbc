"""The one-call MoE layer of a decode step's rows (gemv_cpu.FusedMoeLayer, the registry's MOE_LAYER) against the
layer's torch reference (the same MoE module built with a reference-only registry: torch router, the reference
expert loop over dequantized or dense experts, torch shared expert), for every expert format and router kind, one
token and a 16-row decode step; and the calls it must decline (several rows of a prompt, more decode rows than
MAX_MOE_LAYER_ROWS, bf16 rows on wider weights, a graph being compiled, tensor parallelism)."""

import dataclasses

import pytest
import torch

from dsv4.config import DENSE, FP4, FP8, HASH_MOE, MOE, ModelConfig
from dsv4.embedded import EMBEDDED_MODELS
from dsv4.kernels.gemv_cpu import MAX_BF16_DECODE_ROWS, MAX_MOE_LAYER_ROWS
from dsv4.kernels.registry import MOE_LAYER, KernelRegistry
from dsv4.model import moe as moe_module
from dsv4.model.moe import MoE
from dsv4.parallel.state import ParallelState
from dsv4.quant import quantize_fp4, quantize_fp8_blockwise

# Unit-scale random weights give outputs of size ~1-10; the kernel's products and exp/log sum and round in
# another order than torch's: fp32 rounding noise.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
SEED = 3


def _config(scoring: str) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0]), scoring_func=scoring)


def _fill(moe: MoE, fmt: str, g: torch.Generator) -> None:
    """Random weights of unit scale; a random hash table / correction bias."""
    gate, experts = moe.gate, moe.experts
    gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) / gate.weight.shape[1] ** 0.5)
    if gate.hashed:
        E, k = experts.num_experts, gate.top_k
        gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(gate.tid2eid.shape[0])]))
    else:
        gate.bias.copy_(0.1 * torch.randn(gate.bias.shape, generator=g))
    for name in ("w1", "w3", "w2"):
        weight = getattr(experts, name)
        for e in range(experts.num_experts):
            out_features, in_features = weight.shape[1], weight.shape[2] * (2 if fmt == FP4 else 1)
            dense = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5 * 4
            if fmt == DENSE:
                weight[e].copy_(dense)
                continue
            scale = getattr(experts, f"{name}_scale")
            q, s = (quantize_fp8_blockwise(dense, experts.block, scale_fmt="float") if fmt == FP8
                    else quantize_fp4(dense, experts.group))
            weight[e].copy_(q)
            scale[e].copy_(s.float() if fmt == FP8 else s)
    for linear in (moe.shared_experts.w1, moe.shared_experts.w3, moe.shared_experts.w2):
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) / linear.weight.shape[1] ** 0.5 * 4)


def _pair(fmt: str, mlp_type: str, scoring: str, dtype: torch.dtype = torch.float32,
          **widths: int) -> tuple[MoE, MoE]:
    """The layer with the default kernels and the same layer (same weights) with reference-only kernels;
    `widths` override the tiny config's sizes (hidden_size, moe_intermediate_size)."""
    cfg = dataclasses.replace(_config(scoring), **widths)
    fast = MoE(cfg, mlp_type, fmt, dtype, KernelRegistry())
    reference = MoE(cfg, mlp_type, fmt, dtype, KernelRegistry(force_reference=True))
    _fill(fast, fmt, torch.Generator().manual_seed(SEED))
    reference.load_state_dict(fast.state_dict())
    for layer in (fast, reference):
        layer.bind_kernels()  # what finalize does
    return fast, reference


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("mlp_type", [MOE, HASH_MOE])
@pytest.mark.parametrize("fmt", [DENSE, FP8, FP4])
def test_one_token_layer_matches_reference(fmt, mlp_type, scoring):
    fast, reference = _pair(fmt, mlp_type, scoring)
    g = torch.Generator().manual_seed(SEED + 1)
    for token in range(6):  # several tokens: different hash rows and top-k picks
        x = torch.randn(1, fast.gate.weight.shape[1], generator=g)
        token_ids = torch.tensor([token * 37 % fast.gate.tid2eid.shape[0] if fast.gate.hashed else token])
        assert fast.layer_kernel.supports(x, token_ids) and reference.layer_kernel is None
        torch.testing.assert_close(fast(x, token_ids), reference(x, token_ids), **FP32_TOL)


@pytest.mark.parametrize("mlp_type", [MOE, HASH_MOE])
@pytest.mark.parametrize("fmt", [DENSE, FP8, FP4])
def test_decode_rows_match_reference(fmt, mlp_type):
    """16 decode rows in one call (each its own token and routing): the reference's output row for row."""
    fast, reference = _pair(fmt, mlp_type, "sqrtsoftplus")
    g = torch.Generator().manual_seed(SEED + 4)
    x = torch.randn(16, fast.gate.weight.shape[1], generator=g)
    token_ids = torch.randint(0, fast.gate.tid2eid.shape[0] if fast.gate.hashed else 16, (16,), generator=g)
    assert fast.layer_kernel.supports(x, token_ids, decode_rows=True)
    assert not fast.layer_kernel.supports(x, token_ids)  # a prompt's rows: the separate calls
    torch.testing.assert_close(fast(x, token_ids, decode_rows=True), reference(x, token_ids, decode_rows=True),
                               **FP32_TOL)


@pytest.mark.parametrize("mlp_type", [MOE, HASH_MOE])
@pytest.mark.parametrize("fmt", [DENSE, FP8, FP4])
def test_one_bf16_token_on_bf16_weights_matches_reference(fmt, mlp_type):
    """bf16 rows (a bf16 engine's decode token) on bf16 weights at rest: the kernel rounds where the reference's
    bf16 tensors do (each product's output, silu, the SwiGLU product, the final sum), so the two agree to a few
    bf16 roundings of the output's scale; the routing is fp32 in both and picks the same experts."""
    fast, reference = _pair(fmt, mlp_type, "sqrtsoftplus", torch.bfloat16)
    g = torch.Generator().manual_seed(SEED + 3)
    for token in range(6):
        x = torch.randn(1, fast.gate.weight.shape[1], generator=g).bfloat16()
        token_ids = torch.tensor([token * 37 % fast.gate.tid2eid.shape[0] if fast.gate.hashed else token])
        assert fast.layer_kernel.supports(x, token_ids) and reference.layer_kernel is None
        got, want = fast(x, token_ids), reference(x, token_ids)
        assert got.dtype == want.dtype == torch.bfloat16
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-5 * scale)


# The small benchmark config's widths: weights large enough that the pool splits the shared expert's products
# into several chunks, and at 32-64 rows its SwiGLU too (the down chunks then wait on SwiGLU chunks other threads run).
WIDE = {"hidden_size": 512, "moe_intermediate_size": 256}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [DENSE, FP4])
def test_wide_decode_rows_match_reference_at_any_thread_count(fmt, dtype):
    """A full decode step's rows on wide weights (64 fp32, 32 bf16): the reference's output (fp32: to rounding;
    bf16: to a few bf16 roundings), and the same bits with one thread as with two (each product column is summed
    in one order whoever runs it)."""
    fast, reference = _pair(fmt, MOE, "sqrtsoftplus", dtype, **WIDE)
    rows = MAX_MOE_LAYER_ROWS if dtype == torch.float32 else MAX_BF16_DECODE_ROWS
    g = torch.Generator().manual_seed(SEED + 5)
    x = torch.randn(rows, WIDE["hidden_size"], generator=g).to(dtype)
    token_ids = torch.randint(0, 16, (rows,), generator=g)
    assert fast.layer_kernel.supports(x, token_ids, decode_rows=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = fast(x, token_ids, decode_rows=True)
        torch.set_num_threads(1)
        alone = fast(x, token_ids, decode_rows=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, alone)
    want = reference(x, token_ids, decode_rows=True)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-5, atol=2**-5 * scale)


def test_router_picks_the_reference_experts():
    """The kernel's top-k with correction bias picks what torch's topk picks, including the bias steering it:
    a bias that makes an otherwise low-scoring expert win changes the layer's output exactly as it does the
    reference's."""
    fast, reference = _pair(FP4, MOE, "sqrtsoftplus")
    x = torch.randn(1, fast.gate.weight.shape[1], generator=torch.Generator().manual_seed(SEED + 2))
    token_ids = torch.tensor([0])
    ids, _ = reference.gate(x, token_ids)
    scores = torch.nn.functional.softplus(x @ reference.gate.weight.t()).sqrt()[0]
    loser = int((scores + reference.gate.bias).argmin())
    for layer in (fast, reference):
        layer.gate.bias[loser] = 100.0
    steered, _ = reference.gate(x, token_ids)
    assert loser in steered[0].tolist() and loser not in ids[0].tolist()
    torch.testing.assert_close(fast(x, token_ids), reference(x, token_ids), **FP32_TOL)


def test_declines_calls_it_does_not_run(monkeypatch):
    fast, _ = _pair(FP4, HASH_MOE, "sqrtsoftplus")
    D = fast.gate.weight.shape[1]
    kernel = fast.layer_kernel
    one = torch.randn(1, D)
    assert kernel.supports(one, torch.tensor([5]))
    assert not kernel.supports(torch.randn(2, D), torch.tensor([5, 6]))  # two tokens of a prompt
    assert kernel.supports(torch.randn(2, D), torch.tensor([5, 6]), decode_rows=True)  # a decode step's two rows
    many = MAX_MOE_LAYER_ROWS + 1
    assert not kernel.supports(torch.randn(many, D), torch.arange(many), decode_rows=True)
    assert not kernel.supports(torch.randn(2, D), torch.tensor([5]), decode_rows=True)  # a token id per row
    assert not kernel.supports(one.bfloat16(), torch.tensor([5]))  # bf16 rows on fp32 weights
    assert not kernel.supports(one, torch.tensor([5], dtype=torch.int32))  # a hash row's id must be int64
    # tensor parallel: each rank holds part of every expert and of the shared expert, so the layer is a partial
    # sum for the all-reduce (stood in for here: no process group); no kernel is bound
    parallel = MoE(_config("sqrtsoftplus"), HASH_MOE, DENSE, torch.float32, KernelRegistry(),
                   ParallelState(rank=0, world_size=2))
    parallel.bind_kernels()
    assert parallel.layer_kernel is None and fast.kernels.choose(MOE_LAYER).impl is not None
    reduced = []
    monkeypatch.setattr(moe_module, "all_reduce", lambda x, state: reduced.append(state) or x)
    assert parallel(one, torch.tensor([5])).shape == one.shape
    assert reduced


def test_out_of_range_hash_token_is_an_error():
    fast, _ = _pair(FP4, HASH_MOE, "sqrtsoftplus")
    vocab = fast.gate.tid2eid.shape[0]
    with pytest.raises(ValueError, match="moe_layer"):
        fast(torch.randn(1, fast.gate.weight.shape[1]), torch.tensor([vocab]))
