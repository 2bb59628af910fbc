"""DSpark in the engine (src/dsv4/engine/dspark_proposer.py): lossless speculative decoding.

On the shipped DSpark variant (`dsv4-sort-dspark`, a trained drafter: window 32, compress rates 4 and 8,
max_model_len 64) in fp32: greedy output with DSpark equals plain greedy for batches of 1, 4 and 16 and for
k = 1 .. 5 drafts per step, with prompts past the window and generations that run to max_model_len (across
the window and both compress rates), accepted and rejected drafts, and preemptions mid-flight; seeded
sampling equals plain sampling and does not depend on the batch; the output distribution at temperature > 0 through
`LLM.generate` equals the target's own (chi-square against the exact probabilities); a refit updates the
drafter in the same session as the target and then drafts exactly as a fresh load does (a refit that skipped
it drafts worse, so the check can fail). On the tiny random model with a released-layout drafter (V4 and
V4.1): the target layers the engine captures for `on_commit` and the context rings it fills through it
equal a full target forward and the drafter's own commit of it, and greedy output equals plain.

"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import save_file

import dspark_reference as dref
import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.embedded import DSPARK_MODEL
from dsv4.engine import dspark_draft
from dsv4.engine.dspark_proposer import DSparkProposer, build_dspark_proposer
from dsv4.engine.engine import Engine
from dsv4.engine.sequence import Sequence
from dsv4.engine.speculation import Draft
from dsv4.errors import ConfigError
from dsv4.model.batch import ForwardBatch
from dsv4.tasks import sort_digits as task

MAX_MODEL_LEN = 64  # the embedded model's maximum: twice its window
SEED = 5
RING_TOL = 1e-5  # ring keys from the engine's chunks vs one full forward (different GEMM shapes)
STREAM_TOL = 2e-5  # captured target streams (|x| up to ~5) from the engine's chunks vs one full forward (likewise)
CHI2_Z = 3.09  # the standard normal's 0.999 quantile: a distribution test fails by chance once in 1000


def _sort_prompts(n: int, seed: int = SEED) -> list[list[int]]:
    return [[task.BOS_ID, *task.encode(ex.prompt)] for ex in task.examples(n, seed=seed)]


def _long_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    """Prompts past the window: "sort " and that many digits (more than the task's 8; the model still answers)."""
    g = torch.Generator().manual_seed(SEED)
    return [[task.BOS_ID, *task.encode(task.make_prompt("".join(str(d) for d in torch.randint(0, 10, (n,),
                                                                                             generator=g).tolist())))]
            for n in lengths]


@pytest.fixture(scope="module")
def sort_llm() -> LLM:
    return LLM(DSPARK_MODEL, draft="dspark", dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
               max_model_len=MAX_MODEL_LEN)


class WithoutQ:
    """The DSpark proposer's drafts without their distributions: the engine then judges them by equality
    with its own samples (speculation.py), whatever rule it uses for drafts that carry q."""

    def __init__(self, proposer: DSparkProposer):
        self.proposer = proposer
        self.num_speculative_tokens = proposer.num_speculative_tokens

    def propose(self, seqs, max_drafts):
        return [Draft(d.token_ids) for d in self.proposer.propose(seqs, max_drafts)]

    def __getattr__(self, name):  # on_commit, on_release, end_step, flush, stats, cache
        return getattr(self.proposer, name)


def _run(llm: LLM, prompts, params, max_num_seqs: int, speculate: bool, threshold: float | None = None,
         without_q: bool = False, k: int | None = None, after_step=None):
    """Every prompt through a fresh engine on llm's models, with DSpark or without; after
    every step each running sequence's target slot and (once flushed) context ring hold exactly its computed
    positions, and `after_step(engine, step)` runs if given. Returns (outputs, proposer or None)."""
    limits = dataclasses.replace(llm.limits, max_num_seqs=max_num_seqs)
    proposer = None
    if speculate:
        options = {} if threshold is None else {"verify_threshold": threshold}
        proposer = build_dspark_proposer(llm.loaded, limits, k, 0, **options)
    engine = Engine(llm.loaded.target, limits, 0, llm.config.eos_token_ids, llm.tokenizer,
                    proposer=WithoutQ(proposer) if without_q else proposer)
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    requests = [engine.add_request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if after_step is not None:
            after_step(engine, steps)
        if proposer is not None:
            proposer.flush()
        for seq in engine.scheduler.running:
            assert engine.runner.cache.lengths[seq.slot] == seq.computed
            if proposer is not None:
                assert proposer.cache.lengths[seq.slot] == seq.computed
    assert len(engine.scheduler.free_slots) == limits.max_num_seqs
    if proposer is not None:
        assert all(n == 0 for n in proposer.cache.lengths)  # every ring emptied on release
    return [r.output(delta=False) for r in requests], proposer


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def _mixed_params(n: int) -> list[SamplingParams]:
    """Task answers (stop at eos), and every third one generating to max_model_len past eos."""
    return [SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True) if i % 3 == 0 else SamplingParams(max_tokens=12)
            for i in range(n)]


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_with_dspark_equals_plain_greedy(sort_llm, batch):
    n = {1: 4, 4: 9, 16: 20}[batch]
    prompts = _sort_prompts(n - 2) + _long_prompts((28, 45))  # prompts of 35 and 52 tokens: past the window
    params = _mixed_params(n)
    plain, _ = _run(sort_llm, prompts, params, batch, speculate=False)
    speculated, proposer = _run(sort_llm, prompts, params, batch, speculate=True)
    assert _tokens(speculated) == _tokens(plain)
    assert max(len(p) + len(t) for p, t in zip(prompts, _tokens(plain))) == MAX_MODEL_LEN  # across window, rates
    assert max(len(p) for p in prompts) > 32
    stats = proposer.stats
    # drafts were kept (on the answers), and rejected (past eos: so slots were rewound)
    assert 0 < stats.accepted < stats.judged_drafted
    assert stats.drafted <= proposer.num_speculative_tokens * stats.verifies


SEEDED = SamplingParams(temperature=1.5, top_k=6, seed=11, n=2, max_tokens=MAX_MODEL_LEN, ignore_eos=True)


def test_preemption_mid_flight_with_dspark_equals_plain(sort_llm):
    """Sequences preempted mid-generation (their slots and context rings freed; at step 10 every running one,
    as a finished weight update does) recompute their tokens when readmitted, refill their rings from
    position 0, and still produce plain greedy's output."""
    prompts = _sort_prompts(5, seed=31) + _long_prompts((26,))
    params = _mixed_params(len(prompts))
    preempted = []

    def preempt(engine: Engine, step: int) -> None:
        if step == 10:
            engine.weights_updated()  # the same weights: only the preemption matters here
        if step in (6, 14):
            running = [s for s in engine.scheduler.running if s.output_ids]
            if running and engine.preempt(running[0].request_id):
                preempted.append(running[0].request_id)

    plain, _ = _run(sort_llm, prompts, params, 3, speculate=False)
    speculated, proposer = _run(sort_llm, prompts, params, 3, speculate=True, after_step=preempt)
    assert len(preempted) == 2
    assert _tokens(speculated) == _tokens(plain)
    assert proposer.stats.accepted > 0


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_with_fewer_drafts_per_step_equals_plain_greedy(sort_llm, k):
    """The rest of MTP's matrix, k = 1 .. 4 drafts verified per step (the batch tests run k = 5), batch 4."""
    prompts = _sort_prompts(5, seed=k) + _long_prompts((30,))
    params = _mixed_params(len(prompts))
    plain, _ = _run(sort_llm, prompts, params, 4, speculate=False)
    speculated, proposer = _run(sort_llm, prompts, params, 4, speculate=True, k=k)
    assert _tokens(speculated) == _tokens(plain)
    # k per step, fewer only where the scheduler leaves less room (near max_tokens / max_model_len)
    assert (k - 1) * proposer.stats.verifies < proposer.stats.drafted <= k * proposer.stats.verifies
    assert 0 < proposer.stats.accepted < proposer.stats.judged_drafted


def test_seeded_sampling_with_dspark_equals_plain_under_the_equality_rule(sort_llm):
    """DSpark's drafts judged by equality with the target's own samples (handed over without q): a seeded
    request samples exactly the plain tokens. (Rejection sampling against `Draft.probs` keeps the
    distribution, not the draws: the distribution test below checks that path.)"""
    prompts = _sort_prompts(6)
    plain, _ = _run(sort_llm, prompts, SEEDED, 4, speculate=False)
    assert len({tuple(t) for t in _tokens(plain)}) == 2 * len(prompts)  # really random
    speculated, proposer = _run(sort_llm, prompts, SEEDED, 4, speculate=True, without_q=True)
    assert proposer.stats.accepted > 0
    assert _tokens(speculated) == _tokens(plain)


def test_seeded_sampling_with_dspark_does_not_depend_on_the_batch(sort_llm):
    """Whatever rule judges the drafts, a seeded request's output does not depend on what shares its batch:
    the drafts draw from generators of their own, seeded by the request and the position."""
    prompts = _sort_prompts(6)
    together, _ = _run(sort_llm, prompts, SEEDED, 4, speculate=True)
    alone, _ = _run(sort_llm, prompts[2:3], SEEDED, 1, speculate=True)
    assert _tokens(alone) == _tokens(together)[4:6]


def _chi2_critical(df: int) -> float:
    """The chi-square 0.999 quantile (Wilson-Hilferty)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + CHI2_Z * math.sqrt(h)) ** 3


def _processed(logprobs: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """softmax(logits / T) over the top_k tokens (written out here, not dsv4's sampler)."""
    scaled = logprobs.double() / temperature
    keep = scaled.topk(top_k).indices
    out = torch.zeros_like(scaled)
    out[keep] = scaled[keep].softmax(dim=-1)
    return out


def _chi2(llm: LLM, prompt: list[int], triples: list[tuple], temperature: float, top_k: int) -> tuple[float, int]:
    """Chi-square of the drawn first three tokens against P(t1) P(t2 | t1) P(t3 | t1, t2) at `temperature`
    (bins with an expected count of at least 5; the rest, and the mass of pairs never drawn, pooled).
    Returns (chi-square, bins)."""
    samples = len(triples)
    pairs = sorted({t[:2] for t in triples})
    firsts = sorted({t[0] for t in triples})
    p1 = _processed(llm.forward_logprobs([prompt])[0][-1], temperature, top_k)
    p2 = {a: _processed(lp[-1], temperature, top_k)
          for a, lp in zip(firsts, llm.forward_logprobs([[*prompt, a] for a in firsts]))}
    p3 = {ab: _processed(lp[-1], temperature, top_k)
          for ab, lp in zip(pairs, llm.forward_logprobs([prompt + list(ab) for ab in pairs]))}
    counts: dict[tuple, int] = {}
    for t in triples:
        counts[t] = counts.get(t, 0) + 1
    expected = {}
    for a, b in pairs:
        for c in torch.nonzero(p3[a, b]).flatten().tolist():
            expected[a, b, c] = float(p1[a] * p2[a][b] * p3[a, b][c]) * samples
    assert set(counts) <= set(expected)  # nothing outside the target's support
    bins = [(counts.get(k, 0), e) for k, e in expected.items() if e >= 5]
    bins.append((samples - sum(o for o, _ in bins), samples - sum(e for _, e in bins)))
    return sum((o - e) ** 2 / e for o, e in bins), len(bins)


def test_sampled_output_distribution_equals_the_targets():
    """Through the public path (`LLM(..., draft="dspark").generate`): the first three generated tokens of
    many seeded samples follow the target's own distribution P(t1) P(t2 | t1) P(t3 | t1, t2) (t2 and t3 come
    out of a verify chunk: a draft judged, then the token after it). Chi-square at p = 0.001; the control,
    the same samples against the distribution at a temperature 17-20% off, fails it."""
    temperature, top_k, samples = 1.5, 4, 2000
    # 8 sequences at once: at most the batch an engine speculates for by default (issue 12's break-even batch)
    llm = LLM(DSPARK_MODEL, draft="dspark", dtype="float32", max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    prompt = [task.BOS_ID, *task.encode(task.make_prompt(""))]  # no digits: the model is unsure what follows
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=1000 + i, max_tokens=3, ignore_eos=True)
              for i in range(samples)]
    outputs = llm.generate([prompt] * samples, params, use_tqdm=False)
    assert llm.engine.proposer.stats.verifies >= samples  # every sample verified drafts
    triples = [tuple(o.outputs[0].token_ids) for o in outputs]
    chi2, bins = _chi2(llm, prompt, triples, temperature, top_k)
    assert bins >= 6, "too concentrated a distribution to test"
    assert chi2 < _chi2_critical(bins - 1), (chi2, bins)
    for wrong in (1.25, 1.8):
        chi2, bins = _chi2(llm, prompt, triples, wrong, top_k)
        assert chi2 > _chi2_critical(bins - 1), (wrong, chi2, bins)


def _acceptance(llm: LLM, prompts) -> tuple[list[list[int]], tuple[int, int, int]]:
    """Greedy outputs, and (verify steps, drafts offered, tokens the verify steps produced)."""
    tokens = _tokens(llm.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False))
    stats = llm.engine.proposer.stats
    return tokens, (stats.verifies, stats.drafted, sum(len(t) - 1 for t in tokens))  # token 1: from the prefill


