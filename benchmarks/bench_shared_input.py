"""A decode layer's projections of one input in one C call (`SharedInputLinears`, gemv_cpu.c dense_xw_shared)
against one few-row kernel call per projection (its reference: each Linear's own bound DenseGemv).

One engine, one process (`kernel_ab.py`): every attention layer's shared-input products are unbound (None: each
Linear runs its own call) and bound again in turn; ratio = separate-calls seconds / shared-call seconds of the
decode step (> 1: the shared call is faster).

Writes <out>/bench_shared_input_<config>_<experts>_t<threads>.json and .png and prints a summary.
Usage: python benchmarks/bench_shared_input.py [--config small] [--experts dense] [--batch 1 4 16]
                                               [--threads 2] [--repeats 7]
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
from dsv4.model.attention import Attention  # noqa: E402
from kernel_ab import decode_step_ab, plot_decode_step_ab  # noqa: E402
from report import write_report  # noqa: E402

MODEL_SEED = 0
SIDES = ("separate", "shared")  # the JSON's "<side>_ms" keys


class SharedInputSwitch:
    """Every attention layer's bound shared-input products, which `use(False)` unbinds and `use(True)` restores."""

    def __init__(self, llm: LLM):
        layers = [m for m in llm.loaded.target.modules() if isinstance(m, Attention)]
        # (a layer's q_res has one projection unless it has an indexer: nothing to share, nothing bound)
        self.bound = [(shared, shared.product) for layer in layers for shared in (layer.from_x, layer.from_q)
                      if shared.product is not None]
        if not any(shared is layer.from_x for layer in layers for shared, _ in self.bound):
            raise RuntimeError("the shared-input kernel is bound to no layer (no C build here?)")

    def use(self, on: bool) -> None:
        for shared, product in self.bound:
            shared.product = product if on else None


def plot(results: dict, path: Path) -> None:
    plot_decode_step_ab(results["decode_step"], path, SIDES, ("one call per projection", "one call per input"),
                        f"{results['config']} config, {results['experts']} experts, {results['threads']} threads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(bench.CONFIGS), default="small")
    parser.add_argument("--experts", choices=("dense", "fp8", "fp4"), default="dense", help="routed expert format")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed run (their median is taken)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = bench.CONFIGS[args.config]()
    results: dict = {"config": args.config, "experts": args.experts, "threads": args.threads,
                     "repeats": args.repeats, "prompt_len": args.prompt_len, "steps": args.steps,
                     "ratio": "separate-calls seconds / shared-call seconds (> 1: the shared call is faster)",
                     }
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_hf_checkpoint(ref.build_reference_model(config, MODEL_SEED), tmp)
        llm = LLM(tmp, dtype="float32", expert_dtype=args.experts, max_num_seqs=max(args.batch),
                  max_model_len=args.prompt_len + args.steps + 2,
                  max_num_batched_tokens=max(args.batch) * args.prompt_len)
        results["decode_step"] = decode_step_ab(llm, SharedInputSwitch(llm).use, args.batch, args.prompt_len,
                                                args.steps, args.repeats, config["vocab_size"], SIDES)
    write_report(args.out / f"bench_shared_input_{args.config}_{args.experts}_t{args.threads}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
