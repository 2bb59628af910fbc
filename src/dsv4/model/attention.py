"""DeepSeek-V4 attention: sliding window, CSA (compressed + lightning-indexer top-k), HCA (compressed).

All three share the same projections: low-rank q with a per-head unweighted RMSNorm, one shared K=V
head (MQA), partial interleaved RoPE, a learnable per-head sink, output de-rotation and a grouped
low-rank output projection. CSA and HCA append compressed entries after the window keys.

Shapes: T tokens in the step, H heads, hd head dim, W window, m compress rate, n entries,
B single-token (decode) rows, P padded chunks of L tokens.

The step plan (`ForwardBatch.plan`) splits a step in two: the decode path serves every single-token
row at once (it gathers each row's window ring and entries by cache slot and masks them by position,
so a step costs the same number of ops for 1 or 64 sequences; the compiled decode step runs this same
code), and also each token of the chunks short enough to run as rows (`decode_span`: verify chunks of
k + 1 tokens, each row seeing its own and earlier positions); the prefill path every longer chunk at
once, padded to the longest. Both pool compressor windows
with `Compressor.emit`, pick entries with `Indexer.select` and weigh keys with `softmax_with_sink`.
"""

from dataclasses import dataclass

import torch
from torch import nn

from dsv4.config import CSA, SLIDING, ModelConfig
from dsv4.kernels import bf16_products
from dsv4.kernels.decode_attention_cpu import attend_args
from dsv4.kernels.registry import DECODE_ATTENTION, KernelRegistry, default_registry
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import CompressorCache, LayerCache
from dsv4.model.linear import Linear, SharedInputLinears, compute_weight
from dsv4.model.norm import RMSNorm
from dsv4.model.rope import RotaryTable, norm_rope_
from dsv4.model.step_plan import DecodeMeta, PrefillMeta, WindowPlan, mask_to_bias
from dsv4.parallel.collectives import all_reduce
from dsv4.parallel.state import SINGLE, ParallelState

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

    def __init__(self, cfg: ModelConfig, rate: int, out_dim: int, overlap: bool, dtype: torch.dtype,
                 kernels: KernelRegistry):
        super().__init__()
        self.rate = rate
        self.out_dim = out_dim
        self.overlap = overlap
        width = 2 * out_dim if overlap else out_dim
        self.wkv = Linear(cfg.hidden_size, width, dtype, kernels)
        self.wgate = Linear(cfg.hidden_size, width, dtype, kernels)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(out_dim, cfg.rms_norm_eps, kernels)

    def emit(self, kv: torch.Tensor, gate: torch.Tensor, windows: WindowPlan, cache: CompressorCache,
             rope: RotaryTable) -> None:
        """Record the new tokens in the ring and append the entries of the windows the plan names.
        kv, gate [N, width] are raw projections of the rows the plan indexes (the layer input's)."""
        m, width, d = self.rate, kv.shape[1], self.out_dim
        source_kv, source_gate = kv, gate
        if windows.history_rows is not None:  # read before the ring is overwritten below
            history = windows.history_rows
            source_kv = torch.cat((kv, cache.ring_kv.view(-1, width).index_select(0, history)))
            source_gate = torch.cat((gate, cache.ring_gate.view(-1, width).index_select(0, history)))
        src = windows.src_rows
        cache.ring_kv.index_put_(windows.ring_index, kv if src is None else kv.index_select(0, src))
        cache.ring_gate.index_put_(windows.ring_index, gate if src is None else gate.index_select(0, src))
        E = windows.count
        if E == 0:
            return
        if windows.from_ring:  # every token of the windows is in the ring now
            source_kv, source_gate = cache.ring_kv.view(-1, width), cache.ring_gate.view(-1, width)
        slots_kv = source_kv.view(-1, d).index_select(0, windows.source_rows).view(E, -1, d).float()  # [E, S, d]
        slots_gate = source_gate.view(-1, d).index_select(0, windows.source_rows).view(E, -1, d).float()
        ape = self.ape.view(m, 2, d).transpose(0, 1).reshape(2 * m, d) if self.overlap else self.ape  # [S, d] by slot
        slots_gate.add_(ape)  # in place: a fresh tensor
        if windows.empty_slot_bias is not None:
            # Window 0's Ca slots (no previous window) get gate -inf, so weight exactly 0. Their kv needs no
            # mask: the plan points them at position 0's token, which window 0 weighs itself (so it is finite
            # wherever the entry is), and a finite value times weight 0 adds a zero to the pooled sum.
            slots_gate.add_(windows.empty_slot_bias)
        pooled = (slots_kv * slots_gate.softmax(dim=1)).sum(dim=1)  # [E, d] fp32
        entries = norm_rope_(pooled.to(kv.dtype), self.norm.eps, self.norm.weight, windows.window_ids * m, rope)
        # Written into the cache tensor itself, not a view of it: a compiled graph then scatters the rows
        # in place instead of copying the whole cache back.
        at = (windows.window_slots, windows.window_ids)
        if windows.complete is not None:  # keep what the rows that complete no window hold
            entries = torch.where(windows.complete.unsqueeze(-1), entries, cache.entries[at])
        cache.entries.index_put_(at, entries)


