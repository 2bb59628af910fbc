"""The admin routes of a real `dsv4 serve` process (httpx): auth, pause / resume, weight update sessions over
HTTP (safetensors buckets), reload under --weights-root, the weight report, weight sync from a trainer
process over torch.distributed, pause and updates driven concurrently with generation, retract, and a
reduced run of benchmarks/load_server.py.

The weights used: the embedded sorting model ("A") and the same model with the digits 0 and 1 exchanged
in its embedding and head ("B": it sorts as before with the two digits' names swapped, so "sort 31402="
gives "10234"). Expected answers come from both loaded in this process: every stretch of a completion
(the tokens one weights version chose) must be what that version's weights give greedily for the prompt
plus the tokens before the stretch, so a token computed on a mix of versions, or a retracted request
continued without recomputing, fails the check.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import random
import socket
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save as save_safetensors

from dsv4 import LLM, SamplingParams
from server_harness import REPO, ServerProcess, sort_checkpoint_with_chat_template, wait_for
from weight_trainer import Trainer

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BUCKET_BYTES = 1 << 20
TIMEOUT_S = 60.0
DIGIT_ZERO, DIGIT_ONE = 3, 4  # token ids of "0" and "1"
PROMPTS = ("sort 31402=", "sort 9081726=", "sort 55512=", "sort 7=", "sort 86420135=", "sort 1100=")
# A request long enough to be caught mid-way: 8 sequences of 40 tokens each (two of them fill the 16 slots).
LONG_REQUEST = {"prompt": PROMPTS[4], "max_tokens": 40, "temperature": 0.0, "ignore_eos": True, "n": 8,
                "logprobs": 0}
TRANSFER_BUCKET_BYTES = 64 << 10  # several buckets for the ~1 MB model


def _relabeled(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("embed.weight", "head.weight"):
        w = weights[name].clone()
        w[[DIGIT_ZERO, DIGIT_ONE]] = w[[DIGIT_ONE, DIGIT_ZERO]]
        out[name] = w
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The weights root: the served checkpoint "sorter", plus a symlink that leads outside it."""
    root = tmp_path_factory.mktemp("weights_root")
    sort_checkpoint_with_chat_template(root / "sorter")
    outside = sort_checkpoint_with_chat_template(tmp_path_factory.mktemp("outside") / "elsewhere")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    # A directory inside the root whose weights file is a symlink to a file outside it.
    linked = sort_checkpoint_with_chat_template(root / "linked")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def models(root):
    """(A, B) loaded here, and the tensors of each that differ (what a bucket carries)."""
    a = LLM(str(root / "sorter"))
    weights_a = {name: t.clone() for name, t in a.iter_weights() if name in ("embed.weight", "head.weight")}
    weights_b = _relabeled(weights_a)
    b = LLM(str(root / "sorter"))
    b.update_weights(weights_b)
    return a, b, weights_a, weights_b


@pytest.fixture(scope="module")
def b_checkpoint(root, models):
    """B saved under the weights root ("sorter_b"): what reload and a trainer send, and its fresh load."""
    return models[1].save_checkpoint(root / "sorter_b")


@pytest.fixture(scope="module")
def answers(models):
    a, b, _, _ = models
    params = SamplingParams(max_tokens=12, temperature=0.0)
    return {name: {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(list(PROMPTS), params, use_tqdm=False))}
            for name, llm in (("A", a), ("B", b))}


