"""dsv4 against another checkout of itself (an older commit's tree): bench_generate's dsv4 workloads, paired.

Each version runs in its own warm worker process, whose `dsv4` and `tests/reference.py` come from its
tree (PYTHONPATH=<tree>/src), on the same randomised checkpoint (written once by the new tree). The
driver alternates the two workers workload by workload, after one warm-up each (kernel builds,
compilation, allocator), and takes the median of the back-to-back pairs' ratios (`paired.py`; a
neighbour that slows the shared machine for a while slows both runs of a pair alike). With --rounds R
both workers are started afresh R times and the rounds' pairs pooled: a process keeps its memory layout
(where the allocator and the loader placed its tensors and code) for its whole life, which can shift all
of one worker's times by ~1% alike, so pairs from one pair of processes share that offset.

Workloads (bench_generate's), at each --batch size:
  throughput  greedy generation of --new-tokens tokens after --prompt-len random prompts, prefill
              included: generated tok/s
  step        decode step latency with that many running sequences (median engine step over
              --new-tokens steps after the prompts' prefill): bench_generate's batch-1 decode workload,
              and its roofline steps at the larger sizes
A ratio is old seconds / new seconds: > 1, the new tree is faster.

Writes <out>/bench_versions_<config>[_compiled]_t<threads>.json and .png and prints a summary.
Usage: python benchmarks/bench_versions.py --old /path/to/old/checkout [--config tiny] [--compile]
                                           [--batch 1 16 64] [--workloads throughput step]
                                           [--threads 1] [--repeats 5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from paired import paired, pooled  # noqa: E402
from report import write_report  # noqa: E402

MODEL_SEED = 0
WORKLOADS = ("throughput", "step")


def worker(args) -> int:
    """Serve workloads on stdin ("throughput <batch>" or "step <batch>") with seconds on stdout, one per line."""
    import torch

    sys.path.insert(0, str(args.tree / "tests"))
    sys.path.insert(0, str(args.tree / "benchmarks"))
    import bench_generate as bench  # this tree's workloads and prompts
    from dsv4 import LLM

    torch.set_num_threads(args.threads)
    vocab = json.loads((args.checkpoint / "config.json").read_text())["vocab_size"]
    llm = LLM(str(args.checkpoint), dtype="float32", max_num_seqs=max(args.batch),
              max_model_len=args.prompt_len + args.new_tokens + 1,
              max_num_batched_tokens=max(args.batch) * args.prompt_len, compile=args.compile)
    print("ready", flush=True)
    for line in sys.stdin:
        kind, batch = line.split()
        prompts = bench._prompts(int(batch), args.prompt_len, vocab)
        if kind == "throughput":
            seconds = bench._timed(lambda p=prompts: bench.dsv4_generate(llm, p, args.new_tokens))
        else:
            seconds = bench.dsv4_decode_step(llm, prompts, args.new_tokens)
        print(seconds, flush=True)
    return 0


class Worker:
    """One version's worker process (its tree's dsv4 first on the path)."""

    def __init__(self, tree: Path, checkpoint: Path, args):
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree),
               "--checkpoint", str(checkpoint), "--config", args.config, "--threads", str(args.threads),
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--batch", *map(str, args.batch), *(["--compile"] if args.compile else [])]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._expect("ready")

    def _expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()
        if line != word:
            raise RuntimeError(f"worker said {line!r}, expected {word!r} (exit code {self.proc.poll()})")

    def seconds(self, request: str) -> float:
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker ended during {request!r} (exit code {self.proc.wait()})")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run(args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import bench_generate
    import reference as ref

    results: dict = {"config": args.config, "compile": args.compile, "threads": args.threads,
                     "repeats": args.repeats, "rounds": args.rounds, "old": str(args.old),
                     "old_commit": _commit(args.old),
                     "new_commit": _commit(ROOT), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "ratio": "old seconds / new seconds (> 1: new faster)"}
    with tempfile.TemporaryDirectory() as tmp:
        config = bench_generate.CONFIGS[args.config]()
        ref.save_hf_checkpoint(ref.build_reference_model(config, MODEL_SEED), tmp)
        runs: dict[tuple[str, int], list] = {(kind, batch): [] for kind in args.workloads for batch in args.batch}
        for round_index in range(args.rounds):
            old, new = Worker(args.old, Path(tmp), args), Worker(ROOT, Path(tmp), args)
            try:
                for kind, batch in runs:
                    request = f"{kind} {batch}"
                    t = paired(lambda r=request, w=old: w.seconds(r), lambda r=request, w=new: w.seconds(r),
                               args.repeats)
                    runs[kind, batch].append(t)
                    print(f"round {round_index + 1}/{args.rounds} {kind} b={batch}: x{t.ratio:.3f} "
                          f"[{min(t.ratios):.3f}, {max(t.ratios):.3f}]", flush=True)
            finally:
                old.close()
                new.close()
    for (kind, batch), rounds in runs.items():
        t = pooled(rounds)
        row = {"batch": batch, **_figures(kind, batch, t, args.new_tokens), "pairs": list(t.ratios),
               "round_ratios": [r.ratio for r in rounds], **t.fields()}
        results.setdefault(kind, []).append(row)
        shown = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.startswith(("old", "new")))
        print(f"{kind} b={batch}: {shown}, x{t.ratio:.3f} [{min(t.ratios):.3f}, {max(t.ratios):.3f}]", flush=True)
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in WORKLOADS if k in results]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = results[kind]
        ratios = [r["ratio"] for r in rows]
        spread = [[r["ratio"] - r["ratio_min"] for r in rows], [r["ratio_max"] - r["ratio"] for r in rows]]
        bars = ax.bar([f"b={r['batch']}" for r in rows], ratios, yerr=spread, capsize=4, color="tab:blue")
        ax.bar_label(bars, labels=[f"x{r:.2f}" for r in ratios])
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_ylabel("old seconds / new seconds\n(median pair, bars: range)")
        ax.set_title(f"{kind}: {results['config']}{', compiled' if results['compile'] else ', eager'}, "
                     f"{results['threads']} thread(s)\n{results['old_commit']} -> {results['new_commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _figures(kind: str, batch: int, t, new_tokens: int) -> dict:
    """A workload's figures from its paired medians: tok/s for throughput, ms per step for step."""
    if kind == "throughput":
        return {"old_tok_s": batch * new_tokens / t.peer_s, "new_tok_s": batch * new_tokens / t.ds_s}
    return {"old_ms": t.peer_s * 1e3, "new_ms": t.ds_s * 1e3}


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="the other checkout's root (its src/ and tests/)")
    parser.add_argument("--config", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both workers")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5, help="timed pairs per round")
    parser.add_argument("--rounds", type=int, default=1, help="fresh pairs of worker processes, pairs pooled")
    parser.add_argument("--compile", action="store_true", help="decode steps compiled (LLM(compile=True))")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.old is None:
        parser.error("--old is required")
    results = run(args)
    write_report(args.out / f"bench_versions_{args.config}{'_compiled' if args.compile else ''}_t{args.threads}",
                 results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
