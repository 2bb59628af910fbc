/* mHC on CPU: the coefficients + Sinkhorn, and the fused pre/post steps (kernels/mhc_cpu.py). */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "rows.h"
#include "packed_call.h"

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

/* `mhc_pre`'s arguments, for its rows (`pre_rows`). */
typedef struct {
    const void *streams;
    int bf16;
    const float *raw, *base, *scale;
    int hc, hc_in, iters;
    long D;
    float rms_eps, hc_eps;
    const float *norm_w;
    float norm_eps;
    float *coef;
    void *y;
} pre_job;

/* Tokens [t0, t1) of `mhc_pre`, LANES at a time through the Sinkhorn lanes (each lane one token: a token's
   coefficients do not depend on the others in its block); 1 when a scratch row cannot be allocated. */
static int pre_rows(const void *arg, long t0, long t1) {
    const pre_job *j = arg;
    const int hc = j->hc, hc_in = j->hc_in, mix = 2 * hc + hc * hc;
    const long D = j->D;
    float lanes[16 * 16 * LANES];
    float *scratch = malloc((size_t)(hc_in * D + D) * sizeof(float)); /* bf16 rows: streams, then y */
    if (!scratch) return 1;
    for (long b0 = t0; b0 < t1; b0 += LANES) { /* LANES tokens at a time, for the Sinkhorn lanes */
        const int nb = t1 - b0 < LANES ? (int)(t1 - b0) : LANES;
        for (int l = 0; l < nb; ++l) {
            const long t = b0 + l;
            const float *restrict x = load_row(j->streams, j->bf16, t * hc_in * D, hc_in * D, scratch);
            const float rho = 1.0f / sqrtf(sum_squares(x, hc_in * D) / (float)(hc_in * D) + j->rms_eps);
            float logits[2 * 16 + 16 * 16];
            for (int i = 0; i < mix; ++i) logits[i] = j->raw[t * mix + i] * rho;
            const float *pre = j->coef + t * mix;
            coefficients_head(logits, j->base, j->scale, hc, j->hc_eps, j->coef + t * mix);
            for (int i = 0; i < hc * hc; ++i) lanes[i * LANES + l] = pre[2 * hc + i];
            /* The block input needs only pre: collapse while this token's streams are still in cache. */
            float *restrict yt = j->bf16 ? scratch + hc_in * D : (float *)j->y + t * D;
            if (hc_in == 1) {
                float p = 0.0f;
                for (int k = 0; k < hc; ++k) p += pre[k];
                for (long d = 0; d < D; ++d) yt[d] = p * x[d];
            } else if (hc == COMMON_HC) {
                weighted_sum(yt, x, pre, 1, COMMON_HC, D, 0.0f, NULL);
            } else {
                weighted_sum(yt, x, pre, 1, hc, D, 0.0f, NULL);
            }
            if (j->norm_w) {
                const float r = 1.0f / sqrtf(sum_squares(yt, D) / (float)D + j->norm_eps);
                for (long d = 0; d < D; ++d) yt[d] = j->norm_w[d] * (yt[d] * r);
            }
            if (j->bf16) store_row(j->y, 1, t * D, yt, D);
        }
        for (int l = nb; l < LANES; ++l) /* unused lanes: any finite values, never read back */
            for (int i = 0; i < hc * hc; ++i) lanes[i * LANES + l] = 1.0f;
        if (hc == COMMON_HC) sinkhorn_lanes(lanes, COMMON_HC, j->iters, j->hc_eps);
        else sinkhorn_lanes(lanes, hc, j->iters, j->hc_eps);
        for (int l = 0; l < nb; ++l)
            for (int i = 0; i < hc * hc; ++i) j->coef[(b0 + l) * mix + 2 * hc + i] = lanes[i * LANES + l];
    }
    free(scratch);
    return 0;
}

