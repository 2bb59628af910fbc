"""The generation loop: admit sequences into cache slots, run one forward per step, sample, retire.

Every step packs one decode token per running sequence and then prompt chunks (chunked prefill) into
a single ForwardBatch under a token budget (`max_num_batched_tokens`). Sequences own a preallocated
cache slot from admission to retirement; a request that finds no free slot waits in FIFO order
(admission control), it never fails for lack of room. A prompt that cannot fit `max_model_len` is
rejected on its own, when it is added.

`step()` returns, for every streamed request that progressed, what is new since its previous output
(streaming deltas); finished requests appear one last time with `finished=True`. Requests added with
`stream=False` appear only then (their one delta is the whole result), so a step builds no output
objects for the many requests that merely progressed.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import torch

from dsv4.config import ModelConfig
from dsv4.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from dsv4.engine.request import ABORT, LENGTH, STOP, Request, RequestOutput, Sequence
from dsv4.engine.sampler import Sampler, SamplingState, prompt_logprobs
from dsv4.engine.sampling_params import SamplingParams
from dsv4.errors import ConfigError, RequestError
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import allocate_layer_cache, cache_tensors
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.static_decode import StaticDecode

# Defaults when the user leaves a limit unset; each is then capped by the model and by memory.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Share of the memory available at start-up that the per-sequence caches may take by default
# (weights are already resident; activations and the allocator need headroom too).
CACHE_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int  # cache slots
    max_num_batched_tokens: int  # tokens per forward step
    max_model_len: int  # prompt + output tokens per sequence

    @classmethod
    def derive(
        cls, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
        max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
        memory_bytes: int | None = None,
    ) -> EngineLimits:
        """Fill unset limits from the model (max positions) and memory (available bytes * fraction):
        max_model_len defaults to the model's maximum, reduced until one sequence's cache fits the
        budget; max_num_seqs defaults to as many such sequences as fit, at most DEFAULT_MAX_NUM_SEQS.
        Explicit values are honoured (max_model_len is still capped by the model); max_num_seqs never
        exceeds max_num_batched_tokens."""
        budget = int((memory_bytes if memory_bytes is not None else available_memory(device)) * CACHE_MEMORY_FRACTION)
        model_len = cfg.max_position_embeddings
        if max_model_len is not None:
            model_len = min(max_model_len, model_len)
        if max_model_len is None:
            while model_len > 1 and cache_bytes_per_sequence(cfg, model_len, dtype) > budget:
                model_len //= 2
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", model_len)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if max_num_seqs is None:
            fit = budget // max(1, cache_bytes_per_sequence(cfg, model_len, dtype))
            # Every running sequence needs one token of the step budget to decode.
            max_num_seqs = int(max(1, min(DEFAULT_MAX_NUM_SEQS, fit, max_num_batched_tokens)))
        elif max_num_seqs > max_num_batched_tokens:
            raise ConfigError(
                f"max_num_seqs={max_num_seqs} > max_num_batched_tokens={max_num_batched_tokens}: "
                f"some running sequences could not decode in a step"
            )
        return cls(max_num_seqs, max_num_batched_tokens, model_len)


def cache_bytes_per_sequence(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of one cache slot for sequences up to max_len (shapes from a meta-device allocation)."""
    layers = [allocate_layer_cache(cfg, t, 1, max_len, dtype, "meta") for t in cfg.layer_types]
    return sum(t.numel() * t.element_size() for t in cache_tensors(layers))


