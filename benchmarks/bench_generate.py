"""dsv4 vs transformers 5.23 `generate` on the same randomised model, same dtype, in one run.

Workloads (the same three for both engines):
  throughput  greedy generation of --new-tokens tokens after --prompt-len-token random prompts, at each
              --batch size, prefill included: generated tok/s
  decode      batch-1 decode step latency after a --prompt-len prompt (median over --new-tokens steps)
  prefill     one forward over --prefill-len tokens, logits at every position: tok/s

  Each workload alternates the engines --repeats times (after one warm-up each); a ratio is the median
  of the back-to-back pairs' ratios (ratio_min / ratio_max: their spread).

  roofline    dsv4's median decode step at batch 1 and at each --batch size against this machine's
              roofline, measured in the same run (roofline.py: bandwidth, matmul peaks, bytes, FLOPs)

Writes <out>/bench_<config>[_bf16][_compiled][_t<threads>].json and .png
(ratios dsv4 / transformers; roofline fractions).
Usage: python benchmarks/bench_generate.py --config tiny --batch 16 64 [--threads 1] [--repeats 3]
                                           [--dtype bfloat16] [--compile]
Needs the `test` extra (transformers) and the `bench` extra (matplotlib) installed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the randomised reference models live with the tests
sys.path.insert(0, str(ROOT / "benchmarks"))

import reference as ref  # noqa: E402
import roofline  # noqa: E402
from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.kernels import describe_backends  # noqa: E402
from dsv4.model.batch import ForwardBatch  # noqa: E402
from paired import paired  # noqa: E402
from report import write_report  # noqa: E402

CONFIGS = {"tiny": ref.tiny_config, "small": ref.small_config}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FILE_SUFFIX = {"float32": "", "bfloat16": "_bf16"}
MODEL_SEED = 0
PROMPT_SEED = 1


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- transformers ----
@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> None:
    ids = torch.tensor(prompts)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # ignore-eos: always exactly new_tokens tokens
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                             max_new_tokens=new_tokens, use_cache=True)
    finally:
        model.generation_config.eos_token_id = saved
    assert out.shape[1] == ids.shape[1] + new_tokens


@torch.no_grad()
def hf_decode_step(model, prompt: list[int], steps: int) -> float:
    """Median seconds of one batch-1 cached decode step."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - start)
        cache = out.past_key_values
    return statistics.median(times)


@torch.no_grad()
def hf_prefill(model, prompt: list[int]) -> None:
    model(input_ids=torch.tensor([prompt]), use_cache=False)


# ---- dsv4 ----
def dsv4_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> None:
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)


