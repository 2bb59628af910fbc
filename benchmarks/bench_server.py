"""`dsv4 serve` against offline `LLM.generate`, and against `transformers serve`, in one run.

Workloads, at each --concurrency c (c prompts of the embedded sorting task, greedy, --max-tokens tokens
each with ignore_eos, so both sides generate exactly the same number of tokens):

  throughput  c concurrent non-streamed /v1/completions requests vs `LLM.generate` of the same c prompts
              in this process (same model, same thread count, never running at the same time as the
              server works). Repeated --repeats times, alternating; the ratio server / offline is the
              median of the back-to-back pairs' ratios (goal: >= 0.85).
  latency     c concurrent streaming clients: client-side time to first token and inter-token latency,
              p50 / p99 (pooled over the repeats).
  load        benchmarks/load_server.py at full size (64 streaming clients, a weight reload under load with
              pause mode retract, 100 clients that disconnect mid-stream) against the same server.
  transformers  the same streaming and non-streamed clients against `transformers serve` on the bf16 twin
              of the embedded model, where it runs (it has no ignore_eos: both servers then get the same
              requests without it and stop at the model's EOS; tokens/s from each server's usage counts).

Writes <out>/bench_server[_quick].json and .png. The client runs on the same machine as the servers and
takes CPU from them; on a contended machine every number is contended.

    python benchmarks/bench_server.py [--quick] [--threads 1] [--repeats 3] [--concurrency 1 4 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import load_server  # noqa: E402
from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.embedded import BF16_MODEL, DEFAULT_MODEL, EMBEDDED_MODELS  # noqa: E402
from server_harness import HOST, ServerProcess, free_port  # noqa: E402

FULL = {"concurrency": (1, 4, 16, 64), "repeats": 3, "max_tokens": 48, "clients": 64, "disconnects": 100}
QUICK = {"concurrency": (1, 4), "repeats": 1, "max_tokens": 8, "clients": 8, "disconnects": 8}
GOAL_RATIO = 0.85
TRANSFORMERS_START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
PROMPT_SEED = 0


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [load_server.prompt(rng) for _ in range(count)]


def offline(llm: LLM, texts: list[str], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), seconds


async def served(url: str, bodies: list[dict]) -> tuple[int, float]:
    """Every body as a concurrent non-streamed /v1/completions request; (completion tokens, seconds)."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        seconds = time.perf_counter() - start
    for r in responses:
        r.raise_for_status()
    return sum(r.json()["usage"]["completion_tokens"] for r in responses), seconds


async def streamed(url: str, bodies: list[dict]) -> list[load_server.StreamResult]:
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        results = await asyncio.gather(*(load_server.stream_completion(client, url, b) for b in bodies))
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"streaming clients failed: {errors[:3]}")
    return list(results)


def _bodies(texts: list[str], max_tokens: int, model: str | None = None, ignore_eos: bool = True) -> list[dict]:
    extra = {"ignore_eos": True} if ignore_eos else {}
    named = {"model": model} if model is not None else {}
    return [{"prompt": t, "max_tokens": max_tokens, "temperature": 0.0, **extra, **named} for t in texts]


def latency_summary(results: list[load_server.StreamResult]) -> dict:
    return {
        "ttft_s": load_server._percentiles([r.ttft_s for r in results if r.ttft_s is not None]),
        "itl_s": load_server._percentiles([x for r in results for x in r.itl_s]),
    }


def bench_dsv4(url: str, llm: LLM, concurrency: tuple[int, ...], repeats: int, max_tokens: int) -> list[dict]:
    rows = []
    for c in concurrency:
        texts = prompts(c, PROMPT_SEED + c)
        bodies = _bodies(texts, max_tokens)
        offline(llm, texts, max_tokens)  # warm-up: first-call costs on both sides
        asyncio.run(served(url, bodies))
        pairs, stream_results = [], []
        for _ in range(repeats):
            off_tokens, off_s = offline(llm, texts, max_tokens)
            srv_tokens, srv_s = asyncio.run(served(url, bodies))
            assert off_tokens == srv_tokens == c * max_tokens, (off_tokens, srv_tokens)
            pairs.append({"offline_tok_s": off_tokens / off_s, "server_tok_s": srv_tokens / srv_s,
                          "ratio": (srv_tokens / srv_s) / (off_tokens / off_s)})
            stream_results += asyncio.run(streamed(url, [{**b, "stream": True} for b in bodies]))
        ratios = [p["ratio"] for p in pairs]
        rows.append({
            "concurrency": c,
            "offline_tok_s": statistics.median(p["offline_tok_s"] for p in pairs),
            "server_tok_s": statistics.median(p["server_tok_s"] for p in pairs),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "pairs": pairs, **latency_summary(stream_results),
        })
        print(f"c={c}: server/offline {rows[-1]['ratio']:.2f} ({rows[-1]['server_tok_s']:.0f} vs "
              f"{rows[-1]['offline_tok_s']:.0f} tok/s), TTFT p50 {rows[-1]['ttft_s']['p50']}", flush=True)
    return rows


def start_transformers(threads: int) -> tuple[subprocess.Popen | None, str | None, str, Path]:
    """`transformers serve` on the bf16 twin of the embedded model, or why it does not run."""
    model = str(EMBEDDED_MODELS[BF16_MODEL][0])
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "transformers_serve.log"
    command = [str(Path(sys.executable).parent / "transformers"), "serve", model, "--device", "cpu",
               "--port", str(port), "--host", HOST]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    try:
        process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    except OSError as exc:
        return None, f"cannot start transformers serve: {exc}", model, log
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + TRANSFORMERS_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return None, f"transformers serve exited with {process.returncode}: {log.read_text()[-500:]}", model, log
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return process, None, model, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    return None, "transformers serve did not become healthy in time", model, log


