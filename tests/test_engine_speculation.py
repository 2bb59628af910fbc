"""The engine's speculative-decoding hooks, driven by a scripted proposer that drafts a known continuation
(the plain engine's own output) with chosen drafts made wrong. Whatever is accepted or rejected, the
output must equal plain decoding token for token (greedy and seeded sampling, logprobs, stop ids and
stop strings inside an accepted run, max_tokens, max_model_len), every cache slot must hold exactly
the sequence's computed positions after each step, and the proposer must hear of every final position.

Two models: the tiny config (sliding + CSA + HCA layers; window 32, compress rates 4 and 16) with drafts
wrong in their last token or in runs (two or more rejected drafts after the rings wrapped: the rows they
overwrote are restored, `ModelCache.snapshot` / `rewind`, tests/test_cache_rollback.py), and a
sliding-only model whose window spans max_model_len, with runs of wrong drafts.
"""

from __future__ import annotations

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.engine.engine import Engine
from dsv4.engine.speculation import Draft

VOCAB = 512
SEED = 13
LOGPROB_TOL = 1e-5
K = 3
MAX_MODEL_LEN = 128
PROMPT_LENGTHS = (2, 5, 17, 31, 40, 63)  # around the window (32) and multiples of the compress rates


def _prompts(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _llm(path, write_word_tokenizer, config: dict) -> LLM:
    ref.save_hf_checkpoint(ref.build_reference_model(config, SEED), path)
    write_word_tokenizer(path, VOCAB)
    return LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def full(tmp_path_factory, write_word_tokenizer):
    return _llm(tmp_path_factory.mktemp("spec_full"), write_word_tokenizer, ref.tiny_config())


@pytest.fixture(scope="module")
def wide(tmp_path_factory, write_word_tokenizer):
    config = ref.tiny_config(layer_types=[ref.SLIDING] * 4, sliding_window=MAX_MODEL_LEN)
    return _llm(tmp_path_factory.mktemp("spec_wide"), write_word_tokenizer, config)


# Which drafts the scripted proposer gets wrong, from (index of the draft's token in the completion,
# its place in the proposal, the proposal's length).
def _wrong_last(index: int, place: int, count: int) -> bool:
    return place == count - 1 and index % 3 == 0


def _wrong_runs(index: int, place: int, count: int) -> bool:
    return index % 5 in (2, 3)


def _never(index: int, place: int, count: int) -> bool:
    return False


class ScriptedProposer:
    """Drafts each sequence's known continuation, a draft made wrong where `wrong` says; records what
    the engine asked for and committed."""

    def __init__(self, continuations: dict[tuple[int, int], list[int]], wrong, k: int = K):
        self.num_speculative_tokens = k
        self.continuations = continuations  # (request id, completion index) -> tokens
        self.wrong = wrong
        self.asked: list[tuple[int, int, int, int]] = []  # (max drafts, k, room to max_tokens, to max_model_len)
        self.committed: dict[tuple[str, int], int] = {}  # sequence -> end of its final positions
        self.proposed: dict[tuple[str, int], int] = {}  # sequence -> drafts of its proposal in flight
        self.verdicts: list[tuple[int, int]] = []  # (drafts kept, drafts proposed) per verify chunk
        self.released = 0

    def propose(self, seqs, max_drafts):
        drafts = []
        for seq, most in zip(seqs, max_drafts):
            self.asked.append((most, self.num_speculative_tokens, seq.params.max_tokens - len(seq.output_ids) - 1,
                               MAX_MODEL_LEN - seq.num_tokens - 1))
            n = len(seq.output_ids)
            tokens = self.continuations[seq.request_id, seq.index][n : n + most]
            tokens = [(t + 1) % VOCAB if self.wrong(n + i, i, len(tokens)) else t for i, t in enumerate(tokens)]
            drafts.append(Draft(tokens))
            self.proposed[seq.request_id, seq.index] = len(tokens)
        return drafts

    def on_commit(self, seq, first_position, streams):
        key = (seq.request_id, seq.index)
        assert first_position == self.committed.get(key, 0), "final positions must arrive in order, once"
        assert streams.dim() == 3 and streams.shape[0] >= 1
        self.committed[key] = first_position + streams.shape[0]
        assert self.committed[key] == seq.computed
        if key in self.proposed:  # a verify chunk: its last known token's row, then one per kept draft
            self.verdicts.append((streams.shape[0] - 1, self.proposed.pop(key)))

    def on_release(self, seq):
        self.committed.pop((seq.request_id, seq.index), None)
        self.proposed.pop((seq.request_id, seq.index), None)
        self.released += 1


def _run(llm: LLM, prompts, params, proposer=None) -> list:
    """Every prompt through a fresh engine on llm's model (with `proposer`, speculating); after every step,
    each running sequence's slot holds exactly its computed positions. Returns the final outputs."""
    engine = Engine(llm.loaded.target, llm.limits, 0, llm.config.eos_token_ids, llm.tokenizer, proposer=proposer)
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    requests = [engine.add_request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_work():
        engine.step()
        for seq in engine.scheduler.running:
            assert engine.runner.cache.lengths[seq.slot] == seq.computed
    assert len(engine.scheduler.free_slots) == llm.limits.max_num_seqs
    return [r.output(delta=False) for r in requests]


def _continuations(outputs) -> dict[tuple[str, int], list[int]]:
    return {(o.request_id, c.index): c.token_ids for o in outputs for c in o.outputs}


def _same(plain, speculated) -> None:
    for a, b in zip(plain, speculated):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason)
            assert (x.logprobs is None) == (y.logprobs is None)
            for lp_x, lp_y in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert lp_x.keys() == lp_y.keys()
                assert all(abs(lp_x[t] - lp_y[t]) <= LOGPROB_TOL for t in lp_x)


def _check_asked(proposer: ScriptedProposer) -> None:
    assert proposer.asked, "the scheduler never left room for drafts"
    for most, k, to_max_tokens, to_model_len in proposer.asked:
        assert 1 <= most <= min(k, to_max_tokens, to_model_len)


@pytest.mark.parametrize("model, wrong", [("full", _wrong_last), ("full", _wrong_runs), ("wide", _wrong_runs)])
def test_greedy_speculation_equals_plain_greedy(model, wrong, request):
    llm = request.getfixturevalue(model)
    prompts = _prompts()
    # n=2 on one prompt, logprobs on another; 6 prompts for 4 slots: sequences join and leave mid-flight.
    params = [SamplingParams(max_tokens=30 + 3 * i, ignore_eos=True, logprobs=2 if i == 1 else None,
                             n=2 if i == 2 else 1) for i in range(len(prompts))]
    plain = _run(llm, prompts, params)
    proposer = ScriptedProposer(_continuations(plain), wrong)
    speculated = _run(llm, prompts, params, proposer)
    _same(plain, speculated)
    _check_asked(proposer)
    # Both outcomes happened: drafts were kept, and drafts were rejected (so slots were rewound).
    assert any(kept > 0 for kept, _ in proposer.verdicts) and any(kept < m for kept, m in proposer.verdicts)
    assert proposer.released == sum(len(o.outputs) for o in plain)


@pytest.mark.parametrize("model", ["full", "wide"])
def test_seeded_sampling_under_speculation_equals_plain(model, request):
    llm = request.getfixturevalue(model)
    prompts = _prompts((4, 9, 29))
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_k=40, seed=7, n=2, logprobs=1)
    plain = _run(llm, prompts, params)
    assert len({tuple(c.token_ids) for o in plain for c in o.outputs}) == 2 * len(prompts)  # really random
    _same(plain, _run(llm, prompts, params, ScriptedProposer(_continuations(plain), _wrong_runs)))


