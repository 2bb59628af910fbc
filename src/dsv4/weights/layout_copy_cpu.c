/* Copies into input-major resident weights (dest = the transpose of a contiguous [cols, rows] buffer) from
 * row-major [rows, cols] values: torch's strided copy of a whole transposed matrix runs ~10-20x a memcpy on
 * CPU. Optionally converts dtype (bf16 <-> fp32, rounding to nearest even like torch) or dequantizes FP8 e4m3
 * codes with their block scales in the same pass.
 *
 * dst[c * dst_ld + r] = f(src[r * src_ld + c]) for r < rows, c < cols.
 *
 * The copies also check, in the same pass, that every value they write is finite: `mask` is the
 * destination format's exponent field (fp32 0x7F800000, bf16 0x7F80, fp16 0x7C00; 0: no check), a value
 * whose exponent bits are all set is an infinity or a NaN, and the copy returns whether it wrote one. A
 * caller validating while it stages (into a buffer nothing reads yet) thus reads the values once. The
 * straight copies (copy_*: n elements in memory order) do the same for tensors already in their layout.
 *
 * Built with -march=native (layout_copy.py): with AVX2 the transposes move 8x8 blocks through registers
 * (vector_isa() == 256), and FP8 dequantization decodes 8 codes a step into a band those transposes place;
 * without it, and on the ragged edges a block does not cover, through the tiled scalar walk below
 * (vector_isa() == 0). Both give the same bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h" /* bf16_to_f32, f32_to_bf16 (torch's rounding): the kernels' shared helpers */

#if defined(__AVX2__)
#include <immintrin.h>
#define VECTOR_ISA 256
#else
#define VECTOR_ISA 0
#endif

int vector_isa(void) { return VECTOR_ISA; }

/* ---- the scalar walk (no AVX2, ragged edges, FP8 dequantization) ----
 * A tile of TILE_ROWS source rows x TILE_COLS columns (two cache lines of fp32) is read run by run into a
 * local buffer, transposed there, and written out as TILE_COLS contiguous runs of TILE_ROWS destination
 * elements. Each source run is used whole the one time it is read, so rows a power of two apart (the same
 * L1 set) cannot thrash as a direct tile walk does; the buffer (16 KiB of fp32) stays in L1. Sizes from a
 * sweep on the development VM (256x16 to 16x16): 128x32 was best or close on 1-16 MiB matrices. */
#define TILE_ROWS 128
#define TILE_COLS 32

#define IDENTITY(x) (x)

/* Whether any of n destination elements (4- or 2-byte) has every bit of `mask` set; 0 without a mask. */
static int any_nonfinite(const void *values, int64_t n, size_t size, uint32_t mask) {
    uint32_t seen = 0;
    if (!mask) return 0;
    if (size == sizeof(uint32_t)) {
        const uint32_t *v = (const uint32_t *)values;
        for (int64_t i = 0; i < n; i++) seen |= (v[i] & mask) == mask;
    } else {
        const uint16_t *v = (const uint16_t *)values;
        for (int64_t i = 0; i < n; i++) seen |= (uint32_t)((v[i] & mask) == mask);
    }
    return seen != 0;
}

/* The tile walk every scalar kernel shares: for each source row r of a tile (rows r0 + r, columns c0 ..
 * c0 + nc), FILL_RUN stores the run's converted values at col[c * TILE_ROWS]; then the tile's columns are
 * written out as contiguous runs of the destination, and checked against `mask` (into `seen`). */
#define TILED(DST_T, ...)                                                                                 \
    DST_T buf[TILE_COLS * TILE_ROWS];                                                                     \
    for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {                                                    \
        int64_t nr = r0 + TILE_ROWS < rows ? TILE_ROWS : rows - r0;                                       \
        for (int64_t c0 = 0; c0 < cols; c0 += TILE_COLS) {                                                \
            int64_t nc = c0 + TILE_COLS < cols ? TILE_COLS : cols - c0;                                   \
            for (int64_t r = 0; r < nr; r++) {                                                            \
                DST_T *col = buf + r;                                                                     \
                __VA_ARGS__                                                                               \
            }                                                                                             \
            for (int64_t c = 0; c < nc; c++) {                                                            \
                memcpy(dst + (c0 + c) * dst_ld + r0, buf + c * TILE_ROWS, nr * sizeof(DST_T));            \
                seen |= any_nonfinite(buf + c * TILE_ROWS, nr, sizeof(DST_T), mask);                      \
            }                                                                                             \
        }                                                                                                 \
    }

