"""mHC on CPU as C loops: the coefficients + Sinkhorn, the fused pre/post steps, RMSNorm + RoPE.

Eager PyTorch spends ~120 tiny ops per sublayer on the coefficients alone (sigmoids, a softmax and 39
Sinkhorn normalisations on [T, hc, hc]); decode is dispatch-bound, so one compiled loop per call replaces
them. The arithmetic is fp32; the fused steps read and write fp32 or bf16 streams (bf16 widened per token,
rounded once on store) and can update the streams in place, so a long prefill neither copies its
[T, hc, D] streams to fp32 nor allocates a fresh copy of them per sublayer.
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
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

/* One token's pre, post and the row-softmaxed comb (+ eps): everything before the Sinkhorn passes. */
static void coefficients_head(const float *l, const float *base, const float *scale, int hc, float hc_eps,
                              float *o) {
    const float s_pre = scale[0], s_post = scale[1], s_comb = scale[2];
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
}

/* logits [T, mix], base [mix], scale [3] -> out [T, mix] = pre [hc] | post [hc] | comb [hc, hc] per token.
   mix = 2 hc + hc^2. comb[i, j]: source stream i -> destination stream j. */
void mhc_coefficients_f32(const float *logits, const float *base, const float *scale, long T, int hc,
                          int iters, float hc_eps, float *out) {
    const int mix = 2 * hc + hc * hc;
    for (long t = 0; t < T; ++t) {
        float *o = out + t * mix;
        coefficients_head(logits + t * mix, base, scale, hc, hc_eps, o);
        float *c = o + 2 * hc;
        float denom[16];
        for (int it = 0; it < 2 * iters - 1; ++it) { /* columns, then rows/columns alternately */
            /* Exact divisions, laid out so the compiler can do hc of them per vector instruction. */
            if ((it % 2) == 0) {
                for (int a = 0; a < hc; ++a) denom[a] = c[a];
                for (int b = 1; b < hc; ++b)
                    for (int a = 0; a < hc; ++a) denom[a] += c[b * hc + a];
                for (int a = 0; a < hc; ++a) denom[a] += hc_eps;
                for (int b = 0; b < hc; ++b)
                    for (int a = 0; a < hc; ++a) c[b * hc + a] /= denom[a];
            } else {
                for (int a = 0; a < hc; ++a) {
                    float sum = 0.0f;
                    for (int b = 0; b < hc; ++b) sum += c[a * hc + b];
                    denom[a] = sum + hc_eps;
                }
                for (int a = 0; a < hc; ++a)
                    for (int b = 0; b < hc; ++b) c[a * hc + b] /= denom[a];
            }
        }
    }
}

/* Tokens per Sinkhorn batch: one vector lane each (8 fp32 = one AVX register, two SSE ones). */
#define LANES 8

/* The stream count of every released config: the hot loops are inlined with this constant hc (fully
   unrolled, vectorised over tokens or channels), other hc run the same code with a run-time count. */
#define COMMON_HC 4

/* The Sinkhorn passes of mhc_coefficients_f32 for LANES tokens at once, c[i * LANES + lane] = comb
   entry i of that lane's token: the same operations in the same order per token (bit-identical), with
   every step one vector op across tokens (a lone 4x4 matrix leaves the divider mostly idle). */
static inline __attribute__((always_inline)) void sinkhorn_lanes(float *c, int hc, int iters, float hc_eps) {
    float denom[16 * LANES];
    for (int it = 0; it < 2 * iters - 1; ++it) { /* columns, then rows/columns alternately */
        if ((it % 2) == 0) {
            for (int a = 0; a < hc; ++a)
                for (int l = 0; l < LANES; ++l) denom[a * LANES + l] = c[a * LANES + l];
            for (int b = 1; b < hc; ++b)
                for (int a = 0; a < hc; ++a)
                    for (int l = 0; l < LANES; ++l) denom[a * LANES + l] += c[(b * hc + a) * LANES + l];
            for (int a = 0; a < hc; ++a)
                for (int l = 0; l < LANES; ++l) denom[a * LANES + l] += hc_eps;
            for (int b = 0; b < hc; ++b)
                for (int a = 0; a < hc; ++a)
                    for (int l = 0; l < LANES; ++l) c[(b * hc + a) * LANES + l] /= denom[a * LANES + l];
        } else {
            for (int a = 0; a < hc; ++a) {
                for (int l = 0; l < LANES; ++l) denom[a * LANES + l] = 0.0f;
                for (int b = 0; b < hc; ++b)
                    for (int l = 0; l < LANES; ++l) denom[a * LANES + l] += c[(a * hc + b) * LANES + l];
                for (int l = 0; l < LANES; ++l) denom[a * LANES + l] += hc_eps;
            }
            for (int a = 0; a < hc; ++a)
                for (int b = 0; b < hc; ++b)
                    for (int l = 0; l < LANES; ++l) c[(a * hc + b) * LANES + l] /= denom[a * LANES + l];
        }
    }
}

/* Partial sums per reduction: 16 independent accumulators fill four SSE / two AVX / one AVX-512 vector
   and hide the add latency, so a sum over D runs at load speed instead of one dependent add per element.
   (Sums over hc * D therefore round in a different order than the reference: fp32-rounding level.) */
#define ACC 16

static float sum_squares(const float *restrict x, long n) {
    float acc[ACC] = {0.0f};
    long i = 0;
    for (; i + ACC <= n; i += ACC)
        for (int l = 0; l < ACC; ++l) acc[l] += x[i + l] * x[i + l];
    for (int l = 0; i < n; ++i, ++l) acc[l] += x[i] * x[i];
    for (int w = ACC / 2; w > 0; w /= 2) /* pairwise: log2(ACC) vector adds */
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

/* dst[d] = scale_o * o[d] + sum_k w[k * w_stride] x[k * D + d] over k < n (o NULL: no o term), summed in
   the reference's order. Inlined with a constant n (COMMON_HC) the k loop unrolls and the d loop
   vectorises; with a run-time n it stays scalar. */
static inline __attribute__((always_inline)) void weighted_sum(float *restrict dst, const float *restrict x,
        const float *w, int w_stride, int n, long D, float scale_o, const float *restrict o) {
    for (long d = 0; d < D; ++d) {
        float acc = w[0] * x[d];
        for (int k = 1; k < n; ++k) acc += w[k * w_stride] * x[k * D + d];
        dst[d] = o ? scale_o * o[d] + acc : acc;
    }
}

/* Stream tensors (streams, block input y, block output o, new streams) are fp32 or bf16 (`bf16` flag);
   the arithmetic is fp32 either way. bf16 rows are widened exactly into a per-token fp32 buffer and
   results rounded once on store, to nearest even as torch's `.to(torch.bfloat16)` does (NaN -> 0x7FC0),
   so a bf16 call is bit-identical to widening the tensors, running the fp32 kernel and rounding the
   results, without the three full-size fp32 copies that costs. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Elements [offset, offset + n) of a stream tensor as fp32: in place for fp32, widened into buf for bf16. */
static const float *load_row(const void *base, int bf16, long offset, long n, float *restrict buf) {
    if (!bf16) return (const float *)base + offset;
    const uint16_t *restrict h = (const uint16_t *)base + offset;
    for (long i = 0; i < n; ++i) buf[i] = bf16_to_f32(h[i]);
    return buf;
}

static void store_row(void *base, int bf16, long offset, const float *restrict src, long n) {
    if (!bf16) {
        memcpy((float *)base + offset, src, n * sizeof(float));
        return;
    }
    uint16_t *restrict h = (uint16_t *)base + offset;
    for (long i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]);
}

/* Fused mHC pre-step for T tokens. streams [T, hc_in, D] (hc_in = hc, or 1 when every stream is the
   same broadcast embedding), raw [T, mix] fp32 = flatten(streams) @ fn^T (the broadcast fn when hc_in = 1).
   rho = rsqrt(mean(flatten(streams)^2) + rms_eps); logits = raw * rho; coefficients as above into
   coef [T, mix] fp32; y [T, D] (streams' dtype) = sum_k pre_k R_k; then, if norm_w is not NULL, the
   weighted RMSNorm of y. Returns 0, or 1 when its scratch buffers cannot be allocated. */
int mhc_pre(const void *streams, int bf16, const float *restrict raw, const float *base, const float *scale,
            long T, int hc, int hc_in, long D, int iters, float rms_eps, float hc_eps, const float *norm_w,
            float norm_eps, float *restrict coef, void *y) {
    const int mix = 2 * hc + hc * hc;
    float lanes[16 * 16 * LANES];
    float *scratch = malloc((size_t)(hc_in * D + D) * sizeof(float)); /* bf16 rows: streams, then y */
    if (!scratch) return 1;
    for (long t0 = 0; t0 < T; t0 += LANES) { /* LANES tokens at a time, for the Sinkhorn lanes */
        const int nb = T - t0 < LANES ? (int)(T - t0) : LANES;
        for (int l = 0; l < nb; ++l) {
            const long t = t0 + l;
            const float *restrict x = load_row(streams, bf16, t * hc_in * D, hc_in * D, scratch);
            const float rho = 1.0f / sqrtf(sum_squares(x, hc_in * D) / (float)(hc_in * D) + rms_eps);
            float logits[2 * 16 + 16 * 16];
            for (int i = 0; i < mix; ++i) logits[i] = raw[t * mix + i] * rho;
            const float *pre = coef + t * mix;
            coefficients_head(logits, base, scale, hc, hc_eps, coef + t * mix);
            for (int i = 0; i < hc * hc; ++i) lanes[i * LANES + l] = pre[2 * hc + i];
            /* The block input needs only pre: collapse while this token's streams are still in cache. */
            float *restrict yt = bf16 ? scratch + hc_in * D : (float *)y + t * D;
            if (hc_in == 1) {
                float p = 0.0f;
                for (int k = 0; k < hc; ++k) p += pre[k];
                for (long d = 0; d < D; ++d) yt[d] = p * x[d];
            } else if (hc == COMMON_HC) {
                weighted_sum(yt, x, pre, 1, COMMON_HC, D, 0.0f, NULL);
            } else {
                weighted_sum(yt, x, pre, 1, hc, D, 0.0f, NULL);
            }
            if (norm_w) {
                const float r = 1.0f / sqrtf(sum_squares(yt, D) / (float)D + norm_eps);
                for (long d = 0; d < D; ++d) yt[d] = norm_w[d] * (yt[d] * r);
            }
            if (bf16) store_row(y, 1, t * D, yt, D);
        }
        for (int l = nb; l < LANES; ++l) /* unused lanes: any finite values, never read back */
            for (int i = 0; i < hc * hc; ++i) lanes[i * LANES + l] = 1.0f;
        if (hc == COMMON_HC) sinkhorn_lanes(lanes, COMMON_HC, iters, hc_eps);
        else sinkhorn_lanes(lanes, hc, iters, hc_eps);
        for (int l = 0; l < nb; ++l)
            for (int i = 0; i < hc * hc; ++i) coef[(t0 + l) * mix + 2 * hc + i] = lanes[i * LANES + l];
    }
    free(scratch);
    return 0;
}

/* mHC post-step: out[t, j, :] = post_j o_t + sum_i comb[i, j] R_i (hc_in = 1: R_i = e for every i), with
   streams, o [T, D] and out in one dtype, coef [T, mix] as written by mhc_pre. Each token's new streams
   are built in a scratch row and stored after its old streams are read, so out may be streams itself
   (hc_in = hc): the update in place. Returns 0, or 1 when its scratch buffers cannot be allocated. */
int mhc_post(const void *streams, int bf16, const void *o, const float *restrict coef, long T, int hc, int hc_in,
             long D, void *out) {
    const int mix = 2 * hc + hc * hc;
    float *scratch = malloc((size_t)(hc_in * D + D + hc * D) * sizeof(float)); /* streams, o, new streams */
    if (!scratch) return 1;
    float *restrict rows = scratch + hc_in * D + D;
    for (long t = 0; t < T; ++t) {
        const float *post = coef + t * mix + hc, *c = coef + t * mix + 2 * hc;
        /* not restrict: x may be the very row store_row overwrites below */
        const float *x = load_row(streams, bf16, t * hc_in * D, hc_in * D, scratch);
        const float *ot = load_row(o, bf16, t * D, D, scratch + hc_in * D);
        for (int j = 0; j < hc; ++j) {
            float *restrict dst = rows + j * D;
            const float pj = post[j];
            if (hc_in == 1) {
                float cs = 0.0f;
                for (int i = 0; i < hc; ++i) cs += c[i * hc + j];
                for (long d = 0; d < D; ++d) dst[d] = pj * ot[d] + cs * x[d];
            } else {
                /* column j of comb: sum_i comb[i, j] R_i */
                if (hc == COMMON_HC) weighted_sum(dst, x, c + j, COMMON_HC, COMMON_HC, D, pj, ot);
                else weighted_sum(dst, x, c + j, hc, hc, D, pj, ot);
            }
        }
        store_row(out, bf16, t * hc * D, rows, hc * D);
    }
    free(scratch);
    return 0;
}

/* In place on x [T, G, hd] (fp32, or bf16: each row widened, then rounded once on store): optional
   RMSNorm over hd (weighted when w is not NULL; eps < 0: none), then RoPE on the trailing 2 * rh channels,
   interleaved pairs, angle = pos[t] * inv_freq[i] (negated when inverse). rh = 0: norm only. Returns 0,
   or 1 when the bf16 scratch row cannot be allocated. */
int norm_rope(void *x, int bf16, long T, long G, long hd, float eps, const float *restrict w, const long *pos,
              const float *inv_freq, long rh, int inverse) {
    float cs[512], sn[512]; /* this token's cos / sin per rotary pair */
    float *scratch = bf16 ? malloc((size_t)hd * sizeof(float)) : NULL;
    if (bf16 && !scratch) return 1;
    for (long t = 0; t < T; ++t) {
        for (long i = 0; i < rh; ++i) {
            const float a = (float)pos[t] * inv_freq[i];
            cs[i] = cosf(a);
            sn[i] = inverse ? -sinf(a) : sinf(a);
        }
        for (long g = 0; g < G; ++g) {
            const long offset = (t * G + g) * hd;
            float *restrict v = bf16 ? scratch : (float *)x + offset;
            if (bf16) load_row(x, 1, offset, hd, scratch);
            if (eps >= 0.0f) {
                const float r = 1.0f / sqrtf(sum_squares(v, hd) / (float)hd + eps);
                if (w) { for (long d = 0; d < hd; ++d) v[d] = w[d] * (v[d] * r); }
                else { for (long d = 0; d < hd; ++d) v[d] = v[d] * r; }
            }
            float *restrict rp = v + hd - 2 * rh;
            for (long i = 0; i < rh; ++i) {
                const float a = rp[2 * i], b = rp[2 * i + 1];
                rp[2 * i] = a * cs[i] - b * sn[i];
                rp[2 * i + 1] = b * cs[i] + a * sn[i];
            }
            if (bf16) store_row(x, 1, offset, v, hd);
        }
    }
    free(scratch);
    return 0;
}
"""
_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-fast-math")


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
            result = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
            os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    lib = ctypes.CDLL(str(target))
    fn = lib.mhc_coefficients_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
    P, L, Int, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.mhc_pre.restype = Int
    lib.mhc_pre.argtypes = [P, Int, P, P, P, L, Int, Int, L, Int, F, F, P, F, P, P]
    lib.mhc_post.restype = Int
    lib.mhc_post.argtypes = [P, Int, P, P, L, Int, Int, L, P]
    lib.norm_rope.restype = Int
    lib.norm_rope.argtypes = [P, Int, L, L, L, F, P, P, P, L, Int]
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


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


