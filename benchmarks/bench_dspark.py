"""DSpark speculative decoding on the embedded model: mean accepted length at block size 5, and batch-1
tokens/s with DSpark against no speculation (and against MTP when the engine offers `draft="mtp"`).

Arms, all greedy over the same seeded digit-sorting prompts (the task the embedded model was trained on),
one sequence at a time (max_num_seqs=1), torch on `--threads` threads:

  plain    `LLM("dsv4-sort-dspark")`: the target alone (the same bytes as dsv4-sort's target)
  dspark   `LLM("dsv4-sort-dspark", draft="dspark")`: a block of 5 drafts per step, verified in one forward
  mtp      `LLM("dsv4-sort", draft="mtp")`, only if that engine drafts with it (`engine.proposer` set);
           otherwise skipped with a note

Accepted length: the tokens one verify step adds (its accepted drafts plus the target's own next token),
averaged over verify steps: (generated tokens - one per prompt, sampled by its prefill) / verify steps, the
verify steps counted as engine steps minus the prompts' prefill steps (each prompt fits one step). Every arm
must produce the plain arm's tokens (checked: speculation is lossless).

tokens/s: generated tokens / wall seconds of the whole prompt set. The arms are warmed once, then run in
turn `--repeats` times; each speed ratio is the median over rounds of the ratio within a round (a neighbour
that slows the machine slows a round's arms alike). The DSpark arm also runs a sweep of verify thresholds
(the confidence head's running product, `dspark_proposer.DEFAULT_VERIFY_THRESHOLD` by default) for the
accepted length it buys.

Goals (issue 13): mean accepted length >= 3.0; DSpark tokens/s >= 1.3x MTP's.

Writes <out>/bench_dspark[_quick].json and .png.
Usage: PYTHONPATH=src python benchmarks/bench_dspark.py [--prompts 48] [--repeats 5] [--threads 1]
                                                        [--expert-dtype fp4|dense] [--quick]
Needs the `bench` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv4 import LLM, SamplingParams
from dsv4.embedded import DEFAULT_MODEL, DSPARK_MODEL
from dsv4.engine.dspark_proposer import DEFAULT_VERIFY_THRESHOLD, build_dspark_proposer
from dsv4.errors import ConfigError
from dsv4.tasks import sort_digits as task

ROOT = Path(__file__).resolve().parent.parent
PROMPT_SEED = 2024
GOAL_ACCEPTED_LENGTH = 3.0
GOAL_SPEEDUP_OVER_MTP = 1.3
THRESHOLDS = (0.0, DEFAULT_VERIFY_THRESHOLD, 0.5, 0.9)


class CountingRun:
    """Runs a prompt set through one LLM, counting the engine steps (instance attribute over `step`)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.steps = 0
        step = llm.engine.step

        def counted():
            self.steps += 1
            return step()

        llm.engine.step = counted

    def __call__(self, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]], int]:
        """-> (wall seconds, the outputs' token ids, engine steps taken)."""
        before = self.steps
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return seconds, [o.outputs[0].token_ids for o in outputs], self.steps - before


def accepted_length(tokens: list[list[int]], steps: int, prompts: int) -> float:
    """Mean tokens per verify step (module docstring)."""
    verifies = steps - prompts
    return sum(len(t) - 1 for t in tokens) / max(1, verifies)


