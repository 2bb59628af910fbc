"""`dsv4 serve` through the official `openai` client: completions, chat, streaming with usage, n, logprobs,
stop, seeds, echo, token-id prompts, prompt logprobs, tokenize, errors, disconnects.

One server process for the module (the embedded sorting model with a chat template, an API key, no
admin token); expected values come from the same model loaded in this process (`LLM`), the engine the
server wraps, so each test checks the HTTP layer against the offline API it must agree with.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from dsv4 import LLM, SamplingParams
from server_harness import ServerProcess, metric, sort_checkpoint_with_chat_template, wait_for

API_KEY = "test-key"
MODEL = "sorter"
MAX_BODY_BYTES = 65536
CLIENT_TIMEOUT_S = 60.0
# A client that disconnects from a non-streamed request waits this long for its response first.
DISCONNECT_AFTER_S = 0.02
GREEDY = dict(temperature=0.0)
PROMPT = "sort 31402="
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return sort_checkpoint_with_chat_template(tmp_path_factory.mktemp("ckpt") / "sorter")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    proc = ServerProcess(checkpoint, "--api-key", API_KEY, "--served-model-name", MODEL,
                         "--max-body-bytes", str(MAX_BODY_BYTES),
                         log_file=tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint))


def _offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_completion_greedy_matches_offline_engine(client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY)
    ref = _offline(llm, PROMPT, max_tokens=10)
    choice = out.choices[0]
    assert choice.text == ref.outputs[0].text == "01234"
    assert choice.finish_reason == "stop"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.model_extra["weights_version"] == 0
    assert choice.model_extra["weights_versions"] == [{"version": 0, "start": 0, "end": out.usage.completion_tokens}]


def test_chat_uses_the_checkpoint_template(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "9081726"}], **GREEDY)
    assert out.choices[0].message.content == "0126789"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "stop"
    assert out.model_extra["weights_version"] == 0


def test_streaming_with_usage_equals_the_whole_response(client):
    whole = client.completions.create(model=MODEL, prompt="sort 86420135=", max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="sort 86420135=", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text == "01234568"
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "86420135"}],
                                               stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == "01234568"
    assert chat[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chat[:-1])


def test_raw_event_stream_shape(server):
    """`usage: null` on every chunk before the one usage chunk, then `data: [DONE]` (checked on the wire)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all("usage" in p and p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["usage"]["completion_tokens"] == 4 and payloads[-1]["choices"] == []
    plain = {**body, "stream_options": None}
    del plain["stream_options"]
    with httpx.stream("POST", server.url + "/v1/completions", json=plain, timeout=CLIENT_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert all("usage" not in json.loads(e) for e in events[:-1])  # no usage asked: no usage key


def test_n_and_seed_reproducibility(client):
    def sample(seed, n=3, stream=False):
        kwargs = dict(model=MODEL, prompt="hello there", max_tokens=12, temperature=3.0, seed=seed, n=n,
                      extra_body={"ignore_eos": True})
        if not stream:
            return [c.text for c in sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)]
        texts = [""] * n
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.text
        return texts

    first = sample(7)
    assert len(first) == 3 and len(set(first)) == 3  # seed + index: three different samples
    assert sample(7) == first  # same seed, same completions
    assert sample(7, stream=True) == first  # streamed or not
    assert sample(8) != first


def test_logprobs_match_the_engine(client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    ref = _offline(llm, PROMPT, max_tokens=6, logprobs=3).outputs[0]
    lp = out.choices[0].logprobs
    text = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert lp.tokens == text
    for got, top, token in zip(lp.token_logprobs, ref.logprobs, ref.token_ids):
        assert got == pytest.approx(top[token], abs=LOGPROB_TOL)
    assert [len(t) for t in lp.top_logprobs] == [len(t) for t in ref.logprobs]
    assert lp.text_offset == list(range(len(text)))  # one character per token in this vocabulary

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "31402"}],
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == "01234</s>"
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy
        assert bytes(c.bytes).decode() == c.token


def test_stop_strings_and_stop_token_ids(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stop=["3", "zz"], **GREEDY)
    assert out.choices[0].text == "012" and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == "3"
    four = 7  # token id of "4" in the embedded vocabulary
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, extra_body={"stop_token_ids": [four]},
                                    **GREEDY)
    assert out.choices[0].text == "0123" and out.choices[0].model_extra["stop_reason"] == four
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, stop="23", stream=True, **GREEDY) if c.choices)
    assert streamed == "01"


def test_token_id_prompts_batches_and_echo(client, llm):
    ids = llm.tokenizer.encode(PROMPT).ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == "01234"
    batch = client.completions.create(model=MODEL, prompt=["sort 21=", "sort 3="], max_tokens=8, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(4))
    assert [c.text for c in batch.choices] == ["12", "12", "3", "3"]
    id_batch = client.completions.create(model=MODEL, prompt=[ids, ids[:-3] + ids[-1:]], max_tokens=8, **GREEDY)
    assert [c.text for c in id_batch.choices] == ["01234", "134"]  # "sort 314=": the prompt without "02"
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, echo=True, **GREEDY)
    assert echo.choices[0].text == PROMPT + "01234"


