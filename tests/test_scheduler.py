"""The scheduler on its own (no model): FIFO admission into cache slots, the token budget, chunked
prefill behind decodes, room for verify chunks (budget, max_model_len, max_tokens), preemption to the
front of the queue with a recompute of every token, paused admission."""

import pytest

from dsv4 import SamplingParams
from dsv4.engine.limits import EngineLimits
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.sequence import Sequence, SequenceStatus


def _seq(name: str, prompt_len: int, max_tokens: int = 16) -> Sequence:
    return Sequence(name, 0, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def _run(scheduler: Scheduler, num_speculative_tokens: int = 0, next_token: int = 7):
    """Schedule one step and apply it as the engine would with every draft rejected: each chunk's tokens
    become computed; a chunk that reaches the sequence's last known token samples one more token.
    Returns {request id: (tokens scheduled, draft room)}."""
    plan = scheduler.schedule(num_speculative_tokens)
    for chunk in plan.chunks:
        seq = chunk.seq
        seq.computed += chunk.num_tokens
        if seq.computed == seq.num_tokens:
            seq.append(next_token, None, 0)
    return {c.seq.request_id: (c.num_tokens, c.max_drafts) for c in plan.chunks}


def _limits(seqs: int = 2, budget: int = 16, model_len: int = 64) -> EngineLimits:
    return EngineLimits(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=model_len)


def test_fifo_admission_waits_for_a_free_slot():
    scheduler = Scheduler(_limits(seqs=2))
    a, b, c = _seq("a", 3), _seq("b", 3), _seq("c", 3)
    for seq in (a, b, c):
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.admitted] == ["a", "b"] and {a.slot, b.slot} == {0, 1}
    assert c.status is SequenceStatus.WAITING and c.slot is None and list(scheduler.waiting) == [c]
    freed = a.slot
    scheduler.release(a)
    assert scheduler.schedule().admitted == (c,) and c.slot == freed
    assert not scheduler.free_slots and not scheduler.waiting


def test_budget_chunks_prompts_and_decodes_go_first():
    scheduler = Scheduler(_limits(seqs=3, budget=16))
    long, short = _seq("long", 20), _seq("short", 10)
    scheduler.add(long)
    scheduler.add(short)
    assert _run(scheduler) == {"long": (16, 0)}  # the whole budget to the first prompt, the next waits
    assert _run(scheduler) == {"long": (4, 0), "short": (10, 0)}  # the rest of it, then the next prompt
    assert len(long.output_ids) == 1 and len(short.output_ids) == 1
    late = _seq("late", 30)
    scheduler.add(late)
    # Both decode (one token each) before the new prompt gets what is left of the budget.
    assert _run(scheduler) == {"long": (1, 0), "short": (1, 0), "late": (14, 0)}
    assert _run(scheduler) == {"long": (1, 0), "short": (1, 0), "late": (14, 0)}
    assert _run(scheduler) == {"long": (1, 0), "short": (1, 0), "late": (2, 0)}
    assert late.computed == 30 and len(late.output_ids) == 1


def _decoding(scheduler: Scheduler, name: str, prompt_len: int, generated: int, max_tokens: int = 16) -> Sequence:
    """A running sequence that has generated `generated` tokens and waits to decode the last one."""
    seq = _seq(name, prompt_len, max_tokens)
    scheduler.add(seq)
    scheduler.schedule()  # admits it (the plan is not applied)
    seq.output_ids = [7] * generated
    seq.computed = seq.num_tokens - 1
    return seq


