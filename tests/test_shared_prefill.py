"""Shared prompt prefill: sequences with one prompt (a request's n completions, repeated prompts) prefill it
once and fork the slot state.

The scheduler's grouping on its own (no model): who leads and who follows (prompt-scoring sequences only
behind a leader that computed nothing), that followers take no budget, that a group forks at the step of
the leader's last chunk (a one-token one included) and no later, and what a leader or follower leaving
before the fork does. Then the engine on the tiny model (window 32, compress rates 4 and 16) with a
40-token prompt (past the window, across both rates) prefilled in chunks of 16: outputs with sharing on
equal sharing off (tokens exactly, logprobs and prompt logprobs within the batching tolerance of
test_batching.py: a shared prefill batches fewer rows), for n completions and repeated prompts across
requests, greedy and seeded, with MTP and DSpark speculation; after the fork every cache tensor of a
follower's slot (window, compressor and indexer rings and entries) and the drafters' caches equal bit for
bit what a prefill of that prompt on its own leaves; the model computes the prompt once per group; a
request arriving mid-prefill follows; a leader aborted mid-prefill hands its group on (scores start
over); a weight update between the leader's chunks makes the group recompute under the new version; a
prompt at max_model_len forks one token each.
"""

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.embedded import DSPARK_MODEL
from dsv4.engine.limits import EngineLimits
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.sequence import Sequence, SequenceStatus
from dsv4.model.cache import cache_tensors
from dsv4.tasks import sort_digits as task

TARGET_SEED, MTP_SEED, PROMPT_SEED = 31, 32, 33
PROMPT_LEN = 40  # > sliding_window 32; 10 CSA (rate 4) and 2 HCA (rate 16) entries
BUDGET = 16  # the leader's prompt runs in chunks of 16, 16, 8
LOGPROB_TOL = 1e-5  # tests/test_batching.py's: batch composition moves fp32 logprobs by a few ulps
VOCAB = 512


# ---- the scheduler alone ----
def _limits(seqs: int = 4, budget: int = 16, model_len: int = 64) -> EngineLimits:
    return EngineLimits(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=model_len)


def _seqs(name: str, prompt: list[int], n: int, **params) -> list[Sequence]:
    p = SamplingParams(n=n, max_tokens=8, **params)
    return [Sequence(name, i, prompt, p) for i in range(n)]


def _apply(scheduler: Scheduler, plan, token: int = 7) -> None:
    """Apply a plan as the engine would: chunks computed, a completed prompt samples; followers forked."""
    for chunk in plan.chunks:
        seq = chunk.seq
        seq.computed += chunk.num_tokens
        if seq.computed == seq.num_tokens:
            seq.append(token, None, 0)
    for leader, followers in plan.forks:
        for follower in followers:
            follower.computed = leader.computed
            follower.append(token, None, 0)


def _step(scheduler: Scheduler, share: bool = True):
    plan = scheduler.schedule(share_prompts=share)
    _apply(scheduler, plan)
    return plan


PROMPT = list(range(100, 130))  # 30 tokens
OTHER = list(range(200, 230))


def test_the_n_completions_of_a_prompt_prefill_once_and_fork_at_the_last_chunk():
    scheduler = Scheduler(_limits(seqs=4, budget=16))
    group = _seqs("r", PROMPT, 4)
    for seq in group:
        scheduler.add(seq)
    plan = _step(scheduler)
    assert plan.admitted == tuple(group)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(group[0], 16)]  # followers take no budget
    assert plan.forks == () and scheduler.followers(group[0]) == tuple(group[1:])
    plan = _step(scheduler)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(group[0], 14)]
    assert plan.forks == ((group[0], tuple(group[1:])),)
    assert scheduler.followers(group[0]) == ()
    # From the fork on, all four decode independently.
    plan = _step(scheduler)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(s, 1) for s in group]


