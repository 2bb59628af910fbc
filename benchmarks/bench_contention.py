"""How much dsv4 and llama.cpp slow down when another process keeps a core busy (co-running load).

Same engines, models and workloads as bench_llamacpp.py (one randomised small checkpoint, the GGUF holding
the same values, both engines on --threads threads). Each round times every workload four times: both
engines on an idle machine, then both again while --load busy-looping processes run (the order of the two
halves alternates between rounds, so a drift of the machine's speed falls on both alike). An engine's
slowdown in a round is its loaded seconds / its idle seconds; the reported slowdown is the median over
--repeats rounds (min / max: the spread). `relative` = dsv4 slowdown / llama.cpp slowdown: <= 1 means dsv4
degrades no worse than llama.cpp.

Workloads: decode (batch-1 step, median over --new-tokens steps after a --prompt-len prompt) and throughput
(--batch prompts, --new-tokens greedy tokens each, prefill included).

Writes <out>/bench_contention_<config>_t<threads>_load<N>.json and .png.
Usage: python benchmarks/bench_contention.py [--variants fp32 fp4] [--threads 2] [--load 1] [--repeats 5]
Needs the peer built (benchmarks/peer/build_llamacpp.sh), the `test` and `bench` extras.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_generate import _prompts, _timed, dsv4_decode_step, dsv4_generate  # noqa: E402
from bench_llamacpp import (  # noqa: E402
    CONFIGS,
    DEFAULT_ATTENTION,
    VARIANTS,
    LlamaDriver,
    PeerBuild,
    _background_load,
    _ctx_cells,
    add_workload_arguments,
    prepare_models,
)
from dsv4 import LLM  # noqa: E402
from dsv4.kernels import describe_backends  # noqa: E402
from report import write_report  # noqa: E402


def _summary(idle: list[float], loaded: list[float]) -> dict:
    slowdowns = [b / a for a, b in zip(idle, loaded, strict=True)]
    return {"idle_s": statistics.median(idle), "loaded_s": statistics.median(loaded),
            "slowdown": statistics.median(slowdowns), "slowdown_min": min(slowdowns), "slowdown_max": max(slowdowns)}


def _rounds(workloads: dict, load: int, repeats: int) -> dict:
    """Time every (engine, workload) callable idle and under `load` busy processes, `repeats` rounds."""
    times = {key: {"idle": [], "loaded": []} for key in workloads}
    for fn in workloads.values():
        fn()  # warm-up: kernel builds, allocator, lazy init
    for r in range(repeats):
        halves = ("idle", "loaded") if r % 2 == 0 else ("loaded", "idle")
        for half in halves:
            with _background_load(load if half == "loaded" else 0):
                for key, fn in workloads.items():
                    times[key][half].append(fn())
    return {key: _summary(t["idle"], t["loaded"]) for key, t in times.items()}


def run_variant(args, build: PeerBuild, name: str, paths: dict[str, Path]) -> dict:
    variant = VARIANTS[name]
    vocab = CONFIGS[args.config]()["vocab_size"]
    llm = LLM(paths["checkpoint"], max_num_seqs=args.batch, max_model_len=args.prompt_len + args.new_tokens + 1,
              max_num_batched_tokens=args.batch * args.prompt_len, **variant.dsv4)
    prompt = _prompts(1, args.prompt_len, vocab)[0]
    prompts = _prompts(args.batch, args.prompt_len, vocab)
    cells = _ctx_cells(args.prompt_len + args.new_tokens)
    result: dict = {"variant": name, "label": variant.label, "dsv4": variant.dsv4}
    with LlamaDriver(build, paths[variant.gguf_experts], args.threads,
                     log=args.out / f"llama_driver_contention_{name}.log") as driver:
        driver.context(1, cells, args.prompt_len, DEFAULT_ATTENTION)
        decode = _rounds({"llama": lambda: statistics.median(driver.decode_steps(prompt, args.new_tokens)),
                          "dsv4": lambda: dsv4_decode_step(llm, [prompt], args.new_tokens)},
                         args.load, args.repeats)
        driver.context(args.batch, args.batch * cells, args.batch * args.prompt_len, DEFAULT_ATTENTION)
        throughput = _rounds({"llama": lambda: driver.generate(prompts, args.new_tokens),
                              "dsv4": lambda: _timed(lambda: dsv4_generate(llm, prompts, args.new_tokens))},
                             args.load, args.repeats)
    for workload, rows in (("decode_b1", decode), (f"throughput_b{args.batch}", throughput)):
        result[workload] = {**rows, "relative": rows["dsv4"]["slowdown"] / rows["llama"]["slowdown"]}
        print(f"[{name}] {workload}: llama.cpp x{rows['llama']['slowdown']:.2f} slower under load "
              f"({rows['llama']['idle_s'] * 1e3:.2f} -> {rows['llama']['loaded_s'] * 1e3:.2f} ms), dsv4 "
              f"x{rows['dsv4']['slowdown']:.2f} ({rows['dsv4']['idle_s'] * 1e3:.2f} -> "
              f"{rows['dsv4']['loaded_s'] * 1e3:.2f} ms); relative {result[workload]['relative']:.2f}", flush=True)
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [k for k in results["variants"][0] if k.startswith(("decode", "throughput"))]
    labels, llama, dsv4, llama_err, dsv4_err = [], [], [], [[], []], [[], []]
    for v in results["variants"]:
        for w in workloads:
            labels.append(f"{v['variant']}\n{w}")
            for engine, values, err in (("llama", llama, llama_err), ("dsv4", dsv4, dsv4_err)):
                row = v[w][engine]
                values.append(row["slowdown"])
                err[0].append(row["slowdown"] - row["slowdown_min"])
                err[1].append(row["slowdown_max"] - row["slowdown"])
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(2.2 * len(labels) + 2, 4.5))
    for offset, values, err, name in ((-0.2, llama, llama_err, "llama.cpp"), (0.2, dsv4, dsv4_err, "dsv4")):
        bars = ax.bar([x + offset for x in xs], values, 0.4, yerr=err, capsize=3, label=name)
        ax.bar_label(bars, labels=[f"x{s:.2f}" for s in values], fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_ylabel("loaded / idle seconds\n(median round, bars: range)")
    ax.set_title(f"{results['config']} config, {results['threads']} threads, {results['load']} busy process(es)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, new_tokens=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--load", type=int, default=1, help="busy-looping processes in the loaded half")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=PeerBuild().workdir, help="build_llamacpp.sh's --workdir")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    build = PeerBuild(args.workdir)
    build.check()
    args.out.mkdir(parents=True, exist_ok=True)
    paths = prepare_models(build, args.config, {VARIANTS[v].gguf_experts for v in args.variants}, rebuild=False)
    results = {"config": args.config, "threads": args.threads, "load": args.load, "repeats": args.repeats,
               "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "backends": describe_backends(),
               "peer": "llama.cpp vendored by llama-cpp-python 0.3.36 (benchmarks/peer/build_llamacpp.sh)",
               "variants": [run_variant(args, build, name, paths) for name in args.variants]}
    write_report(args.out / f"bench_contention_{args.config}_t{args.threads}_load{args.load}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
