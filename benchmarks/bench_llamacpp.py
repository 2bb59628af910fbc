"""dsv4 vs llama.cpp on the same DeepSeek-V4 model, side by side in one run.

The peer is the llama.cpp that llama-cpp-python 0.3.36 vendors, built by benchmarks/peer/build_llamacpp.sh
(CPU backend, native flags) and driven through libllama by benchmarks/peer/llama_driver.c. The model is one
randomised checkpoint (tests/reference.py's recipe; --config small is the ~77M config of the issue) written
in DeepSeek's native layout with fp32 dense tensors and FP4 routed experts; llama.cpp's own DeepSeek-V4
converter turns it into GGUF (benchmarks/peer/convert_gguf.py). Each variant pairs a dsv4 engine with the
GGUF holding the same values:

  fp32           dsv4 fp32, experts dense (the FP4 values as fp32)  vs  llama.cpp F32 (experts = those values)
  fp4            dsv4 fp32, experts FP4 (resident as FP4)           vs  llama.cpp with MXFP4 experts (same bytes)
  fp8            dsv4 fp32, experts FP8 (the FP4 values re-quantized  vs  llama.cpp F32 (llama.cpp has no FP8 expert
                 to e4m3 with 128x128 block scales, resident as FP8)       format: compare with dsv4 fp32 in the run)
  bf16           dsv4 bf16, experts dense                            vs  llama.cpp F32
  fp32-compiled  dsv4 fp32, experts dense, LLM(compile=True)         vs  llama.cpp F32
  fp4-compiled   dsv4 fp32, experts FP4, LLM(compile=True)           vs  llama.cpp with MXFP4 experts

Before anything is timed, both engines compute the logits of every position of a prompt and the run
records their max abs difference (a comparison of engines that compute different things is meaningless):
with llama.cpp's caches in f32 and flash attention off ("exact"), its F32 model and dsv4's fp32 model agree
to fp32 rounding, and a variant whose engines compute the same thing stops when they do not
(--max-logit-diff). The timed runs use llama.cpp's defaults (f16 caches, flash attention auto) unless
--peer-attention exact; the check is also reported in the timed configuration.

Workloads (each engine warmed once, then the two alternated --repeats times; a ratio is the median of the
back-to-back pairs' ratios llama.cpp seconds / dsv4 seconds, > 1 means dsv4 is faster; see paired.py):
  decode      batch-1 step after a --prompt-len prompt, median over --new-tokens steps. dsv4: one engine step
              (forward + sampling); llama.cpp: llama_decode of one token + greedy argmax of its logits
  throughput  --batch prompts of --prompt-len random tokens, --new-tokens greedy tokens each, prefill
              included, generated tok/s. dsv4: LLM.generate; llama.cpp: all prompts in one llama_decode
              (split into ubatches by llama.cpp), then one batched llama_decode per step, one sequence each
  prefill     one forward over --prefill-len tokens with logits at every position
  roofline    the b=1 step's bytes (weights read once + caches, benchmarks/roofline.py) at the read bandwidth
              measured in this run: each engine's decode step as a fraction of that bound

Threads: --threads for both (torch intra-op threads; llama.cpp n_threads and n_threads_batch).
--background-load N keeps N busy-looping processes running through the timed workloads (co-running load).
Writes <out>/bench_llamacpp_<config>_t<threads>[_load<N>].json and .png.
Usage: python benchmarks/bench_llamacpp.py [--config small] [--variants fp32 fp4] [--threads 2] [--quick]
Needs the peer built (benchmarks/peer/build_llamacpp.sh), the `test` and `bench` extras.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the randomised reference models live with the tests
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))

from llama_peer import (  # noqa: E402
    DEFAULT_ATTENTION,
    EXACT_ATTENTION,
    LlamaDriver,
    PeerAttention,
    PeerBuild,
    convert,
    write_bench_checkpoint,
)

import reference as ref  # noqa: E402
import roofline  # noqa: E402
from bench_generate import _prompts, _timed, dsv4_decode_step, dsv4_generate, dsv4_logits, dsv4_prefill  # noqa: E402
from dsv4 import LLM  # noqa: E402
from dsv4.kernels import describe_backends  # noqa: E402
from paired import paired  # noqa: E402
from report import write_report  # noqa: E402

MODEL_SEED = 0
# llama.cpp sizes its per-sequence caches in whole multiples of this many cells.
CTX_ROUND = 256
# llama.cpp rotates the lightning indexer's keys with Hadamard blocks of at least 64 (llama_kv_cache::
# build_input_k_rot), so its DeepSeek-V4 graph needs index_head_dim to be a multiple of 64 (released models:
# 128); with the small config's 32 it aborts at context creation. Both benchmark models use 64, as the
# issue's measurements did.
PEER_INDEX_HEAD_DIM = 64
# A quick model for smoke runs: the small config cut down, keeping what llama.cpp's DeepSeek-V4 graph
# hard-codes (CSA rate 4, HCA rate 128, 4 hyper-connection streams).
_QUICK_OVERRIDES = {
    "vocab_size": 2048, "hidden_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
    "n_routed_experts": 8, "index_n_heads": 4,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
}
CONFIGS = {"small": lambda: ref.small_config(index_head_dim=PEER_INDEX_HEAD_DIM),
           "quick": lambda: ref.small_config(**_QUICK_OVERRIDES, index_head_dim=PEER_INDEX_HEAD_DIM)}


@dataclass(frozen=True)
class Variant:
    """A dsv4 engine and the GGUF that holds the same values."""

    label: str
    gguf_experts: str  # "f32" | "mxfp4"
    dsv4: dict = field(default_factory=dict)  # LLM keyword arguments
    # Both engines compute the same thing (with the peer's exact attention): the logits check must pass.
    # Otherwise the difference is by design and only reported: dsv4 bf16 against an F32 model, or llama.cpp's
    # MXFP4 products, which quantize the activations to 8 bits per 32 (ggml's Q8_0) before the dot product.
    same_computation: bool = True


VARIANTS = {
    "fp32": Variant("dsv4 fp32, dense experts / llama.cpp F32", "f32", {"dtype": "float32", "expert_dtype": "dense"}),
    "fp4": Variant("dsv4 fp32, FP4 experts / llama.cpp MXFP4 experts", "mxfp4",
                   {"dtype": "float32", "expert_dtype": "fp4"}, same_computation=False),
    "fp8": Variant("dsv4 fp32, FP8 experts / llama.cpp F32", "f32", {"dtype": "float32", "expert_dtype": "fp8"},
                   same_computation=False),
    "bf16": Variant("dsv4 bf16, dense experts / llama.cpp F32", "f32", {"dtype": "bfloat16", "expert_dtype": "dense"},
                    same_computation=False),
    "fp32-compiled": Variant("dsv4 fp32, dense experts, compile=True / llama.cpp F32", "f32",
                             {"dtype": "float32", "expert_dtype": "dense", "compile": True}),
    "fp4-compiled": Variant("dsv4 fp32, FP4 experts, compile=True / llama.cpp MXFP4 experts", "mxfp4",
                            {"dtype": "float32", "expert_dtype": "fp4", "compile": True}, same_computation=False),
}
PEER_ATTENTION = {"default": DEFAULT_ATTENTION, "exact": EXACT_ATTENTION}


def _ctx_cells(tokens: int) -> int:
    return CTX_ROUND * math.ceil((tokens + 1) / CTX_ROUND)


def prepare_models(build: PeerBuild, config_name: str, experts: set[str], rebuild: bool) -> dict[str, Path]:
    """The native checkpoint and its GGUF conversions, cached under the peer's work directory."""
    models = build.workdir / "models" / f"{config_name}-seed{MODEL_SEED}"
    checkpoint = models / "checkpoint"
    if rebuild or not (checkpoint / "model.safetensors").exists():
        print(f"writing the {config_name} checkpoint to {checkpoint}", flush=True)
        write_bench_checkpoint(checkpoint, CONFIGS[config_name](), MODEL_SEED)
    paths = {"checkpoint": checkpoint}
    for fmt in sorted(experts):
        gguf = models / f"model-{fmt}-experts.gguf"
        if rebuild or not gguf.exists():
            print(f"converting to {gguf.name} with llama.cpp's converter", flush=True)
            convert(build, checkpoint, gguf, fmt)
        paths[fmt] = gguf
    return paths


