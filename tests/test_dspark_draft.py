"""The DSpark draft loop (dsv4/engine/dspark_draft.py) on hand-set heads and logits.

Checked against formulas written out here: each position's logits are base_i + W2 @ W1[prev_i] in fp32,
prev_0 the anchor and prev_i the token drafted at step i-1 (not a teacher-forced or base-argmax token);
q_i is exactly the distribution d_i was drawn from (one-hot for greedy requests, the request's temperature /
top-k processed softmax otherwise, drawn with the row's own generator); the confidence is
sigmoid(proj([head hidden ; W1[prev]])); the verify width is the longest prefix whose running product of
confidences stays at or above the threshold.
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import SamplingParams
from dsv4.engine.dspark_draft import DraftSampling, sample_block, verify_width
from dsv4.model.dspark_heads import ConfidenceHead, MarkovHead

VOCAB, RANK, HIDDEN, BLOCK = 6, 2, 3, 4


@pytest.fixture
def heads():
    """W1 [V, r], W2 [V, r] and proj [1, D + r], hand-set so that the Markov term decides the drafts."""
    markov, confidence = MarkovHead(VOCAB, RANK, torch.float32), ConfidenceHead(HIDDEN, RANK)
    w1 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [0.5, 0.5]])
    # token t's embedding pushes token (t + 2) % V: W2 row (t + 2) % V = 4 * W1[t]
    w2 = torch.zeros(VOCAB, RANK)
    for t in range(VOCAB):
        w2[(t + 2) % VOCAB] += 4 * w1[t]
    with torch.no_grad():
        markov.markov_w1.weight.copy_(w1)
        markov.markov_w2.weight.copy_(w2)
        confidence.proj.weight.copy_(torch.tensor([[0.5, -0.25, 1.0, 2.0, -1.0]]))
    return markov.requires_grad_(False), confidence.requires_grad_(False)


def _expected_greedy(base: torch.Tensor, anchor: int, w1: torch.Tensor, w2: torch.Tensor):
    prev, tokens, logits = anchor, [], []
    for i in range(base.shape[0]):
        row = base[i] + w2 @ w1[prev]
        prev = int(row.argmax())
        tokens.append(prev)
        logits.append(row)
    return tokens, torch.stack(logits)


def test_greedy_drafts_follow_the_previous_draft(heads):
    markov, confidence = heads
    w1, w2 = markov.markov_w1.weight, markov.markov_w2.weight
    base = torch.zeros(2, BLOCK, VOCAB)
    base[:, :, 1] = 0.5  # without the Markov term every position would draft token 1
    hidden = torch.randn(2, BLOCK, HIDDEN, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([0, 3])
    draft = sample_block(base, anchors, hidden, markov, confidence)
    for row, anchor in enumerate(anchors.tolist()):
        tokens, logits = _expected_greedy(base[row], anchor, w1, w2)
        assert draft.tokens[row].tolist() == tokens
        assert torch.equal(draft.logits[row], logits)
        # greedy q: one-hot on the drafted token
        assert torch.equal(draft.q[row], torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float())
        prev = torch.tensor([anchor, *tokens[:-1]])
        features = torch.cat((hidden[row], w1[prev]), dim=-1)
        expected = torch.sigmoid(features @ confidence.proj.weight[0])
        torch.testing.assert_close(draft.confidence[row], expected, rtol=1e-6, atol=1e-7)
    # the Markov term decides: no draft is the base argmax (1), and conditioning every position on the anchor
    # instead of on the previous draft would draft something else
    assert not bool((draft.tokens == 1).any())
    anchor_only = (base + (w2 @ w1[anchors].t()).t().unsqueeze(1)).argmax(dim=-1)
    assert not torch.equal(anchor_only, draft.tokens)


def _processed_q(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) restricted to the top_k tokens, renormalised (written out, not dsv4's code)."""
    scaled = logits / temperature
    keep = scaled.topk(top_k).indices
    masked = torch.full_like(scaled, float("-inf"))
    masked[keep] = scaled[keep]
    return masked.softmax(dim=-1)