# The kernel keeps per-token cos/sin on the stack: at most this many rotary pairs (the C arrays' size).
MAX_ROTARY_PAIRS = 512


# Stream dtypes the fused mHC kernel reads and writes (bf16 widened per token, arithmetic in fp32).
MHC_STREAM_DTYPES = (torch.float32, torch.bfloat16)


class MhcFusedKernel:
    """The whole mHC pre-step (RMS, coefficients + Sinkhorn, stream collapse, the sublayer's weighted
    RMSNorm) and the post-step (stream expansion) as one C call each on CPU, fp32 arithmetic on fp32 or
    bf16 streams. The mix GEMM stays a torch matmul (the caller passes its result), so this is
    `mhc.mix_logits` + `coefficients` + `collapse` + the norm, and `mhc.expand`, in 3 dispatches instead of
    ~40. `post(..., in_place=True)` writes the new streams over the old ones: a prefill of thousands of
    tokens then reuses one [T, hc, D] buffer instead of allocating (and page-faulting in) a fresh one per
    sublayer."""

    def __init__(self, lib: ctypes.CDLL):
        self._pre = lib.mhc_pre
        self._post = lib.mhc_post

    @staticmethod
    def supports(streams: torch.Tensor, hc: int, sinkhorn_iters: int) -> bool:
        dtype_ok = streams.dtype in MHC_STREAM_DTYPES and streams.device.type == "cpu" and streams.is_contiguous()
        return dtype_ok and hc <= MAX_HC and sinkhorn_iters >= 1

    def pre(
        self, streams: torch.Tensor, raw: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
        sinkhorn_iters: int, rms_eps: float, hc_eps: float, norm_weight: torch.Tensor | None, norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc_in, D] (hc_in = hc, or 1 for a broadcast embedding), raw [T, mix] = the
        un-normalised mix GEMM -> (coef [T, mix] fp32 = pre | post | comb, block input [T, D] in streams' dtype)."""
        T, hc_in, D = streams.shape
        raw = raw.float().contiguous()
        coef = torch.empty_like(raw)
        y = streams.new_empty(T, D)
        status = self._pre(streams.data_ptr(), _is_bf16(streams), raw.data_ptr(), base.data_ptr(), scale.data_ptr(),
                           T, hc, hc_in, D, sinkhorn_iters, rms_eps, hc_eps,
                           None if norm_weight is None else norm_weight.data_ptr(), norm_eps,
                           coef.data_ptr(), y.data_ptr())
        _check(status, "mhc_pre", T)
        return coef, y

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
        status = self._post(streams.data_ptr(), _is_bf16(streams), out.data_ptr(), coef.data_ptr(), T, hc, hc_in, D,
                            result.data_ptr())
        _check(status, "mhc_post", T)
        return result


def _is_bf16(streams: torch.Tensor) -> int:
    return int(streams.dtype == torch.bfloat16)


def _check(status: int, kernel: str, tokens: int) -> None:
    if status != 0:
        raise MemoryError(f"{kernel}: could not allocate its per-token scratch rows ({tokens} tokens)")


# Activation dtypes the norm/RoPE kernel accepts. bf16 rows are widened, computed in fp32 and rounded once
# (the reference's norm and rotation each upcast, compute and round): the result differs from it only by
# bf16 rounding.
NORM_ROPE_DTYPES = (torch.float32, torch.bfloat16)


class NormRopeKernel:
    """In place on a contiguous fp32 or bf16 CPU x [T, G, hd]: optional RMSNorm over hd (weighted or
    not), then interleaved RoPE of the trailing channels at positions [T] (cos/sin computed in the loop).
    The arithmetic is fp32 throughout (bf16 x: converted once, rounded once at the end)."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.norm_rope

    @staticmethod
    def supports(x: torch.Tensor, inv_freq: torch.Tensor | None = None) -> bool:
        x_ok = x.device.type == "cpu" and x.dtype in NORM_ROPE_DTYPES and x.is_contiguous()
        return x_ok and (inv_freq is None or (_f32_cpu(inv_freq) and inv_freq.numel() <= MAX_ROTARY_PAIRS))

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
        status = self._fn(x.data_ptr(), int(x.dtype == torch.bfloat16), T, G, hd, -1.0 if eps is None else eps,
                          None if weight is None else weight.data_ptr(),
                          None if positions is None else positions.contiguous().data_ptr(),
                          None if inv_freq is None else inv_freq.data_ptr(), rh, int(inverse))
        _check(status, "norm_rope", T)
        return x
