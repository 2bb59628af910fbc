/* Few-row products with weights read straight from their resident layout, for CPU decode steps.
 *
 * A decode step of a few rows is bound by reading the weights once: these loops stream each weight
 * byte once per call, split the output features across the caller's threads, and decode quantized
 * weights in registers (no dequantized copy is ever written; with many x rows a quantized weight row is
 * decoded once per call into a panel of PANEL_NB rows that all x rows read). Python side: gemv_cpu.py.
 *
 *   dense_xw    y[R, N] = x[R, K] W^T, W resident input-major: storage [K, N] (row k contiguous), fp32 or bf16
 *   dense_xw_shared  y_i = x W_i^T for several such weights of one input in one call (dense_xw: one weight)
 *   quant_xw    y[R, N] = x[R, K] W^T, W [N, K] output-major: FP8 e4m3 with fp32 block scales [ceil(N/b0),
 *               ceil(K/b1)], or FP4 e2m1 (two codes a byte, low nibble = even input) with ue8m0 scales [N, K/g]
 *   moe_experts the routed-expert sum of one MoE layer, out[T, D] = sum_j w_tj E_{e_tj}(x_t), E_e(x) =
 *               W2_e (silu(min(W1_e x, L)) * clamp(W3_e x, -L, L)), for dense, FP8 or FP4 expert stacks
 *
 * Activations (x, y, out) are fp32 or bf16 (bf16: widened on load, rounded to nearest-even once on store);
 * all arithmetic is fp32.
 *
 * Threads: a caller-runs pool (pool_create). A call is cut into chunks of output features; the calling
 * thread takes chunks itself and the pool's workers take chunks when they get a core, so the caller only
 * ever waits for chunks a worker has already started, never for a worker to be scheduled. On a machine
 * whose other core is busy (a co-running process), a call therefore costs what one thread costs instead of
 * a scheduler time slice spent spinning at a barrier (which is what an OpenMP region pays there). Each
 * output element is computed by one thread in a fixed order: results do not depend on the thread count.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "bf16.h"
#include "dot.h"
#include "packed_call.h"

enum { ACT_F32 = 0, ACT_BF16 = 1 };
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_FP8 = 2, FMT_FP4 = 3 };
enum { OK = 0, ERR_ALLOC = 1, ERR_ARGS = 2 };

/* Columns of one dense pass over all K weight rows: the accumulator rows (R x TILE_N floats) stay in L2
   while the weight rows stream through. Long row pieces stream best: on the machine measured (one thread,
   16384x512 fp32 from cold copies) whole rows ran at 17 GB/s, 1024-column tiles at 16, 256-column ones at 12. */
#define TILE_N 16384
/* Weight rows folded per pass over the accumulators: 4 independent streams keep the prefetchers busy and
   cut the accumulator traffic to 1/4 of the weight traffic. */
#define K_UNROLL 4
/* Weight rows a dense pass prefetches ahead of the rows it reads: the hardware prefetchers stop at each 4 KiB
   page, and a pass crosses one every few rows, so without this each page starts with demand misses. */
#define DENSE_PREFETCH_ROWS 8
/* Floats of the accumulator scratch of a pass over several rows of a narrow dense chunk (dense_range): 64 KiB
   of stack, which holds 16 rows of 1024-column tiles. */
#define DENSE_SCRATCH_FLOATS 16384
/* Dense chunks are cut at multiples of this many columns (one cache line of fp32). */
#define SPLIT_ALIGN 16
/* A dense chunk streams at least this many columns of each weight row (shorter row pieces defeat the
   hardware prefetchers), a quantized chunk at least MIN_CHUNK_ROWS weight rows. */
#define MIN_CHUNK_COLS 256
#define MIN_CHUNK_ROWS 8
/* Chunks per thread: enough that a late thread's share is picked up by the others. */
#define CHUNKS_PER_THREAD 4
/* Below this many weight bytes a call runs in one chunk: waking a worker costs more than it saves. */
#define MIN_PARALLEL_BYTES (64 * 1024)
#define E8M0_BIAS 127

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

/* ue8m0 byte -> 2^(s - 127), built in the exponent field (a libm ldexpf call per group would dominate the
   FP4 loop). Byte 0 is the subnormal 2^-127; byte 255 (NaN in e8m0) becomes +inf: resident scales are
   validated finite. */
static inline float e8m0_to_f32(uint8_t s) { return s ? as_float((uint32_t)s << 23) : as_float(0x00400000u); }

/* Bytes a matrix of `elements` weights occupies in format fmt. */
static long matrix_bytes(int fmt, long elements) {
    return fmt == FMT_F32 ? 4 * elements : fmt == FMT_BF16 ? 2 * elements : fmt == FMT_FP8 ? elements : elements / 2;
}

/* Bytes of one cache line: the prefetch stride. */
#define CACHE_LINE 64

/* Asks for [p, p + bytes) to be brought into cache ahead of its use (a hint: never faults, past the end included). */
static inline __attribute__((always_inline)) void prefetch_bytes(const void *p, long bytes) {
    for (long b = 0; b < bytes; b += CACHE_LINE) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* Bytes of the pages the hardware prefetchers stay within. */
#define PAGE_BYTES 4096

/* Asks for the first line of [p, p + bytes) and one line a page after it: the hardware prefetchers, which stop at
   each page boundary, stream each page on from there. For the tile pass's row pieces this beat asking for every
   line (the instructions cost issue slots and miss-buffer entries the prefetchers would not have): measured with
   both builds paired in one process, 2 threads, cold fp32 weights, 1.3-1.4x faster at one row (the 16384 x 512 head
   595 -> 432 us), 1.13x at 4 rows, equal at 16. The register-blocked pass keeps prefetch_bytes: its next panel's
   rows are 1 KiB pieces a page or more apart, which page starts alone left 1.14x slower. */
static inline __attribute__((always_inline)) void prefetch_pages(const void *p, long bytes) {
    for (long b = 0; b < bytes; b += PAGE_BYTES) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* Chunk size that cuts n items into about `pieces` chunks: at least `least` items, a multiple of `align`. */
static long split_size(long n, long pieces, long least, long align) {
    long size = (n + pieces - 1) / pieces;
    size = (size + align - 1) / align * align;
    return size < least ? least : size;
}

/* Chunk size for n items: about CHUNKS_PER_THREAD chunks a thread; the whole range when the weights are too
   small to be worth a second thread. */
static long chunk_size(long n, int nthreads, long weight_bytes, long least, long align) {
    if (nthreads <= 1 || weight_bytes < MIN_PARALLEL_BYTES) return n;
    return split_size(n, (long)CHUNKS_PER_THREAD * nthreads, least, align);
}

/* ---------------------------------------------------------------------------------------------------- */
/* The caller-runs pool.                                                                                */
/* ---------------------------------------------------------------------------------------------------- */

#define MAX_WORKERS 63
/* After a job a worker keeps polling this long for the next one before it sleeps: the kernels of one
   decode step come microseconds apart, and a sleeping worker takes tens of microseconds to wake. */
#define WORKER_SPIN_NS 50000L
#define GEN_SHIFT 32
#define CHUNK_MASK 0xffffffffull

typedef void (*chunk_fn)(const void *job, long chunk);

typedef struct pool {
    pid_t owner; /* the process whose threads these are: a forked child runs every call on its own */
    int n_workers;
    pthread_t threads[MAX_WORKERS];
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_int sleepers;
    atomic_int stop;
    _Atomic uint64_t state; /* generation << 32 | next chunk of the current job */
    atomic_long done;       /* chunks of the current job finished */
    atomic_int helpers;     /* workers allowed to help the current job */
    /* the current job (read by workers after they observe its generation) */
    _Atomic(chunk_fn) fn;
    _Atomic(const void *) job;
    atomic_long n_chunks;
} pool;

typedef struct {
    pool *p;
    int index;
} worker_arg;

/* Take and run chunks of generation `gen` until none is left (or a newer job started).

   The job's fields are read only after a state of generation `gen` with a chunk index has been seen: the
   caller writes them while the state says "generation gen, nothing to take" (CHUNK_MASK) and publishes the
   index after them. Read before that, they could be the next job's while the state still held this one's, and
   a successful exchange would then run (and count as done) a chunk of a job not yet started: its caller could
   return before its last chunk had run. */
static void help(pool *p, uint32_t gen) {
    uint64_t s = atomic_load(&p->state);
    while ((uint32_t)(s >> GEN_SHIFT) == gen && (s & CHUNK_MASK) == CHUNK_MASK) {
        CPU_RELAX();
        s = atomic_load(&p->state);
    }
    if ((uint32_t)(s >> GEN_SHIFT) != gen) return;
    const chunk_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
    const void *job = atomic_load_explicit(&p->job, memory_order_relaxed);
    const long n = atomic_load_explicit(&p->n_chunks, memory_order_relaxed);
    for (;;) {
        if ((uint32_t)(s >> GEN_SHIFT) != gen || (long)(s & CHUNK_MASK) >= n) return;
        /* A successful exchange proves the job is still `gen` and unfinished, so fn/job/n were its own. */
        if (atomic_compare_exchange_weak(&p->state, &s, s + 1)) {
            fn(job, (long)(s & CHUNK_MASK));
            atomic_fetch_add(&p->done, 1);
            s = atomic_load(&p->state);
        }
    }
}

static long elapsed_ns(const struct timespec *since) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (t.tv_sec - since->tv_sec) * 1000000000L + (t.tv_nsec - since->tv_nsec);
}

static void *worker_main(void *arg) {
    worker_arg self = *(worker_arg *)arg;
    free(arg);
    pool *p = self.p;
    uint32_t seen = (uint32_t)(atomic_load(&p->state) >> GEN_SHIFT);
    for (;;) {
        struct timespec start;
        clock_gettime(CLOCK_MONOTONIC, &start);
        uint32_t gen = seen;
        for (long polls = 0; gen == seen && !atomic_load(&p->stop); ++polls) {
            CPU_RELAX();
            gen = (uint32_t)(atomic_load(&p->state) >> GEN_SHIFT);
            if (gen == seen && (polls & 63) == 63 && elapsed_ns(&start) > WORKER_SPIN_NS) {
                pthread_mutex_lock(&p->mu);
                atomic_fetch_add(&p->sleepers, 1);
                /* seq_cst: either the caller sees this sleeper and signals, or this load sees its job */
                gen = (uint32_t)(atomic_load(&p->state) >> GEN_SHIFT);
                if (gen == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->wake, &p->mu);
                atomic_fetch_sub(&p->sleepers, 1);
                pthread_mutex_unlock(&p->mu);
                gen = (uint32_t)(atomic_load(&p->state) >> GEN_SHIFT);
                clock_gettime(CLOCK_MONOTONIC, &start);
            }
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = gen;
        if (self.index < atomic_load(&p->helpers)) help(p, gen);
    }
}

/* A pool of n_workers threads (the caller is the extra one); NULL when threads cannot be made. */
pool *pool_create(int n_workers) {
    if (n_workers < 0) n_workers = 0;
    if (n_workers > MAX_WORKERS) n_workers = MAX_WORKERS;
    pool *p = calloc(1, sizeof(pool));
    if (!p) return NULL;
    p->owner = getpid();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    for (int i = 0; i < n_workers; ++i) {
        worker_arg *arg = malloc(sizeof(worker_arg));
        if (!arg) break;
        arg->p = p;
        arg->index = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, arg) != 0) {
            free(arg);
            break;
        }
        p->n_workers = i + 1;
    }
    return p;
}

void pool_destroy(pool *p) {
    if (!p) return;
    if (p->owner == getpid()) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->stop, 1);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < p->n_workers; ++i) pthread_join(p->threads[i], NULL);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    free(p);
}

int pool_workers(const pool *p) { return p ? p->n_workers : 0; }

/* Spin until *count reaches target: briefly on the CPU, then yielding it (the awaited work is running). */
static void wait_for_count(atomic_long *count, long target) {
    for (long polls = 0; atomic_load(count) < target; ++polls) {
        if (polls < 4096) CPU_RELAX();
        else sched_yield();
    }
}

/* Run fn(job, c) for c in [0, n_chunks), with up to nthreads threads (the caller and nthreads - 1 workers).
   Returns when every chunk has run. */
