"""The HTTP API's request and response bodies (pydantic models).

Requests are validated strictly: a wrong JSON type is an error (no "5" -> 5 coercion), an unknown field
is an error (OpenAI's API refuses unrecognized arguments too), and every list and count is bounded so
that one request cannot make unbounded work. Fields OpenAI defines that this server does not implement
(penalties, logit_bias, tools, ...) are accepted only at their neutral value, and refused with a message
naming them otherwise, so a client never silently gets different semantics than it asked for.

Extensions beyond OpenAI's fields (as vLLM spells them): `top_k`, `min_p`, `stop_token_ids`,
`ignore_eos`, `prompt_logprobs`, `add_generation_prompt`; in responses, `weights_version` (top level) and
`weights_versions` (per choice: which weights version computed which stretch of its tokens),
`stop_reason` and `prompt_logprobs`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsv4.engine.sampling_params import MAX_LOGPROBS
from dsv4.server.errors import ApiError

# Bounds on the work one request may ask for (each costs engine slots or per-token CPU time).
MAX_N = 64  # completions per prompt: each holds a cache slot while it runs
MAX_PROMPTS = 64  # prompts in one /v1/completions request (a batch)
MAX_STOP_STRINGS = 16  # every stop string is searched for after every generated token
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 1024
# OpenAI caps `logprobs` of /v1/completions at 5 and `top_logprobs` of chat at 20; the engine caps both at
# MAX_LOGPROBS (the host transfer of every requested entry costs per token).
PauseMode = Literal["abort", "wait", "retract"]
MAX_PORT = 65535
MAX_HOST_CHARS = 253  # the longest DNS name
MAX_GROUP_NAME_CHARS = 256
# A transfer's waits block the admin thread (later admin operations queue behind it): an hour at most.
MAX_TRANSFER_TIMEOUT_S = 3600.0


class StrictModel(BaseModel):
    """JSON types as written, unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields both completion endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields this server does not implement: only their neutral value is accepted.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        for s in [stop] if isinstance(stop, str) else (stop or []):
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters, got {s!r}")
        return stop

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: float):
        if value != 0:
            raise ValueError(f"penalties are not supported by this server, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    def check(self) -> None:
        """Rules across fields (pydantic checks each field on its own).

        Raises:
            ApiError: naming the field at fault.
        """
        if self.stream_options is not None and not self.stream:
            raise ApiError("stream_options is only allowed when stream is true", param="stream_options")

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, a list of texts, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported by this server")
        return value

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list):
            if not self.prompt or any(isinstance(p, list) and not p for p in self.prompt):
                raise ApiError("prompt must not be empty", param="prompt")
            if len(self.prompt) > MAX_PROMPTS and not isinstance(self.prompt[0], int):
                raise ApiError(f"at most {MAX_PROMPTS} prompts per request, got {len(self.prompt)}", param="prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(f"only best_of == n is supported, got best_of={self.best_of}, n={self.n}",
                           param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError("max_tokens=0 is only allowed with echo (scoring the prompt)", param="max_tokens")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ResponseFormat(StrictModel):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Tool calling is not implemented: no tools may be offered and none may be forced.
    tools: list[dict] | None = None
    tool_choice: Literal["none"] | None = None
    response_format: ResponseFormat | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value):
        if value:
            raise ValueError("tool calling is not supported by this server")
        return value

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (the current OpenAI name) wins over the deprecated max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(StrictModel):
    """POST /tokenize: exactly one of `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError("give exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


# ---- admin ----
class PauseRequest(StrictModel):
    """What happens to requests in flight: abort them (finish_reason "abort"), wait for them to finish,
    or retract them (preempt, and recompute them under the new weights after resume)."""

    mode: PauseMode = "abort"


class WeightsBeginRequest(StrictModel):
    """atomic: stage buckets, apply at finish (else write as they arrive: generation stays paused from
    begin until the session ends). full: finish requires every tensor. mode: how generation in flight is
    paused when the update needs the engine to itself (unless an explicit pause already holds it)."""

    atomic: bool = True
    full: bool = False
    mode: PauseMode = "wait"


class WeightsReloadRequest(StrictModel):
    """Reload every weight from a checkpoint directory under the server's --weights-root."""

    path: str = Field(min_length=1)
    mode: PauseMode = "wait"


class InitTransferRequest(StrictModel):
    """Join a trainer's weight transfer group (`LLM.init_weight_transfer`; the trainer is rank 0).
    timeout: seconds any single wait may take (None: the group's default)."""

    master_address: str = Field(min_length=1, max_length=MAX_HOST_CHARS)
    master_port: int = Field(ge=1, le=MAX_PORT)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(2, ge=2)
    group_name: str = Field("dsv4", min_length=1, max_length=MAX_GROUP_NAME_CHARS)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout: float | None = Field(None, gt=0.0, le=MAX_TRANSFER_TIMEOUT_S)


class UpdateFromDistributedRequest(StrictModel):
    """Receive the update `metadata` plans (the trainer's `WeightSender.plan(...)`) while the trainer sends
    it. atomic / full / mode: as for /admin/weights/begin."""

    metadata: dict
    atomic: bool = True
    full: bool = False
    mode: PauseMode = "wait"


class UpdateFromSharedRequest(UpdateFromDistributedRequest):
    """Apply the update a colocated trainer shared (`ColocatedWeightSender.share(...)` is the `handle`)."""

    handle: dict


# ---- responses ----
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class WeightsStretch(BaseModel):
    """Tokens [start, end) of a completion were computed with weights `version`."""

    version: int
    start: int
    end: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weights_versions: list[WeightsStretch] = Field(default_factory=list)
    prompt_logprobs: list[dict[str, float] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    weights_version: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weights_versions: list[WeightsStretch] = Field(default_factory=list)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    weights_version: int
    prompt_logprobs: list[dict[str, float] | None] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weights_versions: list[WeightsStretch] = Field(default_factory=list)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    weights_version: int
    prompt_logprobs: list[dict[str, float] | None] | None = None
