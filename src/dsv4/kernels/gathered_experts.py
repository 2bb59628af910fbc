"""Ways to compute routed experts over dense stacks (FP8/FP4 stacks run in gemv_cpu's FusedQuantExperts;
their reference, quant_experts.dequantizing_loop, is this loop over experts dequantised per call).

- `loop_experts`, the reference: a Python loop over the experts in use, ~8 ops each plus one host read of
  the expert counts. Also the fast choice when most experts are idle (few picks).
- `GatheredExperts`: gather each (token, pick)'s expert weights and run one batched matmul chain; it
  copies T*k expert matrices, so it only pays off while that copy is small (`supports` caps it).
- `GroupedExperts`: rows sorted by expert and one `torch._grouped_mm` per matrix, or one batched matmul over all
  experts while that wastes few FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.kernels import bf16_products
from dsv4.kernels.row_chunks import row_chunks

# Copying one expert's three matrices costs about as much as the ~8 ops the loop spends per expert
# while they hold up to ~64k elements (256 KiB fp32): larger experts are looped, never copied.
MAX_ELEMENTS_PER_PICK = 1 << 16
# And the whole gathered copy stays within 1 MiB (fp32) per call (measured: beyond it, e.g. 128 picks of
# the tiny config, the copy costs more than the loop), so large batches use the loop.
MAX_GATHERED_ELEMENTS = 1 << 18
# GroupedExperts' all-experts path: on CPU `_grouped_mm` loops over the experts (a few small GEMMs each,
# ~125 us per matrix for the tiny config's 8 experts at 64 tokens), so while every expert is in use anyway
# one batched matmul over all experts is cheaper, as long as its wasted FLOPs (E/k times the routed ones) stay
# small: up to 2^24 FLOPs per call (~0.1 ms at this CPU's ~150 GFLOP/s fp32, about one matrix's loop).
MAX_ALL_EXPERTS_FLOPS = 1 << 24


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L): DeepSeek-V4 clamps both routed and shared experts."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def loop_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_weight, num_experts: int, limit: float, swiglu,
) -> torch.Tensor:
    """x [T, D], ids/weights [T, k] -> sum_e w_e expert_e(x) [T, D], a Python loop over the experts in use
    (the reference, and the fast choice when most experts are idle); expert_weight(name, e) gives expert
    e's matrix "w1" | "w3" | "w2" in the compute dtype (dequantising when stored quantized)."""
    out = torch.zeros_like(x)
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.flatten()[order]
    offset = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[offset : offset + count]
        xe = x.index_select(0, rows)
        hidden = swiglu(xe @ expert_weight("w1", e).t(), xe @ expert_weight("w3", e).t(), limit)
        ye = hidden @ expert_weight("w2", e).t()
        out.index_add_(0, rows, (ye.float() * weight_of[offset : offset + count, None]).to(x.dtype))
        offset += count
    return out