static void pool_run(pool *p, long n_chunks, chunk_fn fn, const void *job, int nthreads) {
    if (!p || p->owner != getpid() || p->n_workers == 0 || n_chunks <= 1 || nthreads <= 1) {
        for (long c = 0; c < n_chunks; ++c) fn(job, c);
        return;
    }
    const uint32_t gen = (uint32_t)(atomic_load(&p->state) >> GEN_SHIFT) + 1;
    /* The new generation with nothing to take, before its fields change: no helper of the previous job can
       take a chunk once they do, and helpers of this one wait for the index (`help`). */
    atomic_store(&p->state, ((uint64_t)gen << GEN_SHIFT) | CHUNK_MASK);
    atomic_store(&p->done, 0);
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->job, job, memory_order_relaxed);
    atomic_store_explicit(&p->n_chunks, n_chunks, memory_order_relaxed);
    atomic_store(&p->helpers, nthreads - 1);
    atomic_store(&p->state, (uint64_t)gen << GEN_SHIFT); /* publishes the job (seq_cst) */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mu);
    }
    help(p, gen);
    wait_for_count(&p->done, n_chunks); /* only chunks a running worker has taken remain */
}

/* pool_run for the other kernel libraries (decode attention spreads its rows over this pool rather than start
   threads of its own: one set of threads for every kernel, as torch runs one intra-op pool). */
void pool_for(pool *p, long n_chunks, chunk_fn fn, const void *job, int nthreads) {
    pool_run(p, n_chunks, fn, job, nthreads);
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

/* a * b + c with one rounding where the CPU has a fused multiply-add (the compiler vectorises fmaf then), else
   two: the dense passes spell their sums out with it, so that the tile and register-blocked passes round alike
   whatever the compiler would contract. */
#ifdef FP_FAST_FMAF
#define MUL_ADD(a, b, c) fmaf(a, b, c)
#else
#define MUL_ADD(a, b, c) ((a) * (b) + (c))
#endif

/* Weight i of a dense row (fp32 or bf16) as fp32; wfmt is a constant wherever this is inlined. */
static inline __attribute__((always_inline)) float dense_weight(const void *row, const int wfmt, long i) {
    return wfmt == FMT_F32 ? ((const float *)row)[i] : bf16_to_f32(((const uint16_t *)row)[i]);
}

/* Where row k of a dense W starts at column n0. */
static inline __attribute__((always_inline)) const void *dense_row(const void *w, const int wfmt, long k, long ldw,
                                                                   long n0) {
    if (wfmt == FMT_F32) return (const float *)w + k * ldw + n0;
    return (const uint16_t *)w + k * ldw + n0;
}

/* dense_tile for one weight format, `wfmt` constant after inlining: each instance's loops read one element
   type, which the compiler vectorises. */
static inline __attribute__((always_inline)) void dense_tile_of(const float *restrict x, long R, long K, long ldx,
                                                                const void *w, const int wfmt, long ldw, long n0,
                                                                long n1, float *restrict acc, long ldacc) {
    const long width = n1 - n0;
    for (long r = 0; r < R; ++r) memset(acc + r * ldacc, 0, sizeof(float) * (size_t)width);
    long k = 0;
    for (; k + K_UNROLL <= K; k += K_UNROLL) {
        const void *restrict w0 = dense_row(w, wfmt, k, ldw, n0), *restrict w1 = dense_row(w, wfmt, k + 1, ldw, n0),
                            *restrict w2 = dense_row(w, wfmt, k + 2, ldw, n0),
                            *restrict w3 = dense_row(w, wfmt, k + 3, ldw, n0);
        if (k + K_UNROLL + DENSE_PREFETCH_ROWS <= K)
            for (long q = 0; q < K_UNROLL; ++q)
                prefetch_pages(dense_row(w, wfmt, k + DENSE_PREFETCH_ROWS + q, ldw, n0),
                               width * (wfmt == FMT_F32 ? 4 : 2));
        for (long r = 0; r < R; ++r) {
            const float a0 = x[r * ldx + k], a1 = x[r * ldx + k + 1], a2 = x[r * ldx + k + 2], a3 = x[r * ldx + k + 3];
            float *restrict out = acc + r * ldacc;
            for (long n = 0; n < width; ++n)
                out[n] += MUL_ADD(a3, dense_weight(w3, wfmt, n),
                                  MUL_ADD(a2, dense_weight(w2, wfmt, n),
                                          MUL_ADD(a1, dense_weight(w1, wfmt, n), a0 * dense_weight(w0, wfmt, n))));
        }
    }
    for (; k < K; ++k) {
        const void *restrict w0 = dense_row(w, wfmt, k, ldw, n0);
        for (long r = 0; r < R; ++r) {
            const float a0 = x[r * ldx + k];
            float *restrict out = acc + r * ldacc;
            for (long n = 0; n < width; ++n) out[n] = MUL_ADD(a0, dense_weight(w0, wfmt, n), out[n]);
        }
    }
}

static void dense_tile(const float *x, long R, long K, long ldx, const void *w, int wfmt, long ldw, long n0, long n1,
                       float *acc, long ldacc) {
    if (wfmt == FMT_F32) dense_tile_of(x, R, K, ldx, w, FMT_F32, ldw, n0, n1, acc, ldacc);
    else dense_tile_of(x, R, K, ldx, w, FMT_BF16, ldw, n0, n1, acc, ldacc);
}

#if defined(__AVX512F__)
/* From this many x rows on, fp32 weights take the register-blocked pass (dense_blocked): the tile pass loads
   and stores its accumulator rows once per K_UNROLL inputs, which at many rows bounds it, where the blocked pass
   keeps the sums in registers. Measured (2 threads, cold weights, both ways paired in one process, the small
   config's shapes): 1.2-1.5x faster at 48-64 rows, even at 16-32 (within the pairs' noise), slower at 8
   (0.7-0.8x) and on the 16384 x 512 head at 16 (0.86x). */
#define BLOCKED_MIN_ROWS 48
/* x rows of one register-blocked pass: two accumulator vectors each, with the step's eight weight vectors
   and the temporaries, inside AVX-512's 32 registers. */
#define BLOCKED_RB 8
/* Output columns of one register-blocked pass: two vectors. */
#define BLOCKED_COLS 32
/* A weight panel of the register-blocked path: BLOCKED_PANEL_K rows (a multiple of K_UNROLL) of
   BLOCKED_PANEL_COLS columns, 64 KiB in fp32. */
#define BLOCKED_PANEL_K 64
#define BLOCKED_PANEL_COLS 256

/* `rb` x rows (constant after inlining) against BLOCKED_COLS columns of an fp32 input-major W, inputs [k0, k1)
   (k1 - k0 a multiple of K_UNROLL unless k1 = K), columns masked by ma / mb (the last block of a range may be
   narrower): the sums start from zero at k0 = 0, else from acc, and are stored back to acc. Each output is
   summed exactly as dense_tile_of sums it (per K_UNROLL inputs: the first's product, three fused multiply-adds,
   then one add into the sum; a remainder input one fused multiply-add), so a row's result depends neither on
   the pass nor on the other rows. */
static inline __attribute__((always_inline)) void blocked_pass(const float *restrict x, const int rb, long k0,
                                                               long k1, long ldx, const float *restrict w, long ldw,
                                                               __mmask16 ma, __mmask16 mb, float *restrict acc,
                                                               long ldacc) {
    __m512 sa[BLOCKED_RB], sb[BLOCKED_RB];
    for (int r = 0; r < rb; ++r) {
        sa[r] = k0 ? _mm512_maskz_loadu_ps(ma, acc + r * ldacc) : _mm512_setzero_ps();
        sb[r] = k0 ? _mm512_maskz_loadu_ps(mb, acc + r * ldacc + 16) : _mm512_setzero_ps();
    }
    long k = k0;
    for (; k + K_UNROLL <= k1; k += K_UNROLL) {
        __m512 wa[K_UNROLL], wb[K_UNROLL];
        for (int q = 0; q < K_UNROLL; ++q) {
            wa[q] = _mm512_maskz_loadu_ps(ma, w + (k + q) * ldw);
            wb[q] = _mm512_maskz_loadu_ps(mb, w + (k + q) * ldw + 16);
        }
        for (int r = 0; r < rb; ++r) {
            const float *xr = x + r * ldx + k;
            const __m512 a0 = _mm512_set1_ps(xr[0]), a1 = _mm512_set1_ps(xr[1]), a2 = _mm512_set1_ps(xr[2]),
                         a3 = _mm512_set1_ps(xr[3]);
            __m512 ta = _mm512_mul_ps(a0, wa[0]), tb = _mm512_mul_ps(a0, wb[0]);
            ta = _mm512_fmadd_ps(a1, wa[1], ta), tb = _mm512_fmadd_ps(a1, wb[1], tb);
            ta = _mm512_fmadd_ps(a2, wa[2], ta), tb = _mm512_fmadd_ps(a2, wb[2], tb);
            ta = _mm512_fmadd_ps(a3, wa[3], ta), tb = _mm512_fmadd_ps(a3, wb[3], tb);
            sa[r] = _mm512_add_ps(sa[r], ta), sb[r] = _mm512_add_ps(sb[r], tb);
        }
    }
    for (; k < k1; ++k) {
        const __m512 wa = _mm512_maskz_loadu_ps(ma, w + k * ldw), wb = _mm512_maskz_loadu_ps(mb, w + k * ldw + 16);
        for (int r = 0; r < rb; ++r) {
            const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
            sa[r] = _mm512_fmadd_ps(a, wa, sa[r]), sb[r] = _mm512_fmadd_ps(a, wb, sb[r]);
        }
    }
    for (int r = 0; r < rb; ++r) {
        _mm512_mask_storeu_ps(acc + r * ldacc, ma, sa[r]);
        _mm512_mask_storeu_ps(acc + r * ldacc + 16, mb, sb[r]);
    }
}

/* acc[R, n0:n1) for an fp32 input-major W with the sums in registers: BLOCKED_COLS columns by BLOCKED_RB x
   rows per pass, each weight vector loaded once per pass feeding every row of it. The weights go panel by
   panel (BLOCKED_PANEL_K rows of BLOCKED_PANEL_COLS columns: long row pieces, which the prefetchers stream,
   held in L2 while its passes read it); the next panel's rows are prefetched while one is worked on. */
static void dense_blocked(const float *x, long R, long K, long ldx, const float *w, long ldw, long n0, long n1,
                          float *acc, long ldacc) {
    for (long p0 = n0; p0 < n1; p0 += BLOCKED_PANEL_COLS) {
        const long p1 = p0 + BLOCKED_PANEL_COLS < n1 ? p0 + BLOCKED_PANEL_COLS : n1;
        for (long k0 = 0; k0 < K; k0 += BLOCKED_PANEL_K) {
            const long k1 = k0 + BLOCKED_PANEL_K < K ? k0 + BLOCKED_PANEL_K : K;
            for (long k = k1; k < k1 + BLOCKED_PANEL_K && k < K; ++k) prefetch_bytes(w + k * ldw + p0, (p1 - p0) * 4);
            for (long n = p0; n < p1; n += BLOCKED_COLS) {
                const long width = p1 - n < BLOCKED_COLS ? p1 - n : BLOCKED_COLS;
                const __mmask16 ma = width >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << width) - 1);
                const __mmask16 mb = width <= 16 ? 0
                                     : width >= 32 ? (__mmask16)0xffff
                                                   : (__mmask16)((1u << (width - 16)) - 1);
                for (long r0 = 0; r0 < R; r0 += BLOCKED_RB) {
                    const float *xr = x + r0 * ldx;
                    float *out = acc + r0 * ldacc + (n - n0);
                    switch (R - r0 < BLOCKED_RB ? R - r0 : BLOCKED_RB) {
#define BLOCKED_CASE(RB_)                                                                                        \
    case RB_: blocked_pass(xr, RB_, k0, k1, ldx, w + n, ldw, ma, mb, out, ldacc); break;
                        BLOCKED_CASE(1) BLOCKED_CASE(2) BLOCKED_CASE(3) BLOCKED_CASE(4) BLOCKED_CASE(5)
                        BLOCKED_CASE(6) BLOCKED_CASE(7)
                    default: blocked_pass(xr, BLOCKED_RB, k0, k1, ldx, w + n, ldw, ma, mb, out, ldacc); break;
#undef BLOCKED_CASE
                    }
                }
            }
        }
    }
}
#endif

