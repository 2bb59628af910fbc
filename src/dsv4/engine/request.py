"""A request's sequences and what the user gets back."""

from dataclasses import dataclass, field

from dsv4.engine.sampler import SamplingState, TokenLogprobs
from dsv4.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    weights_version: int
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class Sequence:
    """One completion being generated: its cache slot and progress."""

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
    text: str = ""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
