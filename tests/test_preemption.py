"""Preemption (recompute): a preempted sequence frees its cache slot, keeps its tokens, waits at the front
of the queue and, admitted again, recomputes its prompt and generated tokens by chunked prefill. Its
output must be what it would have been without the preemption: greedy and seeded tokens, logprobs,
prompt logprobs (scored once), text, a stop string split across the preemption, streaming deltas."""

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams

VOCAB = 512
SEED = 17
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def llm(tmp_path_factory, write_word_tokenizer):
    path = tmp_path_factory.mktemp("preemption")
    ref.save_hf_checkpoint(ref.build_reference_model(ref.tiny_config(), SEED), path)
    write_word_tokenizer(path, VOCAB)
    # 3 slots for 5 requests: preempted sequences queue behind running ones and get other slots back.
    return LLM(str(path), dtype="float32", max_num_seqs=3, max_num_batched_tokens=16, max_model_len=128)


def _prompts(lengths=(40, 3, 20, 7, 12)) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _run(llm: LLM, prompts, params, preempt_at: dict[int, list[str]] | None = None):
    """Run the prompts through llm's engine, preempting the named requests at the given steps (those
    running then). Returns ({request id: final output}, {request id: concatenated streamed tokens, text
    and prompt logprobs deltas}, [(request id, "prefill" | "decode") per preemption that happened])."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    requests = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    streamed = {r.request_id: {"tokens": [], "text": "", "prompt_logprobs": []} for r in requests}
    preemptions, step = [], 0
    while engine.has_work():
        for request_id in (preempt_at or {}).get(step, []):
            seq = requests[int(request_id[1:])].seqs[0]
            phase = "decode" if seq.output_ids else "prefill"
            if engine.preempt(request_id):
                preemptions.append((request_id, phase))
        for out in engine.step():
            got = streamed[out.request_id]
            got["tokens"].extend(out.outputs[0].token_ids)
            got["text"] += out.outputs[0].text
            if out.prompt_logprobs is not None:
                got["prompt_logprobs"].append(out.prompt_logprobs)
        step += 1
    assert len(engine.scheduler.free_slots) == llm.limits.max_num_seqs and not engine.requests
    return {r.request_id: r.output(delta=False) for r in requests}, streamed, preemptions


# Preempt during prefill (r0's 40-token prompt over a 16-token budget), right after the first token, in
# mid-decode, twice in a row, and several requests in one step.
PREEMPTIONS = {1: ["r0"], 3: ["r1", "r2"], 6: ["r1"], 7: ["r1"], 10: ["r0", "r3", "r4"], 14: ["r2"]}


def _same(plain, preempted) -> None:
    for rid, a in plain.items():
        b = preempted[rid]
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason)
            for lp_x, lp_y in zip(x.logprobs or [], y.logprobs or [], strict=True):
                assert lp_x.keys() == lp_y.keys() and all(abs(lp_x[t] - lp_y[t]) <= LOGPROB_TOL for t in lp_x)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for lp_x, lp_y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (lp_x is None) == (lp_y is None)
            assert lp_x is None or all(abs(lp_x[t] - lp_y[t]) <= LOGPROB_TOL for t in lp_x)


def test_preempted_greedy_requests_continue_exactly(llm):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=14, ignore_eos=True, logprobs=2, prompt_logprobs=1 if i == 0 else None)
              for i in range(len(prompts))]
    plain, _, none = _run(llm, prompts, params)
    preempted, streamed, events = _run(llm, prompts, params, PREEMPTIONS)
    assert not none and ("r0", "prefill") in events and events.count(("r1", "decode")) >= 2
    _same(plain, preempted)
    for rid, out in preempted.items():
        assert streamed[rid]["tokens"] == out.outputs[0].token_ids  # deltas: nothing lost, nothing twice
        assert streamed[rid]["text"] == out.outputs[0].text
    assert len(streamed["r0"]["prompt_logprobs"]) == 1  # scored once, although preempted mid-prefill
    assert len(preempted["r0"].prompt_logprobs) == len(prompts[0])


def test_seeded_sampling_continues_across_preemption(llm):
    prompts = _prompts()
    params = SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0, top_p=0.9, seed=3, n=2)
    plain, _, _ = _run(llm, prompts, params)
    assert len({tuple(c.token_ids) for o in plain.values() for c in o.outputs}) == 2 * len(prompts)
    preempted, _, events = _run(llm, prompts, params, PREEMPTIONS)
    assert len(events) >= 4
    _same(plain, preempted)


def test_stop_string_split_across_a_preemption(llm):
    prompt = _prompts((9,))
    base, _, _ = _run(llm, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    tokens = base["r0"].outputs[0].token_ids
    stop = f" w{tokens[5]} w{tokens[6]} "  # held back after token 5, completed by token 6
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop])
    plain, _, _ = _run(llm, prompt, params)
    assert plain["r0"].outputs[0].finish_reason == "stop" and len(plain["r0"].outputs[0].token_ids) == 8
    # Step 0 prefills and samples token 0, step s samples token s: preempt once token 5 is out.
    preempted, streamed, events = _run(llm, prompt, params, {6: ["r0"]})
    assert events == [("r0", "decode")]
    _same(plain, preempted)
    assert streamed["r0"]["text"] == plain["r0"].outputs[0].text
