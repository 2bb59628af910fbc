"""/v1/completions and /v1/chat/completions: request -> engine inputs, engine outputs -> responses.

`plan_completion` / `plan_chat` validate what pydantic cannot check alone (model name, prompt length
against max_model_len, token-id ranges, fields that need a tokenizer) and build one `EngineInput` per
prompt. `CompletionRenderer` / `ChatRenderer` turn the engine's `RequestOutput`s into OpenAI response
bodies, whole (`response`) or as server-sent-event chunks (`chunks`).

Choices are numbered prompt-major: choice `p * n + i` is completion i of prompt p. Every choice lists the
weights version of each stretch of its tokens (`weights_versions`); a response or chunk names the version
that produced it (`weights_version`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel

from dsv4.engine.outputs import CompletionOutput, RequestOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.server.driver import EngineInput, OutputStream
from dsv4.server.errors import ApiError
from dsv4.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    TopLogprob,
    Usage,
    WeightsStretch,
)
from dsv4.server.served_model import ServedModel
from dsv4.server.streaming import DONE_EVENT, sse_event

LENGTH = "length"


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks of the engine, and how to present what comes back.

    Attributes:
        inputs: one engine input per prompt.
        n: completions per prompt.
        echo_texts: per prompt, the text to put before its completions (echo), else None.
        score_only: max_tokens=0 with echo: the engine generates one token, which is not returned.
        logprobs: top alternatives per generated token (None: no logprobs).
        prompt_logprobs: return the prompt's logprobs (extension) with this many alternatives.
    """

    inputs: list[EngineInput]
    n: int
    echo_texts: list[str | None]
    score_only: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(x.prompt_ids) for x in self.inputs)


def new_id(prefix: str) -> str:
    """A response id, unique per request (e.g. "cmpl-<32 hex digits>")."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _check_length(ids: list[int], model: ServedModel, param: str) -> None:
    if len(ids) + 1 > model.max_model_len:
        raise ApiError(
            f"the prompt has {len(ids)} tokens; max_model_len is {model.max_model_len}, which leaves no room "
            f"to generate", param=param,
        )


def _sampling_params(body: SamplingFields, model: ServedModel, prompt_len: int, max_tokens: int | None,
                     logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    room = model.max_model_len - prompt_len  # >= 1: checked by _check_length
    if body.stop and model.tokenizer is None:
        raise ApiError("stop strings need a tokenizer, and this model has none", param="stop")
    try:
        return SamplingParams(
            n=body.n, max_tokens=room if max_tokens is None else min(max_tokens, room),
            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p, seed=body.seed,
            stop=body.stop_strings, stop_token_ids=body.stop_token_ids or (), ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
    except ValueError as exc:  # SamplingParams' messages start with the field name
        raise ApiError(str(exc), param=str(exc).split()[0]) from None


def plan_completion(body: CompletionRequest, model: ServedModel) -> Plan:
    """Raises ApiError naming the field at fault."""
    body.check()
    model.check_name(body.model)
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    score_only = body.max_tokens == 0
    # Echo with logprobs returns the prompt tokens' logprobs too, so the engine has to score the prompt.
    prompt_lp = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_lp = max(prompt_lp or 0, body.logprobs)
    inputs, echo_texts = [], []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids, text = model.encode(prompt, "prompt"), prompt
        else:
            ids, text = model.check_ids(prompt, "prompt"), None
        _check_length(ids, model, "prompt")
        max_tokens = 1 if score_only else body.max_tokens
        params = _sampling_params(body, model, len(ids), max_tokens, body.logprobs, prompt_lp)
        inputs.append(EngineInput(ids, params, text))
        echo_texts.append((text if text is not None else model.decode(ids)) if body.echo else None)
    return Plan(inputs, body.n, echo_texts, score_only, body.logprobs, body.prompt_logprobs)


def plan_chat(body: ChatCompletionRequest, model: ServedModel) -> Plan:
    """Raises ApiError naming the field at fault."""
    body.check()
    model.check_name(body.model)
    text, ids = model.render_chat(body.messages, body.add_generation_prompt)
    _check_length(ids, model, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(body, model, len(ids), body.max_new_tokens, logprobs, body.prompt_logprobs)
    return Plan([EngineInput(ids, params, text)], body.n, [None], logprobs=logprobs,
                prompt_logprobs=body.prompt_logprobs)


def stretches(completion: CompletionOutput) -> list[WeightsStretch]:
    """Which weights version computed which of the completion's tokens, as the engine tagged them: one
    stretch per run of tokens chosen under the same weights (several only when a `retract` update
    recomputed the sequence mid-way), indices counted from the completion's first token."""
    return [WeightsStretch(version=v, start=b, end=e) for v, b, e in completion.weights_versions]


