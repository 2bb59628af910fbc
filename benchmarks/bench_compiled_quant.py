"""The compiled decode step (`LLM(compile=True)`) with FP4 routed experts against the eager engine, paired in one
process; its warm-up with cold and with warm caches; and how much of a generation mixed prefill+decode steps take.

The model: bench_llamacpp.py's, the ~77M small config (tests/reference.py, index_head_dim 64; --config quick for a
smoke run), fp32 dense tensors, FP4 routed experts resident as FP4 (benchmarks/peer/llama_peer.py's checkpoint).

Workloads:
  step        engine step latency with --batch running sequences (median over --new-tokens steps after the
              prompts' prefill; bench_generate's decode workload): eager and compiled engines alternated
              --repeats times after one warm-up each, ratio = eager seconds / compiled seconds (> 1: compiled
              faster; median of the back-to-back pairs, paired.py)
  warmup      seconds from a fresh process's `LLM(...)` until it has served a batch-1 and a --batch request (the
              compiled step's two graphs: batch 1 and the symbolic batch range), in a child process: "cold" with
              empty torch inductor and dsv4 kernel caches (a fresh machine), then "warm" with the caches the
              cold run left; the eager engine the same way for reference
  mixed       one --mixed-batch x --prompt-len generation under the default step budget (LLM's
              max_num_batched_tokens default): which steps mix prompt chunks with decode rows (the compiled
              step serves pure-decode steps only; a mixed step runs eager), their count and share of the
              run's time, and an upper bound of what compiling their decode rows could save (each mixed
              step's decode rows at the eager-minus-compiled step time of that batch)

Threads: --threads torch intra-op threads (the few-row kernels' pool follows torch's count).
Writes <out>/bench_compiled_quant_<config>_t<threads>.json. Usage:
  python benchmarks/bench_compiled_quant.py [--config small] [--threads 1] [--batch 1 16] [--repeats 5] [--skip-warmup]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))

from llama_peer import write_bench_checkpoint  # noqa: E402

from bench_generate import _prompts, dsv4_decode_step, dsv4_generate  # noqa: E402
from bench_llamacpp import CONFIGS  # noqa: E402
from dsv4 import LLM  # noqa: E402
from dsv4.kernels import describe_backends  # noqa: E402
from paired import paired  # noqa: E402
from report import write_report  # noqa: E402

MODEL_SEED = 0
WARMUP_NEW_TOKENS = 2  # the first decode step after the prefill is the one that compiles


def _engine(checkpoint: Path, args, compile: bool, budget: int | None = None) -> LLM:
    return LLM(str(checkpoint), dtype="float32", max_num_seqs=max(max(args.batch), args.mixed_batch),
               max_model_len=args.prompt_len + args.new_tokens + 1, max_num_batched_tokens=budget, compile=compile)


def warmup_child(args) -> int:
    """In a fresh process: seconds until the engine has served a batch-1 request and a --batch one."""
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = _engine(args.checkpoint, args, args.compile)
    loaded = time.perf_counter()
    vocab = llm.config.vocab_size
    for batch in (1, max(args.batch)):
        dsv4_generate(llm, _prompts(batch, args.prompt_len, vocab), WARMUP_NEW_TOKENS)
    done = time.perf_counter()
    print(json.dumps({"load_s": loaded - start, "first_requests_s": done - loaded, "total_s": done - start}))
    return 0


def warmup(checkpoint: Path, args, compile: bool, caches: Path) -> dict:
    """A child process's warm-up with the inductor and kernel caches under `caches` (as they are)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "DSV4_KERNEL_CACHE": str(caches / "kernels"), "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--warmup-child", "--checkpoint", str(checkpoint),
           "--threads", str(args.threads), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--batch", *map(str, args.batch), *(["--compile"] if compile else [])]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return {**figures, "process_s": time.perf_counter() - start}


def _step_kinds(llm: LLM) -> list[tuple[str, int, float]]:
    """Wraps the engine's runner: records (kind, decode rows, seconds) of every step it executes, kind one of
    "decode" (every chunk one token: the compiled step serves it), "prefill" (no one-token chunk), "mixed"."""
    runner, record = llm.engine.runner, []
    execute = runner.execute

    def timed(chunks, *a, **kw):
        start = time.perf_counter()
        result = execute(chunks, *a, **kw)
        seconds = time.perf_counter() - start
        decode = sum(len(c.token_ids) == 1 for c in chunks)
        kind = "decode" if decode == len(chunks) else "prefill" if decode == 0 else "mixed"
        record.append((kind, decode, seconds))
        return result

    runner.execute = timed
    return record


