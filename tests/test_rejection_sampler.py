"""Rejection sampling of draft tokens (`Sampler.sample_rows` with proposals) keeps the target's distribution.

On a vocabulary of 6, N rows each carry a draft token x drawn from q and the proposal (x, q); the row's token
(x if kept with probability min(1, p/q), else a draw from norm(max(p - q, 0))) must be distributed as the
target's processed distribution p (temperature, top-k, top-p, min-p as normal sampling applies them). Checked
with a chi-square test at significance 1e-4 with enough samples that a 2% shift of one probability is caught
(a control draws from such a shifted distribution and must fail the same test), for q unrelated to p, q = p
(every draft kept) and a one-hot q; and a control for the peers' bug: drafts drawn from one distribution but
judged against another are caught. Seeded rows reproduce.
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import SamplingParams
from dsv4.engine.sampler import Proposal, Sampler, SamplingRows, _param_tensors, process_logits

VOCAB = 6
N = 30_000  # a 2% shift of a probability near 0.3 is ~7.5 standard errors
LOGITS = torch.tensor([2.0, 1.2, 0.7, 0.1, -0.4, -1.5])
# Chi-square critical values at significance 1e-4, by degrees of freedom.
CHI2_CRITICAL = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}
SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "filtered": SamplingParams(temperature=0.7, top_k=5, top_p=0.95, min_p=0.03),
}


def _target(params: SamplingParams) -> torch.Tensor:
    return process_logits(LOGITS.unsqueeze(0), *_param_tensors([params], LOGITS.device)).softmax(-1)[0]


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was produced"
    expected = p[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def _passes(counts: torch.Tensor, p: torch.Tensor) -> bool:
    stat, df = _chi2(counts, p)
    return stat < CHI2_CRITICAL[df]


def _judge(params: SamplingParams, draw_q: torch.Tensor, claimed_q: torch.Tensor, seed: int = 0,
           n: int = N) -> torch.Tensor:
    """n rows: drafts drawn from draw_q, judged against claimed_q; returns the rows' tokens."""
    drafts = torch.multinomial(draw_q, n, replacement=True, generator=torch.Generator().manual_seed(seed))
    rows = SamplingRows.build([params] * n, list(range(seed * n, (seed + 1) * n)), LOGITS.device)
    proposals = [Proposal(int(x), claimed_q) for x in drafts]
    out = Sampler().sample_rows(LOGITS.expand(n, VOCAB).clone(), rows, [0] * n, proposals)
    return out.token_ids


def _qs(p: torch.Tensor) -> dict[str, torch.Tensor]:
    unrelated = torch.tensor([0.05, 0.1, 0.4, 0.2, 0.15, 0.1])
    one_hot = torch.zeros(VOCAB)
    one_hot[2] = 1.0
    return {"unrelated": unrelated, "q=p": p.clone(), "one-hot": one_hot}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("q_name", ["unrelated", "q=p", "one-hot"])
def test_output_distribution_is_the_targets(setting, q_name):
    params = SETTINGS[setting]
    p = _target(params)
    q = _qs(p)[q_name]
    tokens = _judge(params, q, q)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert _passes(counts, p.double()), _chi2(counts, p.double())
    if q_name == "q=p":  # p/q = 1: every draft is kept
        drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(0))
        assert torch.equal(tokens, drafts)


def test_the_chi_square_test_catches_a_two_percent_bias():
    p = _target(SETTINGS["t1"]).double()
    shifted = p.clone()
    shifted[0] -= 0.02
    shifted[1] += 0.02
    counts = torch.bincount(torch.multinomial(shifted.float(), N, replacement=True,
                                              generator=torch.Generator().manual_seed(1)), minlength=VOCAB).double()
    assert not _passes(counts, p)


def test_a_q_other_than_the_drafts_distribution_biases_the_output():
    """The peers' bug (vLLM #10198, DeepSpec #31): drafts sampled from one distribution, judged with another."""
    params = SETTINGS["t1"]
    p = _target(params)
    qs = _qs(p)
    tokens = _judge(params, draw_q=qs["unrelated"], claimed_q=p)
    assert not _passes(torch.bincount(tokens, minlength=VOCAB).double(), p.double())


def test_seeded_rows_reproduce_and_greedy_rows_keep_only_the_argmax():
    params = SETTINGS["filtered"]
    q = _qs(_target(params))["unrelated"]
    first = _judge(params, q, q, seed=3, n=2000)
    assert torch.equal(first, _judge(params, q, q, seed=3, n=2000))
    assert not torch.equal(first, _judge(params, q, q, seed=4, n=2000))
    greedy = SamplingParams(temperature=0.0)
    rows = SamplingRows.build([greedy] * 3, [None] * 3, LOGITS.device)
    proposals = [Proposal(0, q), Proposal(2, q), None]
    out = Sampler().sample_rows(LOGITS.expand(3, VOCAB).clone(), rows, [0, 0, 0], proposals)
    assert out.token_ids.tolist() == [0, 0, 0]  # the argmax, whatever was drafted


def test_a_draft_outside_its_own_q_is_refused():
    params = SETTINGS["t1"]
    q = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    rows = SamplingRows.build([params], [1], LOGITS.device)
    with pytest.raises(ValueError, match="probability 0"):
        Sampler().sample_rows(LOGITS.unsqueeze(0).clone(), rows, [0], [Proposal(3, q)])


def test_draft_distributions_come_back_with_return_probs():
    params = [SETTINGS["filtered"], SamplingParams(temperature=0.0)]
    rows = SamplingRows.build(params, [5, None], LOGITS.device)
    out = Sampler().sample_rows(LOGITS.expand(2, VOCAB).clone(), rows, [0, 0], return_probs=True)
    assert torch.allclose(out.probs[0], _target(params[0]))
    assert out.probs[1].tolist() == [1.0, 0, 0, 0, 0, 0]