def test_a_prompt_whose_last_chunk_is_one_token_forks_with_it():
    scheduler = Scheduler(_limits(seqs=4, budget=16))
    group = _seqs("r", list(range(100, 117)), 3)  # 17 tokens: 16, then 1 (planned with the decodes)
    for seq in group:
        scheduler.add(seq)
    _step(scheduler)
    plan = _step(scheduler)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(group[0], 1)]
    assert plan.forks == ((group[0], tuple(group[1:])),)


def test_repeated_prompts_of_separate_requests_group_and_other_prompts_do_not():
    scheduler = Scheduler(_limits(seqs=4, budget=64))
    a, b = _seqs("a", PROMPT, 1), _seqs("b", list(PROMPT), 2)  # an equal prompt in another list
    c = _seqs("c", OTHER, 1)
    for seq in a + c + b:
        scheduler.add(seq)
    plan = _step(scheduler)
    assert [ch.seq.request_id for ch in plan.chunks] == ["a", "c"]
    assert plan.forks == ((a[0], tuple(b)),)


def test_sharing_off_one_token_prompts_and_recomputing_sequences_do_not_group():
    scheduler = Scheduler(_limits(seqs=4, budget=64))
    pair = _seqs("off", PROMPT, 2)
    for seq in pair:
        scheduler.add(seq)
    plan = _step(scheduler, share=False)
    assert [c.seq for c in plan.chunks] == pair and plan.forks == ()

    scheduler = Scheduler(_limits(seqs=4, budget=64))
    ones = _seqs("one", [5], 2)
    for seq in ones:
        scheduler.add(seq)
    plan = _step(scheduler)
    assert [c.seq for c in plan.chunks] == ones and plan.forks == ()

    # A preempted sequence recomputes its prompt and output: it leads nothing and follows no one.
    scheduler = Scheduler(_limits(seqs=4, budget=64))
    done = _seqs("done", PROMPT, 1)[0]
    scheduler.add(done)
    _step(scheduler)
    scheduler.preempt(done)
    fresh = _seqs("fresh", PROMPT, 1)[0]
    scheduler.add(fresh)
    plan = _step(scheduler)
    assert {c.seq for c in plan.chunks} == {done, fresh} and plan.forks == ()


def test_a_prompt_scoring_sequence_follows_only_a_leader_that_computed_nothing():
    scheduler = Scheduler(_limits(seqs=6, budget=16))
    plain = _seqs("plain", PROMPT, 1)
    scored = _seqs("scored", PROMPT, 2, prompt_logprobs=1)
    for seq in plain + scored:
        scheduler.add(seq)
    _step(scheduler)  # admitted together: the scoring one follows too (its scores come from the first chunk)
    assert scheduler.followers(plain[0]) == tuple(scored)
    late = _seqs("late", PROMPT, 2, prompt_logprobs=1)
    for seq in late:
        scheduler.add(seq)
    plan = _step(scheduler)  # too late to score the first chunk: it leads a group of its own, its sibling follows
    assert plan.forks == ((plain[0], tuple(scored)),)
    assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(plain[0], 14), (late[0], 2)]
    assert scheduler.followers(late[0]) == (late[1],)


def test_a_follower_admitted_before_the_last_chunk_joins_and_one_after_it_leads():
    scheduler = Scheduler(_limits(seqs=4, budget=16))
    first = _seqs("first", PROMPT, 1)[0]
    scheduler.add(first)
    _step(scheduler)  # 16 of its 30 tokens
    joiner = _seqs("joiner", PROMPT, 1)[0]
    scheduler.add(joiner)
    plan = _step(scheduler)  # the last 14: the joiner forks from it
    assert plan.forks == ((first, (joiner,)),)
    late = _seqs("late", PROMPT, 1)[0]
    scheduler.add(late)
    plan = _step(scheduler)  # decoding overwrote the prompt's rows: the late one prefills itself
    assert (late, 14) in [(c.seq, c.num_tokens) for c in plan.chunks] and plan.forks == ()


