"""The admin routes of a real `dsv4 serve` process (httpx): auth, pause / resume, weight update sessions over
HTTP (safetensors buckets), reload under --weights-root, the weight report, pause and updates driven
concurrently with generation, and a reduced run of benchmarks/load_server.py.

The weights used: the embedded sorting model ("A") and the same model with the digits 0 and 1 exchanged
in its embedding and head ("B": it sorts as before with the two digits' names swapped, so "sort 31402="
gives "10234"). Expected answers come from both loaded in this process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save as save_safetensors

from dsv4 import LLM, SamplingParams
from server_harness import REPO, ServerProcess, sort_checkpoint_with_chat_template

TOKEN = "admin-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BUCKET_BYTES = 1 << 20
TIMEOUT_S = 60.0
DIGIT_ZERO, DIGIT_ONE = 3, 4  # token ids of "0" and "1"
PROMPTS = ("sort 31402=", "sort 9081726=", "sort 55512=", "sort 7=", "sort 86420135=", "sort 1100=")


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
    """One greedy completion: text, finish_reason, weights_versions, weights_version."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
        r.raise_for_status()
        out = r.json()
        c = out["choices"][0]
        return {"text": c["text"], "finish_reason": c["finish_reason"], "stretches": c["weights_versions"],
                "version": out["weights_version"]}
    text, finish, stretches, versions = "", None, [], set()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            versions.add(chunk["weights_version"])
            for c in chunk["choices"]:
                text += c["text"]
                stretches += c["weights_versions"]
                finish = c["finish_reason"] or finish
    return {"text": text, "finish_reason": finish, "stretches": stretches, "version": max(versions)}


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
    assert "long" not in results and admin.get("/admin/state").json()["held"] == 1
    assert admin.post("/admin/resume").json()["paused"] is False
    waiting.join(TIMEOUT_S)
    assert results["long"]["finish_reason"] == "stop" and results["long"]["text"] == "01234568"
    # retract is refused by name until the engine can preempt.
    r = admin.post("/admin/pause", json={"mode": "retract"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert admin.get("/admin/state").json()["paused"] is False


def test_pause_and_updates_racing_generation_never_mix_versions(server, admin, models, answers):
    """Clients stream and poll while one admin thread runs weight sessions (A <-> B, random pause modes)
    and another pauses and resumes at random. Nothing deadlocks (everything ends within the timeouts),
    every completion runs on one version, and its text is that version's answer (a prefix of it if it
    was aborted)."""
    _, _, weights_a, weights_b = models
    assert admin.post("/admin/weights/reload", json={"path": "sorter"}).status_code == 200
    weights_of = {admin.get("/admin/state").json()["weights_version"]: "A"}
    rng = random.Random(0)
    stop = threading.Event()
    completions, failures = [], []

    def client(seed: int):
        local = random.Random(seed)
        while not stop.is_set():
            prompt = local.choice(PROMPTS)
            try:
                completions.append((prompt, _complete(server.url, prompt, stream=local.random() < 0.5)))
            except Exception as exc:  # reported below; the test must see every failure
                failures.append(repr(exc))

    def updater():
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT_S) as own:
            for i in range(6):
                name = "B" if i % 2 == 0 else "A"
                version = _update(own, weights_b if name == "B" else weights_a, mode=rng.choice(["wait", "abort"]))
                weights_of[version] = name

    def pauser():
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT_S) as own:
            for _ in range(6):
                assert own.post("/admin/pause", json={"mode": rng.choice(["wait", "abort"])}).status_code == 200
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
    for prompt, got in completions:
        versions = {s["version"] for s in got["stretches"]}
        assert len(versions) <= 1, got  # one version per completion
        version = versions.pop() if versions else got["version"]
        expected = answers[weights_of[version]][prompt]
        if got["finish_reason"] == "abort":
            assert expected.startswith(got["text"]), (prompt, got, expected)
        else:
            assert got["text"] == expected, (prompt, got, expected)


def test_reduced_load_run(server, admin):
    """benchmarks/load_server.py at 16 clients and 20 disconnecting ones (the full size runs in the benchmark)."""
    spec = importlib.util.spec_from_file_location("load_server", REPO / "benchmarks" / "load_server.py")
    load_server = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("load_server", load_server)  # its dataclasses look their module up by name
    spec.loader.exec_module(load_server)
    report = asyncio.run(load_server.run_load(server.url, TOKEN, clients=16, disconnects=20, max_tokens=24,
                                              pause_mode="wait", reload_path="sorter"))
    assert report["streams"]["ok"] and report["streams"]["finish_reasons"] == {"length": 16}, report["streams"]
    assert report["update"]["ok"] and report["update"]["versions_seen"] == [report["update"]["version_before"],
                                                                           report["update"]["version_after"]]
    assert report["disconnect"]["ok"], report["disconnect"]
