/* Copies into input-major resident weights (dest = the transpose of a contiguous [cols, rows] buffer) from
 * row-major [rows, cols] values, tile by tile so that both sides stay in L1: torch's strided copy of a whole
 * transposed matrix runs ~10-20x a memcpy on CPU. Optionally converts dtype (bf16 <-> fp32, rounding to
 * nearest even like torch) or dequantizes FP8 e4m3 codes with their block scales in the same pass.
 *
 * dst[c * dst_ld + r] = f(src[r * src_ld + c]) for r < rows, c < cols.
 */
#include <stdint.h>
#include <string.h>

#include "rows.h" /* bf16_to_f32, f32_to_bf16 (torch's rounding): the kernels' shared helpers */

/* A tile of TILE_ROWS source rows x TILE_COLS columns (two cache lines of fp32) is read run by run into a
 * local buffer, transposed there, and written out as TILE_COLS contiguous runs of TILE_ROWS destination
 * elements. Each source run is used whole the one time it is read, so rows a power of two apart (the same
 * L1 set) cannot thrash as a direct tile walk does; the buffer (16 KiB of fp32) stays in L1. Sizes from a
 * sweep on the development VM (256x16 to 16x16): 128x32 was best or close on 1-16 MiB matrices. */
#define TILE_ROWS 128
#define TILE_COLS 32

#define IDENTITY(x) (x)

/* The tile walk every kernel shares: for each source row r of a tile (rows r0 + r, columns c0 .. c0 + nc),
 * FILL_RUN stores the run's converted values at col[c * TILE_ROWS]; then the tile's columns are written
 * out as contiguous runs of the destination. */
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
            for (int64_t c = 0; c < nc; c++)                                                              \
                memcpy(dst + (c0 + c) * dst_ld + r0, buf + c * TILE_ROWS, nr * sizeof(DST_T));            \
        }                                                                                                 \
    }

#define TRANSPOSE(NAME, SRC_T, DST_T, CONVERT)                                                            \
    void NAME(const SRC_T *src, DST_T *dst, int64_t rows, int64_t cols, int64_t src_ld, int64_t dst_ld) {   \
        TILED(DST_T, const SRC_T *s = src + (r0 + r) * src_ld + c0;                                       \
              for (int64_t c = 0; c < nc; c++) col[c * TILE_ROWS] = CONVERT(s[c]);)                       \
    }

TRANSPOSE(transpose_b32, uint32_t, uint32_t, IDENTITY)
TRANSPOSE(transpose_b16, uint16_t, uint16_t, IDENTITY)
TRANSPOSE(transpose_bf16_f32, uint16_t, float, bf16_to_f32)
TRANSPOSE(transpose_f32_bf16, float, uint16_t, f32_to_bf16)

/* value = lut[code] * scale[r / b0][c / b1], formed in fp32 (one rounding, as torch's product); q is
 * contiguous [rows, cols], scale contiguous [ceil(rows / b0), scale_cols]. When b1 is a multiple of
 * TILE_COLS a run has one scale. */
#define DEQUANT_FP8(NAME, DST_T, STORE)                                                                   \
    void NAME(const uint8_t *q, const float *scale, const float *lut, DST_T *dst, int64_t rows,           \
              int64_t cols, int64_t b0, int64_t b1, int64_t scale_cols, int64_t dst_ld) {                 \
        TILED(DST_T, const uint8_t *qr = q + (r0 + r) * cols + c0;                                        \
              const float *sr = scale + ((r0 + r) / b0) * scale_cols;                                     \
              if (b1 % TILE_COLS == 0) {                                                                  \
                  float sv = sr[c0 / b1];                                                                 \
                  for (int64_t c = 0; c < nc; c++) col[c * TILE_ROWS] = STORE(lut[qr[c]] * sv);           \
              } else {                                                                                    \
                  for (int64_t c = 0; c < nc; c++) col[c * TILE_ROWS] = STORE(lut[qr[c]] * sr[(c0 + c) / b1]); \
              })                                                                                          \
    }

DEQUANT_FP8(dequant_fp8_f32, float, IDENTITY)
DEQUANT_FP8(dequant_fp8_bf16, uint16_t, f32_to_bf16)