/* Fused mHC pre-step for T tokens. streams [T, hc_in, D] (hc_in = hc, or 1 when every stream is the
   same broadcast embedding), raw [T, mix] fp32 = flatten(streams) @ fn^T (the broadcast fn when hc_in = 1).
   rho = rsqrt(mean(flatten(streams)^2) + rms_eps); logits = raw * rho; coefficients as above into
   coef [T, mix] fp32; y [T, D] (streams' dtype) = sum_k pre_k R_k; then, if norm_w is not NULL, the
   weighted RMSNorm of y. Tokens spread over `nthreads` threads of `pool` by `run` (NULL: the caller's thread).
   Returns 0, or 1 when its scratch buffers cannot be allocated. */
int mhc_pre(const void *streams, int bf16, const float *restrict raw, const float *base, const float *scale,
            long T, int hc, int hc_in, long D, int iters, float rms_eps, float hc_eps, const float *norm_w,
            float norm_eps, float *restrict coef, void *y, void *pool, pool_for_fn run, int nthreads) {
    pre_job job = {.streams = streams, .bf16 = bf16, .raw = raw, .base = base, .scale = scale, .hc = hc,
                   .hc_in = hc_in, .iters = iters, .D = D, .rms_eps = rms_eps, .hc_eps = hc_eps, .norm_w = norm_w,
                   .norm_eps = norm_eps, .coef = coef, .y = y};
    return run_rows(pre_rows, &job, T, pool, run, nthreads);
}

/* The model's final pre-only collapse (hc_head) of T tokens: streams [T, hc, D] (fp32 or bf16), raw [T, hc] fp32 =
   flatten(streams) @ fn^T; rho = rsqrt(mean(flatten(streams)^2) + rms_eps); pre_k = sigmoid(raw_k rho scale[0] +
   base_k) + hc_eps; y [T, D] (streams' dtype) = sum_k pre_k R_k. Returns 0, or 1 when its scratch row cannot be
   allocated. */
int mhc_head(const void *streams, int bf16, const float *restrict raw, const float *base, const float *scale, long T, int hc,
             long D, float rms_eps, float hc_eps, void *y) {
    float *scratch = malloc((size_t)(hc * D + D) * sizeof(float)); /* bf16 rows: streams, then y */
    if (!scratch) return 1;
    for (long t = 0; t < T; ++t) {
        const float *restrict x = load_row(streams, bf16, t * hc * D, hc * D, scratch);
        const float rho = 1.0f / sqrtf(sum_squares(x, hc * D) / (float)(hc * D) + rms_eps);
        float pre[16];
        for (int k = 0; k < hc; ++k) pre[k] = sigmoidf_(raw[t * hc + k] * rho * scale[0] + base[k]) + hc_eps;
        float *restrict yt = bf16 ? scratch + hc * D : (float *)y + t * D;
        if (hc == COMMON_HC) weighted_sum(yt, x, pre, 1, COMMON_HC, D, 0.0f, NULL);
        else weighted_sum(yt, x, pre, 1, hc, D, 0.0f, NULL);
        if (bf16) store_row(y, 1, t * D, yt, D);
    }
    free(scratch);
    return 0;
}

/* `mhc_post`'s arguments, for its rows (`post_rows`). */
typedef struct {
    const void *streams, *o;
    int bf16, hc, hc_in;
    const float *coef;
    long D;
    void *out;
} post_job;

/* Tokens [t0, t1) of `mhc_post`; 1 when its scratch rows cannot be allocated. */
static int post_rows(const void *arg, long t0, long t1) {
    const post_job *j = arg;
    const int hc = j->hc, hc_in = j->hc_in, mix = 2 * hc + hc * hc;
    const long D = j->D;
    float *scratch = malloc((size_t)(hc_in * D + D + hc * D) * sizeof(float)); /* streams, o, new streams */
    if (!scratch) return 1;
    float *restrict rows = scratch + hc_in * D + D;
    for (long t = t0; t < t1; ++t) {
        const float *post = j->coef + t * mix + hc, *c = j->coef + t * mix + 2 * hc;
        /* not restrict: x may be the very row store_row overwrites below */
        const float *x = load_row(j->streams, j->bf16, t * hc_in * D, hc_in * D, scratch);
        const float *ot = load_row(j->o, j->bf16, t * D, D, scratch + hc_in * D);
        for (int jj = 0; jj < hc; ++jj) {
            float *restrict dst = rows + jj * D;
            const float pj = post[jj];
            if (hc_in == 1) {
                float cs = 0.0f;
                for (int i = 0; i < hc; ++i) cs += c[i * hc + jj];
                for (long d = 0; d < D; ++d) dst[d] = pj * ot[d] + cs * x[d];
            } else {
                /* column jj of comb: sum_i comb[i, jj] R_i */
                if (hc == COMMON_HC) weighted_sum(dst, x, c + jj, COMMON_HC, COMMON_HC, D, pj, ot);
                else weighted_sum(dst, x, c + jj, hc, hc, D, pj, ot);
            }
        }
        store_row(j->out, j->bf16, t * hc * D, rows, hc * D);
    }
    free(scratch);
    return 0;
}