@pytest.fixture(scope="module")
def server(root, tmp_path_factory):
    proc = ServerProcess(root / "sorter", "--admin-token", TOKEN, "--weights-root", str(root),
                         "--max-bucket-bytes", str(MAX_BUCKET_BYTES), "--max-num-seqs", "16",
                         log_file=tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def admin(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT_S) as client:
        yield client


def _complete(url: str, prompt: str, stream: bool = False, max_tokens: int = 12) -> dict:
    """One greedy completion: text, tokens (each token's text, from logprobs), finish_reason, stretches
    (weights_versions), version (weights_version)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
        r.raise_for_status()
        out = r.json()
        c = out["choices"][0]
        return {"prompt": prompt, "text": c["text"], "tokens": c["logprobs"]["tokens"],
                "finish_reason": c["finish_reason"], "stretches": c["weights_versions"],
                "version": out["weights_version"], "ignore_eos": False}
    (choice,) = _stream(url, body).values()
    return {**choice, "prompt": prompt, "ignore_eos": False}


def _stream(url: str, body: dict, on_first_token=None) -> dict[int, dict]:
    """A streamed completion, per choice index: text, tokens, finish_reason, stretches, version (the
    highest any chunk named). `on_first_token()` runs once the first chunk with tokens arrived, while
    the rest is generated."""
    choices: dict[int, dict] = {}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                got = choices.setdefault(c["index"], {"text": "", "tokens": [], "finish_reason": None,
                                                      "stretches": [], "version": 0})
                got["text"] += c["text"]
                got["tokens"] += c["logprobs"]["tokens"]
                got["stretches"] += c["weights_versions"]
                got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
                got["version"] = max(got["version"], chunk["weights_version"])
            if on_first_token is not None and any(got["tokens"] for got in choices.values()):
                on_first_token()
                on_first_token = None
    return choices


def _merged(stretches: list[dict], length: int) -> list[tuple[int, int, int]]:
    """The stretches as (version, start, end), runs of one version joined; checks that they tile
    [0, length) in order with increasing versions."""
    merged: list[list[int]] = []
    for s in stretches:
        if merged and merged[-1][0] == s["version"] and merged[-1][2] == s["start"]:
            merged[-1][2] = s["end"]
        else:
            merged.append([s["version"], s["start"], s["end"]])
    if not merged:  # a request aborted before its first token has no tokens and so no stretches
        assert length == 0, (stretches, length)
        return []
    assert [b for _, b, _ in merged] == [0] + [e for _, _, e in merged[:-1]], stretches
    assert merged[-1][2] == length, (stretches, length)
    assert all(v1 < v2 for (v1, _, _), (v2, _, _) in itertools.pairwise(merged)), stretches
    return [tuple(m) for m in merged]


def _check_stretches(models, weights_of: dict[int, str], completions: list[dict]) -> None:
    """Every stretch of every completion equals what its version's weights (A or B) give greedily for
    the prompt plus the completion's tokens before the stretch."""
    a, b = models[0], models[1]
    vocab = a.tokenizer
    checks = {"A": [], "B": []}
    for got in completions:
        ids = [vocab.token_to_id(t) for t in got["tokens"]]
        prompt_ids = vocab.encode(got["prompt"]).ids
        for version, start, end in _merged(got["stretches"], len(ids)):
            checks[weights_of[version]].append((prompt_ids + ids[:start], ids[start:end], got["ignore_eos"]))
    for name, llm in (("A", a), ("B", b)):
        if checks[name]:
            params = [SamplingParams(max_tokens=len(want), temperature=0.0, ignore_eos=ignore)
                      for _, want, ignore in checks[name]]
            outs = llm.generate([ids for ids, _, _ in checks[name]], params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == [want for _, want, _ in checks[name]], name


def _version(admin: httpx.Client) -> int:
    return admin.get("/admin/state").json()["weights_version"]


def _serve_a(admin: httpx.Client) -> int:
    """Reload A (the served checkpoint); returns its version."""
    r = admin.post("/admin/weights/reload", json={"path": "sorter"})
    assert r.status_code == 200, r.text
    return r.json()["version"]


def _bucket(tensors: dict[str, torch.Tensor]) -> bytes:
    return save_safetensors({k: v.contiguous() for k, v in tensors.items()})


def _update(admin: httpx.Client, tensors: dict[str, torch.Tensor], mode: str = "wait") -> int:
    assert admin.post("/admin/weights/begin", json={"mode": mode}).status_code == 200
    r = admin.post("/admin/weights/bucket", content=_bucket(tensors))
    assert r.status_code == 200, r.text
    r = admin.post("/admin/weights/finish")
    assert r.status_code == 200, r.text
    return r.json()["version"]


def test_admin_routes_need_the_token(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        r = httpx.post(server.url + "/admin/pause", headers=headers, json={"mode": "abort"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    # Checked before the body is read: an unauthenticated upload over the bucket limit is still a 401.
    r = httpx.post(server.url + "/admin/weights/bucket", content=b"x" * (2 * MAX_BUCKET_BYTES))
    assert r.status_code == 401
    for route in ("init_transfer", "update_distributed", "update_shared"):
        assert httpx.post(f"{server.url}/admin/weights/{route}", json={}).status_code == 401
    assert httpx.get(server.url + "/admin/state", headers=AUTH).json()["paused"] is False


def test_weight_session_over_http_changes_answers_and_the_report(server, admin, models, answers):
    _, b, weights_a, weights_b = models
    before = admin.get("/admin/weights/report").json()
    version = before["version"]
    assert _complete(server.url, PROMPTS[0])["text"] == answers["A"][PROMPTS[0]] == "01234"
    assert _update(admin, weights_b) == version + 1
    got = _complete(server.url, PROMPTS[0])
    assert got["text"] == answers["B"][PROMPTS[0]] == "10234" and got["version"] == version + 1
    assert got["stretches"] == [{"version": version + 1, "start": 0, "end": 6}]
    report = admin.get("/admin/weights/report").json()
    assert report["version"] == version + 1 and report["ready"]
    reference = b.weight_report()["tensors"]
    assert {k: v["checksum"] for k, v in report["tensors"].items()} == {k: v["checksum"] for k, v in reference.items()}
    assert {k: v["data_ptr"] for k, v in report["tensors"].items()} == {k: v["data_ptr"] for k, v in
                                                                        before["tensors"].items()}  # in place
    assert _update(admin, weights_a) == version + 2
    assert _complete(server.url, PROMPTS[0])["text"] == "01234"


def test_weight_session_errors_change_nothing(server, admin, models):
    weights_b = models[3]
    version = admin.get("/admin/state").json()["weights_version"]
    assert admin.post("/admin/weights/bucket", content=_bucket(weights_b)).status_code == 409  # no session
    assert admin.post("/admin/weights/finish").status_code == 409
    assert admin.post("/admin/weights/begin", json={"mode": "sometimes"}).status_code == 400
    assert admin.post("/admin/weights/begin", json={}).status_code == 200
    assert admin.post("/admin/weights/begin", json={}).status_code == 409  # one session at a time
    bad = admin.post("/admin/weights/bucket", content=b"not safetensors at all")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    assert admin.post("/admin/weights/bucket", content=b"").status_code == 400
    too_big = admin.post("/admin/weights/bucket", content=b"\0" * (MAX_BUCKET_BYTES + 1))
    assert too_big.status_code == 413 and str(MAX_BUCKET_BYTES) in too_big.json()["error"]["message"]
    unknown = admin.post("/admin/weights/bucket", content=_bucket({"no.such.weight": torch.zeros(2)}))
    assert unknown.status_code == 400 and "no.such.weight" in unknown.json()["error"]["message"]
    # The failed bucket closed the (atomic) session; nothing was applied.
    assert admin.post("/admin/weights/finish").status_code == 409
    assert admin.post("/admin/weights/begin", json={}).status_code == 200
    assert admin.post("/admin/weights/bucket", content=_bucket(weights_b)).status_code == 200
    assert admin.post("/admin/weights/abort").status_code == 200
    state = admin.get("/admin/state").json()
    assert state["weights_version"] == version and state["weights_ready"] and not state["weight_update_open"]
    assert _complete(server.url, PROMPTS[0])["text"] == "01234"


def test_reload_only_under_the_weights_root(server, admin, root, models):
    _, _, _, weights_b = models
    version = _update(admin, weights_b)
    r = admin.post("/admin/weights/reload", json={"path": "sorter"})
    assert r.status_code == 200 and r.json()["version"] == version + 1
    assert _complete(server.url, PROMPTS[0])["text"] == "01234"
    for path in ("escape", "linked", "../", str(root.parent), "/etc", "sorter/../../", "missing", "sorter/config.json",
                 "sorter\x00"):
        r = admin.post("/admin/weights/reload", json={"path": path})
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", (path, r.text)
    assert admin.get("/admin/state").json()["weights_version"] == version + 1
    assert admin.post("/admin/weights/reload", json={"path": 3}).status_code == 400


def test_pause_modes_over_http(server, admin):
    results = {}

    def long_stream():
        results["long"] = _complete(server.url, PROMPTS[4], stream=True, max_tokens=40)

    # abort: the request in flight ends with finish_reason "abort".
    body = {"prompt": PROMPTS[4], "max_tokens": 50, "temperature": 1.0, "ignore_eos": True, "n": 16, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        lines = r.iter_lines()
        next(lines)
        paused = admin.post("/admin/pause", json={"mode": "abort"}).json()
        rest = "\n".join(lines)
    assert paused["paused"] and paused["running"] == 0
    assert '"finish_reason":"abort"' in rest and rest.rstrip().endswith("data: [DONE]")
    # While paused, new requests wait; they run after resume.
    waiting = threading.Thread(target=long_stream)
    waiting.start()
    time.sleep(0.5)
    state = admin.get("/admin/state").json()
    assert "long" not in results and state["waiting"] == 1 and state["running"] == 0
    assert admin.post("/admin/resume").json()["paused"] is False
    waiting.join(TIMEOUT_S)
    assert results["long"]["finish_reason"] == "stop" and results["long"]["text"] == "01234568"
    r = admin.post("/admin/pause", json={"mode": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert admin.get("/admin/state").json()["paused"] is False


@pytest.mark.parametrize("how", ["session", "pause", "reload"])
def test_retract_during_streaming_recomputes_under_the_new_weights(server, admin, models, b_checkpoint, how):
    """A weight update with mode "retract" while a streamed and a non-streamed request generate (a
    session whose finish retracts, an explicit retract pause around a session, a reload): they are
    preempted, the update applies, and they go on under the new weights. Every choice lists two
    stretches, old version then new, and the tokens after the update are B's greedy continuation of
    the prompt plus the tokens before it."""
    _, _, _, weights_b = models
    version = _serve_a(admin)
    n = LONG_REQUEST["n"]
    answers: list[httpx.Response] = []
    if how == "session":  # staged while generation goes on; the finish pauses
        assert admin.post("/admin/weights/begin", json={"mode": "retract"}).status_code == 200
        assert admin.post("/admin/weights/bucket", content=_bucket(weights_b)).status_code == 200
    whole: list[dict] = []
    streamed: dict[int, dict] = {}
    failures: list[BaseException] = []

    def recorded(run):  # a thread's failure is re-raised by the test, not lost with the thread
        def target():
            try:
                run()
            except BaseException as error:  # re-raised below
                failures.append(error)
        return threading.Thread(target=target)

    batch = recorded(lambda: whole.append(
        httpx.post(server.url + "/v1/completions", json=LONG_REQUEST, timeout=TIMEOUT_S).json()))
    stream = recorded(lambda: streamed.update(_stream(server.url, LONG_REQUEST, on_first_token=update)))

    def update():
        if how == "session":
            answers.append(admin.post("/admin/weights/finish"))
        elif how == "reload":
            answers.append(admin.post("/admin/weights/reload", json={"path": "sorter_b", "mode": "retract"}))
        else:
            paused = admin.post("/admin/pause", json={"mode": "retract"})
            assert paused.json()["running"] == 0 and paused.json()["waiting"] == 2 * n, paused.json()
            answers.append(paused)
            assert _update(admin, weights_b, mode="abort") == version + 1  # joins the pause: nothing aborted
            time.sleep(0.2)
            assert admin.get("/admin/state").json()["running"] == 0  # still paused after the update
            answers.append(admin.post("/admin/resume"))

    # Both requests queue behind a pause and start in the same step on resume (their 2n sequences fit the
    # 16 slots), so the batch runs when the stream's first token triggers the update, however fast the
    # machine: a poll for the batch running could miss a request that lasts less than its interval.
    assert admin.post("/admin/pause", json={"mode": "wait"}).json()["paused"] is True
    batch.start()
    stream.start()
    wait_for(lambda: admin.get("/admin/state").json()["waiting"] == 2 * n, TIMEOUT_S, "both requests to queue")
    assert admin.post("/admin/resume").json()["paused"] is False
    stream.join(TIMEOUT_S)
    batch.join(TIMEOUT_S)
    if failures:
        raise failures[0]
    choices = list(streamed.values())
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert _version(admin) == version + 1
    (response,) = whole
    assert response["weights_version"] == version + 1
    for c in response["choices"]:
        choices.append({"text": c["text"], "tokens": c["logprobs"]["tokens"], "finish_reason": c["finish_reason"],
                        "stretches": c["weights_versions"], "version": response["weights_version"]})
    assert len(choices) == 2 * n
    completions = [{**c, "prompt": LONG_REQUEST["prompt"], "ignore_eos": True} for c in choices]
    for got in completions:
        merged = _merged(got["stretches"], LONG_REQUEST["max_tokens"])
        assert [v for v, _, _ in merged] == [version, version + 1], merged
        assert got["finish_reason"] == "length" and got["version"] == version + 1
    _check_stretches(models, {version: "A", version + 1: "B"}, completions)


def test_pause_and_updates_racing_generation_never_mix_versions(server, admin, models):
    """Clients stream and poll while one admin thread runs weight sessions (A <-> B, random pause modes)
    and another pauses and resumes at random (random modes). Nothing deadlocks (everything ends within
    the timeouts), and every stretch of every completion is right for its version."""
    _, _, weights_a, weights_b = models
    weights_of = {_serve_a(admin): "A"}
    rng = random.Random(0)
    stop = threading.Event()
    completions, failures = [], []
    modes = ["wait", "abort", "retract"]

    def client(seed: int):
        local = random.Random(seed)
        while not stop.is_set():
            prompt = local.choice(PROMPTS)
            try:
                completions.append(_complete(server.url, prompt, stream=local.random() < 0.5))
            except Exception as exc:  # reported below; the test must see every failure
                failures.append(repr(exc))

    def updater():
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT_S) as own:
            for i in range(6):
                name = "B" if i % 2 == 0 else "A"
                version = _update(own, weights_b if name == "B" else weights_a, mode=rng.choice(modes))
                weights_of[version] = name

    def pauser():
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT_S) as own:
            for _ in range(6):
                assert own.post("/admin/pause", json={"mode": rng.choice(modes)}).status_code == 200
                time.sleep(rng.uniform(0.0, 0.1))
                assert own.post("/admin/resume").status_code == 200
                time.sleep(rng.uniform(0.0, 0.1))

    clients = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    admins = [threading.Thread(target=updater), threading.Thread(target=pauser)]
    for t in clients + admins:
        t.start()
    for t in admins:
        t.join(4 * TIMEOUT_S)
    stop.set()
    for t in clients:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in clients + admins), "deadlock: a thread did not finish"
    assert not failures, failures[:3]
    assert len(weights_of) == 7 and admin.get("/admin/state").json()["paused"] is False
    assert len(completions) > 10
    assert {c["finish_reason"] for c in completions} <= {"stop", "length", "abort"}
    _check_stretches(models, weights_of, completions)


def test_weight_sync_from_a_trainer_process_through_the_admin_routes(server, admin, models, b_checkpoint):
    """A trainer process (rank 0, `dsv4.rl.WeightSender`) sends B to the running server over gloo through
    /admin/weights/init_transfer and /update_distributed (mode "retract"), while clients generate. The
    served weights then equal a fresh load of B, tensor by tensor and in place; the version bumped by one;
    every completion's stretches are right for their version; the trainer heard the new version."""
    version = _serve_a(admin)
    before = admin.get("/admin/weights/report").json()
    stop, completions, failures = threading.Event(), [], []

    def client(seed: int):
        local = random.Random(seed)
        while not stop.is_set():
            try:
                completions.append(_complete(server.url, local.choice(PROMPTS), stream=True, max_tokens=12))
            except Exception as exc:  # reported below
                failures.append(repr(exc))

    step = {"base_version": version, "bucket_bytes": TRANSFER_BUCKET_BYTES}
    with Trainer(b_checkpoint / "model.safetensors", [step]) as trainer:
        # The HTTP call and the trainer's WeightSender block until both joined (the trainer already waits).
        joined = admin.post("/admin/weights/init_transfer", json={
            "master_address": "127.0.0.1", "master_port": trainer.port, "timeout": trainer.timeout})
        assert joined.status_code == 200, joined.text
        assert joined.json()["rank"] == 1 and joined.json()["world_size"] == 2 and joined.json()["usable"]
        trainer.next("joined")
        meta = trainer.next("meta")
        assert len(meta["buckets"]) > 2
        clients = [threading.Thread(target=client, args=(seed,)) for seed in range(2)]
        for t in clients:
            t.start()
        while not completions and not failures:
            time.sleep(0.05)
        # The trainer is sending (its `send` started as soon as it planned): the route receives it.
        r = admin.post("/admin/weights/update_distributed", json={"metadata": meta, "mode": "retract"})
        sent = trainer.next("sent")
        time.sleep(0.3)  # the clients go on under B a little
        stop.set()
        for t in clients:
            t.join(TIMEOUT_S)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["version"] == version + 1 == _version(admin) and sent["versions"] == {1: version + 1}
    assert result["buckets"] == len(meta["buckets"]) and result["bytes"] == sent["bytes"]
    report = admin.get("/admin/weights/report").json()
    fresh = LLM(str(b_checkpoint)).weight_report()["tensors"]
    assert report["ready"] and report["version"] == version + 1
    assert {k: v["checksum"] for k, v in report["tensors"].items()} == {k: v["checksum"] for k, v in fresh.items()}
    assert {k: v["data_ptr"] for k, v in report["tensors"].items()} == {
        k: v["data_ptr"] for k, v in before["tensors"].items()}
    assert not failures, failures[:3]
    assert not any(t.is_alive() for t in clients)
    assert {c["finish_reason"] for c in completions} <= {"stop", "length"}  # retract aborts nothing
    assert {v for c in completions for v, _, _ in _merged(c["stretches"], len(c["tokens"]))} == {version, version + 1}
    _check_stretches(models, {version: "A", version + 1: "B"}, completions)
    assert _complete(server.url, PROMPTS[0])["text"] == "10234"
    assert admin.get("/admin/state").json()["transfer_group"]["usable"]


def test_weight_sync_routes_refuse_bad_requests(server, admin):
    version = _serve_a(admin)
    for body, param in (({"master_port": 1}, "master_address"),
                        ({"master_address": "127.0.0.1", "master_port": 0}, "master_port"),
                        ({"master_address": "127.0.0.1", "master_port": 1, "backend": "mpi"}, "backend"),
                        ({"master_address": "127.0.0.1", "master_port": 1, "world_size": 1}, "world_size"),
                        ({"master_address": "127.0.0.1", "master_port": 1, "timeout": -1}, "timeout")):
        r = admin.post("/admin/weights/init_transfer", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    # Nobody listens on a port bound here and never listened on: a 502 naming the trainer's store, after
    # the timeout, during which the server keeps serving (the join waits on the admin thread only).
    answer: list[httpx.Response] = []
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        join = threading.Thread(target=lambda: answer.append(admin.post("/admin/weights/init_transfer", json={
            "master_address": "127.0.0.1", "master_port": reserved.getsockname()[1], "timeout": 3})))
        join.start()
        time.sleep(0.2)
        assert _complete(server.url, PROMPTS[0])["text"] == "01234"
        assert httpx.get(server.url + "/admin/state", headers=AUTH, timeout=TIMEOUT_S).json()["running"] == 0
        assert join.is_alive()  # both answered while the join was still waiting
        join.join(TIMEOUT_S)
    (r,) = answer
    assert r.status_code == 502 and "could not reach the trainer's store" in r.json()["error"]["message"]
    r = admin.post("/admin/weights/update_distributed", json={"metadata": {"update_id": "x"}})
    assert r.status_code == 409 and "init_transfer" in r.json()["error"]["message"]
    r = admin.post("/admin/weights/update_distributed", json={"metadata": [], "mode": "retract"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    r = admin.post("/admin/weights/update_shared", json={"metadata": {"update_id": "x"}, "handle": {}})
    assert r.status_code == 400 and "update" in r.json()["error"]["message"]
    assert _version(admin) == version and admin.get("/admin/state").json()["weights_ready"]


def test_reduced_load_run(server, admin):
    """benchmarks/load_server.py at 16 clients and 20 disconnecting ones, the weight reload under load with
    mode retract (the full size runs in the benchmark)."""
    spec = importlib.util.spec_from_file_location("load_server", REPO / "benchmarks" / "load_server.py")
    load_server = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("load_server", load_server)  # its dataclasses look their module up by name
    spec.loader.exec_module(load_server)
    report = asyncio.run(load_server.run_load(server.url, TOKEN, clients=16, disconnects=20, max_tokens=24,
                                              pause_mode="retract", reload_path="sorter"))
    assert report["streams"]["ok"] and report["streams"]["finish_reasons"] == {"length": 16}, report["streams"]
    update = report["update"]
    assert update["ok"], update
    assert update["finish_reasons"] == {"length": 16} and update["recomputed_choices"] == update["retracted"]
    assert update["versions_seen"] == [update["version_before"], update["version_after"]]
    assert report["disconnect"]["ok"], report["disconnect"]
