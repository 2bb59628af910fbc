"""`dsv4 generate`: answer prompts with a checkpoint or an embedded model, and say how fast.

The speed line separates what a user waits for once (loading the weights), per request (the first token:
prompt prefill plus any first-call overhead) and per token (steady decode, measured from the moment every
request has its first token to the end).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field

from dsv4.cli.arguments import (
    add_engine_arguments,
    embedded_model_help,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from dsv4.embedded import DEFAULT_MODEL

# Token-id prompts the CLI uses when the model has no tokenizer (taken modulo the vocabulary).
DEMO_TOKEN_PROMPTS = ((2, 3, 4, 5), (10, 20, 30), (7,))
TOKEN_ID_PROMPT = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")
DEFAULT_MAX_TOKENS = 16
EXIT_OK, EXIT_REJECTED = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dsv4 generate`."""
    parser.add_argument("prompt", nargs="*",
                        help='text, or token ids like "1,2,3" (none: a few demo prompts for the model)')
    parser.add_argument("--model", default=DEFAULT_MODEL, help=embedded_model_help())
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                        help="dummy: seeded dummy weights from config.json alone")
    parser.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                        help="tokens to generate per prompt at most")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed")
    add_engine_arguments(parser)


def parse_prompt(prompt: str) -> str | list[int]:
    """A command-line prompt: "1,2,3" is token ids, anything else is text."""
    if TOKEN_ID_PROMPT.match(prompt):
        return [int(t) for t in prompt.split(",")]
    return prompt


@dataclass
class _Answer:
    """One prompt's accumulated stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    has_text: bool = False
    finish_reason: str | None = None
    error: str | None = None


def run(args: argparse.Namespace) -> int:
    """Load the model, stream the answers, print them and the timing line.

    Returns:
        0 when every prompt was answered, 2 when any was rejected (its error is printed in its place).
    """
    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.progress import Progress

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    start = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, activation_dtype=args.activation_dtype,
              device=args.device, seed=args.seed, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens)
    loaded = time.perf_counter()
    prompts = [parse_prompt(p) for p in args.prompt] or _demo_prompts(llm)

    answers: dict[str, _Answer] = {}
    keys: dict[str, tuple] = {}  # request id -> its prompt, as `_key` spells it
    first_token: dict[str, float] = {}
    token_times: list[tuple[float, int]] = []  # (arrival, tokens) per delta
    with Progress(len(prompts), "generate", "req") as progress:
        for out in llm.stream(prompts, params):
            now = time.perf_counter()
            answer = answers.setdefault(out.request_id, _Answer())
            keys.setdefault(out.request_id, _key(out.prompt, out.prompt_token_ids))
            if out.error is not None:
                answer.error = out.error
                progress.update()
                continue
            delta = out.outputs[0]
            if delta.token_ids:
                first_token.setdefault(out.request_id, now)
                token_times.append((now, len(delta.token_ids)))
            answer.token_ids += delta.token_ids
            answer.has_text = delta.text is not None
            answer.text += delta.text or ""
            answer.finish_reason = delta.finish_reason
            if out.finished:
                progress.update()
    done = time.perf_counter()

    rejected = 0
    for prompt, answer in zip(prompts, _in_prompt_order(prompts, keys, answers)):
        print(f"prompt: {prompt if isinstance(prompt, str) else ','.join(map(str, prompt))}")
        if answer.error is not None:
            rejected += 1
            print(f"error: {answer.error}")
            continue
        shown = answer.text if answer.has_text else ",".join(map(str, answer.token_ids))
        print(f"answer: {shown}  [{answer.finish_reason}]")
    speed = _speed_line(loaded - start, loaded, first_token, token_times, done)
    print(f"{speed}; weights version {llm.weights_version}")
    if llm.speculation is not None:
        print(speculation_line(llm.engine.proposer.num_speculative_tokens, llm.engine.speculation))
    if rejected:
        print(f"dsv4 generate: {rejected} of {len(prompts)} prompt(s) rejected", file=sys.stderr)
        return EXIT_REJECTED
    return EXIT_OK


def speculation_line(k: int, metrics) -> str:
    """The engine's speculative-decoding totals (`SpeculationMetrics`) in one line."""
    per_position = ", ".join(f"{rate:.2f}" for rate in metrics.per_position_rate())
    return (f"speculation (k={k}): {metrics.verify_steps} verify steps, {metrics.accepted_tokens}/"
            f"{metrics.draft_tokens} drafts accepted ({metrics.acceptance_rate:.2f}), mean accepted length "
            f"{metrics.mean_accepted_length:.2f}, acceptance per draft position [{per_position}]")


def _demo_prompts(llm) -> list[str | list[int]]:
    if llm.tokenizer is not None:
        from dsv4.tasks.sort_digits import DEMO_PROMPTS  # the embedded default model's task

        return list(DEMO_PROMPTS)
    return [[t % llm.config.vocab_size for t in ids] for ids in DEMO_TOKEN_PROMPTS]


def _key(text: str | None, token_ids: list[int]) -> tuple:
    return ("text", text) if text is not None else ("ids", tuple(token_ids))


def _in_prompt_order(prompts: list, keys: dict[str, tuple], answers: dict[str, _Answer]) -> list[_Answer]:
    """Answers matched to prompts by content: identical prompts are interchangeable, so any match of equal
    prompts is a correct one."""
    unused: dict[tuple, list[str]] = {}
    for request_id, key in keys.items():
        unused.setdefault(key, []).append(request_id)
    ordered = []
    for prompt in prompts:
        key = ("text", prompt) if isinstance(prompt, str) else ("ids", tuple(prompt))
        ordered.append(answers[unused[key].pop(0)])
    return ordered


def _speed_line(load_s: float, started: float, first_token: dict[str, float],
                token_times: list[tuple[float, int]], done: float) -> str:
    """load; first token (the earliest request's); steady decode over the tokens generated after every
    request had its first token."""
    parts = [f"load {load_s:.2f} s"]
    if not first_token:
        return parts[0] + "; no tokens generated"
    parts.append(f"first token {min(first_token.values()) - started:.3f} s")
    prefill_done = max(first_token.values())
    decoded = sum(n for at, n in token_times if at > prefill_done)
    seconds = done - prefill_done
    if decoded and seconds > 0:
        parts.append(f"decode {decoded} tokens in {seconds:.2f} s ({decoded / seconds:.1f} tok/s)")
    else:
        parts.append("decode: none (every request ended at its first token)")
    return "; ".join(parts)
