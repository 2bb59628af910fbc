/* Few-row products with weights read straight from their resident layout, for CPU decode steps.
 *
 * A decode step of a few rows is bound by reading the weights once: these loops stream each weight
 * byte once per call, split the output features across the caller's threads, and decode quantized
 * weights in registers (no dequantized copy is ever written). Python side: gemv_cpu.py.
 *
 *   dense_xw    y[R, N] = x[R, K] W^T, W resident input-major: storage [K, N] (row k contiguous), fp32 or bf16
 *   quant_xw    y[R, N] = x[R, K] W^T, W [N, K] output-major: FP8 e4m3 with fp32 block scales [ceil(N/b0),
 *               ceil(K/b1)], or FP4 e2m1 (two codes a byte, low nibble = even input) with ue8m0 scales [N, K/g]
 *   moe_experts the routed-expert sum of one MoE layer, out[T, D] = sum_j w_tj E_{e_tj}(x_t), E_e(x) =
 *               W2_e (silu(min(W1_e x, L)) * clamp(W3_e x, -L, L)), for dense, FP8 or FP4 expert stacks
 *
 * Activations (x, y, out) are fp32 or bf16 (bf16: widened on load, rounded to nearest-even once on store);
 * all arithmetic is fp32. Threads: OpenMP, linked against the libgomp torch itself loads (same soname),
 * so these loops run on torch's own intra-op threads instead of competing with them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ACT_F32 = 0, ACT_BF16 = 1 };
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_FP8 = 2, FMT_FP4 = 3 };
enum { OK = 0, ERR_ALLOC = 1, ERR_ARGS = 2 };

/* Columns of one dense pass: 4 weight rows x TILE_N floats (16 KiB) stay in L1 while every x row uses them. */
#define TILE_N 16384
/* Weight rows folded per pass over the accumulators: 4 independent streams keep the prefetchers busy and
   cut the accumulator traffic to 1/4 of the weight traffic. */
#define K_UNROLL 4
/* Output features are split between threads in multiples of this (one cache line of fp32). */
#define SPLIT_ALIGN 16
/* Below this many weight bytes a call runs on one thread: waking a second costs more than it saves. */
#define MIN_PARALLEL_BYTES (64 * 1024)
#define E8M0_BIAS 127

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float as_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e4m3fn byte -> float, branch-free (vectorises). Normals: the 7 exponent+mantissa bits moved under the
   fp32 exponent with the bias difference (127 - 7 = 120) added; subnormals (exponent 0): mantissa * 2^-9.
   0x7f/0xff (NaN) decode to 480: resident weights are validated finite, so no NaN code is ever stored. */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t em = b & 0x7fu;
    const float normal = as_float((em << 20) + (120u << 23));
    const float sub = (float)em * 0x1p-9f;
    const float mag = em < 8 ? sub : normal;
    return (b & 0x80u) ? -mag : mag;
}

/* e2m1 code (bit 3 = sign) -> float, branch-free: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. Codes >= 2 are
   normals: exponent = code >> 1 (bias 1), one mantissa bit; 0 and 1 are 0 and 0.5. */
static inline float e2m1_to_f32(uint32_t c) {
    const uint32_t m = c & 7u;
    const float normal = as_float((m << 22) + (126u << 23));
    const float mag = m < 2 ? 0.5f * (float)m : normal;
    return (c & 8u) ? -mag : mag;
}

static inline float e8m0_to_f32(uint8_t s) { return ldexpf(1.0f, (int)s - E8M0_BIAS); }

/* [lo, hi) of n items for thread t of nt, cut at multiples of align. */
static void split(long n, int t, int nt, long align, long *lo, long *hi) {
    long units = (n + align - 1) / align;
    long a = units * t / nt, b = units * (t + 1) / nt;
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
}

/* Bytes a matrix of `elements` weights occupies in format fmt. */
static long matrix_bytes(int fmt, long elements) {
    return fmt == FMT_F32 ? 4 * elements : fmt == FMT_BF16 ? 2 * elements : fmt == FMT_FP8 ? elements : elements / 2;
}

