"""Score the embedded models on their task (`dsv4 eval`).

`evaluate()` draws a fresh seeded held-out sample of the task (`dsv4.tasks.sort_digits`) and measures
greedy exact-match accuracy, through `LLM` (the same path as any checkpoint), for:

  bf16     the bf16 weights training produced (HF layout, dense experts)
  fp8      the same checkpoint with routed experts quantized on load by dsv4's quantizer (FP8 e4m3)
  fp4      the same with FP4 (e2m1, ue8m0 per 32 inputs)
  shipped  the shipped native checkpoint (FP8 dense, FP4 experts): `LLM()`, the package default

plus the MTP drafter's top-1 agreement with the shipped target's next-next token: over each greedy
completion, at every position t where the drafter would run (t from the last prompt token on), the
drafter sees the target's stream at t and token t+1 and its argmax is compared with token t+2; and the
acceptance of speculative decoding with it (the shipped variant generates with `draft="mtp"`, k =
`SPECULATIVE_TOKENS`, speculating at every batch size).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from dsv4.embedded import BF16_MODEL, DEFAULT_MODEL, EMBEDDED_MODELS
from dsv4.engine.validation import require_int
from dsv4.errors import ConfigError
from dsv4.progress import LOGGER
from dsv4.tasks import sort_digits as task

DEFAULT_N = 256
DEFAULT_SEED = 20260  # held-out: training draws from seeds 0.. of its own stream
_MAX_CONCURRENCY = 64
SPECULATIVE_TOKENS = 3
VARIANTS = ("bf16", "fp8", "fp4", "shipped")


@dataclass(frozen=True)
class EvalResult:
    n: int
    accuracy: dict[str, float]
    mtp_top1_agreement: float
    seconds: dict[str, float]
    speculation: dict | None = None  # the shipped variant's `SpeculationMetrics.as_dict()`

    def to_json(self) -> dict:
        return {"n": self.n, "accuracy": dict(self.accuracy), "mtp_top1_agreement": self.mtp_top1_agreement,
                "speculation": self.speculation}


def _greedy(llm, prompts: list[str]):
    from dsv4.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=task.MAX_DIGITS + 2)
    return llm.generate(prompts, params)


def exact_match(outputs, examples: list[task.Example]) -> float:
    hits = 0
    for out, ex in zip(outputs, examples):
        completion = out.outputs[0]
        hits += completion.finish_reason == "stop" and completion.text == ex.answer
    return hits / max(1, len(examples))


def mtp_agreement(llm, outputs) -> float:
    """Top-1 agreement of the MTP draft with the target's token two ahead, teacher-forced on the
    target's own greedy completions (what speculative decoding would have to guess)."""
    import torch  # imported here so that `dsv4 eval --help` reads this module's defaults without torch

    from dsv4.model.batch import ForwardBatch

    target, mtp = llm.loaded.target, llm.loaded.models["mtp"]
    seqs = [(list(o.prompt_token_ids), list(o.prompt_token_ids) + list(o.outputs[0].token_ids)) for o in outputs]
    seqs = [(p, s) for p, s in seqs if len(s) >= len(p) + 2]
    if not seqs:
        return 0.0
    max_len = max(len(s) for _, s in seqs) + 1
    batch = ForwardBatch.build([(i, s, 0) for i, (_, s) in enumerate(seqs)])
    draft_batch = ForwardBatch.build([(i, s[1:], 0) for i, (_, s) in enumerate(seqs)])
    src = torch.cat([torch.arange(seg.begin, seg.end - 1) for seg in batch.segments])
    with torch.inference_mode():
        streams, _ = target(batch, target.allocate_cache(len(seqs), max_len))
        _, logits = mtp(draft_batch, streams[src], mtp.allocate_cache(len(seqs), max_len))
    drafts = logits.argmax(dim=-1).tolist()
    hits = total = 0
    for seg, (prompt, seq) in zip(draft_batch.segments, seqs):
        for t in range(len(prompt) - 1, len(seq) - 2):  # stream at t + token t+1 -> token t+2
            hits += drafts[seg.begin + t] == seq[t + 2]
            total += 1
    return hits / max(1, total)


