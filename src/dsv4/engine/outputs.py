"""What `LLM.generate` / `LLM.stream` and `Engine.step` hand back: one `RequestOutput` per request, with
one `CompletionOutput` per completion (`SamplingParams.n`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculationMetrics:
    """How speculative decoding went, for one completion or summed over an engine's completions.

    Attributes:
        verify_steps: steps that verified drafts (each keeps the accepted drafts plus one target token).
        draft_tokens: draft tokens verified.
        accepted_tokens: draft tokens kept.
        drafted_per_position: per draft position i (0-based), how many verify steps had a draft i.
        accepted_per_position: per draft position, how many of those drafts were kept.
    """

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: tuple[int, ...] = ()
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Kept drafts / verified drafts (0 when none was verified)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify step: the kept drafts plus the target's own token (1 when none ran)."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 1.0

    def per_position_rate(self) -> list[float]:
        """Per draft position, the share of its drafts that were kept."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def add(self, drafted: int, accepted: int) -> SpeculationMetrics:
        """These metrics plus one verify step of `drafted` drafts whose first `accepted` were kept."""
        width = max(len(self.drafted_per_position), drafted)
        d = list(self.drafted_per_position) + [0] * (width - len(self.drafted_per_position))
        a = list(self.accepted_per_position) + [0] * (width - len(self.accepted_per_position))
        for i in range(drafted):
            d[i] += 1
            a[i] += i < accepted
        return SpeculationMetrics(self.verify_steps + 1, self.draft_tokens + drafted, self.accepted_tokens + accepted,
                                  tuple(d), tuple(a))

    def as_dict(self) -> dict:
        """JSON-ready, with the derived rates."""
        return {"verify_steps": self.verify_steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "drafted_per_position": list(self.drafted_per_position),
                "accepted_per_position": list(self.accepted_per_position)}


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
        speculation: the completion's speculative-decoding metrics so far (None when no draft was
            verified for it).
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    weights_versions: list[tuple[int, int, int]] = field(default_factory=list)
    speculation: SpeculationMetrics | None = None


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
