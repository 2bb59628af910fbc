/* Single-token decode rows of one attention layer on CPU (kernels/decode_attention_cpu.py): the compressor
   rings and the entries they complete (`compress_decode`), then the window ring write, the indexer's top-k
   and the attention over window keys, entries and the sink (`attend_decode`). The formulas are
   model/attention.py's (`Compressor.emit`, `Indexer.select`, `Attention._attend_decode`), the reference these
   are tested against (tests/test_kernels_attention.py). The arithmetic is fp32; rows and caches are fp32 or
   bf16 (`bf16`): widened on load, rounded once on store, and rounded to bf16 where the torch path rounds (the
   pooled entry, each q.k product, each probability). */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "rows.h"
#include "packed_call.h"

/* Element i of an fp32 or bf16 tensor, as fp32. */
static inline float element(const void *base, int bf16, long i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* n elements of an fp32 or bf16 tensor from `offset` into dst, as fp32. */
static void load_into(float *restrict dst, const void *base, int bf16, long offset, long n) {
    if (!bf16) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)base + offset;
    for (long i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
}

/* bf16 rows: x rounded to bf16 and back (where the torch path rounds a product or a probability), else x. */
static inline float rounded(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

/* Per row b (cache slot slots[b], position pos[b]): the raw projections kv, gate [B, width] go to ring row
   pos % R of ring_kv / ring_gate [S, R, width]; a row whose token completes window w = pos / m (pos + 1 a
   multiple of m) pools it into entries [S, E_max, d] at index w: per channel, a softmax over the window's
   slots of gate + ape weighs their kv. Overlapping (width = 2d, R = 2m): slots are the Ca halves (channels
   [0, d)) of window w - 1's tokens, then the Cb halves ([d, 2d)) of window w's, with ape [m, 2d] split
   alike; window 0 has no Ca slots. Otherwise (width = d, R = m): window w's tokens, ape [m, d]. The entry
   is RMS-normed (weight norm_w, eps) and rotated at position w * m (inv_freq [rh]). Returns 0, or 1 when the
   scratch cannot be allocated. */
int compress_decode(long B, int bf16, const long *slots, const long *pos, const void *kv, const void *gate,
                    void *ring_kv, void *ring_gate, long R, long width, const float *ape, long m, int overlap,
                    const float *norm_w, float eps, const float *inv_freq, long rh, void *entries, long max_entries,
                    long d) {
    const long S = overlap ? 2 * m : m;
    const size_t elem = bf16 ? sizeof(uint16_t) : sizeof(float);
    float *scratch = malloc((size_t)(d + 2 * S) * sizeof(float));
    if (!scratch) return 1;
    float *entry = scratch, *logit = scratch + d, *value = scratch + d + S;
    float cs[512], sn[512];
    for (long b = 0; b < B; ++b) {
        const long p = pos[b], slot_ring = slots[b] * R * width;
        const size_t row_bytes = (size_t)width * elem;
        memcpy((char *)ring_kv + (slot_ring + (p % R) * width) * elem, (const char *)kv + b * row_bytes, row_bytes);
        memcpy((char *)ring_gate + (slot_ring + (p % R) * width) * elem, (const char *)gate + b * row_bytes, row_bytes);
        if ((p + 1) % m != 0) continue;
        const long w = p / m;
        const long first_slot = overlap && w == 0 ? m : 0; /* window 0: no previous window's Ca slots */
        for (long c = 0; c < d; ++c) {
            float most = -INFINITY;
            for (long s = first_slot; s < S; ++s) {
                const long offset = overlap ? s - m : s;   /* from the window's first position */
                const long half = overlap && s >= m ? d : 0; /* Cb half for the window's own tokens */
                const long ape_row = overlap ? (s < m ? s : s - m) : s;
                const long at = slot_ring + ((w * m + offset) % R) * width + half + c;
                value[s] = element(ring_kv, bf16, at);
                logit[s] = element(ring_gate, bf16, at) + ape[ape_row * width + half + c];
                if (logit[s] > most) most = logit[s];
            }
            float total = 0.0f;
            for (long s = first_slot; s < S; ++s) {
                logit[s] = expf(logit[s] - most);
                total += logit[s];
            }
            float pooled = 0.0f;
            for (long s = first_slot; s < S; ++s) pooled += value[s] * (logit[s] / total);
            entry[c] = bf16 ? bf16_to_f32(f32_to_bf16(pooled)) : pooled; /* the pooled entry in the cache dtype */
        }
        rope_angles(w * m, inv_freq, rh, 0, cs, sn);
        norm_rope_row(entry, d, eps, norm_w, cs, sn, rh);
        if (w < max_entries) store_row(entries, bf16, (slots[b] * max_entries + w) * d, entry, d);
    }
    free(scratch);
    return 0;
}

/* The heap order of the indexer's top-k: a ranks below b when its score is lower, or equal with a higher
   index (among tied scores the lowest indices are taken, as `top_k_lowest_index_on_ties` does). */
static int ranks_below(const float *score, long a, long b) {
    return score[a] < score[b] || (score[a] == score[b] && a > b);
}

/* chosen[s] = 1 for the k best of score[0, n) (heap of the k best, its root the lowest ranked). */
static void top_k(const float *score, long n, long k, long *heap, char *chosen) {
    memset(chosen, 0, (size_t)n);
    if (k <= 0) return;
    long size = 0;
    for (long s = 0; s < n; ++s) {
        long at;
        if (size < k) { /* sift up */
            at = size++;
            while (at > 0 && ranks_below(score, s, heap[(at - 1) / 2])) {
                heap[at] = heap[(at - 1) / 2];
                at = (at - 1) / 2;
            }
            heap[at] = s;
            continue;
        }
        if (!ranks_below(score, heap[0], s)) continue;
        at = 0; /* replace the root, sift down */
        for (;;) {
            long child = 2 * at + 1;
            if (child >= k) break;
            if (child + 1 < k && ranks_below(score, heap[child + 1], heap[child])) ++child;
            if (!ranks_below(score, heap[child], s)) break;
            heap[at] = heap[child];
            at = child;
        }
        heap[at] = s;
    }
    for (long i = 0; i < size; ++i) chosen[heap[i]] = 1;
}

/* logits[h * ld + i] = dot(q_h, key_i) (dot.h's dot product, bit for bit) for every head h < H of q [H, hd] and
   key i < N of keys [N, hd]. With AVX-512 and hd a multiple of 16, sixteen keys at a time per head: each key's
   sixteen lane sums in a register of its own (the dot product's partial sums), then the sixteen registers
   folded into one vector of the sixteen keys' sums in the dot product's pairwise order (lanes l + 8, l + 4,
   l + 2, l + 1), where a dot product per (head, key) paid a horizontal sum each: on the small config ~6x the
   arithmetic of the logits. */
static void head_logits(const float *restrict q, const float *restrict keys, long N, long H, long hd, long ld,
                        float *restrict logits) {
#if defined(__AVX512F__)
    if (hd % ACC == 0 && ACC == 16) {
        /* where the fold leaves key k: lane 4 * (k % 4) + k / 4 */
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        for (long h = 0; h < H; ++h) {
            const float *qh = q + h * hd;
            for (long i0 = 0; i0 < N; i0 += 16) {
                const long n = N - i0 < 16 ? N - i0 : 16;
                __m512 s[16];
                for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
                for (long c = 0; c < hd; c += 16) {
                    const __m512 qc = _mm512_loadu_ps(qh + c);
                    for (int j = 0; j < 16; ++j)
                        if (j < n) s[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(keys + (i0 + j) * hd + c), s[j]);
                }
                __m512 u[8], v[4];
                for (int k = 0; k < 8; ++k) /* [key 2k | key 2k+1], each its lanes l + l+8 */
                    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0x44),
                                         _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0xEE));
                for (int m = 0; m < 4; ++m) /* keys 4m .. 4m+3 a 128-bit lane each, lanes l + l+4 */
                    v[m] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0x88),
                                         _mm512_shuffle_f32x4(u[2 * m], u[2 * m + 1], 0xDD));
                const __m512 w0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
                const __m512 w1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
                const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(1, 0, 1, 0)),
                                                  _mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(3, 2, 3, 2)));
                _mm512_mask_storeu_ps(logits + h * ld + i0, (__mmask16)((1u << n) - 1),
                                      _mm512_permutexvar_ps(order, sums));
            }
        }
        return;
    }