/* acc[R, n0:n1) for a dense input-major W, a TILE_N-column tile at a time (acc rows of ldacc floats). */
static void dense_range(const float *x, long R, long K, long ldx, const void *w, int wfmt, long ldw, long n0, long n1,
                        float *acc, long ldacc) {
#if defined(__AVX512F__)
    if (wfmt == FMT_F32 && R >= BLOCKED_MIN_ROWS) {
        dense_blocked(x, R, K, ldx, (const float *)w, ldw, n0, n1, acc, ldacc);
        return;
    }
#endif
    if (R == 1 || ldacc == n1 - n0 || R > DENSE_SCRATCH_FLOATS / SPLIT_ALIGN) {
        for (long t0 = n0; t0 < n1; t0 += TILE_N) {
            long t1 = t0 + TILE_N < n1 ? t0 + TILE_N : n1;
            dense_tile(x, R, K, ldx, w, wfmt, ldw, t0, t1, acc + (t0 - n0), ldacc);
        }
        return;
    }
    /* Several rows of a chunk narrower than acc's rows: the passes accumulate into a contiguous scratch, copied
       out once per tile. Left in acc, the chunk's pieces of rows a power-of-two stride apart (a 256-column chunk
       of 512-column rows) crowd into a few L1 sets, which the weight rows streaming through keep evicting:
       measured (2 threads, cold fp32 weights, both ways paired in one process) 4.3x slower at 16 rows of a
       512 x 512 weight, 1.7x at 4 rows, and the 16384 x 512 head 1.3-1.4x slower at 4-16 rows. */
    float scratch[DENSE_SCRATCH_FLOATS];
    long tile = DENSE_SCRATCH_FLOATS / R;
    tile = tile < TILE_N ? tile - tile % SPLIT_ALIGN : TILE_N;
    for (long t0 = n0; t0 < n1; t0 += tile) {
        const long t1 = t0 + tile < n1 ? t0 + tile : n1, width = t1 - t0;
        dense_tile(x, R, K, ldx, w, wfmt, ldw, t0, t1, scratch, width);
        for (long r = 0; r < R; ++r)
            memcpy(acc + r * ldacc + (t0 - n0), scratch + r * width, sizeof(float) * (size_t)width);
    }
}

/* ---------------------------------------------------------------------------------------------------- */
/* Quantized, output-major: acc[r, n] for n in [n0, n1), weight row n decoded in registers.             */
/* ---------------------------------------------------------------------------------------------------- */

/* Largest K the per-row decode buffer holds (the stack array below); larger inputs are an argument error. */
#define MAX_QUANT_K 16384
/* Rows of x one decoded weight row is reused for before the next chunk of rows. */
#define ROW_CHUNK 16
/* x bytes one call of the panel path (quant_rows_panel) takes at a time: well inside L2. */
#define PANEL_X_BYTES (128 * 1024)

/* Inputs of one FP4 decode step: 16 bytes = 32 codes. FP4 groups must be a multiple of this. */
#define FP4_STEP 32
/* Inputs of one FP8 decode step. */
#define FP8_STEP 16

/* Rows of x one pass over a weight row serves: 2 accumulators per row stay in registers (an accumulator
   array indexed at run time would live in memory, and each FMA would wait on a store-to-load round trip). */
#define ROW_BLOCK 4
/* From PANEL_MIN_ROWS x rows on, a call decodes each weight row once into a small panel and runs every row
   against it (quant_rows_panel) instead of decoding it again per ROW_BLOCK rows; blocks of PANEL_RB x rows by
   PANEL_NB weight rows keep 2 * PANEL_RB * PANEL_NB accumulators in registers (12 of AVX2's 16) and load
   PANEL_RB + PANEL_NB vectors per PANEL_RB * PANEL_NB FMAs. */
#define PANEL_RB 2
#define PANEL_NB 3
#define PANEL_MIN_ROWS 8

/* The vector paths below are written once over a few per-ISA primitives: `vec` (fp32 lanes), vec_zero,
   vec_set1, vec_load / vec_store / vec_fma (a * b + c, one rounding), vec_total (the lanes of two vectors
   summed) and vec_total_pair (two of them), fma_step32 (one x row's 32 inputs of a step times
   the step's decoded weights) and the decoders fp4_decode32 / fp8_decode32 (the 32 weights of a step
   times their scale). */
#if defined(__AVX512F__)
typedef __m512 vec; /* 16 lanes: a 32-input step is 2 vectors */
#define VEC_LANES 16

static inline vec vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm512_set1_ps(v); }
static inline vec vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vec_total(vec a, vec b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
/* vec_total(a0, b0) and vec_total(a1, b1). */
static inline void vec_total_pair(vec a0, vec b0, vec a1, vec b1, float *t0, float *t1) {
    *t0 = vec_total(a0, b0);
    *t1 = vec_total(a1, b1);
}

/* 32 inputs of one x row (xr) times a step's decoded weights v[0..1]: the first 16 into *first, the last 16
   into *second. Inlined, the accumulators stay in registers. */
static inline __attribute__((always_inline)) void fma_step32(const float *xr, const vec *v, vec *first,
                                                             vec *second) {
    *first = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(xr), *first);
    *second = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(xr + 16), *second);
}

/* e2m1 magnitudes and signs: the 16 code values as one vector (permutexvar indexes it by code). */
static inline __m512 e2m1_table(void) {
    return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                          -4.0f, -6.0f);
}

/* 16 bytes = 32 FP4 codes -> v[0] (low nibbles), v[1] (high nibbles), times s. */
static inline __attribute__((always_inline)) void fp4_decode32(const uint8_t *bytes, vec s, vec *v) {
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    v[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(codes, _mm512_set1_epi32(0xf)), e2m1_table()), s);
    v[1] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), e2m1_table()), s);
}

/* 16 e4m3 bytes -> 16 floats, as the AVX2 path decodes them: each byte's 7 exponent+mantissa bits moved under a
   half float's 5-bit exponent give that value times 2^-8, subnormals included, one conversion widens the 16 halves
   and 2^8 restores the value exactly. 7 instructions where decoding under the fp32 exponent (normals and
   subnormals apart, then blended) took 11, most on the two 512-bit ports that the products also need. */
static inline __m512 e4m3x16(const uint8_t *b) {
    const __m256i words = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b)), 8);
    /* an arithmetic shift by one: sign at bit 15 (a copy at bit 14, cleared), exponent+mantissa at bits 13-7 */
    const __m256i halves = _mm256_and_si256(_mm256_srai_epi16(words, 1), _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(halves), _mm512_set1_ps(0x1p8f));
}

/* 32 e4m3 bytes -> v[0..1] times s. */
static inline __attribute__((always_inline)) void fp8_decode32(const uint8_t *bytes, vec s, vec *v) {
    v[0] = _mm512_mul_ps(e4m3x16(bytes), s);
    v[1] = _mm512_mul_ps(e4m3x16(bytes + 16), s);
}

#define VECTOR_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef __m256 vec; /* 8 lanes: a 32-input step is 4 vectors */
#define VEC_LANES 8

static inline vec vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec vec_set1(float v) { return _mm256_set1_ps(v); }
static inline vec vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vec_store(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vec_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }

/* Sum of the lanes of a + b (a fixed order: results do not depend on the thread count or batch). */
static inline float vec_total(vec a, vec b) {
    const __m256 v = _mm256_add_ps(a, b);
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

/* vec_total(a0, b0) and vec_total(a1, b1), bit for bit (the same adds of the same lanes), the two sums side by
   side in the 128-bit halves: half the instructions of two vec_totals. */
static inline void vec_total_pair(vec a0, vec b0, vec a1, vec b1, float *t0, float *t1) {
    const __m256 v0 = _mm256_add_ps(a0, b0), v1 = _mm256_add_ps(a1, b1);
    const __m256 four = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
    const __m256 two = _mm256_add_ps(four, _mm256_permute_ps(four, 0xee)); /* lanes 0 + 2, 1 + 3 */
    const __m256 one = _mm256_add_ps(two, _mm256_permute_ps(two, 0x55));   /* lane 0 + lane 1 */
    *t0 = _mm256_cvtss_f32(one);
    *t1 = _mm_cvtss_f32(_mm256_extractf128_ps(one, 1));
}

/* 32 inputs of one x row (xr) times a step's decoded weights v[0..3] (8 each): the first 16 into *first,
   the last 16 into *second. Inlined, the accumulators stay in registers. */
static inline __attribute__((always_inline)) void fma_step32(const float *xr, const vec *v, vec *first,
                                                             vec *second) {
    *first = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xr + 8), _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xr), *first));
    *second =
        _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xr + 24), _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xr + 16), *second));
}

/* e2m1 code c (bit 3 = sign) as a bf16, split in bytes for byte shuffles: every e2m1 value is a bf16 (one
   mantissa bit), so its fp32 is that bf16 shifted up 16 bits. Two 16-entry tables, repeated in both lanes. */
static inline __m256i e2m1_bf16_high_bytes(void) {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, (char)0x80,
                                                     (char)0xbf, (char)0xbf, (char)0xbf, (char)0xc0, (char)0xc0,
                                                     (char)0xc0, (char)0xc0));
}

static inline __m256i e2m1_bf16_low_bytes(void) {
    return _mm256_broadcastsi128_si256(_mm_setr_epi8(0x00, 0x00, (char)0x80, (char)0xc0, 0x00, 0x40, (char)0x80,
                                                     (char)0xc0, 0x00, 0x00, (char)0x80, (char)0xc0, 0x00, 0x40,
                                                     (char)0x80, (char)0xc0));
}

/* 16 bytes = 32 FP4 codes -> v[0..3] times s, in the AVX2 FP4 order (fp4_position): the bytes go to both
   lanes, lane 0 keeps their low nibbles (even inputs), lane 1 their high nibbles (odd inputs); two byte
   shuffles look up each code's bf16 bytes, and interleaving them under zero words gives the fp32 values,
   each 8-input block as [0, 2, 4, 6, 1, 3, 5, 7]. ~half the instructions of a per-value table permute. */
static inline __attribute__((always_inline)) void fp4_decode32(const uint8_t *bytes, vec s, vec *v) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes));
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                           _mm256_set1_epi8(0x0f));
    const __m256i high = _mm256_shuffle_epi8(e2m1_bf16_high_bytes(), codes);
    const __m256i low = _mm256_shuffle_epi8(e2m1_bf16_low_bytes(), codes);
    const __m256i first = _mm256_unpacklo_epi8(low, high), last = _mm256_unpackhi_epi8(low, high); /* bf16 words */
    const __m256i zero = _mm256_setzero_si256();
    v[0] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, first)), s);
    v[1] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, first)), s);
    v[2] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, last)), s);
    v[3] = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, last)), s);
}

/* 16 e4m3 bytes -> two vectors of 8 floats (inputs 0-7, 8-15). Each byte's 7 exponent+mantissa bits moved
   under a half float's 5-bit exponent give that value times 2^-8, subnormals included (both formats'
   subnormals scale the same way); F16C widens 8 halves at once, and 2^8 restores the value exactly (0x7f /
   0xff, NaN in e4m3fn, decode to 480 like the AVX-512 path: resident weights are validated finite). */
static inline __attribute__((always_inline)) void e4m3x16(const uint8_t *b, __m256 *first, __m256 *second) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)b), zero = _mm_setzero_si128();
    /* byte << 8 per 16-bit word, then an arithmetic shift by one: sign at bit 15 (and a copy at bit 14,
       cleared), exponent+mantissa at bits 13-7 */
    const __m128i keep = _mm_set1_epi16((short)0xbf80);
    const __m128i lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, bytes), 1), keep);
    const __m128i hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, bytes), 1), keep);
    const __m256 unscale = _mm256_set1_ps(0x1p8f);
    *first = _mm256_mul_ps(_mm256_cvtph_ps(lo), unscale);
    *second = _mm256_mul_ps(_mm256_cvtph_ps(hi), unscale);
}

