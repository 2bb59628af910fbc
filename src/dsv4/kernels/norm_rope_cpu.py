"""RMSNorm and/or interleaved RoPE in place on CPU, one C call (norm_rope_cpu.c).

Eager PyTorch spends a widening, a reduction, a rsqrt, two multiplies, the cos/sin of every position and
the pairwise rotation (~15 ops) on each q / kv / entry row per layer; decode is dispatch-bound, so one
C loop replaces them. The formulas are `dsv4.model.norm.rms_norm` and `dsv4.model.rope.apply_rotary`
(the references it is tested against, tests/test_kernels.py); the arithmetic is fp32 throughout.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from dsv4.kernels.c_library import compile_library
from dsv4.kernels.mhc_cpu import check_status, eager_cpu
from dsv4.kernels.native_calls import bind_packed, native_call

SOURCE = Path(__file__).with_name("norm_rope_cpu.c")
# The kernels a recorded step may call (native_call), each with a packed twin for the replay (packed_call.h).
REPLAYED = ("norm_rope",)

# Activation dtypes the kernel accepts. bf16 rows are widened, computed in fp32 and rounded once (the
# reference's norm and rotation each upcast, compute and round): the result differs from it only by bf16
# rounding.
NORM_ROPE_DTYPES = (torch.float32, torch.bfloat16)
# The kernel keeps per-token cos/sin on the stack: at most this many rotary pairs (the C arrays' size).
MAX_ROTARY_PAIRS = 512


def build_library() -> ctypes.CDLL:
    """Compile (once per source version) and load the kernel library; raises OSError/RuntimeError."""
    lib = compile_library(SOURCE)
    P, L, Int, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.norm_rope.restype = Int
    lib.norm_rope.argtypes = [P, Int, L, L, L, F, P, P, P, L, Int]
    bind_packed(lib, REPLAYED)
    return lib


class NormRopeKernel:
    """In place on a contiguous fp32 or bf16 CPU x [T, G, hd]: optional RMSNorm over hd (weighted or
    not), then interleaved RoPE of the trailing channels at positions [T] (cos/sin computed in the loop).
    The arithmetic is fp32 throughout (bf16 x: converted once, rounded once at the end)."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.norm_rope

    @staticmethod
    def supports(
        x: torch.Tensor, eps: float | None, weight: torch.Tensor | None = None, positions: torch.Tensor | None = None,
        inv_freq: torch.Tensor | None = None, inverse: bool = False,
    ) -> bool:
        x_ok = eager_cpu(x) and x.dtype in NORM_ROPE_DTYPES and x.is_contiguous()
        return x_ok and (inv_freq is None or (inv_freq.dtype == torch.float32 and inv_freq.is_contiguous()
                                              and inv_freq.is_cpu and inv_freq.numel() <= MAX_ROTARY_PAIRS))

    def __call__(
        self, x: torch.Tensor, eps: float | None, weight: torch.Tensor | None = None,
        positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None, inverse: bool = False,
    ) -> torch.Tensor:
        """x [T, ..., hd]; eps None skips the norm; positions None skips the rotation. Returns x."""
        T, hd = x.shape[0], x.shape[-1]
        G = x.numel() // max(1, T * hd)
        rh = 0 if positions is None else inv_freq.numel()
        if positions is not None and positions.dtype != torch.int64:
            positions = positions.long()
        if weight is not None and weight.dtype != torch.float32:
            weight = weight.float()  # the model keeps norm weights fp32; the kernel reads float*
        native_call(self._fn, (x.data_ptr(), int(x.dtype == torch.bfloat16), T, G, hd, -1.0 if eps is None else eps,
                               None if weight is None else weight.data_ptr(),
                               None if positions is None else positions.contiguous().data_ptr(),
                               None if inv_freq is None else inv_freq.data_ptr(), rh, int(inverse)),
                    check_status, "norm_rope", T)
        return x
