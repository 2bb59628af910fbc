"""Generation in one thread, weight updates in another: the engine serializes them.

Weights alternate between two random models A and B (update k installs B when k is odd, A when even),
so version v ran on A when v is even, on B when odd. Every completion lists (version, begin, end) per
stretch of its tokens, and every stretch is checked against a fresh engine of that version's weights,
greedy, from the prompt plus the tokens before the stretch: no token was computed on a mix of weights.
Then, per pause policy: "abort" ends the requests in flight, "wait" lets them finish first, "retract"
preempts them and recomputes their tokens under the new weights before going on.
"""

from __future__ import annotations

import itertools
import random
import re
import threading
import time

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.engine.engine import PAUSE_MODES
from dsv4.errors import WeightsNotReadyError, WeightUpdateError

SEEDS = {"A": 1, "B": 2}
ENGINE = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 128}
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENGTHS = (3, 9, 20, 5, 33, 12)  # 6 requests for 4 slots: some wait while others run
TOKENS_BEFORE_UPDATE = 4  # the updating thread starts once a request has streamed this many tokens
THREAD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the engine under test, {0: fresh engine on A, 1: fresh engine on B}, {0: A's weights, 1: B's})."""
    paths = {}
    for name, seed in SEEDS.items():
        paths[name] = tmp_path_factory.mktemp(f"concurrency_{name}")
        ref.save_hf_checkpoint(ref.build_reference_model(ref.tiny_config(), seed), paths[name])
    fresh = {0: LLM(str(paths["A"]), **ENGINE), 1: LLM(str(paths["B"]), **ENGINE)}
    weights = {parity: list(engine.iter_weights()) for parity, engine in fresh.items()}
    return LLM(str(paths["A"]), **ENGINE), fresh, weights


def _next_weights(llm: LLM, weights):
    return weights[(llm.weights_version + 1) % 2]


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _spans_are_contiguous(spans, begin: int, end: int) -> None:
    """The stretches tile [begin, end) in order, each with a later version than the one before."""
    if not spans:
        assert begin == end
        return
    assert [b for _, b, _ in spans] == [begin] + [e for _, _, e in spans[:-1]] and spans[-1][2] == end
    assert all(v1 < v2 for (v1, _, _), (v2, _, _) in itertools.pairwise(spans))


def _check_versions(fresh, completions: list[tuple[list[int], list[int], list[tuple[int, int, int]]]]) -> None:
    """completions: (prompt ids, tokens, stretches). Every stretch equals the greedy continuation of its
    version's weights from the prompt and the tokens before it."""
    checks = []
    for prompt_ids, tokens, spans in completions:
        _spans_are_contiguous(spans, 0, len(tokens))
        checks.extend((v, prompt_ids + tokens[:b], tokens[b:e]) for v, b, e in spans)
    for parity in (0, 1):
        mine = [(ids, tokens) for v, ids, tokens in checks if v % 2 == parity]
        if mine:
            params = [SamplingParams(max_tokens=len(tokens), ignore_eos=True) for _, tokens in mine]
            expected = fresh[parity].generate([ids for ids, _ in mine], params, use_tqdm=False)
            assert [e.outputs[0].token_ids for e in expected] == [tokens for _, tokens in mine]


class Updater(threading.Thread):
    """Runs `update_weights(pause=...)` once `start_signal` is set; keeps any exception."""

    def __init__(self, llm: LLM, weights, pause: str, start_signal: threading.Event):
        super().__init__(daemon=True)
        self.llm, self.weights, self.pause, self.start_signal = llm, weights, pause, start_signal
        self.error: BaseException | None = None
        self.version: int | None = None

    def run(self) -> None:
        try:
            assert self.start_signal.wait(THREAD_TIMEOUT_S)
            self.version = self.llm.update_weights(_next_weights(self.llm, self.weights), pause=self.pause)
        except BaseException as exc:  # reported by the test thread
            self.error = exc