/* 32 e4m3 bytes -> v[0..3] times s. */
static inline __attribute__((always_inline)) void fp8_decode32(const uint8_t *bytes, vec s, vec *v) {
    e4m3x16(bytes, &v[0], &v[1]);
    e4m3x16(bytes + 16, &v[2], &v[3]);
    for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(v[i], s);
}

#define VECTOR_ISA 256
#else
#define VECTOR_ISA 0
#endif

#if VECTOR_ISA
/* Inputs of one vector step (fma_step32, fp4_decode32, fp8_decode32). */
#define VEC_STEP 32

/* A weight row's scale of block b (FP4: its ue8m0 byte; FP8: its fp32 block scale), broadcast. */
static inline __attribute__((always_inline)) vec quant_scale(const int wfmt, const void *srow, long b) {
    return vec_set1(wfmt == FMT_FP4 ? e8m0_to_f32(((const uint8_t *)srow)[b]) : ((const float *)srow)[b]);
}

/* Weight row n of a quantized [N, K] weight: its codes (FP4: two a byte) and its block scales (FP4: ue8m0 [N,
   K / b1]; FP8: fp32 [ceil(N / b0), kb_count], shared by b0 rows). */
static inline const uint8_t *quant_row(const int wfmt, const uint8_t *w, long K, long n) {
    return w + (wfmt == FMT_FP4 ? n * (K / 2) : n * K);
}

static inline const void *quant_scales(const int wfmt, const void *scale, long kb_count, long b0, long n) {
    return wfmt == FMT_FP4 ? (const void *)((const uint8_t *)scale + n * kb_count)
                           : (const void *)((const float *)scale + (n / b0) * kb_count);
}

/* One quantized weight row (wfmt FMT_FP4 or FMT_FP8) against `rb` x rows, wfmt and rb constant after
   inlining: per 32-input step the weights decoded in registers and multiplied by their block's scale
   (FP4: a power of two, exact; FP8: the reference's dequantised value, rounded the same way), then one FMA
   per vector and x row, the step's first and last 16 inputs in separate accumulators. FP4: scales `srow`
   are ue8m0 bytes, one per `block` inputs (a multiple of the step dividing K), x rows FP4-ordered. FP8: fp32
   scales, one per `block` inputs (the last block may be shorter); K and block are multiples of the step. */
static inline __attribute__((always_inline)) void quant_row_block(const int wfmt, const float *x, const int rb,
                                                                  long K, const uint8_t *wr, const void *srow,
                                                                  long block, float *out, long ldout) {
    vec first[ROW_BLOCK], second[ROW_BLOCK];
    for (int r = 0; r < rb; ++r) first[r] = second[r] = vec_zero();
    for (long b = 0, k0 = 0; k0 < K; ++b) {
        const vec s = quant_scale(wfmt, srow, b);
        for (const long end = k0 + block < K ? k0 + block : K; k0 < end; k0 += VEC_STEP) {
            vec v[VEC_STEP / VEC_LANES];
            if (wfmt == FMT_FP4) fp4_decode32(wr + k0 / 2, s, v);
            else fp8_decode32(wr + k0, s, v);
            for (int r = 0; r < rb; ++r) fma_step32(x + r * K + k0, v, &first[r], &second[r]);
        }
    }
    for (int r = 0; r < rb; ++r) out[r * ldout] = vec_total(first[r], second[r]);
}

/* Vectors of one 32-input step, and how fma_step32 splits them: the first half into `first`, the rest into
   `second`. */
#define STEP_VECS (VEC_STEP / VEC_LANES)

/* One x row against two weight rows (wr0 / srow0 -> *out0, wr1 / srow1 -> *out1), each summed exactly as
   quant_row_block sums it with rb = 1 (the same FMAs into the same two accumulators in the same order). One weight
   row gives the core two chains of dependent FMAs, one FMA each per step, so a one-row pass waits on their latency
   (warm, an FP4 MoE layer's routed products ran slower than its 4x larger dense shared expert); two rows give it four. */
static inline __attribute__((always_inline)) void quant_row_pair(const int wfmt, const float *x, long K,
                                                                 const uint8_t *wr0, const void *srow0,
                                                                 const uint8_t *wr1, const void *srow1, long block,
                                                                 float *out0, float *out1) {
    vec first0 = vec_zero(), second0 = vec_zero(), first1 = vec_zero(), second1 = vec_zero();
    for (long b = 0, k0 = 0; k0 < K; ++b) {
        const vec s0 = quant_scale(wfmt, srow0, b), s1 = quant_scale(wfmt, srow1, b);
        for (const long end = k0 + block < K ? k0 + block : K; k0 < end; k0 += VEC_STEP) {
            vec v0[STEP_VECS], v1[STEP_VECS];
            if (wfmt == FMT_FP4) fp4_decode32(wr0 + k0 / 2, s0, v0), fp4_decode32(wr1 + k0 / 2, s1, v1);
            else fp8_decode32(wr0 + k0, s0, v0), fp8_decode32(wr1 + k0, s1, v1);
            fma_step32(x + k0, v0, &first0, &second0);
            fma_step32(x + k0, v1, &first1, &second1);
        }
    }
    vec_total_pair(first0, second0, first1, second1, out0, out1);
}

/* Weight row wr (wfmt constant after inlining) decoded and scaled into dst[K], each step's vectors stored in
   the order quant_row_block multiplies them: the values quant_row_block computes in registers. */
static inline __attribute__((always_inline)) void quant_decode_row(const int wfmt, long K, const uint8_t *wr,
                                                                   const void *srow, long block, float *dst) {
    for (long b = 0, k0 = 0; k0 < K; ++b) {
        const vec s = quant_scale(wfmt, srow, b);
        for (const long end = k0 + block < K ? k0 + block : K; k0 < end; k0 += VEC_STEP) {
            vec v[STEP_VECS];
            if (wfmt == FMT_FP4) fp4_decode32(wr + k0 / 2, s, v);
            else fp8_decode32(wr + k0, s, v);
            for (int i = 0; i < STEP_VECS; ++i) vec_store(dst + k0 + i * VEC_LANES, v[i]);
        }
    }
}

/* `rb` x rows against `nb` decoded weight rows of a panel (rows of K floats), rb and nb constant after
   inlining: out[r * ldout + j] = row r . panel row j. Each output is summed exactly as quant_row_block sums
   it (the same FMAs into the same two accumulators in the same order, then vec_total), so a row's result
   does not depend on which path ran it; the rb * nb outputs share each loaded vector, which a one-weight-row
   pass cannot (it reloads every x vector per weight row). */
static inline __attribute__((always_inline)) void panel_block(const float *x, const int rb, const float *panel,
                                                              const int nb, long K, float *out, long ldout) {
    vec first[PANEL_RB][PANEL_NB], second[PANEL_RB][PANEL_NB];
    for (int r = 0; r < rb; ++r)
        for (int j = 0; j < nb; ++j) first[r][j] = second[r][j] = vec_zero();
    for (long k0 = 0; k0 < K; k0 += VEC_STEP) {
        for (int q = 0; q < STEP_VECS; ++q) {
            const long k = k0 + q * VEC_LANES;
            vec xv[PANEL_RB];
            /* Each loaded vector is pinned to a register (the empty asm): folded into every FMA that uses it as
               a memory operand, as the compiler otherwise does, it would be loaded once per FMA. */
            for (int r = 0; r < rb; ++r) {
                xv[r] = vec_load(x + r * K + k);
                __asm__("" : "+x"(xv[r]));
            }
            for (int j = 0; j < nb; ++j) {
                vec wv = vec_load(panel + j * K + k);
                __asm__("" : "+x"(wv));
                for (int r = 0; r < rb; ++r) {
                    if (q < STEP_VECS / 2) first[r][j] = vec_fma(wv, xv[r], first[r][j]);
                    else second[r][j] = vec_fma(wv, xv[r], second[r][j]);
                }
            }
        }
    }
    int o = 0; /* outputs in pairs (vec_total_pair), the last alone when rb * nb is odd */
    for (; o + 1 < rb * nb; o += 2) {
        const int r0 = o / nb, j0 = o % nb, r1 = (o + 1) / nb, j1 = (o + 1) % nb;
        vec_total_pair(first[r0][j0], second[r0][j0], first[r1][j1], second[r1][j1], &out[r0 * ldout + j0],
                       &out[r1 * ldout + j1]);
    }
    if (o < rb * nb) out[(o / nb) * ldout + o % nb] = vec_total(first[o / nb][o % nb], second[o / nb][o % nb]);
}

/* panel_block for the block shapes a tile's edges leave (rb <= PANEL_RB, nb <= PANEL_NB). */
static void panel_tile(const float *x, int rb, const float *panel, int nb, long K, float *out, long ldout) {
#define PANEL_CASE(R_, N_)                                                                                        \
    if (rb == R_ && nb == N_) {                                                                                 \
        panel_block(x, R_, panel, N_, K, out, ldout);                                                           \
        return;                                                                                                 \
    }
    PANEL_CASE(2, 3) PANEL_CASE(1, 3) PANEL_CASE(2, 2) PANEL_CASE(1, 2) PANEL_CASE(2, 1) PANEL_CASE(1, 1)
#undef PANEL_CASE
}

/* quant_rows_vec for many x rows: PANEL_NB weight rows at a time decoded once into a panel (L1-sized for the
   experts' K), then every x row against it, PANEL_RB rows per pass. Same results as the one-weight-row pass. */
static inline __attribute__((always_inline)) void quant_rows_panel(const int wfmt, const float *x, long R, long K,
                                                                   const uint8_t *w, const void *scale, long b0,
                                                                   long b1, long n0, long n1, float *acc,
                                                                   long ldacc) {
    float panel[PANEL_NB * MAX_QUANT_K];
    const long kb_count = (K + b1 - 1) / b1;
    for (long t0 = n0; t0 < n1; t0 += PANEL_NB) {
        const int nb = n1 - t0 < PANEL_NB ? (int)(n1 - t0) : PANEL_NB;
        for (int j = 0; j < nb; ++j) {
            const long n = t0 + j;
            quant_decode_row(wfmt, K, quant_row(wfmt, w, K, n), quant_scales(wfmt, scale, kb_count, b0, n), b1,
                             panel + j * K);
        }
        for (long r0 = 0; r0 < R; r0 += PANEL_RB) {
            const int rb = R - r0 < PANEL_RB ? (int)(R - r0) : PANEL_RB;
            panel_tile(x + r0 * K, rb, panel, nb, K, acc + r0 * ldacc + (t0 - n0), ldacc);
        }
    }
}

/* Quantized rows [n0, n1) (wfmt constant after inlining) against R x rows, ROW_BLOCK x rows per pass.
   FP4: ue8m0 scales [N, K / b1]; FP8: fp32 scales [ceil(N / b0), ceil(K / b1)]. */
static inline __attribute__((always_inline)) void quant_rows_vec(const int wfmt, const float *x, long R, long K,
                                                                 const uint8_t *w, const void *scale, long b0,
                                                                 long b1, long n0, long n1, float *acc, long ldacc) {
    if (R >= PANEL_MIN_ROWS) {
        quant_rows_panel(wfmt, x, R, K, w, scale, b0, b1, n0, n1, acc, ldacc);
        return;
    }
    const long kb_count = (K + b1 - 1) / b1;
    long n = n0;
    if (R == 1) /* weight rows two at a time (quant_row_pair); an odd last one below */
        for (; n + 1 < n1; n += 2)
            quant_row_pair(wfmt, x, K, quant_row(wfmt, w, K, n), quant_scales(wfmt, scale, kb_count, b0, n),
                           quant_row(wfmt, w, K, n + 1), quant_scales(wfmt, scale, kb_count, b0, n + 1), b1,
                           acc + (n - n0), acc + (n + 1 - n0));
    for (; n < n1; ++n) {
        const uint8_t *wr = quant_row(wfmt, w, K, n);
        const void *srow = quant_scales(wfmt, scale, kb_count, b0, n);
        for (long r0 = 0; r0 < R; r0 += ROW_BLOCK) {
            const float *xr = x + r0 * K;
            float *out = acc + r0 * ldacc + (n - n0);
            switch (R - r0 < ROW_BLOCK ? R - r0 : ROW_BLOCK) {
            case 1: quant_row_block(wfmt, xr, 1, K, wr, srow, b1, out, ldacc); break;
            case 2: quant_row_block(wfmt, xr, 2, K, wr, srow, b1, out, ldacc); break;
            case 3: quant_row_block(wfmt, xr, 3, K, wr, srow, b1, out, ldacc); break;
            default: quant_row_block(wfmt, xr, ROW_BLOCK, K, wr, srow, b1, out, ldacc); break;
            }
        }
    }
}