#endif
    for (long h = 0; h < H; ++h)
        for (long i = 0; i < N; ++i) logits[h * ld + i] = dot(q + h * hd, keys + i * hd, hd);
}

/* o[c] = sum_i w[i] keys[i, c] over keys [N, hd], summed in key order from zero (a fused multiply-add per key
   where the CPU has them). With AVX-512, up to 64 columns' sums stay in four registers over every key; summed into
   o key by key, they were a load and a store per key (~40% of the small config's attention). */
static void weighted_keys(float *restrict o, const float *restrict keys, const float *restrict w, long N, long hd) {
    long c0 = 0;
#if defined(__AVX512F__)
    for (; c0 + 64 <= hd; c0 += 64) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (long i = 0; i < N; ++i) {
            const __m512 wi = _mm512_set1_ps(w[i]);
            const float *k = keys + i * hd + c0;
            a0 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(k), a0);
            a1 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(k + 16), a1);
            a2 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(k + 32), a2);
            a3 = _mm512_fmadd_ps(wi, _mm512_loadu_ps(k + 48), a3);
        }
        _mm512_storeu_ps(o + c0, a0), _mm512_storeu_ps(o + c0 + 16, a1);
        _mm512_storeu_ps(o + c0 + 32, a2), _mm512_storeu_ps(o + c0 + 48, a3);
    }
    for (; c0 + 16 <= hd; c0 += 16) {
        __m512 a = _mm512_setzero_ps();
        for (long i = 0; i < N; ++i) a = _mm512_fmadd_ps(_mm512_set1_ps(w[i]), _mm512_loadu_ps(keys + i * hd + c0), a);
        _mm512_storeu_ps(o + c0, a);
    }