#define SCALAR_TRANSPOSE(NAME, SRC_T, DST_T, CONVERT)                                                     \
    static int NAME(const SRC_T *src, DST_T *dst, int64_t rows, int64_t cols, int64_t src_ld,               \
                    int64_t dst_ld, uint32_t mask) {                                                      \
        int seen = 0;                                                                                     \
        TILED(DST_T, const SRC_T *s = src + (r0 + r) * src_ld + c0;                                       \
              for (int64_t c = 0; c < nc; c++) col[c * TILE_ROWS] = CONVERT(s[c]);)                       \
        return seen;                                                                                      \
    }

SCALAR_TRANSPOSE(scalar_b32, uint32_t, uint32_t, IDENTITY)
SCALAR_TRANSPOSE(scalar_b16, uint16_t, uint16_t, IDENTITY)
SCALAR_TRANSPOSE(scalar_bf16_f32, uint16_t, float, bf16_to_f32)
SCALAR_TRANSPOSE(scalar_f32_bf16, float, uint16_t, f32_to_bf16)

#if defined(__AVX2__)
/* ---- register blocks ----
 * A panel of PANEL_ROWS source rows x PANEL_COLS columns is copied strip by strip (STRIP rows at a time)
 * into a local buffer, each source line read whole once (rows a power of two apart share a cache set: a
 * block walk straight from the source re-reads every line from beyond L1/L2), then the strip is
 * transposed from the buffer in 8x8 register blocks (fp32: 8x8 transposes; 16-bit: two 8x8 matrices per
 * register, one per 128-bit lane) and stored as one 64-byte run per destination row: every destination
 * line is written whole at once. A panel keeps its pages (PANEL_ROWS source rows, PANEL_COLS destination
 * rows) in the TLB. Sizes from a sweep on the development VM (32x64 to 256x32): 128x64 was best or close.
 *
 * `stream`: store with non-temporal (streaming) stores, which write whole lines without first reading them
 * into the cache; it is ignored unless every store is aligned (destination and row stride multiples of 32
 * bytes). The caller sets it only for fp32 destinations too large for the last-level cache, where memcpy
 * streams too: measured there ~1.1-1.4x a memcpy instead of ~1.6-2.2x, while in-cache sizes ran slower
 * streamed. */
#define PANEL_ROWS 128
#define PANEL_COLS 64
#define F32_STRIP 16 /* rows per strip into a 4-byte destination: 64 bytes per destination row */
#define B16_STRIP 32 /* ... into a 2-byte destination */
#define F32_COLS 8   /* columns per register block reading fp32 or writing fp32 */
#define B16_COLS 16  /* ... between 16-bit types */
#define STREAM_ALIGN 32

