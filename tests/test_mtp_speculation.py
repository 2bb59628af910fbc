"""Speculative decoding with the MTP drafter (`LLM(draft="mtp", num_speculative_tokens=k)`) against plain decoding.

The model is the embedded `dsv4-sort` (fp32; window 32, compress rates 4 and 8; its MTP layer is trained with the
target, so drafts are often right and accepted runs, rejections and rollbacks all happen). Prompts mix the task's own
("sort 31402=") with random-token prompts run with ignore_eos up to max_model_len (64), so prompts and generations
cross the sliding window and many multiples of both compress rates.

* greedy: token ids identical to plain greedy for every prompt, batches 1, 4, 16 and k = 1..4, with continuous
  batching (more prompts than slots), chunked prefill (a small step budget), n > 1, logprobs and prompt logprobs;
* seeded sampling: a request reproduces its tokens alone or among others;
* logprobs under rejection sampling are the target's own logprobs of the tokens chosen;
* stop strings and stop ids inside accepted runs, max_tokens and max_model_len;
* speculation turns off above `speculation_max_batch`;
* metrics: per completion and engine totals agree;
* arguments are checked.
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.errors import ArgumentTypeError, ConfigError
from dsv4.tasks import sort_digits as task

MODEL = "dsv4-sort"
MAX_MODEL_LEN = 64
LOGPROB_TOL = 1e-4  # fp32 rounding of a verify chunk against single-token decodes (seen: 1.05e-5)
SEED = 3


def _llm(k: int | None = None, **kwargs) -> LLM:
    if k is not None:
        kwargs.update(draft="mtp", num_speculative_tokens=k)
    kwargs.setdefault("max_num_seqs", 4)
    kwargs.setdefault("max_num_batched_tokens", 24)
    return LLM(MODEL, dtype="float32", max_model_len=MAX_MODEL_LEN, **kwargs)


def _prompts(n: int) -> list[list[int]]:
    """Alternately the task's prompts and random-token prompts of 3..50 tokens."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for i, ex in enumerate(task.examples(n, SEED)):
        if i % 2:
            out.append(torch.randint(3, 49, (3 + (i * 7) % 48,), generator=g).tolist())
        else:
            out.append(task.encode(ex.prompt))
    return out


def _params(n: int) -> list[SamplingParams]:
    """The task prompts stop at eos; the random ones ignore it and run to max_model_len. Logprobs are asked of
    task prompts only: on long random contexts the indexer's top-k choice of compressed entries is sometimes a near
    tie, which rounding differences between chunk shapes flip (plain decoding at batch 1 and batch 16 differs
    there by up to 0.05 in a logprob, with the same tokens), so a 1e-5 comparison would test the tie, not
    speculation."""
    return [SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=bool(i % 2), logprobs=2 if i % 6 == 0 else None,
                           prompt_logprobs=1 if i == 0 else None, n=2 if i % 5 == 4 else 1) for i in range(n)]


def _same(plain, speculated) -> None:
    for a, b in zip(plain, speculated, strict=True):
        assert a.error is None and b.error is None
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert (x.finish_reason, x.stop_reason, x.text) == (y.finish_reason, y.stop_reason, y.text)
            for lp_x, lp_y in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert lp_x.keys() == lp_y.keys()
                assert all(abs(lp_x[t] - lp_y[t]) <= LOGPROB_TOL for t in lp_x)
        for lp_x, lp_y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (lp_x is None) == (lp_y is None)
            if lp_x is not None:
                assert all(abs(lp_x[t] - lp_y[t]) <= LOGPROB_TOL for t in lp_x)


@pytest.fixture(scope="module")
def plain():
    return _llm(max_num_seqs=16, max_num_batched_tokens=64)


@pytest.mark.parametrize("batch, num_prompts", [(1, 6), (4, 12), (16, 20)])
def test_greedy_speculation_is_exact(plain, batch, num_prompts):
    prompts = _prompts(num_prompts)
    params = _params(len(prompts))
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert any(o.outputs[0].finish_reason == "length" and len(o.prompt_token_ids) + len(o.outputs[0].token_ids)
               == MAX_MODEL_LEN for o in expected)  # some ran to max_model_len, across the window
    for k in (1, 2, 3, 4):
        llm = _llm(k, max_num_seqs=batch, max_num_batched_tokens=max(batch * (k + 1), 12),
                   speculation_max_batch=batch)
        got = llm.generate(prompts, params, use_tqdm=False)
        _same(expected, got)
        totals = llm.engine.speculation
        assert totals.accepted_tokens > 0 and totals.accepted_tokens < totals.draft_tokens  # both outcomes
        assert len(totals.drafted_per_position) == k
        # Per completion metrics add up to the engine's totals.
        per = [c.speculation for o in got for c in o.outputs if c.speculation is not None]
        assert sum(m.draft_tokens for m in per) == totals.draft_tokens
        assert sum(m.accepted_tokens for m in per) == totals.accepted_tokens


