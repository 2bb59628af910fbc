"""Load test of `dsv4 serve` over loopback: bounded, self-stopping, and fails loudly.

Three phases against one server (started here on a free loopback port, or a running one with --url):

  streams     --clients concurrent streaming clients; every one must end with a finish_reason of
              "stop" or "length", a usage chunk and [DONE], and no error
  update      the same number of clients in two waves: once the first streams, an admin pauses generation
              (--pause-mode), the second wave arrives, the weights are reloaded from the server's
              --weights-root, and generation resumes. No client may fail (nor be aborted unless the mode is
              abort); each completion's weights_versions tile its tokens; the first wave runs on the old
              weights, except that with retract exactly the sequences the pause retracted go on under the
              new ones (two stretches); the second wave runs on the new weights
  disconnect  --disconnects clients that leave after their first event; afterwards no cache slot and no
              running request may remain (read from /metrics)

Prints a JSON summary (client-side TTFT / inter-token latency percentiles too) and exits non-zero if a
check failed. Only loopback addresses are accepted as targets.

    python benchmarks/load_server.py                      # launches the embedded model, full size, retract
    python benchmarks/load_server.py --clients 16 --disconnects 20 --pause-mode wait
    python benchmarks/load_server.py --url http://127.0.0.1:8000 --admin-token T --reload-path dsv4-sort
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import random
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the server-process harness lives with the tests

from dsv4.embedded import DEFAULT_MODEL, EMBEDDED_MODELS  # noqa: E402
from server_harness import ServerProcess, metric, wait_for  # noqa: E402

DEFAULT_CLIENTS = 64
DEFAULT_DISCONNECTS = 100
DEFAULT_MAX_TOKENS = 32
DEFAULT_TIMEOUT_S = 600.0
CLIENT_TIMEOUT_S = 300.0  # one client's whole request
SETTLE_TIMEOUT_S = 60.0  # for the server's gauges to show every slot free after the disconnects
DIGITS_PER_PROMPT = (3, 9)  # the embedded model's task: sort a few digits
OK_FINISH = {"stop", "length"}
PERCENTILES = (50, 99)


@dataclass
class StreamResult:
    """What one streaming client saw."""

    error: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    stretches: list[list[dict]] = field(default_factory=list)  # per choice: its weights_versions, in order
    usage: dict | None = None
    done: bool = False

    @property
    def versions_per_choice(self) -> list[list[int]]:
        """Per choice, the versions of its stretches in order (runs of one version joined)."""
        return [[v for v, _ in itertools.groupby(s["version"] for s in choice)] for choice in self.stretches]

    @property
    def stretches_tile(self) -> bool:
        """Whether each choice's stretches cover its tokens back to back, with versions that only grow."""
        for choice in self.stretches:
            ends = [0] + [s["end"] for s in choice[:-1]]
            if [s["start"] for s in choice] != ends or any(s["end"] <= s["start"] for s in choice):
                return False
            if any(a["version"] > b["version"] for a, b in itertools.pairwise(choice)):
                return False
        return True


def prompt(rng: random.Random) -> str:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(*DIGITS_PER_PROMPT)))
    return f"sort {digits}="


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise SystemExit(f"load_server: refusing {url}: only loopback targets are allowed")


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event | None = None,
                            leave_after_events: int | None = None) -> StreamResult:
    """One streaming /v1/completions request, timed at the client. `leave_after_events`: disconnect after
    that many events (a client that goes away). `started` is set at the first token."""
    result = StreamResult()
    begin = last = time.perf_counter()
    events = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    result.done = True
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = payload["error"]["message"]
                    break
                if payload.get("usage"):
                    result.usage = payload["usage"]
                now = time.perf_counter()
                new = 0
                for choice in payload["choices"]:
                    while len(result.stretches) <= choice["index"]:
                        result.stretches.append([])
                    stretches = choice.get("weights_versions")
                    if stretches is not None:
                        result.stretches[choice["index"]].extend(stretches)
                        new += sum(s["end"] - s["start"] for s in stretches)
                    else:  # a server without per-token versions (transformers serve): a chunk of text per token
                        new += bool(choice.get("text") or (choice.get("delta") or {}).get("content"))
                    if choice.get("finish_reason"):
                        result.finish_reasons.append(choice["finish_reason"])
                if new:
                    if result.ttft_s is None:
                        result.ttft_s = now - begin
                        if started is not None:
                            started.set()
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.tokens += new
                events += 1
                if leave_after_events is not None and events >= leave_after_events:
                    break
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    values = sorted(values)
    return {f"p{p}": values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))] for p in PERCENTILES}


