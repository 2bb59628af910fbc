"""Mixture of experts: a router (learned top-k with correction bias, or a static token-id hash table),
routed SwiGLU experts resident in one of three layouts, and one always-on shared expert.

Shapes: T tokens, D hidden, E experts, k experts per token, I expert width.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import DENSE, EXPERT_FORMATS, FP8, HASH_MOE, ModelConfig, QuantConfig
from dsv4.kernels.gathered_experts import loop_experts, swiglu
from dsv4.kernels.quant_experts import dequantized_expert, dequantizing_loop, quant_experts
from dsv4.kernels.registry import (
    FEW_ROW_EXPERTS,
    MOE_EXPERTS,
    MOE_LAYER,
    QUANT_EXPERTS,
    KernelRegistry,
    default_registry,
)
from dsv4.model.linear import Linear, compute_weight, input_major
from dsv4.parallel.collectives import all_reduce
from dsv4.parallel.state import SINGLE, ParallelState

# Keeps the normalisation well-defined when every selected score underflows to zero.
_ROUTING_NORM_EPS = 1e-20


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Router(nn.Module):
    """Scores every expert, selects k, and returns normalised, scaled routing weights."""

    def __init__(self, cfg: ModelConfig, hashed: bool, dtype: torch.dtype):
        super().__init__()
        self.hashed = hashed
        self.top_k = cfg.num_experts_per_tok
        self.scoring_func = cfg.scoring_func
        self.scaling = cfg.routed_scaling_factor
        self.weight = input_major(cfg.n_routed_experts, cfg.hidden_size, dtype)
        if hashed:
            # Static selection table, int32 as on disk; rows hold k distinct expert ids.
            self.tid2eid = _frozen(torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.int32))
        else:
            self.bias = _frozen(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (expert ids [T, k] int64, weights [T, k] fp32)."""
        xf = x if x.dtype == torch.float32 else x.float()
        wf = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        logits = xf @ wf.t()  # [T, E]
        if self.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:  # softmax
            scores = logits.softmax(dim=-1)
        if self.hashed:
            ids = self.tid2eid[token_ids].long()
        else:
            # The correction bias steers selection only; the weights use the unbiased scores.
            ids = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _ROUTING_NORM_EPS)
        return ids, weights * self.scaling