/* FP4 rows [n0, n1) against R FP4-ordered x rows (xp). */
static void fp4_rows(const float *xp, long R, long K, const uint8_t *w, const uint8_t *scale, long group, long n0,
                     long n1, float *acc, long ldacc) {
    quant_rows_vec(FMT_FP4, xp, R, K, w, scale, 1, group, n0, n1, acc, ldacc);
}

static void fp8_rows_vec(const float *x, long R, long K, const uint8_t *w, const float *scale, long b0, long b1,
                         long n0, long n1, float *acc, long ldacc) {
    quant_rows_vec(FMT_FP8, x, R, K, w, scale, b0, b1, n0, n1, acc, ldacc);
}
#define HAVE_FP8_VEC 1
#else
/* Portable paths: a table per byte (branch-free; the compiler vectorises the products). */

static void fp4_rows(const float *xp, long R, long K, const uint8_t *w, const uint8_t *scale, long group, long n0,
                     long n1, float *acc, long ldacc) {
    float table[16], dec[MAX_QUANT_K];
    for (uint32_t c = 0; c < 16; ++c) table[c] = e2m1_to_f32(c);
    const long half = K / 2, groups = K / group;
    for (long n = n0; n < n1; ++n) {
        const uint8_t *wr = w + n * half, *srow = scale + n * groups;
        for (long g = 0; g < groups; ++g) {
            const float s = e8m0_to_f32(srow[g]);
            for (long k0 = g * group; k0 < (g + 1) * group; k0 += FP4_STEP)
                for (long i = 0; i < FP4_STEP / 2; ++i) {
                    dec[k0 + i] = table[wr[k0 / 2 + i] & 0xf] * s;
                    dec[k0 + FP4_STEP / 2 + i] = table[wr[k0 / 2 + i] >> 4] * s;
                }
        }
        for (long r = 0; r < R; ++r) acc[r * ldacc + (n - n0)] = dot(xp + r * K, dec, K);
    }
}
#define HAVE_FP8_VEC 0
#endif

/* The decode paths this build has: 512 = AVX-512 permutes (FP4) and half floats (FP8), 256 = AVX2 byte shuffles /
   F16C, 0 = per-byte tables. */
int vector_isa(void) { return VECTOR_ISA; }

/* FP8 rows [n0, n1), any K: each row decoded once through a 256-entry table and scaled per block. */
static void fp8_rows_table(const float *x, long R, long K, const uint8_t *w, const float *scale, long b0, long b1,
                           long n0, long n1, float *acc, long ldacc) {
    float table[256], dec[MAX_QUANT_K];
    for (uint32_t b = 0; b < 256; ++b) table[b] = e4m3_to_f32((uint8_t)b);
    const long kb_count = (K + b1 - 1) / b1;
    for (long n = n0; n < n1; ++n) {
        const uint8_t *wr = w + n * K;
        const float *srow = scale + (n / b0) * kb_count;
        for (long kb = 0; kb < kb_count; ++kb)
            for (long k = kb * b1; k < K && k < (kb + 1) * b1; ++k) dec[k] = table[wr[k]] * srow[kb];
        for (long r = 0; r < R; ++r) {
            float total = 0.0f;
            for (long k = 0; k < K; ++k) total += x[r * K + k] * dec[k];
            acc[r * ldacc + (n - n0)] = total;
        }
    }
}

static void fp8_rows(const float *x, long R, long K, const uint8_t *w, const float *scale, long b0, long b1,
                     long n0, long n1, float *acc, long ldacc) {
#if HAVE_FP8_VEC
    if (K % (2 * FP8_STEP) == 0 && b1 % (2 * FP8_STEP) == 0) {
        fp8_rows_vec(x, R, K, w, scale, b0, b1, n0, n1, acc, ldacc);
        return;
    }
#endif
    fp8_rows_table(x, R, K, w, scale, b0, b1, n0, n1, acc, ldacc);
}

/* x: [R, K] rows, FP4-ordered (fp4_order_rows) when wfmt is FMT_FP4. */
static void quant_range(const float *x, long R, long K, int wfmt, const void *w, const void *scale, long b0, long b1,
                        long n0, long n1, float *acc, long ldacc) {
    /* The panel path reads its x rows once per weight-row tile: as many as stay in L2 (PANEL_X_BYTES). */
    const long panel_rows = PANEL_X_BYTES / ((long)sizeof(float) * K);
    const long chunk = VECTOR_ISA && R >= PANEL_MIN_ROWS && panel_rows > ROW_CHUNK ? panel_rows : ROW_CHUNK;
    for (long r0 = 0; r0 < R; r0 += chunk) {
        long rows = R - r0 < chunk ? R - r0 : chunk;
        if (wfmt == FMT_FP8)
            fp8_rows(x + r0 * K, rows, K, (const uint8_t *)w, (const float *)scale, b0, b1, n0, n1,
                     acc + r0 * ldacc, ldacc);
        else
            fp4_rows(x + r0 * K, rows, K, (const uint8_t *)w, (const uint8_t *)scale, b1, n0, n1, acc + r0 * ldacc,
                     ldacc);
    }
}

/* Position of input k in an FP4-ordered row: the order in which this build's FP4 decode (fp4_decode32, or
   the portable table path) produces a 32-input step's values, so that x (and the experts' hidden rows, w2's
   inputs) are laid out to match once per call instead of the decoded weights being shuffled per step.
   AVX2: each 8-input block [0, 2, 4, 6, 1, 3, 5, 7]; otherwise the step's even inputs, then its odd ones
   (low nibbles, then high nibbles). */
static inline long fp4_position(long k) {
    const long step = k - k % FP4_STEP, i = k % FP4_STEP;
#if VECTOR_ISA == 256
    return step + (i - i % 8) + (i % 2) * 4 + (i % 8) / 2;
#else
    return step + (i % 2) * (FP4_STEP / 2) + i / 2;
#endif
}

/* x rows [R, K] -> xp, each row FP4-ordered (fp4_position). */
static void fp4_order_rows(const float *x, long R, long K, float *xp) {
    for (long r = 0; r < R; ++r)
        for (long k = 0; k < K; ++k) xp[r * K + fp4_position(k)] = x[r * K + k];
}

static int quant_args_ok(int wfmt, long K, long b0, long b1) {
    if (K <= 0 || K > MAX_QUANT_K) return 0;
    if (wfmt == FMT_FP8) return b0 > 0 && b1 > 0;
    if (wfmt == FMT_FP4) return b1 > 0 && b1 % FP4_STEP == 0 && K % b1 == 0;
    return 0;
}

/* One quant_xw call, cut into chunks of `chunk` output columns. */
typedef struct {
    const float *x; /* [R, K] fp32 (FP4-ordered for FP4 weights) */
    long R, K, N, b0, b1, chunk;
    int wfmt, act;
    const void *w, *scale;
    float *acc; /* [R, N]: y itself for fp32 outputs, else scratch rounded into y per chunk */
    void *y;
} product_job;

static void product_chunk(const void *arg, long c) {
    const product_job *j = arg;
    const long n0 = c * j->chunk, n1 = n0 + j->chunk < j->N ? n0 + j->chunk : j->N;
    quant_range(j->x, j->R, j->K, j->wfmt, j->w, j->scale, j->b0, j->b1, n0, n1, j->acc + n0, j->N);
    if (j->act != ACT_F32)
        for (long r = 0; r < j->R; ++r) store_row(j->y, j->act, r * j->N + n0, j->acc + r * j->N + n0, n1 - n0);
}

/* Most weights one dense_xw_shared call takes (a layer's projections of one input number at most 7). */
#define MAX_SHARED 16

/* dense_xw over several weights, chunk c of all their chunks (weight i's run from first[i]). Weight i multiplies
   the K columns of x from x_step * i (rows ldx apart; one shared x: x_step 0, ldx K), its rows are ldw[i] apart,
   and its sums go to acc[i], rows ldacc[i] apart. */
typedef struct {
    const float *x;
    long R, K, count, ldx, x_step;
    int act;
    const void *const *w;
    const int *wfmt;
    const long *N;
    void *const *y;
    float *acc[MAX_SHARED];
    long chunk[MAX_SHARED], first[MAX_SHARED + 1], ldw[MAX_SHARED], ldacc[MAX_SHARED];
} shared_job;

static void shared_chunk(const void *arg, long c) {
    const shared_job *j = arg;
    long i = 0;
    while (c >= j->first[i + 1]) ++i;
    const long N = j->N[i], n0 = (c - j->first[i]) * j->chunk[i], n1 = n0 + j->chunk[i] < N ? n0 + j->chunk[i] : N;
    dense_range(j->x + i * j->x_step, j->R, j->K, j->ldx, j->w[i], j->wfmt[i], j->ldw[i], n0, n1, j->acc[i] + n0,
                j->ldacc[i]);
    if (j->act != ACT_F32) /* y[i]'s rows are ldacc[i] apart, as acc[i]'s */
        for (long r = 0; r < j->R; ++r)
            store_row(j->y[i], j->act, r * j->ldacc[i] + n0, j->acc[i] + r * j->ldacc[i] + n0, n1 - n0);
}

/* Columns a chunk of a dense product over a resident [K, N] weight takes: how dense_xw cuts its columns. */
static long dense_chunk(long N, long K, int wfmt, int nthreads) {
    return chunk_size(N, nthreads, matrix_bytes(wfmt, K * N), MIN_CHUNK_COLS, SPLIT_ALIGN);
}

/* Each weight cut as its own call cuts it (a share of the chunks by bytes balanced worse at 4+ rows). */
static void cut_weights(shared_job *job, int nthreads) {
    for (long i = 0; i < job->count; ++i) {
        const long N = job->N[i];
        job->chunk[i] = dense_chunk(N, job->K, job->wfmt[i], nthreads);
        job->first[i + 1] = job->first[i] + (N + job->chunk[i] - 1) / job->chunk[i];
    }
}

/* y_i[R, N_i] = x[R, K] W_i^T for i < count, each W_i resident input-major [K, N_i] (fp32 or bf16): what
   `count` dense_xw calls give, bit for bit (each output column is summed in the same order), in one call whose
   chunks are all theirs: one dispatch to the pool instead of `count` (and, from Python, one call instead of
   `count`), and the workers take the small weights' single chunks alongside the large weights' pieces. */
int dense_xw_shared(pool *p, const void *x, int act, long R, long K, long count, const void *const *w,
                    const int *wfmt, const long *N, void *const *y, int nthreads) {
    if (R <= 0 || K <= 0 || count <= 0 || count > MAX_SHARED) return ERR_ARGS;
    long columns = 0;
    for (long i = 0; i < count; ++i) {
        if ((wfmt[i] != FMT_F32 && wfmt[i] != FMT_BF16) || N[i] <= 0) return ERR_ARGS;
        columns += N[i];
    }
    float *xf = act == ACT_BF16 ? malloc(sizeof(float) * (size_t)(R * K)) : NULL;
    float *acc = act == ACT_BF16 ? malloc(sizeof(float) * (size_t)(R * columns)) : NULL;
    if (act == ACT_BF16 && (!xf || !acc)) {
        free(xf), free(acc);
        return ERR_ALLOC;
    }
    shared_job job = {.x = rows_f32(x, act, R * K, xf), .R = R, .K = K, .count = count, .ldx = K, .act = act, .w = w,
                      .wfmt = wfmt, .N = N, .y = y};
    for (long i = 0, offset = 0; i < count; offset += R * N[i], ++i) {
        job.acc[i] = act == ACT_BF16 ? acc + offset : (float *)y[i];
        job.ldw[i] = job.ldacc[i] = N[i];
    }
    cut_weights(&job, nthreads);
    pool_run(p, job.first[count], shared_chunk, &job, nthreads);
    free(xf);
    free(acc);
    return OK;
}

