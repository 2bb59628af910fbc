/* The fp32 dot product of the C kernels (rows.h's users, gemv_cpu.c's portable path): one definition, so
   every kernel that sums a product sums it in the same order. */
#ifndef DSV4_DOT_H
#define DSV4_DOT_H

/* Partial sums per reduction: 16 independent accumulators fill four SSE / two AVX / one AVX-512 vector
   and hide the add latency, so a sum over D runs at load speed instead of one dependent add per element.
   (A sum therefore rounds in another order than a sequential one: fp32-rounding level.) */
#define ACC 16

static inline float dot(const float *restrict a, const float *restrict b, long n) {
    float acc[ACC] = {0.0f};
    long i = 0;
    for (; i + ACC <= n; i += ACC)
        for (int l = 0; l < ACC; ++l) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
    for (int w = ACC / 2; w > 0; w /= 2) /* pairwise: log2(ACC) vector adds */
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

#endif