def check_logits(llm: LLM, driver: LlamaDriver, prompt: list[int], attention: PeerAttention) -> dict:
    """Both engines' logits at every prompt position: max abs difference, and of the log-probabilities."""
    with tempfile.TemporaryDirectory() as tmp:
        driver.context(1, _ctx_cells(len(prompt)), len(prompt), attention)
        peer = torch.from_numpy(driver.logits(prompt, Path(tmp) / "logits.f32").copy())
    ours = dsv4_logits(llm, prompt, llm.loaded.target.allocate_cache(1, len(prompt) + 1)).float()
    diff = (peer - ours).abs()
    logprob_diff = (peer.log_softmax(-1) - ours.log_softmax(-1)).abs()
    return {"positions": len(prompt), "max_abs_logit_diff": diff.max().item(),
            "mean_abs_logit_diff": diff.mean().item(), "max_abs_logit": ours.abs().max().item(),
            "max_abs_logprob_diff": logprob_diff.max().item(),
            "argmax_agreement": (peer.argmax(-1) == ours.argmax(-1)).float().mean().item()}


def run_variant(args, build: PeerBuild, name: str, paths: dict[str, Path], peaks: dict) -> dict:
    variant = VARIANTS[name]
    vocab = CONFIGS[args.config]()["vocab_size"]
    max_batch = max(args.batch)
    llm = LLM(paths["checkpoint"], max_num_seqs=max_batch,
              max_model_len=max(args.prompt_len + args.new_tokens, args.prefill_len) + 1,
              max_num_batched_tokens=max_batch * args.prompt_len, **variant.dsv4)
    log = args.out / f"llama_driver_{name}.log"
    result: dict = {"variant": name, "label": variant.label, "dsv4": variant.dsv4,
                    "gguf": paths[variant.gguf_experts].name, "throughput": []}
    with LlamaDriver(build, paths[variant.gguf_experts], args.threads, log=log) as driver:
        prompt = _prompts(1, args.prompt_len, vocab)[0]
        attention = PEER_ATTENTION[args.peer_attention]
        result["peer_attention"] = {"kv_cache": attention.kv_cache, "flash_attn": attention.flash_attn}
        result["logits"] = {config: check_logits(llm, driver, prompt, PEER_ATTENTION[config])
                            for config in sorted({"exact", args.peer_attention})}
        for config, check in result["logits"].items():
            print(f"[{name}] logits over {args.prompt_len} positions, peer attention {config}: max abs diff "
                  f"{check['max_abs_logit_diff']:.3g} (logits up to {check['max_abs_logit']:.3g}), "
                  f"argmax agreement {check['argmax_agreement']:.3f}", flush=True)
        exact_diff = result["logits"]["exact"]["max_abs_logit_diff"]
        if variant.same_computation and exact_diff > args.max_logit_diff:
            raise SystemExit(f"[{name}] the engines disagree (max abs logit diff {exact_diff:.3g} > "
                             f"--max-logit-diff {args.max_logit_diff}): timing them side by side would compare "
                             "different computations")

        with _background_load(args.background_load):
            driver.context(1, _ctx_cells(args.prompt_len + args.new_tokens), args.prompt_len, attention)
            t = paired(lambda: statistics.median(driver.decode_steps(prompt, args.new_tokens)),
                       lambda: dsv4_decode_step(llm, [prompt], args.new_tokens), args.repeats)
            result["decode_b1"] = {"llama_ms": t.peer_s * 1e3, "dsv4_ms": t.ds_s * 1e3, **t.fields()}
            print(f"[{name}] decode b=1: llama.cpp {t.peer_s * 1e3:.2f} ms, dsv4 {t.ds_s * 1e3:.2f} ms, "
                  f"x{t.ratio:.2f} [{min(t.ratios):.2f}-{max(t.ratios):.2f}]", flush=True)

            for batch in args.batch:
                prompts = _prompts(batch, args.prompt_len, vocab)
                driver.context(batch, batch * _ctx_cells(args.prompt_len + args.new_tokens), batch * args.prompt_len,
                               attention)
                t = paired(lambda p=prompts: driver.generate(p, args.new_tokens),
                           lambda p=prompts: _timed(lambda: dsv4_generate(llm, p, args.new_tokens)), args.repeats)
                generated = batch * args.new_tokens
                row = {"batch": batch, "llama_tok_s": generated / t.peer_s, "dsv4_tok_s": generated / t.ds_s,
                       **t.fields()}
                result["throughput"].append(row)
                print(f"[{name}] throughput b={batch}: llama.cpp {row['llama_tok_s']:.0f} tok/s, "
                      f"dsv4 {row['dsv4_tok_s']:.0f} tok/s, x{t.ratio:.2f}", flush=True)

            long_prompt = _prompts(1, args.prefill_len, vocab)[0]
            driver.context(1, _ctx_cells(args.prefill_len), args.prefill_len, attention)
            scratch = llm.loaded.target.allocate_cache(1, args.prefill_len + 1)
            t = paired(lambda: driver.prefill(long_prompt),
                       lambda: _timed(lambda: dsv4_prefill(llm, long_prompt, scratch)), args.repeats)
            result["prefill"] = {"tokens": args.prefill_len, "llama_tok_s": args.prefill_len / t.peer_s,
                                 "dsv4_tok_s": args.prefill_len / t.ds_s, **t.fields()}
            print(f"[{name}] prefill {args.prefill_len}: llama.cpp {args.prefill_len / t.peer_s:.0f} tok/s, "
                  f"dsv4 {args.prefill_len / t.ds_s:.0f} tok/s, x{t.ratio:.2f}", flush=True)

    model = llm.loaded.target
    cost = roofline.decode_step_cost(model, model.cfg, 1, args.prompt_len + args.new_tokens // 2)
    bound_s = cost["bytes"] / (peaks["read_bw_gb_s"] * 1e9)
    result["roofline_b1"] = {"bytes": cost["bytes"], "bound_ms": bound_s * 1e3,
                             "dsv4_fraction": bound_s * 1e3 / result["decode_b1"]["dsv4_ms"],
                             "llama_fraction": bound_s * 1e3 / result["decode_b1"]["llama_ms"]}
    print(f"[{name}] b=1 roofline: {cost['bytes'] / 1e6:.1f} MB at {peaks['read_bw_gb_s']:.1f} GB/s = "
          f"{bound_s * 1e3:.2f} ms: dsv4 at {100 * result['roofline_b1']['dsv4_fraction']:.0f}%, llama.cpp at "
          f"{100 * result['roofline_b1']['llama_fraction']:.0f}%", flush=True)
    return result


def _busy_loop() -> None:
    while True:
        pass


class _background_load:
    """`count` processes spinning on a core each while the block runs (the co-running load of issue 18)."""

    def __init__(self, count: int):
        self.count = count
        self.procs: list[multiprocessing.Process] = []

    def __enter__(self):
        for _ in range(self.count):
            proc = multiprocessing.get_context("spawn").Process(target=_busy_loop, daemon=True)
            proc.start()
            self.procs.append(proc)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.join()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = results["variants"]
    workloads = ["decode b=1", *(f"b={r['batch']}" for r in variants[0]["throughput"]), "prefill"]
    fig, (ax, ax_roof) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1.4]})
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        rows = [v["decode_b1"], *v["throughput"], v["prefill"]]
        ratios = [r["ratio"] for r in rows]
        spread = [[r["ratio"] - r["ratio_min"] for r in rows], [r["ratio_max"] - r["ratio"] for r in rows]]
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(rows))]
        bars = ax.bar(xs, ratios, width, yerr=spread, capsize=3, label=v["label"])
        ax.bar_label(bars, labels=[f"x{r:.2f}" for r in ratios], fontsize=7)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_ylabel("dsv4 speed / llama.cpp\n(median pair, bars: range)")
    load = f", {results['background_load']} busy process(es)" if results["background_load"] else ""
    ax.set_title(f"{results['config']} config, {results['threads']} thread(s){load}", fontsize=10)
    ax.legend(fontsize=7)

    labels, fractions = [], []
    for v in variants:
        labels += [f"{v['variant']}\ndsv4", f"{v['variant']}\nllama"]
        fractions += [100 * v["roofline_b1"]["dsv4_fraction"], 100 * v["roofline_b1"]["llama_fraction"]]
    bars = ax_roof.bar(labels, fractions, color=["tab:blue", "tab:orange"] * len(variants))
    ax_roof.bar_label(bars, labels=[f"{f:.0f}%" for f in fractions], fontsize=7)
    ax_roof.set_ylabel("b=1 decode, % of roofline")
    ax_roof.set_title(f"weights read once at {results['peaks']['read_bw_gb_s']:.0f} GB/s", fontsize=10)
    ax_roof.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_workload_arguments(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    """The options every dsv4-vs-llama.cpp benchmark shares: model config, variants, prompt, threads."""
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["fp32", "fp4"])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--threads", type=int, default=2, help="threads for both engines")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, new_tokens=48)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="busy-looping processes kept running through the timed workloads")
    parser.add_argument("--max-logit-diff", type=float, default=1e-3,
                        help="refuse to time a same-computation variant whose logits differ by more than this")
    parser.add_argument("--peer-attention", choices=sorted(PEER_ATTENTION), default="default",
                        help="llama.cpp's caches/attention while timed: its defaults (f16 caches, flash attention "
                             "auto) or exact (f32 caches, no flash attention; what the logits check uses)")
    parser.add_argument("--workdir", type=Path, default=PeerBuild().workdir, help="build_llamacpp.sh's --workdir")
    parser.add_argument("--rebuild-models", action="store_true", help="rewrite the checkpoint and the GGUF files")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the quick config, b=4, 16-token prompts, 4 new tokens, 1 repeat")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.config, args.batch, args.prompt_len, args.new_tokens = "quick", [4], 16, 4
        args.prefill_len, args.repeats = 32, 1
    torch.set_num_threads(args.threads)
    build = PeerBuild(args.workdir)
    build.check()
    args.out.mkdir(parents=True, exist_ok=True)
    paths = prepare_models(build, args.config, {VARIANTS[v].gguf_experts for v in args.variants},
                           args.rebuild_models)
    peaks = roofline.measure_peaks(repeats=1 if args.quick else roofline.PEAK_REPEATS)
    print("peaks: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()), flush=True)
    results = {"config": args.config, "threads": args.threads, "repeats": args.repeats,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prefill_len": args.prefill_len,
               "background_load": args.background_load, "torch": torch.__version__, "numpy": np.__version__,
               "machine": platform.processor() or platform.machine(), "backends": describe_backends(),
               "peer": "llama.cpp vendored by llama-cpp-python 0.3.36 (benchmarks/peer/build_llamacpp.sh)",
               "peaks": peaks, "variants": []}
    for name in args.variants:
        results["variants"].append(run_variant(args, build, name, paths, peaks))
    load = f"_load{args.background_load}" if args.background_load else ""
    write_report(args.out / f"bench_llamacpp_{args.config}_t{args.threads}{load}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