static int threads_for(long weight_bytes, int nthreads) {
    return weight_bytes < MIN_PARALLEL_BYTES || nthreads < 1 ? 1 : nthreads;
}

/* Rows of x as fp32 (a copy only for bf16). */
static const float *rows_f32(const void *x, int act, long count, float *scratch) {
    if (act == ACT_F32) return (const float *)x;
    const uint16_t *h = (const uint16_t *)x;
    for (long i = 0; i < count; ++i) scratch[i] = bf16_to_f32(h[i]);
    return scratch;
}

static void store_row(void *y, int act, long offset, const float *v, long n) {
    if (act == ACT_F32) {
        memcpy((float *)y + offset, v, sizeof(float) * (size_t)n);
    } else {
        uint16_t *h = (uint16_t *)y + offset;
        for (long i = 0; i < n; ++i) h[i] = f32_to_bf16(v[i]);
    }
}

/* ---------------------------------------------------------------------------------------------------- */
/* Dense, input-major: acc[r, n0:n1] = sum_k x[r, k] W[k, n] for W rows of ldw elements (fp32 or bf16).  */
/* ---------------------------------------------------------------------------------------------------- */

static void dense_tile(const float *restrict x, long R, long K, long ldx, const void *w, int wfmt, long ldw,
                       long n0, long n1, float *restrict acc, long ldacc) {
    const long width = n1 - n0;
    for (long r = 0; r < R; ++r) memset(acc + r * ldacc, 0, sizeof(float) * (size_t)width);
    long k = 0;
    if (wfmt == FMT_F32) {
        const float *W = (const float *)w;
        for (; k + K_UNROLL <= K; k += K_UNROLL) {
            const float *restrict w0 = W + k * ldw + n0, *restrict w1 = w0 + ldw, *restrict w2 = w1 + ldw,
                                  *restrict w3 = w2 + ldw;
            for (long r = 0; r < R; ++r) {
                const float a0 = x[r * ldx + k], a1 = x[r * ldx + k + 1], a2 = x[r * ldx + k + 2],
                            a3 = x[r * ldx + k + 3];
                float *restrict out = acc + r * ldacc;
                for (long n = 0; n < width; ++n) out[n] += a0 * w0[n] + a1 * w1[n] + a2 * w2[n] + a3 * w3[n];
            }
        }
        for (; k < K; ++k) {
            const float *restrict w0 = W + k * ldw + n0;
            for (long r = 0; r < R; ++r) {
                const float a0 = x[r * ldx + k];
                float *restrict out = acc + r * ldacc;
                for (long n = 0; n < width; ++n) out[n] += a0 * w0[n];
            }
        }
    } else {
        const uint16_t *W = (const uint16_t *)w;
        for (; k + K_UNROLL <= K; k += K_UNROLL) {
            const uint16_t *restrict w0 = W + k * ldw + n0, *restrict w1 = w0 + ldw, *restrict w2 = w1 + ldw,
                                     *restrict w3 = w2 + ldw;
            for (long r = 0; r < R; ++r) {
                const float a0 = x[r * ldx + k], a1 = x[r * ldx + k + 1], a2 = x[r * ldx + k + 2],
                            a3 = x[r * ldx + k + 3];
                float *restrict out = acc + r * ldacc;
                for (long n = 0; n < width; ++n)
                    out[n] += a0 * bf16_to_f32(w0[n]) + a1 * bf16_to_f32(w1[n]) + a2 * bf16_to_f32(w2[n]) +
                              a3 * bf16_to_f32(w3[n]);
            }
        }
        for (; k < K; ++k) {
            const uint16_t *restrict w0 = W + k * ldw + n0;
            for (long r = 0; r < R; ++r) {
                const float a0 = x[r * ldx + k];
                float *restrict out = acc + r * ldacc;
                for (long n = 0; n < width; ++n) out[n] += a0 * bf16_to_f32(w0[n]);
            }
        }
    }
}