def test_refit_updates_dspark_and_acceptance_equals_a_fresh_load():
    prompts = _sort_prompts(12, seed=21)
    fresh = LLM(DSPARK_MODEL, draft="dspark", dtype="float32", max_num_seqs=4)
    weights = dict(fresh.iter_weights())
    tokens, acceptance = _acceptance(fresh, prompts)
    verifies, _, produced = acceptance
    assert produced >= 3 * verifies  # the trained drafter: most of each block is kept

    refit = LLM(DSPARK_MODEL, load_format="dummy", draft="dspark", dtype="float32", max_num_seqs=4, seed=3)
    refit.update_weights(weights)  # one session: target and drafter (native names)
    assert _acceptance(refit, prompts) == (tokens, acceptance)

    # the control: the same refit without the drafter's tensors leaves it drafting with dummy weights
    skipped = LLM(DSPARK_MODEL, load_format="dummy", draft="dspark", dtype="float32", max_num_seqs=4, seed=3)
    skipped.update_weights({n: t for n, t in weights.items() if not n.startswith("mtp.")})
    skipped_tokens, (skipped_verifies, _, _) = _acceptance(skipped, prompts)
    assert skipped_tokens == tokens  # lossless either way
    assert produced / skipped_verifies < 0.5 * produced / verifies  # tokens per verify step at least halved


