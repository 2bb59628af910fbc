"""The C decode-attention kernel (kernels/decode_attention_cpu.py) against the torch decode path it replaces.

One engine, one process (`kernel_ab.py`): each layer's attention alternates between the registry's kernel and a
view of the registry that declines DECODE_ATTENTION (the layer then runs its torch path, the kernel's
reference); ratio = torch-path seconds / kernel seconds of the decode step (> 1: the kernel is faster). Its
measurements set MAX_DECODE_ROWS, the rows up to which the registry uses the kernel.

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
from kernel_ab import decode_step_ab, plot_decode_step_ab  # noqa: E402
from report import write_report  # noqa: E402

MODEL_SEED = 0
SIDES = ("torch", "kernel")  # the JSON's "<side>_ms" keys


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
    plot_decode_step_ab(results["decode_step"], path, SIDES, ("torch decode path", "C decode-attention kernel"),
                        f"{results['config']} config, {results['threads']} threads: torch / kernel step time")


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
                     "ratio": "torch-path seconds / kernel seconds (> 1: the kernel is faster)"}
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_hf_checkpoint(ref.build_reference_model(config, MODEL_SEED), tmp)
        llm = LLM(tmp, dtype="float32", max_num_seqs=max(args.batch), max_model_len=args.prompt_len + args.steps + 2,
                  max_num_batched_tokens=max(args.batch) * args.prompt_len)
        registry, view = llm.loaded.target.kernels, TorchDecodeView(llm.loaded.target.kernels)
        results["decode_step"] = decode_step_ab(
            llm, lambda on: _set_attention_kernels(llm, registry if on else view), args.batch, args.prompt_len,
            args.steps, args.repeats, config["vocab_size"], SIDES)
    write_report(args.out / f"bench_decode_attention_{args.config}_t{args.threads}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
