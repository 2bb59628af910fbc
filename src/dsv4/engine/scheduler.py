"""The scheduler: which sequences hold a cache slot, and which of their tokens the next step computes.

Plain bookkeeping over `Sequence`s (no tensors, no model), so it is tested on its own
(tests/test_scheduler.py).

Admission: a sequence waits in FIFO order until a cache slot is free (and admission is not paused);
it never fails for lack of room. A preempted sequence goes back to the front of the queue.

A step's token budget (`max_num_batched_tokens`) is filled in this order:

1. one token for every decoding sequence (its last sampled token, whose logits choose the next);
2. speculation: room for draft tokens after that token (a verify chunk of 1 + k tokens), at most
   `num_speculative_tokens` per sequence and never more than can be kept: the sequence may not pass
   `max_model_len` (prompt + output tokens) nor its `max_tokens`, even if every draft is accepted
   and a bonus token follows. None at all when more sequences decode than `max_speculating` (past
   the break-even batch, verifying k extra tokens per sequence costs more than the drafts save);
3. chunked prefill: the pending tokens of the other running sequences (a new prompt, or the prompt and
   output of a preempted sequence being recomputed), in chunks of whatever budget is left.

`max_num_seqs <= max_num_batched_tokens` (`EngineLimits`), so every running sequence can always decode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from dsv4.engine.limits import EngineLimits
from dsv4.engine.sequence import Sequence, SequenceStatus


class ScheduledChunk(NamedTuple):  # a tuple: one is made per running sequence and step
    """One sequence's share of a step.

    Attributes:
        seq: the sequence.
        num_tokens: how many of its known tokens to compute, from position `seq.computed`.
        max_drafts: room for draft tokens after them (a verify chunk); 0 when not speculating.
    """

    seq: Sequence
    num_tokens: int
    max_drafts: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """A step's plan: the chunks to compute, and the sequences that took a cache slot for it."""

    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[Sequence, ...]
    speculation_off: bool = False  # drafts were wanted, but more sequences decode than `max_speculating`


class Scheduler:
    """FIFO admission into cache slots and token-budgeted steps (module docstring).

    Args:
        limits: the engine's slots, step budget and sequence length.
    """

    def __init__(self, limits: EngineLimits):
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # A freed slot goes to the front: admission reuses the slot freed last, whose cache pages are already
        # resident (cache memory is taken as it is written), instead of touching a fresh slot per request.
        self.free_slots: deque[int] = deque(range(limits.max_num_seqs))
        self.admitting = True  # False while generation is paused: waiting sequences stay queued

    # ---- queues ----
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind the waiting ones."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def can_admit(self) -> bool:
        """Whether the next `schedule` would give a waiting sequence a slot."""
        return self.admitting and bool(self.waiting) and bool(self.free_slots)

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's slot and its cache state; it keeps its tokens and goes back to the
        front of the waiting queue, to recompute them when it is admitted again.

        Raises:
            ValueError: the sequence is not running.
        """
        if seq.status is not SequenceStatus.RUNNING:
            raise ValueError(f"request {seq.request_id} sequence {seq.index}: only a running sequence can be "
                             f"preempted, this one is {seq.status.value}")
        self.running.remove(seq)
        self.free_slots.appendleft(seq.slot)
        seq.preempt()
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Forget a sequence that ended (finished or aborted): its slot, if any, is free again."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.free_slots.appendleft(seq.slot)
            seq.slot = None

    # ---- one step ----
    def schedule(self, num_speculative_tokens: int = 0, max_speculating: int | None = None) -> SchedulerOutput:
        """Admit what fits, then plan the step's chunks within the token budget (module docstring).

        Args:
            num_speculative_tokens: the most draft tokens a decoding sequence may verify this step.
            max_speculating: the most decoding sequences a step speculates for (None: no limit); with
                more, the step decodes without drafts.

        Returns:
            The chunks (decodes and verify chunks first, in running order, then prefill chunks) and the
            newly admitted sequences.
        """
        admitted = []
        while self.can_admit():
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)

        budget = self.limits.max_num_batched_tokens
        # Known tokens without cache state, per running sequence (`Sequence.pending`, inlined: hot loop).
        pending = [(seq, len(seq.prompt_ids) + len(seq.output_ids) - seq.computed) for seq in self.running]
        decodes = [seq for seq, n in pending if n == 1][:budget]
        budget -= len(decodes)
        off = num_speculative_tokens > 0 and max_speculating is not None and len(decodes) > max_speculating
        if off:
            num_speculative_tokens = 0
        chunks = []
        for seq in decodes:
            drafts = 0
            if num_speculative_tokens > 0 and seq.decoding:
                drafts = min(num_speculative_tokens, budget, self._max_drafts(seq))
                budget -= drafts
            chunks.append(ScheduledChunk(seq, 1, drafts))
        for seq, n in pending:
            if budget <= 0:
                break
            if n > 1:
                take = min(n, budget)
                chunks.append(ScheduledChunk(seq, take))
                budget -= take
        return SchedulerOutput(tuple(chunks), tuple(admitted), off)

    def _max_drafts(self, seq: Sequence) -> int:
        """Drafts that can all be kept: k accepted drafts plus one more token add k + 1 tokens, and the
        sequence may end with max_model_len tokens and max_tokens generated ones."""
        return max(0, min(self.limits.max_model_len - seq.num_tokens - 1,
                          seq.params.max_tokens - len(seq.output_ids) - 1))
