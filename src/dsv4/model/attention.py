"""DeepSeek-V4 attention: sliding window, CSA (compressed + lightning-indexer top-k), HCA (compressed).

All three share the same projections: low-rank q with a per-head unweighted RMSNorm, one shared K=V
head (MQA), partial interleaved RoPE, a learnable per-head sink, output de-rotation and a grouped
low-rank output projection. CSA and HCA append compressed entries after the window keys.

Shapes: T tokens in the step, H heads, hd head dim, W window, m compress rate, n entries,
B single-token (decode) rows.

Two paths compute the same thing. The per-segment path (the reference) loops over the sequences of
the step and handles any chunk length. The batched decode path serves every single-token segment at
once: it gathers each row's window ring and entries by cache slot and masks them by position, so a
decode step costs the same number of ops for 1 or 64 sequences. The batched prefill path serves every
other segment at once, padded to the longest chunk: P segments, L = longest chunk.
"""

import torch
from torch import nn

from dsv4.config import CSA, SLIDING, ModelConfig
from dsv4.kernels.registry import DECODE_ATTENTION, PREFILL_ATTENTION, default_registry
from dsv4.model.batch import ForwardBatch, Segment
from dsv4.model.cache import CompressorCache, LayerCache
from dsv4.model.linear import Linear
from dsv4.model.norm import RMSNorm
from dsv4.model.rope import RotaryTable, norm_rope_
from dsv4.model.step_plan import DecodeMeta, PrefillMeta, decode_meta, mask_to_bias, prefill_meta

# Logits one attention tile may hold ([segments, queries, H, keys] fp32): 2^18 floats = 1 MiB, within a
# typical per-core L2, so a tile's bmm -> softmax -> bmm chain reads its logits from cache, not memory
# (measured on 64 segments of 64 tokens, tiny config: the attention math ~20% faster than in one pass,
# 2^16 and 2^20 slower than 2^18).
TILE_LOGITS = 1 << 18
# Query block of a chunk longer than twice this many windows: each block scores the ~(1 + this) windows
# of keys it can see instead of the whole chunk.
QUERY_BLOCK_WINDOWS = 2


