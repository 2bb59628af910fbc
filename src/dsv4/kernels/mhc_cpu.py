"""mHC coefficients + Sinkhorn as one C call on CPU (fp32).

Eager PyTorch spends ~120 tiny ops per sublayer on this (sigmoids, a softmax and 39 Sinkhorn
normalisations on [T, hc, hc]); decode is dispatch-bound, so one compiled loop per call replaces them.
The C source is compiled with the system C compiler at first use into a per-user cache directory
(no torch headers, so it builds in well under a second) and called through ctypes on the tensors'
storage. The arithmetic order follows `dsv4.model.mhc.coefficients_reference` step by step (the
oracle); only libm's expf/ the reduction order may differ, at the level of fp32 rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

# Streams the kernel is validated for (every released config has hc = 4); larger hc uses the reference.
MAX_HC = 16

_SOURCE = r"""
#include <math.h>

static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

/* logits [T, mix], base [mix], scale [3] -> out [T, mix] = pre [hc] | post [hc] | comb [hc, hc] per token.
   mix = 2 hc + hc^2. comb[i, j]: source stream i -> destination stream j. */
void mhc_coefficients_f32(const float *logits, const float *base, const float *scale, long T, int hc,
                          int iters, float hc_eps, float *out) {
    const int mix = 2 * hc + hc * hc;
    const float s_pre = scale[0], s_post = scale[1], s_comb = scale[2];
    for (long t = 0; t < T; ++t) {
        const float *l = logits + t * mix;
        float *o = out + t * mix;
        for (int k = 0; k < hc; ++k) {
            o[k] = sigmoidf_(l[k] * s_pre + base[k]) + hc_eps;
            o[hc + k] = 2.0f * sigmoidf_(l[hc + k] * s_post + base[hc + k]);
        }
        float *c = o + 2 * hc;
        const float *lc = l + 2 * hc, *bc = base + 2 * hc;
        for (int i = 0; i < hc; ++i) { /* row softmax (the first row normalisation), then + eps */
            float mx = -INFINITY;
            for (int j = 0; j < hc; ++j) {
                c[i * hc + j] = lc[i * hc + j] * s_comb + bc[i * hc + j];
                if (c[i * hc + j] > mx) mx = c[i * hc + j];
            }
            float sum = 0.0f;
            for (int j = 0; j < hc; ++j) { c[i * hc + j] = expf(c[i * hc + j] - mx); sum += c[i * hc + j]; }
            for (int j = 0; j < hc; ++j) c[i * hc + j] = c[i * hc + j] / sum + hc_eps;
        }
        for (int it = 0; it < 2 * iters - 1; ++it) { /* columns, then rows/columns alternately */
            const int by_column = (it % 2) == 0;
            for (int a = 0; a < hc; ++a) {
                float sum = 0.0f;
                for (int b = 0; b < hc; ++b) sum += by_column ? c[b * hc + a] : c[a * hc + b];
                const float denom = sum + hc_eps;
                for (int b = 0; b < hc; ++b) {
                    if (by_column) c[b * hc + a] /= denom; else c[a * hc + b] /= denom;
                }
            }
        }
    }
}
"""
_FLAGS = ("-O2", "-shared", "-fPIC", "-fno-fast-math")


def _cache_dir() -> Path:
    override = os.environ.get("DSV4_KERNEL_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "dsv4" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build_library() -> ctypes.CDLL:
    """Compile (once per source version) and load the kernel library; raises OSError/RuntimeError."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler on PATH (tried $CC, cc, gcc)")
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"mhc_cpu_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "mhc_cpu.c"
            src.write_text(_SOURCE)
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(built), "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
            os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    lib = ctypes.CDLL(str(target))
    fn = lib.mhc_coefficients_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
    return lib


class MhcCpuKernel:
    """Callable with the signature of `coefficients_reference`, for fp32 CPU tensors."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.mhc_coefficients_f32

    @staticmethod
    def supports(logits: torch.Tensor, hc: int, sinkhorn_iters: int) -> bool:
        # iters >= 1: the reference always runs the first column pass, the kernel counts passes from it.
        return logits.device.type == "cpu" and logits.dtype == torch.float32 and hc <= MAX_HC and sinkhorn_iters >= 1

    def __call__(
        self, logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int, hc_eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = logits.contiguous()
        base = base.float().contiguous()
        scale = scale.float().contiguous()
        T = logits.shape[0]
        out = torch.empty_like(logits)  # [T, mix]
        self._fn(logits.data_ptr(), base.data_ptr(), scale.data_ptr(), T, hc, sinkhorn_iters, hc_eps, out.data_ptr())
        pre, post, comb = out.split([hc, hc, hc * hc], dim=-1)
        return pre, post, comb.unflatten(-1, (hc, hc))
