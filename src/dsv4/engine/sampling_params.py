"""Per-request sampling settings.

`SamplingParams` is an immutable value object: it is validated once on construction, so the sampler and
scheduler can trust every field without re-checking it on the hot path. A bad field raises
`ArgumentTypeError` (a TypeError) or `RequestError` (a ValueError) naming `SamplingParams.<field>` and the
value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsv4.engine.validation import MAX_SEED, describe, require_bool, require_int, require_number, require_str
from dsv4.errors import ArgumentTypeError, RequestError

#: Largest number of top logprobs a request may ask for (per generated or prompt token). Bounded because
#: every requested entry costs a host transfer.
MAX_LOGPROBS = 20

#: Largest number of completions per prompt: OpenAI's API caps `n` at 128, and every completion holds a
#: sequence's state, so a larger value is a mistake rather than a workload.
MAX_N = 128

#: Accepted values of `SamplingParams.logprobs_mode`.
LOGPROBS_MODES = ("raw", "processed")

_WHERE = "SamplingParams"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        n: number of independent completions for the prompt (1 to `MAX_N`).
        max_tokens: maximum number of generated tokens (>= 1).
        temperature: softmax temperature, finite and >= 0; 0 means greedy (argmax, ties go to the lowest
            token id), which is exactly deterministic.
        top_k: keep only the `top_k` most likely tokens; 0 or -1 disables the filter.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability mass is
            >= `top_p` (the top token is always kept). 1.0 disables the filter. Must be in (0, 1].
        min_p: drop tokens whose probability is < `min_p` * max_prob. 0.0 disables the filter. Must be in
            [0, 1].
        seed: if set, the request samples from its own random generator seeded with this value, so its
            tokens do not depend on which other requests share the batch nor on its position in the batch.
            Completion i of the request uses seed + i.
        stop: stop strings. Generation ends when the output text contains one; the stop string itself is not
            part of the returned text. A single string or any sequence of strings is accepted and stored as
            a tuple.
        stop_token_ids: token ids that end generation (in addition to EOS). Stored as a tuple.
        ignore_eos: keep generating past the EOS token (benchmarking).
        logprobs: if set, return the sampled token's logprob plus the top `logprobs` alternatives for every
            generated token (0 to `MAX_LOGPROBS`).
        prompt_logprobs: same, for every prompt token (the first prompt token has no logprob).
        logprobs_mode: which distribution the logprobs are taken from:
            "raw": log_softmax of the model's unprocessed logits, before temperature / top-k / top-p /
            min-p. This is what a trainer computes from the same weights, so RL pipelines that compare
            inference logprobs with trainer logprobs want "raw".
            "processed": log_softmax of the logits after temperature scaling and the top-k, top-p and min-p
            filters, i.e. the distribution the token was drawn from (filtered-out tokens get -inf). For
            greedy requests the temperature is taken as 1 (the filters still apply), as in vLLM.

    Raises:
        ArgumentTypeError: a field of the wrong type (e.g. `stop=5`, `seed=1.5`).
        RequestError: a field out of range (e.g. `temperature=float("inf")`, `top_p=0`).
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
        # Sequence fields become tuples so the params stay hashable and immutable. A bare string is one
        # stop string, not a sequence of characters.
        object.__setattr__(self, "stop", _string_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        require_int(f"{_WHERE}.n", self.n, minimum=1, maximum=MAX_N, error=RequestError)
        require_int(f"{_WHERE}.max_tokens", self.max_tokens, minimum=1, error=RequestError)
        require_number(f"{_WHERE}.temperature", self.temperature, minimum=0, error=RequestError)
        require_int(f"{_WHERE}.top_k", self.top_k, minimum=-1, error=RequestError)
        require_number(f"{_WHERE}.top_p", self.top_p, maximum=1, error=RequestError)
        if self.top_p <= 0:
            raise RequestError(f"{_WHERE}.top_p must be in (0, 1], got {self.top_p}")
        require_number(f"{_WHERE}.min_p", self.min_p, minimum=0, maximum=1, error=RequestError)
        if self.seed is not None:
            require_int(f"{_WHERE}.seed", self.seed, minimum=0, maximum=MAX_SEED, error=RequestError)
        for s in self.stop:
            if not s:
                raise RequestError(f"{_WHERE}.stop must not contain an empty string")
        for i, token in enumerate(self.stop_token_ids):
            require_int(f"{_WHERE}.stop_token_ids[{i}]", token, minimum=0, error=RequestError)
        require_bool(f"{_WHERE}.ignore_eos", self.ignore_eos)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                require_int(f"{_WHERE}.{name}", value, minimum=0, maximum=MAX_LOGPROBS, error=RequestError)
        require_str(f"{_WHERE}.logprobs_mode", self.logprobs_mode)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise RequestError(f"{_WHERE}.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0


def _string_tuple(field: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Sequence) or isinstance(value, bytes) or not all(isinstance(v, str) for v in value):
        raise ArgumentTypeError(f"{_WHERE}.{field} must be a string or a list of strings, got {describe(value)}")
    return tuple(value)


def _int_tuple(field: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ArgumentTypeError(f"{_WHERE}.{field} must be a list of token ids, got {describe(value)}")
    return tuple(value)
