"""DSpark's per-sequence context: the committed target positions a draft block attends to.

For every drafter stage, a ring of context keys in preallocated slots (fixed addresses, nothing
allocated per step):

  rows[stage]  [S, R, hd]   kv_norm(wkv(main_x)) rotated at its position; position t at row t % R

R = window + rollback. A draft for a slot that holds positions [0, L) attends to the last `window` of
them, [L - window, L) (the release's 128-row ring). The `rollback` extra rows keep what a rewind of up to
that many positions needs: rows are only ever written for committed positions, so a rewind only has to
find the older rows still in place. Draft-block keys are never stored here.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.model.cache import check_fork, copy_slot_rows

_HIDDEN = float("-inf")  # additive bias of a context row the draft must not see


@dataclass(frozen=True)
class ContextRows:
    """Where N drafts' context rows sit in the flattened rings, and which of them hold a position."""

    index: torch.Tensor  # [N * window] int64 rows of a ring viewed as [S * R, hd]
    bias: torch.Tensor  # [N, window] fp32: 0 for a committed position, -inf for a row before position 0


class DSparkCache:
    """The context rings of one DSpark drafter (one per stage, `window + rollback` rows per slot) and how
    many positions each slot holds."""

    def __init__(self, stages: int, slots: int, window: int, rollback: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        if rollback < 0:
            raise ValueError(f"rollback must be >= 0 positions, got {rollback}")
        self.rows = [torch.zeros(slots, window + rollback, head_dim, dtype=dtype, device=device) for _ in range(stages)]
        self.window = window
        self.lengths = [0] * slots

    @property
    def ring_len(self) -> int:
        return self.rows[0].shape[1]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < len(self.lengths):
            raise ValueError(f"cache slot {slot} does not exist (the DSpark cache has {len(self.lengths)} slots)")

    def write(self, segments: Sequence[tuple[int, int, int]], keys: Sequence[torch.Tensor]) -> None:
        """Record committed positions. A segment starts at or before what its slot holds (earlier: it
        rewrites, e.g. a reused slot starting again at 0); the slot then holds [0, first + count).

        Args:
            segments: (slot, first position, count) per sequence, in the row order of keys.
            keys: one [sum of counts, hd] tensor per stage.

        Raises:
            ValueError: a slot that does not exist, a gap after what a slot holds, a key count mismatch.
        """
        ring = self.ring_len
        dest, src, offset = [], [], 0
        for slot, start, count in segments:
            self._check_slot(slot)
            held = self.lengths[slot]
            if start > held or start < 0 or count < 1:
                raise ValueError(
                    f"cache slot {slot} holds DSpark context positions [0, {held}); cannot commit {count} "
                    f"position(s) from {start} (commits continue a slot's positions without a gap)"
                )
            # Only the last R positions of a long commit survive in the ring; writing only those keeps
            # every destination row unique (index_copy_ leaves duplicates in an undefined order).
            first = max(start, start + count - ring)
            positions = range(first, start + count)
            dest.extend(slot * ring + p % ring for p in positions)
            src.extend(offset + p - start for p in positions)
            offset += count
        device = self.rows[0].device
        dest_t = torch.tensor(dest, dtype=torch.long, device=device)
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        for rows, stage_keys in zip(self.rows, keys):
            if stage_keys.shape[0] != offset:
                raise ValueError(f"{stage_keys.shape[0]} context key rows for {offset} committed positions")
            rows.view(-1, rows.shape[-1]).index_copy_(0, dest_t, stage_keys.index_select(0, src_t).to(rows.dtype))
        for slot, start, count in segments:
            self.lengths[slot] = start + count

    def anchor_positions(self, slots: Sequence[int]) -> list[int]:
        """The position of each slot's next token (its draft anchor): the count of committed positions.

        Args:
            slots: cache slots.

        Returns:
            One position per slot.

        Raises:
            ValueError: a slot that does not exist or holds no committed position.
        """
        positions = []
        for slot in slots:
            self._check_slot(slot)
            if self.lengths[slot] == 0:
                raise ValueError(f"cache slot {slot} holds no committed position to draft from (commit the prefill)")
            positions.append(self.lengths[slot])
        return positions

    def context_rows(self, slots: Sequence[int]) -> ContextRows:
        """Where the last `window` committed positions of each slot sit (rows before position 0 hidden).

        Args:
            slots: cache slots, one per draft.

        Returns:
            `ContextRows` for `read`.
        """
        device = self.rows[0].device
        ring, window = self.ring_len, self.window
        held = torch.tensor(self.anchor_positions(slots), dtype=torch.long, device=device)  # [N]
        positions = held.unsqueeze(1) - window + torch.arange(window, device=device)  # [N, window]
        visible = positions >= 0
        slot_t = torch.tensor(list(slots), dtype=torch.long, device=device).unsqueeze(1)
        index = slot_t * ring + positions.clamp(min=0) % ring
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill(~visible, _HIDDEN)
        return ContextRows(index=index.reshape(-1), bias=bias)

    def read(self, stage: int, rows: ContextRows) -> torch.Tensor:
        """One stage's context keys.

        Args:
            stage: the drafter stage.
            rows: from `context_rows`.

        Returns:
            [N, window, hd] keys, row j of draft n at position lengths - window + j.
        """
        ring_rows = self.rows[stage]
        flat = ring_rows.view(-1, ring_rows.shape[-1]).index_select(0, rows.index)
        return flat.view(-1, self.window, ring_rows.shape[-1])

    def fork(self, source: int, targets: Sequence[int], length: int) -> None:
        """Give each target slot `source`'s committed positions [0, length) (sequences sharing a prompt's
        prefill, `ModelCache.fork`): the ring rows they occupy, one copy per stage for all targets.

        Args:
            source: the slot holding the positions (it keeps them).
            targets: distinct slots other than `source`; each then holds exactly [0, length).
            length: positions to copy, at most what `source` holds.

        Raises:
            ValueError: a slot that does not exist, `source` holds fewer positions, or bad targets.
        """
        for slot in (source, *targets):
            self._check_slot(slot)
        check_fork(source, targets, length, self.lengths[source])
        copy_slot_rows(((ring, min(length, self.ring_len)) for ring in self.rows), source, targets)
        for slot in targets:
            self.lengths[slot] = length

    def rewind(self, slot: int, length: int) -> None:
        """Make slot hold only positions [0, length) again (a later commit continues from there); 0 empties
        the slot (its sequence ended or was preempted: the next commit starts at position 0).

        Args:
            slot: the cache slot.
            length: the positions it keeps.

        Raises:
            ValueError: length is beyond what the slot holds, or so far back that the rows the next draft
                needs were already overwritten (allocate with a larger rollback).
        """
        self._check_slot(slot)
        held = self.lengths[slot]
        if not 0 <= length <= held:
            raise ValueError(f"cache slot {slot} holds positions [0, {held}); cannot rewind to {length}")
        oldest_kept = max(0, held - self.ring_len)
        if length and max(0, length - self.window) < oldest_kept:  # the next draft reads [length - window, length)
            raise ValueError(
                f"cache slot {slot}: rewinding from {held} to {length} positions needs position "
                f"{length - self.window}, already overwritten (the ring keeps {self.ring_len - self.window} "
                f"positions of rollback)"
            )
        self.lengths[slot] = length
