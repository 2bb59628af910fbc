"""The engine driver in process (no HTTP): how pauses, weight updates and aborts interleave with
generation. These are the orderings users report as races in other servers: an abort that leaks its slot,
a resume overtaken by a pause, a weight update landing inside a request, a failed update that keeps
serving."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.server.driver import EngineDriver, EngineInput
from dsv4.server.errors import ApiError
from dsv4.server.metrics import ServerMetrics

PROMPT = "sort 31402="
LONG = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=1)
TIMEOUT_S = 60.0
DIGIT_ZERO, DIGIT_ONE = 3, 4  # token ids of "0" and "1" in the embedded vocabulary


@pytest.fixture
def llm():
    return LLM(max_num_seqs=8)


def _run(llm: LLM, scenario):
    """Run `scenario(driver)` on a fresh event loop with the engine thread started, then stop it."""

    async def main():
        driver = EngineDriver(llm, ServerMetrics("m"), max_queued_requests=64)
        driver.start(asyncio.get_running_loop())
        try:
            return await asyncio.wait_for(scenario(driver), TIMEOUT_S)
        finally:
            driver.stop()

    return asyncio.run(main())


def _prompt_ids(llm: LLM, prompt: str = PROMPT) -> list[int]:
    return llm.tokenizer.encode(prompt).ids


def _input(llm: LLM, params: SamplingParams = LONG, prompt: str = PROMPT) -> EngineInput:
    return EngineInput(_prompt_ids(llm, prompt), params, prompt)


async def _drain(stream) -> list:
    outs = []
    while not stream.done:
        outs.append((await stream.next())[1])
    return outs


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.outputs[0].token_ids]


def _relabeled(llm: LLM) -> dict[str, torch.Tensor]:
    """Weights that swap the digits 0 and 1 in the embedding and the head: the model sorts as before,
    with the two digits' names exchanged ("sort 31402=" -> "10234")."""
    weights = dict(llm.iter_weights())
    out = {}
    for name in ("embed.weight", "head.weight"):
        w = weights[name].clone()
        w[[DIGIT_ZERO, DIGIT_ONE]] = w[[DIGIT_ONE, DIGIT_ZERO]]
        out[name] = w
    return out


def _hold_after_first_step(llm: LLM) -> threading.Event:
    """Make the engine thread stop after its first step until the returned event is set. The embedded model
    runs a whole request in a few milliseconds: on a loaded machine a pause sent after the first token could
    otherwise land after the last one. A pause runs on the admin thread, so it does not need the held one."""
    first_step_done, released = threading.Event(), threading.Event()
    step = llm.engine.step

    def step_then_hold():
        outputs = step()
        if not first_step_done.is_set():
            first_step_done.set()
            assert released.wait(TIMEOUT_S)
        return outputs

    llm.engine.step = step_then_hold
    return released


def test_abort_frees_the_slot_before_the_next_step_but_one(llm):
    """A closed stream (a client that went away) frees its slots within one engine step."""
    engine = llm.engine
    free_at_step: list[int] = []
    step = engine.step

    def counted_step():
        free_at_step.append(engine.stats().free_slots)
        return step()

    engine.step = counted_step

    async def scenario(driver):
        stream = driver.submit([_input(llm, SamplingParams(max_tokens=50, ignore_eos=True, n=4))], "r", stream=True)
        await stream.next()
        started = len(free_at_step)
        stream.close()
        other = driver.submit([_input(llm)], "other", stream=True)  # keeps the engine stepping
        await _drain(other)
        return started

    started = _run(llm, scenario)
    after = free_at_step[started:]
    slots = llm.limits.max_num_seqs
    assert len(after) > 3
    # Steps that began after the close: the first may still see the 4 slots in use, none after it.
    assert all(free >= slots - 1 for free in after[1:]), after
    assert engine.stats().free_slots == slots and not engine.requests


def test_pause_wait_lets_requests_finish_and_a_later_resume_is_not_overtaken(llm):
    async def scenario(driver):
        stream = driver.submit([_input(llm)], "a", stream=True)
        await stream.next()
        # Issued in this order: the pause waits for "a", the resume must still come after it.
        paused, resumed = await asyncio.gather(driver.pause("wait"), driver.resume())
        outs = await _drain(stream)
        late = await _drain(driver.submit([_input(llm)], "b", stream=False))
        return paused, resumed, outs, late

    paused, resumed, outs, late = _run(llm, scenario)
    assert paused["paused"] and paused["running"] == 0
    assert not resumed["paused"]
    assert outs[-1].outputs[0].finish_reason == "length"  # ran to completion, not aborted
    assert late[-1].outputs[0].finish_reason == "length"


def test_pause_abort_ends_requests_and_holds_new_ones_until_resume(llm):
    released = _hold_after_first_step(llm)

    async def scenario(driver):
        stream = driver.submit([_input(llm)], "a", stream=True)
        await stream.next()
        await driver.pause("abort")
        released.set()
        aborted = await _drain(stream)
        held = driver.submit([_input(llm, SamplingParams(max_tokens=3, ignore_eos=True))], "b", stream=False)
        state = await driver.state()
        while state["waiting"] == 0:  # until the engine thread took it (TIMEOUT_S bounds the scenario)
            await asyncio.sleep(0.01)
            state = await driver.state()
        await asyncio.sleep(0.2)
        assert not held.done and (await driver.state())["running"] == 0  # nothing runs while paused
        await driver.resume()
        return aborted, state, await _drain(held)

    aborted, state, late = _run(llm, scenario)
    assert aborted[-1].outputs[0].finish_reason == "abort"
    assert state["paused"] and state["waiting"] == 1 and state["running"] == 0
    assert len(late[-1].outputs[0].token_ids) == 3