class Collected:
    """A streamed request, rebuilt from its deltas (each delta lists the stretches of its own tokens)."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.tokens: list[int] = []
        self.spans: list[tuple[int, int, int]] = []
        self.final = None

    def add(self, delta) -> None:
        assert self.final is None, "a request reported after its final delta"
        c = delta.outputs[0]
        begin = len(self.tokens)
        self.tokens.extend(c.token_ids)
        _spans_are_contiguous(c.weights_versions, begin, len(self.tokens))
        for v, b, e in c.weights_versions:
            if self.spans and self.spans[-1][0] == v:
                self.spans[-1] = (v, self.spans[-1][1], e)
            else:
                self.spans.append((v, b, e))
        if self.spans:
            assert delta.weights_version == self.spans[-1][0]
        if delta.finished:
            self.final = delta


@pytest.mark.parametrize("repeat", range(2))
@pytest.mark.parametrize("pause", ["abort", "wait", "retract"])
def test_stream_while_another_thread_updates(models, pause, repeat):
    llm, fresh, weights = models
    old = llm.weights_version
    started = threading.Event()
    updater = Updater(llm, weights, pause, started)
    updater.start()
    prompts = _prompts(repeat)
    collected: dict[str, Collected] = {}
    for delta in llm.stream(prompts, GREEDY):
        got = collected.setdefault(delta.request_id, Collected(delta.prompt_token_ids))
        got.add(delta)
        if len(got.tokens) >= TOKENS_BEFORE_UPDATE and not started.is_set():
            started.set()
            # This loop drives the steps: holding it until the update has paused generation keeps requests
            # in flight for the policy to act on (else a fast step loop could finish them all first).
            deadline = time.monotonic() + THREAD_TIMEOUT_S
            while not llm.engine.paused and updater.is_alive() and time.monotonic() < deadline:
                time.sleep(0.001)
    updater.join(THREAD_TIMEOUT_S)
    assert not updater.is_alive() and updater.error is None, updater.error
    assert updater.version == old + 1 == llm.weights_version
    assert len(collected) == len(prompts) and all(c.final is not None for c in collected.values())
    assert not llm.engine.has_work() and len(llm.engine.scheduler.free_slots) == ENGINE["max_num_seqs"]
    _check_versions(fresh, [(c.prompt_ids, c.tokens, c.spans) for c in collected.values()])
    reasons = {c.final.outputs[0].finish_reason for c in collected.values()}
    versions = [[v for v, _, _ in c.spans] for c in collected.values()]
    if pause == "abort":  # everything in flight ended; nothing ran on the new weights
        assert "abort" in reasons and all(v == [old] for v in versions if v)
    elif pause == "wait":  # the running ones finished on the old weights, the queued ones ran on the new
        assert reasons == {"length"} and all(len(v) == 1 for v in versions) and [old] in versions
    else:  # the running ones went on under the new weights after recomputing
        assert reasons == {"length"} and [old, old + 1] in versions


def test_generate_threads_and_weight_sessions(models):
    """Two threads generating round after round while sessions of two buckets (atomic or fail-stop, each
    pause policy) come and go: nothing fails, and every stretch is right for its version."""
    llm, fresh, weights = models
    rounds, errors, results = 3, [], []

    def generate(seed: int) -> None:
        try:
            for r in range(rounds):
                results.extend(llm.generate(_prompts(10 * seed + r), GREEDY, use_tqdm=False))
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(seed,), daemon=True) for seed in (1, 2)]
    for t in threads:
        t.start()
    pick = random.Random(0)
    sessions = 0
    while any(t.is_alive() for t in threads):
        time.sleep(pick.uniform(0.0, 0.3))
        pairs = _next_weights(llm, weights)
        half = len(pairs) // 2
        with llm.begin_weight_update(atomic=pick.random() < 0.5, pause=pick.choice(PAUSE_MODES)) as session:
            session.load(pairs[:half])
            session.load(pairs[half:])
        sessions += 1
    for t in threads:
        t.join(THREAD_TIMEOUT_S)
    assert not errors, errors
    assert sessions >= 1 and len(results) == 2 * rounds * len(PROMPT_LENGTHS)
    assert {o.outputs[0].finish_reason for o in results} <= {"length", "abort"}
    _check_versions(fresh, [(o.prompt_token_ids, c.token_ids, c.weights_versions) for o in results for c in o.outputs])


def test_explicit_pause_then_update_then_resume(models):
    """pause_generation("retract") from the consuming loop, an update while paused (its own policy does
    not touch the retracted requests), a request queued meanwhile runs only after resume_generation."""
    llm, fresh, weights = models
    old = llm.weights_version
    collected: dict[str, Collected] = {}
    late: list = []
    late_thread = None
    for delta in llm.stream(_prompts(5), GREEDY):
        got = collected.setdefault(delta.request_id, Collected(delta.prompt_token_ids))
        got.add(delta)
        if late_thread is None and len(got.tokens) >= TOKENS_BEFORE_UPDATE:
            llm.pause_generation("retract")
            assert llm.engine.stats().running == 0 and llm.engine.stats().paused
            assert llm.update_weights(_next_weights(llm, weights), pause="abort") == old + 1
            in_flight = len(llm.engine.requests)
            late_thread = threading.Thread(
                target=lambda: late.extend(llm.generate(_prompts(6)[:1], GREEDY, use_tqdm=False)), daemon=True)
            late_thread.start()
            deadline = time.monotonic() + THREAD_TIMEOUT_S
            while len(llm.engine.requests) == in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # the generating thread would have run steps by now, were it not paused
            assert llm.engine.stats().running == 0 and late_thread.is_alive()  # queued, not admitted
            llm.resume_generation()
    late_thread.join(THREAD_TIMEOUT_S)
    assert not late_thread.is_alive() and len(late) == 1
    assert late[0].outputs[0].weights_versions == [(old + 1, 0, MAX_TOKENS)]
    versions = [[v for v, _, _ in c.spans] for c in collected.values()]
    assert [old, old + 1] in versions and {c.final.outputs[0].finish_reason for c in collected.values()} == {"length"}
    completions = [(c.prompt_ids, c.tokens, c.spans) for c in collected.values()]
    tail = late[0].outputs[0]
    _check_versions(fresh, [*completions, (late[0].prompt_token_ids, tail.token_ids, tail.weights_versions)])


def test_wait_update_from_inside_the_stream_loop(models):
    """The consumer itself updates with pause="wait": the update runs the steps that finish the requests
    in flight (their deltas queue for the stream), no deadlock."""
    llm, fresh, weights = models
    old = llm.weights_version
    collected: dict[str, Collected] = {}
    updated = False
    for delta in llm.stream(_prompts(7), GREEDY):
        got = collected.setdefault(delta.request_id, Collected(delta.prompt_token_ids))
        got.add(delta)
        if not updated and len(got.tokens) >= TOKENS_BEFORE_UPDATE:
            running = llm.engine.stats().running
            assert llm.update_weights(_next_weights(llm, weights), pause="wait") == old + 1
            updated = True
            assert running > 0 and sum(c.final is None for c in collected.values()) >= 1
    versions = [[v for v, _, _ in c.spans] for c in collected.values()]
    assert all(len(v) == 1 for v in versions) and [old] in versions and [old + 1] in versions
    _check_versions(fresh, [(c.prompt_ids, c.tokens, c.spans) for c in collected.values()])


def test_failed_fail_stop_update_ends_requests_with_an_error(models):
    """A fail-stop session that fails while another thread generates: its requests end ("abort", with
    the error), none runs on the half-written weights; a complete update restores service."""
    llm, fresh, weights = models
    finals, errors = [], []
    first_token, session_open = threading.Event(), threading.Event()

    def generate() -> None:
        # The consumer drives the steps, so holding it after its first token keeps every request in
        # flight until the session has paused generation (a race a fast machine would otherwise win).
        try:
            for delta in llm.stream(_prompts(8), GREEDY):
                if not first_token.is_set():
                    first_token.set()
                    assert session_open.wait(THREAD_TIMEOUT_S)
                if delta.finished:
                    finals.append(delta)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    pairs = list(_next_weights(llm, weights))
    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    assert first_token.wait(THREAD_TIMEOUT_S)
    bad = max(i for i, (_, t) in enumerate(pairs) if t.dtype == torch.float32)
    name, tensor = pairs[bad]
    with pytest.raises(WeightUpdateError, match=re.escape(name)):
        with llm.begin_weight_update(atomic=False, pause="retract") as session:
            session_open.set()
            session.load(pairs[:bad])  # written in place: from here on the weights are a mix
            session.load([(name, torch.full_like(tensor, float("nan")))])
    thread.join(THREAD_TIMEOUT_S)
    assert not thread.is_alive() and not errors, errors
    # Every request was admitted or queued when the session paused generation: each ends with the error.
    assert len(finals) == len(PROMPT_LENGTHS)
    assert all(o.outputs[0].finish_reason == "abort" and "target model" in o.error for o in finals)
    with pytest.raises(WeightsNotReadyError, match="target model"):
        llm.generate(_prompts(8)[:1], GREEDY, use_tqdm=False)
    llm.update_weights(_next_weights(llm, weights))  # complete: every tensor
    after = llm.generate(_prompts(8), GREEDY, use_tqdm=False)
    _check_versions(fresh, [(o.prompt_token_ids, c.token_ids, c.weights_versions) for o in after for c in o.outputs])