def test_a_leader_leaving_before_the_fork_hands_its_group_to_its_first_follower():
    for leave in ("release", "preempt"):
        scheduler = Scheduler(_limits(seqs=4, budget=16))
        leader, *followers = _seqs("r", PROMPT, 3)
        other = _seqs("other", PROMPT, 1)[0]
        for seq in (leader, *followers, other):
            scheduler.add(seq)
        _step(scheduler)
        assert leader.computed == 16
        getattr(scheduler, leave)(leader)
        heir = followers[0]
        assert scheduler.followers(heir) == (followers[1], other)
        plan = _step(scheduler)
        assert [(c.seq, c.num_tokens) for c in plan.chunks] == [(heir, 16)]  # from position 0: it computed nothing
        plan = _step(scheduler)
        # A preempted leader lost its state too: readmitted at once, it follows the heir.
        rejoined = (leader,) if leave == "preempt" else ()
        assert plan.forks == ((heir, (followers[1], other, *rejoined)),)


def test_a_follower_leaving_before_the_fork_just_leaves():
    scheduler = Scheduler(_limits(seqs=4, budget=16))
    leader, gone, kept = _seqs("r", PROMPT, 3)
    for seq in (leader, gone, kept):
        scheduler.add(seq)
    _step(scheduler)
    scheduler.release(gone)
    assert gone.slot is None and scheduler.followers(leader) == (kept,)
    assert _step(scheduler).forks == ((leader, (kept,)),)


# ---- the engine on the tiny model ----
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    config = ref.tiny_config()
    native = ref.native_state_dict(ref.build_reference_model(config, TARGET_SEED))
    path = tmp_path_factory.mktemp("shared_prefill") / "ckpt"
    ref.write_native_checkpoint(path, config, {**native, **ref.random_mtp_tensors(config, MTP_SEED)})
    yield path
    torch.set_num_threads(saved)


def _llm(path, share: bool, draft: str | None = None, seqs: int = 4, model_len: int = 128,
         budget: int = BUDGET) -> LLM:
    return LLM(path, dtype="float32", draft=draft, max_num_seqs=seqs, max_num_batched_tokens=budget,
               max_model_len=model_len, share_prompt_prefill=share)