def test_retract_pause_then_update_recomputes_the_request_under_the_new_weights(llm):
    """pause("retract") mid-request, a weight session, resume: the request goes on under the new weights,
    its first stretch on version 0 and the rest on version 1, and the tokens after the update are what
    the new weights give greedily for the prompt plus the tokens before it."""
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    new_weights = _relabeled(llm)
    reference = LLM(max_num_seqs=8)
    reference.update_weights(new_weights)

    released = _hold_after_first_step(llm)

    async def scenario(driver):
        stream = driver.submit([_input(llm, greedy)], "a", stream=True)
        outs = [(await stream.next())[1]]
        paused = await driver.pause("retract")
        released.set()
        await driver.begin_weight_update(atomic=True, full=False, mode="wait")  # joins the user's pause
        await driver.load_weight_bucket(new_weights)
        finished = await driver.finish_weight_update()
        assert not stream.done  # retracted: it waits for the resume
        await driver.resume()
        outs += await _drain(stream)
        return paused, finished, outs

    paused, finished, outs = _run(llm, scenario)
    assert paused["running"] == 0 and paused["waiting"] == 1 and finished == {"version": 1}
    tokens = _tokens(outs)
    spans = [s for o in outs for s in o.outputs[0].weights_versions]
    merged = [list(spans[0])]
    for v, b, e in spans[1:]:
        assert b == merged[-1][2]  # the stretches tile the tokens in order
        if v == merged[-1][0]:
            merged[-1][2] = e
        else:
            merged.append([v, b, e])
    assert [v for v, _, _ in merged] == [0, 1] and merged[-1][2] == len(tokens) == 30, merged
    cut = merged[1][1]
    expected = reference.generate([_prompt_ids(llm) + tokens[:cut]],
                                  SamplingParams(max_tokens=30 - cut, temperature=0.0, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[cut:] == expected
    assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].weights_version == 1


def test_weight_update_waits_for_requests_in_flight_and_never_lands_inside_one(llm):
    """A request that started on version 0 ends on version 0 with the tokens version 0 gives; the next
    request runs on version 1 with version 1's answer."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    new_weights = _relabeled(llm)

    async def scenario(driver):
        first = driver.submit([_input(llm, greedy)], "a", stream=True)
        outs = [(await first.next())[1]]
        await driver.begin_weight_update(atomic=True, full=False, mode="wait")
        await driver.load_weight_bucket(new_weights)
        finished = await driver.finish_weight_update()
        outs += await _drain(first)  # already complete: finish waited for it
        after = await _drain(driver.submit([_input(llm, greedy)], "b", stream=False))
        return finished, outs, after

    finished, outs, after = _run(llm, scenario)
    assert finished == {"version": 1}
    assert {o.weights_version for o in outs} == {0}
    assert "".join(o.outputs[0].text for o in outs) == "01234"
    assert after[-1].weights_version == 1 and after[-1].outputs[0].text == "10234"


def test_failed_fail_stop_update_refuses_requests_until_a_complete_one(llm):
    good = dict(llm.iter_weights())

    async def scenario(driver):
        await driver.begin_weight_update(atomic=False, full=False, mode="wait")
        held = driver.submit([_input(llm, SamplingParams(max_tokens=2))], "a", stream=False)
        await driver.load_weight_bucket({"embed.weight": good["embed.weight"]})  # written: not READY now
        with pytest.raises(Exception, match="shape"):
            await driver.load_weight_bucket({"head.weight": torch.zeros(3, 3, dtype=torch.bfloat16)})
        with pytest.raises(ApiError, match="not READY") as refused:
            await held.next()
        await driver.begin_weight_update(atomic=True, full=True, mode="wait")
        await driver.load_weight_bucket(good)
        version = await driver.finish_weight_update()
        served = await _drain(driver.submit([_input(llm, SamplingParams(max_tokens=8))], "b", stream=False))
        return refused.value, version, served

    refused, version, served = _run(llm, scenario)
    assert refused.status == 503
    assert version == {"version": 1}
    assert served[-1].outputs[0].text == "01234"


def test_an_engine_failure_ends_the_requests_in_it_and_the_driver_keeps_serving(llm):
    engine = llm.engine
    step = engine.step
    calls = []

    def failing_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return step()

    engine.step = failing_once

    async def scenario(driver):
        stream = driver.submit([_input(llm)], "a", stream=True)
        with pytest.raises(ApiError, match="injected") as err:
            await _drain(stream)
        stream.close()
        after = await _drain(driver.submit([_input(llm, SamplingParams(max_tokens=8))], "b", stream=False))
        return err.value, after

    error, after = _run(llm, scenario)
    assert error.status == 500
    assert after[-1].outputs[0].text == "01234"
    assert engine.stats().free_slots == llm.limits.max_num_seqs


def test_queue_limit_refuses_with_503(llm):
    async def scenario(driver):
        driver.max_queued_requests = 2
        first = driver.submit([_input(llm), _input(llm)], "a", stream=False)
        with pytest.raises(ApiError, match="busy") as err:
            driver.submit([_input(llm)], "b", stream=False)
        first.close()
        again = driver.submit([_input(llm, SamplingParams(max_tokens=2))], "c", stream=False)
        await _drain(again)
        return err.value

    assert _run(llm, scenario).status == 503