def mixed(checkpoint: Path, args, eager: LLM, compiled: LLM) -> dict:
    """Step kinds of one generation under the default step budget, and their time."""
    llm = _engine(checkpoint, args, compile=False)  # the default budget, eager as a mixed step runs
    record = _step_kinds(llm)
    prompts = _prompts(args.mixed_batch, args.prompt_len, llm.config.vocab_size)
    dsv4_generate(llm, prompts, args.new_tokens)
    total = sum(s for _, _, s in record)
    mixed_steps = [(rows, s) for kind, rows, s in record if kind == "mixed"]
    # What compiling a mixed step's decode rows could save at most: a pure-decode step of that many rows,
    # eager minus compiled (their prompt chunks run the prefill path either way).
    bound = 0.0
    for rows, _ in mixed_steps:
        sub = prompts[:rows]
        saving = dsv4_decode_step(eager, sub, args.new_tokens) - dsv4_decode_step(compiled, sub, args.new_tokens)
        bound += max(0.0, saving)
    return {"batch": args.mixed_batch, "budget": llm.limits.max_num_batched_tokens, "steps": len(record),
            "mixed_steps": len(mixed_steps), "mixed_decode_rows": [rows for rows, _ in mixed_steps],
            "mixed_s": sum(s for _, s in mixed_steps), "run_s": total,
            "mixed_time_share": sum(s for _, s in mixed_steps) / total,
            "saving_bound_s": bound, "saving_bound_share": bound / total,
            "kinds": {k: sum(kind == k for kind, _, _ in record) for k in ("prefill", "mixed", "decode")}}


def run(args, stem: Path) -> dict:
    """Every workload; the results so far are written to `stem` after each."""
    torch.set_num_threads(args.threads)
    results: dict = {"config": args.config, "experts": "fp4", "dtype": "float32", "threads": args.threads,
                     "repeats": args.repeats, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                     "load_average_start": os.getloadavg(), "kernels": describe_backends(),
                     "ratio": "eager seconds / compiled seconds (> 1: compiled faster)"}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        write_bench_checkpoint(checkpoint, CONFIGS[args.config](), MODEL_SEED)
        if not args.skip_warmup:
            results["warmup"] = {}
            for name, compile in (("compiled", True), ("eager", False)):
                caches = Path(tmp) / f"caches_{name}"
                results["warmup"][name] = {"cold": warmup(checkpoint, args, compile, caches),
                                           "warm": warmup(checkpoint, args, compile, caches)}
                print(f"warmup {name}: {results['warmup'][name]}", flush=True)
                write_report(stem, results)  # so far
            # This process compiles from the cache the warm-up left (as a warm restart would).
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "caches_compiled" / "inductor")
        eager, compiled = _engine(checkpoint, args, False), _engine(checkpoint, args, True)
        results["step"] = []
        for batch in args.batch:
            prompts = _prompts(batch, args.prompt_len, eager.config.vocab_size)
            t = paired(lambda p=prompts: dsv4_decode_step(eager, p, args.new_tokens),
                       lambda p=prompts: dsv4_decode_step(compiled, p, args.new_tokens), args.repeats)
            row = {"batch": batch, "eager_ms": 1e3 * t.peer_s, "compiled_ms": 1e3 * t.ds_s, "pairs": list(t.ratios),
                   **t.fields()}
            results["step"].append(row)
            print(f"step b={batch}: eager {row['eager_ms']:.2f} ms, compiled {row['compiled_ms']:.2f} ms, "
                  f"x{t.ratio:.3f} [{min(t.ratios):.3f}, {max(t.ratios):.3f}]", flush=True)
            write_report(stem, results)  # so far
        results["mixed"] = mixed(checkpoint, args, eager, compiled)
        print(f"mixed: {results['mixed']}", flush=True)
    results["load_average_end"] = os.getloadavg()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--mixed-batch", type=int, default=64,
                        help="prompts of the mixed-step generation (64 x 64 tokens: more than one step's budget)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-warmup", action="store_true", help="no cold / warm warm-up processes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    # the warm-up child's own arguments
    parser.add_argument("--warmup-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup_child:
        return warmup_child(args)
    stem = args.out / f"bench_compiled_quant_{args.config}_t{args.threads}"
    write_report(stem, run(args, stem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