def test_llm_draft_dspark_wires_the_proposer():
    prompts = _sort_prompts(5, seed=8)
    params = SamplingParams(max_tokens=12)
    plain = LLM(DSPARK_MODEL, max_num_seqs=2)
    speculating = LLM(DSPARK_MODEL, draft="dspark", max_num_seqs=2)
    proposer = speculating.engine.proposer
    assert isinstance(proposer, DSparkProposer) and proposer.num_speculative_tokens == 5
    assert plain.engine.proposer is None
    outputs = speculating.generate(prompts, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(plain.generate(prompts, params, use_tqdm=False))
    examples = task.examples(5, seed=8)
    assert all(task.is_correct(ex.prompt, o.outputs[0].text) for ex, o in zip(examples, outputs))
    assert proposer.stats.verifies > 0 and proposer.stats.accepted > 0
    with pytest.raises(ConfigError, match="draft='dspark' with compile=True"):
        LLM(DSPARK_MODEL, draft="dspark", compile=True, expert_dtype="dense")


@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.999, 1.0])
def test_drafts_carry_q_and_the_confident_width(sort_llm, threshold):
    """propose() offers the block the drafter draws, cut to `verify_width(confidence, threshold)` and to the
    engine's room, each draft with exactly the q it was drawn from."""
    limits = sort_llm.limits
    proposer = build_dspark_proposer(sort_llm.loaded, limits, None, 0, verify_threshold=threshold)
    engine = Engine(sort_llm.loaded.target, limits, 0, sort_llm.config.eos_token_ids, proposer=proposer)
    for i, prompt in enumerate(_sort_prompts(3, seed=2)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20))
    engine.step()  # prefill: every sequence samples its first token
    seqs = list(engine.scheduler.running)
    proposer.flush()
    anchors = [s.output_ids[-1] for s in seqs]
    block = dspark_draft.draft(proposer.drafter, proposer.cache, [s.slot for s in seqs], anchors)
    widths = dspark_draft.verify_width(block.confidence, threshold).tolist()
    room = [5, 2, 5]
    drafts = proposer.propose(seqs, room)
    for i, draft in enumerate(drafts):
        width = min(widths[i], room[i])
        assert draft.token_ids == block.tokens[i, :width].tolist()
        if width:
            assert torch.equal(draft.probs, block.q[i, :width])
        else:
            assert draft.probs is None
    if threshold == 0.0:
        assert [len(d.token_ids) for d in drafts] == room