/* acc[R, n0:n1) for a dense input-major W, a TILE_N-column tile at a time (acc rows of ldacc floats). */
static void dense_range(const float *x, long R, long K, long ldx, const void *w, int wfmt, long ldw, long n0, long n1,
                        float *acc, long ldacc) {
    for (long t0 = n0; t0 < n1; t0 += TILE_N) {
        long t1 = t0 + TILE_N < n1 ? t0 + TILE_N : n1;
        dense_tile(x, R, K, ldx, w, wfmt, ldw, t0, t1, acc + (t0 - n0), ldacc);
    }
}

int dense_xw(const void *x, int act, long R, long K, const void *w, int wfmt, long ldw, long N, void *y,
             int nthreads) {
    if ((wfmt != FMT_F32 && wfmt != FMT_BF16) || R <= 0 || K <= 0 || N <= 0 || ldw < N) return ERR_ARGS;
    float *xf = act == ACT_BF16 ? malloc(sizeof(float) * (size_t)(R * K)) : NULL;
    if (act == ACT_BF16 && !xf) return ERR_ALLOC;
    const float *xs = rows_f32(x, act, R * K, xf);
    const long wbytes = matrix_bytes(wfmt, K * N);
    int status = OK;
#pragma omp parallel num_threads(threads_for(wbytes, nthreads))
    {
        long n0, n1;
        split(N, omp_get_thread_num(), omp_get_num_threads(), SPLIT_ALIGN, &n0, &n1);
        if (n1 > n0) {
            float *acc = act == ACT_F32 ? NULL : malloc(sizeof(float) * (size_t)(R * (n1 - n0)));
            if (act == ACT_F32) {
                /* accumulate straight into y's columns */
                dense_range(xs, R, K, K, w, wfmt, ldw, n0, n1, (float *)y + n0, N);
            } else if (acc) {
                dense_range(xs, R, K, K, w, wfmt, ldw, n0, n1, acc, n1 - n0);
                for (long r = 0; r < R; ++r) store_row(y, act, r * N + n0, acc + r * (n1 - n0), n1 - n0);
            } else {
#pragma omp atomic write
                status = ERR_ALLOC;
            }
            free(acc);
        }
    }
    free(xf);
    return status;
}

/* ---------------------------------------------------------------------------------------------------- */
/* Quantized, output-major: acc[r, n] for n in [n0, n1), weight row n decoded in registers.             */
/* ---------------------------------------------------------------------------------------------------- */

/* Largest K the per-row decode buffer holds (the stack array below); larger inputs are an argument error. */
#define MAX_QUANT_K 16384
/* Rows of x one decoded weight row is reused for before the next chunk of rows. */
#define ROW_CHUNK 16

/* Partial sums per dot product: 16 independent lanes (one AVX-512 / two AVX vectors) let the compiler
   vectorise the reductions without reassociating them (no -ffast-math): lane l sums inputs l, l+16, ... */
#define LANES 16

/* sum over the blocks [k0, k1) of K of scale(block) * (x . w) with w decoded into dec[]; blocks of `block`
   inputs (a multiple of LANES, or the tail of K), the block scales given by scale_of(b). */
