"""The per-step index plan every attention layer of one forward shares.

Built once per step from the ForwardBatch (positions, slots, masks, ring rows, completed windows), then
read by each layer's batched decode / prefill path, so the index bookkeeping costs a few ops per step
instead of a few per layer.
"""

import torch

from dsv4.model.batch import ForwardBatch, Segment


class DecodeMeta:
    """The index tensors of a step's single-token rows, built once per step and shared by every layer
    (each layer's caches differ, the slots / positions / masks do not)."""

    def __init__(self, batch: ForwardBatch):
        segs = [seg for seg in batch.segments if seg.length == 1]
        device = batch.positions.device
        self.batch = batch  # keeps the keyed batch alive, so its id is never reused while memoised
        self.count = len(segs)
        self.pure = len(segs) == len(batch.segments) and len(segs) == batch.positions.shape[0]
        self.rows = slice(None) if self.pure else torch.tensor([seg.begin for seg in segs], device=device)
        self.positions = [seg.start for seg in segs]
        self.device = device
        slot_ids = [seg.slot for seg in segs]
        self.slots = torch.tensor(slot_ids, device=device)
        # Rows whose slots are one ascending run (the usual steady decode batch) read every cache as a
        # slice, a view: no per-layer copy of each row's window ring and entries.
        first = slot_ids[0] if slot_ids else 0
        contiguous = slot_ids == list(range(first, first + len(slot_ids)))
        self.slot_range = slice(first, first + len(slot_ids)) if contiguous else None
        self.pos = torch.tensor(self.positions, device=device)
        self._memo: dict = {}

    def read(self, cache_rows: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """cache_rows [slots, N, ...] -> each row's slot's first `count` (all when None) entries
        [B, count, ...]: a view when the slots are one ascending run, else a gather (a copy)."""
        rows = self.slot_range if self.slot_range is not None else self.slots
        return cache_rows[rows] if count is None else cache_rows[rows, :count]

    def _cached(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def ring_rows(self, ring_len: int) -> torch.Tensor:
        return self._cached(("ring", ring_len), lambda: self.pos % ring_len)

    def window(self, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring row of each token, [B, W] bias): ring row i holds the latest position = i (mod W), <= pos;
        held > pos - W always, so only never-written rows are hidden."""
        def build():
            pos = self.pos.unsqueeze(-1)
            held = pos - (pos - torch.arange(W, device=self.device)) % W
            return self.ring_rows(W), mask_to_bias(held >= 0)
        return self._cached(("window", W), build)

    def entry_counts(self, rate: int) -> tuple[int, torch.Tensor]:
        """(most complete entries of any row, [B] complete entries per row)."""
        return self._cached(("counts", rate),
                            lambda: (max((p + 1) // rate for p in self.positions), (self.pos + 1) // rate))

    def entry_bias(self, rate: int) -> torch.Tensor:
        def build():
            n_max, counts = self.entry_counts(rate)
            return mask_to_bias(torch.arange(n_max, device=self.device) < counts.unsqueeze(-1))
        return self._cached(("entry_bias", rate), build)

    def completed(self, rate: int):
        """Rows whose token completes a window: (row list, window list, their slots, window ids tensor)."""
        def build():
            done = [b for b, p in enumerate(self.positions) if (p + 1) % rate == 0]
            if not done:
                return done, [], None, None
            windows = [self.positions[b] // rate for b in done]
            slots = self.slots[torch.tensor(done, device=self.device)]
            return done, windows, slots, torch.tensor(windows, device=self.device)
        return self._cached(("done", rate), build)


class PrefillMeta:
    """The index tensors of a step's batched segments, padded to the longest chunk L, built once per step
    and shared by every layer. Padded row t of segment p is flat row begin_p + min(t, len_p - 1)
    (a duplicate of its last token, masked out everywhere).

    Attention keys are laid out per segment as [h window-ring tokens before the chunk | the L chunk
    tokens | n compressed entries | one zero key for the sink], n = 0 on sliding layers."""

    def __init__(self, batch: ForwardBatch, segments: list[Segment]):
        device = batch.positions.device
        self.batch = batch  # keeps the keyed batch alive, so its id is never reused while memoised
        self.device = device
        self.num_rows = batch.positions.shape[0]  # T: rows of the flat batch every layer input has
        longest = max(seg.length for seg in segments)
        self.shape = (len(segments), longest)  # (P, L)
        self.max_start = max(seg.start for seg in segments)
        slot_ids = [seg.slot for seg in segments]
        self.slots = torch.tensor(slot_ids, device=device)  # [P]
        # Slots that are one ascending run (fresh prompts admitted together) read the caches as a view.
        first = slot_ids[0]
        ascending = slot_ids == list(range(first, first + len(slot_ids)))
        self.slot_range = slice(first, first + len(slot_ids)) if ascending else None
        self.starts = torch.tensor([seg.start for seg in segments], device=device)  # [P]
        lengths = torch.tensor([seg.length for seg in segments], device=device)  # [P]
        self.ends = self.starts + lengths
        t = torch.arange(longest, device=device)
        self.begins = torch.tensor([seg.begin for seg in segments], device=device)  # [P] flat row of each first token
        self.valid = t < lengths.unsqueeze(-1)  # [P, L]
        self.gather_rows = self.begins.unsqueeze(-1) + torch.minimum(t, lengths.unsqueeze(-1) - 1)  # [P, L] flat rows
        self.rows = self.gather_rows[self.valid]  # [T'] flat rows of the valid padded rows, in padded order
        self.positions = self.starts.unsqueeze(-1) + t  # [P, L]
        # Equal-length chunks back to back (a batch of same-length prompts, or one prompt): the padded
        # layout is a slice of the flat batch, so padding is a view instead of a gather.
        b0 = segments[0].begin
        dense = all(seg.length == longest and seg.begin == b0 + p * longest for p, seg in enumerate(segments))
        self.dense_rows = slice(b0, b0 + len(segments) * longest) if dense else None
        self._memo: dict = {}

    def _cached(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] (a flat-batch tensor) -> [P, L, ...] padded chunks: a view when the chunks are dense,
        else one index_select (several times cheaper than indexing with the [P, L] gather_rows)."""
        if self.dense_rows is not None:
            return x[self.dense_rows].unflatten(0, self.shape)
        return x.index_select(0, self.gather_rows.view(-1)).unflatten(0, self.shape)

    def read(self, cache_rows: torch.Tensor, count: int) -> torch.Tensor:
        """cache_rows [S, N, ...] -> each segment's slot's first `count` rows [P, count, ...]: a view when the
        slots are one ascending run, else a gather."""
        if self.slot_range is not None:
            return cache_rows[self.slot_range, :count]
        return cache_rows[:, :count].index_select(0, self.slots)

    def _history(self, ring_len: int, wanted: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(h, [P, h] positions and [P * h] flat ring rows (slot * ring_len + position % ring_len) of the h
        positions before each chunk): h = wanted, trimmed when no segment starts that late (positions < 0 do
        not exist: fresh prompts need no history; their rows are stale and always masked)."""
        h = min(wanted, self.max_start)
        positions = self.starts.unsqueeze(-1) - h + torch.arange(h, device=self.device)
        flat_rows = self.slots.unsqueeze(-1) * ring_len + positions % ring_len
        return h, positions, flat_rows.view(-1)

    def ring_writes(self, ring_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat ring rows slot * ring_len + position % ring_len, flat source rows) of the tokens a ring of
        ring_len keeps: each segment's last ring_len positions (distinct rows, so index_copy_ is exact)."""
        def build():
            keep = self.valid & (self.positions >= (self.ends - ring_len).unsqueeze(-1))  # [P, L]
            dst = self.slots.unsqueeze(-1) * ring_len + self.positions % ring_len
            return dst[keep], self.gather_rows[keep]
        return self._cached(("ring", ring_len), build)

    def window_history(self, W: int) -> torch.Tensor:
        """[P * h] flat rows of a [S * W, hd] window ring holding the h = min(W - 1, latest start) positions
        before each chunk (the first h keys of every segment)."""
        return self._cached(("window", W), lambda: self._history(W, W - 1)[2])

    def entry_counts(self, rate: int) -> tuple[int, torch.Tensor]:
        """(most entries of any segment after the step, [P, L] complete entries each query sees: w < (t+1)//m)."""
        return self._cached(("counts", rate), lambda: (int(self.ends.max()) // rate, (self.positions + 1) // rate))

    def _window_visible(self, W: int) -> torch.Tensor:
        """[P, L, h + L] window keys visible from each query (shared by every layer's bias)."""
        def build():
            _, history_pos, _ = self._history(W, W - 1)
            key_pos = torch.cat((history_pos, self.positions), dim=1)  # [P, h + L]
            key_ok = torch.cat((history_pos >= 0, self.valid), dim=1)
            q_pos, k_pos = self.positions.unsqueeze(-1), key_pos.unsqueeze(1)
            return key_ok.unsqueeze(1) & (k_pos <= q_pos) & (k_pos > q_pos - W)
        return self._cached(("visible", W), build)

    def attention_bias(self, W: int, rate: int | None, causal_entries: bool) -> torch.Tensor:
        """[P, L, h + L + n + 1] additive bias over the key layout (0 visible, -inf hidden; never modify:
        shared by the step's layers). Window key j is visible from query t iff it exists and
        t - W < j <= t. Entries (rate given; n = entry_counts(rate)[0]): entry w is visible iff complete
        (w < (t+1)//m) when causal_entries, else all hidden (the caller shows its picks). Sink column: 0."""
        def build():
            visible = [self._window_visible(W)]  # [P, L, h + L]
            if rate is not None:
                n_max, counts = self.entry_counts(rate)
                entry = torch.arange(n_max, device=self.device)
                visible.append((entry < counts.unsqueeze(-1)) & causal_entries)  # [P, L, n]
            visible.append(torch.ones(*self.shape, 1, dtype=torch.bool, device=self.device))  # the sink
            return mask_to_bias(torch.cat(visible, dim=-1))
        return self._cached(("bias", W, rate, causal_entries), build)

    def compressor(self, rate: int, ring_len: int, overlap: bool) -> "_CompressorPlan":
        def build():
            return _CompressorPlan(self, rate, ring_len, overlap)
        return self._cached(("compressor", rate, ring_len, overlap), build)


class _CompressorPlan:
    """Where the windows completed by a PrefillMeta's segments find their tokens. A compressor reads them
    from a flat source [T flat-batch rows | P * h ring rows] (h positions before each chunk, h <= the ring
    length, which holds the previous window too) viewed as rows of out_dim channels: `source_rows` [E * S]
    indexes that view. Overlapping (width 2 out_dim, so token r is half-rows 2r (Ca) and 2r + 1 (Cb)):
    S = 2m slots, Ca of window w - 1's tokens then Cb of window w's. Otherwise S = m, window w's tokens."""

    def __init__(self, meta: PrefillMeta, rate: int, ring_len: int, overlap: bool):
        device = meta.device
        history, _, self.history_rows = meta._history(ring_len, ring_len)  # h, [P * h] flat ring rows
        first_window, end_window = meta.starts // rate, meta.ends // rate  # windows [first, end) complete
        counts = end_window - first_window  # [P]
        segs = torch.arange(len(counts), device=device)
        window_seg = torch.repeat_interleave(segs, counts)  # [E] segment of each completed window
        offsets = torch.cumsum(counts, 0) - counts
        within = torch.arange(window_seg.numel(), device=device) - offsets[window_seg]
        self.window_ids = first_window[window_seg] + within  # [E]
        self.window_slots = meta.slots[window_seg]  # [E]
        # [F] windows with id 0 (fresh sequences), whose previous-window (Ca) slots weigh nothing; None if none.
        first = (self.window_ids == 0).nonzero().squeeze(1)
        self.first = first if overlap and first.numel() > 0 else None
        slot = torch.arange(-rate if overlap else 0, rate, device=device)  # [S]: offset from the window start
        # [E, S] positions; window 0's previous-window slots (negative) are clamped to position 0 (masked).
        token_pos = (self.window_ids.unsqueeze(-1) * rate + slot).clamp(min=0)
        start = meta.starts[window_seg].unsqueeze(-1)
        in_chunk = meta.begins[window_seg].unsqueeze(-1) + token_pos - start
        in_ring = meta.num_rows + window_seg.unsqueeze(-1) * history + token_pos - (start - history)
        rows = torch.where(token_pos >= start, in_chunk, in_ring)  # [E, S] source token rows
        self.needs_history = bool((rows >= meta.num_rows).any())
        self.source_rows = (rows * 2 + (slot >= 0) if overlap else rows).view(-1)  # [E * S]


_LAST_META: list = [None]
_LAST_PREFILL: list = [None]


def prefill_meta(batch: ForwardBatch, decode_served: bool) -> PrefillMeta:
    """The step's PrefillMeta (memoised on the batch object): every segment, or only the multi-token
    ones when the decode path serves the single-token rows."""
    memo = _LAST_PREFILL[0]
    if memo is None or memo[0] is not batch or memo[1] != decode_served:
        segments = [seg for seg in batch.segments if not (decode_served and seg.length == 1)]
        memo = _LAST_PREFILL[0] = (batch, decode_served, PrefillMeta(batch, segments))
    return memo[2]


def decode_meta(batch: ForwardBatch) -> DecodeMeta | None:
    """The step's DecodeMeta (memoised on the batch object), None when it has no single-token rows."""
    meta = _LAST_META[0]
    if meta is None or meta.batch is not batch:
        if not any(seg.length == 1 for seg in batch.segments):
            return None
        meta = _LAST_META[0] = DecodeMeta(batch)
    return meta


def mask_to_bias(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(~visible, float("-inf"))
