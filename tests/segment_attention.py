"""The oracle of tests/test_kernels_attention.py: one attention layer run one sequence at a time.

It reads an `Attention` module's weights and writes the caches in their documented layout
(`model/cache.py`), but shares none of the model's batched code: per segment it gathers the window keys
from the ring by position, pools each completed compressor window from the ring history and the chunk,
scores the indexer over the visible entries, and takes one softmax over [keys | sink] with an explicit
concatenation. Short and slow; the model's decode and prefill paths must agree with it (outputs and every
cache tensor), which pins down slot, ring and entry bookkeeping that the end-to-end transformers parity
tests only see through the logits.
"""

from __future__ import annotations

import torch

from dsv4.model.attention import Attention, Compressor, Indexer
from dsv4.model.batch import ForwardBatch, Segment
from dsv4.model.cache import CompressorCache, LayerCache
from dsv4.model.rope import RotaryTable, norm_rope_


def _bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))


@torch.no_grad()
def segment_attention(attn: Attention, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
    """x [T, D] (normed block input) -> [T, D], each segment of `batch` on its own, in order."""
    T, pos = x.shape[0], batch.positions
    q_res = attn.q_norm(attn.wq_a(x))
    q = norm_rope_(attn.wq_b(q_res).view(T, attn.n_heads, attn.head_dim), attn.eps, None, pos, attn.rope)
    kv = norm_rope_(attn.wkv(x), attn.kv_norm.eps, attn.kv_norm.weight, pos, attn.rope)
    out = torch.empty_like(q)
    for seg in batch.segments:
        rows = slice(seg.begin, seg.end)
        keys, bias = _window_keys(attn.window, kv[rows], seg, cache.window)
        if attn.compressor is not None:
            comp_kv, comp_gate = attn.compressor.wkv(x[rows]), attn.compressor.wgate(x[rows])
            n = _emit(attn.compressor, comp_kv, comp_gate, seg, cache.compressor, attn.rope)
            entries = cache.compressor.entries[seg.slot, :n]
            visible = torch.arange(n) < ((pos[rows] + 1) // attn.compressor.rate).unsqueeze(-1)  # complete ones
            if attn.indexer is not None:
                indexer = attn.indexer
                idx_kv, idx_gate = indexer.compressor.wkv(x[rows]), indexer.compressor.wgate(x[rows])
                n_keys = _emit(indexer.compressor, idx_kv, idx_gate, seg, cache.indexer, attn.rope)
                idx_q = norm_rope_(indexer.wq_b(q_res[rows]).view(seg.length, indexer.n_heads, -1), None, None,
                                   pos[rows], attn.rope)
                picks = _select(indexer, idx_q, indexer.weights_proj(x[rows]), cache.indexer.entries[seg.slot, :n_keys],
                                pos[rows])
                chosen = torch.zeros(seg.length, n + 1, dtype=torch.bool)
                chosen.scatter_(1, torch.where(picks < 0, n, picks), True)
                visible = chosen[:, :n]
            keys = torch.cat((keys, entries))
            bias = torch.cat((bias, _bias(visible)), dim=-1)
        logits = torch.einsum("lhd,nd->hln", q[rows], keys).float() * attn.head_dim**-0.5 + bias
        sink = attn.attn_sink.view(-1, 1, 1).expand(-1, seg.length, 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
        out[rows] = torch.einsum("hln,nd->lhd", probs.to(keys.dtype), keys)
    out = norm_rope_(out, None, None, pos, attn.rope, inverse=True)
    grouped = out.reshape(T, attn.o_groups, -1)
    wo_a = attn.wo_a.weight.view(attn.o_groups, attn.o_lora_rank, -1)
    return attn.wo_b(torch.einsum("tgc,goc->tgo", grouped, wo_a).reshape(T, -1))


def _window_keys(W: int, kv: torch.Tensor, seg: Segment, ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The window keys visible to the segment ([earlier ring tokens | new tokens]) and their [len, n] bias
    (key j is visible from query t iff t - W < j <= t); then records the new tokens in the ring."""
    start, end = seg.start, seg.start + seg.length
    hist_pos = torch.arange(max(0, start - W + 1), start)
    keys = torch.cat((ring[seg.slot, hist_pos % W], kv))
    key_pos = torch.cat((hist_pos, torch.arange(start, end)))
    q_pos = key_pos[-seg.length :].unsqueeze(-1)
    visible = (key_pos <= q_pos) & (key_pos > q_pos - W)
    keep = torch.arange(max(start, end - W), end)
    ring[seg.slot, keep % W] = kv[keep - start]
    return keys, _bias(visible)


def _emit(comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, seg: Segment, cache: CompressorCache,
          rope: RotaryTable) -> int:
    """Append the entries of every window the segment completes; returns the slot's entry count after it."""
    m, slot, d = comp.rate, seg.slot, comp.out_dim
    start, end = seg.start, seg.start + seg.length
    ring_len = cache.ring_kv.shape[1]
    base = max(0, (start // m - 1) * m)  # the previous window's first position too
    history = torch.arange(base, start) % ring_len
    all_kv = torch.cat((cache.ring_kv[slot, history], kv)).float()  # positions [base, end)
    all_gate = torch.cat((cache.ring_gate[slot, history], gate)).float()
    keep = torch.arange(max(start, end - ring_len), end)
    cache.ring_kv[slot, keep % ring_len] = kv[keep - start]
    cache.ring_gate[slot, keep % ring_len] = gate[keep - start]
    for w in range(start // m, end // m):
        tokens = torch.arange(w * m, (w + 1) * m) - base
        slots_kv, slots_gate = all_kv[tokens], all_gate[tokens] + comp.ape  # [m, width]
        if comp.overlap:  # Ca of window w - 1's tokens, then Cb of window w's
            if w > 0:
                prev_kv, prev_gate = all_kv[tokens - m, :d], all_gate[tokens - m, :d] + comp.ape[:, :d]
            else:  # window 0 has no previous window: its Ca slots weigh nothing
                prev_kv, prev_gate = torch.zeros(m, d), torch.full((m, d), float("-inf"))
            slots_kv = torch.cat((prev_kv, slots_kv[:, d:]))
            slots_gate = torch.cat((prev_gate, slots_gate[:, d:]))
        pooled = (slots_kv * slots_gate.softmax(dim=0)).sum(dim=0, keepdim=True)
        entry = norm_rope_(pooled.to(kv.dtype), comp.norm.eps, comp.norm.weight, torch.tensor([w * m]), rope)
        cache.entries[slot, w] = entry[0]
    return end // m


def _select(indexer: Indexer, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
    """q [T, nI, dI], head_weights [T, nI], keys [n, dI] -> [T, min(k, n)] picks among the complete entries,
    -1 where fewer than k are complete."""
    scores = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu() * indexer.head_dim**-0.5
    scores = (scores * (head_weights.float() * indexer.n_heads**-0.5).unsqueeze(-1)).sum(dim=1)  # [T, n]
    visible = ((positions + 1) // indexer.rate).unsqueeze(-1)
    scores = scores.masked_fill(torch.arange(scores.shape[-1]) >= visible, float("-inf"))
    picks = scores.topk(min(indexer.topk, scores.shape[-1]), dim=-1).indices
    return torch.where(picks >= visible, torch.full_like(picks, -1), picks)