/* r[i] <- column i of the 8x8 fp32 matrix whose rows are r[0..7] (three shuffle stages). */
static inline void transpose8_ps(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* Within each 128-bit lane: r[i] <- column i of the 8x8 16-bit matrix whose rows are r[0..7] (three unpack
 * stages; the two lanes are two independent matrices). */
static inline void transpose8_epi16_lanes(__m256i r[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            b[4 * i + 2 * j] = _mm256_unpacklo_epi32(a[4 * i + j], a[4 * i + j + 2]);
            b[4 * i + 2 * j + 1] = _mm256_unpackhi_epi32(a[4 * i + j], a[4 * i + j + 2]);
        }
    for (int i = 0; i < 4; i++) {
        r[2 * i] = _mm256_unpacklo_epi64(b[i], b[i + 4]);
        r[2 * i + 1] = _mm256_unpackhi_epi64(b[i], b[i + 4]);
    }
}

/* 8 fp32 <-> 8 bf16: widening is exact; narrowing rounds to nearest even, NaN -> 0x7FC0 (as f32_to_bf16). */
static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline __m128i to_bf16x8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    /* every lane holds 0..0xFFFF, which the unsigned saturating pack keeps exactly */
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

/* Store 32 bytes (streamed or not), marking in *seen the 32-bit / 16-bit lanes whose `mask` bits are all
 * set (every lane is marked with a zero mask: the caller then ignores *seen). */
static inline void store256(void *p, __m256i x, int stream) {
    if (stream)
        _mm256_stream_si256((__m256i *)p, x);
    else
        _mm256_storeu_si256((__m256i *)p, x);
}

static inline void store_checked32(void *p, __m256i x, int stream, __m256i mask, __m256i *seen) {
    *seen = _mm256_or_si256(*seen, _mm256_cmpeq_epi32(_mm256_and_si256(x, mask), mask));
    store256(p, x, stream);
}

static inline void store_checked16(void *p, __m256i x, int stream, __m256i mask, __m256i *seen) {
    *seen = _mm256_or_si256(*seen, _mm256_cmpeq_epi16(_mm256_and_si256(x, mask), mask));
    store256(p, x, stream);
}

static inline __m256 load_f32x8(const void *p) { return _mm256_loadu_ps((const float *)p); }

/* The panel walk every blocked kernel shares: for each strip of STRIP_ROWS rows (r) of a panel (columns c0
 * .. c1), its source runs are copied into buf[STRIP_ROWS][PANEL_COLS], then BLOCKS(b, c) stores the
 * columns c .. c + COLS of the strip, whose rows start at b (= buf + column offset). */
#define PANELS(SRC_T, STRIP_ROWS, COLS, ...)                                                             \
    SRC_T buf[STRIP_ROWS * PANEL_COLS] __attribute__((aligned(64)));                                      \
    for (int64_t r0 = 0; r0 < rows; r0 += PANEL_ROWS) {                                                   \
        int64_t r1 = r0 + PANEL_ROWS < rows ? r0 + PANEL_ROWS : rows;                                     \
        for (int64_t c0 = 0; c0 < cols; c0 += PANEL_COLS) {                                               \
            int64_t nc = c0 + PANEL_COLS < cols ? PANEL_COLS : cols - c0;                                 \
            for (int64_t r = r0; r < r1; r += STRIP_ROWS) {                                               \
                for (int i = 0; i < STRIP_ROWS; i++)                                                      \
                    memcpy(buf + i * PANEL_COLS, src + (r + i) * src_ld + c0, nc * sizeof(SRC_T));        \
                for (int64_t c = 0; c < nc; c += COLS) {                                                  \
                    const SRC_T *b = buf + c;                                                             \
                    __VA_ARGS__                                                                           \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

/* Kernels reading 8 columns per row (fp32, or bf16 widened): a strip of 16 rows is two 8x8 transposes,
 * then each of the 8 columns' 16 values is stored by STORE16(destination, first 8, last 8). */
#define F32_BLOCKS(NAME, SRC_T, DST_T, LOAD8, STORE16)                                                   \
    static __m256i NAME(const SRC_T *src, DST_T *dst, int64_t rows, int64_t cols, int64_t src_ld,           \
                        int64_t dst_ld, int stream, __m256i mask) {                                       \
        __m256i seen = _mm256_setzero_si256();                                                            \
        PANELS(SRC_T, F32_STRIP, F32_COLS, __m256 lo[8], hi[8];                                           \
               for (int i = 0; i < 8; i++) {                                                              \
                   lo[i] = LOAD8(b + i * PANEL_COLS);                                                     \
                   hi[i] = LOAD8(b + (8 + i) * PANEL_COLS);                                               \
               } transpose8_ps(lo);                                                                       \
               transpose8_ps(hi);                                                                         \
               for (int i = 0; i < 8; i++) STORE16(dst + (c0 + c + i) * dst_ld + r, lo[i], hi[i]);)       \
        return seen;                                                                                      \
    }

#define STORE16_F32(p, lo, hi)                                                                            \
    do {                                                                                                  \
        store_checked32((p), _mm256_castps_si256(lo), stream, mask, &seen);                               \
        store_checked32((p) + 8, _mm256_castps_si256(hi), stream, mask, &seen);                           \
    } while (0)

F32_BLOCKS(blocked_b32, uint32_t, uint32_t, load_f32x8, STORE16_F32)
F32_BLOCKS(blocked_bf16_f32, uint16_t, float, load_bf16x8, STORE16_F32)

/* fp32 -> bf16: a strip of 32 rows is four 8x8 transposes per 8 columns, each column's 32 rounded values
 * one 64-byte run. */
static __m256i blocked_f32_bf16(const float *src, uint16_t *dst, int64_t rows, int64_t cols, int64_t src_ld,
                                int64_t dst_ld, int stream, __m256i mask) {
    __m256i seen = _mm256_setzero_si256();
    PANELS(float, B16_STRIP, F32_COLS, __m128i q[4][8]; for (int k = 0; k < 4; k++) {
        __m256 x[8];
        for (int i = 0; i < 8; i++) x[i] = load_f32x8(b + (8 * k + i) * PANEL_COLS);
        transpose8_ps(x);
        for (int i = 0; i < 8; i++) q[k][i] = to_bf16x8(x[i]);
    } for (int i = 0; i < 8; i++) {
        uint16_t *d = dst + (c0 + c + i) * dst_ld + r;
        store_checked16(d, _mm256_set_m128i(q[1][i], q[0][i]), stream, mask, &seen);
        store_checked16(d + 16, _mm256_set_m128i(q[3][i], q[2][i]), stream, mask, &seen);
    })
    return seen;
}

/* 16-bit elements: 16 columns of 16 rows hold two 8x8 matrices per 8 rows (columns c .. c + 7 in the low
 * lanes, c + 8 .. c + 15 in the high ones), transposed lane by lane; column c + i is then the low lanes of
 * register i of both 8-row halves, column c + 8 + i their high lanes. A strip of 32 rows is two such
 * blocks, stored as one 64-byte run per destination row. */
static inline void b16_block(const uint16_t *b, __m256i out[16]) {
    __m256i top[8], bottom[8];
    for (int i = 0; i < 8; i++) {
        top[i] = _mm256_load_si256((const __m256i *)(b + i * PANEL_COLS));
        bottom[i] = _mm256_load_si256((const __m256i *)(b + (8 + i) * PANEL_COLS));
    }
    transpose8_epi16_lanes(top);
    transpose8_epi16_lanes(bottom);
    for (int i = 0; i < 8; i++) {
        out[i] = _mm256_permute2x128_si256(top[i], bottom[i], 0x20);
        out[8 + i] = _mm256_permute2x128_si256(top[i], bottom[i], 0x31);
    }
}

static __m256i blocked_b16(const uint16_t *src, uint16_t *dst, int64_t rows, int64_t cols, int64_t src_ld,
                           int64_t dst_ld, int stream, __m256i mask) {
    __m256i seen = _mm256_setzero_si256();
    PANELS(uint16_t, B16_STRIP, B16_COLS, __m256i upper[16], lower[16]; b16_block(b, upper);
           b16_block(b + 16 * PANEL_COLS, lower); for (int i = 0; i < 16; i++) {
               uint16_t *d = dst + (c0 + c + i) * dst_ld + r;
               store_checked16(d, upper[i], stream, mask, &seen);
               store_checked16(d + 16, lower[i], stream, mask, &seen);
           })
    return seen;
}

/* The whole matrix: the blocks cover [0, rows - rows % STRIP) x [0, cols - cols % COLS); the scalar walk
 * takes the last columns of those rows and the last rows % STRIP rows. Returns whether a written value has
 * every bit of `mask` set (0 without a mask). */
#define TRANSPOSE(NAME, SRC_T, DST_T, BLOCKED, SCALAR, STRIP, COLS)                                       \
    int NAME(const SRC_T *src, DST_T *dst, int64_t rows, int64_t cols, int64_t src_ld, int64_t dst_ld,      \
             int stream, uint32_t mask) {                                                                 \
        int64_t rb = rows - rows % (STRIP), cb = cols - cols % (COLS);                                    \
        stream = stream && (uintptr_t)dst % STREAM_ALIGN == 0 && (dst_ld * sizeof(DST_T)) % STREAM_ALIGN == 0; \
        __m256i lanes = sizeof(DST_T) == sizeof(uint32_t) ? _mm256_set1_epi32((int)mask)                  \
                                                          : _mm256_set1_epi16((short)mask);               \
        int seen = !_mm256_testz_si256(BLOCKED(src, dst, rb, cb, src_ld, dst_ld, stream, lanes),          \
                                       _mm256_set1_epi8(-1));                                             \
        if (stream) _mm_sfence(); /* streamed lines are visible before the call returns */                \
        if (cb < cols) seen |= SCALAR(src + cb, dst + cb * dst_ld, rb, cols - cb, src_ld, dst_ld, mask);  \
        if (rb < rows) seen |= SCALAR(src + rb * src_ld, dst + rb, rows - rb, cols, src_ld, dst_ld, mask); \
        return mask && seen;                                                                              \
    }
#else
#define TRANSPOSE(NAME, SRC_T, DST_T, BLOCKED, SCALAR, STRIP, COLS)                                       \
    int NAME(const SRC_T *src, DST_T *dst, int64_t rows, int64_t cols, int64_t src_ld, int64_t dst_ld,      \
             int stream, uint32_t mask) {                                                                 \
        (void)stream;                                                                                     \
        return SCALAR(src, dst, rows, cols, src_ld, dst_ld, mask);                                        \
    }
#endif

TRANSPOSE(transpose_b32, uint32_t, uint32_t, blocked_b32, scalar_b32, F32_STRIP, F32_COLS)
TRANSPOSE(transpose_b16, uint16_t, uint16_t, blocked_b16, scalar_b16, B16_STRIP, B16_COLS)
TRANSPOSE(transpose_bf16_f32, uint16_t, float, blocked_bf16_f32, scalar_bf16_f32, F32_STRIP, F32_COLS)
TRANSPOSE(transpose_f32_bf16, float, uint16_t, blocked_f32_bf16, scalar_f32_bf16, B16_STRIP, F32_COLS)

/* Straight copies of n elements in memory order, converting like the transposes and checking the values
 * written against `mask` in the same pass (the compiler vectorizes the loop). */
#define STRAIGHT_COPY(NAME, SRC_T, DST_T, CONVERT, BITS_T)                                                \
    static int NAME(const SRC_T *restrict src, DST_T *restrict dst, int64_t n, uint32_t mask) {           \
        BITS_T seen = 0;                                                                                  \
        const BITS_T m = (BITS_T)mask;                                                                    \
        for (int64_t i = 0; i < n; i++) {                                                                 \
            DST_T v = CONVERT(src[i]);                                                                    \
            BITS_T bits;                                                                                  \
            memcpy(&bits, &v, sizeof bits);                                                               \
            seen |= (BITS_T)((bits & m) == m);                                                            \
            dst[i] = v;                                                                                   \
        }                                                                                                 \
        return mask && seen;                                                                              \
    }

STRAIGHT_COPY(cached_b32, uint32_t, uint32_t, IDENTITY, uint32_t)
STRAIGHT_COPY(cached_b16, uint16_t, uint16_t, IDENTITY, uint16_t)
STRAIGHT_COPY(cached_bf16_f32, uint16_t, float, bf16_to_f32, uint32_t)
STRAIGHT_COPY(cached_f32_bf16, float, uint16_t, f32_to_bf16, uint16_t)

/* ---- streaming straight copies ----
 * A destination nothing reads soon (a staging buffer, weights being written) is stored with non-temporal
 * stores: whole lines go to memory without first being read into the cache (a cached store reads every
 * destination line it does not hold: three memory transfers per line instead of two). In a refit of a
 * model larger than the cache, the line would be gone again before anything read it. STREAM_LINE bytes per
 * step (four 32-byte stores); the unaligned head and the tail take the cached copy. */
#define STREAM_LINE 128
#if defined(__AVX2__)
#define STREAMED_COPY(NAME, BITS_T, CACHED, SET1, CMPEQ)                                                  \
    static int NAME(const BITS_T *src, BITS_T *dst, int64_t n, uint32_t mask) {                           \
        const int64_t step = STREAM_LINE / sizeof(BITS_T), lane = STREAM_ALIGN / sizeof(BITS_T);           \
        int64_t head = (int64_t)((-(uintptr_t)dst) % STREAM_ALIGN) / (int64_t)sizeof(BITS_T);            \
        if (head > n) head = n;                                                                           \
        int seen = CACHED(src, dst, head, mask);                                                          \
        const __m256i m = SET1(mask);                                                                     \
        __m256i hit = _mm256_setzero_si256();                                                             \
        int64_t i = head;                                                                                 \
        for (; i + step <= n; i += step)                                                                  \
            for (int k = 0; k < STREAM_LINE / STREAM_ALIGN; k++) {                                        \
                __m256i x = _mm256_loadu_si256((const __m256i *)(src + i + k * lane));                    \
                hit = _mm256_or_si256(hit, CMPEQ(_mm256_and_si256(x, m), m));                             \
                _mm256_stream_si256((__m256i *)(dst + i + k * lane), x);                                  \
            }                                                                                             \
        _mm_sfence(); /* streamed lines are visible before the call returns */                            \
        seen |= CACHED(src + i, dst + i, n - i, mask);                                                    \
        return mask && (seen || !_mm256_testz_si256(hit, hit));                             \
    }

static inline __m256i set1_32(uint32_t mask) { return _mm256_set1_epi32((int)mask); }
static inline __m256i set1_16(uint32_t mask) { return _mm256_set1_epi16((short)mask); }
STREAMED_COPY(streamed_b32, uint32_t, cached_b32, set1_32, _mm256_cmpeq_epi32)
STREAMED_COPY(streamed_b16, uint16_t, cached_b16, set1_16, _mm256_cmpeq_epi16)
#else
#define streamed_b32 cached_b32
#define streamed_b16 cached_b16
#endif

/* The straight copies the Python side calls: `stream` picks streaming stores where they exist (the copies
 * that keep the bits); the converting ones always store through the cache. */
int copy_b32(const uint32_t *src, uint32_t *dst, int64_t n, uint32_t mask, int stream) {
    return stream ? streamed_b32(src, dst, n, mask) : cached_b32(src, dst, n, mask);
}
int copy_b16(const uint16_t *src, uint16_t *dst, int64_t n, uint32_t mask, int stream) {
    return stream ? streamed_b16(src, dst, n, mask) : cached_b16(src, dst, n, mask);
}
int copy_bf16_f32(const uint16_t *src, float *dst, int64_t n, uint32_t mask, int stream) {
    (void)stream;
    return cached_bf16_f32(src, dst, n, mask);
}
int copy_f32_bf16(const float *src, uint16_t *dst, int64_t n, uint32_t mask, int stream) {
    (void)stream;
    return cached_f32_bf16(src, dst, n, mask);
}

/* Raw bytes: dst[0 .. n) = src[...] with streaming stores. The unaligned head and the tail go through
 * memcpy. */
static void copy_streamed(const uint8_t *src, uint8_t *dst, int64_t n) {
#if defined(__AVX2__)
    int64_t head = (int64_t)((-(uintptr_t)dst) % STREAM_ALIGN);
    if (head > n) head = n;
    memcpy(dst, src, head);
    int64_t i = head;
    for (; i + STREAM_LINE <= n; i += STREAM_LINE)
        for (int k = 0; k < STREAM_LINE; k += STREAM_ALIGN)
            _mm256_stream_si256((__m256i *)(dst + i + k), _mm256_loadu_si256((const __m256i *)(src + i + k)));
    memcpy(dst + i, src + i, n - i);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}

/* count such copies in one call (a refit's commit of its staging buffers: one call for every tensor): copy
 * j takes nbytes[j] from address src[j] to address dst[j]. */
void copy_many_streamed(const int64_t *src, const int64_t *dst, const int64_t *nbytes, int64_t count) {
    for (int64_t j = 0; j < count; j++)
        copy_streamed((const uint8_t *)(uintptr_t)src[j], (uint8_t *)(uintptr_t)dst[j], nbytes[j]);
}

/* The value of block scale i: fp32 values, or ue8m0 bytes (2^(b - 127): the byte in an fp32 exponent field,
 * byte 0 giving 0.0 as dsv4.quant.e8m0_to_float32 does; the caller has refused the NaN byte). */
static inline float block_scale(const void *scale, int e8m0, int64_t i) {
    if (!e8m0) return ((const float *)scale)[i];
    uint32_t bits = (uint32_t)((const uint8_t *)scale)[i] << 23;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#if defined(__AVX2__)
/* Rows decoded per band of the vector path: a multiple of both transposes' strips (16 and 32 rows). */
#define DEQUANT_BAND 32

/* 8 e4m3fn codes -> their exact fp32 values: a normal code's exponent and mantissa placed in the fp32 fields
 * (exponent rebiased 7 -> 127), a subnormal's (exponent 0) value m * 2^-9, the sign bit moved to bit 31.
 * NaN codes (S.1111.111) decode to 480 here and are marked in *nan: the caller refuses them. */
static inline __m256 e4m3x8(const uint8_t *p, __m256i *nan) {
    __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
    *nan = _mm256_or_si256(*nan, _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F)));
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23)));
    __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.0f / 512));
    __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(_mm256_blendv_ps(normal, subnormal, is_subnormal), _mm256_castsi256_ps(sign));
}

