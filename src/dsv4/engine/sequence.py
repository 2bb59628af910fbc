"""One completion being generated: its tokens, its progress through the cache, its text and stop state.

A sequence's tokens are its prompt followed by what it generated. `computed` counts the leading tokens
whose cache state exists in its slot; the scheduler gives it the tokens after that (`pending`): a whole
prompt in chunks at first, then one token per step (the last sampled one), or that token plus draft
tokens when speculating. A preempted sequence keeps its tokens, text and stop state but loses its slot
and its cache (`computed` back to 0): when it is admitted again it recomputes all of its tokens.

Every generated token is tagged with the weights version whose logits chose it; `weights_spans` keeps
one (version, first token index, end index) stretch per run of tokens from the same version.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dsv4.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from dsv4.engine.outputs import CompletionOutput, SpeculationMetrics
from dsv4.engine.sampler import TokenLogprobs
from dsv4.engine.sampling_params import SamplingParams

STOP, LENGTH, ABORT = "stop", "length", "abort"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for a cache slot (new, or preempted)
    RUNNING = "running"  # holds a cache slot
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: the scheduler's queues look sequences up by object
class Sequence:
    """One completion of a request.

    `prompt_ids` and `params` are the request's own objects, shared by its n sequences (never copied,
    never mutated); what differs per completion is its seed (`params.seed + index`, as vLLM does).
    """

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    computed: int = 0  # leading tokens whose cache state exists in `slot`
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    detokenizer: IncrementalDetokenizer | None = None
    stop_checker: StopStringChecker | None = None
    text: str = ""  # streamable text so far (stop strings and any held-back partial stop excluded)
    sent_tokens: int = 0  # how many output tokens / logprobs / text chars earlier deltas carried
    sent_text: int = 0
    weights_spans: list[list[int]] = field(default_factory=list)  # [version, begin, end) per stretch
    num_preemptions: int = 0
    speculation: SpeculationMetrics | None = None  # once a draft was verified for it

    @property
    def seed(self) -> int | None:
        """This completion's sampling seed (None: the sampler's default generator)."""
        return None if self.params.seed is None else self.params.seed + self.index

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Known tokens whose cache state does not exist yet (at least 1 while the sequence runs)."""
        return self.num_tokens - self.computed

    @property
    def decoding(self) -> bool:
        """Past its prompt (and any recompute): one known token left to compute, which samples the next."""
        return self.pending == 1 and bool(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """(prompt + output)[start:end], without building the whole list."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    def append(self, token: int, logprobs: TokenLogprobs | None, version: int) -> None:
        """Record a generated token chosen under weights `version` (its text comes with `add_text`)."""
        index = len(self.output_ids)
        self.output_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.weights_spans and self.weights_spans[-1][0] == version:
            self.weights_spans[-1][2] = index + 1
        else:
            self.weights_spans.append([version, index, index + 1])

    def add_text(self, token: int) -> str | None:
        """Detokenize `token`; returns the stop string if the text now contains one."""
        if self.detokenizer is None:
            return None
        check = self.stop_checker.feed(self.detokenizer.add_token(token))
        self.text += check.delta
        return check.stop

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark finished; a sequence not ended by a stop string releases its held-back text."""
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = SequenceStatus.FINISHED
        if self.detokenizer is not None and self.stop_checker.stopped_by is None:
            self.text += self.stop_checker.feed(self.detokenizer.finish()).delta
            self.text += self.stop_checker.finish()

    def preempt(self) -> None:
        """Drop the cache state (the caller frees the slot); tokens, text and stop state are kept."""
        self.status = SequenceStatus.WAITING
        self.slot = None
        self.computed = 0
        self.num_preemptions += 1

    def completion(self, delta: bool) -> CompletionOutput:
        """What is new since the previous delta (delta=True), or everything."""
        tokens_from = self.sent_tokens if delta else 0
        text_from = self.sent_text if delta else 0
        if delta:
            self.sent_tokens, self.sent_text = len(self.output_ids), len(self.text)
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = [lp.top for lp in self.logprobs[tokens_from:]]
        spans = [(v, b if b > tokens_from else tokens_from, e) for v, b, e in self.weights_spans if e > tokens_from]
        return CompletionOutput(
            index=self.index,
            token_ids=self.output_ids[tokens_from:],
            text=self.text[text_from:] if self.detokenizer is not None else None,
            finish_reason=self.finish_reason,
            logprobs=logprobs,
            stop_reason=self.stop_reason,
            weights_versions=spans,
            speculation=self.speculation,
        )
