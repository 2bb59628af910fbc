"""Speculative decoding with the MTP drafter on the embedded model: acceptance, and tokens/s with speculation on vs off.

The model is the shipped `dsv4-sort` (FP8 dense, FP4 experts; its MTP layer is trained jointly with the target by
scripts/train_embedded.py), on its own task's held-out prompts (`dsv4.tasks.sort_digits`), greedy. For every batch
size B and number of draft tokens k, one engine with B cache slots answers the same prompts B at a time without
speculation and one with `draft="mtp", num_speculative_tokens=k` (speculating at every batch size): their outputs
must be identical (speculation is exact), and they are timed back to back (`paired.py`: the median of the pairs'
ratios, so that a neighbour slowing the machine slows both halves of a pair). Reported per (k, B):

  acceptance_rate        accepted drafts / verified drafts
  mean_accepted_length   tokens per verify step (accepted drafts + the target's own token; at most k + 1)
  per_position           acceptance of each draft position
  tok_s_off / tok_s_on   generated tokens per second, prompt included in the time (what a user waits for)
  speedup                tok_s_on / tok_s_off, the median of paired ratios (ratio_min / ratio_max: their spread);
                         the headline figure, the one the batch-1 goal is judged by
  decode_tok_s_off / decode_tok_s_on  the decode phase alone (TPOT-based): each answer's tokens after its first
                         over the time from its first token to its last (streamed, `_decode_seconds`), summed
                         over the answers; per sequence at batch > 1. The MTP pass over a prompt runs in the
                         step that yields the first token, so it is outside this figure (time to first token)
  decode_speedup         decode_tok_s_on / decode_tok_s_off, the median of its own paired ratios (decode_speedup_min
                         / decode_speedup_max), timed after the end-to-end pairs

  speedup_ceiling_free_verify  the plain run's ms over the speculating run's prompt steps alone (from `costs`):
                         the speedup if verify steps and their drafting cost nothing
  speedup_bound_perfect_drafter  (batch 1) the plain run's ms over what a drafter that is free and always right
                         would leave: per answer its prompt forward plus the fewest verify forwards that reach
                         its length (chunks of min(k + 1, tokens left) tokens), each a decode forward times its
                         chunk's `verify_cost` decode_rows_over_decode_step (forward ms from the plain `costs`
                         run, so that the bound's parts come from one run and a paired ratio): the most any
                         drafter could reach with this target
  answer_lengths         the generated tokens of each answer (what the bound is computed over)
  costs                  where the steps' time goes, from one more (untimed) run of each engine with the
                         engine's parts wrapped in timers (`StepCosts`): per step kind ("prefill": a chunk
                         starts at position 0; "decode": a plain decode step; "verify": a step verifying
                         drafts), its count and mean ms of target forward, drafting (the proposer's
                         `propose` + `end_step`: the MTP forwards and draft sampling) and everything else
                         (scheduling, sampling, accepting, rewinding), and the MTP forwards per verify step

and `verify_cost`: one target forward over a chunk of n = 1 .. k_max + 1 tokens of one sequence (a verify
chunk; n = 1 is a decode step) after a held-out prompt, ms as the median of `--repeats` x VERIFY_CALLS calls,
through the decode path (one row per token, what the engine runs) and, paired with it, through the padded
prefill path (decode_span=1, what verify chunks ran before), each also as a multiple of the decode step;

and `break_even_batch`: per k, the largest measured batch at which speculation still pays (speedup >= 1), the
measurement behind `speculation.DEFAULT_SPECULATION_MAX_BATCH`. Goals (issue 12): acceptance >= 0.85 at k=1, mean
accepted length >= 2.5 at k=3, batch-1 tokens/s with speculation >= 1.8x without (the best k).

Writes <out>/bench_speculation[_<expert dtype>][_quick].json and .png.
Usage: PYTHONPATH=src python benchmarks/bench_speculation.py [--ks 1 2 3 4] [--batches 1 2 4 8 16]
                                                            [--prompts 16] [--repeats 3] [--threads 1]
                                                            [--expert-dtype dense] [--quick]
Needs the `bench` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsv4 import LLM, SamplingParams
from dsv4.model.batch import ForwardBatch
from dsv4.tasks import sort_digits as task
from paired import paired

ROOT = Path(__file__).resolve().parent.parent
MODEL = "dsv4-sort"
PROMPT_SEED = 31337  # held-out: training draws from seeds 0.. of its own stream
GOALS = {"acceptance_k1": 0.85, "mean_accepted_length_k3": 2.5, "batch1_speedup": 1.8}
QUICK = {"ks": [1, 3], "batches": [1, 2], "prompts": 2, "repeats": 1}


def _engine(batch: int, k: int | None, expert_dtype: str | None = None) -> LLM:
    spec = {} if k is None else {"draft": "mtp", "num_speculative_tokens": k, "speculation_max_batch": batch}
    return LLM(MODEL, max_num_seqs=batch, max_num_batched_tokens=max(64, batch * 8), expert_dtype=expert_dtype,
               **spec)


def _answer(llm: LLM, prompts: list[str], batch: int) -> tuple[float, int, list[list[int]]]:
    """Every prompt, `batch` at a time: (seconds, generated tokens, token ids per prompt)."""
    params = SamplingParams(max_tokens=task.MAX_DIGITS + 2)
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outputs]
    return seconds, sum(len(t) for t in ids), ids


def _decode_seconds(llm: LLM, prompts: list[str], batch: int) -> float:
    """The same workload streamed: seconds per token of the decode phase (module docstring: the summed time
    from each answer's first token to its last over the summed tokens after each first one)."""
    params = SamplingParams(max_tokens=task.MAX_DIGITS + 2)
    seconds, tokens = 0.0, 0
    for i in range(0, len(prompts), batch):
        first: dict[str, tuple[float, int]] = {}  # request -> (time of its first token, tokens by then)
        counts: dict[str, int] = {}
        for delta in llm.stream(prompts[i : i + batch], params):
            now = time.perf_counter()
            counts[delta.request_id] = counts.get(delta.request_id, 0) + len(delta.outputs[0].token_ids)
            first.setdefault(delta.request_id, (now, counts[delta.request_id]))
            if delta.finished:
                start, at_first = first[delta.request_id]
                seconds += now - start
                tokens += counts[delta.request_id] - at_first
    if not tokens:
        raise AssertionError(f"batch={batch}: no answer had a token after its first (no decode phase to time)")
    return seconds / tokens


class StepCosts:
    """Times an engine's steps by part while active (a context manager): the engine's `step`, its runner's
    `execute` (the target forward), its proposer's `propose` and `end_step`, and the MTP drafter's forward
    calls, each wrapped on the instance and restored on exit. Per step kind (module docstring): steps and
    seconds of forward / draft / total, and MTP forwards."""

    PARTS = ("forward", "draft", "total")

    def __init__(self, llm: LLM):
        self.engine = llm.engine
        self.kinds: dict[str, dict[str, float]] = {}
        self._step: dict[str, float] = {}
        self._kind = "decode"
        self._saved: list[tuple[object, str]] = []

    def _wrap(self, obj, name: str, on_call) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            on_call(time.perf_counter() - start, *args, **kwargs)
            return out
        self._saved.append((obj, name))
        setattr(obj, name, timed)

    def __enter__(self) -> StepCosts:
        engine, proposer = self.engine, self.engine.proposer

        def on_execute(seconds, chunks, logit_rows, verify=(), *rest):
            self._kind = "prefill" if any(c.start == 0 for c in chunks) else "verify" if verify else "decode"
            self._step["forward"] += seconds

        def on_draft(seconds, *args):
            self._step["draft"] += seconds

        def on_mtp(seconds, *args, **kwargs):
            self._step["mtp_forwards"] += 1

        self._wrap(engine.runner, "execute", on_execute)
        if proposer is not None:
            self._wrap(proposer, "propose", on_draft)
            self._wrap(proposer, "end_step", on_draft)
            self._wrap(proposer.drafter, "forward", on_mtp)
        step = engine.step

        def timed_step():
            self._step = {"forward": 0.0, "draft": 0.0, "mtp_forwards": 0}
            start = time.perf_counter()
            out = step()
            totals = self.kinds.setdefault(self._kind, dict.fromkeys(("steps", "mtp_forwards", *self.PARTS), 0.0))
            totals["steps"] += 1
            totals["total"] += time.perf_counter() - start
            for part, value in self._step.items():
                totals[part] += value
            return out
        self._saved.append((engine, "step"))
        engine.step = timed_step
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in reversed(self._saved):
            delattr(obj, name)  # the instance attribute: the class's method shows again

    def report(self) -> dict:
        """{kind: {"steps", "forward_ms", "draft_ms", "other_ms" (per step means), "mtp_forwards_per_step"}}."""
        out = {}
        for kind, t in sorted(self.kinds.items()):
            n = t["steps"]
            out[kind] = {"steps": int(n), "forward_ms": 1e3 * t["forward"] / n, "draft_ms": 1e3 * t["draft"] / n,
                         "other_ms": 1e3 * (t["total"] - t["forward"] - t["draft"]) / n,
                         "mtp_forwards_per_step": t["mtp_forwards"] / n}
        return out


def _total_ms(part: dict | None) -> float:
    """All the ms of one step kind of a `StepCosts.report` (0 for a kind that did not occur)."""
    if part is None:
        return 0.0
    return (part["forward_ms"] + part["draft_ms"] + part["other_ms"]) * part["steps"]


def step_costs(llm: LLM, prompts: list[str], batch: int) -> dict:
    """`StepCosts.report` of one run of the workload."""
    with StepCosts(llm) as costs:
        _answer(llm, prompts, batch)
    return costs.report()


VERIFY_CALLS = 20  # forwards per timed sample of `verify_cost`


def verify_cost(llm: LLM, prompt: str, longest: int, repeats: int) -> list[dict]:
    """Per chunk length n in 1..longest: ms of one target forward over n tokens after `prompt` (module
    docstring), decode rows vs the prefill path, paired."""
    runner = llm.engine.runner
    model, cache = runner.model, runner.model.allocate_cache(1, llm.limits.max_model_len)
    ids = llm.tokenizer.encode(prompt).ids
    start = len(ids)
    with torch.inference_mode():
        model(ForwardBatch.build([(0, ids, 0)]), cache)

        def seconds(n: int, span: int) -> float:
            begin = time.perf_counter()
            for _ in range(VERIFY_CALLS):
                batch = ForwardBatch.build([(0, ids[:n], start)], decode_span=span)
                model(batch, cache)
            return (time.perf_counter() - begin) / VERIFY_CALLS

        rows = []
        for n in range(1, longest + 1):
            timing = paired(lambda n=n: seconds(n, 1), lambda n=n: seconds(n, runner.decode_span), repeats)
            rows.append({"tokens": n, "decode_rows_ms": 1e3 * timing.ds_s, "prefill_path_ms": 1e3 * timing.peer_s,
                         "prefill_path_over_decode_rows": timing.ratio})
    decode_ms = rows[0]["decode_rows_ms"]
    for row in rows:
        row["decode_rows_over_decode_step"] = row["decode_rows_ms"] / decode_ms
        row["prefill_path_over_decode_step"] = row["prefill_path_ms"] / decode_ms
    return rows


def measure(k: int, batch: int, prompts: list[str], repeats: int, plain: LLM, expert_dtype: str | None) -> dict:
    spec = _engine(batch, k, expert_dtype)
    _, tokens, plain_ids = _answer(plain, prompts, batch)
    _, _, spec_ids = _answer(spec, prompts, batch)
    if spec_ids != plain_ids:
        raise AssertionError(f"k={k} batch={batch}: speculative greedy output differs from plain greedy")
    spec.engine.speculation = type(spec.engine.speculation)()  # count the timed runs only
    timing = paired(lambda: _answer(plain, prompts, batch)[0], lambda: _answer(spec, prompts, batch)[0], repeats)
    metrics = spec.engine.speculation
    decode = paired(lambda: _decode_seconds(plain, prompts, batch), lambda: _decode_seconds(spec, prompts, batch),
                    repeats)
    costs = {"off": step_costs(plain, prompts, batch), "on": step_costs(spec, prompts, batch)}
    # What speculation could reach at best here: every verify step free, the prompt steps (target and MTP
    # forwards over the prompt) as measured: the workload's plain seconds over those.
    prompt_ms = _total_ms(costs["on"].get("prefill"))
    plain_ms = sum(_total_ms(part) for part in costs["off"].values())
    return {
        "k": k, "batch": batch, "tokens": tokens, "answer_lengths": [len(ids) for ids in plain_ids],
        "acceptance_rate": metrics.acceptance_rate, "mean_accepted_length": metrics.mean_accepted_length,
        "per_position": metrics.per_position_rate(), "verify_steps": metrics.verify_steps,
        "tok_s_off": tokens / timing.peer_s, "tok_s_on": tokens / timing.ds_s,
        "speedup": timing.ratio, "speedup_min": min(timing.ratios), "speedup_max": max(timing.ratios),
        "decode_tok_s_off": 1 / decode.peer_s, "decode_tok_s_on": 1 / decode.ds_s, "decode_speedup": decode.ratio,
        "decode_speedup_min": min(decode.ratios), "decode_speedup_max": max(decode.ratios),
        "costs": costs, "speedup_ceiling_free_verify": plain_ms / prompt_ms if prompt_ms else None,
    }


def perfect_drafter_bound(row: dict, verify_over_decode: dict[int, float]) -> float:
    """`speedup_bound_perfect_drafter` of a batch-1 row (module docstring); verify_over_decode: chunk tokens ->
    its forward's cost in decode forwards."""
    plain = row["costs"]["off"]
    bound_ms = 0.0
    for length in row["answer_lengths"]:
        bound_ms += plain["prefill"]["forward_ms"]  # the first token comes from the prompt's forward
        left = length - 1
        while left > 0:
            chunk = min(row["k"] + 1, left)
            bound_ms += verify_over_decode[chunk] * plain["decode"]["forward_ms"]
            left -= chunk
    return sum(_total_ms(part) for part in plain.values()) / bound_ms


def break_even(rows: list[dict]) -> dict[str, int]:
    """Per k, the largest batch at which speculation paid (0: at none)."""
    out = {}
    for k in sorted({r["k"] for r in rows}):
        paying = [r["batch"] for r in rows if r["k"] == k and r["speedup"] >= 1.0]
        out[str(k)] = max(paying, default=0)
    return out


def goals(rows: list[dict]) -> dict:
    def at(k: int, batch: int = 1):
        return next((r for r in rows if r["k"] == k and r["batch"] == batch), None)

    figures = {
        "acceptance_k1": at(1)["acceptance_rate"] if at(1) else None,
        "mean_accepted_length_k3": at(3)["mean_accepted_length"] if at(3) else None,
        "batch1_speedup": max((r["speedup"] for r in rows if r["batch"] == 1), default=None),
    }
    return {name: {"value": value, "goal": GOALS[name], "met": value is not None and value >= GOALS[name]}
            for name, value in figures.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ks = sorted({r["k"] for r in rows})
    fig, (left, right, parts) = plt.subplots(1, 3, figsize=(16, 4))
    for k in ks:
        mine = sorted((r for r in rows if r["k"] == k), key=lambda r: r["batch"])
        batches = [r["batch"] for r in mine]
        (line,) = left.plot(batches, [r["speedup"] for r in mine], marker="o", label=f"k={k}, end to end")
        left.fill_between(batches, [r["speedup_min"] for r in mine], [r["speedup_max"] for r in mine], alpha=0.15)
        left.plot(batches, [r["decode_speedup"] for r in mine], marker="x", ls="--", color=line.get_color(),
                  label=f"k={k}, decode phase (TPOT)")
    left.axhline(1.0, color="grey", lw=0.8)
    left.axhline(GOALS["batch1_speedup"], color="green", lw=0.8, ls="--", label="batch-1 goal")
    left.set_xscale("log", base=2)
    left.set_xlabel("batch size (sequences decoding together)")
    left.set_ylabel("tokens/s with speculation / without (paired)")
    left.legend(fontsize=7)
    batches = sorted({r["batch"] for r in rows})
    for batch in batches:
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["k"])
        right.plot([r["k"] for r in mine], [r["mean_accepted_length"] for r in mine], marker="o",
                   label=f"batch {batch}")
    right.plot(ks, [k + 1 for k in ks], color="grey", lw=0.8, ls=":", label="k + 1 (all accepted)")
    right.set_xlabel("draft tokens per step (k)")
    right.set_ylabel("mean accepted length (tokens per verify step)")
    right.legend()
    _plot_costs(parts, rows)
    fig.suptitle(f"MTP speculative decoding on {MODEL} ({result['machine']['threads']} thread(s))")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COST_PARTS = (  # (engine, step kind, StepCosts field, label) stacked per bar of the cost panel
    ("prefill", "forward_ms", "prefill forward"), ("prefill", "draft_ms", "prefill: MTP over the prompt"),
    ("decode", "forward_ms", "decode forward"), ("verify", "forward_ms", "verify forward"),
    ("verify", "draft_ms", "drafting (MTP forwards, draft sampling)"),
)


def _plot_costs(ax, rows: list[dict]) -> None:
    """Batch 1: ms per generated token, by part (`StepCosts`), without speculation and with it per k."""
    import matplotlib.pyplot as plt

    mine = sorted((r for r in rows if r["batch"] == 1), key=lambda r: r["k"])
    if not mine:
        return
    bars = [("off", mine[0]["costs"]["off"], mine[0]["tokens"])]
    bars += [(f"k={r['k']}", r["costs"]["on"], r["tokens"]) for r in mine]
    colors = [plt.get_cmap("tab10")(i) for i in range(len(COST_PARTS) + 1)]
    labelled = set()
    for x, (_, costs, tokens) in enumerate(bars):
        values = [costs[kind][field] * costs[kind]["steps"] / tokens if kind in costs else 0.0
                  for kind, field, _ in COST_PARTS]
        values.append(sum(p["other_ms"] * p["steps"] for p in costs.values()) / tokens)
        labels = [label for _, _, label in COST_PARTS] + ["other (schedule, sample, accept, rewind)"]
        bottom = 0.0
        for value, label, color in zip(values, labels, colors):
            shown = value > 0 and label not in labelled
            labelled |= {label} if shown else set()
            ax.bar(x, value, bottom=bottom, color=color, label=label if shown else None)
            bottom += value
    ax.set_xticks(range(len(bars)), [name for name, _, _ in bars])
    ax.set_ylabel("ms per generated token (batch 1)")
    ax.set_xlabel("one instrumented run per engine (StepCosts)")
    ax.legend(fontsize=7)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    prompts = [ex.prompt for ex in task.examples(args.prompts, PROMPT_SEED)]
    rows = []
    for batch in args.batches:
        plain = _engine(batch, None, args.expert_dtype)
        for k in args.ks:
            rows.append(measure(k, batch, prompts, args.repeats, plain, args.expert_dtype))
            r = rows[-1]
            print(f"k={k} batch={batch}: acceptance {r['acceptance_rate']:.3f}, mean accepted length "
                  f"{r['mean_accepted_length']:.2f}, {r['tok_s_off']:.1f} -> {r['tok_s_on']:.1f} tok/s "
                  f"(x{r['speedup']:.2f}); decode phase x{r['decode_speedup']:.2f}", flush=True)
    costs = verify_cost(_engine(1, None, args.expert_dtype), prompts[0], max(args.ks) + 1, args.repeats)
    verify_over_decode = {row["tokens"]: row["decode_rows_over_decode_step"] for row in costs}
    for r in rows:
        if r["batch"] == 1:
            r["speedup_bound_perfect_drafter"] = perfect_drafter_bound(r, verify_over_decode)
    return {
        "model": MODEL, "expert_dtype": args.expert_dtype or "shipped (fp4)", "prompts": args.prompts,
        "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "rows": rows, "break_even_batch": break_even(rows), "goals": goals(rows), "verify_cost": costs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts answered per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="back-to-back (off, on) pairs per figure")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--expert-dtype", choices=("fp4", "fp8", "dense"), default=None,
                        help="routed experts' resident format (default: the shipped FP4)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} (smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "bench_speculation" + (f"_{args.expert_dtype}" if args.expert_dtype else "")
    stem += "_quick" if args.quick else ""
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / f"{stem}.png")
    print(json.dumps({"break_even_batch": result["break_even_batch"], "goals": result["goals"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
