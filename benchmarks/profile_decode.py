"""Where dsv4's batch-1 decode step goes: its kernel calls one by one, the host's work around them, and aten ops.

The model is the benchmark checkpoint of bench_llamacpp.py (the small config, fp32 dense tensors, FP4
routed experts; written once under benchmarks/.peer/models), loaded with the routed experts FP4
(`--experts fp4`) or as dense fp32 stacks (`--experts dense`), eager or `--compile`. One sequence: a
--prompt-len prompt, warm-up steps, then:

  plain     --steps engine steps timed without any instrumentation (the reference step time)
  kernels   eager steps replay a recorded decode step (engine/decode_replay.py): each recorded C call timed on
            its own, summed per kernel (ms per step, calls per step, us per call). A clock read per call adds
            well under a microsecond to each. Compiled steps run as one graph (this part is skipped).
  host      the same replayed steps timed around the replay's kernel calls: the calls, the host's work around
            them (schedule, embedding row, sampling, outputs), and that host work again with the calls skipped
            (`host_warm_ms`: the same Python with its code and data still in the caches, which a real step's
            weights have just streamed through).
  ops       torch.profiler over the same steps: top-level op count per step and self CPU time per
            aten op (ctypes C kernels are not ops: their time is in "outside ops").

Writes <out>/profile_decode_<experts>[_compiled]_t<threads>.json and prints a summary.
Usage: python benchmarks/profile_decode.py [--experts fp4|dense] [--compile] [--threads 2] [--steps 16]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))

import llama_peer  # noqa: E402

from bench_llamacpp import CONFIGS, prepare_models  # noqa: E402
from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.kernels import describe_backends  # noqa: E402
from dsv4.kernels.native_calls import Replay  # noqa: E402
from report import write_report  # noqa: E402

PROMPT_SEED = 1
TOP_OPS = 15
# Timed runs of --steps steps one request makes: plain, kernels, host (real and skipped calls), ops.
STEP_RUNS = 5


def _prompt(length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(2, vocab, (length,), generator=g).tolist()


def _run_steps(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def _start(llm: LLM, prompt: list[int], steps: int, warmup: int) -> None:
    """A fresh request with room for `warmup` + STEP_RUNS x `steps` decode steps; prefill and warm-up run here."""
    engine = llm.engine
    engine.add_request(f"profile-{time.monotonic_ns()}", prompt,
                       SamplingParams(max_tokens=warmup + STEP_RUNS * steps + 2, ignore_eos=True))
    engine.step()  # prefill + first token
    _run_steps(engine, warmup)


def profile_decode(args) -> dict:
    torch.set_num_threads(args.threads)
    config = CONFIGS["small"]()
    checkpoint = prepare_models(llama_peer.PeerBuild(), "small", set(), rebuild=False)["checkpoint"]
    llm = LLM(checkpoint, dtype="float32", expert_dtype=args.experts, max_num_seqs=1,
              max_model_len=args.prompt_len + args.warmup + STEP_RUNS * args.steps + 8, compile=args.compile)
    prompt = _prompt(args.prompt_len, config["vocab_size"])
    _start(llm, prompt, args.steps, args.warmup)
    engine = llm.engine
    plain = _run_steps(engine, args.steps)
    result: dict = {"experts": args.experts, "compile": args.compile, "threads": args.threads,
                    "steps": args.steps, "prompt_len": args.prompt_len, "torch": torch.__version__,
                    "backends": describe_backends(), "plain_step_ms": 1e3 * statistics.median(plain)}

    if not args.compile:
        result["kernels"] = _kernel_split(engine, args.steps)
        result["host"] = _host_split(engine, args.steps)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = _run_steps(engine, args.steps)
    events = prof.key_averages()
    top_level = [e for e in prof.events() if e.cpu_parent is None]
    op_s = sum(e.cpu_time_total for e in top_level) / 1e6
    by_self = sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    result["ops"] = {
        "profiled_step_ms": 1e3 * statistics.median(profiled),
        "top_level_ops_per_step": len(top_level) / args.steps,
        "inside_top_level_ops_ms_per_step": 1e3 * op_s / args.steps,
        "outside_ops_ms_per_step": 1e3 * (sum(profiled) - op_s) / args.steps,
        "self_cpu_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in by_self},
        "calls_per_step": {e.key: e.count / args.steps for e in by_self},
    }
    return result


def _kernel_split(engine, steps: int) -> dict:
    """Replayed steps whose recorded calls are timed one by one (`Replay.run_call`): per kernel, ms per step, calls
    per step and us per call, the costliest first; and the replayed step's median."""
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)

    def timed_calls(replay: Replay, stop: int | None = None) -> None:
        for index, kernel in enumerate(replay.kernels[:stop]):
            start = time.perf_counter()
            replay.run_call(index)
            seconds[kernel] += time.perf_counter() - start
            calls[kernel] += 1

    replayed_before = engine.runner.replay.replayed_steps
    with mock.patch.object(Replay, "run", timed_calls):
        timed = _run_steps(engine, steps)
    if engine.runner.replay.replayed_steps - replayed_before != steps:
        raise RuntimeError("the kernel split needs every timed step replayed (see DecodeReplay.refused)")
    return {"step_ms": 1e3 * statistics.median(timed),
            "per_kernel": {kernel: {"ms_per_step": 1e3 * seconds[kernel] / steps,
                                    "calls_per_step": calls[kernel] / steps,
                                    "us_per_call": 1e6 * seconds[kernel] / calls[kernel]}
                           for kernel in sorted(seconds, key=lambda k: -seconds[k])}}