def test_stop_id_and_stop_string_inside_an_accepted_run(full):
    prompt = _prompts((11,))
    base = _run(full, prompt, SamplingParams(max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    stop_id, stop_word = base[6], f" w{base[9]} "
    cases = [SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
             SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop_word])]
    for params in cases:
        plain = _run(full, prompt, params)
        assert plain[0].outputs[0].finish_reason == "stop"
        # Every draft right: the stop falls inside a run of K accepted drafts.
        proposer = ScriptedProposer({("0", 0): base}, _never, k=4)
        speculated = _run(full, prompt, params, proposer)
        _same(plain, speculated)
        assert len(speculated[0].outputs[0].token_ids) < len(base)


def test_max_tokens_and_max_model_len_are_never_passed(full):
    near_end = _prompts((MAX_MODEL_LEN - 7,))
    prompts = _prompts((6, 6, 6, 6)) + near_end
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 6)] + [SamplingParams(
        max_tokens=50, ignore_eos=True)]
    plain = _run(full, prompts, params)
    assert [len(o.outputs[0].token_ids) for o in plain] == [1, 2, 3, 6, 7]  # the last one: max_model_len
    proposer = ScriptedProposer(_continuations(plain), _never, k=4)
    speculated = _run(full, prompts, params, proposer)
    _same(plain, speculated)
    assert all(o.outputs[0].finish_reason == "length" for o in speculated)
    _check_asked(proposer)
