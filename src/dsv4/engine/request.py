"""A request's sequences, their text/stop state, and what the user gets back.

A `Request` is one prompt with `n` `Sequence`s (completions). Each sequence owns a cache slot while it
runs and turns its tokens into text incrementally (`IncrementalDetokenizer` -> `StopStringChecker`),
so stop strings are found as soon as they complete and streamed text never has to be taken back.
`Request.output(delta=True)` returns only what is new since the previous delta (streaming);
`delta=False` returns everything (the final result).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from dsv4.engine.sampler import SamplingState, TokenLogprobs
from dsv4.engine.sampling_params import SamplingParams

STOP, LENGTH, ABORT = "stop", "length", "abort"


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None  # per generated token: {sampled id and top-k ids: logprob}
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    weights_version: int
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # set when this request alone was rejected (e.g. longer than max_model_len)


@dataclass(eq=False)  # identity semantics: the engine's queues look sequences up by object
class Sequence:
    """One completion being generated: its cache slot, progress and text state."""

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    state: SamplingState
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    slot: int | None = None
    computed: int = 0  # tokens whose cache state exists
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    detokenizer: IncrementalDetokenizer | None = None
    stop_checker: StopStringChecker | None = None
    text: str = ""  # streamable text so far (stop strings and any held-back partial stop excluded)
    sent_tokens: int = 0  # how many output tokens / logprobs / text chars earlier deltas carried
    sent_text: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """len(all_ids), without building the list (the engine asks every step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, index: int) -> int:
        """all_ids[index], without building the list."""
        n_prompt = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n_prompt else self.output_ids[index - n_prompt]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
        if self.detokenizer is not None and self.stop_checker.stopped_by is None:
            self.text += self.stop_checker.feed(self.detokenizer.finish()).delta
            self.text += self.stop_checker.finish()

    def completion(self, delta: bool) -> CompletionOutput:
        tokens_from = self.sent_tokens if delta else 0
        text_from = self.sent_text if delta else 0
        if delta:
            self.sent_tokens, self.sent_text = len(self.output_ids), len(self.text)
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = [lp.top for lp in self.logprobs[tokens_from:]]
        return CompletionOutput(
            index=self.index,
            token_ids=self.output_ids[tokens_from:],
            text=self.text[text_from:] if self.detokenizer is not None else None,
            finish_reason=self.finish_reason,
            logprobs=logprobs,
            stop_reason=self.stop_reason,
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    weights_version: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # set once the whole prompt is scored
    prompt_logprobs_parts: list[TokenLogprobs | None] = field(default_factory=list)  # chunks scored so far
    prompt_logprobs_sent: bool = False
    stream: bool = True  # False: `Engine.step` reports the request only once, when it finishes

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)

    def output(self, delta: bool) -> RequestOutput:
        prompt_lp = None
        if self.prompt_logprobs is not None and not (delta and self.prompt_logprobs_sent):
            prompt_lp = [None if lp is None else lp.top for lp in self.prompt_logprobs]
            self.prompt_logprobs_sent = self.prompt_logprobs_sent or delta
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[seq.completion(delta) for seq in self.seqs],
            finished=self.finished,
            weights_version=self.weights_version,
            prompt_logprobs=prompt_lp,
        )