def test_prompt_scoring_with_echo_and_prompt_logprobs(client, llm):
    """max_tokens=0 + echo + logprobs: the prompt's own logprobs (as lm-eval asks), equal to the engine's."""
    ids = llm.tokenizer.encode(PROMPT).ids
    expected = llm.forward_logprobs([ids])[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, **GREEDY)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == PROMPT and out.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    want = [expected[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=LOGPROB_TOL)

    ext = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 0},
                                    **GREEDY)
    prompt_lps = ext.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    assert [p[str(t)] for p, t in zip(prompt_lps[1:], ids[1:])] == pytest.approx(want, abs=LOGPROB_TOL)


def test_models_tokenize_detokenize_version(server, client, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tok["tokens"] == llm.tokenizer.encode(PROMPT).ids and tok["count"] == len(tok["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "12"}]}).json()
    assert chat["tokens"] == llm.tokenizer.encode("sort 12=").ids  # the template adds <s> itself
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": PROMPT}
    assert httpx.get(server.url + "/version").json()["weights_version"] == 0
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [1, 4096]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(max_tokens="8"), "max_tokens"),  # wrong type
        (dict(temperature=-1.0), "temperature"),  # out of range
        (dict(n=0), "n"),
        (dict(top_p=1.5), "top_p"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt="sort " + "1" * 80 + "="), "prompt"),  # over max_model_len (64)
        (dict(prompt=[3, 4, 9999]), "prompt"),  # token id outside the vocabulary
        (dict(extra_body={"not_a_field": 1}), "not_a_field"),
        (dict(frequency_penalty=0.5), "frequency_penalty"),
        (dict(stream_options={"include_usage": True}), "stream_options"),  # only with stream
    ],
)
def test_bad_requests_get_400_naming_the_field(client, kwargs, param):
    kwargs = {"model": MODEL, "prompt": PROMPT, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    assert param in body["message"] or "prompt" in body["message"]


def test_other_refusals(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert err.value.body["param"] == "tools"
    keyless = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    with pytest.raises(openai.AuthenticationError):
        keyless.models.list()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    too_big = httpx.post(server.url + "/v1/completions", headers=headers,
                         content=json.dumps({"prompt": "x" * MAX_BODY_BYTES}))
    assert too_big.status_code == 413 and str(MAX_BODY_BYTES) in too_big.json()["error"]["message"]
    not_json = httpx.post(server.url + "/v1/completions", headers=headers, content=b"{not json")
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    for content, content_type in ((b"", "application/json"), (b"[]", "application/json"),
                                  (json.dumps({"prompt": PROMPT}).encode(), "text/plain")):
        r = httpx.post(server.url + "/v1/completions", content=content,
                       headers={**headers, "Content-Type": content_type})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], r.text
    # Admin routes are off without --admin-token: not there at all.
    assert httpx.post(server.url + "/admin/pause", headers={"Authorization": "Bearer x"}).status_code == 404


def test_bad_requests_do_not_disturb_requests_in_flight(client):
    stream = client.completions.create(model=MODEL, prompt="sort 86420135=", max_tokens=16, stream=True, **GREEDY)
    text = next(stream).choices[0].text
    for kwargs in (dict(n=-1), dict(max_tokens="x"), dict(prompt=[99999])):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{"model": MODEL, "prompt": PROMPT, **kwargs})
    text += "".join(c.choices[0].text for c in stream if c.choices)
    assert text == "01234568"


def test_disconnect_aborts_the_request_and_frees_its_slots(server):
    """A client that goes away mid-stream: its request ends as "abort" (it would otherwise run its 50
    tokens x 64 sequences) and no cache slot stays in use."""
    aborted_before = metric(server.url, "request_success_total", 'finished_reason="abort"')
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "n": 64, "temperature": 1.0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        next(r.iter_lines())  # the first event: the request runs
    wait_for(lambda: metric(server.url, "request_success_total", 'finished_reason="abort"') > aborted_before,
             30.0, "the abort to be counted")
    wait_for(lambda: metric(server.url, "cache_slots_used") == 0, 30.0, "every slot to be free")
    assert metric(server.url, "num_requests_running") == 0
    # A disconnected non-streamed request is aborted too.
    aborted_before = metric(server.url, "request_success_total", 'finished_reason="abort"')
    # The client gives up while the request runs: its body is sent (the timeout bounds the wait for the
    # response), and 64 x 50 tokens take the engine far longer than DISCONNECT_AFTER_S, even on a fast CPU
    # (0.3 s was not: a fast machine finished the request within it).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(CLIENT_TIMEOUT_S, read=DISCONNECT_AFTER_S),
                   headers={"Authorization": f"Bearer {API_KEY}"})
    wait_for(lambda: metric(server.url, "request_success_total", 'finished_reason="abort"') > aborted_before,
             30.0, "the abort of the non-streamed request")
    wait_for(lambda: metric(server.url, "cache_slots_used") == 0, 30.0, "every slot to be free")


def test_metrics_count_what_was_served(server, client):
    before = metric(server.url, "generation_tokens_total")
    ttft_before = metric(server.url, "time_to_first_token_seconds_count")
    list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                   extra_body={"ignore_eos": True}, **GREEDY))
    assert metric(server.url, "generation_tokens_total") == before + 3
    assert metric(server.url, "time_to_first_token_seconds_count") == ttft_before + 1
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "cache_slots_used", "weights_version",
                 "spec_decode_num_accepted_tokens_per_pos"):
        assert f"dsv4:{name}" in text
