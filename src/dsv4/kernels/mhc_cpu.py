"""mHC on CPU as C loops (mhc_cpu.c): the coefficients + Sinkhorn, the fused pre/post steps.

Eager PyTorch spends ~120 tiny ops per sublayer on the coefficients alone (sigmoids, a softmax and 39
Sinkhorn normalisations on [T, hc, hc]); decode is dispatch-bound, so one compiled loop per call replaces
them. The arithmetic is fp32; the fused steps read and write fp32 or bf16 streams (bf16 widened per token,
rounded once on store) and can update the streams in place, so a long prefill neither copies its
[T, hc, D] streams to fp32 nor allocates a fresh copy of them per sublayer.
The C source is compiled at first use (c_library.py; no torch headers, so it builds in well under a
second) and called through ctypes on the tensors' storage. The arithmetic order follows
`dsv4.model.mhc.coefficients_reference` step by step (the oracle); only libm's expf / the reduction order
may differ, at the level of fp32 rounding.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from dsv4.kernels.c_library import NATIVE, compile_library, cpu_features
from dsv4.kernels.gemv_cpu import MAX_F32_DECODE_ROWS, WorkerPool, pool_call_args
from dsv4.kernels.native_calls import bind_packed, native_call
from dsv4.kernels.row_chunks import row_chunks

# Streams the kernel is validated for (every released config has hc = 4); larger hc uses the reference.
MAX_HC = 16
# Tokens whose mix GEMM runs in C (`MhcFusedKernel._few_token_mix`): a decode step's rows
# (`gemv_cpu.MAX_F32_DECODE_ROWS`); more (a prefill's) take torch's GEMM on all of torch's threads.
MAX_MIX_ROWS = MAX_F32_DECODE_ROWS

SOURCE = Path(__file__).with_name("mhc_cpu.c")
# The kernels a recorded step may call (native_call), each with a packed twin for the replay (packed_call.h).
REPLAYED = ("mhc_coefficients_f32", "mhc_pre", "mhc_post", "mhc_mix", "mhc_head")


def build_library(march: str = NATIVE) -> ctypes.CDLL:
    """Compile (once per source version, flags and CPU) and load the kernel library; raises OSError/RuntimeError.

    Args:
        march: the compiler's -march target ("native": this CPU, whose vector units the mix GEMM's dot products
            use; the tests build an older one for the plain-C path).
    """
    lib = compile_library(SOURCE, (f"-march={march}",), cpu_features())
    P, L, Int, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.mhc_coefficients_f32.restype = None
    lib.mhc_coefficients_f32.argtypes = [P] * 3 + [L, Int, Int, F, P]
    lib.mhc_pre.restype = Int
    lib.mhc_pre.argtypes = [P, Int, P, P, P, L, Int, Int, L, Int, F, F, P, F, P, P, P, P, Int]
    lib.mhc_post.restype = Int
    lib.mhc_post.argtypes = [P, Int, P, P, L, Int, Int, L, P, P, P, Int]
    lib.mhc_mix.restype = Int
    lib.mhc_mix.argtypes = [P, Int, L, L, P, L, P, P, P, Int]
    lib.mhc_head.restype = Int
    lib.mhc_head.argtypes = [P, Int, P, P, P, L, Int, L, F, F, P]
    bind_packed(lib, REPLAYED)
    return lib


def eager_cpu(x: torch.Tensor) -> bool:
    """Whether a C kernel may run on x: CPU storage, and not inside a graph torch.compile is capturing (it
    calls the library on raw pointers, which a graph cannot trace; the compiler fuses the torch reference
    formulas instead). The capture check comes first: a graph being captured then traces nothing of the
    caller's `supports` beyond it, so the compiled step guards none of the attributes and kernel-module
    constants the remaining checks read."""
    return not torch.compiler.is_compiling() and x.is_cpu


class MhcCpuKernel:
    """Callable with the signature of `coefficients_reference`, for fp32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.mhc_coefficients_f32

    @staticmethod
    def supports(logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int,
                 hc_eps: float) -> bool:
        # iters >= 1: the reference always runs the first column pass, the kernel counts passes from it.
        return eager_cpu(logits) and logits.dtype == torch.float32 and hc <= MAX_HC and sinkhorn_iters >= 1

    def __call__(
        self, logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int, hc_eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = logits.contiguous()
        base = base.float().contiguous()
        scale = scale.float().contiguous()
        T = logits.shape[0]
        out = torch.empty_like(logits)  # [T, mix]
        native_call(self._fn, (logits.data_ptr(), base.data_ptr(), scale.data_ptr(), T, hc, sinkhorn_iters, hc_eps,
                               out.data_ptr()), check_status, "mhc_coefficients", T)
        pre, post, comb = out.split([hc, hc, hc * hc], dim=-1)
        return pre, post, comb.unflatten(-1, (hc, hc))


# Stream dtypes the fused mHC kernel reads and writes (bf16 widened per token, arithmetic in fp32).
MHC_STREAM_DTYPES = (torch.float32, torch.bfloat16)


def mix_gemm(streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """streams [T, hc, D] (fp32 or bf16), fn [mix, hc*D] fp32 -> flatten(streams) @ fn^T in fp32 [T, mix]:
    the GEMM of `mhc.mix_logits`, before its RMS scaling."""
    flat = streams.view(streams.shape[0], -1)
    fn_t = fn.float().t()
    if flat.dtype == torch.float32:
        return flat @ fn_t
    raw = flat.new_empty(flat.shape[0], fn.shape[0], dtype=torch.float32)
    for chunk in row_chunks(*flat.shape):  # bf16 rows widened a chunk at a time, not all [T, hc*D] at once
        torch.mm(flat[chunk].float(), fn_t, out=raw[chunk])
    return raw


class MhcFusedKernel:
    """The whole mHC pre-step (the mix GEMM, RMS, coefficients + Sinkhorn, stream collapse, the sublayer's
    weighted RMSNorm) and the post-step (stream expansion) on CPU, fp32 arithmetic on fp32 or bf16
    streams: `mhc.mix_logits` + `coefficients` + `collapse` + the norm, and `mhc.expand`, in 3 dispatches
    (the GEMM a torch matmul, the rest one C call each) instead of ~40. `post(..., in_place=True)` writes
    the new streams over the old ones: a prefill of thousands of tokens then reuses one [T, hc, D] buffer
    instead of allocating (and page-faulting in) a fresh one per sublayer.

    `supports` takes `pre`'s arguments; `post` then serves the same streams."""

    def __init__(self, lib: ctypes.CDLL, pool: WorkerPool | None = None):
        """pool: the few-row kernels' worker pool, which the mix GEMM of a few tokens spreads its rows over
        (None: the caller's thread)."""
        self._pre = lib.mhc_pre
        self._post = lib.mhc_post
        self._mix = lib.mhc_mix
        self._head = lib.mhc_head
        self._pool = pool

    @staticmethod
    def supports(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                 sinkhorn_iters: int, rms_eps: float, hc_eps: float, norm_weight: torch.Tensor | None,
                 norm_eps: float) -> bool:
        dtype_ok = eager_cpu(streams) and streams.dtype in MHC_STREAM_DTYPES and streams.is_contiguous()
        return dtype_ok and hc <= MAX_HC and sinkhorn_iters >= 1

    def pre(
        self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
        sinkhorn_iters: int, rms_eps: float, hc_eps: float, norm_weight: torch.Tensor | None, norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc_in, D] (hc_in = hc, or 1 for a broadcast embedding with the pre-summed fn
        [mix, D]), fn [mix, hc_in * D] -> (coef [T, mix] fp32 = pre | post | comb, block input [T, D] in
        streams' dtype)."""
        T, hc_in, D = streams.shape
        raw = self._mix_raw(streams, fn)
        coef = torch.empty_like(raw)
        y = streams.new_empty(T, D)
        native_call(self._pre, (streams.data_ptr(), _is_bf16(streams), raw.data_ptr(), base.data_ptr(),
                                scale.data_ptr(), T, hc, hc_in, D, sinkhorn_iters, rms_eps, hc_eps,
                                None if norm_weight is None else norm_weight.data_ptr(), norm_eps,
                                coef.data_ptr(), y.data_ptr(), *pool_call_args(self._pool)), check_status, "mhc_pre", T)
        return coef, y

    def _mix_raw(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """flatten(streams) @ fn^T [T, mix] fp32, contiguous: a few tokens in C (`_few_token_mix`), more with
        torch's GEMM (`mix_gemm`)."""
        if streams.shape[0] <= MAX_MIX_ROWS:
            return self._few_token_mix(streams, fn)
        return mix_gemm(streams, fn).contiguous()

    def _few_token_mix(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """`mix_gemm` of a few tokens in C (`mhc_mix`: a dot product per output, rows over the pool's threads),
        where torch's GEMM on one thread (decode steps keep torch there: `KernelRegistry.threads_for_rows`) ran
        2-4x slower on the small config's [16, 2048] x [2048, 24]."""
        T, hc_in, D = streams.shape
        fn = fn.float().contiguous()
        raw = torch.empty(T, fn.shape[0], dtype=torch.float32)
        native_call(self._mix, (streams.data_ptr(), _is_bf16(streams), T, hc_in * D, fn.data_ptr(), fn.shape[0],
                                raw.data_ptr(), *pool_call_args(self._pool)), check_status, "mhc_mix", T)
        return raw

    def post(
        self, streams: torch.Tensor, out: torch.Tensor, coef: torch.Tensor, hc: int, in_place: bool = False
    ) -> torch.Tensor:
        """R'_j = post_j * out + sum_i comb[i, j] R_i -> [T, hc, D] in streams' dtype; in_place (streams
        [T, hc, D], not a broadcast [T, 1, D]): written over streams, which is returned."""
        T, hc_in, D = streams.shape
        out = out.to(streams.dtype).contiguous()
        if in_place and hc_in != hc:
            raise ValueError(f"in-place mHC post needs [T, {hc}, D] streams, got {tuple(streams.shape)}")
        result = streams if in_place else streams.new_empty(T, hc, D)
        native_call(self._post, (streams.data_ptr(), _is_bf16(streams), out.data_ptr(), coef.data_ptr(), T, hc, hc_in,
                                 D, result.data_ptr(), *pool_call_args(self._pool)), check_status, "mhc_post", T)
        return result


class MhcHeadKernel(MhcFusedKernel):
    """The model's final pre-only collapse (`mhc.head_collapse`, hc_head) on CPU: the mix as the fused pre-step's
    (C for a decode step's tokens, torch's GEMM for more), then one C call (`mhc_head`: RMS, sigmoid
    coefficients, collapse) instead of ~10 torch ops. `supports` / `__call__` take `head_collapse`'s arguments."""

    @staticmethod
    def supports(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float,
                 hc_eps: float) -> bool:
        """[T, hc, D] fp32 or bf16 streams, fp32 base and scale."""
        return (eager_cpu(streams) and streams.dtype in MHC_STREAM_DTYPES and streams.is_contiguous()
                and streams.dim() == 3 and streams.shape[1] <= MAX_HC and base.dtype == scale.dtype == torch.float32
                and base.is_contiguous() and scale.is_contiguous())

    def __call__(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 rms_eps: float, hc_eps: float) -> torch.Tensor:
        """streams [T, hc, D], fn [hc, hc * D] -> [T, D] in streams' dtype."""
        T, hc, D = streams.shape
        raw = self._mix_raw(streams, fn)
        y = streams.new_empty(T, D)
        native_call(self._head, (streams.data_ptr(), _is_bf16(streams), raw.data_ptr(), base.data_ptr(),
                                 scale.data_ptr(), T, hc, D, rms_eps, hc_eps, y.data_ptr()),
                    check_status, "mhc_head", T)
        return y


def _is_bf16(streams: torch.Tensor) -> int:
    return int(streams.dtype == torch.bfloat16)


def check_status(status: int, kernel: str, tokens: int) -> None:
    """Raises MemoryError when a kernel reports (status != 0) that its scratch rows could not be allocated."""
    if status != 0:
        raise MemoryError(f"{kernel}: could not allocate its per-token scratch rows ({tokens} tokens)")
