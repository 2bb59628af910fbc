"""The model runner: the engine's one door into the model.

It owns the per-sequence caches (`ModelCache`, one slot per running sequence) and, for a step, turns the
scheduled chunks into one `ForwardBatch` (the step's metadata, built once and handed to every layer),
runs the compiled decode step (`StaticDecode`, pure-decode steps when `compile_decode`), a replay of a
recorded decode step (`DecodeReplay`, the other pure-decode steps) or the eager forward, and
returns the streams of every row, the streams of the inner layers a proposer reads (`capture_layers`, the
model's own `forward(capture_layers=...)`), and the logits of the rows the engine asked for: the last row of
each sequence that samples, or every row of a verify chunk. The compiled step and the replay return no layer
captures, so a step that captures runs the eager forward.

Verify chunks (k + 1 tokens) and other chunks that fit the cache's smallest ring run through the decode
path, one row per token (`ForwardBatch.build`'s decode_span), not the padded prefill path.

Speculation: `execute` snapshots the cache rows that verify chunks overwrite (`ModelCache.snapshot`), and
`rewind` puts back those of rejected draft positions after the engine has kept the accepted prefix, so a
rejected draft leaves no trace in the window or compressor rings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from dsv4.engine.decode_replay import DecodeReplay
from dsv4.engine.limits import EngineLimits
from dsv4.engine.static_decode import StaticDecode
from dsv4.engine.step_memory import keep_step_memory
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import RingSnapshot
from dsv4.model.deepseek_v4 import DeepseekV4


class Chunk(NamedTuple):
    """One sequence's tokens in a step: they sit at positions [start, start + len(token_ids)) of `slot`."""

    slot: int
    token_ids: list[int]
    start: int


@dataclass(frozen=True)
class StepResult:
    """streams: [T, hc, D] pre-head streams of every row of the step; logits: fp32 [len(rows), V] for
    the rows asked for, in that order (None when none were); captured: {layer: [T, hc, D] that layer's
    output streams of every row} for the layers asked for (empty when none were); argmax: [len(rows)] int64
    each logits row's argmax (the first largest id) when it was asked for and the step computed it, else None.
    Valid until the runner's next `execute`: a replayed step returns its record's own buffers."""

    streams: torch.Tensor
    logits: torch.Tensor | None
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    argmax: torch.Tensor | None = None


