"""What `LLM.generate` / `LLM.stream` and `Engine.step` hand back: one `RequestOutput` per request, with
one `CompletionOutput` per completion (`SamplingParams.n`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion, whole or (streaming) what is new since the previous delta.

    Attributes:
        index: which of the request's n completions.
        token_ids: generated token ids.
        text: their text (None without a tokenizer).
        finish_reason: "stop" | "length" | "abort", None while running.
        logprobs: per generated token, {sampled id and top-k ids: logprob} (when asked for).
        stop_reason: the stop string or stop token id that ended it, if any.
        weights_versions: (weights version, first token index, end index) per stretch of tokens chosen
            under the same weights; indices count from the completion's first token (a delta lists the
            stretches of its own tokens). Several stretches only when a weight update retracted the
            sequence mid-way (`pause="retract"`).
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    weights_versions: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One request's result (or streaming delta).

    Attributes:
        weights_version: the latest weights version that chose any of its tokens (the version in effect
            when it was added, while it has none).
        prompt_logprobs: per prompt token (None for the first), once the whole prompt is scored.
        error: set when this request alone was rejected or could not be served (e.g. longer than
            max_model_len); it then has no completions or ends with finish_reason "abort".
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    weights_version: int
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
