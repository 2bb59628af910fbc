/* bf16 <-> fp32 of the C kernels (rows.h's users and gemv_cpu.c): one definition, so every kernel widens and
   rounds bf16 as torch does. */
#ifndef DSV4_BF16_H
#define DSV4_BF16_H

#include <stdint.h>
#include <string.h>

/* Exact: bf16 is fp32's top half. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch's `.to(torch.bfloat16)` (NaN -> 0x7FC0). */
static inline uint16_t f32_to_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* `v` rounded to bf16's precision, kept as fp32. */
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

#endif