def _weighted(rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [..., n], weights [..., 1] -> (rows.float() * weights).to(rows.dtype), the reference's one
    rounding of an fp32 product, computed a chunk of rows at a time (`row_chunks`) into out (may be rows
    itself)."""
    if out is None and rows.dtype == torch.float32:
        return rows * weights.float()  # one op, no widening (and the form the compiled decode step fuses)
    n = rows.shape[-1]
    flat_rows, flat_weights = rows.reshape(-1, n), weights.float().reshape(-1, 1)
    out = torch.empty_like(flat_rows) if out is None else out.view(-1, n)
    for chunk in row_chunks(*flat_rows.shape):
        out[chunk] = flat_rows[chunk].float() * flat_weights[chunk]
    return out.view(rows.shape)


class GatheredExperts:
    """Callable with the arguments of `gathered`; `supports` takes the same."""

    @staticmethod
    def supports(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor, limit: float, activation) -> bool:
        _, inter, hidden = w1.shape
        per_pick = 3 * inter * hidden
        return (x.dtype == w1.dtype and per_pick <= MAX_ELEMENTS_PER_PICK
                and ids.numel() * per_pick <= MAX_GATHERED_ELEMENTS)

    def __call__(self, *args) -> torch.Tensor:
        return self.gathered(*args)

    @staticmethod
    def gathered(
        x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float, swiglu,
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, k], dense w1/w3 [E, I, D], w2 [E, D, I] -> sum_e w_e expert_e(x) [T, D].
        Each token's k contributions are added in increasing expert order, as the reference does."""
        T, k = ids.shape
        ids, order = ids.sort(dim=-1, stable=True)
        weights = weights.gather(1, order)
        flat = ids.flatten()  # [T*k]
        xs = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, D]
        # Gather [in, out] matrices: a plain row copy for input-major stacks (model/linear.py).
        w1_in, w3_in, w2_in = (w.transpose(1, 2).index_select(0, flat) for w in (w1, w3, w2))
        hidden = swiglu(bf16_products.bmm(xs, w1_in), bf16_products.bmm(xs, w3_in), limit)
        ys = bf16_products.bmm(hidden, w2_in).view(T, k, -1)  # [T, k, D]
        contrib = _weighted(ys, weights.unsqueeze(-1))
        out = torch.zeros_like(x)
        for j in range(k):  # k is 2..8: accumulate like the reference's index_add, pick by pick
            out = out + contrib[:, j]
        return out


class GroupedExperts:
    """All routed (token, pick) rows sorted by expert, then one `torch._grouped_mm` per matrix over
    the stacked dense weights: ~20 ops per layer whatever the batch or the number of experts in use,
    no per-expert Python loop, no host read of the expert counts, no weight copies. Contributions are
    added with one index_add in the reference's order (experts ascending, stable within an expert).

    Small experts at batches that touch every expert take `all_experts` instead (see `uses_all_experts`).
    Inside a graph torch.compile captures, the strategies that are fixed-shape tensor programs (all
    experts, gathered weights) stay in the graph, and the rest runs as one opaque op (`routed_experts`).
    `supports` takes the call's arguments."""

    @staticmethod
    def supports(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor, limit: float, activation) -> bool:
        # _grouped_mm wants 16-byte aligned row strides: D and I a multiple of 16 bytes.
        aligned = all(n * x.element_size() % 16 == 0 for n in w1.shape[1:])
        return x.dtype == w1.dtype and x.dtype in (torch.float32, torch.bfloat16) and x.device == w1.device and aligned

    @staticmethod
    def uses_all_experts(tokens: int, k: int, w1: torch.Tensor) -> bool:
        """True when the T*k picks can cover every expert (so the grouped loop would visit all E anyway)
        and computing every expert for every token stays within MAX_ALL_EXPERTS_FLOPS."""
        E, inter, hidden = w1.shape
        return tokens * k >= E and 2 * 3 * tokens * E * inter * hidden <= MAX_ALL_EXPERTS_FLOPS

    @staticmethod
    def mostly_idle(picks: int, w1: torch.Tensor) -> bool:
        """Fewer picks than experts: CPU `_grouped_mm` still visits every expert (a select, a slice and a
        host read of its offset per expert and matrix, ~50 ops per layer for 16 experts), while a loop
        over the few experts in use costs ~8 ops each."""
        return picks < w1.shape[0]

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float, activation,
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, k], dense w1/w3 [E, I, D], w2 [E, D, I] -> sum_e w_e expert_e(x) [T, D]."""
        args = (x, ids, weights, w1, w3, w2, limit, activation)
        if self.uses_all_experts(ids.shape[0], ids.shape[1], w1):
            return self.all_experts(*args)
        if torch.compiler.is_compiling():
            if GatheredExperts.supports(*args):
                return GatheredExperts.gathered(*args)
            if activation is not swiglu:
                raise ValueError("a compiled graph's opaque routed-experts op runs SwiGLU experts only")
            return routed_experts(x, ids, weights, w1, w3, w2, limit)
        if self.mostly_idle(ids.numel(), w1):
            stacks = {"w1": w1, "w3": w3, "w2": w2}
            return loop_experts(x, ids, weights, lambda name, e: stacks[name][e], w1.shape[0], limit, activation)
        return self.grouped(*args)

    @staticmethod
    def all_experts(
        x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float, swiglu,
    ) -> torch.Tensor:
        """Every expert on every token, unpicked ones weighted 0: one batched matmul per matrix over the
        input-major stacks (no weight copies), no sort or scatter. The experts' contributions are summed after
        the down projection (fp32 rounding differs from the reference's pick-by-pick adds, values do not)."""
        T = x.shape[0]
        # [T, E] routing weight of each expert (0 where not picked)
        dense_weights = torch.zeros(T, w1.shape[0], dtype=torch.float32, device=x.device)
        dense_weights.scatter_(1, ids, weights.float())
        hidden_all = swiglu(bf16_products.matmul(x, w1.transpose(1, 2)),  # [E, T, I]
                            bf16_products.matmul(x, w3.transpose(1, 2)), limit)
        scaled = _weighted(hidden_all, dense_weights.t().unsqueeze(-1))  # [E, T, I]
        return bf16_products.bmm(scaled, w2.transpose(1, 2)).sum(dim=0)  # [T, D]

    @staticmethod
    def grouped(
        x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float, swiglu,
    ) -> torch.Tensor:
        """The `_grouped_mm` path (any batch)."""
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)
        offsets = torch.bincount(flat_ids, minlength=w1.shape[0]).cumsum(0).to(torch.int32)
        token_of = order // ids.shape[1]
        xs = x.index_select(0, token_of)  # [T*k, D], grouped by expert (several times cheaper than x[token_of])
        hidden = bf16_products.grouped_mm(xs, w1.transpose(1, 2), offsets)  # [T*k, I], the gate until overwritten
        up = bf16_products.grouped_mm(xs, w3.transpose(1, 2), offsets)
        for chunk in row_chunks(*hidden.shape):
            hidden[chunk] = swiglu(hidden[chunk], up[chunk], limit)
        ys = bf16_products.grouped_mm(hidden, w2.transpose(1, 2), offsets)  # [T*k, D]
        contrib = _weighted(ys, weights.flatten()[order].unsqueeze(-1), out=ys)
        return torch.zeros_like(x).index_add_(0, token_of, contrib)