def dsv4_decode_step(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Median seconds of one engine step (forward + sampling) with len(prompts) running sequences."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-decode-{i}", prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # prefill (all prompts fit one step's token budget) + the first tokens
    times = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dsv4_logits(llm: LLM, prompt: list[int], cache) -> torch.Tensor:
    """fp32 logits [len(prompt), vocab] of one forward over the prompt (a fresh sequence in slot 0 of cache)."""
    with torch.inference_mode():
        model = llm.loaded.target
        streams, _ = model(ForwardBatch.build([(0, prompt, 0)]), cache)
        return model.logits(streams)


def dsv4_prefill(llm: LLM, prompt: list[int], cache) -> None:
    dsv4_logits(llm, prompt, cache)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    config = CONFIGS[args.config]()
    vocab = config["vocab_size"]
    hf_model = ref.build_reference_model(config, MODEL_SEED).to(DTYPES[args.dtype])
    results: dict = {
        "config": args.config, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
        "compile": args.compile,
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "backends": describe_backends(), "throughput": [], "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
    }
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_hf_checkpoint(hf_model, tmp)
        llm = LLM(tmp, dtype=args.dtype, max_num_seqs=max(args.batch),
                  max_model_len=max(args.prompt_len + args.new_tokens, args.prefill_len) + 1,
                  max_num_batched_tokens=max(args.batch) * args.prompt_len, compile=args.compile)
        for batch in args.batch:
            prompts = _prompts(batch, args.prompt_len, vocab)
            generated = batch * args.new_tokens
            # bind this batch's prompts (a default argument) rather than closing over the loop variable
            t = paired(lambda p=prompts: _timed(lambda: hf_generate(hf_model, p, args.new_tokens)),
                        lambda p=prompts: _timed(lambda: dsv4_generate(llm, p, args.new_tokens)), args.repeats)
            row = {"batch": batch, "hf_tok_s": generated / t.peer_s, "dsv4_tok_s": generated / t.ds_s, **t.fields()}
            results["throughput"].append(row)
            print(f"throughput b={batch}: transformers {row['hf_tok_s']:.0f} tok/s, "
                  f"dsv4 {row['dsv4_tok_s']:.0f} tok/s, x{row['ratio']:.2f}", flush=True)

        prompt = _prompts(1, args.prompt_len, vocab)[0]
        t = paired(lambda: hf_decode_step(hf_model, prompt, args.new_tokens),
                    lambda: dsv4_decode_step(llm, [prompt], args.new_tokens), args.repeats)
        ds_step = t.ds_s
        results["decode_b1"] = {"hf_ms": t.peer_s * 1e3, "dsv4_ms": t.ds_s * 1e3, **t.fields()}
        print(f"decode b=1 step: transformers {t.peer_s * 1e3:.2f} ms, dsv4 {t.ds_s * 1e3:.2f} ms, x{t.ratio:.2f}",
              flush=True)

        long_prompt = _prompts(1, args.prefill_len, vocab)[0]
        scratch = llm.loaded.target.allocate_cache(1, args.prefill_len + 1)
        t = paired(lambda: _timed(lambda: hf_prefill(hf_model, long_prompt)),
                    lambda: _timed(lambda: dsv4_prefill(llm, long_prompt, scratch)), args.repeats)
        results["prefill"] = {"tokens": args.prefill_len, "hf_tok_s": args.prefill_len / t.peer_s,
                              "dsv4_tok_s": args.prefill_len / t.ds_s, **t.fields()}
        print(f"prefill {args.prefill_len}: transformers {args.prefill_len / t.peer_s:.0f} tok/s, "
              f"dsv4 {args.prefill_len / t.ds_s:.0f} tok/s, x{t.ratio:.2f}", flush=True)

        results["roofline"] = measure_roofline(args, llm, vocab, ds_step)
    return results


def measure_roofline(args, llm: LLM, vocab: int, b1_step_s: float) -> dict:
    """dsv4's decode step at batch 1 (already measured) and at each --batch size against this machine's
    roofline; the cost is taken at the mean decode position of the workload."""
    peaks = roofline.measure_peaks()
    print("peaks: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()), flush=True)
    model, cfg = llm.loaded.target, llm.loaded.target.cfg
    mean_pos = args.prompt_len + args.new_tokens // 2
    rows = []
    for batch in [1, *args.batch]:
        if batch == 1:
            step_s = b1_step_s
        else:
            step_s = dsv4_decode_step(llm, _prompts(batch, args.prompt_len, vocab), args.new_tokens)
        cost = roofline.decode_step_cost(model, cfg, batch, mean_pos)
        row = {"batch": batch, **cost, **roofline.roofline_fraction(cost, peaks, args.dtype, step_s)}
        rows.append(row)
        print(f"roofline b={batch}: {cost['bytes'] / 1e6:.2f} MB, {cost['flops'] / 1e9:.3f} GFLOP, "
              f"{row['bound']}-bound {row['roofline_ms']:.3f} ms vs measured {row['measured_ms']:.2f} ms: "
              f"{100 * row['fraction']:.1f}%", flush=True)
    return {"peaks": peaks, "position": mean_pos, "experts": "expected distinct under uniform routing",
            "steps": rows}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"throughput b={r['batch']}" for r in results["throughput"]] + ["decode step b=1", "prefill"]
    rows = [*results["throughput"], results["decode_b1"], results["prefill"]]
    ratios = [r["ratio"] for r in rows]
    spread = [[r["ratio"] - r["ratio_min"] for r in rows], [r["ratio_max"] - r["ratio"] for r in rows]]  # pair range
    fig, (ax, ax_roof) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    bars = ax.bar(labels, ratios, yerr=spread, capsize=4, color="tab:blue")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.bar_label(bars, labels=[f"x{r:.1f}" for r in ratios])
    ax.set_ylabel("dsv4 speed / transformers\n(median pair, bars: range)")
    mode = ", compiled decode" if results.get("compile") else ""
    ax.set_title(f"{results['config']} config, {results['dtype']}, {results['threads']} thread(s){mode}")
    ax.tick_params(axis="x", labelsize=8)

    steps = results["roofline"]["steps"]
    fractions = [100 * r["fraction"] for r in steps]
    bars = ax_roof.bar([f"b={r['batch']}" for r in steps], fractions, color="tab:orange")
    ax_roof.bar_label(bars, labels=[f"{f:.1f}%\n{r['bound'][:3]}" for f, r in zip(fractions, steps)])
    ax_roof.set_ylabel("dsv4 decode step, % of roofline")
    peaks = results["roofline"]["peaks"]
    matmul_peak = peaks["matmul_" + results["dtype"] + "_gflop_s"]
    ax_roof.set_title(f"roofline: {peaks['read_bw_gb_s']:.0f} GB/s, {matmul_peak:.0f} GFLOP/s", fontsize=10)
    ax_roof.set_ylim(0, max(100.0, 1.2 * max(fractions)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for both engines")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="both engines' weights and activations")
    parser.add_argument("--compile", action="store_true",
                        help="dsv4 decode steps as one torch.compile'd graph (LLM(compile=True))")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    results = run(args)
    threads = f"_t{args.threads}" if args.threads != 1 else ""
    write_report(args.out / f"bench_{args.config}{FILE_SUFFIX[args.dtype]}{'_compiled' if args.compile else ''}"
                 f"{threads}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
