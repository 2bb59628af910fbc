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

Shared prompt prefill (`schedule(share_prompts=True)`): sequences admitted with the same prompt (the n
completions of a request, GRPO groups; separate requests repeating a prompt) compute it once. The first
one admitted leads; the others follow it: they hold a slot but get no chunks (no step budget) while the
leader prefills. The step whose chunk completes the leader's prompt lists the group in
`SchedulerOutput.forks`: after that forward the engine copies the leader's slot state into each
follower's slot (`ModelCache.fork`), each follower samples its first token from the leader's last
logits, and from then on they are ordinary, independent sequences. Only fresh sequences group (no
generated tokens, nothing computed: a preempted sequence recomputing its output prefills on its own), and
a sequence that scores its request's prompt (`prompt_logprobs`, completion 0) follows only a leader that
has computed nothing yet (the engine scores the leader's chunks for it, from the first). A leader that
leaves before the fork (aborted, preempted) hands the group to its first follower, which prefills from
position 0; a follower that leaves just leaves. Followers join only before the leader's last chunk is
planned: the slot state is forked at that step and no later (decoding overwrites the prompt's rows of
the rings).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from dsv4.engine.limits import EngineLimits
from dsv4.engine.sequence import Sequence, SequenceStatus

# Shorter prompts do not group: a one-token prompt is a single decode row, nothing worth sharing.
MIN_SHARED_PROMPT = 2


def scores_prompt(seq: Sequence) -> bool:
    """Whether `seq` computes its request's prompt logprobs (the engine scores completion 0's chunks)."""
    return seq.index == 0 and seq.params.prompt_logprobs is not None


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
    # Per leader whose chunk completes its prompt this step: (leader, its followers), which take its slot
    # state after the forward (module docstring, shared prompt prefill).
    forks: tuple[tuple[Sequence, tuple[Sequence, ...]], ...] = ()


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
        # Shared prompt prefill (module docstring): leaders still prefilling that new sequences may follow,
        # by prompt; each leader's followers; each follower's leader.
        self._leaders: dict[tuple[int, ...], Sequence] = {}
        self._followers: dict[Sequence, list[Sequence]] = {}
        self._leader_of: dict[Sequence, Sequence] = {}

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
        self._leave_group(seq)
        self.running.remove(seq)
        self.free_slots.appendleft(seq.slot)
        seq.preempt()
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Forget a sequence that ended (finished or aborted): its slot, if any, is free again."""
        self._leave_group(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.free_slots.appendleft(seq.slot)
            seq.slot = None

    # ---- one step ----
    def schedule(self, num_speculative_tokens: int = 0, max_speculating: int | None = None,
                 share_prompts: bool = False) -> SchedulerOutput:
        """Admit what fits, then plan the step's chunks within the token budget (module docstring).

        Args:
            num_speculative_tokens: the most draft tokens a decoding sequence may verify this step.
            max_speculating: the most decoding sequences a step speculates for (None: no limit); with
                more, the step decodes without drafts.
            share_prompts: newly admitted sequences follow a leader prefilling the same prompt (module
                docstring); groups formed earlier fork either way.

        Returns:
            The chunks (decodes and verify chunks first, in running order, then prefill chunks), the
            newly admitted sequences, and the groups that fork after this step.
        """
        admitted = []
        while self.can_admit():
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            if share_prompts:
                self._join_group(seq)

        budget = self.limits.max_num_batched_tokens
        # Known tokens without cache state, per running sequence (`Sequence.pending`, inlined: hot loop).
        pending = [(seq, len(seq.prompt_ids) + len(seq.output_ids) - seq.computed) for seq in self.running]
        decodes = [seq for seq, n in pending if n == 1][:budget]
        budget -= len(decodes)
        off = num_speculative_tokens > 0 and max_speculating is not None and len(decodes) > max_speculating
        if off:
            num_speculative_tokens = 0
        chunks = []
        completing = []  # leaders whose prompt this step completes
        for seq in decodes:
            drafts = 0
            if num_speculative_tokens > 0 and seq.decoding:
                drafts = min(num_speculative_tokens, budget, self._max_drafts(seq))
                budget -= drafts
            chunks.append(ScheduledChunk(seq, 1, drafts))
            if seq in self._followers:  # the last token of a chunked prompt
                completing.append(seq)
        for seq, n in pending:
            if budget <= 0:
                break
            if n > 1 and seq not in self._leader_of:  # followers take no budget: the leader computes for them
                take = min(n, budget)
                chunks.append(ScheduledChunk(seq, take))
                budget -= take
                if take == n and seq in self._followers:
                    completing.append(seq)
        forks = tuple((leader, tuple(self._close_group(leader))) for leader in completing)
        return SchedulerOutput(tuple(chunks), tuple(admitted), off, tuple(f for f in forks if f[1]))

    # ---- shared prompt prefill ----
    def followers(self, leader: Sequence) -> tuple[Sequence, ...]:
        """The sequences waiting for `leader`'s prompt prefill (none if it leads no group)."""
        return tuple(self._followers.get(leader, ()))

    def _join_group(self, seq: Sequence) -> None:
        """A sequence just took a slot: follow the leader prefilling its prompt, or lead a new group."""
        if seq.output_ids or seq.computed or len(seq.prompt_ids) < MIN_SHARED_PROMPT:
            return
        key = tuple(seq.prompt_ids)
        leader = self._leaders.get(key)
        if leader is not None and (leader.computed == 0 or not scores_prompt(seq)):
            self._followers[leader].append(seq)
            self._leader_of[seq] = leader
        else:  # no leader, or a scoring one too late for the first chunk's scores: lead (later ones follow it)
            self._leaders[key] = seq
            self._followers[seq] = []

    def _close_group(self, leader: Sequence) -> list[Sequence]:
        """The leader's prompt is complete this step: no one joins any more; returns its followers."""
        key = tuple(leader.prompt_ids)
        if self._leaders.get(key) is leader:
            del self._leaders[key]
        followers = self._followers.pop(leader)
        for follower in followers:
            del self._leader_of[follower]
        return followers

    def _leave_group(self, seq: Sequence) -> None:
        """`seq` leaves its slot before its group forked: a follower just leaves; a leader hands the group
        to its first follower, which prefills the prompt from position 0 (it computed nothing yet)."""
        leader = self._leader_of.pop(seq, None)
        if leader is not None:
            self._followers[leader].remove(seq)
            return
        if seq not in self._followers:
            return
        followers = self._close_group(seq)
        if followers:
            heir = followers[0]
            self._followers[heir] = followers[1:]
            for follower in followers[1:]:
                self._leader_of[follower] = heir
            self._leaders.setdefault(tuple(heir.prompt_ids), heir)

    def _max_drafts(self, seq: Sequence) -> int:
        """Drafts that can all be kept: k accepted drafts plus one more token add k + 1 tokens, and the
        sequence may end with max_model_len tokens and max_tokens generated ones."""
        return max(0, min(self.limits.max_model_len - seq.num_tokens - 1,
                          seq.params.max_tokens - len(seq.output_ids) - 1))
