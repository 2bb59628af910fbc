"""The DSpark draft loop: from one backbone pass's base logits to B draft tokens, the exact distribution
each was drawn from, and the confidence that picks how many of them to verify.

The drafter (model/dspark.py) scores the blocks; drawing from those scores is sampling, with each request's
params and generator, so it lives here next to the sampler, as the MTP draft loop lives in mtp_proposer.py.

The backbone scores all B block positions at once; the Markov head then makes the drafts depend on each
other, so they are drawn one after another:

    prev_0 = anchor
    for i in 0 .. B-1:
        logits_i = base_i + markov_w2 @ markov_w1[prev_i]          (fp32)
        q_i      = the request's processed distribution of logits_i   (one-hot argmax for greedy rows)
        d_i      ~ q_i ;  prev_{i+1} = d_i
    c_i = sigmoid(proj([head hidden_i ; markov_w1[prev_i]]))

Rejection sampling is exact only if q_i is the distribution d_i was really drawn from, so this module
returns q_i itself rather than leaving the caller to recompute it.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.engine.sampler import greedy_tokens, process_logits
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.dspark import DSparkDrafter
from dsv4.model.dspark_cache import DSparkCache
from dsv4.model.dspark_heads import ConfidenceHead, MarkovHead


@dataclass(frozen=True)
class DraftSampling:
    """How the drafts of N sequences are drawn: each sequence's request params, and a generator of the
    draft's own per sequence (None allowed for greedy requests), so that drafting neither consumes the
    target sampler's random stream nor depends on the other sequences of the batch."""

    params: Sequence[SamplingParams]
    generators: Sequence[torch.Generator | None]

    def __post_init__(self) -> None:
        if len(self.params) != len(self.generators):
            raise ValueError(f"{len(self.params)} sampling params but {len(self.generators)} generators")
        for row, (params, generator) in enumerate(zip(self.params, self.generators)):
            if not params.greedy and generator is None:
                raise ValueError(f"draft row {row} samples (temperature {params.temperature}) but has no generator")


@dataclass(frozen=True)
class DSparkDraft:
    """One draft block per sequence (N sequences, B = dspark_block_size, V = vocabulary)."""

    tokens: torch.Tensor  # [N, B] int64: d_1 .. d_B, at positions anchor + 1 .. anchor + B
    q: torch.Tensor  # [N, B, V] fp32: the distribution each token was drawn from (one-hot for greedy rows)
    logits: torch.Tensor  # [N, B, V] fp32: the Markov-corrected logits q was derived from
    confidence: torch.Tensor  # [N, B] fp32: estimated P(d_i accepted | d_1 .. d_{i-1} accepted)


def _draw(logits: torch.Tensor, sampling: DraftSampling | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] fp32 -> (tokens [N], q [N, V]). Greedy rows: argmax (lowest id on ties, as the
    sampler) with a one-hot q. Sampling rows: q = softmax of the request's processed logits
    (temperature, top-k, top-p, min-p; the sampler's own `process_logits`), token drawn from q with the
    row's generator."""
    greedy = greedy_tokens(logits)  # the sampler's greedy rule, so drafts agree with what the target would pick
    q = torch.zeros_like(logits).scatter_(1, greedy.unsqueeze(1), 1.0)
    if sampling is None:
        return greedy, q
    tokens = greedy.clone()
    rows = [i for i, params in enumerate(sampling.params) if not params.greedy]
    if not rows:
        return tokens, q
    picked = [sampling.params[i] for i in rows]
    device = logits.device
    processed = process_logits(
        logits[rows],
        torch.tensor([p.temperature for p in picked], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in picked], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in picked], dtype=torch.float32, device=device),
        torch.tensor([p.min_p for p in picked], dtype=torch.float32, device=device),
    )
    probs = processed.softmax(dim=-1)
    for j, row in enumerate(rows):
        tokens[row] = torch.multinomial(probs[j], 1, generator=sampling.generators[row])[0]
        q[row] = probs[j]
    return tokens, q


def sample_block(
    base_logits: torch.Tensor,
    anchors: torch.Tensor,
    head_hidden: torch.Tensor,
    markov: MarkovHead,
    confidence: ConfidenceHead,
    sampling: DraftSampling | None = None,
) -> DSparkDraft:
    """Draw one block of drafts per sequence.

    Args:
        base_logits: [N, B, V] fp32 backbone logits of the block positions.
        anchors: [N] int64, the token each block starts from (prev_0).
        head_hidden: [N, B, D], the last stage's collapse before its final norm.
        markov: the last stage's Markov head.
        confidence: the last stage's confidence head.
        sampling: per-sequence request params and generators; None drafts greedily.

    Returns:
        The drafts, the distributions they were drawn from, their logits and confidences.
    """
    n, block, _ = base_logits.shape
    if sampling is not None and len(sampling.params) != n:
        raise ValueError(f"sampling settings for {len(sampling.params)} rows, {n} draft blocks")
    prev = anchors
    tokens, qs, all_logits, embeddings = [], [], [], []
    for i in range(block):
        embedding = markov.markov_w1(prev)
        logits = base_logits[:, i] + markov.bias(embedding)
        prev, q = _draw(logits, sampling)
        tokens.append(prev)
        qs.append(q)
        all_logits.append(logits)
        embeddings.append(embedding)
    confidence_logits = confidence(head_hidden, torch.stack(embeddings, dim=1))
    return DSparkDraft(
        tokens=torch.stack(tokens, dim=1),
        q=torch.stack(qs, dim=1),
        logits=torch.stack(all_logits, dim=1),
        confidence=confidence_logits.sigmoid(),
    )


@torch.no_grad()
def draft(
    drafter: DSparkDrafter, cache: DSparkCache, slots: Sequence[int], anchors: Sequence[int] | torch.Tensor,
    sampling: DraftSampling | None = None,
) -> DSparkDraft:
    """Draft one block per sequence.

    Args:
        drafter: the DSpark drafter (READY).
        cache: its context rings; each slot must hold its committed positions [0, p].
        slots: the sequences' cache slots.
        anchors: each sequence's newest token (at position p + 1, not yet run by the target).
        sampling: the requests' params and the drafts' generators; None drafts greedily.

    Returns:
        Per sequence: B draft tokens (positions p+2 .. p+B+1), the distributions q they were drawn from,
        the corrected logits, and the confidences.
    """
    anchor_t = torch.as_tensor(anchors, dtype=torch.long, device=drafter.mtp[0].main_proj.weight.device).reshape(-1)
    hidden, base_logits = drafter.score_blocks(cache, slots, anchor_t)
    last = drafter.mtp[-1]
    return sample_block(base_logits, anchor_t, hidden, last.markov_head, last.confidence_head, sampling)


def verify_width(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """How many drafts of each block to verify: the longest prefix whose estimated survival probability,
    the running product of its confidences, stays at or above `threshold`.

    Args:
        confidence: [N, B] per-position confidences in [0, 1].
        threshold: in [0, 1]; 0 verifies every draft, 1 only drafts of certain confidence.

    Returns:
        [N] int64 widths in [0, B].

    Raises:
        ValueError: threshold outside [0, 1].
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"verify threshold must be in [0, 1], got {threshold!r}")
    survives = confidence.float().cumprod(dim=-1) >= threshold
    return survives.long().cumprod(dim=-1).sum(dim=-1)