def summarize(results: list[StreamResult], seconds: float) -> dict:
    tokens = sum(r.tokens for r in results)
    return {
        "clients": len(results),
        "errors": [r.error for r in results if r.error],
        "finish_reasons": dict(sorted({f: sum(r.finish_reasons.count(f) for r in results)
                                       for r in results for f in r.finish_reasons}.items())),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "ttft_s": _percentiles([r.ttft_s for r in results if r.ttft_s is not None]),
        "itl_s": _percentiles([x for r in results for x in r.itl_s]),
    }


def _body(rng: random.Random, max_tokens: int) -> dict:
    return {"prompt": prompt(rng), "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


def _completed(r: StreamResult, ok_finish: set[str]) -> bool:
    return r.error is None and r.done and r.usage is not None and bool(r.finish_reasons) and all(
        f in ok_finish for f in r.finish_reasons)


async def phase_streams(client: httpx.AsyncClient, url: str, clients: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_completion(client, url, _body(rng, max_tokens)) for _ in range(clients)))
    summary = summarize(results, time.perf_counter() - start)
    summary["ok"] = all(_completed(r, OK_FINISH) for r in results)
    return summary


async def phase_update(client: httpx.AsyncClient, url: str, admin: httpx.AsyncClient, clients: int,
                       max_tokens: int, mode: str, reload_path: str, seed: int) -> dict:
    """Wave 1 streams; once every client of it has a token, pause(mode), then wave 2 arrives (it waits for
    the resume), the weights are reloaded and generation resumes. What each wave may see:

      wave 1   requests in flight at the pause: "abort" ends them, "wait" lets them finish on the old
               weights, "retract" preempts them and they go on under the new ones (then exactly the
               sequences the pause retracted have two stretches, old version then new);
      wave 2   queued during the pause: every token on the new weights.
    """
    rng = random.Random(seed)
    version_before = (await admin.get("/admin/state")).json()["weights_version"]
    first_wave = clients // 2
    started = [asyncio.Event() for _ in range(first_wave)]
    start = time.perf_counter()
    wave1 = [asyncio.ensure_future(stream_completion(client, url, _body(rng, max_tokens), started[i]))
             for i in range(first_wave)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), CLIENT_TIMEOUT_S)

    async def admin_call(path: str, body: dict | None) -> dict:
        r = await admin.post(path, json=body)
        return {"route": path, "status": r.status_code, "body": r.json()}

    answers = [await admin_call("/admin/pause", {"mode": mode})]
    retracted = answers[0]["body"].get("waiting", 0) if mode == "retract" else 0  # wave 2 is not sent yet
    wave2 = [asyncio.ensure_future(stream_completion(client, url, _body(rng, max_tokens)))
             for _ in range(clients - first_wave)]
    answers.append(await admin_call("/admin/weights/reload", {"path": reload_path, "mode": mode}))
    answers.append(await admin_call("/admin/resume", None))
    results1, results2 = await asyncio.gather(asyncio.gather(*wave1), asyncio.gather(*wave2))
    results = [*results1, *results2]
    summary = summarize(results, time.perf_counter() - start)
    version_after = (await admin.get("/admin/state")).json()["weights_version"]
    ok_finish = OK_FINISH | ({"abort"} if mode == "abort" else set())
    two_versions = [[version_before, version_after]]
    recomputed = sum(vs in two_versions for r in results1 for vs in r.versions_per_choice)
    summary.update({
        "pause_mode": mode, "admin": answers, "version_before": version_before, "version_after": version_after,
        "versions_seen": sorted({v for r in results for vs in r.versions_per_choice for v in vs}),
        "retracted": retracted, "recomputed_choices": recomputed,
        "stretches_tile": all(r.stretches_tile for r in results),
        "wave2_on_new_weights": all(vs == [version_after] for r in results2 for vs in r.versions_per_choice),
    })
    wave1_ok = all(vs in ([[version_before]] + (two_versions if mode == "retract" else []))
                   for r in results1 for vs in r.versions_per_choice if vs)
    summary["ok"] = (all(_completed(r, ok_finish) for r in results) and all(a["status"] == 200 for a in answers)
                     and version_after == version_before + 1 and summary["stretches_tile"] and wave1_ok
                     and summary["wave2_on_new_weights"] and recomputed == retracted)
    return summary