def _host_split(engine, steps: int) -> dict:
    """Replayed steps timed around `Replay.run` (the recorded kernel calls), then steps whose calls are skipped
    (the logits of the last real step are sampled again, their cache rows stay unwritten: only the timing of the
    steps after them is used): what the host's work costs with warm caches."""
    real_run = Replay.run
    in_calls = [0.0]

    def timed_run(replay: Replay, stop: int | None = None) -> None:
        start = time.perf_counter()
        real_run(replay, stop)
        in_calls[0] += time.perf_counter() - start

    replayed_before = engine.runner.replay.replayed_steps
    with mock.patch.object(Replay, "run", timed_run):
        real = sum(_run_steps(engine, steps))
    with mock.patch.object(Replay, "run", lambda replay, stop=None: None):
        skipped = sum(_run_steps(engine, steps))
    if engine.runner.replay.replayed_steps - replayed_before != 2 * steps:
        raise RuntimeError("the host split needs every timed step replayed (see DecodeReplay.refused)")
    return {"step_ms": 1e3 * real / steps, "replay_calls_ms": 1e3 * in_calls[0] / steps,
            "host_ms": 1e3 * (real - in_calls[0]) / steps, "host_warm_ms": 1e3 * skipped / steps}


def _print(result: dict) -> None:
    mode = "compiled" if result["compile"] else "eager"
    print(f"experts {result['experts']}, {mode}, {result['threads']} thread(s): "
          f"plain step {result['plain_step_ms']:.2f} ms")
    if "kernels" in result:
        k = result["kernels"]
        print(f"  kernels (replayed step {k['step_ms']:.2f} ms, each call timed):")
        for kernel, row in k["per_kernel"].items():
            print(f"    {kernel:45s} {row['ms_per_step']:7.3f} ms  x{row['calls_per_step']:.0f}  "
                  f"{row['us_per_call']:7.1f} us a call")
    if "host" in result:
        h = result["host"]
        print(f"  host (replayed step {h['step_ms']:.2f} ms): kernel calls {h['replay_calls_ms']:.3f} ms, host work "
              f"around them {h['host_ms']:.3f} ms, the same host work with the calls skipped "
              f"{h['host_warm_ms']:.3f} ms")
    o = result["ops"]
    print(f"  ops (profiled step {o['profiled_step_ms']:.2f} ms; {o['top_level_ops_per_step']:.0f} top-level ops, "
          f"{o['inside_top_level_ops_ms_per_step']:.2f} ms inside them, {o['outside_ops_ms_per_step']:.2f} outside):")
    for key, ms in o["self_cpu_ms_per_step"].items():
        print(f"    {key:45s} {ms:7.3f} ms  x{o['calls_per_step'][key]:.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", choices=("fp4", "dense"), default="fp4")
    parser.add_argument("--compile", action="store_true", help="LLM(compile=True)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    result = profile_decode(args)
    _print(result)
    write_report(args.out / f"profile_decode_{args.experts}{'_compiled' if args.compile else ''}_t{args.threads}",
                 result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
