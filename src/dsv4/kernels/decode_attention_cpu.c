/* Single-token decode rows of one attention layer on CPU (kernels/decode_attention_cpu.py): the compressor
   rings and the entries they complete (`compress_decode`), then the window ring write, the indexer's top-k
   and the attention over window keys, entries and the sink (`attend_decode`). fp32 throughout. The formulas
   are model/attention.py's (`Compressor.emit`, `Indexer.select`, `Attention._attend_decode`), the reference
   these are tested against (tests/test_decode_attention.py). */
#include "rows.h"

/* Dot product with ACC independent partial sums (vectorisable without reassociation). */
static float dot(const float *restrict a, const float *restrict b, long n) {
    float acc[ACC] = {0.0f};
    long i = 0;
    for (; i + ACC <= n; i += ACC)
        for (int l = 0; l < ACC; ++l) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
    for (int w = ACC / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

/* Per row b (cache slot slots[b], position pos[b]): the raw projections kv, gate [B, width] go to ring row
   pos % R of ring_kv / ring_gate [S, R, width]; a row whose token completes window w = pos / m (pos + 1 a
   multiple of m) pools it into entries [S, E_max, d] at index w: per channel, a softmax over the window's
   slots of gate + ape weighs their kv. Overlapping (width = 2d, R = 2m): slots are the Ca halves (channels
   [0, d)) of window w - 1's tokens, then the Cb halves ([d, 2d)) of window w's, with ape [m, 2d] split
   alike; window 0 has no Ca slots. Otherwise (width = d, R = m): window w's tokens, ape [m, d]. The entry
   is RMS-normed (weight norm_w, eps) and rotated at position w * m (inv_freq [rh]). Returns 0, or 1 when the
   scratch cannot be allocated. */
int compress_decode(long B, const long *slots, const long *pos, const float *kv, const float *gate,
                    float *ring_kv, float *ring_gate, long R, long width, const float *ape, long m, int overlap,
                    const float *norm_w, float eps, const float *inv_freq, long rh, float *entries, long max_entries,
                    long d) {
    const long S = overlap ? 2 * m : m;
    float *scratch = malloc((size_t)(d + 2 * S) * sizeof(float));
    if (!scratch) return 1;
    float *entry = scratch, *logit = scratch + d, *value = scratch + d + S;
    float cs[512], sn[512];
    for (long b = 0; b < B; ++b) {
        const long p = pos[b], slot_ring = slots[b] * R * width;
        memcpy(ring_kv + slot_ring + (p % R) * width, kv + b * width, width * sizeof(float));
        memcpy(ring_gate + slot_ring + (p % R) * width, gate + b * width, width * sizeof(float));
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
                value[s] = ring_kv[at];
                logit[s] = ring_gate[at] + ape[ape_row * width + half + c];
                if (logit[s] > most) most = logit[s];
            }
            float total = 0.0f;
            for (long s = first_slot; s < S; ++s) {
                logit[s] = expf(logit[s] - most);
                total += logit[s];
            }
            float pooled = 0.0f;
            for (long s = first_slot; s < S; ++s) pooled += value[s] * (logit[s] / total);
            entry[c] = pooled;
        }
        rope_angles(w * m, inv_freq, rh, 0, cs, sn);
        norm_rope_row(entry, d, eps, norm_w, cs, sn, rh);
        if (w < max_entries) memcpy(entries + (slots[b] * max_entries + w) * d, entry, d * sizeof(float));
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

/* Per row b: kv [B, hd] goes to window ring row pos % W of window [S, W, hd]; then each head of q [B, H, hd]
   attends, with scale hd^-0.5 and a sink logit sink[h] (no value), to the ring rows holding positions
   (pos - W, pos] and to the n = (pos + 1) / rate complete entries of entries [S, E_max, hd] (NULL: a
   sliding layer), or, with an indexer (index_q [B, nI, dI], index_w [B, nI], index_entries [S, E_max, dI];
   NULL: none), to the min(topk, n) entries it picks: score[s] = sum_h relu(q_h . K_s) dI^-0.5 w_h nI^-0.5.
   out [B, H, hd]. Returns 0, or 1 when the scratch cannot be allocated. */
int attend_decode(long B, long H, long hd, const long *slots, const long *pos, const float *q, const float *kv,
                  float *window, long W, const float *entries, long max_entries, long rate, const float *index_q,
                  const float *index_w, const float *index_entries, long nI, long dI, long topk, const float *sink,
                  float *out) {
    long most_entries = 0;
    for (long b = 0; b < B; ++b) {
        const long n = entries ? (pos[b] + 1) / rate : 0;
        if (n > most_entries) most_entries = n < max_entries ? n : max_entries;
    }
    const long keys_max = W + most_entries;
    float *logits = malloc((size_t)(keys_max + most_entries) * sizeof(float));
    const float **keys = malloc((size_t)keys_max * sizeof(float *));
    long *heap = malloc((size_t)(topk > 0 ? topk : 1) * sizeof(long));
    char *chosen = malloc((size_t)(most_entries > 0 ? most_entries : 1));
    if (!logits || !keys || !heap || !chosen) {
        free(logits), free(keys), free(heap), free(chosen);
        return 1;
    }
    float *score = logits + keys_max;
    const float scale = 1.0f / sqrtf((float)hd);
    for (long b = 0; b < B; ++b) {
        const long p = pos[b], slot = slots[b];
        float *ring = window + slot * W * hd;
        memcpy(ring + (p % W) * hd, kv + b * hd, hd * sizeof(float));
        long N = 0; /* ring row i holds position p - ((p - i) mod W): written once that is >= 0 */
        for (long i = 0; i < W && i <= p; ++i) keys[N++] = ring + i * hd;
        long n = entries ? (p + 1) / rate : 0;
        if (n > max_entries) n = max_entries;
        const float *slot_entries = entries ? entries + slot * max_entries * hd : NULL;
        if (n > 0 && index_q) {
            const float head_scale = 1.0f / sqrtf((float)nI), dim_scale = 1.0f / sqrtf((float)dI);
            const float *iq = index_q + b * nI * dI, *iw = index_w + b * nI;
            const float *ik = index_entries + slot * max_entries * dI;
            for (long s = 0; s < n; ++s) {
                float total = 0.0f;
                for (long h = 0; h < nI; ++h) {
                    const float relu = fmaxf(dot(iq + h * dI, ik + s * dI, dI), 0.0f);
                    total += (relu * dim_scale) * (iw[h] * head_scale);
                }
                score[s] = total;
            }
            top_k(score, n, topk < n ? topk : n, heap, chosen);
            for (long s = 0; s < n; ++s)
                if (chosen[s]) keys[N++] = slot_entries + s * hd;
        } else {
            for (long s = 0; s < n; ++s) keys[N++] = slot_entries + s * hd;
        }
        for (long h = 0; h < H; ++h) {
            const float *qh = q + (b * H + h) * hd;
            float most = sink[h];
            for (long j = 0; j < N; ++j) {
                logits[j] = dot(qh, keys[j], hd) * scale;
                if (logits[j] > most) most = logits[j];
            }
            float total = expf(sink[h] - most);
            for (long j = 0; j < N; ++j) {
                logits[j] = expf(logits[j] - most);
                total += logits[j];
            }
            float *o = out + (b * H + h) * hd;
            memset(o, 0, hd * sizeof(float));
            for (long j = 0; j < N; ++j) {
                const float weight = logits[j] / total;
                const float *k = keys[j];
                for (long c = 0; c < hd; ++c) o[c] += weight * k[c];
            }
        }
    }
    free(logits), free(keys), free(heap), free(chosen);
    return 0;
}