#endif
    if (c0 < hd) {
        memset(o + c0, 0, (size_t)(hd - c0) * sizeof(float));
        for (long i = 0; i < N; ++i)
            for (long c = c0; c < hd; ++c) o[c] += w[i] * keys[i * hd + c];
    }
}

/* The attention of a call's rows: its arguments (`attend_decode`'s). */
typedef struct {
    long B, H, hd, W, max_entries, rate, nI, dI, topk;
    int bf16;
    const long *slots, *pos;
    const void *q, *kv, *entries, *index_q, *index_w, *index_entries;
    void *window, *out;
    const float *sink;
} attend_job;

/* Rows [b0, b1) of `attend_decode`; 1 when the scratch cannot be allocated. Rows touch only their own slots'
   window rows and outputs, so row ranges run in parallel. */
static int attend_rows(const void *job, long b0, long b1) {
    const attend_job *j = job;
    const long W = j->W, hd = j->hd, H = j->H, nI = j->nI, dI = j->dI, rate = j->rate, max_entries = j->max_entries;
    const int bf16 = j->bf16;
    const long *slots = j->slots, *pos = j->pos;
    const void *entries = j->entries, *index_q = j->index_q;
    long most_entries = 0;
    for (long b = b0; b < b1; ++b) {
        const long n = entries ? (pos[b] + 1) / rate : 0;
        if (n > most_entries) most_entries = n < max_entries ? n : max_entries;
    }
    const long keys_max = W + most_entries;
    /* logits [H, keys_max] | scores [most_entries] | keys [keys_max, hd] (fp32 copies) | q [H, hd], out | index
       q rows, index keys [most_entries, dI] (bf16 widened), their dot products [nI, most_entries], head weights */
    const size_t floats = (size_t)H * keys_max + most_entries + (size_t)keys_max * hd + (size_t)(H + 1) * hd +
                          (size_t)nI * dI + (size_t)most_entries * dI + (size_t)nI * most_entries + nI;
    float *logits = malloc(floats * sizeof(float));
    long *heap = malloc((size_t)(j->topk > 0 ? j->topk : 1) * sizeof(long));
    char *chosen = malloc((size_t)(most_entries > 0 ? most_entries : 1));
    if (!logits || !heap || !chosen) {
        free(logits), free(heap), free(chosen);
        return 1;
    }
    float *score = logits + H * keys_max, *keys = score + most_entries, *qs = keys + keys_max * hd, *o = qs + H * hd;
    float *iq = o + hd, *ik = iq + nI * dI, *index_dots = ik + most_entries * dI, *iw = index_dots + nI * most_entries;
    const float scale = 1.0f / sqrtf((float)hd);
    for (long b = b0; b < b1; ++b) {
        const long p = pos[b], slot = slots[b];
        const long ring = slot * W * hd;
        store_row(j->window, bf16, ring + (p % W) * hd, load_row(j->kv, bf16, b * hd, hd, keys), hd);
        long N = 0; /* ring row i holds position p - ((p - i) mod W): written once that is >= 0 */
        for (long i = 0; i < W && i <= p; ++i, ++N)
            load_into(keys + N * hd, j->window, bf16, ring + i * hd, hd);
        long n = entries ? (p + 1) / rate : 0;
        if (n > max_entries) n = max_entries;
        const long slot_entries = slot * max_entries * hd;
        if (n > 0 && index_q) {
            const float head_scale = 1.0f / sqrtf((float)nI), dim_scale = 1.0f / sqrtf((float)dI);
            load_into(iq, index_q, bf16, b * nI * dI, nI * dI);
            load_into(iw, j->index_w, bf16, b * nI, nI);
            /* the slot's first n index entries [n, dI], widened where bf16 */
            const float *index_keys = load_row(j->index_entries, bf16, slot * max_entries * dI, n * dI, ik);
            head_logits(iq, index_keys, n, nI, dI, most_entries, index_dots);
            for (long s = 0; s < n; ++s) {
                float total = 0.0f;
                for (long h = 0; h < nI; ++h) {
                    const float relu = fmaxf(index_dots[h * most_entries + s], 0.0f);
                    total += (relu * dim_scale) * (iw[h] * head_scale);
                }
                score[s] = total;
            }
            top_k(score, n, j->topk < n ? j->topk : n, heap, chosen);
        }
        for (long s = 0; s < n; ++s) {
            if (index_q && !chosen[s]) continue;
            float *row = keys + N++ * hd;
            load_into(row, entries, bf16, slot_entries + s * hd, hd);
        }
        load_into(qs, j->q, bf16, b * H * hd, H * hd);
        head_logits(qs, keys, N, H, hd, keys_max, logits);
        for (long h = 0; h < H; ++h) {
            float *lh = logits + h * keys_max;
            float most = j->sink[h];
            for (long i = 0; i < N; ++i) {
                lh[i] = rounded(lh[i], bf16) * scale;
                if (lh[i] > most) most = lh[i];
            }
            float total = expf(j->sink[h] - most);
            for (long i = 0; i < N; ++i) {
                lh[i] = expf(lh[i] - most);
                total += lh[i];
            }
            for (long i = 0; i < N; ++i) lh[i] = rounded(lh[i] / total, bf16); /* the probabilities */
            weighted_keys(o, keys, lh, N, hd);
            store_row(j->out, bf16, (b * H + h) * hd, o, hd);
        }
    }
    free(logits), free(heap), free(chosen);
    return 0;
}

