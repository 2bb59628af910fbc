"""Routed FP8 / FP4 experts inside a graph torch.compile captures: one custom op, `dsv4::quant_experts`.

Eager, a MoE layer over quantized stacks (model/moe.py) asks its kernel registry for the fused C kernel
(QUANT_EXPERTS: gemv_cpu.py's FusedQuantExperts, weights decoded in registers or, for many rows per expert,
a few rows at a time into a per-call panel) and otherwise runs `dequantizing_loop`, the reference, which
dequantizes only the experts in use, one at a time, for that call. Neither can
be traced: the kernel is a ctypes call, and the loop reads the expert counts on the host to pick its
experts. The compiled decode step (engine/static_decode.py) therefore calls both through this op, opaque
to the compiler (its fake gives the output's shape and dtype), which makes the eager forward's choice per
call: the fused kernel wherever its `supports` takes the call (the registry's own test: any row count over
stacks of a supported layout), the loop elsewhere. So the compiled step computes what the eager step
computes, row count for row count.

The weights stay quantized at rest: the op reads the resident stacks, which the graph takes as inputs by
address (never as constants), so an in-place refit is seen by the next call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4.kernels.gathered_experts import loop_experts, swiglu
from dsv4.quant import dequantize_fp4, dequantize_fp8_blockwise


def dequantized_expert(
    weight: torch.Tensor, scale: torch.Tensor, block: Sequence[int], dtype: torch.dtype,
) -> torch.Tensor:
    """One expert's matrix in `dtype`: FP8 [out, in] (float8_e4m3fn) with fp32 block scales of `block`, or FP4
    [out, in/2] (two e2m1 codes per int8 byte) with ue8m0 scale bytes, one per block[1] inputs of a row."""
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_blockwise(weight, scale, block, out_dtype=dtype)
    return dequantize_fp4(weight, scale, block[1], out_dtype=dtype)


def dequantizing_loop(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w1_scale: torch.Tensor,
    w3: torch.Tensor, w3_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, block: Sequence[int],
    limit: float,
) -> torch.Tensor:
    """The reference over quantized stacks: x [T, D], ids/weights [T, k], w1/w3 [E, I, ...], w2 [E, D, ...] with
    their scales -> sum_e w_e expert_e(x) [T, D] (SwiGLU experts), each used expert dequantized to x's dtype for
    this call only (`loop_experts`)."""
    stacks = {"w1": (w1, w1_scale), "w3": (w3, w3_scale), "w2": (w2, w2_scale)}

    def expert_weight(name: str, e: int) -> torch.Tensor:
        weight, scale = stacks[name]
        return dequantized_expert(weight[e], scale[e], block, x.dtype)

    return loop_experts(x, ids, weights, expert_weight, w1.shape[0], limit, swiglu)


def _process_kernel():
    """The process's FusedQuantExperts: the implementation every kernel registry's C backend of QUANT_EXPERTS
    is (registry.py builds it from `gemv_cpu.shared_kernels()`). An op's arguments are tensors and numbers,
    so the op reaches the kernel here rather than through the model's registry."""
    from dsv4.kernels.gemv_cpu import shared_kernels

    return shared_kernels()[3]


@torch.library.custom_op("dsv4::quant_experts", mutates_args=())
def quant_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w1_scale: torch.Tensor,
    w3: torch.Tensor, w3_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, block: list[int],
    limit: float, fused: bool,
) -> torch.Tensor:
    """`dequantizing_loop`'s arguments (block as a list) -> [T, D]; `fused`: the model's registry chose the C
    kernel for QUANT_EXPERTS, which then runs every call it supports (the others run the loop)."""
    # A compiled graph may hand over rows with other strides than eager would; the kernel wants them packed.
    args = (x.contiguous(), ids.contiguous(), weights.contiguous(), w1, w1_scale, w3, w3_scale, w2, w2_scale,
            tuple(block), limit)
    if fused:
        kernel = _process_kernel()
        if kernel.supports(*args):
            return kernel(*args)
    return dequantizing_loop(*args)


@quant_experts.register_fake
def _quant_experts_shape(x, ids, weights, w1, w1_scale, w3, w3_scale, w2, w2_scale, block, limit, fused):
    return torch.empty_like(x)