/* y[R, N] = x[R, K] W^T for one resident input-major W [K, N]: the one-weight dense_xw_shared. */
int dense_xw(pool *p, const void *x, int act, long R, long K, const void *w, int wfmt, long N, void *y, int nthreads) {
    return dense_xw_shared(p, x, act, R, K, 1, &w, &wfmt, &N, &y, nthreads);
}

/* y[R, G * N] with y[r, g * N + n] = sum_k x[r, g * K + k] W[g * N + n, k] for g < G: a grouped product (each
   group of K inputs through its own block of N outputs: the attention's grouped low-rank output projection) of
   rows x [R, G * K] (act: fp32, or bf16 widened once, y then rounded once as dense_xw rounds) and one resident
   input-major W [G * N, K] (storage [K, G * N], fp32 or bf16). Each output is summed as dense_xw sums it; the
   groups' column chunks share one dispatch to the pool. G <= MAX_SHARED (else ERR_ARGS: the caller takes torch's
   path). */
int dense_xw_grouped(pool *p, const void *x, int act, long R, long G, long K, const void *w, int wfmt, long N,
                     void *y, int nthreads) {
    if (R <= 0 || K <= 0 || N <= 0 || G <= 0 || G > MAX_SHARED || (wfmt != FMT_F32 && wfmt != FMT_BF16) ||
        (act != ACT_F32 && act != ACT_BF16))
        return ERR_ARGS;
    const void *blocks[MAX_SHARED];
    int formats[MAX_SHARED];
    long widths[MAX_SHARED];
    void *outputs[MAX_SHARED];
    const size_t element = wfmt == FMT_F32 ? sizeof(float) : sizeof(uint16_t);
    const size_t out_element = act == ACT_F32 ? sizeof(float) : sizeof(uint16_t);
    /* bf16 rows: widened once, the sums in an fp32 scratch [R, G * N] stored rounded (shared_chunk) */
    float *xf = act == ACT_BF16 ? malloc(sizeof(float) * (size_t)(R * G * K)) : NULL;
    float *acc = act == ACT_BF16 ? malloc(sizeof(float) * (size_t)(R * G * N)) : (float *)y;
    if (act == ACT_BF16 && (!xf || !acc)) {
        free(xf), free(acc);
        return ERR_ALLOC;
    }
    shared_job job = {.x = rows_f32(x, act, R * G * K, xf), .R = R, .K = K, .count = G, .ldx = G * K, .x_step = K,
                      .act = act, .w = blocks, .wfmt = formats, .N = widths, .y = outputs};
    for (long g = 0; g < G; ++g) {
        blocks[g] = (const char *)w + (size_t)(g * N) * element; /* the group's columns of every storage row */
        formats[g] = wfmt;
        widths[g] = N;
        outputs[g] = (char *)y + (size_t)(g * N) * out_element;
        job.acc[g] = acc + g * N;
        job.ldw[g] = job.ldacc[g] = G * N;
    }
    cut_weights(&job, nthreads);
    pool_run(p, job.first[G], shared_chunk, &job, nthreads);
    free(xf);
    if (act == ACT_BF16) free(acc);
    return OK;
}

