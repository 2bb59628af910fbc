"""The engine and LLM facade: sampling options, stop conditions, logprobs, streaming + abort,
admission control, per-request errors, default limits and the chat template."""

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.engine.limits import EngineLimits, cache_bytes_per_sequence
from dsv4.errors import ConfigError, RequestError

SEED = 5
VOCAB = 512
TOL = 1e-5
# Word "w3" stands for the assistant turn marker; roles other than user/assistant are refused.
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}"
    "{% if m['role'] not in ('user', 'assistant') %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


def _word(i: int) -> str:
    return f"w{i}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory, write_word_tokenizer):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("engine")
    ref.save_hf_checkpoint(ref.build_reference_model(ref.tiny_config(), SEED), path)
    write_word_tokenizer(path, VOCAB, {"chat_template": CHAT_TEMPLATE, "bos_token": "w0"})
    yield LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    torch.set_num_threads(saved)


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_too_long_prompt_fails_alone(llm):
    outs = llm.generate([_ids(5), _ids(200), _ids(7)], GREEDY, use_tqdm=False)
    assert outs[1].error and "max_model_len=128" in outs[1].error and outs[1].outputs == []
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 12
    assert outs[2].error is None and outs[2].outputs[0].finish_reason == "length"
    with pytest.raises(RequestError, match="max_model_len"):
        llm.engine.add_request("x", _ids(200), GREEDY)


def test_admission_control_queues_beyond_slots(llm):
    prompts = [_ids(3 + i, seed=i) for i in range(9)]  # 9 requests x n=2 for 4 slots
    sampled = SamplingParams(max_tokens=5, ignore_eos=True, n=2, temperature=1.0, seed=3)
    outs = llm.generate(prompts, sampled, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2] * 9
    assert all(len(c.token_ids) == 5 for o in outs for c in o.outputs)
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids  # seed + index: distinct samples
    again = llm.generate(prompts[0], SamplingParams(max_tokens=5, ignore_eos=True, n=2, temperature=1.0, seed=3),
                         use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outs[0].outputs]
    assert len(llm.engine.scheduler.free_slots) == llm.limits.max_num_seqs and not llm.engine.requests