/* Rows [r0, r0 + nr) of the dequantized matrix, row-major into out[nr][cols]: 8 codes a step times their
 * block's scale (b1 a multiple of 8: one scale per step), the ragged last columns through the table. Returns
 * whether a code was a NaN code. */
static int dequant_rows(const uint8_t *q, const void *scale, int e8m0, const float *lut, float *out, int64_t r0,
                        int64_t nr, int64_t cols, int64_t b0, int64_t b1, int64_t scale_cols) {
    __m256i nan = _mm256_setzero_si256();
    unsigned ragged_nan = 0;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *qr = q + (r0 + r) * cols;
        int64_t sr = ((r0 + r) / b0) * scale_cols;
        float *o = out + r * cols;
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8)
            _mm256_storeu_ps(o + c, _mm256_mul_ps(e4m3x8(qr + c, &nan), _mm256_set1_ps(block_scale(scale, e8m0, sr + c / b1))));
        for (; c < cols; c++) {
            ragged_nan |= (qr[c] & 0x7Fu) == 0x7Fu;
            o[c] = lut[qr[c]] * block_scale(scale, e8m0, sr + c / b1);
        }
    }
    return ragged_nan || !_mm256_testz_si256(nan, nan);
}

/* The vector path: band by band, decode DEQUANT_BAND rows into a buffer, then transpose them into the
 * destination with the register-block transposes (the values bit for bit those of the table walk: the same
 * fp32 product, the same bf16 rounding). -1 where it does not apply (b1 not a multiple of 8, no memory). */