/* mHC post-step: out[t, j, :] = post_j o_t + sum_i comb[i, j] R_i (hc_in = 1: R_i = e for every i), with
   streams, o [T, D] and out in one dtype, coef [T, mix] as written by mhc_pre. Each token's new streams
   are built in a scratch row and stored after its old streams are read, so out may be streams itself
   (hc_in = hc): the update in place. Tokens spread over `nthreads` threads of `pool` by `run` (NULL: the caller's thread).
   Returns 0, or 1 when its scratch buffers cannot be allocated. */
int mhc_post(const void *streams, int bf16, const void *o, const float *restrict coef, long T, int hc, int hc_in,
             long D, void *out, void *pool, pool_for_fn run, int nthreads) {
    post_job job = {.streams = streams, .o = o, .bf16 = bf16, .hc = hc, .hc_in = hc_in, .coef = coef, .D = D,
                    .out = out};
    return run_rows(post_rows, &job, T, pool, run, nthreads);
}

/* The mix GEMM of a few tokens (`mhc_mix`): its arguments. Each row's outputs are cut into `parts` ranges, a unit
   of work per (row, range): a single decode row then still spreads over the threads (its 24 outputs read a 196 KiB
   fn on the small config: ~14 us a call on one core from a cold cache, 17 calls a step). */
typedef struct {
    const void *streams;
    int bf16;
    long T, K, mix, parts;
    const float *fn;
    float *out;
} mix_job;

/* Outputs `mix_dots` sums at once: independent chains of fused multiply-adds, one register each; a range's rest
   takes groups of half as many before single dot products. */
#define MIX_OUTPUTS 8
#define MIX_HALF (MIX_OUTPUTS / 2)

#if defined(__AVX512F__)
/* out[m + k] = dot(x, fn[m + k]) for k < n (n a constant where inlined): n chains sharing each load of x. */
static inline __attribute__((always_inline)) void mix_group(const float *restrict x, const float *restrict fn, long K,
                                                            long m, int n, float *restrict out) {
    __m512 acc[MIX_OUTPUTS];
    for (int k = 0; k < n; ++k) acc[k] = _mm512_setzero_ps();
    for (long c = 0; c < K; c += 16) {
        const __m512 xc = _mm512_loadu_ps(x + c);
        for (int k = 0; k < n; ++k) acc[k] = _mm512_fmadd_ps(xc, _mm512_loadu_ps(fn + (m + k) * K + c), acc[k]);
    }
    for (int k = 0; k < n; ++k) out[m + k] = _mm512_reduce_add_ps(acc[k]); /* dot's pairwise tree */
}
#endif

/* out[m] = dot(x, fn[m]) for m in [m0, m1) (dot.h's dot product, bit for bit, whatever the range's cut). With AVX-512
   and K a multiple of 16, MIX_OUTPUTS (then MIX_HALF) outputs at a time share each load of x: one dot product at a
   time is a single chain of dependent adds (on the small config's 2048 inputs ~4x the time of its arithmetic). */
static void mix_dots(const float *restrict x, const float *restrict fn, long K, long m0, long m1, float *restrict out) {
    long m = m0;
#if defined(__AVX512F__)
    if (K % 16 == 0 && ACC == 16) {
        for (; m + MIX_OUTPUTS <= m1; m += MIX_OUTPUTS) mix_group(x, fn, K, m, MIX_OUTPUTS, out);
        for (; m + MIX_HALF <= m1; m += MIX_HALF) mix_group(x, fn, K, m, MIX_HALF, out);
    }
#endif
    for (; m < m1; ++m) out[m] = dot(x, fn + m * K, K);
}