def build_grouped_experts() -> GroupedExperts:
    """Raises where torch has no usable `_grouped_mm` (the registry then falls back)."""
    kernel = GroupedExperts()
    w = torch.ones(2, 4, 8)
    got = kernel.grouped(torch.ones(2, 8), torch.tensor([[0], [1]]), torch.ones(2, 1), w, w,
                         w.transpose(1, 2).contiguous(), 10.0, lambda a, b, limit: a * b)
    if not torch.equal(got, torch.full((2, 8), 256.0)):  # (8 * 8) * 4
        raise RuntimeError("torch._grouped_mm gave a wrong result")
    return kernel


# The routed experts enter a compiled graph as one opaque op where neither fixed-shape strategy applies:
# which experts run, and on how many rows each, is data-dependent (and `_grouped_mm` has no fp32 meta
# kernel), so the graph keeps the eager GroupedExperts call, ~20 framework ops per layer, while everything
# around it is fused.
@torch.library.custom_op("dsv4::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
) -> torch.Tensor:
    """x [B, D], ids/weights [B, k], dense w1/w3 [E, I, D], w2 [E, D, I] -> [B, D] (SwiGLU experts)."""
    return GroupedExperts()(x, ids, weights, w1, w3, w2, limit, swiglu)


@routed_experts.register_fake
def _routed_experts_shape(x, ids, weights, w1, w3, w2, limit):
    return torch.empty_like(x)
