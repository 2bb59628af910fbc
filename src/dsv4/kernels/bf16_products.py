"""bf16 matrix products on CPUs without bf16 matrix instructions: operands widened to fp32, fp32 GEMM.

torch's CPU bf16 GEMMs (oneDNN, `_grouped_mm`, bmm) run at their real speed only where the CPU has
bf16 matrix instructions (AMX-BF16, AVX512-BF16; measured 417 GFLOP/s on such a machine). Elsewhere, e.g.
an AVX2-only EPYC, they fall back to a scalar path: measured 0.9 GFLOP/s against 108 GFLOP/s fp32 on the
same machine, so a bf16 model at b=16 spent ~90% of its decode step in three attention `bmm`s and the
grouped output projection's product. Every bf16 product of the model goes through this module, which
decides once per process (`WIDENS_BF16`, from the CPU's feature flags) how to run it:

  bf16 matrix units   torch's own bf16 op, unchanged
  none                the bf16 operands widened to fp32 (exact: every bf16 value is an fp32 value), the
                      fp32 op (MKL), the result rounded to bf16 once

Numerics: bf16 semantics here are bf16 storage with fp32 accumulation, which is what torch's bf16 GEMMs
compute (fp32 accumulators, one rounding of the result to bf16 on store); the widened path computes the
same sums in fp32 and rounds once at the same point, so the two differ only by the order of the fp32 sums
(then at most one bf16 rounding step apart). fp32 operands and non-CPU tensors always take torch's op.

Weights are widened for the call only, never kept: a Linear's weight [N, K] (input-major storage [K, N]) is
widened in panels of output features of at most PANEL_ELEMENTS (1 MiB of fp32, cache-sized), each panel's
product written into its columns of the bf16 result, so a large weight (the 16384 x 512 head) never makes a
full fp32 copy. `grouped_mm` widens one expert's matrix at a time. Row counts the few-row C kernel takes
(gemv_cpu.MAX_BF16_ROWS) never reach `linear`: the model's Linear asks the registry first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.kernels.c_library import cpu_features

# /proc/cpuinfo flags of the bf16 matrix instructions oneDNN's bf16 GEMM uses for its fast path.
BF16_MATRIX_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
BF16_MATRIX_UNITS = bool(BF16_MATRIX_FLAGS & set(cpu_features().split()))
# The rule: bf16 products run widened to fp32 on a CPU without bf16 matrix units.
WIDENS_BF16 = not BF16_MATRIX_UNITS
# A widened weight panel: at most this many fp32 elements (1 MiB, within a core's L2 on this class of CPU).
PANEL_ELEMENTS = 1 << 18


def widens(*operands: torch.Tensor) -> bool:
    """True when a product of these operands runs widened: all bf16 CPU tensors on a CPU without bf16 units."""
    return WIDENS_BF16 and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in operands)


def describe() -> str:
    """For `dsv4 env`: how this process runs bf16 products."""
    if WIDENS_BF16:
        return ("bf16 products       widened    bf16 operands widened to fp32, fp32 GEMM, rounded to bf16 once "
                "(this CPU has no AMX-BF16 / AVX512-BF16: torch's bf16 GEMMs run their slow path)")
    return "bf16 products       torch      torch's bf16 GEMMs (this CPU has bf16 matrix instructions)"


def _rounded(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An fp32 result rounded to bf16 once: a new tensor, or written into `out`."""
    return result.to(torch.bfloat16) if out is None else out.copy_(result)


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.bmm(a, b, out=out)`; widened when `widens(a, b)`."""
    if not widens(a, b):
        return torch.bmm(a, b, out=out)
    return _rounded(torch.bmm(a.float(), b.float()), out)


def baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """`torch.baddbmm(bias, a, b, alpha=alpha)`: bias + alpha * a @ b; widened when `widens(bias, a, b)`."""
    if not widens(bias, a, b):
        return torch.baddbmm(bias, a, b, alpha=alpha)
    return _rounded(torch.baddbmm(bias.float(), a.float(), b.float(), alpha=alpha), None)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)`; widened when `widens(a, b)`."""
    if not widens(a, b):
        return torch.matmul(a, b)
    return _rounded(torch.matmul(a.float(), b.float()), None)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (x [..., K], weight [N, K], no bias); widened when `widens(x, weight)`, the
    weight one panel of output features at a time (`PANEL_ELEMENTS`)."""
    if not widens(x, weight):
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1]).float()
    n, k = weight.shape
    out = rows.new_empty(rows.shape[0], n, dtype=torch.bfloat16)
    step = max(1, PANEL_ELEMENTS // k)
    for start in range(0, n, step):
        panel = weight[start : start + step].t().float()  # [K, panel]: a row copy for an input-major weight
        out[:, start : start + step] = torch.mm(rows, panel)
    return out.view(*x.shape[:-1], n)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(x, weights, offs=offsets)`: x [M, K] rows grouped by expert, weights [E, K, N],
    offsets [E] int32 (the end of each expert's rows) -> [M, N]; widened when `widens(x, weights)`, one
    expert's weight at a time (experts without rows skipped; the offsets are read on the host)."""
    if not widens(x, weights):
        return torch._grouped_mm(x, weights, offs=offsets)
    out = x.new_empty(x.shape[0], weights.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = torch.mm(x[start:end].float(), weights[e].float())
        start = end
    return out
