"""Shared prompt prefill on RL-shaped batches: 16 prompts x 8 samples, sharing on vs off, in one process.

The workload is a GRPO rollout's: --prompts random prompts of --prompt-len tokens, each asked for --samples
completions (`SamplingParams(n=...)`, seeded sampling at temperature 1) of --new-tokens tokens, all submitted
at once (`LLM.generate`, prefill included in the time). One engine serves both sides; between runs only
`Engine.share_prompt_prefill` flips (on: the n completions of a prompt prefill it once and fork the slot
state; off: every completion prefills its prompt itself). The sides alternate --repeats times after a warm-up
each (`paired.py`): speedup is the median over back-to-back pairs of off seconds / on seconds (ratio_min /
ratio_max: their spread). Both sides must return the same tokens (checked on the warm-up runs: sharing
changes no output), and the prompt tokens the model computed per run are counted.

Configs: "tiny" (tests/reference.py's 4-layer tiny config) and "small" (its ~77M small config), random weights.

Writes <out>/bench_shared_prefill[_quick].json and .png.
Usage: PYTHONPATH=src python benchmarks/bench_shared_prefill.py [--configs tiny small] [--prompts 16]
                                                               [--samples 8] [--prompt-len 128]
                                                               [--new-tokens 16] [--repeats 3] [--threads 1]
                                                               [--quick]
Needs the `test` extra (transformers builds the random models) and the `bench` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the randomised reference models live with the tests
sys.path.insert(0, str(ROOT / "benchmarks"))

import reference as ref  # noqa: E402
from dsv4 import LLM, SamplingParams  # noqa: E402
from paired import paired  # noqa: E402
from report import write_report  # noqa: E402

CONFIGS = {"tiny": ref.tiny_config, "small": ref.small_config}
MODEL_SEED, PROMPT_SEED, SAMPLE_SEED = 0, 1, 2
# Ids 0 and 1 are bos / eos in the reference configs; prompts draw from the rest.
FIRST_ORDINARY_ID = 2
QUICK = {"configs": ["tiny"], "prompts": 2, "samples": 2, "prompt_len": 40, "new_tokens": 4, "repeats": 1}


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(FIRST_ORDINARY_ID, vocab, (length,), generator=g).tolist() for _ in range(count)]


class Rollout:
    """One config's engine and workload; `run(share)` generates every completion once."""

    def __init__(self, path: str, args, vocab: int):
        self.prompts = _prompts(args.prompts, args.prompt_len, vocab)
        self.params = SamplingParams(n=args.samples, max_tokens=args.new_tokens, temperature=1.0,
                                     seed=SAMPLE_SEED, ignore_eos=True)
        sequences = args.prompts * args.samples
        self.llm = LLM(path, dtype="float32", max_num_seqs=sequences, max_model_len=args.prompt_len + args.new_tokens,
                       max_num_batched_tokens=max(sequences, min(sequences * args.prompt_len, 2048)))
        self.prompt_tokens = 0  # prompt tokens the model computed in the last run
        runner = self.llm.engine.runner
        execute = runner.execute
        prompt_len = args.prompt_len

        def counting(chunks, *rest, **kwargs):
            self.prompt_tokens += sum(min(len(c.token_ids), prompt_len - c.start)
                                      for c in chunks if c.start < prompt_len)
            return execute(chunks, *rest, **kwargs)

        runner.execute = counting

    def run(self, share: bool) -> tuple[float, list[list[list[int]]]]:
        """Seconds to generate every completion, and their tokens per prompt."""
        self.llm.engine.share_prompt_prefill = share
        self.prompt_tokens = 0
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, [[c.token_ids for c in o.outputs] for o in outputs]


def measure(config: str, args) -> dict:
    cfg = CONFIGS[config]()
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_hf_checkpoint(ref.build_reference_model(cfg, MODEL_SEED), tmp)
        rollout = Rollout(tmp, args, cfg["vocab_size"])
    computed = {}
    tokens = {}
    for share in (False, True):  # the warm-ups: outputs and prompt work of each side
        _, tokens[share] = rollout.run(share)
        computed[share] = rollout.prompt_tokens
    identical = tokens[True] == tokens[False]
    if not identical:
        raise AssertionError(f"{config}: sharing the prefill changed the sampled tokens")
    t = paired(lambda: rollout.run(False)[0], lambda: rollout.run(True)[0], args.repeats)
    generated = args.prompts * args.samples * args.new_tokens
    row = {"config": config, "off_s": t.peer_s, "on_s": t.ds_s, "off_tok_s": generated / t.peer_s,
           "on_tok_s": generated / t.ds_s, "speedup": t.ratio, "speedup_min": min(t.ratios),
           "speedup_max": max(t.ratios), "pairs": list(t.ratios), "prompt_tokens_off": computed[False],
           "prompt_tokens_on": computed[True], "outputs_identical": identical}
    print(f"{config}: off {t.peer_s:.2f} s, on {t.ds_s:.2f} s, speedup x{t.ratio:.2f} "
          f"(pairs {', '.join(f'{r:.2f}' for r in t.ratios)}); prompt tokens computed {computed[False]} -> "
          f"{computed[True]}", flush=True)
    return row


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    width = 0.38
    off = ax.bar([i - width / 2 for i in x], [r["off_s"] for r in rows], width, label="sharing off", color="tab:grey")
    on = ax.bar([i + width / 2 for i in x], [r["on_s"] for r in rows], width, label="sharing on", color="tab:blue")
    ax.bar_label(off, fmt="%.2f s")
    ax.bar_label(on, fmt="%.2f s")
    ax.set_xticks(list(x), [r["config"] for r in rows])
    ax.set_ylabel("seconds per rollout (median)")
    ax.set_title(f"{results['prompts']} prompts x {results['samples']} samples, {results['prompt_len']}-token "
                 f"prompts, {results['new_tokens']} new tokens", fontsize=9)
    ax.legend()
    speedups = [r["speedup"] for r in rows]
    spread = [[r["speedup"] - r["speedup_min"] for r in rows], [r["speedup_max"] - r["speedup"] for r in rows]]
    bars = ax_ratio.bar([r["config"] for r in rows], speedups, yerr=spread, capsize=4, color="tab:green")
    ax_ratio.bar_label(bars, labels=[f"x{s:.2f}" for s in speedups])
    ax_ratio.axhline(1.0, color="grey", linewidth=1)
    ax_ratio.set_ylabel("off / on seconds (median pair, bars: range)")
    ax_ratio.set_title(f"{results['threads']} thread(s), {results['repeats']} pairs", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["tiny", "small"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (n)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a seconds-long run of the machinery (tests)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = {"prompts": args.prompts, "samples": args.samples, "prompt_len": args.prompt_len,
                   "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
                   "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                   "rows": [measure(config, args) for config in args.configs]}
    finally:
        torch.set_num_threads(saved)
    write_report(args.out / f"bench_shared_prefill{'_quick' if args.quick else ''}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