def test_stop_token_ids_and_eos(llm):
    base = llm.generate([_ids(6)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = base[4]
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    out = llm.generate([_ids(6)], params, use_tqdm=False)[0].outputs[0]
    cut = base.index(stop_at) + 1
    assert out.token_ids == base[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_at
    eos = llm.config.eos_token_ids[0]
    llm.engine.eos_token_ids = {stop_at}  # pretend the model's EOS is that token
    try:
        stopped = llm.generate([_ids(6)], SamplingParams(max_tokens=12), use_tqdm=False)[0].outputs[0]
        ignored = llm.generate([_ids(6)], GREEDY, use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = {eos}
    assert stopped.token_ids == base[:cut] and stopped.finish_reason == "stop"
    assert ignored.token_ids == base


def test_stop_strings_truncate_text(llm):
    base = llm.generate([_ids(6)], GREEDY, use_tqdm=False)[0].outputs[0]
    # Decoded after the prompt's context, so the continuation starts with the separating space.
    assert base.text == "".join(" " + _word(t) for t in base.token_ids)
    stop = f" {_word(base.token_ids[5])} "  # spaces make it match only at that token
    out = llm.generate([_ids(6)], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert out.token_ids == base.token_ids[: len(out.token_ids)] and len(out.token_ids) <= 7


def test_logprobs_raw_match_forward_and_processed_differ(llm):
    prompt = _ids(9)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, temperature=0.7, top_k=20, seed=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    full = llm.forward_logprobs([prompt + out.token_ids])[0]  # [len, V]
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = full[len(prompt) - 1 + i]
        assert token in lp and len(lp) <= 3
        top2 = row.topk(2).indices.tolist()
        assert set(top2) <= set(lp)
        for t, v in lp.items():
            assert abs(v - row[t].item()) <= TOL
    processed_params = SamplingParams(**{**params.__dict__, "logprobs_mode": "processed"})
    processed = llm.generate([prompt], processed_params, use_tqdm=False)[0].outputs[0]
    assert processed.token_ids == out.token_ids  # same seed, same draws
    assert abs(processed.logprobs[0][out.token_ids[0]] - out.logprobs[0][out.token_ids[0]]) > 1e-3


def test_prompt_logprobs_match_forward_across_chunks(llm):
    prompt = _ids(40, seed=9)  # 40 tokens over a 16-token budget: three prefill chunks
    out = llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1), use_tqdm=False)[0]
    full = llm.forward_logprobs([prompt])[0]
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        lp = out.prompt_logprobs[t]
        assert prompt[t] in lp
        assert abs(lp[prompt[t]] - full[t - 1, prompt[t]].item()) <= TOL
        assert full[t - 1].argmax().item() in lp


def test_stream_deltas_concatenate_and_abort_frees_slots(llm):
    prompts = [_ids(4, seed=1), _ids(30, seed=2), _ids(8, seed=3)]
    full = llm.generate(prompts, GREEDY, use_tqdm=False)
    tokens, texts, finals = {}, {}, {}
    aborted = None
    for delta in llm.stream(prompts, GREEDY):
        rid = delta.request_id
        tokens.setdefault(rid, []).extend(delta.outputs[0].token_ids)
        texts[rid] = texts.get(rid, "") + delta.outputs[0].text
        if delta.finished:
            finals[rid] = delta.outputs[0].finish_reason
        if aborted is None and len(tokens[rid]) >= 3 and not delta.finished and rid != min(tokens):
            aborted = rid
            assert llm.abort(rid)
            assert not llm.abort(rid)
    order = sorted(tokens, key=int)
    assert len(order) == 3 and aborted is not None and finals[aborted] == "abort"
    for rid, expected in zip(order, full):
        if rid == aborted:
            assert tokens[rid] == expected.outputs[0].token_ids[: len(tokens[rid])]
        else:
            assert tokens[rid] == expected.outputs[0].token_ids and finals[rid] == "length"
            assert texts[rid] == expected.outputs[0].text
    assert len(llm.engine.scheduler.free_slots) == llm.limits.max_num_seqs and not llm.engine.has_work()


def test_unstreamed_requests_are_reported_once_when_finished(llm):
    """stream=False: step() reports nothing while the request runs, then one output with everything;
    a streamed request in the same steps still gets a delta every step."""
    engine = llm.engine
    quiet = engine.add_request("quiet", _ids(6, seed=4), SamplingParams(max_tokens=5, ignore_eos=True, n=2),
                               stream=False)
    loud = engine.add_request("loud", _ids(9, seed=5), SamplingParams(max_tokens=7, ignore_eos=True))
    reported: dict[str, list] = {"quiet": [], "loud": []}
    while engine.has_work():
        for out in engine.step():
            reported[out.request_id].append(out)
    assert len(reported["quiet"]) == 1 and reported["quiet"][0].finished
    final = quiet.output(delta=False)
    assert [c.token_ids for c in reported["quiet"][0].outputs] == [c.token_ids for c in final.outputs]
    assert all(len(c.token_ids) == 5 and c.text for c in final.outputs)
    assert len(reported["loud"]) == 7 and [o.finished for o in reported["loud"]] == [False] * 6 + [True]
    streamed = [t for o in reported["loud"] for t in o.outputs[0].token_ids]
    assert streamed == loud.output(delta=False).outputs[0].token_ids
    assert len(engine.scheduler.free_slots) == llm.limits.max_num_seqs


def test_chat_uses_checkpoint_template(llm):
    messages = [{"role": "user", "content": "w7 w9"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [0, 7, 9, 3]
    direct = llm.generate([out.prompt_token_ids], GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.outputs[0].token_ids == direct.token_ids
    with pytest.raises(RequestError, match="unknown role system"):
        llm.chat([{"role": "system", "content": "w1"}], GREEDY, use_tqdm=False)


def test_default_limits_follow_model_and_memory(llm):
    cfg = llm.config
    roomy = EngineLimits.derive(cfg, torch.float32, "cpu", memory_bytes=1 << 40)
    assert roomy.max_model_len == cfg.max_position_embeddings and roomy.max_num_seqs >= 1
    per_seq = cache_bytes_per_sequence(cfg, cfg.max_position_embeddings, torch.float32)
    tight = EngineLimits.derive(cfg, torch.float32, "cpu", memory_bytes=int(per_seq * 3 / 0.25))  # 3 sequences fit
    assert tight.max_model_len == cfg.max_position_embeddings and tight.max_num_seqs == 3
    tiny = EngineLimits.derive(cfg, torch.float32, "cpu", memory_bytes=per_seq)  # less than one full-length sequence
    assert tiny.max_model_len < cfg.max_position_embeddings
    assert cache_bytes_per_sequence(cfg, tiny.max_model_len, torch.float32) <= per_seq * 0.25
    huge = EngineLimits.derive(cfg, torch.float32, "cpu", max_model_len=10**9)
    assert huge.max_model_len == cfg.max_position_embeddings
    assert EngineLimits.derive(cfg, torch.float32, "cpu", max_num_batched_tokens=8,
                               memory_bytes=1 << 40).max_num_seqs == 8
    with pytest.raises(ConfigError, match="max_num_seqs=9 > max_num_batched_tokens=8"):
        EngineLimits.derive(cfg, torch.float32, "cpu", max_num_seqs=9, max_num_batched_tokens=8)
    with pytest.raises(ConfigError, match="max_model_len must be a positive int"):
        EngineLimits.derive(cfg, torch.float32, "cpu", max_model_len=0)


def test_sampling_rows_are_built_once_per_batch_composition(llm):
    """The sampling settings of a step are rebuilt only when a sequence joins or leaves the batch."""
    engine = llm.engine
    builds = engine.sampling.builds
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1)
    for i in range(3):  # 3 prompts prefilled in one step, then 5 decode steps with the same 3 rows
        engine.add_request(f"steady{i}", _ids(4, seed=i), params)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps == 2:  # a 4th joins: its rows join at its first sample, and the batch shrinks back later
            engine.add_request("joiner", _ids(4, seed=9), params)
    assert steps == 8 and engine.sampling.builds - builds == 3  # (3 rows), (4 rows), (the joiner alone)


def test_closing_a_stream_early_aborts_its_requests(llm):
    stream = llm.stream([_ids(5), _ids(7, seed=1)], GREEDY)
    first = next(stream)
    assert not first.finished and llm.engine.stats().running == 2
    stream.close()
    assert llm.engine.stats().running == 0 and len(llm.engine.scheduler.free_slots) == llm.limits.max_num_seqs
    outs = llm.engine.step()
    assert {o.outputs[0].finish_reason for o in outs} == {"abort"} and not llm.engine.has_work()
