"""Speculative decoding: the drafter's interface to the engine, and how a verify chunk is judged.

Each step, a decoding sequence may verify draft tokens: the scheduler leaves room for up to
`Proposer.num_speculative_tokens` of them after the sequence's last sampled token (never more than the
sequence could keep, see `Scheduler`), the engine asks the proposer for them, and the target computes
the chunk [last token, draft 1, ..., draft k] in the same forward as everything else, with logits for
each of its k + 1 rows.

Judging: every row is sampled by the engine's `Sampler`. Draft i is kept while it equals the target's
token at its position (`accepted_length`); the first token that disagrees is kept instead of it, and when
every draft is kept the last row's token follows as a bonus token.

* Drafts without `Draft.probs` (chosen deterministically): each row's token is exactly what a decode
  step would sample (the same processed distribution, and for seeded requests the same draws, since they
  depend only on the token's index), so every kept token is the token decoding without drafts would have
  chosen, for any sampling settings; for greedy requests this is the usual rule.
* Drafts with `Draft.probs` = q: greedy rows still keep a draft iff it is the argmax; random rows use
  rejection sampling (`Sampler`, sampler.py: keep with probability min(1, p/q), else a token from
  norm(max(p - q, 0))), which keeps more drafts at temperature > 0 and leaves every token distributed as
  non-speculative sampling's. q must be exactly the distribution each draft was sampled from.

After judging, the engine keeps the accepted prefix plus one token, moves the sequence's `computed` back
to just past the accepted drafts and rewinds its cache slot (`ModelRunner.rewind`: the ring rows the
rejected drafts overwrote are restored), then tells the proposer which positions are final
(`on_commit`), with their target streams (what an MTP drafter reads) and, for a proposer that declares
`capture_layers` (DSpark reads inner target layers), those layers' streams of the same rows, which the
target's forward returns alongside (`ModelRunner.execute`); and finally that the step's commits are all in
(`end_step`, optional: a proposer may batch its per-commit work there).

Which proposer `LLM(draft=...)` builds: `llm.PROPOSER_BUILDERS` (name -> builder).
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
        capture_layers: optional: the target layers whose output streams `on_commit` receives as
            `captured` (ascending layer ids; read through the function `capture_layers`). A proposer
            without it (MTP, which reads the final streams only) is called without `captured`.
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

    def on_commit(self, seq: Sequence, first_position: int, streams: torch.Tensor,
                  captured: dict[int, torch.Tensor] | None = None) -> None:
        """Positions [first_position, first_position + len(streams)) of `seq` are final: computed this
        step and kept (the rows of rejected drafts are left out). Called for every chunk of every step,
        prefill chunks included, after the step's tokens were appended to `seq.output_ids`.

        Args:
            seq: the sequence.
            first_position: the position of the first row.
            streams: [rows, hc, D] the target's pre-head streams of those positions; valid until the step ends
                (a replayed decode step's are its record's buffers): copy what is kept longer.
            captured: {layer: [rows, hc, D] that target layer's output streams of those positions} for
                every layer of `capture_layers`; passed (by keyword) only to a proposer that declares them.
        """
        ...

    def on_release(self, seq: Sequence) -> None:
        """`seq` left its cache slot (finished, aborted, or preempted: it will recompute from position 0,
        and `on_commit` then starts over)."""
        ...

    # Optional (read only when defined, see `capture_layers`):
    # capture_layers: tuple[int, ...]: the target layers whose streams `on_commit` receives as `captured`.
    # Optional (the engine shares prompt prefills only when defined, engine.py):
    # def on_fork(self, leader: Sequence, followers: Seq[Sequence], length: int) -> None: the followers'
    #     slots take the leader's state of positions [0, length) (committed in earlier steps); `on_commit`
    #     of the leader's last prompt chunk, from `length`, then comes for each follower too, after its
    #     first token was appended.
    # Optional (called only when defined, see `end_step`):
    # def end_step(self) -> None: every `on_commit` of the step has been made; the streams passed to
    #     them stay valid until this returns (batch the per-commit work here).


def capture_layers(proposer: Proposer | None) -> tuple[int, ...]:
    """The target layers `proposer` wants captured for `on_commit` (none for a proposer that does not
    declare `capture_layers`, or no proposer)."""
    return tuple(getattr(proposer, "capture_layers", ())) if proposer is not None else ()


def end_step(proposer: Proposer) -> None:
    """Tell `proposer` that the step's commits are all in, if it wants to know (an optional method, so
    that proposers written against the three-method protocol keep working)."""
    hook = getattr(proposer, "end_step", None)
    if hook is not None:
        hook()


#: The most draft tokens per step `LLM` accepts (a verify chunk must also fit the model's smallest ring,
#: checked against the cache: `ModelCache.rollback_limit`).
MAX_SPECULATIVE_TOKENS = 8
#: Default `SpeculationConfig.max_batch`: above this many decoding sequences a step does not speculate.
#: benchmarks/bench_speculation.py measures the break-even batch; on the embedded dsv4-sort on a 2-core
#: CPU (a dispatch-bound toy: a 4-token verify chunk costs ~1.9-2.2x a 1-token decode whether it runs as
#: decode rows or through the prefill path, mostly for the routed experts its tokens touch; one MTP call
#: ~0.4-0.6x) speculation paid at no batch size beyond noise (k=1 at batch 4: 1.20x, pairs 0.64-1.40x), so
#: that figure cannot set a default for real models; 8 follows the peers' GPU measurements (vLLM on DSV4:
#: +75% at 1 sequence, +38% at 8, -37% at 32).
DEFAULT_SPECULATION_MAX_BATCH = 8


@dataclass(frozen=True)
class SpeculationConfig:
    """How `LLM` speculates.

    Attributes:
        method: the drafter's name (a key of `llm.PROPOSER_BUILDERS`).
        num_speculative_tokens: draft tokens per sequence and step (k; None: the drafter's default).
        max_batch: the most decoding sequences a step speculates for (None: no limit); above it the
            engine decodes without drafts (past the break-even batch, see benchmarks/bench_speculation.py).
    """

    method: str
    num_speculative_tokens: int | None
    max_batch: int | None


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