/* Per row b: kv [B, hd] goes to window ring row pos % W of window [S, W, hd]; then each head of q [B, H, hd]
   attends, with scale hd^-0.5 and a sink logit sink[h] (no value), to the ring rows holding positions
   (pos - W, pos] and to the n = (pos + 1) / rate complete entries of entries [S, E_max, hd] (NULL: a
   sliding layer), or, with an indexer (index_q [B, nI, dI], index_w [B, nI], index_entries [S, E_max, dI];
   NULL: none), to the min(topk, n) entries it picks: score[s] = sum_h relu(q_h . K_s) dI^-0.5 w_h nI^-0.5.
   out [B, H, hd]. Rows are spread over `nthreads` threads of `pool` by `run` (the gemv library's `pool_for`;
   NULL: the caller's thread alone); a row's arithmetic is the same wherever it runs. Rows must be of distinct
   slots (a decode step's: one row per sequence). Returns 0, or 1 when a scratch cannot be allocated. */
int attend_decode(long B, int bf16, long H, long hd, const long *slots, const long *pos, const void *q,
                  const void *kv, void *window, long W, const void *entries, long max_entries, long rate,
                  const void *index_q, const void *index_w, const void *index_entries, long nI, long dI, long topk,
                  const float *sink, void *out, void *pool, pool_for_fn run, int nthreads) {
    attend_job job = {.B = B, .H = H, .hd = hd, .W = W, .max_entries = max_entries, .rate = rate, .nI = nI, .dI = dI,
                      .topk = topk, .bf16 = bf16, .slots = slots, .pos = pos, .q = q, .kv = kv, .entries = entries,
                      .index_q = index_q, .index_w = index_w, .index_entries = index_entries, .window = window,
                      .out = out, .sink = sink};
    return run_rows(attend_rows, &job, B, pool, run, nthreads);
}

/* Each replayable kernel's twin taking its arguments from a block, and their letters (packed_call.h). */
const char *const compress_decode_signature = "lippppppllplipfplpll";
int compress_decode_packed(const packed_arg *a) {
    return compress_decode(a[0].l, a[1].i, a[2].p, a[3].p, a[4].p, a[5].p, a[6].p, a[7].p, a[8].l, a[9].l, a[10].p,
                           a[11].l, a[12].i, a[13].p, a[14].f, a[15].p, a[16].l, a[17].p, a[18].l, a[19].l);
}
const char *const attend_decode_signature = "lillppppplpllppplllppppi";
int attend_decode_packed(const packed_arg *a) {
    return attend_decode(a[0].l, a[1].i, a[2].l, a[3].l, a[4].p, a[5].p, a[6].p, a[7].p, a[8].p, a[9].l, a[10].p,
                         a[11].l, a[12].l, a[13].p, a[14].p, a[15].p, a[16].l, a[17].l, a[18].l, a[19].p, a[20].p,
                         a[21].p, (pool_for_fn)a[22].p, a[23].i);
}