@pytest.mark.parametrize("budget, expected", [
    # roomy keeps all 4 drafts; near_len has 36 of 40 tokens: 3 drafts + 1 token reach 40; near_max
    # generated 1 of 3: 1 draft + 1 token reach 3. The prompt gets what the 3 decodes and 8 drafts leave.
    (12, {"roomy": (1, 4), "near_len": (1, 3), "near_max": (1, 1), "prompt": (1, 0)}),
    # A tight budget: the decodes first, then drafts in running order until the budget is spent.
    (8, {"roomy": (1, 4), "near_len": (1, 1), "near_max": (1, 0)}),
])
def test_verify_room_within_budget_model_len_and_max_tokens(budget, expected):
    scheduler = Scheduler(_limits(seqs=4, budget=budget, model_len=40))
    _decoding(scheduler, "roomy", 5, 1)
    _decoding(scheduler, "near_len", 35, 1)
    _decoding(scheduler, "near_max", 5, 1, max_tokens=3)
    scheduler.add(_seq("prompt", 9))
    plan = _run(scheduler, num_speculative_tokens=4)
    assert plan == expected
    assert sum(n + k for n, k in plan.values()) <= budget
    assert _run(scheduler, num_speculative_tokens=0)["roomy"] == (1, 0)  # no speculation: no room


def test_a_prompt_still_prefilling_gets_no_draft_room():
    scheduler = Scheduler(_limits(seqs=2, budget=8))
    seq = _seq("a", 9)
    scheduler.add(seq)
    assert _run(scheduler, num_speculative_tokens=3) == {"a": (8, 0)}
    assert _run(scheduler, num_speculative_tokens=3) == {"a": (1, 0)}  # last prompt token: no sample yet
    assert _run(scheduler, num_speculative_tokens=3) == {"a": (1, 3)}


def test_preempted_sequence_goes_first_and_recomputes_every_token():
    scheduler = Scheduler(_limits(seqs=1, budget=4))
    first, second = _seq("first", 6), _seq("second", 2)
    scheduler.add(first)
    scheduler.add(second)
    _run(scheduler)
    _run(scheduler)  # 6 prompt tokens over a 4-token budget; the second step samples one
    _run(scheduler)
    assert first.output_ids == [7, 7] and first.computed == 7
    slot = first.slot
    scheduler.preempt(first)
    assert first.status is SequenceStatus.WAITING and first.slot is None and first.computed == 0
    assert list(scheduler.waiting) == [first, second] and list(scheduler.free_slots) == [slot]
    assert first.output_ids == [7, 7] and first.num_preemptions == 1
    # Re-admitted before the sequence that was already waiting; prompt + outputs in budget-sized chunks.
    assert _run(scheduler) == {"first": (4, 0)}
    assert _run(scheduler) == {"first": (4, 0)}  # 8 tokens known: the second chunk ends with the last
    assert first.output_ids == [7, 7, 7] and first.computed == 8
    with pytest.raises(ValueError, match="only a running sequence can be preempted, this one is waiting"):
        scheduler.preempt(second)


def test_paused_admission_keeps_sequences_waiting_and_running_ones_going():
    scheduler = Scheduler(_limits(seqs=2))
    running, queued = _seq("running", 3), _seq("queued", 3)
    scheduler.add(running)
    _run(scheduler)
    scheduler.admitting = False
    scheduler.add(queued)
    assert not scheduler.can_admit()
    assert _run(scheduler) == {"running": (1, 0)}
    assert queued.status is SequenceStatus.WAITING
    scheduler.admitting = True
    assert scheduler.can_admit() and "queued" in _run(scheduler)


def test_no_draft_room_above_the_speculating_batch_limit():
    scheduler = Scheduler(_limits(seqs=4, budget=32, model_len=64))
    for name in "abc":
        _decoding(scheduler, name, 5, 1)
    plan = scheduler.schedule(3, max_speculating=2)  # three decode: more than 2
    assert plan.speculation_off and [c.max_drafts for c in plan.chunks] == [0, 0, 0]
    plan = scheduler.schedule(3, max_speculating=3)
    assert not plan.speculation_off and [c.max_drafts for c in plan.chunks] == [3, 3, 3]
    assert not scheduler.schedule(0, max_speculating=0).speculation_off  # nothing wanted: nothing turned off