def bench_transformers(dsv4_url: str, threads: int, concurrency: tuple[int, ...], max_tokens: int) -> dict:
    """Both servers, the same requests (no ignore_eos, which transformers serve refuses)."""
    process, problem, model, log = start_transformers(threads)
    if process is None:
        return {"runs": False, "reason": problem}
    url = f"http://{HOST}:{process.args[process.args.index('--port') + 1]}"
    rows = []
    try:
        for c in concurrency:
            texts = prompts(c, PROMPT_SEED + c)
            row = {"concurrency": c}
            for name, target, model_name in (("dsv4", dsv4_url, None), ("transformers", url, model)):
                bodies = _bodies(texts, max_tokens, model_name, ignore_eos=False)
                asyncio.run(served(target, bodies))  # warm-up (transformers loads the model on first use)
                tokens, seconds = asyncio.run(served(target, bodies))
                results = asyncio.run(streamed(target, [{**b, "stream": True} for b in bodies]))
                row[name] = {"tok_s": tokens / seconds, "tokens": tokens, **latency_summary(results)}
            row["ratio_dsv4_over_transformers"] = row["dsv4"]["tok_s"] / row["transformers"]["tok_s"]
            rows.append(row)
            print(f"c={c}: dsv4 / transformers serve throughput {row['ratio_dsv4_over_transformers']:.2f}", flush=True)
    except (httpx.HTTPError, RuntimeError) as exc:
        return {"runs": False, "reason": f"transformers serve failed under the benchmark: {exc}", "rows": rows,
                "log_tail": log.read_text()[-500:]}
    finally:
        process.terminate()
        process.wait(30)
    return {"runs": True, "model": BF16_MODEL, "rows": rows,
            "note": "transformers serve: default (no continuous batching); requests stop at EOS"}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["dsv4"]
    conc = [r["concurrency"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(conc, [r["server_tok_s"] for r in rows], "o-", label="dsv4 serve (HTTP)")
    ax.plot(conc, [r["offline_tok_s"] for r in rows], "s--", label="LLM.generate (offline)")
    for r in rows:
        ax.annotate(f"{r['ratio']:.2f}x", (r["concurrency"], r["server_tok_s"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="generated tok/s",
           title=f"throughput (server/offline, goal >= {GOAL_RATIO})")
    ax.legend()
    for ax, key, title in ((axes[1], "ttft_s", "time to first token"), (axes[2], "itl_s", "inter-token latency")):
        for p, style in (("p50", "o-"), ("p99", "^--")):
            ax.plot(conc, [r[key][p] for r in rows], style, label=f"dsv4 {p}")
        tf = report.get("transformers", {})
        if tf.get("runs"):
            tconc = [r["concurrency"] for r in tf["rows"]]
            ax.plot(tconc, [r["transformers"][key]["p50"] for r in tf["rows"]], "x:", label="transformers serve p50")
        ax.set(xscale="log", xlabel="concurrent streams", ylabel="seconds", title=title, ylim=(0, None))
        ax.legend()
    for ax in axes:
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
    fig.suptitle(f"dsv4 serve, {report['model']}, {report['threads']} thread(s), "
                 f"{report['max_tokens']} tokens/request (contended machine unless stated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run (no transformers serve)")
    parser.add_argument("--concurrency", type=int, nargs="+")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-plot", action="store_true", help="JSON only (no matplotlib needed)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    concurrency = tuple(args.concurrency or preset["concurrency"])
    repeats = args.repeats or preset["repeats"]
    max_tokens = args.max_tokens or preset["max_tokens"]
    torch.set_num_threads(args.threads)
    token = secrets.token_hex(16)
    models_dir = EMBEDDED_MODELS[DEFAULT_MODEL][0].parent
    log = Path(tempfile.mkdtemp()) / "dsv4_serve.log"
    server = ServerProcess(DEFAULT_MODEL, "--admin-token", token, "--weights-root", str(models_dir),
                           "--threads", str(args.threads), log_file=log)
    report = {
        "model": DEFAULT_MODEL, "threads": args.threads, "max_tokens": max_tokens, "repeats": repeats,
        "quick": args.quick, "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                         "torch": torch.__version__, "cpus": torch.get_num_threads()},
        "goal_ratio": GOAL_RATIO,
    }
    try:
        llm = LLM(DEFAULT_MODEL)
        report["dsv4"] = bench_dsv4(server.url, llm, concurrency, repeats, max_tokens)
        del llm
        report["load"] = asyncio.run(load_server.run_load(
            server.url, token, preset["clients"], preset["disconnects"], load_server.DEFAULT_MAX_TOKENS, "retract",
            DEFAULT_MODEL))
        if args.quick or args.no_transformers:
            report["transformers"] = {"runs": None, "reason": "skipped (--quick / --no-transformers)"}
        else:
            report["transformers"] = bench_transformers(server.url, args.threads, concurrency, max_tokens)
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_server_quick" if args.quick else "bench_server"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    if not args.no_plot:
        plot(report, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json{'' if args.no_plot else ' / .png'}; load test ok: {report['load']['ok']}")
    return 0 if report["load"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