/* b0, b1: the FP8 block (b0 output rows x b1 inputs); FP4: b1 = inputs per scale (b0 unused). */
int quant_xw(pool *p, const void *x, int act, long R, long K, int wfmt, const void *w, const void *scale, long b0,
             long b1, long N, void *y, int nthreads) {
    if (!quant_args_ok(wfmt, K, b0, b1) || R <= 0 || N <= 0) return ERR_ARGS;
    float *xf = act == ACT_BF16 || wfmt == FMT_FP4 ? malloc(sizeof(float) * (size_t)(R * K)) : NULL;
    float *acc = act == ACT_BF16 ? malloc(sizeof(float) * (size_t)(R * N)) : (float *)y;
    int status = OK;
    if ((act == ACT_BF16 || wfmt == FMT_FP4) && (!xf || !acc)) {
        status = ERR_ALLOC;
    } else {
        const float *xs = x;
        if (act == ACT_BF16) xs = rows_f32(x, act, R * K, xf);
        if (wfmt == FMT_FP4) { /* in place for bf16 (xf holds the widened rows): order through a temporary row */
            float *ordered = malloc(sizeof(float) * (size_t)K);
            if (!ordered) {
                status = ERR_ALLOC;
                goto done;
            }
            for (long r = 0; r < R; ++r) {
                fp4_order_rows(xs + r * K, 1, K, ordered);
                memcpy(xf + r * K, ordered, sizeof(float) * (size_t)K);
            }
            free(ordered);
            xs = xf;
        }
        const long chunk = chunk_size(N, nthreads, matrix_bytes(wfmt, K * N), MIN_CHUNK_ROWS, 1);
        product_job job = {xs, R, K, N, b0, b1, chunk, wfmt, act, w, scale, acc, y};
        pool_run(p, (N + chunk - 1) / chunk, product_chunk, &job, nthreads);
    }
done:
    free(xf);
    if (act == ACT_BF16) free(acc);
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

/* Picks one gather task copies into the grouped rows. */
#define GATHER_PICKS 64
/* Tokens one combine task sums. */
#define COMBINE_TOKENS 16

/* A MoE layer's shared expert, run inside the routed experts' two product phases (moe_layer): its gate and up
   columns are chunks of the first phase, its SwiGLU and down columns chunks of the second, so the layer waits on
   the pool twice rather than four times. Each product is summed as dense_xw sums it. */
typedef struct {
    const float *x; /* [T, D] fp32 rows */
    int fmt, bf16;  /* bf16: values round where the reference's bf16 tensors round */
    long Is, chunk_in, n_in, chunk_out, n_out, n_swiglu;
    float limit; /* in the rows' dtype */
    const void *w1, *w3, *w2;
    float *gate, *up, *h, *y;  /* [T, Is] x 3, [T, D] fp32 (bf16 rows: bf16 values) */
    atomic_long *swiglu_done; /* SwiGLU chunks finished: the down chunks start once all have */
} shared_expert;

typedef struct {
    long T, D, I, E, topk, b0, b1, chunk_i, chunk_d, n_chunks_i, n_chunks_d;
    int fmt, act;
    float limit;
    const void *x;
    const long *start, *token, *token_slots; /* token_slots[t * topk ...]: t's picks' slots, ascending */
    const float *pick_w;
    float *xs, *gate, *up, *h, *y; /* [P, D], [P, I] x 3, [P, D] */
    const void *w1, *s1, *w3, *s3, *w2, *s2;
    const shared_expert *shared; /* NULL: routed experts alone */
    void *out;
} moe_job;

/* Phase 0, chunk c: grouped rows [c * GATHER_PICKS, ...) = their tokens' x rows, as fp32 (FP4 weights read
   their inputs FP4-ordered). */
static void moe_gather_chunk(const void *arg, long c) {
    const moe_job *j = arg;
    const long P = j->T * j->topk, s0 = c * GATHER_PICKS, s1 = s0 + GATHER_PICKS < P ? s0 + GATHER_PICKS : P;
    long position[FP4_STEP];
    for (long i = 0; i < FP4_STEP; ++i) position[i] = j->fmt == FMT_FP4 ? fp4_position(i) : i;
    for (long s = s0; s < s1; ++s) {
        float *dst = j->xs + s * j->D;
        const long row = j->token[s] * j->D;
        long d = 0;
        for (; d + FP4_STEP <= j->D; d += FP4_STEP)
            for (long i = 0; i < FP4_STEP; ++i)
                dst[d + position[i]] = j->act == ACT_F32 ? ((const float *)j->x)[row + d + i]
                                                         : bf16_to_f32(((const uint16_t *)j->x)[row + d + i]);
        for (; d < j->D; ++d) /* a tail shorter than a step: never FP4 (its inputs are multiples of a step) */
            dst[d] = j->act == ACT_F32 ? ((const float *)j->x)[row + d]
                                       : bf16_to_f32(((const uint16_t *)j->x)[row + d]);
    }
}

/* Chunk size for an expert-major split of n columns per expert over `used` experts (bytes_each weight bytes
   each): about CHUNKS_PER_THREAD chunks a thread across all of them, so that few experts are cut finely and
   many are not cut at all (a dense chunk reads a piece of each weight row: the longer, the better it streams). */
static long expert_chunk(long n, int nthreads, long used, long bytes_each, long least, long align) {
    if (nthreads <= 1 || bytes_each * used < MIN_PARALLEL_BYTES) return n;
    const long chunks = (long)CHUNKS_PER_THREAD * nthreads;
    return split_size(n, (chunks + used - 1) / used, least, align);
}

/* Chunk c of an expert-major split (n_chunks chunks of `chunk` columns per expert, n columns): its expert,
   and its columns [*lo, *hi). */
static long expert_columns(long c, long n_chunks, long chunk, long n, long *lo, long *hi) {
    *lo = (c % n_chunks) * chunk;
    *hi = *lo + chunk < n ? *lo + chunk : n;
    return c / n_chunks;
}

/* Phase 1, chunk c: expert c / n_chunks_i, hidden columns [i0, i1) of its picks' rows. Expert-major chunks: the
   chunks of one expert run back to back, so its rows are read from cache, not memory, by all but the first. */
static void moe_hidden_chunk(const moe_job *j, long c) {
    long i0, i1;
    const long e = expert_columns(c, j->n_chunks_i, j->chunk_i, j->I, &i0, &i1);
    const long rows = j->start[e + 1] - j->start[e], first = j->start[e];
    if (rows == 0) return;
    const float *xe = j->xs + first * j->D;
    float *gate = j->gate + first * j->I, *up = j->up + first * j->I, *h = j->h + first * j->I;
    matrix_range(xe, rows, expert(j->fmt, j->w1, j->s1, e, j->D, j->I, j->b0, j->b1), j->b0, j->b1, i0, i1, gate + i0,
                 j->I);
    matrix_range(xe, rows, expert(j->fmt, j->w3, j->s3, e, j->D, j->I, j->b0, j->b1), j->b0, j->b1, i0, i1, up + i0,
                 j->I);
    for (long r = 0; r < rows; ++r)
        for (long i = i0; i < i1; ++i) {
            const float g = gate[r * j->I + i], u = up[r * j->I + i];
            const float gc = g < j->limit ? g : j->limit;
            const float uc = u < -j->limit ? -j->limit : (u > j->limit ? j->limit : u);
            h[r * j->I + (j->fmt == FMT_FP4 ? fp4_position(i) : i)] = silu(gc) * uc; /* w2's input order */
        }
}

/* Phase 2, chunk c: expert c / n_chunks_d, output columns [d0, d1) of its picks' rows (y, unweighted). */
static void moe_output_chunk(const moe_job *j, long c) {
    long d0, d1;
    const long e = expert_columns(c, j->n_chunks_d, j->chunk_d, j->D, &d0, &d1);
    const long rows = j->start[e + 1] - j->start[e], first = j->start[e];
    if (rows == 0) return;
    matrix_range(j->h + first * j->I, rows, expert(j->fmt, j->w2, j->s2, e, j->I, j->D, j->b0, j->b1), j->b0, j->b1,
                 d0, d1, j->y + first * j->D + d0, j->D);
}

/* Shared-expert SwiGLU elements one chunk computes (the exps dominate: a decode step of 64 rows has 64 x Is). */
#define SWIGLU_CHUNK 2048

/* Shared chunk c of phase 1: columns of its gate (c < n_in) or up product. */
static void shared_in_chunk(const shared_expert *s, long T, long D, long c) {
    const int up = c >= s->n_in;
    const long n0 = (c - up * s->n_in) * s->chunk_in, n1 = n0 + s->chunk_in < s->Is ? n0 + s->chunk_in : s->Is;
    float *acc = up ? s->up : s->gate;
    dense_range(s->x, T, D, D, up ? s->w3 : s->w1, s->fmt, s->Is, n0, n1, acc + n0, s->Is);
    if (s->bf16)
        for (long r = 0; r < T; ++r)
            for (long i = n0; i < n1; ++i) acc[r * s->Is + i] = round_bf16(acc[r * s->Is + i]);
}

/* Shared chunk c of phase 2's SwiGLU part: elements [c * SWIGLU_CHUNK, ...) of silu(min(gate, L)) * clamp(up, -L,
   L) over the [T, Is] rows (bf16 rows round silu's output and the product). */
static void shared_swiglu_chunk(const shared_expert *s, long T, long c) {
    const long n = T * s->Is, i0 = c * SWIGLU_CHUNK, i1 = i0 + SWIGLU_CHUNK < n ? i0 + SWIGLU_CHUNK : n;
    const float lim = s->limit;
    for (long i = i0; i < i1; ++i) {
        const float g = s->gate[i], u = s->up[i];
        const float gc = g < lim ? g : lim;
        const float uc = u < -lim ? -lim : (u > lim ? lim : u);
        s->h[i] = s->bf16 ? round_bf16(round_bf16(silu(gc)) * uc) : silu(gc) * uc;
    }
    atomic_fetch_add(s->swiglu_done, 1); /* publishes h's elements (seq_cst) */
}

/* Shared chunk c of phase 2's down part: output columns of W2s h, once every SwiGLU chunk has finished. Those
   chunks come first in the phase, so each is running or done when a down chunk is taken: the wait is short. */
static void shared_out_chunk(const shared_expert *s, long T, long D, long c) {
    wait_for_count(s->swiglu_done, s->n_swiglu);
    const long n0 = c * s->chunk_out, n1 = n0 + s->chunk_out < D ? n0 + s->chunk_out : D;
    dense_range(s->h, T, s->Is, s->Is, s->w2, s->fmt, D, n0, n1, s->y + n0, D);
}

/* Phase 1, chunk c: the routed experts' hidden chunks, then the shared expert's gate and up chunks. */
static void moe_first_chunk(const void *arg, long c) {
    const moe_job *j = arg;
    const long routed = j->E * j->n_chunks_i;
    if (c < routed) moe_hidden_chunk(j, c);
    else shared_in_chunk(j->shared, j->T, j->D, c - routed);
}

/* Phase 2, chunk c: the shared SwiGLU chunks, the routed experts' output chunks, the shared down chunks. */
static void moe_second_chunk(const void *arg, long c) {
    const moe_job *j = arg;
    const long swiglu = j->shared ? j->shared->n_swiglu : 0, routed = j->E * j->n_chunks_d;
    if (c < swiglu) shared_swiglu_chunk(j->shared, j->T, c);
    else if (c < swiglu + routed) moe_output_chunk(j, c - swiglu);
    else shared_out_chunk(j->shared, j->T, j->D, c - swiglu - routed);
}

/* Phase 3, chunk c: tokens [c * COMBINE_TOKENS, ...): out[t] = sum over t's picks of pick weight * y, the picks
   in ascending expert order (the reference loop's order: its index_add runs expert by expert), summed in out's
   row itself (fp32; bf16: the reference adds bf16-rounded products into a bf16 sum, which out's row holds). */
static void moe_combine_chunk(const void *arg, long c) {
    const moe_job *j = arg;
    const long t0 = c * COMBINE_TOKENS, t1 = t0 + COMBINE_TOKENS < j->T ? t0 + COMBINE_TOKENS : j->T;
    for (long t = t0; t < t1; ++t) {
        float *o32 = (float *)j->out + t * j->D;
        uint16_t *o16 = (uint16_t *)j->out + t * j->D;
        for (long q = 0; q < j->topk; ++q) {
            const long s = j->token_slots[t * j->topk + q];
            const float w = j->pick_w[s], *ys = j->y + s * j->D;
            if (j->act == ACT_F32) {
                for (long d = 0; d < j->D; ++d) o32[d] = (q ? o32[d] : 0.0f) + ys[d] * w;
            } else {
                for (long d = 0; d < j->D; ++d)
                    o16[d] = f32_to_bf16((q ? bf16_to_f32(o16[d]) : 0.0f) + round_bf16(ys[d] * w));
            }
        }
        if (!j->shared) continue;
        const float *sy = j->shared->y + t * j->D; /* the shared expert's row, added last (the reference's order) */
        if (j->act == ACT_F32) {
            for (long d = 0; d < j->D; ++d) o32[d] += sy[d];
        } else {
            for (long d = 0; d < j->D; ++d) o16[d] = f32_to_bf16(bf16_to_f32(o16[d]) + round_bf16(sy[d]));
        }
    }
}

/* x [T, D] (act), ids [T, k] int64, weights [T, k] fp32 -> out [T, D] (act, overwritten).
   w1/w3: [E, I, D] logical (gate / up), w2: [E, D, I] logical, in format fmt (dense: input-major storage).
   Each token's picks are added in ascending expert order, as the reference loop does; the only differences
   from it are the fp32 summation orders inside the products. Phases (each split across the pool): gather the
   picks' rows grouped by expert; gate, up and SwiGLU rows per (expert, hidden columns); the down projection
   per (expert, output columns); each token's weighted sum. A shared expert (moe_layer's) rides along: its
   products in the two product phases, its row added last in the sum. */
static int moe_run(pool *p, const void *x, int act, long T, long D, long I, long topk, const int64_t *ids,
                   const float *weights, long E, int fmt, const void *w1, const void *s1, const void *w3,
                   const void *s3, const void *w2, const void *s2, long b0, long b1, float limit,
                   const shared_expert *shared, void *out, int nthreads) {
    if (T <= 0 || D <= 0 || I <= 0 || topk <= 0 || E <= 0) return ERR_ARGS;
    if ((fmt == FMT_FP8 || fmt == FMT_FP4) && (!quant_args_ok(fmt, D, b0, b1) || !quant_args_ok(fmt, I, b0, b1)))
        return ERR_ARGS;
    const long P = T * topk;
    for (long q = 0; q < P; ++q)
        if (ids[q] < 0 || ids[q] >= E) return ERR_ARGS;
    long *start = calloc((size_t)E + 1, sizeof(long)), *fill = malloc(sizeof(long) * (size_t)E);
    long *token = malloc(sizeof(long) * (size_t)P), *token_slots = malloc(sizeof(long) * (size_t)P);
    long *taken = calloc((size_t)T, sizeof(long)); /* slots of each token listed so far */
    float *pick_w = malloc(sizeof(float) * (size_t)P);
    float *xs = malloc(sizeof(float) * (size_t)(P * D)); /* gathered rows, grouped by expert */
    float *hidden = malloc(sizeof(float) * (size_t)(3 * P * I)); /* gate | up | SwiGLU */
    float *y = malloc(sizeof(float) * (size_t)(P * D));
    int status = OK;
    if (!start || !fill || !token || !token_slots || !taken || !pick_w || !xs || !hidden || !y) {
        status = ERR_ALLOC;
        goto done;
    }
    /* Counting sort of the picks by expert (stable: token order within an expert). */
    for (long q = 0; q < P; ++q) start[ids[q] + 1]++;
    for (long e = 0; e < E; ++e) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(long) * (size_t)E);
    for (long q = 0; q < P; ++q) {
        const long slot = fill[ids[q]]++;
        token[slot] = q / topk;
        pick_w[slot] = weights[q];
    }
    /* Each token's slots, ascending (slots run expert by expert: ascending expert order, as the reference adds). */
    for (long s = 0; s < P; ++s) token_slots[token[s] * topk + taken[token[s]]++] = s;
    long used = 0; /* experts with picks: only their chunks do work */
    for (long e = 0; e < E; ++e) used += start[e + 1] > start[e];
    const long matrix = matrix_bytes(fmt, D * I);
    const int dense = fmt == FMT_F32 || fmt == FMT_BF16;
    const long least = dense ? MIN_CHUNK_COLS : MIN_CHUNK_ROWS, align = dense ? SPLIT_ALIGN : 1;
    const long chunk_i = expert_chunk(I, nthreads, used, 2 * matrix, least, align);
    const long chunk_d = expert_chunk(D, nthreads, used, matrix, least, align);
    moe_job job = {.T = T, .D = D, .I = I, .E = E, .topk = topk, .b0 = b0, .b1 = b1, .chunk_i = chunk_i,
                   .chunk_d = chunk_d, .n_chunks_i = (I + chunk_i - 1) / chunk_i,
                   .n_chunks_d = (D + chunk_d - 1) / chunk_d, .fmt = fmt, .act = act, .limit = limit, .x = x,
                   .start = start, .token = token, .token_slots = token_slots, .pick_w = pick_w, .xs = xs,
                   .gate = hidden, .up = hidden + P * I, .h = hidden + 2 * P * I, .y = y, .w1 = w1, .s1 = s1,
                   .w3 = w3, .s3 = s3, .w2 = w2, .s2 = s2, .shared = shared, .out = out};
    const long shared_first = shared ? 2 * shared->n_in : 0;
    const long shared_second = shared ? shared->n_swiglu + shared->n_out : 0;
    pool_run(p, (P + GATHER_PICKS - 1) / GATHER_PICKS, moe_gather_chunk, &job, nthreads);
    pool_run(p, E * job.n_chunks_i + shared_first, moe_first_chunk, &job, nthreads);
    pool_run(p, E * job.n_chunks_d + shared_second, moe_second_chunk, &job, nthreads);
    pool_run(p, (T + COMBINE_TOKENS - 1) / COMBINE_TOKENS, moe_combine_chunk, &job, nthreads);
done:
    free(start);
    free(fill);
    free(token);
    free(token_slots);
    free(taken);
    free(pick_w);
    free(xs);
    free(hidden);
    free(y);
    return status;
}

int moe_experts(pool *p, const void *x, int act, long T, long D, long I, long topk, const int64_t *ids,
                const float *weights, long E, int fmt, const void *w1, const void *s1, const void *w3, const void *s3,
                const void *w2, const void *s2, long b0, long b1, float limit, void *out, int nthreads) {
    return moe_run(p, x, act, T, D, I, topk, ids, weights, E, fmt, w1, s1, w3, s3, w2, s2, b0, b1, limit, NULL, out,
                   nthreads);
}

/* ---------------------------------------------------------------------------------------------------- */
/* One MoE layer of a few tokens: router, routed experts and the shared expert in one call.           */
/* ---------------------------------------------------------------------------------------------------- */

enum { SCORE_SOFTMAX = 0, SCORE_SIGMOID = 1, SCORE_SQRTSOFTPLUS = 2 };
/* torch's F.softplus default: softplus(v) = v above it (log1p(exp(v)) rounds to v there anyway). */
#define SOFTPLUS_THRESHOLD 20.0f

/* scores[e] from the router logits, as the reference's scoring function. */
static void router_scores(int scoring, float *scores, long E) {
    if (scoring == SCORE_SOFTMAX) {
        float top = scores[0], total = 0.0f;
        for (long e = 1; e < E; ++e) top = scores[e] > top ? scores[e] : top;
        for (long e = 0; e < E; ++e) total += scores[e] = expf(scores[e] - top);
        for (long e = 0; e < E; ++e) scores[e] /= total;
    } else if (scoring == SCORE_SIGMOID) {
        for (long e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + expf(-scores[e]));
    } else {
        for (long e = 0; e < E; ++e)
            scores[e] = sqrtf(scores[e] > SOFTPLUS_THRESHOLD ? scores[e] : log1pf(expf(scores[e])));
    }
}

/* ids[0..k) = the k experts of largest scores[e] + bias[e], largest first (equal keys: the lower id first). */
static void router_top_k(const float *scores, const float *bias, long E, long k, int64_t *ids) {
    for (long j = 0; j < k; ++j) {
        long best = -1;
        float best_key = 0.0f;
        for (long e = 0; e < E; ++e) {
            int taken = 0;
            for (long i = 0; i < j; ++i) taken |= ids[i] == e;
            const float key = scores[e] + bias[e];
            if (!taken && (best < 0 || key > best_key)) {
                best = e;
                best_key = key;
            }
        }
        ids[j] = best;
    }
}