def available_memory(device: str | torch.device) -> int:
    """Free bytes on `device` now: CUDA's free memory, or the host's MemAvailable (Linux) / total RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Engine:
    def __init__(
        self, model: DeepseekV4, limits: EngineLimits, seed: int, eos_token_ids: tuple[int, ...], tokenizer=None,
        compile_decode: bool = False,
    ):
        """compile_decode: run pure-decode steps through `StaticDecode` compiled with torch.compile
        (raises ValueError when the model cannot use it, e.g. FP8/FP4 routed experts)."""
        self.model = model
        self.static_decode = StaticDecode(model, compile=True) if compile_decode else None
        self.limits = limits
        self.tokenizer = tokenizer
        self.cache = model.allocate_cache(limits.max_num_seqs, limits.max_model_len)
        self.free_slots = deque(range(limits.max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.sampler = Sampler(default_seed=seed)
        self.eos_token_ids = set(eos_token_ids)
        self._aborted: list[Request] = []  # their final outputs go out with the next step

    # ---- requests ----
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
        weights_version: int = 0, stream: bool = True,
    ) -> Request:
        """Queue a request (its n sequences). Raises RequestError for this request only. stream=False:
        `step()` reports it only when it finishes."""
        if request_id in self.requests:
            raise RequestError(f"request {request_id}: id already in use")
        if not prompt_ids:
            raise RequestError(f"request {request_id}: empty prompt")
        if len(prompt_ids) + 1 > self.limits.max_model_len:
            raise RequestError(
                f"request {request_id}: prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                f"max_model_len={self.limits.max_model_len}"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError(f"request {request_id}: stop strings need a tokenizer, and this model has none")
        seqs = [self._sequence(request_id, i, prompt_ids, params) for i in range(params.n)]
        request = Request(request_id, prompt, list(prompt_ids), params, seqs, weights_version, stream=stream)
        self.requests[request_id] = request
        self.waiting.extend(seqs)
        return request

    def _sequence(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(request_id, index, list(prompt_ids), params, SamplingState.from_params(params, index))
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            seq.stop_checker = StopStringChecker(params.stop)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its slots; its final delta (finish_reason "abort") comes out of
        the next `step()`. False if the request is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.finished:
                seq.finish(ABORT)
            self._release(seq)
        self._aborted.append(request)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    # ---- one step ----
    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            self.running.append(seq)

    def _schedule(self) -> list[tuple[Sequence, list[int]]]:
        """Decode tokens first (one per sequence past its prompt), then prompt chunks up to the budget."""
        budget = self.limits.max_num_batched_tokens
        work = []
        for seq in self.running:
            if seq.computed >= len(seq.prompt_ids) and budget > 0:
                work.append((seq, [seq.token_at(seq.computed)]))
                budget -= 1
        for seq in self.running:
            if seq.computed < len(seq.prompt_ids) and budget > 0:
                chunk = seq.prompt_ids[seq.computed : seq.computed + budget]
                work.append((seq, chunk))
                budget -= len(chunk)
        return work

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one forward and sample; returns the deltas of the requests that progressed."""
        outputs = [request.output(delta=True) for request in self._aborted]
        self._aborted.clear()
        self._admit()
        work = self._schedule()
        if not work:
            return outputs
        batch = ForwardBatch.build([(seq.slot, chunk, seq.computed) for seq, chunk in work], device=self._device)
        logits = None  # [T, V], when the forward already computed every row's logits
        if self.static_decode is not None and self.static_decode.serves(batch):
            streams, logits = self.static_decode(batch, self.cache)
        else:
            streams, _ = self.model(batch, self.cache)
        sampling: list[Sequence] = []  # sequences whose last known token is in the step
        rows: list[int] = []  # the flat row of that token: its logits pick the next one
        for (seq, chunk), segment in zip(work, batch.segments):
            if seq.params.prompt_logprobs is not None and seq.index == 0 and seq.computed < len(seq.prompt_ids):
                self._score_prompt_chunk(seq, streams[segment.begin : segment.end])
            seq.computed += len(chunk)
            if seq.computed == seq.num_tokens:
                sampling.append(seq)
                rows.append(segment.end - 1)
        if not sampling:
            return outputs
        if len(rows) < batch.num_tokens:
            picked = torch.tensor(rows, device=self._device)
            streams = streams.index_select(0, picked)
            logits = None if logits is None else logits.index_select(0, picked)
        # else every row samples (a pure decode step): rows are 0..T-1 in order, no gather needed.
        logits = self.model.logits(streams) if logits is None else logits
        out = self.sampler.sample(logits, [seq.state for seq in sampling])
        reported: dict[str, Request] = {}  # streamed requests that progressed, and finished ones
        for seq, token, lp in zip(sampling, out.token_ids.tolist(), out.logprobs):
            self._append(seq, token, lp)
            request = self.requests[seq.request_id]
            if request.stream or (seq.finished and request.finished):
                reported[seq.request_id] = request
        for request in reported.values():
            outputs.append(request.output(delta=True))
            if request.finished:
                del self.requests[request.request_id]
        return outputs

    @property
    def _device(self) -> torch.device:
        return self.model.embed.weight.device

    def _score_prompt_chunk(self, seq: Sequence, streams: torch.Tensor) -> None:
        """Prompt logprobs for the chunk starting at seq.computed: row t predicts prompt token t+1."""
        request = self.requests[seq.request_id]
        start, n_prompt = seq.computed, len(seq.prompt_ids)
        rows = min(streams.shape[0], n_prompt - 1 - start)  # the last prompt row predicts an output token
        params = seq.params
        parts = []
        if rows > 0:
            logits = self.model.logits(streams[:rows])
            next_ids = torch.tensor(seq.prompt_ids[start + 1 : start + 1 + rows], device=logits.device)
            parts = prompt_logprobs(logits, next_ids, params.prompt_logprobs, params.logprobs_mode, params)
            parts = parts if start == 0 else parts[1:]  # the leading None belongs to prompt token 0 only
        elif start == 0:
            parts = [None]
        request.prompt_logprobs_parts.extend(parts)
        if start + streams.shape[0] >= n_prompt:
            request.prompt_logprobs = request.prompt_logprobs_parts

    def _append(self, seq: Sequence, token: int, logprobs) -> None:
        seq.output_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self._finish(seq, STOP, token)
        else:
            stop = seq.add_text(token)
            if stop is not None:
                self._finish(seq, STOP, stop)
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.limits.max_model_len:
                self._finish(seq, LENGTH)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish(reason, stop_reason)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
