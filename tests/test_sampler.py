"""Tests for SamplingParams, Sampler, process_logits and prompt_logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsv4.engine import sampler as sampler_module
from dsv4.engine.sampler import (
    Sampler,
    SamplingRows,
    SamplingState,
    process_logits,
    prompt_logprobs,
)
from dsv4.engine.sampling_params import SamplingParams

VOCAB = 1000
STEPS = 20
BATCH = 8
DIST_SAMPLES = 20_000
DIST_TOLERANCE = 0.02


def _states(*params: SamplingParams) -> list[SamplingState]:
    return [SamplingState.from_params(p) for p in params]


def _filters(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """process_logits on a batch of rows that all share one setting."""
    batch = logits.shape[0]
    return process_logits(
        logits,
        torch.full((batch,), temperature),
        torch.full((batch,), top_k, dtype=torch.int64),
        torch.full((batch,), top_p),
        torch.full((batch,), min_p),
    )


def _kept(processed_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(processed_row).nonzero().flatten().tolist())


# ---------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("logprobs_mode", "processed_logits"),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_params_reject_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_store_sequences_as_tuples_and_are_frozen():
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[1, 2])
    assert params.stop == ("a", "bc")
    assert params.stop_token_ids == (1, 2)
    assert SamplingParams(stop="END").stop == ("END",)
    hash(params)  # hashable because every field is immutable
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]


def test_params_accept_boundary_values():
    SamplingParams(top_p=1.0, min_p=1.0, top_k=-1, logprobs=0, prompt_logprobs=20)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


# ---------------------------------------------------------------------------
# Greedy and top-k = 1
# ---------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[2, [7, 30, 41]] = 100.0  # a three-way tie for the max
    out = Sampler().sample(logits, _states(*[SamplingParams()] * 6))
    expected = logits.argmax(dim=-1)
    assert torch.equal(out.token_ids, expected)
    assert out.token_ids[2].item() == 7


def test_greedy_ties_in_long_rows_resolve_to_the_lowest_id():
    """Vocab-sized rows (vectorised reductions split them into chunks): the first max still wins."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 16384, generator=g)
    tied = [torch.randperm(16384, generator=g)[:5] for _ in range(8)]
    for row, cols in enumerate(tied):
        logits[row, cols] = 100.0
    out = Sampler().sample(logits, _states(*[SamplingParams()] * 8))
    assert out.token_ids.tolist() == [int(cols.min()) for cols in tied]