async def phase_disconnect(client: httpx.AsyncClient, url: str, clients: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_completion(client, url, _body(rng, max_tokens), leave_after_events=1)
                                     for _ in range(clients)))

    def settled():
        return metric(url, "cache_slots_used") == 0 and metric(url, "num_requests_running") == 0

    try:
        await asyncio.to_thread(wait_for, settled, SETTLE_TIMEOUT_S, "every slot to be free")
        leaked = False
    except AssertionError:
        leaked = True
    return {
        "clients": clients, "errors": [r.error for r in results if r.error], "seconds": time.perf_counter() - start,
        "slots_used_after": metric(url, "cache_slots_used"),
        "running_after": metric(url, "num_requests_running"),
        "ok": not leaked and not any(r.error for r in results),
    }


async def run_load(url: str, admin_token: str | None, clients: int, disconnects: int, max_tokens: int,
                   pause_mode: str, reload_path: str | None, seed: int = 0) -> dict:
    """All phases in order; the update phase runs when an admin token and a reload path are given."""
    check_loopback(url)
    limits = httpx.Limits(max_connections=max(clients, disconnects) + 8)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S)
    report: dict = {"url": url, "max_tokens": max_tokens}
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        report["streams"] = await phase_streams(client, url, clients, max_tokens, seed)
        if admin_token and reload_path:
            headers = {"Authorization": f"Bearer {admin_token}"}
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as admin:
                report["update"] = await phase_update(client, url, admin, clients, max_tokens, pause_mode,
                                                      reload_path, seed + 1)
        report["disconnect"] = await phase_disconnect(client, url, disconnects, max_tokens, seed + 2)
    report["ok"] = all(report[p]["ok"] for p in ("streams", "update", "disconnect") if p in report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: launch the embedded model on loopback)")
    parser.add_argument("--admin-token", help="the running server's admin token (enables the update phase)")
    parser.add_argument("--reload-path", help="checkpoint under the running server's --weights-root")
    parser.add_argument("--clients", type=int, default=DEFAULT_CLIENTS)
    parser.add_argument("--disconnects", type=int, default=DEFAULT_DISCONNECTS)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--pause-mode", choices=("abort", "wait", "retract"), default="retract")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="the whole run's deadline (s)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    server = None
    url, token, reload_path = args.url, args.admin_token, args.reload_path
    if url is None:
        token = secrets.token_hex(16)
        models_dir = EMBEDDED_MODELS[DEFAULT_MODEL][0].parent
        server = ServerProcess(DEFAULT_MODEL, "--admin-token", token, "--weights-root", str(models_dir),
                               log_file=Path(tempfile.mkdtemp()) / "server.log")
        url, reload_path = server.url, DEFAULT_MODEL
    try:
        report = asyncio.run(asyncio.wait_for(
            run_load(url, token, args.clients, args.disconnects, args.max_tokens, args.pause_mode, reload_path),
            args.timeout))
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