/* First output of range `part` of a row: ranges as even as MIX_HALF-aligned cuts allow, the last ending at mix. */
static long mix_cut(const mix_job *j, long part) {
    return part >= j->parts ? j->mix : (part * j->mix / j->parts) / MIX_HALF * MIX_HALF;
}

/* Units [u0, u1) of `mhc_mix` (unit u: row u / parts, output range u % parts); 1 when a bf16 row's buffer cannot be
   allocated. */
static int mix_units(const void *job, long u0, long u1) {
    const mix_job *j = job;
    float *buf = j->bf16 ? malloc((size_t)j->K * sizeof(float)) : NULL;
    if (j->bf16 && !buf) return 1;
    for (long u = u0; u < u1; ++u) {
        const long t = u / j->parts, part = u % j->parts;
        mix_dots(load_row(j->streams, j->bf16, t * j->K, j->K, buf), j->fn, j->K, mix_cut(j, part),
                 mix_cut(j, part + 1), j->out + t * j->mix);
    }
    free(buf);
    return 0;
}

/* out[T, mix] fp32 = flatten(streams) [T, K] (fp32 or bf16) @ fn^T, fn [mix, K] fp32 row-major: the mix GEMM of
   `mhc_pre`'s `raw` for a few tokens (a decode step's), each output one dot product (dot.h's order, so a token's
   logits do not depend on the other tokens or the threads), spread over `nthreads` threads of `pool` by `run`
   (NULL: the caller's thread): whole rows when there are at least as many as threads, else each row's outputs cut
   into one range per thread. Returns 0, or 1 when a scratch row cannot be allocated. */
int mhc_mix(const void *streams, int bf16, long T, long K, const float *fn, long mix, float *out, void *pool,
            pool_for_fn run, int nthreads) {
    const long parts = run && nthreads > 1 && T < nthreads ? nthreads : 1;
    mix_job job = {.streams = streams, .bf16 = bf16, .T = T, .K = K, .mix = mix, .parts = parts, .fn = fn, .out = out};
    return run_rows(mix_units, &job, T * parts, pool, run, nthreads);
}

/* Each replayable kernel's twin taking its arguments from a block, and their letters (packed_call.h). */
const char *const mhc_coefficients_f32_signature = "pppliifp";
int mhc_coefficients_f32_packed(const packed_arg *a) {
    mhc_coefficients_f32(a[0].p, a[1].p, a[2].p, a[3].l, a[4].i, a[5].i, a[6].f, a[7].p);
    return 0;
}
const char *const mhc_pre_signature = "pipppliiliffpfppppi";
int mhc_pre_packed(const packed_arg *a) {
    return mhc_pre(a[0].p, a[1].i, a[2].p, a[3].p, a[4].p, a[5].l, a[6].i, a[7].i, a[8].l, a[9].i, a[10].f, a[11].f,
                   a[12].p, a[13].f, a[14].p, a[15].p, a[16].p, (pool_for_fn)a[17].p, a[18].i);
}
const char *const mhc_post_signature = "pippliilpppi";
int mhc_post_packed(const packed_arg *a) {
    return mhc_post(a[0].p, a[1].i, a[2].p, a[3].p, a[4].l, a[5].i, a[6].i, a[7].l, a[8].p, a[9].p,
                    (pool_for_fn)a[10].p, a[11].i);
}
const char *const mhc_mix_signature = "pillplpppi";
int mhc_mix_packed(const packed_arg *a) {
    return mhc_mix(a[0].p, a[1].i, a[2].l, a[3].l, a[4].p, a[5].l, a[6].p, a[7].p, (pool_for_fn)a[8].p, a[9].i);
}
const char *const mhc_head_signature = "pippplilffp";
int mhc_head_packed(const packed_arg *a) {
    return mhc_head(a[0].p, a[1].i, a[2].p, a[3].p, a[4].p, a[5].l, a[6].i, a[7].l, a[8].f, a[9].f, a[10].p);
}