def test_an_all_greedy_call_takes_the_argmax_its_caller_computed():
    """A replayed decode step computes its rows' argmax with the logits (engine/decode_replay.py): an all-greedy call
    samples exactly those tokens (here deliberately not the logits' own argmax, to show nothing recomputes them), and
    an argmax of the wrong length is refused."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    rows = SamplingRows.build([SamplingParams()] * 4, [None] * 4, torch.device("cpu"))
    given = (logits.argmax(dim=-1) + 1) % VOCAB
    assert torch.equal(Sampler().sample_rows(logits, rows, [0] * 4, argmax=given).token_ids, given)
    assert torch.equal(Sampler().sample_rows(logits, rows, [0] * 4).token_ids, logits.argmax(dim=-1))
    with pytest.raises(ValueError, match=r"argmax \(3,\)"):
        Sampler().sample_rows(logits, rows, [0] * 4, argmax=given[:3])


def test_greedy_rows_in_a_mixed_batch_stay_argmax():
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams() if i % 2 == 0 else SamplingParams(temperature=5.0) for i in range(BATCH)]
    out = Sampler().sample(logits, _states(*params))
    greedy = torch.arange(0, BATCH, 2)
    assert torch.equal(out.token_ids[greedy], logits[greedy].argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.1, 1.0, 3.0, 100.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[3, [5, 9]] = 50.0  # tie: must resolve to id 5 like argmax does
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(BATCH)]
    states = _states(*params)
    sampler = Sampler()
    for _ in range(3):
        assert torch.equal(sampler.sample(logits, states).token_ids, logits.argmax(dim=-1))


# ---------------------------------------------------------------------------
# Filters on a hand-computed example
# ---------------------------------------------------------------------------

# Token ids 0..3 with probabilities deliberately not sorted by id, so the
# un-sort step of process_logits is exercised.
HAND_PROBS = torch.tensor([0.10, 0.50, 0.15, 0.25])
HAND_LOGITS = HAND_PROBS.log().unsqueeze(0)


@pytest.mark.parametrize(
    "settings, kept",
    [
        ({}, {0, 1, 2, 3}),
        ({"top_k": 2}, {1, 3}),
        ({"top_k": -1}, {0, 1, 2, 3}),
        # Sorted masses 0.50, 0.25, 0.15, 0.10; mass before each: 0, .50, .75, .90.
        ({"top_p": 0.7}, {1, 3}),
        ({"top_p": 0.8}, {1, 2, 3}),
        ({"top_p": 0.3}, {1}),  # the top token is always kept
        # min-p 0.25: threshold 0.125 drops only p = 0.10.
        ({"min_p": 0.25}, {1, 2, 3}),
        ({"min_p": 0.5}, {1, 3}),
        ({"min_p": 1.0}, {1}),
        # top-k before top-p: after top-k=3 the masses are .50/.90, .25/.90,
        # .15/.90 with mass before 0, .556, .833, so top-p 0.8 drops id 2
        # (top-p alone at 0.8 keeps it, see above).
        ({"top_k": 3, "top_p": 0.8}, {1, 3}),
        # Temperature before min-p: at T=2 the probs are ~.165 .370 .203 .262,
        # so min-p 0.5 (threshold ~.185) keeps id 2, which it drops at T=1.
        ({"temperature": 2.0, "min_p": 0.5}, {1, 2, 3}),
    ],
)
def test_filters_match_hand_computed_masks(settings, kept):
    temperature = settings.get("temperature", 1.0)
    processed = _filters(HAND_LOGITS, **settings)
    assert _kept(processed[0]) == kept
    # Surviving entries are exactly the temperature-scaled logits.
    survivors = sorted(kept)
    assert torch.equal(processed[0, survivors], HAND_LOGITS[0, survivors] / temperature)


def test_filters_are_row_independent():
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(3))
    temperature = torch.linspace(0.5, 2.0, BATCH)
    top_k = torch.tensor([0, 5, 50, -1, 0, 10, 0, 1])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.95, 1.0, 0.3, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0, 0.2, 0.0, 0.0])
    batched = process_logits(logits, temperature, top_k, top_p, min_p)
    for row in range(BATCH):
        alone = process_logits(
            logits[row : row + 1], temperature[row : row + 1], top_k[row : row + 1],
            top_p[row : row + 1], min_p[row : row + 1],
        )
        assert torch.equal(batched[row : row + 1], alone)


# ---------------------------------------------------------------------------
# Seeded sampling
# ---------------------------------------------------------------------------

TARGET = SamplingParams(temperature=0.8, top_k=200, top_p=0.95, seed=1234)


def _target_logits(step: int) -> torch.Tensor:
    """[V] logits the target request sees at ``step``, identical across runs."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(10_000 + step)) * 3


def _run_target(position: int, batch: int, others_seed: int, default_seed: int) -> list[int]:
    """Sample STEPS tokens for TARGET at ``position`` in a batch of ``batch``
    rows whose other rows get settings and logits derived from ``others_seed``."""
    rng = torch.Generator().manual_seed(others_seed)
    other_params = []
    for i in range(batch):
        kind = i % 4
        if kind == 0:
            other_params.append(SamplingParams())  # greedy
        elif kind == 1:
            other_params.append(SamplingParams(temperature=1.0))  # unseeded
        elif kind == 2:
            other_params.append(SamplingParams(temperature=0.7, top_p=0.9, seed=others_seed + i))
        else:
            other_params.append(SamplingParams(temperature=1.3, min_p=0.05, logprobs=5))
    states = _states(*other_params)
    target = SamplingState.from_params(TARGET)
    states[position] = target

    sampler = Sampler(default_seed=default_seed)
    tokens = []
    for step in range(STEPS):
        logits = torch.randn(batch, VOCAB, generator=rng) * 3
        logits[position] = _target_logits(step)
        tokens.append(sampler.sample(logits, states).token_ids[position].item())
    return tokens