def test_num_speculative_tokens_caps_the_drafts(sort_llm):
    outputs, proposer = _run(sort_llm, _sort_prompts(4), SamplingParams(max_tokens=12), 2, speculate=True)
    assert proposer.num_speculative_tokens == 5 and proposer.stats.drafted > 2 * proposer.stats.verifies
    limits = dataclasses.replace(sort_llm.limits, max_num_seqs=2)
    capped = build_dspark_proposer(sort_llm.loaded, limits, 2, 0)
    engine = Engine(sort_llm.loaded.target, limits, 0, sort_llm.config.eos_token_ids, proposer=capped)
    params = SamplingParams(max_tokens=12)
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(_sort_prompts(4))]
    while engine.has_work():
        engine.step()
    assert capped.num_speculative_tokens == 2 and capped.stats.drafted == 2 * capped.stats.verifies
    assert [r.output(delta=False).outputs[0].token_ids for r in requests] == _tokens(outputs)


def test_bad_proposer_settings_are_config_errors(sort_llm):
    for bad in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ConfigError, match="dspark verify_threshold: expected a number in"):
            build_dspark_proposer(sort_llm.loaded, sort_llm.limits, None, 0, verify_threshold=bad)
    for bad in (0, 6, 2.0, True):
        with pytest.raises(ConfigError, match=r"dspark num_speculative_tokens: expected an integer in \[1, 5\]"):
            build_dspark_proposer(sort_llm.loaded, sort_llm.limits, bad, 0)
    without = LLM(DSPARK_MODEL)
    with pytest.raises(ConfigError, match="loaded without their DSpark drafter"):
        build_dspark_proposer(without.loaded, without.limits)