/* x [T, D] (act: fp32 or bf16) -> out [T, D] (act) = routed + shared, the MoE layer of T tokens (`topk` routed
   experts of E each):
     router    logits = x Wr^T in fp32 (Wr [E, D] resident input-major, fp32 or bf16), scored by `scoring`; a
               token's experts: a hash row (hash_table[token_ids[t]], int32 [V, topk]; the ids are read at the
               call, so a replayed call reads the step's tokens) when hash_table is given, else the top-k of
               scores + bias; their weights = scores / (sum + norm_eps) * scaling
     routed    moe_experts over the stacks w1/w3/w2 (fmt, scales, b0/b1), SwiGLU clamped at `limit`
     shared    W2s (silu(min(W1s x, L)) * clamp(W3s x, -L, L)), W1s/W3s [Is, D], W2s [D, Is] input-major
               (shared_fmt: fp32 or bf16)
   Each product is the kernel the layer's separate calls run on the same rows (dense_xw, moe_experts), so only
   the router's and the shared SwiGLU's fp32 roundings can differ from the torch reference's. bf16 rows round
   where the reference's bf16 tensors do: each product's output, silu's, the SwiGLU product and the final sum. */
int moe_layer(pool *p, const void *x, int act, long T, long D, long E, long topk, const void *router_w,
              int router_fmt, int scoring, const float *bias, const int32_t *hash_table, long vocab,
              const int64_t *token_ids, float scaling, float norm_eps, long I, int fmt, const void *w1, const void *s1,
              const void *w3, const void *s3, const void *w2, const void *s2, long b0, long b1, float limit, long Is,
              int shared_fmt, const void *sw1, const void *sw3, const void *sw2, void *out, int nthreads) {
    if (T <= 0 || D <= 0 || E <= 0 || topk <= 0 || topk > E || Is <= 0 ||
        (router_fmt != FMT_F32 && router_fmt != FMT_BF16) || (shared_fmt != FMT_F32 && shared_fmt != FMT_BF16) ||
        scoring < SCORE_SOFTMAX || scoring > SCORE_SQRTSOFTPLUS || (act != ACT_F32 && act != ACT_BF16))
        return ERR_ARGS;
    if (hash_table) {
        if (!token_ids) return ERR_ARGS;
        for (long t = 0; t < T; ++t)
            if (token_ids[t] < 0 || token_ids[t] >= vocab) return ERR_ARGS;
    } else if (!bias) {
        return ERR_ARGS;
    }
    const int bf16 = act == ACT_BF16;
    const size_t rows = (size_t)T;
    float *scores = malloc(sizeof(float) * rows * (size_t)E), *weights = malloc(sizeof(float) * rows * (size_t)topk);
    int64_t *ids = malloc(sizeof(int64_t) * rows * (size_t)topk);
    /* x as fp32 [T, D] | the shared expert's gate | up | SwiGLU [T, Is] each | its output [T, D] */
    float *work = malloc(sizeof(float) * rows * (size_t)(2 * D + 3 * Is));
    int status = OK;
    if (!scores || !weights || !ids || !work) {
        status = ERR_ALLOC;
        goto done;
    }
    const long hidden = T * Is;
    float *xf = work, *gate = work + T * D, *up = gate + hidden, *h = up + hidden, *shared_y = h + hidden;
    const float *x32 = rows_f32(x, act, T * D, xf);
    dense_range(x32, T, D, D, router_w, router_fmt, E, 0, E, scores, E);
    for (long t = 0; t < T; ++t) {
        float *token_scores = scores + t * E, *token_weights = weights + t * topk;
        int64_t *token_experts = ids + t * topk;
        router_scores(scoring, token_scores, E);
        if (hash_table)
            for (long j = 0; j < topk; ++j) token_experts[j] = hash_table[token_ids[t] * topk + j];
        else
            router_top_k(token_scores, bias, E, topk, token_experts);
        float total = 0.0f;
        for (long j = 0; j < topk; ++j) {
            if (token_experts[j] < 0 || token_experts[j] >= E) {
                status = ERR_ARGS;
                goto done;
            }
            total += token_weights[j] = token_scores[token_experts[j]];
        }
        for (long j = 0; j < topk; ++j) token_weights[j] = token_weights[j] / (total + norm_eps) * scaling;
    }
    /* The shared expert's products cut as dense_xw cuts them. */
    atomic_long swiglu_done = 0;
    const long chunk_in = dense_chunk(Is, D, shared_fmt, nthreads);
    const long chunk_out = dense_chunk(D, Is, shared_fmt, nthreads);
    const shared_expert shared = {.x = x32, .fmt = shared_fmt, .bf16 = bf16, .Is = Is, .chunk_in = chunk_in,
                                  .n_in = (Is + chunk_in - 1) / chunk_in, .chunk_out = chunk_out,
                                  .n_out = (D + chunk_out - 1) / chunk_out,
                                  .n_swiglu = (hidden + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK,
                                  .limit = bf16 ? round_bf16(limit) : limit, /* the bound in the rows' dtype */
                                  .w1 = sw1, .w3 = sw3, .w2 = sw2, .gate = gate, .up = up, .h = h, .y = shared_y,
                                  .swiglu_done = &swiglu_done};
    status = moe_run(p, x, act, T, D, I, topk, ids, weights, E, fmt, w1, s1, w3, s3, w2, s2, b0, b1, limit, &shared,
                     out, nthreads);
done:
    free(scores);
    free(weights);
    free(ids);
    free(work);
    return status;
}

/* ---------------------------------------------------------------------------------------------------- */
/* Embedding rows: a decode step's token rows of the table, as bytes.                                   */
/* ---------------------------------------------------------------------------------------------------- */

/* out[i] = table[ids[i]] for i < n, rows of row_bytes bytes (a copy, so bit for bit the table's row); an id
   outside [0, rows) is an argument error, found before any row is written. */
int gather_rows(const void *table, long rows, long row_bytes, const int64_t *ids, long n, void *out) {
    if (rows <= 0 || row_bytes <= 0 || n < 0) return ERR_ARGS;
    for (long i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= rows) return ERR_ARGS;
    for (long i = 0; i < n; ++i)
        memcpy((char *)out + i * row_bytes, (const char *)table + ids[i] * row_bytes, (size_t)row_bytes);
    return OK;
}

/* ---------------------------------------------------------------------------------------------------- */
/* Greedy sampling: each row's argmax.                                                                  */
/* ---------------------------------------------------------------------------------------------------- */

/* Floats one step of the argmax's passes compares: an AVX-512 vector. */
#define ARGMAX_LANES 16

/* The index torch.max(dim=-1) returns for one row of n > 0 floats: the first of its largest value, or the first
   NaN where the row holds one. One pass finds the maximum (and whether a NaN is there), a second the first
   position holding it: with AVX-512 sixteen floats a step (a running index does not vectorise). */
static long row_argmax(const float *restrict x, long n) {
    long i = 0;
    float best = x[0];
    int nan = x[0] != x[0];
#if defined(__AVX512F__)
    if (n >= ARGMAX_LANES) {
        __m512 most = _mm512_loadu_ps(x);
        __mmask16 unordered = _mm512_cmp_ps_mask(most, most, _CMP_UNORD_Q);
        for (i = ARGMAX_LANES; i + ARGMAX_LANES <= n; i += ARGMAX_LANES) {
            const __m512 v = _mm512_loadu_ps(x + i);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            most = _mm512_max_ps(most, v); /* NaN-free rows only are read from it */
        }
        best = _mm512_reduce_max_ps(most);
        nan = unordered != 0;
    }
#endif
    for (; i < n; ++i) {
        best = x[i] > best ? x[i] : best;
        nan |= x[i] != x[i];
    }
    long k = 0;
#if defined(__AVX512F__)
    const __m512 wanted = _mm512_set1_ps(best);
    for (; k + ARGMAX_LANES <= n; k += ARGMAX_LANES) {
        const __m512 v = _mm512_loadu_ps(x + k);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, wanted, _CMP_EQ_OQ);
        if (hit) return k + __builtin_ctz(hit);
    }
#endif
    for (; k < n; ++k)
        if (nan ? x[k] != x[k] : x[k] == best) return k;
    return 0; /* not reached: the maximum (or a NaN) is one of the row's values */
}

typedef struct {
    const float *x;
    long rows, cols, rows_per_chunk;
    int64_t *out;
} argmax_job;

static void argmax_chunk(const void *arg, long c) {
    const argmax_job *j = arg;
    const long r0 = c * j->rows_per_chunk, r1 = r0 + j->rows_per_chunk < j->rows ? r0 + j->rows_per_chunk : j->rows;
    for (long r = r0; r < r1; ++r) j->out[r] = row_argmax(j->x + r * j->cols, j->cols);
}

/* out[r] = the argmax of row r of x [rows, cols] fp32 (`row_argmax`), rows over the pool's threads. */
int argmax_rows(pool *p, const float *x, long rows, long cols, int64_t *out, int nthreads) {
    if (rows <= 0 || cols <= 0) return ERR_ARGS;
    const long chunks = nthreads > 1 ? (rows < 2L * nthreads ? rows : 2L * nthreads) : 1;
    argmax_job job = {x, rows, cols, (rows + chunks - 1) / chunks, out};
    pool_run(p, (rows + job.rows_per_chunk - 1) / job.rows_per_chunk, argmax_chunk, &job, nthreads);
    return OK;
}

/* Each replayable kernel's twin taking its arguments from a block, and their letters (packed_call.h). */
const char *const dense_xw_shared_signature = "ppilllppppi";
int dense_xw_shared_packed(const packed_arg *a) {
    return dense_xw_shared(a[0].p, a[1].p, a[2].i, a[3].l, a[4].l, a[5].l, a[6].p, a[7].p, a[8].p, a[9].p, a[10].i);
}
const char *const dense_xw_signature = "ppillpilpi";
int dense_xw_packed(const packed_arg *a) {
    return dense_xw(a[0].p, a[1].p, a[2].i, a[3].l, a[4].l, a[5].p, a[6].i, a[7].l, a[8].p, a[9].i);
}
const char *const dense_xw_grouped_signature = "ppilllpilpi";
int dense_xw_grouped_packed(const packed_arg *a) {
    return dense_xw_grouped(a[0].p, a[1].p, a[2].i, a[3].l, a[4].l, a[5].l, a[6].p, a[7].i, a[8].l, a[9].p, a[10].i);
}
const char *const quant_xw_signature = "ppillipplllpi";
int quant_xw_packed(const packed_arg *a) {
    return quant_xw(a[0].p, a[1].p, a[2].i, a[3].l, a[4].l, a[5].i, a[6].p, a[7].p, a[8].l, a[9].l, a[10].l, a[11].p,
                    a[12].i);
}
const char *const moe_experts_signature = "ppillllpplippppppllfpi";
int moe_experts_packed(const packed_arg *a) {
    return moe_experts(a[0].p, a[1].p, a[2].i, a[3].l, a[4].l, a[5].l, a[6].l, a[7].p, a[8].p, a[9].l, a[10].i, a[11].p,
                       a[12].p, a[13].p, a[14].p, a[15].p, a[16].p, a[17].l, a[18].l, a[19].f, a[20].p, a[21].i);
}
const char *const moe_layer_signature = "ppillllpiipplpfflippppppllflippppi";
int moe_layer_packed(const packed_arg *a) {
    return moe_layer(a[0].p, a[1].p, a[2].i, a[3].l, a[4].l, a[5].l, a[6].l, a[7].p, a[8].i, a[9].i, a[10].p, a[11].p,
                     a[12].l, a[13].p, a[14].f, a[15].f, a[16].l, a[17].i, a[18].p, a[19].p, a[20].p, a[21].p, a[22].p,
                     a[23].p, a[24].l, a[25].l, a[26].f, a[27].l, a[28].i, a[29].p, a[30].p, a[31].p, a[32].p, a[33].i);
}
const char *const gather_rows_signature = "pllplp";
int gather_rows_packed(const packed_arg *a) {
    return gather_rows(a[0].p, a[1].l, a[2].l, a[3].p, a[4].l, a[5].p);
}
const char *const argmax_rows_signature = "ppllpi";
int argmax_rows_packed(const packed_arg *a) {
    return argmax_rows(a[0].p, a[1].p, a[2].l, a[3].l, a[4].p, a[5].i);
}