def _prompt(seed: int = PROMPT_SEED, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_same(shared, separate) -> None:
    """Equal completions: tokens and logprob keys exactly, logprob values within LOGPROB_TOL."""
    assert len(shared) == len(separate)
    for a, b in zip(shared, separate):
        assert a.error is None and b.error is None
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            for da, db in zip(ca.logprobs or [], cb.logprobs or []):
                assert da.keys() == db.keys()
                assert max(abs(da[t] - db[t]) for t in da) <= LOGPROB_TOL
        if b.prompt_logprobs is not None:
            for da, db in zip(a.prompt_logprobs, b.prompt_logprobs):
                assert (da is None) == (db is None)
                if da is not None:
                    assert da.keys() == db.keys() and max(abs(da[t] - db[t]) for t in da) <= LOGPROB_TOL


def _count_prompt_rows(llm: LLM) -> list[int]:
    """Make the runner count the prompt tokens it computes (rows of chunks that start inside a prompt)."""
    counted = [0]
    runner = llm.engine.runner
    execute = runner.execute

    def counting(chunks, *args, **kwargs):
        counted[0] += sum(len(c.token_ids) for c in chunks if c.start < PROMPT_LEN)
        return execute(chunks, *args, **kwargs)

    runner.execute = counting
    return counted


SEEDED = SamplingParams(n=4, max_tokens=10, temperature=0.9, top_k=50, seed=11, logprobs=2, ignore_eos=True)
GREEDY = SamplingParams(n=4, max_tokens=10, logprobs=2, ignore_eos=True)


# Without a drafter the leader's prompt is chunked. With MTP, seeded tokens depend on the drafts verified
# (rejection sampling keeps the distribution, not the tokens), so the budget fits every prompt at once:
# sharing off then prefills all eight in one step too, and both runs draft the same verify chunks.
@pytest.mark.parametrize("draft, budget", [(None, BUDGET), ("mtp", 8 * PROMPT_LEN)])
def test_n_completions_share_one_prefill_and_match_separate_prefills(checkpoint, draft, budget):
    prompt = _prompt()
    results = {}
    for share in (True, False):
        llm = _llm(checkpoint, share, draft, seqs=8, budget=budget)
        rows = _count_prompt_rows(llm)
        results[share] = llm.generate([prompt, prompt], [GREEDY, SEEDED], use_tqdm=False)
        # Two requests of four: with sharing, one prefill in all (the second request follows the first).
        assert rows[0] == (1 if share else 8) * PROMPT_LEN
        assert llm.engine.shared_prefills == (7 if share else 0)
    _assert_same(results[True], results[False])
    assert len({tuple(c.token_ids) for c in results[True][1].outputs}) == 4  # the seeds do differ


def test_repeated_prompts_across_requests_with_prompt_logprobs(checkpoint):
    prompt, other = _prompt(), _prompt(PROMPT_SEED + 1, 37)
    params = [SamplingParams(max_tokens=6, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(n=2, max_tokens=6, temperature=0.7, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(n=2, max_tokens=6, prompt_logprobs=1, logprobs_mode="processed",
                             temperature=0.5, seed=9, ignore_eos=True)]
    prompts = [prompt, list(prompt), other, prompt]
    results = {}
    for share in (True, False):
        llm = _llm(checkpoint, share, seqs=6)
        results[share] = llm.generate(prompts, params, use_tqdm=False)
        # All but the first request's completion follow it, the scoring ones included (admitted together).
        assert llm.engine.shared_prefills == (4 if share else 0)
    _assert_same(results[True], results[False])


def _slot_state(cache, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in cache_tensors(cache.layers)]


def _prefill(llm: LLM, prompt: list[int], n: int) -> list:
    """Add one greedy request and step until every completion has its first token (cache right after the
    prompt); returns its sequences."""
    request = llm.engine.add_request("r", prompt, SamplingParams(n=n, max_tokens=4, ignore_eos=True))
    while any(not seq.output_ids for seq in request.seqs):
        llm.engine.step()
    return request.seqs


def test_a_followers_slot_equals_a_separate_prefill_bit_for_bit(checkpoint):
    prompt = _prompt()
    shared = _llm(checkpoint, True, "mtp")
    seqs = _prefill(shared, prompt, 4)
    assert shared.engine.shared_prefills == 3
    alone = _llm(checkpoint, False, "mtp")
    (single,) = _prefill(alone, prompt, 1)
    caches = [(shared.engine.runner.cache, alone.engine.runner.cache),
              (shared.engine.proposer.cache, alone.engine.proposer.cache)]
    target = _slot_state(alone.engine.runner.cache, single.slot)
    assert all(t.count_nonzero() for t in target)  # every ring and entry tensor was written
    for mine, theirs in caches:
        expected = _slot_state(theirs, single.slot)
        for seq in seqs:
            assert mine.lengths[seq.slot] == theirs.lengths[single.slot]
            for got, want in zip(_slot_state(mine, seq.slot), expected, strict=True):
                assert torch.equal(got, want)
    # Four windows, the HCA compressor's three tensors, and both CSA layers' compressor and indexer (3 + 3).
    assert len(target) == 4 + 3 + 2 * (3 + 3)
    assert [s.output_ids for s in seqs] == [single.output_ids] * 4


def test_a_leader_aborted_mid_prefill_hands_the_prompt_to_a_follower(checkpoint):
    prompt = _prompt()
    params = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=4, logprobs=1, prompt_logprobs=2,
                            ignore_eos=True)
    llm = _llm(checkpoint, True)
    engine = llm.engine
    engine.add_request("lead", prompt, SamplingParams(max_tokens=8))
    follower_request = engine.add_request("follow", prompt, params)
    engine.step()  # the leader's first chunk
    lead = engine.requests["lead"].seqs[0]
    assert lead.computed == BUDGET and all(s.computed == 0 for s in follower_request.seqs)
    assert len(follower_request.prompt_logprobs_parts) == 1 + BUDGET  # scored from the leader's chunk (None first)
    engine.abort("lead")
    while engine.has_work():
        engine.step()
    assert engine.shared_prefills == 2
    reference = _llm(checkpoint, False).generate([prompt], params, use_tqdm=False)
    _assert_same([follower_request.output(delta=False)], reference)


def test_a_request_arriving_mid_prefill_follows_and_both_match_separate_runs(checkpoint):
    prompt = _prompt()
    first = SamplingParams(max_tokens=8, temperature=0.6, seed=1, logprobs=1, ignore_eos=True)
    late = SamplingParams(n=2, max_tokens=8, temperature=1.1, top_p=0.9, seed=8, logprobs=1, ignore_eos=True)
    engine = _llm(checkpoint, True).engine
    a = engine.add_request("a", prompt, first)
    engine.step()
    b = engine.add_request("b", list(prompt), late)  # the leader has computed its first chunk
    while engine.has_work():
        engine.step()
    assert engine.shared_prefills == 2
    for request, params in ((a, first), (b, late)):
        _assert_same([request.output(delta=False)], _llm(checkpoint, False).generate([prompt], params, use_tqdm=False))


def test_a_weight_update_between_the_leaders_chunks_recomputes_the_group(checkpoint):
    prompt = _prompt()
    llm = _llm(checkpoint, True)
    engine = llm.engine
    rows = _count_prompt_rows(llm)
    request = engine.add_request("r", prompt, SEEDED)
    engine.step()
    with engine.exclusive():
        version = engine.weights_updated()  # same values: the version alone must force the recompute
    assert all(s.computed == 0 and s.status is SequenceStatus.WAITING for s in request.seqs)
    while engine.has_work():
        engine.step()
    assert rows[0] == BUDGET + PROMPT_LEN  # the first chunk, then the whole prompt once more
    output = request.output(delta=False)
    assert all(c.weights_versions == [(version, 0, SEEDED.max_tokens)] for c in output.outputs)
    _assert_same([output], _llm(checkpoint, False).generate([prompt], SEEDED, use_tqdm=False))


def test_a_prompt_at_max_model_len_forks_one_token_each(checkpoint):
    prompt = _prompt(length=3 * BUDGET + 1)  # its last chunk is one token
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=2, ignore_eos=True)
    results = {}
    for share in (True, False):
        llm = _llm(checkpoint, share, model_len=len(prompt) + 1)
        results[share] = llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.shared_prefills == (2 if share else 0)
    _assert_same(results[True], results[False])
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in results[True][0].outputs)


