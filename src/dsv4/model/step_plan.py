"""The step plan: the index tensors every attention layer of one forward shares.

`ForwardBatch.build` (called once per step by the model runner) makes the step's `StepPlan`; each layer
reads it from the batch: positions, slots, masks, ring rows, completed windows. The index bookkeeping so
costs a few ops per step instead of a few per layer; what a layer asks for first (per window size or
compress rate) is built then and kept in the plan for the step's other layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dsv4.model.batch import Segment


class _Memo:
    """Per-step lazily built values, keyed by what they depend on (window size, compress rate)."""

    def __init__(self):
        self._memo: dict = {}

    def _cached(self, key, build):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


@dataclass(frozen=True)
class StepPlan:
    """The step's plans: `decode` for its single-token rows, `prefill` for its longer chunks (each None
    when the step has no such rows)."""

    decode: DecodeMeta | None
    prefill: PrefillMeta | None

    @property
    def single_tokens(self) -> bool:
        """A decode step: every row is one sequence's next token (no prefill chunk, no multi-row span)."""
        return self.prefill is None and self.decode is not None and self.decode.spans is None

    @classmethod
    def of_segments(cls, segments: Sequence[Segment], num_rows: int, device: torch.device,
                    decode_span: int = 1, positions: torch.Tensor | None = None) -> StepPlan:
        """The plan of a flat batch of num_rows rows cut into `segments`: segments of at most
        `decode_span` tokens go to the decode path (each token a row of its own), longer ones to the
        prefill path. `positions`: the batch's [num_rows] positions tensor, when it has one."""
        if decode_span < 1:
            raise ValueError(f"decode_span must be >= 1, got {decode_span}")
        if segments and num_rows == len(segments):  # every segment one token (none is empty): a decode step
            return cls(decode=DecodeMeta.of_single_tokens(segments, True, device, positions), prefill=None)
        rows = [seg for seg in segments if seg.length <= decode_span]
        chunks = [seg for seg in segments if seg.length > decode_span]
        pure = not chunks
        return cls(decode=DecodeMeta.of_segments(rows, pure, device, positions) if rows else None,
                   prefill=PrefillMeta(chunks, num_rows, device) if chunks else None)


@dataclass(frozen=True)
class WindowPlan:
    """Where a compressor finds the tokens of the windows it pools this step, and where it writes.

    The new tokens' raw projections go to the ring at `ring_index` (slots, position % R) from rows
    `src_rows` of the layer input (None: every row, in order). The windows' tokens are read from a
    flat source viewed as rows of out_dim channels, which `source_rows` [count * S] indexes: the ring
    itself once the step's tokens are written when `from_ring` (rows of one token each: every token of
    their windows is then in the ring), else [the layer input's rows | the ring rows `history_rows`, read
    before the ring is written (None: no window needs them)]. Overlapping (width 2 out_dim, so token r is
    half-rows 2r (Ca) and 2r + 1 (Cb)): S = 2m slots, Ca of window w - 1's tokens then Cb of window w's;
    otherwise S = m, window w's tokens.
    Entry `window_ids` [count] of slot `window_slots` [count] is written, only where `complete` [count]
    when given (a compiled step pools every row's current window and keeps the completed ones).
    `empty_slot_bias` [count, S, 1] fp32 (or None: none) is added to the gates: -inf on the slots that
    weigh nothing (window 0's previous-window slots), 0 elsewhere."""

    ring_index: tuple[torch.Tensor, torch.Tensor]
    src_rows: torch.Tensor | None
    history_rows: torch.Tensor | None
    source_rows: torch.Tensor
    window_ids: torch.Tensor
    window_slots: torch.Tensor
    empty_slot_bias: torch.Tensor | None
    complete: torch.Tensor | None
    count: int
    from_ring: bool = False


def _window_slots(rate: int, overlap: bool, device: torch.device) -> torch.Tensor:
    """[S] each pooled slot's offset from its window's first position (negative: the previous window)."""
    return torch.arange(-rate if overlap else 0, rate, device=device)


def _empty_slot_bias(first: torch.Tensor | None, slot: torch.Tensor) -> torch.Tensor | None:
    """[E] windows with id 0 -> [E, S, 1] fp32 gate bias, -inf on their previous-window slots (None stays None).
    An additive bias, not a mask: adding it broadcast over the channels is one vectorised pass, where a
    masked_fill of the [E, S, d] gates walks every element through a per-element mask (~10x slower)."""
    if first is None:
        return None
    return mask_to_bias(~(first.unsqueeze(-1) & (slot < 0))).unsqueeze(-1)