def build_arms(expert_dtype: str | None) -> tuple[dict[str, CountingRun], list[str]]:
    options = {"max_num_seqs": 1, "expert_dtype": expert_dtype}
    arms = {"plain": CountingRun(LLM(DSPARK_MODEL, **options)),
            "dspark": CountingRun(LLM(DSPARK_MODEL, draft="dspark", **options))}
    notes = []
    try:
        mtp = LLM(DEFAULT_MODEL, draft="mtp", **options)
    except ConfigError as exc:
        mtp = None
        notes.append(f"mtp arm skipped: {exc}")
    if mtp is not None and mtp.engine.proposer is None:
        notes.append("mtp arm skipped: LLM(draft='mtp') loads the MTP layer but its engine does not draft with it")
        mtp = None
    if mtp is not None:
        arms["mtp"] = CountingRun(mtp)
    for note in notes:
        print(note, flush=True)
    return arms, notes


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    prompts = [[task.BOS_ID, *task.encode(ex.prompt)] for ex in task.examples(args.prompts, seed=PROMPT_SEED)]
    params = SamplingParams(max_tokens=task.MAX_SEQ_LEN)
    arms, notes = build_arms(args.expert_dtype)
    for arm in arms.values():  # warm-up (lazy init, allocator)
        arm(prompts[: max(1, len(prompts) // 8)], params)
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    lengths: dict[str, float] = {}
    reference = None
    for _ in range(args.repeats):
        for name, arm in arms.items():
            s, tokens, steps = arm(prompts, params)
            if reference is None:
                reference = tokens
            if tokens != reference:
                raise SystemExit(f"{name}: speculative output differs from plain greedy")
            seconds[name].append(s)
            lengths[name] = accepted_length(tokens, steps, len(prompts))
    generated = sum(len(t) for t in reference)
    out = {"arms": {}, "notes": notes}
    for name in arms:
        out["arms"][name] = {"seconds_median": statistics.median(seconds[name]),
                             "tokens_per_s": generated / statistics.median(seconds[name]),
                             "accepted_length": None if name == "plain" else lengths[name]}

    def ratio(fast: str, slow: str) -> dict:
        per_round = [b / a for a, b in zip(seconds[fast], seconds[slow])]
        return {"ratio": statistics.median(per_round), "ratio_min": min(per_round), "ratio_max": max(per_round)}

    out["dspark_vs_plain"] = ratio("dspark", "plain")
    if "mtp" in arms:
        out["dspark_vs_mtp"] = {**ratio("dspark", "mtp"), "goal": GOAL_SPEEDUP_OVER_MTP}
        out["dspark_vs_mtp"]["meets_goal"] = out["dspark_vs_mtp"]["ratio"] >= GOAL_SPEEDUP_OVER_MTP
        out["mtp_vs_plain"] = ratio("mtp", "plain")
    dspark_length = out["arms"]["dspark"]["accepted_length"]
    out["accepted_length"] = {"value": dspark_length, "goal": GOAL_ACCEPTED_LENGTH,
                              "meets_goal": dspark_length >= GOAL_ACCEPTED_LENGTH, "block_size": 5}
    out["threshold_sweep"] = threshold_sweep(arms["dspark"], prompts, params, reference)
    out["setup"] = {"prompts": len(prompts), "generated_tokens": generated, "repeats": args.repeats,
                    "threads": args.threads, "expert_dtype": args.expert_dtype or "as shipped (fp4)",
                    "verify_threshold": DEFAULT_VERIFY_THRESHOLD, "machine": platform.machine(),
                    "python": sys.version.split()[0], "torch": torch.__version__}
    return out


def threshold_sweep(arm: CountingRun, prompts, params, reference) -> list[dict]:
    """Accepted length and seconds of the DSpark arm at each verify threshold (one run each)."""
    llm = arm.llm
    default = llm.engine.proposer
    rows = []
    try:
        for threshold in THRESHOLDS:
            proposer = build_dspark_proposer(llm.loaded, llm.limits, None, 0, verify_threshold=threshold)
            llm.engine.proposer = proposer
            s, tokens, steps = arm(prompts, params)
            if tokens != reference:
                raise SystemExit(f"dspark at threshold {threshold}: output differs from plain greedy")
            rows.append({"threshold": threshold, "accepted_length": accepted_length(tokens, steps, len(prompts)),
                         "drafted_per_verify": proposer.stats.drafted / max(1, proposer.stats.verifies),
                         "seconds": s})
    finally:
        llm.engine.proposer = default
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(results["arms"])
    left.bar(names, [results["arms"][n]["tokens_per_s"] for n in names], color="tab:blue")
    left.set_ylabel("tokens / s (batch 1)")
    left.set_title("decode speed")
    sweep = results["threshold_sweep"]
    right.plot([r["threshold"] for r in sweep], [r["accepted_length"] for r in sweep], marker="o", label="DSpark")
    right.axhline(GOAL_ACCEPTED_LENGTH, color="gray", linestyle="--", label="goal")
    if "mtp" in results["arms"]:
        right.axhline(results["arms"]["mtp"]["accepted_length"], color="tab:orange", label="MTP")
    right.set_xlabel("verify threshold")
    right.set_ylabel("mean accepted length (tokens / verify step)")
    right.set_title("acceptance, block size 5")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--expert-dtype", choices=("fp4", "dense"), default=None,
                   help="routed experts' resident format (default: as shipped, FP4)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--quick", action="store_true", help="a few prompts, one round: checks the machinery")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 4, 1
    threads = torch.get_num_threads()
    try:
        results = run(args)
    finally:
        torch.set_num_threads(threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "bench_dspark_quick" if args.quick else "bench_dspark" + (f"_{args.expert_dtype}" if args.expert_dtype
                                                                     else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / f"{stem}.png")
    print(json.dumps({k: v for k, v in results.items() if k != "threshold_sweep"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