def prompt_logprobs_json(values: list[dict[int, float] | None] | None) -> list[dict[str, float] | None] | None:
    """Prompt logprobs with JSON keys: per prompt token, None (the first) or {str(token id): logprob}."""
    if values is None:
        return None
    return [None if d is None else {str(k): v for k, v in d.items()} for d in values]


def _created() -> int:
    return int(time.time())


class _Choices:
    """Per-choice bookkeeping of a streamed response: whether it started and finished."""

    def __init__(self, count: int):
        self.finished = [False] * count
        self.started = [False] * count


class CompletionRenderer:
    """Engine outputs -> /v1/completions bodies."""

    def __init__(self, plan: Plan, model: ServedModel, request_id: str):
        self.plan, self.model, self.id = plan, model, request_id
        self.created = _created()

    def _logprobs(self, ids: list[int], lps: list[dict[int, float]] | None, prompt_index: int, echo: bool,
                  prompt_lps: list[dict[int, float] | None] | None, offset: int) -> CompletionLogprobs | None:
        if self.plan.logprobs is None:
            return None
        text = self.model.token_text
        tokens, token_lps, tops = [], [], []
        if echo:
            prompt_ids = self.plan.inputs[prompt_index].prompt_ids
            for pos, token in enumerate(prompt_ids):
                entry = prompt_lps[pos] if prompt_lps is not None and pos < len(prompt_lps) else None
                tokens.append(text(token))
                token_lps.append(None if entry is None else entry.get(token))
                tops.append(None if entry is None else {text(k): v for k, v in entry.items()})
        for token, entry in zip(ids, lps or []):
            tokens.append(text(token))
            token_lps.append(entry.get(token))
            tops.append({text(k): v for k, v in entry.items()})
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)

    def _choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput, first: bool,
                text_offset: int) -> CompletionChoice:
        score_only = self.plan.score_only
        ids = [] if score_only else c.token_ids
        text = "" if score_only else (c.text or "")
        echo = self.plan.echo_texts[prompt_index] if first else None
        if echo is not None:
            text = echo + text
        kept = CompletionOutput(c.index, ids, text, c.finish_reason, None if score_only else c.logprobs,
                                weights_versions=[] if score_only else c.weights_versions)
        return CompletionChoice(
            index=prompt_index * self.plan.n + c.index,
            text=text,
            logprobs=self._logprobs(ids, kept.logprobs, prompt_index, echo is not None, out.prompt_logprobs,
                                    text_offset),
            finish_reason=LENGTH if score_only and c.finish_reason else c.finish_reason,
            stop_reason=None if score_only else c.stop_reason,
            weights_versions=stretches(kept),
            prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if first and self.plan.prompt_logprobs
            is not None else None,
        )

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        """The whole response from each prompt's final output."""
        choices = [self._choice(p, out, c, True, 0) for p, out in enumerate(outputs) for c in out.outputs]
        completion_tokens = 0 if self.plan.score_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model.name, choices=choices,
            usage=_usage(self.plan.prompt_tokens, completion_tokens),
            weights_version=max(o.weights_version for o in outputs),
        )

    def chunks(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per engine step with news, the usage chunk if asked, [DONE]."""
        state = _Choices(len(self.plan.inputs) * self.plan.n)
        offsets = [0] * len(state.finished)

        def news(p: int, out: RequestOutput) -> CompletionResponse | None:
            choices = []
            for c in out.outputs:
                index = p * self.plan.n + c.index
                if state.finished[index]:
                    continue
                first = not state.started[index]
                if not (c.token_ids or c.finish_reason or (first and self.plan.echo_texts[p] is not None)):
                    continue
                choice = self._choice(p, out, c, first, offsets[index])
                state.started[index] = True
                offsets[index] += len(choice.text)
                state.finished[index] = c.finish_reason is not None
                choices.append(choice)
            if not choices:
                return None
            return CompletionResponse(id=self.id, created=self.created, model=self.model.name, choices=choices,
                                      weights_version=out.weights_version)

        def tokens(out: RequestOutput) -> int:
            return 0 if self.plan.score_only else sum(len(c.token_ids) for c in out.outputs)

        def usage_chunk(completion_tokens: int, version: int) -> CompletionResponse:
            return CompletionResponse(id=self.id, created=self.created, model=self.model.name, choices=[],
                                      usage=_usage(self.plan.prompt_tokens, completion_tokens),
                                      weights_version=version)

        # Version 0 names the usage chunk of a stream that ended before any output.
        return _events(stream, include_usage, 0, news, tokens, usage_chunk)


class ChatRenderer:
    """Engine outputs -> /v1/chat/completions bodies."""

    def __init__(self, plan: Plan, model: ServedModel, request_id: str):
        self.plan, self.model, self.id = plan, model, request_id
        self.created = _created()

    def _logprobs(self, c: CompletionOutput) -> ChatLogprobs | None:
        if self.plan.logprobs is None:
            return None
        text, k = self.model.token_text, self.plan.logprobs
        content = []
        for token, entry in zip(c.token_ids, c.logprobs or []):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            t = text(token)
            content.append(ChatTokenLogprob(
                token=t, logprob=entry[token], bytes=list(t.encode()),
                top_logprobs=[TopLogprob(token=text(i), logprob=v, bytes=list(text(i).encode())) for i, v in top],
            ))
        return ChatLogprobs(content=content)

    def response(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        (out,) = outputs
        choices = [
            ChatChoice(index=c.index, message=ChatMessageOut(content=c.text or ""), logprobs=self._logprobs(c),
                       finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                       weights_versions=stretches(c))
            for c in out.outputs
        ]
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model.name, choices=choices,
            usage=_usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)),
            weights_version=out.weights_version,
            prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs) if self.plan.prompt_logprobs is not None
            else None,
        )

    def chunks(self, stream: OutputStream, include_usage: bool, version: int) -> AsyncIterator[str]:
        """Server-sent events: the assistant role first, then one chunk per engine step with news, the
        usage chunk if asked, [DONE]. `version`: the weights version serving when the request came in
        (named by the role chunks, which carry no tokens)."""
        state = _Choices(self.plan.n)

        def news(_: int, out: RequestOutput) -> ChatCompletionChunk | None:
            choices = []
            for c in out.outputs:
                if state.finished[c.index] or not (c.token_ids or c.finish_reason):
                    continue
                choices.append(ChatStreamChoice(
                    index=c.index, delta=ChatDelta(content=c.text or ""), logprobs=self._logprobs(c),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    weights_versions=stretches(c),
                ))
                state.finished[c.index] = c.finish_reason is not None
            if not choices:
                return None
            chunk = self._chunk(choices, out.weights_version)
            if out.prompt_logprobs is not None and self.plan.prompt_logprobs is not None:
                chunk.prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
            return chunk

        def tokens(out: RequestOutput) -> int:
            return sum(len(c.token_ids) for c in out.outputs)

        def usage_chunk(completion_tokens: int, version: int) -> ChatCompletionChunk:
            chunk = self._chunk([], version)
            chunk.usage = _usage(self.plan.prompt_tokens, completion_tokens)
            return chunk

        role = ChatDelta(role="assistant", content="")
        opening = self._chunk([ChatStreamChoice(index=i, delta=role) for i in range(self.plan.n)], version)
        return _events(stream, include_usage, version, news, tokens, usage_chunk, opening)

    def _chunk(self, choices: list[ChatStreamChoice], version: int) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model.name, choices=choices,
                                   weights_version=version)


async def _events(
    stream: OutputStream, include_usage: bool, version: int,
    news: Callable[[int, RequestOutput], BaseModel | None], tokens: Callable[[RequestOutput], int],
    usage_chunk: Callable[[int, int], BaseModel], opening: BaseModel | None = None,
) -> AsyncIterator[str]:
    """The server-sent events of one streamed response, for either renderer.

    Args:
        stream: the request's engine outputs; closed however the events end.
        include_usage: whether a usage chunk ends the stream (and chunks carry a `usage` field).
        version: the weights version the usage chunk names if no output arrives.
        news: (prompt index, output) -> the chunk of what the output adds, or None when it adds nothing.
        tokens: the completion tokens an output counts for the usage chunk.
        usage_chunk: (completion tokens, weights version) -> the usage chunk.
        opening: a chunk sent before any output (the chat role chunk).

    Yields:
        `opening`, a chunk per output with news, an error event if the engine failed the request, the usage
        chunk if asked and the stream completed, then [DONE].
    """
    exclude = None if include_usage else {"usage"}
    completion_tokens = 0
    try:
        if opening is not None:
            yield sse_event(opening, exclude)
        while not stream.done:
            try:
                p, out = await stream.next()
            except ApiError as exc:
                yield sse_event(exc.body())
                break
            version = out.weights_version
            chunk = news(p, out)
            completion_tokens += tokens(out)
            if chunk is not None:
                yield sse_event(chunk, exclude)
        if include_usage and stream.done:
            yield sse_event(usage_chunk(completion_tokens, version))
        yield DONE_EVENT
    finally:
        stream.close()


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