#define DEQUANT_BANDED(NAME, DST_T, TRANSPOSE_F32)                                                         \
    static int NAME(const uint8_t *q, const void *scale, int e8m0, const float *lut, DST_T *dst, int64_t rows, \
                    int64_t cols, int64_t b0, int64_t b1, int64_t scale_cols, int64_t dst_ld) {              \
        if (b1 % 8 || cols <= 0) return -1;                                                               \
        float *band = malloc((size_t)(DEQUANT_BAND * cols) * sizeof(float));                              \
        if (!band) return -1;                                                                             \
        int nan = 0;                                                                                      \
        for (int64_t r0 = 0; r0 < rows; r0 += DEQUANT_BAND) {                                              \
            int64_t nr = r0 + DEQUANT_BAND < rows ? DEQUANT_BAND : rows - r0;                             \
            nan |= dequant_rows(q, scale, e8m0, lut, band, r0, nr, cols, b0, b1, scale_cols);             \
            TRANSPOSE_F32(band, dst + r0, nr, cols, cols, dst_ld, 0, 0);                                  \
        }                                                                                                 \
        free(band);                                                                                       \
        return nan;                                                                                       \
    }
#endif

/* value = lut[code] * scale[r / b0][c / b1], formed in fp32 (one rounding, as torch's product); q is
 * contiguous [rows, cols], scale contiguous [ceil(rows / b0), scale_cols] of fp32 values or (scale_e8m0)
 * ue8m0 bytes. When b1 is a multiple of TILE_COLS a run has one scale. Returns whether any code is an e4m3fn
 * NaN code (S.1111.111), checked in the same pass: a caller whose destination nothing reads yet (a fresh
 * load, a staging buffer) reads the codes once; the others check them before. */
