/* Helpers shared by the mHC, norm/RoPE and decode-attention kernels (mhc_cpu.c, norm_rope_cpu.c,
   decode_attention_cpu.c): fp32 / bf16 rows, a sum of squares (dot.h's dot product), one row's RMSNorm + RoPE. */
#ifndef DSV4_ROWS_H
#define DSV4_ROWS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "dot.h"

/* Another library's thread pool (the gemv library's `pool_for`): run fn(job, c) for c in [0, n_chunks) on up
   to nthreads threads, the caller's included, returning when all have run. */
typedef void (*chunk_fn)(const void *job, long chunk);
typedef void (*pool_for_fn)(void *pool, long n_chunks, chunk_fn fn, const void *job, int nthreads);

/* Work on rows [r0, r1) of a call (`job`: its arguments); nonzero when a scratch could not be allocated. */
typedef int (*rows_fn)(const void *job, long r0, long r1);

/* Chunks of rows per thread: a few each, so that a thread that started late still takes its share. */
#define ROW_CHUNKS_PER_THREAD 2

/* A call's rows cut into chunks for the pool (`run_rows`). */
typedef struct {
    rows_fn fn;
    const void *job;
    long rows, per_chunk;
    int failed; /* written by whichever chunk fails; read once the pool has run every chunk */
} row_split;

static inline void row_split_chunk(const void *arg, long c) {
    row_split *split = (row_split *)arg;
    const long r0 = c * split->per_chunk, r1 = r0 + split->per_chunk < split->rows ? r0 + split->per_chunk : split->rows;
    if (split->fn(split->job, r0, r1)) __atomic_store_n(&split->failed, 1, __ATOMIC_RELAXED);
}

/* fn(job, r0, r1) over rows [0, rows) of independent work: in chunks on nthreads threads of `pool` by `run`, or
   on the caller's thread alone (no pool, one thread, one row). Returns nonzero when a chunk failed. */
static inline int run_rows(rows_fn fn, const void *job, long rows, void *pool, pool_for_fn run, int nthreads) {
    const long most = (long)nthreads * ROW_CHUNKS_PER_THREAD;
    const long chunks = run && nthreads > 1 ? (rows < most ? rows : most) : 1;
    if (chunks <= 1) return fn(job, 0, rows);
    row_split split = {fn, job, rows, (rows + chunks - 1) / chunks, 0};
    run(pool, (rows + split.per_chunk - 1) / split.per_chunk, row_split_chunk, &split, nthreads);
    return __atomic_load_n(&split.failed, __ATOMIC_RELAXED);
}

static float sum_squares(const float *restrict x, long n) { return dot(x, x, n); }

/* Stream tensors (streams, block input y, block output o, new streams) are fp32 or bf16 (`bf16` flag);
   the arithmetic is fp32 either way. bf16 rows are widened exactly into a per-token fp32 buffer and
   results rounded once on store, to nearest even as torch's `.to(torch.bfloat16)` does (NaN -> 0x7FC0),
   so a bf16 call is bit-identical to widening the tensors, running the fp32 kernel and rounding the
   results, without the three full-size fp32 copies that costs (bf16.h).

   Elements [offset, offset + n) of a stream tensor as fp32: in place for fp32, widened into buf for bf16. */
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

/* cos / sin of angle pos * inv_freq[i] for the rh rotary pairs (the sine negated when inverse). */
static void rope_angles(long pos, const float *inv_freq, long rh, int inverse, float *cs, float *sn) {
    for (long i = 0; i < rh; ++i) {
        const float a = (float)pos * inv_freq[i];
        cs[i] = cosf(a);
        sn[i] = inverse ? -sinf(a) : sinf(a);
    }
}

/* In place on one fp32 row v [hd]: RMSNorm (weighted when w is not NULL; eps < 0: none), then RoPE of the
   trailing 2 * rh channels in interleaved pairs by cs / sn (rope_angles). */
static void norm_rope_row(float *restrict v, long hd, float eps, const float *restrict w, const float *cs,
                          const float *sn, long rh) {
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
}

#endif