def test_seeded_request_is_reproducible_and_independent_of_batch():
    alone = _run_target(position=0, batch=1, others_seed=0, default_seed=0)
    assert alone == _run_target(position=0, batch=1, others_seed=0, default_seed=0)
    assert alone == _run_target(position=5, batch=BATCH, others_seed=1, default_seed=7)
    assert alone == _run_target(position=0, batch=BATCH, others_seed=2, default_seed=99)
    assert alone == _run_target(position=BATCH - 1, batch=BATCH, others_seed=3, default_seed=0)
    # The test could fail: the tokens are genuinely random, not a fixed argmax.
    assert len(set(alone)) > 1


def test_different_seeds_give_different_sequences():
    def run(seed):
        state = SamplingState.from_params(dataclasses.replace(TARGET, seed=seed))
        sampler = Sampler()
        return [sampler.sample(_target_logits(s).unsqueeze(0), [state]).token_ids.item() for s in range(STEPS)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_n_completions_get_distinct_reproducible_seeds():
    params = SamplingParams(n=3, seed=5, temperature=1.0)
    seeds = [SamplingState.from_params(params, i).seed for i in range(3)]
    assert seeds == [5, 6, 7]
    with pytest.raises(ValueError):
        SamplingState.from_params(params, 3)
    assert SamplingState.from_params(SamplingParams(temperature=1.0)).seed is None


def test_unseeded_rows_use_the_sampler_default_seed_without_touching_global_rng():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0)] * 4
    global_state = torch.get_rng_state()
    first = Sampler(default_seed=3).sample(logits, _states(*params)).token_ids
    again = Sampler(default_seed=3).sample(logits, _states(*params)).token_ids
    other = Sampler(default_seed=4).sample(logits, _states(*params)).token_ids
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# ---------------------------------------------------------------------------
# Distribution sanity
# ---------------------------------------------------------------------------

DIST_PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_seeded_samples_follow_the_distribution():
    state = SamplingState.from_params(SamplingParams(temperature=1.0, seed=42))
    sampler = Sampler()
    logits = DIST_PROBS.log().unsqueeze(0)
    tokens = torch.cat([sampler.sample(logits, [state]).token_ids for _ in range(DIST_SAMPLES)])
    freq = _frequencies(tokens, len(DIST_PROBS))
    assert torch.allclose(freq, DIST_PROBS, atol=DIST_TOLERANCE), freq


@pytest.mark.parametrize(
    "params, expected",
    [
        # Temperature 2 on log-probs gives p ** 0.5, renormalised.
        (SamplingParams(temperature=2.0), DIST_PROBS.sqrt() / DIST_PROBS.sqrt().sum()),
        # top-p 0.6: mass before in sorted order is 0, .4, .7 -> keep ids 3, 2.
        (SamplingParams(temperature=1.0, top_p=0.6), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])),
        (SamplingParams(temperature=1.0, top_k=3), torch.tensor([0.0, 2 / 9, 3 / 9, 4 / 9])),
    ],
)
def test_unseeded_batched_samples_follow_the_processed_distribution(params, expected):
    logits = DIST_PROBS.log().expand(DIST_SAMPLES, -1)
    tokens = Sampler(default_seed=0).sample(logits, _states(*[params] * DIST_SAMPLES)).token_ids
    freq = _frequencies(tokens, len(DIST_PROBS))
    assert torch.allclose(freq, expected, atol=DIST_TOLERANCE), freq


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------

LOGPROB_K = 3