#define DEQUANT_FP8(NAME, DST_T, STORE, VECTOR_DEQUANT)                                                                   \
    int NAME(const uint8_t *q, const void *scale, int scale_e8m0, const float *lut, DST_T *dst,           \
             int64_t rows, int64_t cols, int64_t b0, int64_t b1, int64_t scale_cols, int64_t dst_ld) {    \
        VECTOR_DEQUANT                                                                                    \
        const uint32_t mask = 0; /* the caller bounds the products instead (codes and scales checked) */  \
        int seen = 0;                                                                                     \
        unsigned nan_codes = 0;                                                                           \
        (void)seen;                                                                                       \
        TILED(DST_T, const uint8_t *qr = q + (r0 + r) * cols + c0;                                        \
              int64_t sr = ((r0 + r) / b0) * scale_cols;                                                  \
              for (int64_t c = 0; c < nc; c++) nan_codes |= (qr[c] & 0x7Fu) == 0x7Fu;                    \
              if (b1 % TILE_COLS == 0) {                                                                  \
                  float sv = block_scale(scale, scale_e8m0, sr + c0 / b1);                                \
                  for (int64_t c = 0; c < nc; c++) col[c * TILE_ROWS] = STORE(lut[qr[c]] * sv);           \
              } else {                                                                                    \
                  for (int64_t c = 0; c < nc; c++)                                                        \
                      col[c * TILE_ROWS] = STORE(lut[qr[c]] * block_scale(scale, scale_e8m0, sr + (c0 + c) / b1)); \
              })                                                                                          \
        return nan_codes != 0;                                                                            \
    }