static inline float scaled_dot(const float *restrict x, const float *restrict dec, long K, long block,
                               const float *restrict scales) {
    float acc[LANES] = {0.0f};
    for (long k0 = 0, b = 0; k0 < K; k0 += block, ++b) {
        const long k1 = k0 + block < K ? k0 + block : K;
        float part[LANES] = {0.0f};
        long k = k0;
        for (; k + LANES <= k1; k += LANES)
            for (int l = 0; l < LANES; ++l) part[l] += x[k + l] * dec[k + l];
        for (int l = 0; k < k1; ++k, ++l) part[l] += x[k] * dec[k];
        for (int l = 0; l < LANES; ++l) acc[l] += scales[b] * part[l];
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

/* FP8 rows [n0, n1): each row decoded once into dec, then dotted with every x row. */
static void fp8_rows(const float *x, long R, long K, const uint8_t *w, const float *scale, long b0, long b1,
                     long n0, long n1, float *acc, long ldacc) {
    float dec[MAX_QUANT_K];
    const long kb_count = (K + b1 - 1) / b1;
    for (long n = n0; n < n1; ++n) {
        const uint8_t *restrict wr = w + n * K;
        for (long k = 0; k < K; ++k) dec[k] = e4m3_to_f32(wr[k]);
        const float *srow = scale + (n / b0) * kb_count;
        for (long r = 0; r < R; ++r) acc[r * ldacc + (n - n0)] = scaled_dot(x + r * K, dec, K, b1, srow);
    }
}

/* FP4 rows [n0, n1): decoded in input order (byte j = inputs 2j | 2j+1), then dotted group by group. */
static void fp4_rows(const float *x, long R, long K, const uint8_t *w, const uint8_t *scale, long group, long n0,
                     long n1, float *acc, long ldacc) {
    float dec[MAX_QUANT_K];
    float sc[MAX_QUANT_K / 2];
    const long half = K / 2, groups = K / group;
    for (long n = n0; n < n1; ++n) {
        const uint8_t *restrict wr = w + n * half;
        for (long j = 0; j < half; ++j) {
            dec[2 * j] = e2m1_to_f32(wr[j] & 0xfu);
            dec[2 * j + 1] = e2m1_to_f32(wr[j] >> 4);
        }
        const uint8_t *srow = scale + n * groups;
        for (long g = 0; g < groups; ++g) sc[g] = e8m0_to_f32(srow[g]);
        for (long r = 0; r < R; ++r) acc[r * ldacc + (n - n0)] = scaled_dot(x + r * K, dec, K, group, sc);
    }
}

static void quant_range(const float *x, long R, long K, int wfmt, const void *w, const void *scale, long b0, long b1,
                        long n0, long n1, float *acc, long ldacc) {
    for (long r0 = 0; r0 < R; r0 += ROW_CHUNK) {
        long rows = R - r0 < ROW_CHUNK ? R - r0 : ROW_CHUNK;
        if (wfmt == FMT_FP8)
            fp8_rows(x + r0 * K, rows, K, (const uint8_t *)w, (const float *)scale, b0, b1, n0, n1,
                     acc + r0 * ldacc, ldacc);
        else
            fp4_rows(x + r0 * K, rows, K, (const uint8_t *)w, (const uint8_t *)scale, b1, n0, n1, acc + r0 * ldacc,
                     ldacc);
    }
}

static int quant_args_ok(int wfmt, long K, long b0, long b1) {
    if (K <= 0 || K > MAX_QUANT_K) return 0;
    if (wfmt == FMT_FP8) return b0 > 0 && b1 > 0;
    if (wfmt == FMT_FP4) return b1 > 0 && K % b1 == 0 && K % 2 == 0;
    return 0;
}

/* b0, b1: the FP8 block (b0 output rows x b1 inputs); FP4: b1 = inputs per scale (b0 unused). */
int quant_xw(const void *x, int act, long R, long K, int wfmt, const void *w, const void *scale, long b0, long b1,
             long N, void *y, int nthreads) {
    if (!quant_args_ok(wfmt, K, b0, b1) || R <= 0 || N <= 0) return ERR_ARGS;
    float *xf = act == ACT_BF16 ? malloc(sizeof(float) * (size_t)(R * K)) : NULL;
    if (act == ACT_BF16 && !xf) return ERR_ALLOC;
    const float *xs = rows_f32(x, act, R * K, xf);
    const long wbytes = matrix_bytes(wfmt, K * N);
    int status = OK;
#pragma omp parallel num_threads(threads_for(wbytes, nthreads))
    {
        long n0, n1;
        split(N, omp_get_thread_num(), omp_get_num_threads(), 1, &n0, &n1);
        if (n1 > n0) {
            float *acc = malloc(sizeof(float) * (size_t)(R * (n1 - n0)));
            if (acc) {
                quant_range(xs, R, K, wfmt, w, scale, b0, b1, n0, n1, acc, n1 - n0);
                for (long r = 0; r < R; ++r) store_row(y, act, r * N + n0, acc + r * (n1 - n0), n1 - n0);
                free(acc);
            } else {
#pragma omp atomic write
                status = ERR_ALLOC;
            }
        }
    }
    free(xf);
    return status;
}

/* ---------------------------------------------------------------------------------------------------- */
/* Routed experts of one MoE layer.                                                                     */
/* ---------------------------------------------------------------------------------------------------- */

/* One expert matrix: dense input-major [in, out] (ld = out) or quantized output-major [out, in]. */
typedef struct {
    int fmt;
    const void *w;     /* this expert's weight */
    const void *scale; /* FP8: fp32 block grid; FP4: ue8m0 bytes [out, in / b1] */
    long in, out;
} expert_matrix;

static expert_matrix expert(int fmt, const void *w, const void *scale, long e, long in, long out, long b0, long b1) {
    expert_matrix m = {fmt, NULL, NULL, in, out};
    if (fmt == FMT_F32) m.w = (const float *)w + e * in * out;
    else if (fmt == FMT_BF16) m.w = (const uint16_t *)w + e * in * out;
    else if (fmt == FMT_FP8) {
        m.w = (const uint8_t *)w + e * in * out;
        m.scale = (const float *)scale + e * ((out + b0 - 1) / b0) * ((in + b1 - 1) / b1);
    } else {
        m.w = (const uint8_t *)w + e * in * out / 2;
        m.scale = (const uint8_t *)scale + e * out * (in / b1);
    }
    return m;
}

/* acc[R, n0:n1) = x[R, in] M^T restricted to outputs [n0, n1). */
static void matrix_range(const float *x, long R, expert_matrix m, long b0, long b1, long n0, long n1, float *acc,
                         long ldacc) {
    if (m.fmt == FMT_F32 || m.fmt == FMT_BF16)
        dense_range(x, R, m.in, m.in, m.w, m.fmt, m.out, n0, n1, acc, ldacc);
    else
        quant_range(x, R, m.in, m.fmt, m.w, m.scale, b0, b1, n0, n1, acc, ldacc);
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* x [T, D] (act), ids [T, k] int64, weights [T, k] fp32 -> out [T, D] (act, overwritten).
   w1/w3: [E, I, D] logical (gate / up), w2: [E, D, I] logical, in format fmt (dense: input-major storage).
   Experts run in ascending id order and each output element accumulates in that order, as the reference
   loop does; the only differences from it are the fp32 summation orders inside the products. */
int moe_experts(const void *x, int act, long T, long D, long I, long topk, const int64_t *ids, const float *weights,
                long E, int fmt, const void *w1, const void *s1, const void *w3, const void *s3, const void *w2,
                const void *s2, long b0, long b1, float limit, void *out, int nthreads) {
    if (T <= 0 || D <= 0 || I <= 0 || topk <= 0 || E <= 0) return ERR_ARGS;
    if ((fmt == FMT_FP8 || fmt == FMT_FP4) && (!quant_args_ok(fmt, D, b0, b1) || !quant_args_ok(fmt, I, b0, b1)))
        return ERR_ARGS;
    const long P = T * topk;
    for (long p = 0; p < P; ++p)
        if (ids[p] < 0 || ids[p] >= E) return ERR_ARGS;
    /* Counting sort of the picks by expert (stable: token order within an expert). */
    long *start = calloc((size_t)E + 1, sizeof(long));
    long *token = malloc(sizeof(long) * (size_t)P);
    float *pick_w = malloc(sizeof(float) * (size_t)P);
    float *xs = malloc(sizeof(float) * (size_t)(P * D)); /* gathered rows, grouped by expert */
    float *h = malloc(sizeof(float) * (size_t)(P * I));  /* SwiGLU hidden rows */
    float *accum = malloc(sizeof(float) * (size_t)(T * D));
    long *fill = malloc(sizeof(long) * (size_t)E);
    int status = OK;
    if (!start || !token || !pick_w || !xs || !h || !accum || !fill) {
        status = ERR_ALLOC;
        goto done;
    }
    for (long p = 0; p < P; ++p) start[ids[p] + 1]++;
    for (long e = 0; e < E; ++e) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(long) * (size_t)E);
    for (long p = 0; p < P; ++p) {
        long slot = fill[ids[p]]++;
        token[slot] = p / topk;
        pick_w[slot] = weights[p];
    }
    for (long s = 0; s < P; ++s) {
        if (act == ACT_F32) memcpy(xs + s * D, (const float *)x + token[s] * D, sizeof(float) * (size_t)D);
        else
            for (long d = 0; d < D; ++d) xs[s * D + d] = bf16_to_f32(((const uint16_t *)x)[token[s] * D + d]);
    }
    memset(accum, 0, sizeof(float) * (size_t)(T * D));
    const long used_bytes = 3 * matrix_bytes(fmt, D * I) * (P < E ? P : E); /* at most P experts are read */
#pragma omp parallel num_threads(threads_for(used_bytes, nthreads))
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long i0, i1, d0, d1;
        split(I, t, nt, SPLIT_ALIGN, &i0, &i1);
        split(D, t, nt, SPLIT_ALIGN, &d0, &d1);
        float *gate = malloc(sizeof(float) * (size_t)(P * (i1 - i0 > 0 ? i1 - i0 : 1)));
        float *up = malloc(sizeof(float) * (size_t)(P * (i1 - i0 > 0 ? i1 - i0 : 1)));
        float *y = malloc(sizeof(float) * (size_t)(P * (d1 - d0 > 0 ? d1 - d0 : 1)));
        int ok = gate && up && y;
        if (!ok) {
#pragma omp atomic write
            status = ERR_ALLOC;
        }
        /* Phase 1: this thread's hidden columns [i0, i1) of every pick's row. */
        for (long e = 0; ok && e < E && i1 > i0; ++e) {
            const long rows = start[e + 1] - start[e];
            if (rows == 0) continue;
            const float *xe = xs + start[e] * D;
            const long w = i1 - i0;
            matrix_range(xe, rows, expert(fmt, w1, s1, e, D, I, b0, b1), b0, b1, i0, i1, gate, w);
            matrix_range(xe, rows, expert(fmt, w3, s3, e, D, I, b0, b1), b0, b1, i0, i1, up, w);
            for (long r = 0; r < rows; ++r)
                for (long i = 0; i < w; ++i) {
                    const float g = gate[r * w + i], u = up[r * w + i];
                    const float gc = g < limit ? g : limit;
                    const float uc = u < -limit ? -limit : (u > limit ? limit : u);
                    h[(start[e] + r) * I + i0 + i] = silu(gc) * uc;
                }
        }
#pragma omp barrier
        /* Phase 2: this thread's output columns [d0, d1), experts in ascending order. */
        for (long e = 0; ok && e < E && d1 > d0; ++e) {
            const long rows = start[e + 1] - start[e];
            if (rows == 0) continue;
            const long w = d1 - d0;
            matrix_range(h + start[e] * I, rows, expert(fmt, w2, s2, e, I, D, b0, b1), b0, b1, d0, d1, y, w);
            for (long r = 0; r < rows; ++r) {
                const long s = start[e] + r;
                float *dst = accum + token[s] * D + d0;
                for (long d = 0; d < w; ++d) {
                    const float v = y[r * w + d] * pick_w[s];
                    /* bf16: the reference adds bf16-rounded products into a bf16 sum */
                    dst[d] = act == ACT_F32 ? dst[d] + v
                                            : bf16_to_f32(f32_to_bf16(dst[d] + bf16_to_f32(f32_to_bf16(v))));
                }
            }
        }
        free(gate);
        free(up);
        free(y);
    }
    if (status == OK)
        for (long tkn = 0; tkn < T; ++tkn) store_row(out, act, tkn * D, accum + tkn * D, D);
done:
    free(start);
    free(token);
    free(pick_w);
    free(xs);
    free(h);
    free(accum);
    free(fill);
    return status;
}