def evaluate(n: int = DEFAULT_N, seed: int = DEFAULT_SEED, models_dir: str | Path | None = None,
             variants: tuple[str, ...] = VARIANTS) -> EvalResult:
    """Score the embedded models on held-out examples of their task.

    Progress: each variant's generation shows as a bar on a terminal or periodic log lines otherwise
    (`dsv4.progress`), and a log line reports each variant as it completes.

    Args:
        n: examples drawn (>= 1).
        seed: seed of the draw.
        models_dir: score the two model folders a training run wrote there instead of the embedded ones.
        variants: which of `VARIANTS` to score.

    Returns:
        Accuracy and time per variant, and the MTP drafter's top-1 agreement (NaN without "shipped").

    Raises:
        ConfigError: n < 1 or an unknown variant.
    """
    from dsv4.engine.llm import LLM

    require_int("evaluate: n", n, minimum=1)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"evaluate: unknown variant(s) {unknown}; expected some of {VARIANTS}")

    if models_dir is not None:
        bf16_path, shipped_path = Path(models_dir) / BF16_MODEL, Path(models_dir) / DEFAULT_MODEL
    else:
        bf16_path, shipped_path = EMBEDDED_MODELS[BF16_MODEL][0], None  # None: LLM() loads the default
    examples = task.examples(n, seed)
    prompts = [ex.prompt for ex in examples]
    accuracy: dict[str, float] = {}
    seconds: dict[str, float] = {}
    agreement = float("nan")
    speculation = None
    for variant in variants:
        t0 = time.perf_counter()
        if variant == "shipped":
            llm = LLM(shipped_path, draft="mtp", max_num_seqs=_MAX_CONCURRENCY,
                      num_speculative_tokens=SPECULATIVE_TOKENS, speculation_max_batch=_MAX_CONCURRENCY)
        else:
            expert_dtype = None if variant == "bf16" else variant
            llm = LLM(bf16_path, expert_dtype=expert_dtype, max_num_seqs=_MAX_CONCURRENCY)
        outputs = _greedy(llm, prompts)
        accuracy[variant] = exact_match(outputs, examples)
        if variant == "shipped":
            agreement = mtp_agreement(llm, outputs)
            speculation = llm.engine.speculation.as_dict()
        seconds[variant] = time.perf_counter() - t0
        LOGGER.info("eval: %s (%d/%d) accuracy %.4f in %.1f s", variant, len(accuracy), len(variants),
                    accuracy[variant], seconds[variant])
    return EvalResult(n=n, accuracy=accuracy, mtp_top1_agreement=agreement, seconds=seconds, speculation=speculation)


_DESCRIPTIONS = {
    "bf16": f"{BF16_MODEL} (HF layout, bf16 experts)",
    "fp8": f"{BF16_MODEL}, experts -> FP8 on load",
    "fp4": f"{BF16_MODEL}, experts -> FP4 on load",
    "shipped": f"{DEFAULT_MODEL} (native FP8 + FP4, default)",
}


def format_table(result: EvalResult) -> str:
    width = max(len(d) for d in _DESCRIPTIONS.values())
    lines = [f"task: {task.NAME} (e.g. '{task.DEMO_PROMPTS[0]}' -> '{task.solve(task.DEMO_PROMPTS[0])}'), "
             f"greedy exact match on {result.n} held-out prompts",
             f"{'variant':<8}  {'model':<{width}}  {'accuracy':>8}  {'time':>6}"]
    for variant, acc in result.accuracy.items():
        lines.append(f"{variant:<8}  {_DESCRIPTIONS[variant]:<{width}}  {acc:>8.4f}  {result.seconds[variant]:>5.1f}s")
    lines.append("MTP draft top-1 agreement with the target's next-next token (shipped): "
                 f"{result.mtp_top1_agreement:.4f}")
    if result.speculation is not None:
        spec = result.speculation
        per_position = ", ".join(f"{a / d:.2f}" if d else "-" for a, d in
                                 zip(spec["accepted_per_position"], spec["drafted_per_position"]))
        lines.append(f"speculative decoding with it (k={SPECULATIVE_TOKENS}): acceptance "
                     f"{spec['acceptance_rate']:.4f}, mean accepted length {spec['mean_accepted_length']:.2f}, "
                     f"per draft position [{per_position}]")
    return "\n".join(lines)