#if defined(__AVX2__)
static int transpose_b32_f(const float *src, float *dst, int64_t rows, int64_t cols, int64_t src_ld, int64_t dst_ld,
                           int stream, uint32_t mask) {
    return transpose_b32((const uint32_t *)src, (uint32_t *)dst, rows, cols, src_ld, dst_ld, stream, mask);
}

DEQUANT_BANDED(banded_fp8_f32, float, transpose_b32_f)
DEQUANT_BANDED(banded_fp8_bf16, uint16_t, transpose_f32_bf16)

/* The value of code q[r * cols + c] (as the table walk forms it), stored at dst[c * dst_ld + r], for the rows
 * [r0, r1) and columns [c0, c1): the ragged edges of `direct_fp8_f32`. Returns whether a code was a NaN code. */
static int dequant_edge_f32(const uint8_t *q, const void *scale, int e8m0, const float *lut, float *dst,
                            int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t cols, int64_t b0, int64_t b1,
                            int64_t scale_cols, int64_t dst_ld) {
    unsigned nan_codes = 0;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *qr = q + r * cols;
        int64_t sr = (r / b0) * scale_cols;
        for (int64_t c = c0; c < c1; c++) {
            nan_codes |= (qr[c] & 0x7Fu) == 0x7Fu;
            dst[c * dst_ld + r] = lut[qr[c]] * block_scale(scale, e8m0, sr + c / b1);
        }
    }
    return nan_codes != 0;
}