# ---- the tiny random model, both releases' drafters ----
TARGET_SEED, DSPARK_SEED = 51, 52
DSPARK_FIELDS = {"dspark_block_size": 5, "dspark_noise_token_id": 7, "dspark_markov_rank": 8, "n_mtp_layers": 2}
VARIANTS = {
    "v4-flash-dspark": {"dspark_target_layer_ids": [1, 3]},  # the last layer: the streams on_commit gets
    "v4.1": {"dspark_target_layer_ids": [0, 2], "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2},
}
TINY_LEN = 96


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_llm(request, tmp_path_factory) -> LLM:
    config = ref.tiny_config(**DSPARK_FIELDS, **VARIANTS[request.param])
    native = ref.native_state_dict(ref.build_reference_model(ref.tiny_config(), TARGET_SEED))
    root = tmp_path_factory.mktemp("engine_dspark") / request.param
    root.mkdir()
    (root / "config.json").write_text(json.dumps(dict(config, torch_dtype="float32")))
    tensors = {**native, **dref.released_dspark_tensors(config, DSPARK_SEED)}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(root / "model.safetensors"))
    return LLM(root, draft="dspark", dtype="float32", max_num_seqs=4, max_num_batched_tokens=24,
               max_model_len=TINY_LEN)


def test_rings_filled_by_the_engine_equal_a_direct_commit(tiny_llm):
    """After prefill chunks and verify steps, each running sequence's context ring equals the drafter's own
    commit (the phase tested against the reference) of one full target forward over its computed tokens."""
    llm = tiny_llm
    proposer = build_dspark_proposer(llm.loaded, llm.limits, None, 0, verify_threshold=0.0)
    engine = Engine(llm.loaded.target, llm.limits, 0, llm.config.eos_token_ids, proposer=proposer)
    drafter, target = proposer.drafter, llm.loaded.target
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate((40, 7, 29)):
        prompt = torch.randint(8, 512, (n,), generator=g).tolist()
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    checked = 0
    while engine.has_work():
        engine.step()
        proposer.flush()
        for seq in engine.scheduler.running:
            if seq.computed < 36 or checked >= 6:
                continue
            tokens = seq.tokens(0, seq.computed)
            batch = ForwardBatch.build([(0, tokens, 0)])
            _, captured = target(batch, target.allocate_cache(1, TINY_LEN), capture_layers=drafter.capture_layers)
            clean = drafter.allocate_cache(1, TINY_LEN)
            drafter.commit(clean, batch, captured)
            for stage in range(len(drafter.mtp)):
                got = proposer.cache.read(stage, proposer.cache.context_rows([seq.slot]))
                want = clean.read(stage, clean.context_rows([0]))
                assert (got - want).abs().max().item() <= RING_TOL, f"stage {stage}, {seq.computed} positions"
            checked += 1
    assert checked == 6


def test_tiny_greedy_with_dspark_equals_plain(tiny_llm):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(8, 512, (n,), generator=g).tolist() for n in (3, 33, 17, 50, 9)]
    params = [SamplingParams(max_tokens=TINY_LEN - len(p), ignore_eos=True) for p in prompts]
    plain, _ = _run(tiny_llm, prompts, params, 4, speculate=False)
    speculated, proposer = _run(tiny_llm, prompts, params, 4, speculate=True, threshold=0.0)
    assert _tokens(speculated) == _tokens(plain)
    assert proposer.stats.judged_drafted > proposer.stats.accepted  # rejected drafts: slots rewound


