"""The generation loop: admit sequences into cache slots, run one forward per step, sample, retire.

Every step packs the pending prompt chunks and one decode token per running sequence into a single
ForwardBatch under a token budget. Sequences own a cache slot from admission to retirement; a request
that finds no free slot waits.
"""

from collections import deque
from dataclasses import dataclass

import torch

from dsv4.engine.request import Sequence
from dsv4.engine.sampler import Sampler
from dsv4.errors import RequestError
from dsv4.model.batch import ForwardBatch
from dsv4.model.deepseek_v4 import DeepseekV4


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int  # cache slots
    max_num_batched_tokens: int  # tokens per forward step
    max_model_len: int  # prompt + output tokens per sequence


class Engine:
    def __init__(self, model: DeepseekV4, limits: EngineLimits, seed: int, eos_token_ids: tuple[int, ...]):
        self.model = model
        self.limits = limits
        self.cache = model.allocate_cache(limits.max_num_seqs, limits.max_model_len)
        self.free_slots = deque(range(limits.max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sampler = Sampler(default_seed=seed)
        self.eos_token_ids = set(eos_token_ids)

    def add(self, seq: Sequence) -> None:
        total = len(seq.prompt_ids) + 1
        if not seq.prompt_ids:
            raise RequestError(f"request {seq.request_id}: empty prompt")
        if total > self.limits.max_model_len:
            raise RequestError(
                f"request {seq.request_id}: prompt of {len(seq.prompt_ids)} tokens does not fit "
                f"max_model_len={self.limits.max_model_len}"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
                work.append((seq, [seq.all_ids[seq.computed]]))
                budget -= 1
        for seq in self.running:
            if seq.computed < len(seq.prompt_ids) and budget > 0:
                chunk = seq.prompt_ids[seq.computed : seq.computed + budget]
                work.append((seq, chunk))
                budget -= len(chunk)
        return work

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one forward; returns the sequences that finished in it."""
        self._admit()
        work = self._schedule()
        if not work:
            return []
        batch = ForwardBatch.build([(seq.slot, chunk, seq.computed) for seq, chunk in work])
        streams, _ = self.model(batch, self.cache)
        sampling = []
        for (seq, chunk), last in zip(work, batch.last_token_indices.tolist()):
            seq.computed += len(chunk)
            if seq.computed == len(seq.all_ids):  # the last known token: its logits pick the next one
                sampling.append((seq, last))
        finished = []
        if sampling:
            logits = self.model.logits(streams[torch.tensor([i for _, i in sampling])])
            out = self.sampler.sample(logits, [seq.state for seq, _ in sampling])
            for (seq, _), token, lp in zip(sampling, out.token_ids.tolist(), out.logprobs):
                self._append(seq, token, lp)
                if seq.finished:
                    finished.append(seq)
        for seq in finished:
            self.retire(seq)
        return finished

    def _append(self, seq: Sequence, token: int, logprobs) -> None:
        seq.output_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq.all_ids) >= self.limits.max_model_len:
            seq.finish_reason = "length"

    def retire(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