class Indexer(nn.Module):
    """Lightning indexer: picks, per query, the top-k compressed entries a CSA layer attends to.

    score[t, s] = sum_h (w[t, h] / sqrt(nI)) * relu(qI[t, h] . K_s) / sqrt(dI), keys K from its own
    overlapping compressor at width dI; future entries are masked, picks past them become -1.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelRegistry):
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.topk = cfg.index_topk
        self.rate = cfg.compress_rate_csa
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, kernels)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype, kernels)
        self.compressor = Compressor(cfg, self.rate, self.head_dim, overlap=True, dtype=dtype, kernels=kernels)

    def select(
        self, q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """q [P, L, nI, dI] (rotated), head_weights [P, L, nI], keys [P, n, dI], counts [P, L] visible
        entries per query (entries w < (t+1)//m are complete) -> [P, L, min(k, n)] entry indices, -1
        where fewer than k entries are visible."""
        P, L, n_heads, dim = q.shape
        scores = torch.bmm(q.float().view(P, L * n_heads, dim), keys.float().transpose(1, 2))  # [P, L*nI, n]
        scores = scores.view(P, L, n_heads, -1).relu_().mul_(self.head_dim**-0.5)  # in place: a fresh tensor
        weights = (head_weights.float() * self.n_heads**-0.5).unsqueeze(-1)  # [P, L, nI, 1]
        scores = scores.mul_(weights).sum(dim=2)  # [P, L, n]
        visible_count = counts.unsqueeze(-1)
        n = scores.shape[-1]
        entry = torch.arange(n, device=scores.device)
        scores = scores.masked_fill(entry >= visible_count, float("-inf"))
        picks = top_k_lowest_index_on_ties(scores, min(self.topk, n))
        return torch.where(picks >= visible_count, torch.full_like(picks, -1), picks)


def top_k_lowest_index_on_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [..., n] -> [..., k] indices of the k largest scores, best first (by score descending, then index
    ascending); among scores equal to the k-th largest the lowest indices are taken. Why: relu gives many
    entries a score of exactly 0 whatever the batch or chunk shape, and topk breaks such ties by its own
    internal order, which differs between a decode row and a prefill chunk; the attention would then see
    different entries for the same token.

    One topk over a composite int64 key, the score's order-preserving integer image above the reversed
    index: keys are distinct, so the top k are the brute-force ranking's (score desc, index asc) whatever
    order topk scans them in, and topk returns them by key, descending: the ranking's order, the same for a
    decode row and a prefill chunk. (No sort into index order: whoever sums over the picks may take them in
    any fixed order, and a sort of k picks cost the compiled tiny decode step ~1.5%.)"""
    n = scores.shape[-1]  # < 2^32: the key's index bits (a cache row holds far fewer entries)
    # -0.0 and 0.0 compare equal (a tie), but their bits differ: one zero first.
    bits = torch.where(scores == 0, 0.0, scores).view(torch.int32)
    # Negative floats' magnitude bits count the wrong way as signed integers: flip them.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    reversed_index = n - 1 - torch.arange(n, device=scores.device, dtype=torch.int64)  # lower index: larger key
    keys = ordered * (1 << 32) + reversed_index
    return keys.topk(k, dim=-1).indices


class Attention(nn.Module):
    """Under tensor parallelism (`parallel`) a rank holds whole output-projection groups, g / N of them, and
    the H / N query heads they read (q up-projection rows, sinks); the shared KV head, q down-projection,
    compressors and indexer are replicated. The output is each rank's partial wo_b sum, all-reduced."""

    def __init__(self, cfg: ModelConfig, layer_type: str, dtype: torch.dtype, kernels: KernelRegistry | None = None,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        kernels = kernels or default_registry()
        self.kernels = kernels
        self.layer_type = layer_type
        self.parallel = parallel
        self.n_heads = parallel.local(cfg.num_attention_heads)
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.o_groups = parallel.local(cfg.o_groups)
        self.o_lora_rank = cfg.o_lora_rank
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype, kernels)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, kernels)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype, kernels)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, dtype, kernels)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        group_in = self.n_heads * self.head_dim // self.o_groups
        self.wo_a = Linear(group_in, self.o_groups * self.o_lora_rank, dtype, kernels)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, cfg.hidden_size, dtype, kernels)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.eps = cfg.rms_norm_eps
        # Sliding layers rotate with the main table; CSA/HCA layers use the compress table for everything.
        self.rope = RotaryTable(cfg.rope_main if layer_type == SLIDING else cfg.rope_compress, kernels)
        self.compressor = None
        self.indexer = None
        if layer_type != SLIDING:
            rate = cfg.compress_rate(layer_type)
            self.compressor = Compressor(cfg, rate, self.head_dim, overlap=layer_type == CSA, dtype=dtype,
                                         kernels=kernels)
        if layer_type == CSA:
            self.indexer = Indexer(cfg, dtype, kernels)
        # The projections of the layer input x, and of the q low-rank rows: each set one kernel call at decode.
        from_x = [self.wq_a, self.wkv]
        from_q = [self.wq_b]
        if self.compressor is not None:
            from_x += [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            from_x += [self.indexer.compressor.wkv, self.indexer.compressor.wgate, self.indexer.weights_proj]
            from_q += [self.indexer.wq_b]
        self.from_x, self.from_q = SharedInputLinears(*from_x), SharedInputLinears(*from_q)

    def bind_kernels(self) -> None:
        """At finalize (`process_weights_after_loading`, every one): bind the shared-input products."""
        self.from_x.bind_kernels(self.kernels)
        self.from_q.bind_kernels(self.kernels)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        """x [T, D] (normed block input) -> [T, D]; reads and extends each sequence's cache slot."""
        T, pos, dr = x.shape[0], batch.positions, batch.decode_rows  # dr: `Linear.forward`'s decode_rows
        q_a, kv, *x_side = self.from_x(x, dr)  # wq_a, wkv, then the compressors' and the indexer's (`__init__`)
        q_res = self.q_norm(q_a, inplace=True)  # [T, ql]
        q, *q_side = self.from_q(q_res, dr)
        # Per-head unweighted norm, then RoPE: [T, H, hd]
        q = norm_rope_(q.view(T, self.n_heads, self.head_dim), self.eps, None, pos, self.rope)
        kv = norm_rope_(kv, self.kv_norm.eps, self.kv_norm.weight, pos, self.rope)  # [T, hd]

        side = _SideInputs()
        if self.compressor is not None:  # raw projections (gate before ape): the compressor's ring holds them
            side.comp_kv, side.comp_gate = x_side[:2]
        if self.indexer is not None:
            side.idx_kv, side.idx_gate, side.idx_w = x_side[2:]
            side.idx_q = norm_rope_(q_side[0].view(T, self.indexer.n_heads, -1), None, None, pos, self.rope)

        decode, prefill = batch.plan.decode, batch.plan.prefill
        if decode is not None and decode.pure:  # its rows are the whole flat batch, in segment order: no gather
            out = self._decode(q, kv, decode, cache, side)
        else:
            out = torch.empty_like(q)
            if decode is not None:
                rows = decode.rows
                out[rows] = self._decode(q[rows], kv[rows], decode, cache, side.rows(rows))
            if prefill is not None:
                padded = self._prefill(q, kv, prefill, cache, side)  # [P, L, H, hd]
                if prefill.dense_rows is not None:  # no padding: the chunks are one run of flat rows
                    out[prefill.dense_rows] = padded.flatten(0, 1)
                else:
                    out[prefill.rows] = padded[prefill.valid]
        # V carried RoPE: de-rotate at the query position
        return self._project_out(norm_rope_(out, None, None, pos, self.rope, inverse=True), dr)

    def _decode(
        self, q: torch.Tensor, kv: torch.Tensor, meta: DecodeMeta, cache: LayerCache, side: "_SideInputs"
    ) -> torch.Tensor:
        """Batched path for B single-token segments: q [B, H, hd], kv [B, hd] -> [B, H, hd]. Rows of one token
        each run the registry's C kernel when it has one for the call (this torch code is its reference)."""
        if meta.spans is None:
            args = attend_args(self, q, kv, meta, cache, side)
            kernel = self.kernels.kernel(DECODE_ATTENTION, *args)
            if kernel is not None:
                return kernel.serve_layer(self, meta, cache, side, args)
        ring_rows, window_bias = meta.window(self.window)
        displaced = meta.displaced(self.window)  # multi-row segments: the ring rows they overwrite, read first
        if displaced is not None:
            displaced_rows, displaced_bias = displaced
            displaced_keys = cache.window.view(-1, self.head_dim).index_select(0, displaced_rows)
        cache.window.index_put_((meta.slots, ring_rows), kv)
        # [B, W, hd]; ring row i holds the latest position = i (mod W), <= the segment's last position
        blocks = [(meta.read(cache.window), window_bias)]
        if displaced is not None:
            blocks.append((displaced_keys.view(*displaced_bias.shape, self.head_dim), displaced_bias))
        if self.compressor is not None:
            comp, rate = cache.compressor, self.compressor.rate
            self._emit(side, meta, cache)
            n = meta.entry_reads(rate)
            if n > 0:
                if self.indexer is not None:
                    # CSA: attend to the k picked entries only (gathered), not to all n with a mask.
                    index_keys = meta.read(cache.indexer.entries, n)  # [B, n, dI]
                    picks = self.indexer.select(side.idx_q.unsqueeze(1), side.idx_w.unsqueeze(1), index_keys,
                                                meta.entry_counts(rate).unsqueeze(1)).squeeze(1)  # [B, k]
                    entries = gather_entries(comp.entries, meta.slots, picks.clamp(min=0))  # [B, k, hd]
                    blocks.append((entries, mask_to_bias(picks >= 0)))
                else:
                    blocks.append((meta.read(comp.entries, n), meta.entry_bias(rate)))  # [B, n, hd]
        return self._attend_decode(q, blocks)

    def compressor_parts(self, side: "_SideInputs", cache: LayerCache) -> list[tuple]:
        """(compressor, raw kv, raw gate, its cache) of the layer's compressors: the indexer's too on CSA layers."""
        if self.compressor is None:
            return []
        parts = [(self.compressor, side.comp_kv, side.comp_gate, cache.compressor)]
        if self.indexer is not None:
            parts.append((self.indexer.compressor, side.idx_kv, side.idx_gate, cache.indexer))
        return parts

    def _emit(self, side: "_SideInputs", meta: DecodeMeta | PrefillMeta, cache: LayerCache) -> None:
        """Both compressors (the indexer's too, on CSA layers) record the step's tokens and pool the
        windows the plan names."""
        for comp, kv, gate, comp_cache in self.compressor_parts(side, cache):
            windows = meta.windows(comp.rate, comp_cache.ring_kv.shape[1], comp.overlap)
            comp.emit(kv, gate, windows, comp_cache, self.rope)

    def _prefill(
        self, q: torch.Tensor, kv: torch.Tensor, meta: PrefillMeta, cache: LayerCache, side: "_SideInputs"
    ) -> torch.Tensor:
        """Batched path for meta's P segments: q [T, H, hd], kv [T, hd] and side are the whole flat batch
        -> padded [P, L, H, hd] (rows past a segment's length are padding)."""
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
            self._emit(side, meta, cache)
            # Entries past a segment's own count are masked.
            keys[:, h + L : h + L + n_max] = meta.read(cache.compressor.entries, n_max)
            if self.indexer is not None:
                index = cache.indexer
                # With at most topk entries every visible entry is picked: the causal bias is the picks'.
                if n_max > self.indexer.topk:
                    index_keys = meta.read(index.entries, n_max)
                    idx_q, idx_w = meta.padded(side.idx_q), meta.padded(side.idx_w)
                    picks = self.indexer.select(idx_q, idx_w, index_keys, counts)  # [P, L, k]
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
        # Whole segments are written in place (out= ops keep no autograd history: not when training).
        in_place = block == L and not torch.is_grad_enabled()
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
                tile_out = out[p0:p1] if in_place else None
                tile_out = self._attend_tile(q[p0:p1, r0:r1], block_keys[p0:p1], block_bias[p0:p1], tile_out)
                if not in_place:
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
        logits = bf16_products.bmm(q.reshape(P, B * H, hd), keys.transpose(1, 2)).view(P, B, H, -1).float()  # [P,B,H,N]
        # bias + scale * q.k, in place unless autograd records the step (out= ops keep no history)
        logits = torch.add(bias.unsqueeze(2), logits, alpha=self.head_dim**-0.5,
                           out=None if torch.is_grad_enabled() else logits)
        probs = softmax_with_sink(logits, self.attn_sink).to(keys.dtype)
        if out is None:
            return bf16_products.bmm(probs.view(P, B * H, -1), keys).view(P, B, H, hd)
        bf16_products.bmm(probs.view(P, B * H, -1), keys, out=out.view(P, B * H, hd))
        return out

    def _attend_decode(self, q: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Attention per row over score blocks: q [B, H, hd], blocks of (keys (= values) [B, N_i, hd],
        bias [B, N_i]) -> [B, H, hd]. One softmax spans every block's logits and the per-head sink, so
        this equals attending over the concatenated keys; only the small [B, H, N] logits are
        concatenated, never the keys (which may be views into the cache)."""
        scale = self.head_dim**-0.5
        if q.dtype == torch.float32:  # one fused GEMM per block: bias + scale * q k^T
            logits = [torch.baddbmm(bias.unsqueeze(1), q, keys.transpose(1, 2), alpha=scale) for keys, bias in blocks]
        else:
            logits = [bf16_products.bmm(q, keys.transpose(1, 2)).float() * scale + bias.unsqueeze(1)
                      for keys, bias in blocks]
        sink_column = logits[0].new_empty(q.shape[0], q.shape[1], 1)
        probs = softmax_with_sink(torch.cat((*logits, sink_column), dim=-1), self.attn_sink).to(q.dtype)
        out, start = None, 0
        for keys, _ in blocks:
            block_probs = probs[..., start : start + keys.shape[1]]  # [B, H, N_i]
            out = bf16_products.bmm(block_probs, keys) if out is None else bf16_products.baddbmm(out, block_probs, keys)
            start += keys.shape[1]
        return out

    def _project_out(self, out: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """Grouped low-rank output: heads split into g groups, each mapped to ol by its own block of wo_a."""
        T = out.shape[0]
        product = self.wo_a.product
        if product is not None and not torch.compiler.is_compiling():  # the few-row kernel, groups in one call
            rows = out.reshape(T, -1)
            if product.supports_grouped(rows, self.o_groups, decode_rows):
                return all_reduce(self.wo_b(product.grouped(rows, self.o_groups), decode_rows), self.parallel)
        grouped = out.reshape(T, self.o_groups, -1).transpose(0, 1)  # [g, T, (H/g)*hd]
        wo_a = compute_weight(self.wo_a.weight, grouped.dtype)
        wo_a = wo_a.view(self.o_groups, self.o_lora_rank, -1).transpose(1, 2)  # [g, (H/g)*hd, ol]
        # One bmm over the groups (an einsum plans the same product per call: 2-3x its cost at a decode row)
        low_rank = bf16_products.bmm(grouped, wo_a).transpose(0, 1).reshape(T, -1)  # [T, g*ol]
        return all_reduce(self.wo_b(low_rank, decode_rows), self.parallel)  # tensor parallel: the ranks' groups summed


@dataclass
class _SideInputs:
    """A row range's compressor / indexer projections (None where the layer has no such part)."""

    comp_kv: torch.Tensor | None = None
    comp_gate: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None
    idx_gate: torch.Tensor | None = None
    idx_q: torch.Tensor | None = None
    idx_w: torch.Tensor | None = None

    def rows(self, rows) -> "_SideInputs":
        """The same projections of rows `rows` only."""
        return _SideInputs(*(None if t is None else t[rows] for t in vars(self).values()))


def softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Attention probabilities with a per-head sink logit that takes mass but adds no value.

    Args:
        logits: fp32 [..., N + 1] scaled, biased scores whose last column is reserved for the sink
            (overwritten here); whatever multiplies the probabilities must give that column a zero value
            (a zero key) or drop it.
        sink: the sink logits, broadcastable to logits[..., -1] (per head).

    Returns:
        fp32 [..., N + 1] softmax over the N scores and the sink.
    """
    logits[..., -1] = sink
    return logits.softmax(dim=-1)


def gather_entries(entries: torch.Tensor, slots: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """entries [S, n, d] (a contiguous cache), slots [B], picks [B, k] -> entries[slots[b], picks[b, j]]
    [B, k, d]: one index_select over the flattened rows, several times cheaper than 2-D advanced indexing."""
    S, n, d = entries.shape
    flat_rows = (slots.unsqueeze(-1) * n + picks).view(-1)  # [B*k]
    return entries.view(S * n, d).index_select(0, flat_rows).view(*picks.shape, d)