class Compressor(nn.Module):
    """Gated pooling of every m consecutive tokens into one entry [out_dim].

    Overlapping (CSA and the indexer): each token projects to two halves, Ca (feeds the next window's
    entry) and Cb (its own window's); entry w softmaxes, per channel, over the 2m slots
    {Ca of window w-1} + {Cb of window w}. Non-overlapping (HCA): a softmax over the m slots of window w.
    The entry is normed and rotated at position w*m with the compress table.
    """

    def __init__(self, cfg: ModelConfig, rate: int, out_dim: int, overlap: bool, dtype: torch.dtype):
        super().__init__()
        self.rate = rate
        self.out_dim = out_dim
        self.overlap = overlap
        width = 2 * out_dim if overlap else out_dim
        self.wkv = Linear(cfg.hidden_size, width, dtype)
        self.wgate = Linear(cfg.hidden_size, width, dtype)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(out_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> raw kv, gate [T, width] (gate before ape)."""
        return self.wkv(x), self.wgate(x)

    def emit(
        self, kv: torch.Tensor, gate: torch.Tensor, seg: Segment, cache: CompressorCache, rope: RotaryTable
    ) -> int:
        """Append the entries of every window completed by this segment to cache.entries[slot].
        kv, gate [len, width] are the segment's raw projections. Returns the entry count after the segment."""
        m, slot = self.rate, seg.slot
        start, end = seg.start, seg.start + seg.length
        ring_len = cache.ring_kv.shape[1]
        first_window, end_window = start // m, end // m  # windows [first, end) complete in this segment
        # The token history the new windows need (previous window too when overlapping) lives in the ring.
        base = max(0, (first_window - 1) * m) if self.overlap else first_window * m
        history = torch.arange(base, start, device=kv.device) % ring_len
        all_kv = torch.cat((cache.ring_kv[slot, history], kv))  # positions [base, end)
        all_gate = torch.cat((cache.ring_gate[slot, history], gate))
        keep = torch.arange(max(start, end - ring_len), end, device=kv.device)
        cache.ring_kv[slot, keep % ring_len] = kv[keep - start]
        cache.ring_gate[slot, keep % ring_len] = gate[keep - start]

        n_new = end_window - first_window
        if n_new <= 0:
            return end_window
        lo = first_window * m - base
        cur_kv = all_kv[lo : lo + n_new * m].float().view(n_new, m, -1)
        cur_gate = all_gate[lo : lo + n_new * m].float().view(n_new, m, -1) + self.ape  # ape by slot in window
        if self.overlap:
            d = self.out_dim
            prev_kv = torch.zeros(n_new, m, d, device=kv.device)
            prev_gate = torch.full((n_new, m, d), float("-inf"), device=kv.device)
            has_prev = first_window > 0  # window 0 has no previous window: its Ca slots weigh nothing
            src = all_kv[: (n_new - (not has_prev)) * m].float().view(-1, m, 2 * d)
            src_gate = all_gate[: (n_new - (not has_prev)) * m].float().view(-1, m, 2 * d) + self.ape
            prev_kv[int(not has_prev) :] = src[..., :d]
            prev_gate[int(not has_prev) :] = src_gate[..., :d]
            slots_kv = torch.cat((prev_kv, cur_kv[..., d:]), dim=1)  # [n_new, 2m, d]
            slots_gate = torch.cat((prev_gate, cur_gate[..., d:]), dim=1)
        else:
            slots_kv, slots_gate = cur_kv, cur_gate
        pooled = (slots_kv * slots_gate.softmax(dim=1)).sum(dim=1)  # [n_new, d] fp32
        positions = torch.arange(first_window, end_window, device=kv.device) * m
        entries = norm_rope_(pooled.to(kv.dtype), self.norm.eps, self.norm.weight, positions, rope)
        cache.entries[slot, first_window:end_window] = entries
        return end_window

    def emit_decode(
        self, kv: torch.Tensor, gate: torch.Tensor, meta: DecodeMeta, cache: CompressorCache, rope: RotaryTable,
    ) -> None:
        """`emit` for B single-token rows at once: kv, gate [B, width] at meta's positions and cache
        slots. Records each token in its ring; rows whose token completes window w = p // m append
        entry w. Equals `emit` on each row (same ring rows, same entries)."""
        m, ring_len = self.rate, cache.ring_kv.shape[1]
        device = kv.device
        slots, ring_rows = meta.slots, meta.ring_rows(ring_len)
        cache.ring_kv[slots, ring_rows] = kv
        cache.ring_gate[slots, ring_rows] = gate
        done, windows, done_slots, window_ids = meta.completed(m)
        if not done:
            return
        ring_kv = cache.ring_kv[done_slots].float()  # [E, R, width]
        ring_gate = cache.ring_gate[done_slots].float()
        if not self.overlap:
            # R == m: ring row j holds the window's token j, whose ape row is j.
            slots_kv, slots_gate = ring_kv, ring_gate + self.ape
        else:
            # R == 2m: window w fills ring half w % 2, window w - 1 the other half.
            d, E = self.out_dim, len(done)
            cur_half = torch.tensor([w % 2 for w in windows], device=device)
            rows = torch.arange(E, device=device)
            halves_kv = ring_kv.view(E, 2, m, 2 * d)
            halves_gate = ring_gate.view(E, 2, m, 2 * d)
            cur_kv, prev_kv = halves_kv[rows, cur_half], halves_kv[rows, 1 - cur_half]
            cur_gate, prev_gate = halves_gate[rows, cur_half] + self.ape, halves_gate[rows, 1 - cur_half] + self.ape
            first = torch.tensor([w == 0 for w in windows], device=device).view(E, 1, 1)
            # Window 0 has no previous window: its Ca slots weigh nothing (and hold no data).
            prev_kv = prev_kv[..., :d].masked_fill(first, 0.0)
            prev_gate = prev_gate[..., :d].masked_fill(first, float("-inf"))
            slots_kv = torch.cat((prev_kv, cur_kv[..., d:]), dim=1)  # [E, 2m, d]
            slots_gate = torch.cat((prev_gate, cur_gate[..., d:]), dim=1)
        pooled = (slots_kv * slots_gate.softmax(dim=1)).sum(dim=1)  # [E, d] fp32
        entries = norm_rope_(pooled.to(kv.dtype), self.norm.eps, self.norm.weight, window_ids * m, rope)
        cache.entries[done_slots, window_ids] = entries

    def emit_batched(
        self, kv: torch.Tensor, gate: torch.Tensor, meta: PrefillMeta, cache: CompressorCache, rope: RotaryTable,
    ) -> None:
        """`emit` for all of meta's segments at once: kv, gate [T, width] are the flat batch's raw
        projections. Equals `emit` on each segment (same ring rows, same entries)."""
        m, ring_len, width = self.rate, cache.ring_kv.shape[1], kv.shape[1]
        plan = meta.compressor(m, ring_len, self.overlap)
        ring_kv, ring_gate = cache.ring_kv.view(-1, width), cache.ring_gate.view(-1, width)  # [S * R, width]
        # The windows' tokens: the flat batch, then (chunks continuing a sequence) the ring rows before
        # each chunk, read before the ring is overwritten below.
        source_kv, source_gate = kv, gate
        if plan.needs_history:
            source_kv = torch.cat((kv, ring_kv.index_select(0, plan.history_rows)))
            source_gate = torch.cat((gate, ring_gate.index_select(0, plan.history_rows)))
        ring_rows, src_rows = meta.ring_writes(ring_len)
        ring_kv.index_copy_(0, ring_rows, kv.index_select(0, src_rows))
        ring_gate.index_copy_(0, ring_rows, gate.index_select(0, src_rows))
        E, d = plan.window_ids.numel(), self.out_dim
        if E == 0:
            return
        # [E, S, d] slots of each window (S = 2m overlapping: Ca of window w-1's tokens, Cb of window w's)
        slots_kv = source_kv.view(-1, d).index_select(0, plan.source_rows).view(E, -1, d).float()
        slots_gate = source_gate.view(-1, d).index_select(0, plan.source_rows).view(E, -1, d).float()
        ape = self.ape.view(m, 2, d).transpose(0, 1).reshape(2 * m, d) if self.overlap else self.ape  # [S, d] by slot
        slots_gate.add_(ape)  # in place: a fresh tensor
        if plan.first is not None:  # window 0's Ca slots (no previous window) weigh nothing
            slots_kv[:, :m].index_fill_(0, plan.first, 0.0)
            slots_gate[:, :m].index_fill_(0, plan.first, float("-inf"))
        pooled = (slots_kv * slots_gate.softmax(dim=1)).sum(dim=1)  # [E, d] fp32
        entries = norm_rope_(pooled.to(kv.dtype), self.norm.eps, self.norm.weight, plan.window_ids * m, rope)
        flat_entries = cache.entries.view(-1, d)  # [S * E_max, d]
        flat_entries.index_copy_(0, plan.window_slots * cache.entries.shape[1] + plan.window_ids, entries)


class Indexer(nn.Module):
    """Lightning indexer: picks, per query, the top-k compressed entries a CSA layer attends to.

    score[t, s] = sum_h (w[t, h] / sqrt(nI)) * relu(qI[t, h] . K_s) / sqrt(dI), keys K from its own
    overlapping compressor at width dI; future entries are masked, picks past them become -1.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.rate = cfg.compress_rate_csa
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype)
        self.compressor = Compressor(cfg, self.rate, self.head_dim, overlap=True, dtype=dtype)

    def select(
        self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """q [T, nI, dI] (rotated), head_weights [T, nI], keys [n, dI], positions [T] -> [T, min(k, n)]
        entry indices, -1 where fewer than k entries are visible."""
        scores = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu() * self.head_dim**-0.5
        scores = (scores * (head_weights.float() * self.n_heads**-0.5).unsqueeze(-1)).sum(dim=1)  # [T, n]
        return self._top_visible(scores, (positions + 1) // self.rate)  # entries w < (t+1)//m are complete

    def select_decode(
        self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """`select` for B single-token rows: q [B, nI, dI], head_weights [B, nI], keys [B, n, dI] (row b's
        first counts[b] are its visible entries) -> [B, min(k, n)] picks, -1 where fewer are visible."""
        picks = self.select_batched(q.unsqueeze(1), head_weights.unsqueeze(1), keys, counts.unsqueeze(1))
        return picks.squeeze(1)

    def select_batched(
        self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """`select` for P padded segments: q [P, L, nI, dI], head_weights [P, L, nI], keys [P, n, dI],
        counts [P, L] visible entries per query -> [P, L, min(k, n)] picks, -1 where fewer are visible."""
        P, L, n_heads, dim = q.shape
        scores = torch.bmm(q.float().view(P, L * n_heads, dim), keys.float().transpose(1, 2))  # [P, L*nI, n]
        scores = scores.view(P, L, n_heads, -1).relu_().mul_(self.head_dim**-0.5)  # in place: a fresh tensor
        weights = (head_weights.float() * self.n_heads**-0.5).unsqueeze(-1)  # [P, L, nI, 1]
        scores = scores.mul_(weights).sum(dim=2)  # [P, L, n]
        return self._top_visible(scores, counts)

    def _top_visible(self, scores: torch.Tensor, visible_count: torch.Tensor) -> torch.Tensor:
        """scores [..., n], visible_count [...] -> top-min(k, n) entries among the visible ones; picks past
        the visible entries (fewer than k visible) become the -1 sentinel."""
        visible_count = visible_count.unsqueeze(-1)
        entry = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(entry >= visible_count, float("-inf"))
        picks = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return torch.where(picks >= visible_count, torch.full_like(picks, -1), picks)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, dtype: torch.dtype):
        super().__init__()
        self.layer_type = layer_type
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.o_groups = cfg.o_groups
        self.o_lora_rank = cfg.o_lora_rank
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        group_in = self.n_heads * self.head_dim // self.o_groups
        self.wo_a = Linear(group_in, self.o_groups * self.o_lora_rank, dtype)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, cfg.hidden_size, dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.eps = cfg.rms_norm_eps
        # Sliding layers rotate with the main table; CSA/HCA layers use the compress table for everything.
        self.rope = RotaryTable(cfg.rope_main if layer_type == SLIDING else cfg.rope_compress)
        self.compressor = None
        self.indexer = None
        if layer_type != SLIDING:
            rate = cfg.compress_rate(layer_type)
            self.compressor = Compressor(cfg, rate, self.head_dim, overlap=layer_type == CSA, dtype=dtype)
        if layer_type == CSA:
            self.indexer = Indexer(cfg, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        """x [T, D] (normed block input) -> [T, D]; reads and extends each sequence's cache slot."""
        T, pos = x.shape[0], batch.positions
        q_res = self.q_norm(self.wq_a(x), inplace=True)  # [T, ql]
        # Per-head unweighted norm, then RoPE: [T, H, hd]
        q = norm_rope_(self.wq_b(q_res).view(T, self.n_heads, self.head_dim), self.eps, None, pos, self.rope)
        kv = norm_rope_(self.wkv(x), self.kv_norm.eps, self.kv_norm.weight, pos, self.rope)  # [T, hd]

        comp_kv = comp_gate = idx_kv = idx_gate = idx_q = idx_w = None
        if self.compressor is not None:
            comp_kv, comp_gate = self.compressor.project(x)
        if self.indexer is not None:
            idx_kv, idx_gate = self.indexer.compressor.project(x)
            idx_q = norm_rope_(self.indexer.wq_b(q_res).view(T, self.indexer.n_heads, -1), None, None, pos, self.rope)
            idx_w = self.indexer.weights_proj(x)

        registry = default_registry()
        meta = decode_meta(batch) if not registry.choose(DECODE_ATTENTION).is_reference else None
        if meta is not None and meta.pure:
            # A pure decode step needs no gather: its rows are the whole flat batch, in segment order.
            side = _SideInputs(comp_kv, comp_gate, idx_kv, idx_gate, idx_q, idx_w)
            out = self._decode(q, kv, meta, cache, side)
            return self._project_out(norm_rope_(out, None, None, pos, self.rope, inverse=True))
        out = torch.empty_like(q)
        if meta is not None:
            rows = meta.rows
            side = _rows_of(rows, comp_kv, comp_gate, idx_kv, idx_gate, idx_q, idx_w)
            out[rows] = self._decode(q[rows], kv[rows], meta, cache, side)
        # Segments the decode path did not serve (all of them when it is off).
        segments = [seg for seg in batch.segments if meta is None or seg.length > 1]
        if segments and not registry.choose(PREFILL_ATTENTION).is_reference:
            pre = prefill_meta(batch, decode_served=meta is not None)
            side = _SideInputs(comp_kv, comp_gate, idx_kv, idx_gate, idx_q, idx_w)
            padded = self._prefill(q, kv, pre, cache, side)  # [P, L, H, hd]
            if pre.dense_rows is not None:  # no padding: the chunks are one run of flat rows
                out[pre.dense_rows] = padded.flatten(0, 1)
            else:
                out[pre.rows] = padded[pre.valid]
            segments = []
        for seg in segments:
            rows = slice(seg.begin, seg.end)
            out[rows] = self._segment(q[rows], kv[rows], seg, batch.positions[rows], cache,
                                      _rows_of(rows, comp_kv, comp_gate, idx_kv, idx_gate, idx_q, idx_w))
        # V carried RoPE: de-rotate at the query position
        out = norm_rope_(out, None, None, pos, self.rope, inverse=True)
        return self._project_out(out)

    def _segment(
        self, q: torch.Tensor, kv: torch.Tensor, seg: Segment, positions: torch.Tensor, cache: LayerCache,
        side: "_SideInputs",
    ) -> torch.Tensor:
        """Reference path for one sequence's chunk: q [L, H, hd], kv [L, hd] -> [L, H, hd]."""
        keys, bias = self._window_keys(kv, seg, cache.window)
        if self.compressor is not None:
            n = self.compressor.emit(side.comp_kv, side.comp_gate, seg, cache.compressor, self.rope)
            entries = cache.compressor.entries[seg.slot, :n]
            if self.indexer is not None:
                n_keys = self.indexer.compressor.emit(side.idx_kv, side.idx_gate, seg, cache.indexer, self.rope)
                index_keys = cache.indexer.entries[seg.slot, :n_keys]
                entry_bias = self._selected_bias(self.indexer.select(side.idx_q, side.idx_w, index_keys, positions), n)
            else:
                entry_bias = self._causal_entry_bias(positions, n, self.compressor.rate)
            keys = torch.cat((keys, entries))
            bias = torch.cat((bias, entry_bias.to(bias.dtype)), dim=-1)
        return self._attend(q, keys, bias)

    def _decode(
        self, q: torch.Tensor, kv: torch.Tensor, meta: DecodeMeta, cache: LayerCache, side: "_SideInputs"
    ) -> torch.Tensor:
        """Batched path for B single-token segments: q [B, H, hd], kv [B, hd] -> [B, H, hd].
        Writes the same cache rows as `_segment` would for each row."""
        ring_rows, window_bias = meta.window(self.window)
        cache.window[meta.slots, ring_rows] = kv
        # [B, W, hd]; ring row i holds the latest position = i (mod W), <= pos
        blocks = [(meta.read(cache.window), window_bias)]
        if self.compressor is not None:
            rate = self.compressor.rate
            self.compressor.emit_decode(side.comp_kv, side.comp_gate, meta, cache.compressor, self.rope)
            if self.indexer is not None:
                self.indexer.compressor.emit_decode(side.idx_kv, side.idx_gate, meta, cache.indexer, self.rope)
            n_max, counts = meta.entry_counts(rate)
            if n_max > 0:
                if self.indexer is not None:
                    # CSA: attend to the k picked entries only (gathered), not to all n with a mask.
                    index_keys = meta.read(cache.indexer.entries, n_max)  # [B, n_max, dI]
                    picks = self.indexer.select_decode(side.idx_q, side.idx_w, index_keys, counts)  # [B, k]
                    entries = gather_entries(cache.compressor.entries, meta.slots, picks.clamp(min=0))  # [B, k, hd]
                    blocks.append((entries, mask_to_bias(picks >= 0)))
                else:
                    blocks.append((meta.read(cache.compressor.entries, n_max), meta.entry_bias(rate)))  # [B, n_max, hd]
        return self._attend_decode(q, blocks)

    def _prefill(
        self, q: torch.Tensor, kv: torch.Tensor, meta: PrefillMeta, cache: LayerCache, side: "_SideInputs"
    ) -> torch.Tensor:
        """Batched path for meta's P segments: q [T, H, hd], kv [T, hd] and side are the whole flat batch
        -> padded [P, L, H, hd] (rows past a segment's length are padding). Writes the same cache rows as
        `_segment` would for each segment."""
        W, (P, L), hd = self.window, meta.shape, self.head_dim
        ring = cache.window.view(-1, hd)  # [S * W, hd]
        history_rows = meta.window_history(W)  # [P * h]
        h = history_rows.numel() // P
        rate, n_max = None, 0
        if self.compressor is not None:
            rate = self.compressor.rate
            n_max, counts = meta.entry_counts(rate)  # counts [P, L]: complete entries each query sees
        # keys [P, h + L + n + 1, hd] = [earlier ring tokens | new tokens | entries | the sink's zero key],
        # the ring tokens read before the ring is overwritten below.
        keys = kv.new_empty(P, h + L + n_max + 1, hd)
        keys[:, :h] = ring.index_select(0, history_rows).view(P, h, hd)
        keys[:, h : h + L] = meta.padded(kv)
        keys[:, -1] = 0.0
        ring_rows, src_rows = meta.ring_writes(W)
        ring.index_copy_(0, ring_rows, kv.index_select(0, src_rows))
        bias = meta.attention_bias(W, rate, causal_entries=True)  # [P, L, h + L + n + 1]
        if self.compressor is not None:
            self.compressor.emit_batched(side.comp_kv, side.comp_gate, meta, cache.compressor, self.rope)
            # Entries past a segment's own count are masked.
            keys[:, h + L : h + L + n_max] = meta.read(cache.compressor.entries, n_max)
            if self.indexer is not None:
                self.indexer.compressor.emit_batched(side.idx_kv, side.idx_gate, meta, cache.indexer, self.rope)
                # With at most topk entries every visible entry is picked: the causal bias is the picks'.
                if n_max > self.indexer.topk:
                    index_keys = meta.read(cache.indexer.entries, n_max)
                    idx_q, idx_w = meta.padded(side.idx_q), meta.padded(side.idx_w)
                    picks = self.indexer.select_batched(idx_q, idx_w, index_keys, counts)  # [P, L, k]
                    bias = meta.attention_bias(W, rate, causal_entries=False).clone()  # entries hidden
                    # Show the picks; -1 picks point one past the entries, at the sink column (already 0).
                    bias[..., h + L :].scatter_(-1, torch.where(picks < 0, n_max, picks), 0.0)
        return self._attend_padded(meta.padded(q), keys, bias, h)

    def _attend_padded(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, h: int) -> torch.Tensor:
        """`_attend` per segment: q [P, L, H, hd], keys (= values) [P, h + L + n + 1, hd] = the window keys
        (h earlier ring tokens, the L chunk tokens), n entries and the sink's zero key; bias [P, L, N]
        (N = h + L + n + 1, sink column 0) -> [P, L, H, hd].

        Runs in tiles of whole segments and query blocks. A chunk much longer than the window is cut into
        blocks of QUERY_BLOCK_WINDOWS windows, each scoring only the window keys it can see (the rest are
        masked for all its queries), so the window part costs O(L W) instead of O(L^2); and each tile's
        logits stay within TILE_LOGITS, so the bmm -> softmax -> bmm chain reads them from cache."""
        P, L, H, hd = q.shape
        W = self.window
        block = QUERY_BLOCK_WINDOWS * W if L > 2 * QUERY_BLOCK_WINDOWS * W else L
        out = q.new_empty(P, L, H, hd)
        for r0 in range(0, L, block):
            r1 = min(L, r0 + block)
            lo, hi = max(0, h + r0 - W + 1), h + r1  # the window keys rows [r0, r1) can see
            if lo == 0 and hi == h + L:
                block_keys, block_bias = keys, bias[:, r0:r1]
            else:
                block_keys = torch.cat((keys[:, lo:hi], keys[:, h + L :]), dim=1)
                block_bias = torch.cat((bias[:, r0:r1, lo:hi], bias[:, r0:r1, h + L :]), dim=-1)
            per_tile = max(1, TILE_LOGITS // ((r1 - r0) * H * block_keys.shape[1]))  # segments per tile
            for p0 in range(0, P, per_tile):
                p1 = min(P, p0 + per_tile)
                tile_out = out[p0:p1] if block == L else None  # whole segments: write in place
                tile_out = self._attend_tile(q[p0:p1, r0:r1], block_keys[p0:p1], block_bias[p0:p1], tile_out)
                if block != L:
                    out[p0:p1, r0:r1] = tile_out
        return out

    def _attend_tile(
        self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [P, B, H, hd], keys (= values) [P, N, hd] whose last row is the sink's zero key, bias [P, B, N]
        whose last column is 0 -> [P, B, H, hd] (written into `out`, a contiguous [P, B, H, hd], if given).
        The sink's logit takes the last column of the softmax and its zero value adds nothing, so neither
        logits nor probabilities are concatenated or sliced. Queries that see no key (padding) give the
        sink all their mass."""
        P, B, H, hd = q.shape
        logits = torch.bmm(q.reshape(P, B * H, hd), keys.transpose(1, 2)).view(P, B, H, -1).float()  # [P, B, H, N]
        torch.add(bias.unsqueeze(2), logits, alpha=self.head_dim**-0.5, out=logits)  # in place: bias + scale * q.k
        logits[..., -1] = self.attn_sink  # [H]
        probs = logits.softmax(dim=-1).to(keys.dtype)
        if out is None:
            return torch.bmm(probs.view(P, B * H, -1), keys).view(P, B, H, hd)
        torch.bmm(probs.view(P, B * H, -1), keys, out=out.view(P, B * H, hd))
        return out

    def _attend_decode(self, q: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """`_attend` per row over score blocks: q [B, H, hd], blocks of (keys (= values) [B, N_i, hd],
        bias [B, N_i]) -> [B, H, hd]. One softmax spans every block's logits and the per-head sink, so
        this equals attending over the concatenated keys; only the small [B, H, N] logits are
        concatenated, never the keys (which may be views into the cache)."""
        scale = self.head_dim**-0.5
        if q.dtype == torch.float32:  # one fused GEMM per block: bias + scale * q k^T
            logits = [torch.baddbmm(bias.unsqueeze(1), q, keys.transpose(1, 2), alpha=scale) for keys, bias in blocks]
        else:
            logits = [torch.bmm(q, keys.transpose(1, 2)).float() * scale + bias.unsqueeze(1) for keys, bias in blocks]
        sink = self.attn_sink.view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat((*logits, sink), dim=-1).softmax(dim=-1).to(q.dtype)  # [B, H, sum N_i + 1]
        out, start = None, 0
        for keys, _ in blocks:
            block_probs = probs[..., start : start + keys.shape[1]]  # [B, H, N_i]
            out = torch.bmm(block_probs, keys) if out is None else torch.baddbmm(out, block_probs, keys)
            start += keys.shape[1]
        return out

    def _window_keys(self, kv: torch.Tensor, seg: Segment, ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The window keys visible to the segment ([earlier ring tokens | new tokens]) and the [len, n]
        additive mask (key j is visible from query t iff t - W < j <= t); then records the new tokens."""
        W, start, end = self.window, seg.start, seg.start + seg.length
        hist_pos = torch.arange(max(0, start - W + 1), start, device=kv.device)
        keys = torch.cat((ring[seg.slot, hist_pos % W], kv))
        key_pos = torch.cat((hist_pos, torch.arange(start, end, device=kv.device)))
        q_pos = key_pos[-seg.length :].unsqueeze(-1)
        visible = (key_pos <= q_pos) & (key_pos > q_pos - W)
        keep = torch.arange(max(start, end - W), end, device=kv.device)
        ring[seg.slot, keep % W] = kv[keep - start]
        return keys, mask_to_bias(visible)

    @staticmethod
    def _causal_entry_bias(positions: torch.Tensor, n: int, rate: int) -> torch.Tensor:
        """HCA: every complete entry is visible: w < (t+1)//m."""
        entry = torch.arange(n, device=positions.device)
        return mask_to_bias(entry < ((positions + 1) // rate).unsqueeze(-1))

    @staticmethod
    def _selected_bias(picks: torch.Tensor, n: int) -> torch.Tensor:
        """CSA: only the indexer's picks are visible; -1 picks select nothing."""
        visible = torch.zeros(picks.shape[0], n + 1, dtype=torch.bool, device=picks.device)
        visible.scatter_(1, torch.where(picks < 0, n, picks), True)
        return mask_to_bias(visible[:, :n])

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [L, H, hd], keys (= values) [N, hd], bias [L, N] -> [L, H, hd]; softmax with a per-head sink
        logit that takes probability mass but contributes no value."""
        logits = torch.einsum("lhd,nd->hln", q, keys).float() * self.head_dim**-0.5 + bias
        sink = self.attn_sink.view(-1, 1, 1).expand(-1, q.shape[0], 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hln,nd->lhd", probs.to(keys.dtype), keys)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: heads split into g groups, each mapped to ol by its own block of wo_a."""
        T = out.shape[0]
        grouped = out.reshape(T, self.o_groups, -1)  # [T, g, (H/g)*hd]
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)  # [g, ol, (H/g)*hd]
        low_rank = torch.einsum("tgc,goc->tgo", grouped, wo_a).reshape(T, -1)  # [T, g*ol]
        return self.wo_b(low_rank)


class _SideInputs:
    """A row range's compressor / indexer projections (None where the layer has no such part)."""

    # __init__'s positional order (the callers pass the tensors in this order), so not sorted
    _FIELDS = ("comp_kv", "comp_gate", "idx_kv", "idx_gate", "idx_q", "idx_w")
    __slots__ = _FIELDS

    def __init__(self, *tensors: torch.Tensor | None):
        for name, t in zip(self._FIELDS, tensors):
            setattr(self, name, t)


def _rows_of(rows, *tensors: torch.Tensor | None) -> _SideInputs:
    return _SideInputs(*(None if t is None else t[rows] for t in tensors))


def gather_entries(entries: torch.Tensor, slots: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """entries [S, n, d] (a contiguous cache), slots [B], picks [B, k] -> entries[slots[b], picks[b, j]]
    [B, k, d]: one index_select over the flattened rows, several times cheaper than 2-D advanced indexing."""
    S, n, d = entries.shape
    flat_rows = (slots.unsqueeze(-1) * n + picks).view(-1)  # [B*k]
    return entries.view(S * n, d).index_select(0, flat_rows).view(*picks.shape, d)