def test_sampled_drafts_are_drawn_from_q(heads):
    markov, confidence = heads
    base = torch.randn(1, BLOCK, VOCAB, generator=torch.Generator().manual_seed(1))
    hidden = torch.zeros(1, BLOCK, HIDDEN)
    params = SamplingParams(temperature=0.7, top_k=3)
    draft = sample_block(base, torch.tensor([2]), hidden, markov, confidence,
                         DraftSampling([params], [torch.Generator().manual_seed(5)]))
    prev = 2
    for i in range(BLOCK):
        logits = base[0, i] + markov.markov_w2.weight @ markov.markov_w1.weight[prev]
        torch.testing.assert_close(draft.logits[0, i], logits)
        torch.testing.assert_close(draft.q[0, i], _processed_q(logits, 0.7, 3), rtol=1e-6, atol=1e-7)
        prev = int(draft.tokens[0, i])
        assert draft.q[0, i, prev] > 0  # drawn inside q's support (top-3)
    # the same seed drafts the same block
    again = sample_block(base, torch.tensor([2]), hidden, markov, confidence,
                         DraftSampling([params], [torch.Generator().manual_seed(5)]))
    assert torch.equal(again.tokens, draft.tokens)


def test_first_draft_frequencies_match_q(heads):
    """Drawing many blocks from one position: the first draft's frequencies match q_0 (chi-square)."""
    markov, confidence = heads
    rows = 4000
    base = torch.randn(1, BLOCK, VOCAB, generator=torch.Generator().manual_seed(2)).expand(rows, -1, -1)
    params = SamplingParams(temperature=1.3)
    sampling = DraftSampling([params] * rows, [torch.Generator().manual_seed(100 + r) for r in range(rows)])
    draft = sample_block(base, torch.full((rows,), 4), torch.zeros(rows, BLOCK, HIDDEN), markov, confidence, sampling)
    q = draft.q[0, 0]
    assert torch.equal(draft.q[:, 0], q.expand(rows, -1))
    counts = torch.bincount(draft.tokens[:, 0], minlength=VOCAB).float()
    expected = q * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom: P(> 20.5) < 0.001


def test_greedy_and_sampled_rows_in_one_batch(heads):
    markov, confidence = heads
    base = torch.randn(2, BLOCK, VOCAB, generator=torch.Generator().manual_seed(3))
    sampling = DraftSampling([SamplingParams(), SamplingParams(temperature=1.0)], [None, torch.Generator()])
    draft = sample_block(base, torch.tensor([1, 1]), torch.zeros(2, BLOCK, HIDDEN), markov, confidence, sampling)
    tokens, _ = _expected_greedy(base[0], 1, markov.markov_w1.weight, markov.markov_w2.weight)
    assert draft.tokens[0].tolist() == tokens
    assert torch.equal(draft.q[0].max(dim=-1).values, torch.ones(BLOCK))
    torch.testing.assert_close(draft.q[1].sum(dim=-1), torch.ones(BLOCK))
    assert bool((draft.q[1] > 0).all())  # no filter: every token possible


def test_sampled_row_needs_its_own_generator():
    with pytest.raises(ValueError, match="draft row 1 samples"):
        DraftSampling([SamplingParams(), SamplingParams(temperature=0.5)], [None, None])
    with pytest.raises(ValueError, match="2 sampling params but 1 generators"):
        DraftSampling([SamplingParams(), SamplingParams()], [None])


@pytest.mark.parametrize(
    ("confidence", "threshold", "width"),
    [
        ([0.99, 0.98, 0.97, 0.96, 0.95], 0.5, 5),  # all above: verify the whole block
        ([0.40, 0.99, 0.99, 0.99, 0.99], 0.5, 0),  # the first is below: verify none
        ([0.90, 0.80, 0.70, 0.99, 0.99], 0.5, 3),  # 0.9, 0.72, 0.504 | 0.499
        ([0.90, 0.80, 0.70, 0.99, 0.99], 0.504, 3),  # at the threshold counts
        ([0.01, 0.01, 0.01, 0.01, 0.01], 0.0, 5),  # threshold 0: always all
        ([1.00, 1.00, 0.999, 1.00, 1.00], 1.0, 2),  # threshold 1: only certain drafts
        ([1.00, 1.00, 1.00, 1.00, 1.00], 1.0, 5),
    ],
)
def test_verify_width_from_the_running_product(confidence, threshold, width):
    assert verify_width(torch.tensor([confidence]), threshold).tolist() == [width]


def test_verify_width_per_row_and_bad_threshold():
    confidence = torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.9, 0.9], [0.9, 0.1, 0.9]])
    assert verify_width(confidence, 0.7).tolist() == [3, 0, 1]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="verify threshold must be in"):
            verify_width(confidence, bad)