def test_raw_and_processed_logprobs_come_from_the_right_distribution():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)) * 2
    common = dict(temperature=0.7, top_k=5, seed=11, logprobs=LOGPROB_K)
    raw_params = SamplingParams(**common, logprobs_mode="raw")
    proc_params = SamplingParams(**common, logprobs_mode="processed")
    raw = Sampler().sample(logits, _states(raw_params))
    proc = Sampler().sample(logits, _states(proc_params))
    # The mode changes what is reported, not what is sampled.
    assert torch.equal(raw.token_ids, proc.token_ids)
    token = raw.token_ids.item()

    raw_lp = logits[0].log_softmax(-1)
    proc_lp = _filters(logits, temperature=0.7, top_k=5)[0].log_softmax(-1)
    for record, expected in ((raw.logprobs[0], raw_lp), (proc.logprobs[0], proc_lp)):
        assert record.token_id == token
        assert record.logprob == pytest.approx(expected[token].item(), abs=1e-6)
        values, ids = expected.topk(LOGPROB_K)
        for i, v in zip(ids.tolist(), values.tolist()):
            assert record.top[i] == pytest.approx(v, abs=1e-6)
        assert token in record.top
        assert record.rank == int((expected > expected[token]).sum()) + 1

    # Processed mass is concentrated on the 5 survivors of top-k: higher
    # logprobs there, -inf elsewhere; raw logprobs are finite everywhere.
    assert proc.logprobs[0].logprob > raw.logprobs[0].logprob
    assert math.isfinite(min(raw_lp.tolist()))
    assert int(torch.isfinite(proc_lp).sum()) == 5


def test_logprob_dict_always_contains_the_sampled_token():
    logits = torch.zeros(1, 16)
    logits[0, 0] = 0.5  # token 0 is the most likely, but sampling often picks others
    for seed in range(50):
        out = Sampler().sample(logits, _states(SamplingParams(temperature=1.0, seed=seed, logprobs=1)))
        token, record = out.token_ids.item(), out.logprobs[0]
        if token != 0:
            assert set(record.top) == {0, token}
            assert record.rank > 1
            break
    else:
        pytest.fail("no seed sampled a non-top token")
    only = Sampler().sample(logits, _states(SamplingParams(logprobs=0))).logprobs[0]
    assert set(only.top) == {0} and only.rank == 1


def test_rows_without_logprobs_get_none_and_greedy_processed_uses_temperature_one():
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(), SamplingParams(top_k=4, logprobs=2, logprobs_mode="processed")]
    out = Sampler().sample(logits, _states(*params))
    assert out.logprobs[0] is None
    expected = _filters(logits[1:], top_k=4)[0].log_softmax(-1)
    token = out.token_ids[1].item()
    assert token == logits[1].argmax().item()
    assert out.logprobs[1].logprob == pytest.approx(expected[token].item(), abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [512, 3])
def test_prompt_logprobs(monkeypatch, chunk_rows):
    monkeypatch.setattr(sampler_module, "PROMPT_LOGPROBS_CHUNK_ROWS", chunk_rows)
    prompt_len, vocab = 8, 40
    logits = torch.randn(prompt_len - 1, vocab, generator=torch.Generator().manual_seed(7))
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(8))
    out = prompt_logprobs(logits, prompt[1:], k=2)
    assert len(out) == prompt_len and out[0] is None
    expected = logits.log_softmax(-1)
    for t in range(prompt_len - 1):
        record = out[t + 1]
        token = prompt[t + 1].item()
        assert record.token_id == token
        assert record.logprob == pytest.approx(expected[t, token].item(), abs=1e-6)
        assert set(expected[t].topk(2).indices.tolist()) | {token} == set(record.top)

    params = SamplingParams(temperature=0.5, top_k=3)
    processed = prompt_logprobs(logits, prompt[1:], k=2, mode="processed", params=params)
    expected_proc = _filters(logits, temperature=0.5, top_k=3).log_softmax(-1)
    for t in range(prompt_len - 1):
        token = prompt[t + 1].item()
        assert processed[t + 1].logprob == pytest.approx(expected_proc[t, token].item(), abs=1e-6)
    with pytest.raises(ValueError):
        prompt_logprobs(logits, prompt[1:], k=2, mode="processed")
