"""What the few-row kernels would buy a batch-1 decode step before they are wired into the model.

Until the kernels are registered with the model's kernel registry, this script swaps them in from the
outside, for its own process only: `Linear.forward` (every dense projection and the output head) goes to
`DenseGemv` when it supports the call, and `RoutedExperts.forward` to `FusedExperts` / `FusedQuantExperts`.
It checks that the swapped model's logits match the plain model's, then alternates plain and swapped
decode steps (paired.py): ratio = plain step / swapped step. Delete it once the kernels are wired.

The model is bench_llamacpp.py's small checkpoint (fp32 dense tensors, FP4 experts), loaded with FP4 or
dense experts. Writes <out>/estimate_wired_kernels_<experts>_t<threads>.json.
Usage: python benchmarks/estimate_wired_kernels.py [--experts fp4|dense] [--threads 2] [--steps 32]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))
sys.path.insert(0, str(ROOT / "tests"))

from llama_peer import PeerBuild  # noqa: E402

from bench_generate import _prompts, dsv4_decode_step, dsv4_logits  # noqa: E402
from bench_llamacpp import CONFIGS, prepare_models  # noqa: E402
from dsv4 import LLM  # noqa: E402
from dsv4.kernels.gemv_cpu import build_kernels  # noqa: E402
from dsv4.model.linear import Linear  # noqa: E402
from dsv4.model.moe import DENSE, RoutedExperts  # noqa: E402
from paired import paired  # noqa: E402
from report import write_report  # noqa: E402

# The swapped model computes the same values as the plain one, summed in another order.
LOGITS_TOL = 1e-3


class Swap:
    """Class-level forwards replaced while `on`; the originals run otherwise."""

    def __init__(self, threads: int):
        self.dense, _, self.experts, self.quant_experts = build_kernels(threads)
        self.on = False
        self.calls = {"dense": 0, "experts": 0}
        self._linear, self._routed = Linear.forward, RoutedExperts.forward
        swap = self

        def linear_forward(module, x):
            if swap.on:
                flat = x.reshape(-1, x.shape[-1])
                if swap.dense.supports(flat, module.weight):
                    swap.calls["dense"] += 1
                    return swap.dense(flat, module.weight).view(*x.shape[:-1], -1)
            return F.linear(x, module.weight)

        def routed_forward(module, x, ids, weights):
            if swap.on:
                if module.format == DENSE:
                    args = (x, ids, weights, module.w1, module.w3, module.w2, module.limit)
                    kernel = swap.experts
                else:
                    block = module.block if module.format == "fp8" else (1, module.group)
                    args = (x, ids, weights, module.w1, module.w1_scale, module.w3, module.w3_scale, module.w2,
                            module.w2_scale, block, module.limit)
                    kernel = swap.quant_experts
                if kernel.supports(*args):
                    swap.calls["experts"] += 1
                    return kernel(*args)
            return swap._routed(module, x, ids, weights)

        Linear.forward, RoutedExperts.forward = linear_forward, routed_forward

    @contextlib.contextmanager
    def enabled(self):
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def restore(self) -> None:
        Linear.forward, RoutedExperts.forward = self._linear, self._routed


def _decode_steps(llm: LLM, prompt: list[int], steps: int, swap: Swap, on: bool) -> float:
    """Median seconds of `steps` engine steps of one sequence after its prompt (prefill untimed), the
    kernels swapped in when `on`."""
    with swap.enabled() if on else contextlib.nullcontext():
        return dsv4_decode_step(llm, [prompt], steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", choices=("fp4", "dense"), default="fp4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = prepare_models(PeerBuild(), "small", set(), rebuild=False)["checkpoint"]
    llm = LLM(checkpoint, dtype="float32", expert_dtype=args.experts, max_num_seqs=1,
              max_model_len=args.prompt_len + args.steps + 2)
    prompt = _prompts(1, args.prompt_len, CONFIGS["small"]()["vocab_size"])[0]
    swap = Swap(args.threads)
    try:
        cache = llm.loaded.target.allocate_cache(1, args.prompt_len + 1)
        plain = dsv4_logits(llm, prompt, cache)
        with swap.enabled():
            swapped = dsv4_logits(llm, prompt, cache)
        diff = (plain - swapped).abs().max().item()
        if diff > LOGITS_TOL:
            raise SystemExit(f"the swapped model's logits differ by {diff:.3g} (> {LOGITS_TOL})")
        t = paired(lambda: _decode_steps(llm, prompt, args.steps, swap, on=False),
                   lambda: _decode_steps(llm, prompt, args.steps, swap, on=True), args.repeats)
    finally:
        swap.restore()
    result = {"experts": args.experts, "threads": args.threads, "steps": args.steps, "max_abs_logit_diff": diff,
              "plain_step_ms": t.peer_s * 1e3, "kernels_step_ms": t.ds_s * 1e3, **t.fields(),
              "kernel_calls": swap.calls}
    print(f"experts {args.experts}, {args.threads} thread(s): plain {t.peer_s * 1e3:.2f} ms, with the kernels "
          f"{t.ds_s * 1e3:.2f} ms per step: x{t.ratio:.2f} [{min(t.ratios):.2f}-{max(t.ratios):.2f}] "
          f"(logits max abs diff {diff:.2g})")
    write_report(args.out / f"estimate_wired_kernels_{args.experts}_t{args.threads}", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
