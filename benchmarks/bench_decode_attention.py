"""The C decode-attention kernel (kernels/decode_attention_cpu.py) against the torch decode path it replaces.

One engine, one process: each layer's attention alternates between the registry's kernel and a view of the
registry that declines DECODE_ATTENTION (the layer then runs its torch path, the kernel's reference), so the
two sides of a pair share weights, caches, threads and the machine's state of the moment. Workload: the
median decode engine step (bench_generate's `dsv4_decode_step`: forward + sampling) with B running
sequences after --prompt-len random prompts; ratio = torch-path seconds / kernel seconds (> 1: the kernel is
faster), the median of --repeats back-to-back pairs. Its measurements set MAX_DECODE_ROWS, the rows up to
which the registry uses the kernel.

Writes <out>/bench_decode_attention_<config>_t<threads>.json and .png and prints a summary.
Usage: python benchmarks/bench_decode_attention.py [--config small] [--batch 1 2 4 8 16] [--threads 2]
                                                   [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_generate as bench  # noqa: E402
import reference as ref  # noqa: E402
from dsv4 import LLM  # noqa: E402
from dsv4.kernels import decode_attention_cpu  # noqa: E402
from dsv4.kernels.registry import DECODE_ATTENTION  # noqa: E402
from paired import paired  # noqa: E402
from report import write_report  # noqa: E402

MODEL_SEED = 0


class TorchDecodeView:
    """The registry, declining DECODE_ATTENTION: an attention layer given it runs its torch decode path."""

    def __init__(self, registry):
        self.registry = registry

    def kernel(self, op: str, *args):
        return None if op == DECODE_ATTENTION else self.registry.kernel(op, *args)


def _set_attention_kernels(llm: LLM, kernels) -> None:
    for layer in llm.loaded.target.layers:
        layer.attn.kernels = kernels


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["decode_step"]
    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [r["torch_ms"] for r in rows], "o-", label="torch decode path")
    ax.plot(batches, [r["kernel_ms"] for r in rows], "o-", label="C decode-attention kernel")
    for r in rows:
        ax.annotate(f"x{r['ratio']:.2f}", (r["batch"], r["kernel_ms"]), textcoords="offset points", xytext=(4, -12))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running sequences (rows per decode step)")
    ax.set_ylabel("median decode step (ms)")
    ax.set_title(f"{results['config']} config, {results['threads']} threads: torch / kernel step time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(bench.CONFIGS), default="small")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed run (their median is taken)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = bench.CONFIGS[args.config]()
    results: dict = {"config": args.config, "threads": args.threads, "repeats": args.repeats,
                     "prompt_len": args.prompt_len, "steps": args.steps,
                     "max_decode_rows": decode_attention_cpu.MAX_DECODE_ROWS,
                     "ratio": "torch-path seconds / kernel seconds (> 1: the kernel is faster)", "decode_step": []}
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_hf_checkpoint(ref.build_reference_model(config, MODEL_SEED), tmp)
        llm = LLM(tmp, dtype="float32", max_num_seqs=max(args.batch), max_model_len=args.prompt_len + args.steps + 2,
                  max_num_batched_tokens=max(args.batch) * args.prompt_len)
        registry, view = llm.loaded.target.kernels, TorchDecodeView(llm.loaded.target.kernels)
        for batch in args.batch:
            prompts = bench._prompts(batch, args.prompt_len, config["vocab_size"])

            def step(kernels, p=prompts) -> float:
                _set_attention_kernels(llm, kernels)
                return bench.dsv4_decode_step(llm, p, args.steps)

            t = paired(lambda: step(view), lambda: step(registry), args.repeats)
            row = {"batch": batch, "torch_ms": t.peer_s * 1e3, "kernel_ms": t.ds_s * 1e3, "pairs": list(t.ratios),
                   **t.fields()}
            results["decode_step"].append(row)
            print(f"b={batch}: torch path {row['torch_ms']:.2f} ms, kernel {row['kernel_ms']:.2f} ms, "
                  f"x{t.ratio:.2f} [{min(t.ratios):.2f}, {max(t.ratios):.2f}]", flush=True)
        _set_attention_kernels(llm, registry)
    write_report(args.out / f"bench_decode_attention_{args.config}_t{args.threads}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
