"""Speculative decoding: the drafter's interface to the engine, and how a verify chunk is judged.

Each step, a decoding sequence may verify draft tokens: the scheduler leaves room for up to
`Proposer.num_speculative_tokens` of them after the sequence's last sampled token (never more than the
sequence could keep, see `Scheduler`), the engine asks the proposer for them, and the target computes
the chunk [last token, draft 1, ..., draft k] in the same forward as everything else, with logits for
each of its k + 1 rows.

Judging (`accepted_length`): every row is sampled exactly as a decode step would sample it (the same
processed distribution, and for seeded requests the same draws, since they depend only on the token's
index). Draft i is kept while it equals the target's sample at its position; the first sample that
disagrees is kept instead of it, and when every draft is kept the last row's sample follows as a bonus
token. Every kept token is therefore the token that decoding without drafts would have chosen, for any
sampling settings; for greedy requests this is the usual rule. Rejection sampling against the drafts'
distributions (accept with min(1, p/q), which keeps more drafts at temperature > 0) needs `Draft.probs`
and replaces `accepted_length` for the rows that carry them.

After judging, the engine keeps the accepted prefix plus one token, moves the sequence's `computed` back
to just past the accepted drafts and rewinds its cache slot (`ModelRunner.rewind`), then tells the
proposer which positions are final (`on_commit`), with their target streams (what an MTP drafter reads).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsv4.engine.sequence import Sequence


@dataclass(frozen=True)
class Draft:
    """A proposer's guess of a sequence's next tokens.

    Attributes:
        token_ids: the draft tokens, in order (fewer than asked for, or none, is fine).
        probs: [len(token_ids), V] the distribution each draft token was sampled from (q), or None when
            they were chosen deterministically.
    """

    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """What the engine asks of a drafter (an MTP layer, DSpark, an n-gram table, a test script).

    Attributes:
        num_speculative_tokens: the most draft tokens it proposes per sequence and step (k).
    """

    num_speculative_tokens: int

    def propose(self, seqs: Seq[Sequence], max_drafts: Seq[int]) -> list[Draft]:
        """Draft tokens for each decoding sequence: what follows all of `seq`'s known tokens.

        Args:
            seqs: the sequences that verify this step (each has sampled at least one token).
            max_drafts: per sequence, how many drafts it may verify (1 to k); more are dropped.

        Returns:
            One `Draft` per sequence, in order.
        """
        ...

    def on_commit(self, seq: Sequence, first_position: int, streams: torch.Tensor) -> None:
        """Positions [first_position, first_position + len(streams)) of `seq` are final: computed this
        step and kept (the rows of rejected drafts are left out). Called for every chunk of every step,
        prefill chunks included, after the step's tokens were appended to `seq.output_ids`.

        Args:
            seq: the sequence.
            first_position: the position of the first row.
            streams: [rows, hc, D] the target's pre-head streams of those positions.
        """
        ...

    def on_release(self, seq: Sequence) -> None:
        """`seq` left its cache slot (finished, aborted, or preempted: it will recompute from position 0,
        and `on_commit` then starts over)."""
        ...


def accepted_length(sampled: Seq[int], drafts: Seq[int]) -> int:
    """How many leading drafts the target keeps.

    Args:
        sampled: the target's samples at the k + 1 rows of a verify chunk (row i chooses the token that
            follows draft i; row 0 follows the last sampled token).
        drafts: the k draft tokens.

    Returns:
        j in [0, k]: drafts[:j] are kept; sampled[j] is the token after them.
    """
    j = 0
    while j < len(drafts) and sampled[j] == drafts[j]:
        j += 1
    return j