def test_greedy_drafts_are_the_argmax_with_or_without_a_sampled_neighbour():
    """An all-greedy step drafts by argmax and hands the engine no q; a step that also drafts for a sampled
    request gives every draft its q (one-hot at a greedy sequence's token): the same greedy drafts either way."""
    prompts = [task.encode(ex.prompt) for ex in task.examples(2, SEED)]
    greedy, sampled = SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    llm = _llm(3, max_num_seqs=2)
    proposer, calls = llm.engine.proposer, []
    propose = proposer.propose

    def recorded(seqs, max_drafts):
        drafts = propose(seqs, max_drafts)
        calls.append([((*seq.prompt_ids, *seq.output_ids), seq.params.greedy, d) for seq, d in zip(seqs, drafts)])
        return drafts

    proposer.propose = recorded
    llm.generate(prompts, greedy, use_tqdm=False)
    alone = {known: d.token_ids for call in calls for known, _, d in call}  # what follows those tokens
    assert calls and all(d.probs is None for call in calls for *_, d in call)
    calls.clear()
    llm.generate(prompts, [greedy, sampled], use_tqdm=False)
    mixed = [call for call in calls if len(call) == 2]
    assert mixed
    for call in mixed:
        for known, is_greedy, d in call:
            assert d.probs is not None and d.probs.shape == (len(d.token_ids), 49)
            assert torch.allclose(d.probs.sum(-1), torch.ones(len(d.token_ids)))
            q_of_drafts = d.probs[torch.arange(len(d.token_ids)), d.token_ids]
            if is_greedy:
                assert torch.equal(q_of_drafts, torch.ones(len(d.token_ids)))  # one-hot at the argmax
                assert d.token_ids == alone[known][: len(d.token_ids)]
            else:
                assert bool((q_of_drafts > 0).all())


def test_seeded_sampling_reproduces_whatever_the_batch():
    prompts = _prompts(6)
    seeded = SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True, temperature=0.8, top_p=0.9, min_p=0.02,
                            seed=11)
    other = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0)
    llm = _llm(3)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.speculation.accepted_tokens > 0
    for place in (0, 3, 5):  # among different neighbours, in another slot, after other steps
        batch = [*prompts[:place], prompts[1], *prompts[place + 1 :]]
        params = [seeded if i == place else other for i in range(len(batch))]
        assert llm.generate(batch, params, use_tqdm=False)[place].outputs[0].token_ids == alone
    assert _llm(3).generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids == alone


def test_logprobs_under_rejection_sampling_are_the_targets(plain):
    prompts = [task.encode(ex.prompt) for ex in task.examples(6, SEED)]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=5, logprobs=0, n=2)
    llm = _llm(3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.speculation.accepted_tokens > 0
    for out in outputs:
        for c in out.outputs:
            ids = out.prompt_token_ids + c.token_ids
            target = plain.forward_logprobs([ids])[0]  # [len, V] log-softmax
            start = len(out.prompt_token_ids) - 1
            for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
                assert abs(lp[token] - target[start + i, token].item()) <= LOGPROB_TOL


def test_stops_inside_accepted_runs_and_length_limits(plain):
    prompt = task.encode("sort 86420135=")
    base = plain.generate([prompt], SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert base.text.strip() == "01234568"
    cases = [SamplingParams(max_tokens=12, stop_token_ids=[base.token_ids[4]]),
             SamplingParams(max_tokens=12, stop=["45"]), SamplingParams(max_tokens=5),
             SamplingParams(max_tokens=1)]
    llm = _llm(4)
    for params in cases:
        _same(plain.generate([prompt], params, use_tqdm=False), llm.generate([prompt], params, use_tqdm=False))
    long_prompt = _prompts(2)[1][:3] * 20  # 60 tokens: 4 left to max_model_len
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    got = llm.generate([long_prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(got.token_ids) == MAX_MODEL_LEN - len(long_prompt) and got.finish_reason == "length"
    _same(plain.generate([long_prompt], params, use_tqdm=False), llm.generate([long_prompt], params, use_tqdm=False))


def test_speculation_turns_off_above_its_batch_limit():
    prompts = [task.encode(ex.prompt) for ex in task.examples(8, SEED)]
    params = SamplingParams(max_tokens=12)
    llm = _llm(2, max_num_seqs=8, max_num_batched_tokens=32, speculation_max_batch=3)
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.steps_without_speculation > 0  # 8 decoding together: no drafts
    assert llm.engine.speculation.verify_steps > 0  # once fewer than 4 were left decoding, drafts again
    never = _llm(2, max_num_seqs=8, max_num_batched_tokens=32, speculation_max_batch=0)
    never.generate(prompts, params, use_tqdm=False)
    assert never.engine.speculation.verify_steps == 0


def test_bad_speculation_arguments_are_refused():
    with pytest.raises(ConfigError, match="num_speculative_tokens needs a drafter"):
        LLM(MODEL, num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(MODEL, draft="mtp", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(MODEL, draft="mtp", num_speculative_tokens=9)
    with pytest.raises(ArgumentTypeError, match="num_speculative_tokens"):
        LLM(MODEL, draft="mtp", num_speculative_tokens=2.5)
    with pytest.raises(ConfigError, match="speculation_max_batch"):
        LLM(MODEL, draft="mtp", num_speculative_tokens=2, speculation_max_batch=-1)
    with pytest.raises(ConfigError, match="smallest cache ring"):
        LLM(MODEL, draft="mtp", num_speculative_tokens=8)  # a 9-token verify chunk, rings of 8 rows


def test_preemption_and_a_weight_update_mid_flight_stay_exact(plain):
    """A preempted sequence (and every sequence after a weight update) recomputes its tokens and the drafter
    starts its slot over; outputs still equal plain greedy."""
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = _llm(3)
    engine = llm.engine
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    for step in range(40):
        engine.step()
        if step == 6:
            engine.preempt("1")
        if step == 12:
            with engine.exclusive():
                engine.weights_updated()  # same weights: every running sequence is preempted and recomputes
    while engine.has_work():
        engine.step()
    assert [r.output(delta=False).outputs[0].token_ids for r in requests] == [o.outputs[0].token_ids for o in expected]
    assert engine.speculation.accepted_tokens > 0
