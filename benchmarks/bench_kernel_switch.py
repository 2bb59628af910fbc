"""One of the model's bound decode kernels switched off and on in one engine: what it saves per decode step.

Switches (each kernel's reference is what the model runs without it):
  shared-input      a layer's projections of one input in one C call (`SharedInputLinears`, gemv_cpu.c
                    dense_xw_shared) against one few-row kernel call per projection
  moe-layer         a decode step's whole MoE layer in one C call (`MoE.layer_kernel`, gemv_cpu.c moe_layer) against
                    the router, routed-expert kernel and shared expert as separate modules (torch ops around kernels)
  decode-attention  single-token decode rows' attention in C (DECODE_ATTENTION, decode_attention_cpu.c) against the
                    torch decode path: each attention layer gets a view of its registry that declines the op

One engine, one process (`kernel_ab.py`), its decode steps eager (not replayed): the kernel's bindings (or its
registry) are swapped out and back in turn; ratio = off seconds / on seconds of the decode step (> 1: the kernel
is faster). The model is a bench_generate config with a seeded random checkpoint (--model small | tiny, --experts
its routed-expert format) or an embedded model by name (e.g. dsv4-sort, the demo's model, in its own formats), at
--dtype.

Writes <out>/bench_kernel_switch_<switch>_<model>[_<experts>]_<dtype>_t<threads>.json and .png.
Usage: python benchmarks/bench_kernel_switch.py --switch shared-input [--model small] [--experts dense]
                                                [--dtype float32] [--batch 1 4 16] [--threads 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
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
from dsv4.embedded import EMBEDDED_MODELS  # noqa: E402
from dsv4.kernels.registry import DECODE_ATTENTION  # noqa: E402
from dsv4.model.attention import Attention  # noqa: E402
from dsv4.model.moe import MoE  # noqa: E402
from kernel_ab import decode_step_ab, plot_decode_step_ab  # noqa: E402
from report import write_report  # noqa: E402

MODEL_SEED = 0
SIDES = ("off", "on")  # the JSON's "<side>_ms" keys


class TorchDecodeView:
    """A registry that declines DECODE_ATTENTION: an attention layer given it runs its torch decode path."""

    def __init__(self, registry):
        self.registry = registry

    def kernel(self, op: str, *args):
        return None if op == DECODE_ATTENTION else self.registry.kernel(op, *args)


class KernelSwitch:
    """One kind of kernel in every model the engine runs, which `use(False)` swaps out (the module then runs its
    reference) and `use(True)` back in: (holder, attribute name, value on, value off) entries."""

    def __init__(self, llm: LLM, switch: str):
        self.entries = []
        for model in llm.loaded.models.values():
            for module in model.modules():
                if switch == "shared-input" and isinstance(module, Attention):
                    holders = [(shared, "product") for shared in (module.from_x, module.from_q)]
                elif switch == "moe-layer" and isinstance(module, MoE):
                    holders = [(module, "layer_kernel")]
                elif switch == "decode-attention" and isinstance(module, Attention):
                    registry = module.kernels
                    if registry.choose(DECODE_ATTENTION).impl is not None:
                        self.entries.append((module, "kernels", registry, TorchDecodeView(registry)))
                    continue
                else:
                    continue
                # (a q_res with one projection, a layer the kernel cannot run: nothing bound, nothing to switch)
                self.entries += [(h, name, getattr(h, name), None) for h, name in holders
                                 if getattr(h, name) is not None]
        if not self.entries:
            raise RuntimeError(f"no {switch} kernel serves this model (no C build here, or none applies)")

    def use(self, on: bool) -> None:
        for holder, name, value_on, value_off in self.entries:
            setattr(holder, name, value_on if on else value_off)


def plot(results: dict, path: Path) -> None:
    plot_decode_step_ab(results["decode_step"], path, SIDES, ("kernel off (reference)", "kernel on"),
                        f"{results['switch']}: {results['model']}, {results['dtype']}, {results['threads']} threads")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch", choices=("shared-input", "moe-layer", "decode-attention"), required=True)
    parser.add_argument("--model", default="small",
                        help=f"a bench config ({', '.join(sorted(bench.CONFIGS))}) or an embedded model's name")
    parser.add_argument("--experts", choices=("dense", "fp8", "fp4"), default="dense",
                        help="routed expert format of a bench config (an embedded model keeps its own)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed run (their median is taken)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.model not in bench.CONFIGS and args.model not in EMBEDDED_MODELS:
        parser.error(f"--model: {args.model!r} is neither a bench config nor an embedded model")
    torch.set_num_threads(args.threads)
    results: dict = {"switch": args.switch, "model": args.model, "dtype": args.dtype, "threads": args.threads,
                     "repeats": args.repeats, "prompt_len": args.prompt_len, "steps": args.steps,
                     "ratio": "kernel-off seconds / kernel-on seconds (> 1: the kernel is faster)"}
    limits = {"max_num_seqs": max(args.batch), "max_num_batched_tokens": max(args.batch) * args.prompt_len}
    with tempfile.TemporaryDirectory() as tmp:
        if args.model in bench.CONFIGS:
            config = bench.CONFIGS[args.model]()
            ref.save_hf_checkpoint(ref.build_reference_model(config, MODEL_SEED), tmp)
            path, extra, name = tmp, {"expert_dtype": args.experts}, f"{args.model}_{args.experts}"
            results["experts"] = args.experts
        else:
            path, extra, name = args.model, {}, args.model
            config = json.loads((EMBEDDED_MODELS[args.model].path / "config.json").read_text())
        max_len = min(args.prompt_len + args.steps + 2, config["max_position_embeddings"])
        if args.prompt_len + args.steps + 1 > max_len:
            parser.error(f"--prompt-len + --steps must stay under the model's {max_len} positions")
        llm = LLM(path, dtype=args.dtype, max_model_len=max_len, **limits, **extra)
        # Eager steps on both sides: a replayed decode step (engine/decode_replay.py) would keep the kernels its
        # recording called whichever way the switch stands.
        llm.engine.runner.replay = None
        results["decode_step"] = decode_step_ab(llm, KernelSwitch(llm, args.switch).use, args.batch, args.prompt_len,
                                                args.steps, args.repeats, config["vocab_size"], SIDES)
    write_report(args.out / f"bench_kernel_switch_{args.switch}_{name}_{args.dtype}_t{args.threads}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