class RecordingCommits:
    """The DSpark proposer, recording a copy of what the engine hands each `on_commit`."""

    def __init__(self, proposer: DSparkProposer):
        self.proposer = proposer
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self.capture_layers = proposer.capture_layers
        self.commits = []  # (the sequence's tokens through the last row, first position, streams, captured)

    def on_commit(self, seq, first_position, streams, captured=None):
        self.commits.append((seq.tokens(0, first_position + streams.shape[0]), first_position, streams.clone(),
                             {layer: rows.clone() for layer, rows in captured.items()}))
        self.proposer.on_commit(seq, first_position, streams, captured=captured)

    def __getattr__(self, name):  # propose, on_release, end_step
        return getattr(self.proposer, name)


def test_engine_hands_on_commit_the_captured_layers(tiny_llm):
    """The proposer declares the drafter's capture layers; the engine runs the target with them and hands
    each on_commit the committed rows' streams of exactly those layers, equal to one full target forward over
    the sequence (the last layer's are the final streams themselves); without them on_commit refuses."""
    llm = tiny_llm
    target = llm.loaded.target
    proposer = build_dspark_proposer(llm.loaded, llm.limits, None, 0, verify_threshold=0.0)
    layers = proposer.drafter.capture_layers
    assert proposer.capture_layers == layers
    recording = RecordingCommits(proposer)
    engine = Engine(target, llm.limits, 0, llm.config.eos_token_ids, proposer=recording)
    g = torch.Generator().manual_seed(6)
    for i, n in enumerate((30, 9)):
        engine.add_request(str(i), torch.randint(8, 512, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=12, ignore_eos=True))
    while engine.has_work():
        engine.step()
    assert proposer.stats.judged_verifies > 0  # verify chunks' kept rows were committed, not only prefill
    last = len(target.layers) - 1
    for tokens, first, streams, captured in recording.commits:
        assert set(captured) == set(layers)
        if last in captured:
            assert torch.equal(captured[last], streams)
        _, full = target(ForwardBatch.build([(0, tokens, 0)]), target.allocate_cache(1, TINY_LEN),
                         capture_layers=layers)
        for layer, rows in captured.items():
            assert rows.shape == streams.shape
            assert (rows - full[layer][first : first + rows.shape[0]]).abs().max().item() <= STREAM_TOL
    seq = Sequence("x", 0, [9, 10], SamplingParams())
    seq.slot = 0
    with pytest.raises(ValueError, match=r"on_commit of sequence x/0 at position 0 got no captured streams"):
        proposer.on_commit(seq, 0, streams[:2])


def test_commits_of_several_steps_flush_in_position_order(tiny_llm):
    """Two sequences' prefill chunks committed over two target forwards before any draft (A0, B0, A1, B1)
    reach the rings as one segment per slot, equal to a direct commit of each full sequence."""
    llm = tiny_llm
    proposer = build_dspark_proposer(llm.loaded, llm.limits, None, 0)
    target, drafter = llm.loaded.target, proposer.drafter
    g = torch.Generator().manual_seed(9)
    seqs = []
    for slot in (1, 3):
        seq = Sequence(str(slot), 0, torch.randint(8, 512, (20,), generator=g).tolist(), SamplingParams())
        seq.slot = slot
        seqs.append(seq)
    cache = target.allocate_cache(4, TINY_LEN)
    for start in (0, 10):
        batch = ForwardBatch.build([(s.slot, s.prompt_ids[start : start + 10], start) for s in seqs])
        streams, captured = target(batch, cache, capture_layers=proposer.capture_layers)
        for s, seg in zip(seqs, batch.segments):
            rows = {layer: layer_streams[seg.begin : seg.end] for layer, layer_streams in captured.items()}
            proposer.on_commit(s, start, streams[seg.begin : seg.end], captured=rows)
    proposer.flush()
    for s in seqs:
        full = ForwardBatch.build([(0, s.prompt_ids, 0)])
        _, captured = target(full, target.allocate_cache(1, TINY_LEN), capture_layers=drafter.capture_layers)
        clean = drafter.allocate_cache(1, TINY_LEN)
        drafter.commit(clean, full, captured)
        assert proposer.cache.lengths[s.slot] == 20
        for stage in range(len(drafter.mtp)):
            got = proposer.cache.read(stage, proposer.cache.context_rows([s.slot]))
            want = clean.read(stage, clean.context_rows([0]))
            assert (got - want).abs().max().item() <= RING_TOL