class ModelRunner:
    """Runs the target model over cache slots (module docstring).

    Args:
        model: the target model (READY or not: forward checks).
        limits: slots and sequence length of the caches.
        compile_decode: run pure-decode steps through `StaticDecode` compiled with torch.compile.
        replay_decode: replay pure-decode steps (`DecodeReplay`; the `replay` attribute, None when off).

    Raises:
        ValueError: compile_decode for a model the static step cannot run (e.g. activation_dtype != dtype).
    """

    def __init__(self, model: DeepseekV4, limits: EngineLimits, compile_decode: bool = False,
                 replay_decode: bool = True):
        self.model = model
        self.static_decode = StaticDecode(model, compile=True) if compile_decode else None
        self.cache = model.allocate_cache(limits.max_num_seqs, limits.max_model_len)
        self.replay = DecodeReplay(model, self.cache) if replay_decode else None
        # Chunks that fit the smallest ring (verify chunks always do) run as decode rows of their slot:
        # a verify chunk then costs the decode path's ops, not the padded prefill path's.
        self.decode_span = self.cache.rollback_limit()
        self.device = model.embed.weight.device
        if self.device.type == "cpu":  # steps' temporaries reuse their memory instead of faulting it in anew
            keep_step_memory()
        self._snapshot: RingSnapshot | None = None  # the last step's verify chunks' overwritten rows

    @property
    def ready(self) -> bool:
        """Whether the weights are READY (a failed fail-stop refit leaves them not)."""
        return self.model.ready

    def require_ready(self) -> None:
        """Raises WeightsNotReadyError (naming the model) unless the weights are READY."""
        self.model.require_ready()

    def execute(self, chunks: Sequence[Chunk], logit_rows: Sequence[int], verify: Sequence[int] = (),
                capture_layers: tuple[int, ...] = (), argmax: bool = False) -> StepResult:
        """One forward over the chunks; extends each chunk's slot through its last position.

        Args:
            chunks: per sequence, its slot, new tokens and the position of the first.
            logit_rows: rows of the flat batch (chunks back to back) whose logits are wanted, ascending
                and distinct.
            verify: indices of the chunks that may be rewound after this step (verify chunks): the rows
                they overwrite are saved first.
            capture_layers: target layers whose output streams are wanted too (the proposer's).
            argmax: the caller samples every logit row greedily: a replayed step computes their argmax with
                the logits (`StepResult.argmax`; other steps leave it to the sampler).

        Returns:
            The streams of every row, the captured layers' streams, the logits of `logit_rows` and, when asked
            for and computed, their argmax.
        """
        self._snapshot = None
        if verify:
            self._snapshot = self.cache.snapshot(
                [(chunks[i].slot, chunks[i].start, len(chunks[i].token_ids)) for i in verify])
        if not verify and logit_rows and self._replay_serves(chunks, capture_layers):
            out = self.replay(chunks, argmax)  # C calls only, made with the threads they were recorded with
            return self._result(len(chunks), True, out.streams, out.logits, {}, logit_rows, out.argmax)
        batch = ForwardBatch.build(list(chunks), device=self.device, decode_span=self.decode_span)
        if self._compiled_serves(chunks, capture_layers):
            streams, logits = self.static_decode(batch, self.cache)
            return self._result(batch.num_tokens, batch.decode_rows, streams, logits, {}, logit_rows)
        with self.step_threads(chunks, capture_layers):
            streams, captured = self.model(batch, self.cache, capture_layers)
            return self._result(batch.num_tokens, batch.decode_rows, streams, None, captured, logit_rows)

    def step_threads(self, chunks: Sequence[Chunk], capture_layers: tuple[int, ...] = (), argmax: bool = False):
        """The threads a step over `chunks` runs on, as a context for its forward (`execute`) and the caller's
        sampling of its logits. A one-row step, or a decode step whose products the few-row kernels run, keeps
        off torch's OpenMP pool (the registry's threads_for_rows says why), head and sampling included: an OpenMP
        region of the sampler's (an argmax over 16 x 16384 logits is one) leaves torch's worker spinning on the
        core the kernels' worker needs, into the next step (measured on the small config, fp32, b=16: the step
        16.4 -> 15.6 ms with the sampling inside). A replayed step whose rows the replay's argmax samples
        (`argmax`, as `execute` takes it) runs no torch op at all, so torch's thread count is left alone: setting
        it twice cost ~25 us a step right after the weights had streamed through the caches. The compiled step's
        generated code is left on the threads it was compiled for."""
        if self._compiled_serves(chunks, capture_layers) or (argmax and self._replay_serves(chunks, capture_layers)):
            return contextlib.nullcontext()
        rows = sum(len(chunk.token_ids) for chunk in chunks)
        single_tokens = bool(chunks) and rows == len(chunks)  # a decode step (`StepPlan.single_tokens`)
        return self.model.kernels.threads_for_rows(rows, single_tokens, (self.model.activation_dtype, self.model.dtype))

    def _replay_serves(self, chunks: Sequence[Chunk], capture_layers: tuple[int, ...]) -> bool:
        """Whether a replayed decode step runs these chunks (not where the compiled step does)."""
        return (self.replay is not None and not self._compiled_serves(chunks, capture_layers)
                and self.replay.serves(chunks, capture_layers))

    def _compiled_serves(self, chunks: Sequence[Chunk], capture_layers: tuple[int, ...]) -> bool:
        """Whether the compiled decode step runs these chunks: every one a single token, no layer captured."""
        return self.static_decode is not None and not capture_layers and self.static_decode.serves(chunks)

    def _result(self, rows: int, decode_rows: bool, streams: torch.Tensor, logits: torch.Tensor | None,
                captured: dict[int, torch.Tensor], logit_rows: Sequence[int],
                argmax: torch.Tensor | None = None) -> StepResult:
        """The result of a step of `rows` rows (`decode_rows`: a decode step's) with the logits of `logit_rows`;
        `logits`: every row's, when the forward already computed them (the compiled step, the replay), else None;
        `argmax`: every row's argmax with them (kept only when every row's logits are the ones asked for)."""
        if not logit_rows:
            return StepResult(streams, None, captured)
        if len(logit_rows) == rows:  # every row, in order (a pure decode step): no gather
            return StepResult(streams, self.logits(streams, decode_rows) if logits is None else logits, captured,
                              None if logits is None else argmax)
        picked = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
        if logits is not None:
            return StepResult(streams, logits.index_select(0, picked), captured)
        return StepResult(streams, self.logits(streams.index_select(0, picked)), captured)

    def logits(self, streams: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """Pre-head streams [N, hc, D] -> fp32 logits [N, V]; decode_rows: a decode step's rows (`Linear.forward`)."""
        return self.model.logits(streams, decode_rows)

    def rewind(self, lengths: dict[int, int]) -> None:
        """Forget positions >= lengths[slot] of each slot (draft tokens of the last step that were not
        accepted, or the whole slot with length 0): the rows they overwrote are restored from the
        step's snapshot, and the next chunk of the slot starts at its new length.

        Args:
            lengths: slot -> positions it keeps.
        """
        self.cache.rewind(lengths, self._snapshot)

    def fork(self, source: int, targets: Sequence[int], length: int) -> None:
        """Copy slot `source`'s positions [0, length) into each target slot (`ModelCache.fork`): sequences
        that share a prompt's prefill.

        Args:
            source: the slot that computed them.
            targets: the slots that take them.
            length: positions to copy.
        """
        self.cache.fork(source, targets, length)

    def forward_logprobs(self, token_ids: Sequence[Sequence[int]], chunk_tokens: int) -> list[torch.Tensor]:
        """Per sequence, fp32 [len, vocab] log-softmax next-token distributions from the chunked prefill
        path, in a scratch cache slot (the engine's slots are untouched).

        Args:
            token_ids: the sequences.
            chunk_tokens: tokens per forward (the engine's step budget).

        Returns:
            One [len, V] tensor per sequence.
        """
        self.require_ready()
        scratch = self.model.allocate_cache(1, max(len(ids) for ids in token_ids) + 1)
        results = []
        for ids in token_ids:
            parts = []
            for start in range(0, len(ids), chunk_tokens):
                batch = ForwardBatch.build([Chunk(0, list(ids[start : start + chunk_tokens]), start)],
                                           device=self.device)
                streams, _ = self.model(batch, scratch)
                parts.append(self.logits(streams).log_softmax(dim=-1))
            results.append(torch.cat(parts))
        return results
