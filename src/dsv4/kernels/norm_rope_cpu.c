/* RMSNorm and/or interleaved RoPE in place on CPU (kernels/norm_rope_cpu.py). */
#include "rows.h"
#include "packed_call.h"

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
        if (rh > 0) rope_angles(pos[t], inv_freq, rh, inverse, cs, sn);
        for (long g = 0; g < G; ++g) {
            const long offset = (t * G + g) * hd;
            float *restrict v = bf16 ? scratch : (float *)x + offset;
            if (bf16) load_row(x, 1, offset, hd, scratch);
            norm_rope_row(v, hd, eps, w, cs, sn, rh);
            if (bf16) store_row(x, 1, offset, v, hd);
        }
    }
    free(scratch);
    return 0;
}

/* Each replayable kernel's twin taking its arguments from a block, and their letters (packed_call.h). */
const char *const norm_rope_signature = "pilllfpppli";
int norm_rope_packed(const packed_arg *a) {
    return norm_rope(a[0].p, a[1].i, a[2].l, a[3].l, a[4].l, a[5].f, a[6].p, a[7].p, a[8].p, a[9].l, a[10].i);
}