class RoutedExperts(nn.Module):
    """E SwiGLU experts, stacked: w1 (gate) and w3 (up) [E, I, D], w2 (down) [E, D, I].

    Layouts (one resident copy; FP8/FP4 decoded inside the fused kernel, or dequantised per used expert by
    the reference loop, never kept):
      dense  model dtype, stored input-major (linear.py): the grouped GEMMs read [E, in, out]
      fp8    float8_e4m3fn weights + fp32 block scales [E, ceil(out/b0), ceil(in/b1)]
      fp4    int8 [E, out, in/2] (two e2m1 codes per byte, low nibble = even input) + ue8m0 bytes
             (uint8) [E, out, in/group]

    Parallel (`parallel`): with expert parallelism this rank holds experts [first_expert, first_expert + E/N)
    whole; without it, every expert with 1/N of its intermediate width (w1/w3 rows, w2 columns).
    """

    def __init__(self, cfg: ModelConfig, fmt: str, quant: QuantConfig | None, dtype: torch.dtype,
                 kernels: KernelRegistry | None = None, parallel: ParallelState = SINGLE):
        super().__init__()
        self.kernels = kernels or default_registry()
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"expert format must be one of {EXPERT_FORMATS}, got {fmt!r}")
        self.format = fmt
        self.dtype = dtype
        self.limit = cfg.swiglu_limit
        self.parallel = parallel
        self.first_expert, stop = parallel.expert_range(cfg.n_routed_experts)
        self.num_experts = stop - self.first_expert  # held by this rank
        self.block = quant.weight_block_size if quant else (128, 128)
        self.group = quant.fp4_group_size if quant else 32
        E, inter, D = self.num_experts, parallel.expert_width(cfg.moe_intermediate_size), cfg.hidden_size
        for name, (out_dim, in_dim) in (("w1", (inter, D)), ("w3", (inter, D)), ("w2", (D, inter))):
            weight, scale = self._allocate(E, out_dim, in_dim)
            self.register_parameter(name, weight)
            if scale is not None:
                self.register_parameter(f"{name}_scale", scale)
        self.fused = None  # the fused C kernel bound to the stacks (`bind_kernels`), None: the paths below

    def _allocate(self, E: int, out_dim: int, in_dim: int) -> tuple[nn.Parameter, nn.Parameter | None]:
        """The stacks (and their scales) as zeros: every load writes each byte of them, so a build that wrote
        values here (unit scales, say) would write the scales twice and fault their pages in before the load's
        copy (the build's tensors come from a `WeightArena` on CPU: zeros no one has written). A zero scale
        is a valid value of either format (fp32 0.0; ue8m0 byte 0, which `quant.e8m0_to_float32` decodes to
        0.0), and zero codes dequantize to zeros whatever their scale."""
        if self.format == DENSE:
            return input_major(out_dim, in_dim, self.dtype, stack=(E,)), None
        if self.format == FP8:
            b0, b1 = self.block
            weight = torch.zeros(E, out_dim, in_dim, dtype=torch.float8_e4m3fn)
            return _frozen(weight), _frozen(torch.zeros(E, -(-out_dim // b0), -(-in_dim // b1)))
        if in_dim % self.group:
            raise ValueError(f"FP4 experts need the input dim ({in_dim}) to be a multiple of {self.group}")
        weight = torch.zeros(E, out_dim, in_dim // 2, dtype=torch.int8)
        return _frozen(weight), _frozen(torch.zeros(E, out_dim, in_dim // self.group, dtype=torch.uint8))

    def expert_weight(self, name: str, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert e's matrix `name` in `dtype` (None: the model's parameter dtype, what export reads): a dense
        weight itself, or widened per call (`compute_weight`) for wider activations; FP8/FP4 dequantised
        straight to `dtype` (one rounding, none when it is fp32)."""
        dtype = self.dtype if dtype is None else dtype
        weight = getattr(self, name)[e]
        if self.format == DENSE:
            return compute_weight(weight, dtype)
        return dequantized_expert(weight, getattr(self, f"{name}_scale")[e], self.quant_block, dtype)

    @property
    def quant_block(self) -> tuple[int, int]:
        """The scale block of FP8 / FP4 stacks: (output rows, inputs) per scale; FP4 scales one row's group."""
        return self.block if self.format == FP8 else (1, self.group)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], ids/weights [T, k] -> sum_e w_e * expert_e(x) [T, D]. The fused C kernel bound to the
        stacks at finalize serves dense few-token calls (FEW_ROW_EXPERTS) and FP8/FP4 calls of any size
        (QUANT_EXPERTS, decoded in registers or a per-call panel), the registry's grouped/gathered GEMMs larger
        dense batches; otherwise the reference loop. Inside a compiled graph
        FP8/FP4 experts run as one op making the same choice per call (kernels/quant_experts.py). Expert
        parallel: the sum over the experts this rank holds (ids are global)."""
        if self.parallel.expert_parallel:
            return self._forward_held(x, ids, weights)
        return self._forward_local(x, ids, weights)

    def _forward_held(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Only the (token, pick) pairs routed to this rank's experts, each a one-pick row (so no expert
        runs on tokens it was not picked for); the other ranks' picks arrive in the MoE's all-reduce."""
        local = ids - self.first_expert
        token, pick = ((local >= 0) & (local < self.num_experts)).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        if token.numel() == 0:
            return out
        rows = self._forward_local(x.index_select(0, token), local[token, pick].unsqueeze(1),
                                   weights[token, pick].unsqueeze(1))
        return out.index_add_(0, token, rows)

    def bind_kernels(self) -> None:
        """At finalize (`process_weights_after_loading`, every one): bind the fused C kernel of the stacks'
        layout (dense: FEW_ROW_EXPERTS; FP8 / FP4: QUANT_EXPERTS) to them."""
        self.fused = self.kernels.bind(FEW_ROW_EXPERTS if self.format == DENSE else QUANT_EXPERTS, self)

    def _forward_local(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` with ids indexing this rank's experts."""
        if not torch.compiler.is_compiling():
            fused = self.fused
            if fused is not None and fused.supports(x, ids, weights):
                return fused(x, ids, weights)
        if self.format == DENSE:
            args = (x, ids, weights, self.w1, self.w3, self.w2, self.limit, swiglu)
            fast = self.kernels.kernel(MOE_EXPERTS, *args)
            if fast is not None:
                return fast(*args)
        elif torch.compiler.is_compiling():
            c_kernel = not self.kernels.choose(QUANT_EXPERTS).is_reference
            return quant_experts(*self._quant_args(x, ids, weights)[:-2], list(self.quant_block), self.limit, c_kernel)
        return self.forward_reference(x, ids, weights)

    def _quant_args(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """The arguments of QUANT_EXPERTS and `dequantizing_loop` over this layer's FP8 / FP4 stacks."""
        return (x, ids, weights, self.w1, self.w1_scale, self.w3, self.w3_scale, self.w2, self.w2_scale,
                self.quant_block, self.limit)

    def forward_reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One expert at a time, dequantising (or widening) only the experts in use, to x's dtype."""
        if self.format != DENSE:
            return dequantizing_loop(*self._quant_args(x, ids, weights))
        return loop_experts(x, ids, weights, lambda name, e: self.expert_weight(name, e, x.dtype), self.num_experts,
                            self.limit, swiglu)


class SharedExpert(nn.Module):
    """Always-on SwiGLU MLP; under tensor parallelism each rank holds 1/N of its width (a partial sum)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelRegistry | None = None,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        self.limit = cfg.swiglu_limit
        width = parallel.local(cfg.moe_intermediate_size)
        self.w1 = Linear(cfg.hidden_size, width, dtype, kernels)
        self.w3 = Linear(cfg.hidden_size, width, dtype, kernels)
        self.w2 = Linear(width, cfg.hidden_size, dtype, kernels)

    def forward(self, x: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """decode_rows: x's rows are a decode step's (`Linear.forward`)."""
        return self.w2(swiglu(self.w1(x, decode_rows), self.w3(x, decode_rows), self.limit), decode_rows)


class MoE(nn.Module):
    """The router is replicated (every rank routes every token); routed and shared experts give partial
    sums under tensor / expert parallelism, combined by one all-reduce. On one rank, a call the registry's
    MOE_LAYER kernel (bound to the weights at finalize) supports (one token, or a decode step's rows) runs router,
    routed and shared experts in that one call."""

    def __init__(self, cfg: ModelConfig, mlp_type: str, expert_format: str, dtype: torch.dtype,
                 kernels: KernelRegistry | None = None, parallel: ParallelState = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.kernels = kernels or default_registry()
        self.gate = Router(cfg, hashed=mlp_type == HASH_MOE, dtype=dtype)
        self.experts = RoutedExperts(cfg, expert_format, cfg.quant, dtype, kernels, parallel)
        self.shared_experts = SharedExpert(cfg, dtype, kernels, parallel)
        self.layer_kernel = None  # MOE_LAYER bound to the weights (`bind_kernels`), None: the modules above

    def bind_kernels(self) -> None:
        """At finalize (`process_weights_after_loading`, every one): bind the registry's MOE_LAYER kernel to the
        layer's weights (on one rank only: a parallel layer is a partial sum for the all-reduce)."""
        self.layer_kernel = None if self.parallel.is_parallel else self.kernels.bind(
            MOE_LAYER, self.gate, self.experts, self.shared_experts, _ROUTING_NORM_EPS)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """x [T, D], token_ids [T] (hash routing needs them) -> [T, D]; decode_rows: x's rows are a decode
        step's (`Linear.forward`)."""
        if not torch.compiler.is_compiling():  # a captured graph runs torch (and guards nothing of the kernel)
            fused = self.layer_kernel
            if fused is not None and fused.supports(x, token_ids, decode_rows):
                return fused(x, token_ids)
        ids, weights = self.gate(x, token_ids)
        return all_reduce(self.experts(x, ids, weights) + self.shared_experts(x, decode_rows), self.parallel)
