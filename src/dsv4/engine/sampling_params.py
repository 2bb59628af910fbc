"""Per-request sampling settings.

`SamplingParams` is an immutable value object: it is validated once on
construction, so the sampler and scheduler can trust every field without
re-checking it on the hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Largest number of top logprobs a request may ask for (per generated or
#: prompt token). Bounded because every requested entry costs a host transfer.
MAX_LOGPROBS = 20

#: Accepted values of `SamplingParams.logprobs_mode`.
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Fields:
        n: number of independent completions for the prompt (>= 1).
        max_tokens: maximum number of generated tokens (>= 1).
        temperature: softmax temperature; ``0`` means greedy (argmax, ties go
            to the lowest token id), which is exactly deterministic.
        top_k: keep only the ``top_k`` most likely tokens; ``0`` or ``-1``
            disables the filter.
        top_p: nucleus sampling; keep the smallest set of most likely tokens
            whose probability mass is ``>= top_p`` (the top token is always
            kept). ``1.0`` disables the filter. Must be in ``(0, 1]``.
        min_p: drop tokens whose probability is ``< min_p * max_prob``.
            ``0.0`` disables the filter. Must be in ``[0, 1]``.
        seed: if set, the request samples from its own random generator
            seeded with this value, so its tokens do not depend on which other
            requests share the batch nor on its position in the batch.
        stop: stop strings. Generation ends when the output text contains one;
            the stop string itself is not part of the returned text. A single
            string or any sequence of strings is accepted and stored as a tuple.
        stop_token_ids: token ids that end generation (in addition to EOS).
            Stored as a tuple.
        ignore_eos: keep generating past the EOS token (benchmarking).
        logprobs: if set, return the sampled token's logprob plus the top
            ``logprobs`` alternatives for every generated token
            (``0 <= logprobs <= MAX_LOGPROBS``).
        prompt_logprobs: same, for every prompt token (the first prompt token
            has no logprob).
        logprobs_mode: which distribution the logprobs are taken from:

            * ``"raw"``: ``log_softmax`` of the model's unprocessed logits, i.e.
              before temperature / top-k / top-p / min-p. This is what a
              trainer computes from the same weights, so RL pipelines that
              compare inference logprobs with trainer logprobs want ``"raw"``.
            * ``"processed"``: ``log_softmax`` of the logits after temperature
              scaling and the top-k, top-p and min-p filters, i.e. the
              distribution the token was actually drawn from (filtered-out
              tokens get ``-inf``). For greedy requests the temperature is
              taken as 1 (the filters still apply), as in vLLM.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        # Normalise sequence fields to tuples so the params stay hashable and
        # immutable. A bare string is one stop string, not a sequence of chars.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        _require_int("n", self.n, minimum=1)
        _require_int("max_tokens", self.max_tokens, minimum=1)
        _require_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _require_int("top_k", self.top_k, minimum=-1)
        _require_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _require_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value, minimum=0, maximum=MAX_LOGPROBS)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0


def _is_int(value: object) -> bool:
    # bool is a subclass of int but never a meaningful count or id here.
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _require_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN compares unequal to itself and passes every bound check
        raise ValueError(f"{name} must not be NaN")
