"""DeepSeek-V4 attention: sliding window, CSA (compressed + lightning-indexer top-k), HCA (compressed).

All three share the same projections: low-rank q with a per-head unweighted RMSNorm, one shared K=V
head (MQA), partial interleaved RoPE, a learnable per-head sink, output de-rotation and a grouped
low-rank output projection. CSA and HCA append compressed entries after the window keys.

Shapes: T tokens in the step, H heads, hd head dim, W window, m compress rate, n entries.
"""

import torch
from torch import nn

from dsv4.config import CSA, SLIDING, ModelConfig
from dsv4.model.batch import ForwardBatch, Segment
from dsv4.model.cache import CompressorCache, LayerCache
from dsv4.model.norm import RMSNorm, rms_normalize
from dsv4.model.rope import RotaryTable, apply_rotary


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
        self.wkv = nn.Linear(cfg.hidden_size, width, bias=False, dtype=dtype)
        self.wgate = nn.Linear(cfg.hidden_size, width, bias=False, dtype=dtype)
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
        entries = self.norm(pooled.to(kv.dtype))
        positions = torch.arange(first_window, end_window, device=kv.device) * m
        cos, sin = rope.cos_sin(positions)
        cache.entries[slot, first_window:end_window] = apply_rotary(entries, cos, sin)
        return end_window


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
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=dtype)
        self.compressor = Compressor(cfg, self.rate, self.head_dim, overlap=True, dtype=dtype)

    def select(
        self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """q [T, nI, dI] (rotated), head_weights [T, nI], keys [n, dI], positions [T] -> [T, min(k, n)]
        entry indices, -1 where fewer than k entries are visible."""
        scores = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu() * self.head_dim**-0.5
        scores = (scores * (head_weights.float() * self.n_heads**-0.5).unsqueeze(-1)).sum(dim=1)  # [T, n]
        visible_count = ((positions + 1) // self.rate).unsqueeze(-1)  # entries w < (t+1)//m are complete
        entry = torch.arange(keys.shape[0], device=keys.device)
        scores = scores.masked_fill(entry >= visible_count, float("-inf"))
        picks = scores.topk(min(self.topk, keys.shape[0]), dim=-1).indices
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
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        group_in = self.n_heads * self.head_dim // self.o_groups
        self.wo_a = nn.Linear(group_in, self.o_groups * self.o_lora_rank, bias=False, dtype=dtype)
        self.wo_b = nn.Linear(self.o_groups * self.o_lora_rank, cfg.hidden_size, bias=False, dtype=dtype)
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
        T = x.shape[0]
        cos, sin = self.rope.cos_sin(batch.positions)  # [T, r/2]
        q_res = self.q_norm(self.wq_a(x))  # [T, ql]
        q = rms_normalize(self.wq_b(q_res).view(T, self.n_heads, self.head_dim), self.eps)
        q = apply_rotary(q, cos, sin)  # [T, H, hd]
        kv = apply_rotary(self.kv_norm(self.wkv(x)), cos, sin)  # [T, hd]

        comp_kv = comp_gate = idx_kv = idx_gate = idx_q = idx_w = None
        if self.compressor is not None:
            comp_kv, comp_gate = self.compressor.project(x)
        if self.indexer is not None:
            idx_kv, idx_gate = self.indexer.compressor.project(x)
            idx_q = apply_rotary(self.indexer.wq_b(q_res).view(T, self.indexer.n_heads, -1), cos, sin)
            idx_w = self.indexer.weights_proj(x)

        out = torch.empty_like(q)
        for seg in batch.segments:
            rows = slice(seg.begin, seg.end)
            keys, bias = self._window_keys(kv[rows], seg, cache.window)
            if self.compressor is not None:
                n = self.compressor.emit(comp_kv[rows], comp_gate[rows], seg, cache.compressor, self.rope)
                entries = cache.compressor.entries[seg.slot, :n]
                positions = batch.positions[rows]
                if self.indexer is not None:
                    n_keys = self.indexer.compressor.emit(idx_kv[rows], idx_gate[rows], seg, cache.indexer, self.rope)
                    index_keys = cache.indexer.entries[seg.slot, :n_keys]
                    entry_bias = self._selected_bias(self.indexer.select(idx_q[rows], idx_w[rows], index_keys, positions), n)
                else:
                    entry_bias = self._causal_entry_bias(positions, n, self.compressor.rate)
                keys = torch.cat((keys, entries))
                bias = torch.cat((bias, entry_bias.to(bias.dtype)), dim=-1)
            out[rows] = self._attend(q[rows], keys, bias)
        out = apply_rotary(out, cos, sin, inverse=True)  # V carried RoPE: de-rotate at the query position
        return self._project_out(out)

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
        return keys, _mask_to_bias(visible)

    @staticmethod
    def _causal_entry_bias(positions: torch.Tensor, n: int, rate: int) -> torch.Tensor:
        """HCA: every complete entry is visible: w < (t+1)//m."""
        entry = torch.arange(n, device=positions.device)
        return _mask_to_bias(entry < ((positions + 1) // rate).unsqueeze(-1))

    @staticmethod
    def _selected_bias(picks: torch.Tensor, n: int) -> torch.Tensor:
        """CSA: only the indexer's picks are visible; -1 picks select nothing."""
        visible = torch.zeros(picks.shape[0], n + 1, dtype=torch.bool, device=picks.device)
        visible.scatter_(1, torch.where(picks < 0, n, picks), True)
        return _mask_to_bias(visible[:, :n])

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


def _mask_to_bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(~visible, float("-inf"))