def _half_rows(rows: torch.Tensor, slot: torch.Tensor, overlap: bool) -> torch.Tensor:
    """[E, S] source token rows -> [E * S] rows of the out_dim view (Ca half before the window, Cb in it)."""
    return (rows * 2 + (slot >= 0) if overlap else rows).reshape(-1)


class DecodeMeta(_Memo):
    """The index tensors of a step's decode rows, shared by every layer (each layer's caches differ, the
    slots / positions / masks do not).

    A row is one token of a short segment: a decode step's token, or one of the k + 1 tokens of a verify
    chunk (`StepPlan.of_segments`' decode_span), which are decoded as rows of the same slot, each seeing
    only its own and earlier positions. The chunk writes its tokens into the window ring before the rows
    read it, so ring row p % W then holds the chunk's position p, not the position p - W that the
    chunk's earlier rows still see: those rows, read before the write, come as a separate "displaced"
    block (`displaced`). Compressor windows that a row completes pool the chunk's earlier tokens from the
    layer input, not from the ring (`windows`).

    Built from the segments (eager: the host knows each row's position, so only the rows completing a
    compressor window pool one, and each layer reads as many entries as the furthest row has) or from
    tensors (`of_tensors`, inside a compiled graph: single-token rows only; every row pools its current
    window and keeps it only when complete; `reads` fixes the entries read per compress rate)."""

    def __init__(self, pos: torch.Tensor, slots: torch.Tensor, rows, pure: bool, host_positions: list[int] | None,
                 reads: dict[int, int] | None, slot_range: slice | None,
                 spans: tuple[list[int], list[int]] | None = None):
        super().__init__()
        self.pos, self.slots, self.rows, self.pure = pos, slots, rows, pure  # [B] positions, [B] cache slots
        self.device = pos.device
        self.host_positions = host_positions
        self.reads = reads
        # Rows whose slots are one ascending run (the usual steady decode batch) read every cache as a
        # slice, a view: no per-layer copy of each row's window ring and entries.
        self.slot_range = slot_range
        # Per row, the first and the last position of its segment (host lists), or None when every
        # segment is a single token (each row's own position).
        self.spans = spans

    @classmethod
    def of_segments(cls, segs: Sequence[Segment], pure: bool, device: torch.device,
                    positions: torch.Tensor | None = None) -> DecodeMeta:
        """The rows of `segs`; `positions`: the batch's [T] positions tensor, reused when the rows are the
        whole batch (`pure`) instead of built again."""
        if all(seg.end - seg.begin == 1 for seg in segs):
            return cls.of_single_tokens(segs, pure, device, positions)
        host_positions, slot_ids, flat_rows, firsts, lasts = [], [], [], [], []
        for seg in segs:
            host_positions.extend(range(seg.start, seg.start + seg.length))
            slot_ids.extend([seg.slot] * seg.length)
            flat_rows.extend(range(seg.begin, seg.end))
            firsts.extend([seg.start] * seg.length)
            lasts.extend([seg.start + seg.length - 1] * seg.length)
        pos = positions if pure and positions is not None else torch.tensor(host_positions, device=device)
        rows = slice(None) if pure else torch.tensor(flat_rows, device=device)
        # One slot per segment repeated over its rows: never one ascending run, so no slot range.
        return cls(pos, torch.tensor(slot_ids, device=device), rows, pure, host_positions, None, None,
                   (firsts, lasts))

    @classmethod
    def of_single_tokens(cls, segs: Sequence[Segment], pure: bool, device: torch.device,
                         positions: torch.Tensor | None = None) -> DecodeMeta:
        """`of_segments` when every segment is one token (a decode step): one row per segment, no spans."""
        host_positions, slot_ids = [seg.start for seg in segs], [seg.slot for seg in segs]
        rows = slice(None) if pure else torch.tensor([seg.begin for seg in segs], device=device)
        pos = positions if pure and positions is not None else torch.tensor(host_positions, device=device)
        first = slot_ids[0]
        contiguous = slot_ids == list(range(first, first + len(slot_ids)))
        return cls(pos, torch.tensor(slot_ids, device=device), rows, pure, host_positions, None,
                   slice(first, first + len(slot_ids)) if contiguous else None)

    @classmethod
    def of_tensors(cls, pos: torch.Tensor, slots: torch.Tensor, reads: dict[int, int]) -> DecodeMeta:
        """A pure-decode step from its [B] positions and slots; reads: entries read per compress rate."""
        return cls(pos, slots, slice(None), True, None, reads, None)

    def read(self, cache_rows: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """cache_rows [slots, N, ...] -> each row's slot's first `count` (all when None) entries
        [B, count, ...]: a view when the slots are one ascending run, else a gather (a copy)."""
        rows = self.slot_range if self.slot_range is not None else self.slots
        return cache_rows[rows] if count is None else cache_rows[rows, :count]

    def window(self, W: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring row of each token, [B, W] bias of the ring after the step's writes): ring row i holds the
        latest position = i (mod W) up to the row's segment's last position; held > pos - W always, so
        only never-written rows and, in a multi-row segment, the later rows' positions are hidden."""
        def build():
            self._check_span(W)
            pos = self.pos.unsqueeze(-1)
            last = pos if self.spans is None else self._span_tensor(1).unsqueeze(-1)
            held = last - (last - torch.arange(W, device=self.device)) % W
            visible = held >= 0 if self.spans is None else (held >= 0) & (held <= pos)
            return self.pos % W, mask_to_bias(visible)
        return self._cached(("window", W), build)

    def displaced(self, W: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For multi-row segments (None when there are none): ([B * D] flat rows of a [S * W, hd] window
        ring, [B, D] bias), D the longest segment: the ring rows that the row's segment overwrites, to be
        read before the write. Row j of the segment held position first + j - W, which the segment's rows
        before j still see (and rows from j on see the chunk's own position first + j instead)."""
        if self.spans is None:
            return None

        def build():
            self._check_span(W)
            first, last = (self._span_tensor(i).unsqueeze(-1) for i in (0, 1))
            span = max(b - a for a, b in zip(*self.spans)) + 1
            written = first + torch.arange(span, device=self.device)  # [B, D] positions the segment writes
            visible = (written <= last) & (written > self.pos.unsqueeze(-1)) & (written - W >= 0)
            flat_rows = self.slots.unsqueeze(-1) * W + written % W
            return flat_rows.view(-1), mask_to_bias(visible)
        return self._cached(("displaced", W), build)

    def _span_tensor(self, which: int) -> torch.Tensor:
        """[B] the first (which=0) or last (1) position of each row's segment."""
        return self._cached(("span", which), lambda: torch.tensor(self.spans[which], device=self.device))

    def _check_span(self, ring_len: int) -> None:
        """A segment longer than a ring would write one of its rows twice in a step."""
        if self.spans is not None:
            longest = max(b - a for a, b in zip(*self.spans)) + 1
            if longest > ring_len:
                raise ValueError(f"a decode-path segment of {longest} tokens does not fit a ring of {ring_len} rows "
                                 f"(decode_span must be at most every ring's length)")

    def entry_reads(self, rate: int) -> int:
        """How many entries each row reads: the given `reads`, else the most any row has completed."""
        if self.reads is not None:
            return self.reads[rate]
        return max((p + 1) // rate for p in self.host_positions)

    def entry_counts(self, rate: int) -> torch.Tensor:
        """[B] complete entries per row."""
        return self._cached(("counts", rate), lambda: (self.pos + 1) // rate)

    def entry_bias(self, rate: int) -> torch.Tensor:
        """[B, n] bias of the n = entry_reads(rate) entries read: each row sees its complete ones."""
        def build():
            n = self.entry_reads(rate)
            return mask_to_bias(torch.arange(n, device=self.device) < self.entry_counts(rate).unsqueeze(-1))
        return self._cached(("entry_bias", rate), build)

    def windows(self, rate: int, ring_len: int, overlap: bool) -> WindowPlan:
        """The WindowPlan of the rows' windows (compressor rate m, ring of ring_len >= the window's span):
        with host positions, the rows whose token completes window p // m; else every row's (`complete`)."""
        def build():
            self._check_span(ring_len)  # the ring writes below must hit distinct rows
            B, m, device = self.pos.shape[0], rate, self.device
            ring_index = (self.slots, self.pos % ring_len)
            complete = first = None
            if self.host_positions is None:
                rows = torch.arange(B, device=device)
                complete, first = (self.pos + 1) % m == 0, (self.pos < m if overlap else None)
            else:
                done = [b for b, p in enumerate(self.host_positions) if (p + 1) % m == 0]
                if not done:  # the common step: the tokens only go to the ring
                    empty = self.pos[:0]
                    return WindowPlan(ring_index, None, None, empty, empty, empty, None, None, 0)
                rows = torch.tensor(done, dtype=torch.long, device=device)
                if overlap and any(self.host_positions[b] < m for b in done):
                    first = self.pos.index_select(0, rows) < m
            pos, slots = self.pos.index_select(0, rows), self.slots.index_select(0, rows)  # [E]
            E = rows.shape[0]
            slot = _window_slots(m, overlap, device)
            token_pos = ((pos // m).unsqueeze(-1) * m + slot).clamp(min=0)  # [E, S]
            history = None
            if self.spans is None:  # one token per row: its window's tokens are in the ring once it is written
                # (read from the ring after the write: a compiled graph then scatters into the ring in place,
                # where a read before the write made it copy the whole ring twice)
                source = slots.unsqueeze(-1) * ring_len + token_pos % ring_len
            else:
                # The window's tokens from the row's segment come from the layer input (the segment's rows
                # are consecutive: position p is row b - (pos_b - p)), its earlier ones from the ring (read
                # before the step's tokens are written; in a kept window no slot lies after the row's token).
                in_ring = B + torch.arange(E, device=device).unsqueeze(-1) * ring_len + token_pos % ring_len
                segment_first = self._span_tensor(0).index_select(0, rows).unsqueeze(-1)
                in_step = rows.unsqueeze(-1) - (pos.unsqueeze(-1) - token_pos)
                source = torch.where(token_pos >= segment_first, in_step, in_ring)
                history = (slots.unsqueeze(-1) * ring_len + torch.arange(ring_len, device=device)).view(-1)
            return WindowPlan(
                ring_index=ring_index, src_rows=None, history_rows=history,
                source_rows=_half_rows(source, slot, overlap), window_ids=pos // m, window_slots=slots,
                empty_slot_bias=_empty_slot_bias(first, slot), complete=complete, count=E, from_ring=self.spans is None,
            )
        return self._cached(("windows", rate, ring_len, overlap), build)


class PrefillMeta(_Memo):
    """The index tensors of a step's batched segments, padded to the longest chunk L, built once per step
    and shared by every layer. Padded row t of segment p is flat row begin_p + min(t, len_p - 1)
    (a duplicate of its last token, masked out everywhere).

    Attention keys are laid out per segment as [h window-ring tokens before the chunk | the L chunk
    tokens | n compressed entries | one zero key for the sink], n = 0 on sliding layers."""

    def __init__(self, segments: Sequence[Segment], num_rows: int, device: torch.device):
        super().__init__()
        self.device = device
        self.num_rows = num_rows  # T: rows of the flat batch every layer input has
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

    def windows(self, rate: int, ring_len: int, overlap: bool) -> WindowPlan:
        """The WindowPlan of the windows the segments complete (compressor rate m, ring of ring_len)."""
        def build():
            history, _, history_rows = self._history(ring_len, ring_len)  # h, [P * h] flat ring rows
            first_window, end_window = self.starts // rate, self.ends // rate  # windows [first, end) complete
            counts = end_window - first_window  # [P]
            window_seg = torch.repeat_interleave(torch.arange(len(counts), device=self.device), counts)  # [E]
            offsets = torch.cumsum(counts, 0) - counts
            within = torch.arange(window_seg.numel(), device=self.device) - offsets[window_seg]
            window_ids = first_window[window_seg] + within  # [E]
            first = window_ids == 0  # fresh sequences' first windows
            slot = _window_slots(rate, overlap, self.device)
            # [E, S] positions; window 0's previous-window slots (negative) are clamped to position 0 (masked).
            token_pos = (window_ids.unsqueeze(-1) * rate + slot).clamp(min=0)
            start = self.starts[window_seg].unsqueeze(-1)
            in_chunk = self.begins[window_seg].unsqueeze(-1) + token_pos - start
            in_ring = self.num_rows + window_seg.unsqueeze(-1) * history + token_pos - (start - history)
            rows = torch.where(token_pos >= start, in_chunk, in_ring)  # [E, S] source token rows
            ring_rows, src_rows = self.ring_writes(ring_len)
            return WindowPlan(
                ring_index=(ring_rows // ring_len, ring_rows % ring_len), src_rows=src_rows,
                history_rows=history_rows if bool((rows >= self.num_rows).any()) else None,
                source_rows=_half_rows(rows, slot, overlap), window_ids=window_ids,
                window_slots=self.slots[window_seg],
                empty_slot_bias=_empty_slot_bias(first, slot) if overlap and bool(first.any()) else None,
                complete=None,
                count=window_ids.numel(),
            )
        return self._cached(("windows", rate, ring_len, overlap), build)


def mask_to_bias(visible: torch.Tensor) -> torch.Tensor:
    """Boolean visibility -> fp32 additive attention bias (0 visible, -inf hidden)."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(~visible, float("-inf"))