/* FP8 codes into an fp32 input-major weight in one pass, no intermediate buffer: a block of 16 rows x 8
 * columns of codes is decoded in registers (two 8x8 fp32 blocks times their one block scale: b0 a multiple
 * of 16, b1 of 8), transposed there, and stored as one 64-byte run into each of its 8 destination rows.
 * Panel by panel (PANEL_ROWS x PANEL_COLS codes, 8 KiB: its source lines stay in L1), column block by column
 * block, and down the panel's rows inside each: the 8 destination rows of a column block are then written
 * as runs of PANEL_ROWS contiguous values, which the hardware prefetches for, where a walk along the columns
 * stored to 8 new rows a destination stride apart at every step (a 2-4 KiB stride for the benchmark models'
 * 512-1024-row linears, all in a few cache sets: 1.5-2.3x slower on those, the same on short ones). The banded
 * path decoded rows into a buffer, copied them into the transposes' strip buffer and transposed from there
 * (~2x the time on the benchmark models' linears). The values are the same fp32 products, bit for bit. -1
 * where it does not apply (the block sizes). */
static int direct_fp8_f32(const uint8_t *q, const void *scale, int e8m0, const float *lut, float *dst,
                          int64_t rows, int64_t cols, int64_t b0, int64_t b1, int64_t scale_cols, int64_t dst_ld) {
    if (b0 % F32_STRIP || b1 % F32_COLS) return -1;
    int64_t rb = rows - rows % F32_STRIP, cb = cols - cols % F32_COLS;
    __m256i nan = _mm256_setzero_si256();
    for (int64_t r0 = 0; r0 < rb; r0 += PANEL_ROWS) {
        int64_t r1 = r0 + PANEL_ROWS < rb ? r0 + PANEL_ROWS : rb;
        for (int64_t c0 = 0; c0 < cb; c0 += PANEL_COLS) {
            int64_t c1 = c0 + PANEL_COLS < cb ? c0 + PANEL_COLS : cb;
            for (int64_t c = c0; c < c1; c += F32_COLS) {
                for (int64_t r = r0; r < r1; r += F32_STRIP) {
                    const uint8_t *qr = q + r * cols;
                    __m256 s = _mm256_set1_ps(block_scale(scale, e8m0, (r / b0) * scale_cols + c / b1));
                    __m256 lo[8], hi[8];
                    for (int i = 0; i < 8; i++) {
                        lo[i] = _mm256_mul_ps(e4m3x8(qr + i * cols + c, &nan), s);
                        hi[i] = _mm256_mul_ps(e4m3x8(qr + (8 + i) * cols + c, &nan), s);
                    }
                    transpose8_ps(lo);
                    transpose8_ps(hi);
                    for (int i = 0; i < 8; i++) {
                        float *d = dst + (c + i) * dst_ld + r;
                        _mm256_storeu_ps(d, lo[i]);
                        _mm256_storeu_ps(d + 8, hi[i]);
                    }
                }
            }
        }
    }
    int edge = dequant_edge_f32(q, scale, e8m0, lut, dst, 0, rb, cb, cols, cols, b0, b1, scale_cols, dst_ld);
    edge |= dequant_edge_f32(q, scale, e8m0, lut, dst, rb, rows, 0, cols, cols, b0, b1, scale_cols, dst_ld);
    return edge || !_mm256_testz_si256(nan, nan);
}

#define VECTOR_F32                                                                                        \
    int direct = direct_fp8_f32(q, scale, scale_e8m0, lut, dst, rows, cols, b0, b1, scale_cols, dst_ld);  \
    if (direct >= 0) return direct;                                                                       \
    int banded = banded_fp8_f32(q, scale, scale_e8m0, lut, dst, rows, cols, b0, b1, scale_cols, dst_ld);  \
    if (banded >= 0) return banded;
#define VECTOR_BF16                                                                                       \
    int banded = banded_fp8_bf16(q, scale, scale_e8m0, lut, dst, rows, cols, b0, b1, scale_cols, dst_ld); \
    if (banded >= 0) return banded;
#else
#define VECTOR_F32
#define VECTOR_BF16
#endif

DEQUANT_FP8(dequant_fp8_f32, float, IDENTITY, VECTOR_F32)
DEQUANT_FP8(dequant_fp8_bf16, uint16_t, f32_to_bf16, VECTOR_BF16)
