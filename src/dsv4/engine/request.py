"""A request: one prompt, its n sequences (completions), and how its outputs reach the caller.

Each sequence turns its tokens into text incrementally (`IncrementalDetokenizer` -> `StopStringChecker`),
so stop strings are found as soon as they complete and streamed text never has to be taken back.
`Request.output(delta=True)` returns only what is new since the previous delta (streaming);
`delta=False` returns everything (the final result).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4.engine.outputs import RequestOutput
from dsv4.engine.sampler import TokenLogprobs
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.sequence import Sequence

OutputSink = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    """A queued or running request.

    Attributes:
        weights_version: the latest weights version that chose any of its tokens (the version in effect
            when it was added, while it has none).
        stream: report a delta every step it progresses (True) or only the final output (False).
        sink: if set, called (by whichever thread runs the step, under the engine's lock: it must not
            block, step or pause the engine) with every output `Engine.step` makes for this request,
            besides returning it; lets several threads drive the engine.
        error: why the engine ended it without serving it (its outputs carry it).
    """

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    weights_version: int = 0
    stream: bool = True
    sink: OutputSink | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # set once the whole prompt is scored
    prompt_logprobs_parts: list[TokenLogprobs | None] = field(default_factory=list)  # chunks scored so far
    prompt_logprobs_sent: bool = False

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
            error=self.error,
        )