def test_dspark_followers_take_the_leaders_context_rings(tmp_path):
    """On the shipped DSpark variant (window 32, rates 4 and 8): after the fork a follower's context rings equal
    a separate prefill's bit for bit, and greedy output with sharing equals it without."""
    prompt = [task.BOS_ID, *task.encode(task.make_prompt("3141592653589793238462643383279502884197"))]
    assert len(prompt) > 32  # past the window and the ring's first wrap

    def build(share: bool) -> LLM:
        return LLM(DSPARK_MODEL, draft="dspark", dtype="float32", max_num_seqs=4, max_num_batched_tokens=BUDGET,
                   max_model_len=64, share_prompt_prefill=share)

    shared, alone = build(True), build(False)
    seqs = _prefill(shared, prompt, 3)
    (single,) = _prefill(alone, prompt, 1)
    assert shared.engine.shared_prefills == 2
    mine, theirs = shared.engine.proposer, alone.engine.proposer
    mine.flush()
    theirs.flush()
    for seq in seqs:
        assert mine.cache.lengths[seq.slot] == theirs.cache.lengths[single.slot] == len(prompt)
        for got, want in zip(mine.cache.rows, theirs.cache.rows, strict=True):
            assert torch.equal(got[seq.slot], want[single.slot])
    params = SamplingParams(n=3, max_tokens=16, ignore_eos=True)
    results = [build(share).generate([prompt], params, use_tqdm=False) for share in (True, False)]
    _assert_same(*results)
