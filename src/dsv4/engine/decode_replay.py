"""A decode step recorded once as its C kernel calls, then replayed: the host-side twin of a CUDA graph.

On CPU every op of an eager decode step of up to 64 rows runs in a C kernel (the few-row products, the fused mHC
steps, norm + RoPE, the decode attention, the fused MoE layer), yet the Python around those ~150 calls (module
calls, `supports` checks, argument packing, output allocation, ctypes' argument conversion) took ~1.5-2 ms of a
~4 ms small-config step at batch 1, more than the weights take to stream, and ~5 ms of a ~14 ms step at 16 rows.
A replay makes the same calls with the same arguments (kernels/native_calls.py) for a small fraction of that:
one call into C that makes them all in order. Each row count gets its own record.

Why it computes exactly what the eager step computes:
- the record is the eager forward itself over the engine's cache, the blocks and the head
  (`DeepseekV4.forward_embedded`, `head_output`), every kernel call kept with its arguments, and that step's
  result is the eager one;
- a step's values reach the calls only through tensors whose addresses they hold: the token ids, their positions
  and cache slots (written into the recorded step's tensors before each replay); the embedding rows are the
  replay's first call, which copies the table's rows for the token ids it reads there (bit for bit what the eager
  embedding returns);
- the record is refused, and the steps stay eager, when the forward ran any torch op other than an allocation
  or a view (`_AllocationsOnly`): a kernel that declined the call, a weight widened per call, anything a replay
  would not redo;
- what the host decides in the eager forward does not differ between decode steps of one row count (the plan's
  shape is fixed; which compressor windows complete, how many entries a row reads and the indexer's picks are
  decided in C from the positions), which tests/test_decode_replay.py checks across every compress rate's
  windows, with rows in scattered slots.

The host's work around the calls is kept free of torch ops. A step streams ~100 MB of weights through the caches
(the small config), and right after it each torch op's dispatch runs from cold caches: ~50-90 us an op there
against a few us warm (measured on the small config, fp32, batch 1: the embedding lookup 90 us, each output copy
60-70 us). So the embedding rows are gathered by a recorded C call (numpy's gather of them cost ~24 us there), the
step returns the record's own output buffers (valid until the next step of that row count; the engine consumes
them within its step), and when every row samples greedily the record's argmax call runs inside the replay, so the
sampler never touches the logits.

The record holds pointers into the weights and the cache. Weights keep their addresses through every load and
refit (written in place), and each finalize (`process_weights_after_loading`) starts a new weights generation
after which the next step records afresh (the kernels were bound again); a record also names the thread count
its calls were made with. The cache is the runner's, allocated once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.kernels.gemv_cpu import MAX_F32_DECODE_ROWS
from dsv4.kernels.native_calls import Replay, recording
from dsv4.kernels.registry import EMBEDDING_ROWS, GREEDY_ARGMAX
from dsv4.model.batch import ForwardBatch, Segment
from dsv4.model.cache import ModelCache
from dsv4.model.deepseek_v4 import DeepseekV4

_aten = torch.ops.aten
# Ops a recorded forward may run: allocations (outputs the kernels write) and ops whose result is their input's
# storage (views, and `to` / `reshape` / `contiguous` where they change nothing). Any other op computes something
# the replay would not compute again.
_ALLOCATIONS = frozenset({_aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default})


def _aliases_input(args: tuple, out) -> bool:
    """Whether `out` (a tensor) lies in the storage of the op's first argument (a tensor)."""
    return (bool(args) and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor)
            and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr())


class _AllocationsOnly(TorchDispatchMode):
    """Notes every torch op the block runs that neither allocates nor returns its input's storage, and keeps
    every tensor allocated in it (the recorded calls hold their addresses)."""

    def __init__(self):
        super().__init__()
        self.foreign: list[str] = []
        self.allocated: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated.append(out)
        elif not _aliases_input(args, out):
            self.foreign.append(str(func))
        return out


# Rows a replayed step may have: a decode step's rows that the few-row kernels (products, attention, mHC, the MoE
# layer) take; a step of more rows runs eager, where torch's GEMMs take them.
MAX_REPLAY_ROWS = MAX_F32_DECODE_ROWS
# Records kept (the least recently used goes first): each holds its step's intermediates (the small config at 64
# rows: 14 MB, the logits [64, V] fp32 among them), and a batch whose size wanders through every count would
# otherwise keep one per count. Recording is one eager step and ~10% (small config, 64 rows: 28.5 against 25.9 ms),
# so a row count that comes back after its record was dropped costs little.
MAX_RECORDS = 8


@dataclass(frozen=True)
class DecodeOutput:
    """A replayed step's outputs: the record's own buffers, valid until the next step of this row count.

    streams: [B, hc, D] the last layer's streams; logits: fp32 [B, V]; argmax: [B] int64 each row's argmax (the
    first largest id), when asked for and the model's kernels take the logits, else None."""

    streams: torch.Tensor
    logits: torch.Tensor
    argmax: torch.Tensor | None


@dataclass(frozen=True)
class _Record:
    """One recorded step: the replay, the step tensors its calls read, its output streams, and what it is valid for."""

    replay: Replay
    generation: int  # the model's weights generation when recorded
    threads: int | None  # the few-row pool's threads when recorded
    token_ids: torch.Tensor  # [B] int64
    embeds: torch.Tensor  # [B, D]: the embedding rows the first block reads
    # Whether the replay's first call gathers `embeds` from the table (the model's EMBEDDING_ROWS kernel); else
    # (weights narrower than the activations, or no kernel) torch's lookup fills them before the calls.
    gathers_embeds: bool
    streams: torch.Tensor  # [B, hc, D]: what the last layer's calls write
    logits: torch.Tensor  # [B, V] in the activation dtype: what the head's call writes
    fp32_logits: bool  # whether `logits` are fp32 (asked once: a dtype read costs ~20 us after a step)
    forward_calls: int  # the replay's calls of the forward; an argmax call over `logits` may follow them
    argmax: torch.Tensor | None  # [B] what that argmax call writes (fp32 logits), or None: no such call
    step_values: tuple[np.ndarray, np.ndarray, np.ndarray]  # token ids, positions, slots: views of the step tensors
    held: tuple  # every tensor the calls address that nobody else keeps


class DecodeReplay:
    """Serves the pure-decode steps of `model` over `cache` (every sequence one token, at most MAX_REPLAY_ROWS of
    them) by replaying one recorded step per row count (module docstring)."""

    def __init__(self, model: DeepseekV4, cache: ModelCache, max_records: int = MAX_RECORDS):
        self.model = model
        self.cache = cache
        self.max_records = max_records
        self._records: dict[int, _Record] = {}  # by row count, least recently used first
        self._refused: dict[int, int] = {}  # row count -> the weights generation whose recording was refused
        self.refused: str | None = None  # why the last refused recording was refused
        self.replayed_steps = 0  # steps served by a replay (not recorded)
        # Fixed for the model's life (weights are written in place): one CPU rank. Asked once, not every step (a
        # tensor attribute read right after a step has streamed the weights through the caches costs ~10 us).
        self._host_model = not model.parallel.is_parallel and model.embed.weight.is_cpu

    def serves(self, chunks, capture_layers: tuple[int, ...]) -> bool:
        """Whether a step of these chunks replays: every chunk one token, at most MAX_REPLAY_ROWS of them, no layer
        captured, on one CPU rank, and no refused recording of this row count for the current weights."""
        return (self._host_model and 0 < len(chunks) <= MAX_REPLAY_ROWS and not capture_layers
                and all(len(chunk.token_ids) == 1 for chunk in chunks)
                and self._refused.get(len(chunks)) != self.model.weights_generation)

    @property
    def recorded_rows(self) -> tuple[int, ...]:
        """The row counts with a record, least recently used first."""
        return tuple(self._records)

    def recorded_calls(self, rows: int = 1) -> int:
        """Kernel calls of the record of `rows`-row steps (0: none)."""
        return len(self.recorded_kernels(rows))

    def recorded_kernels(self, rows: int = 1) -> tuple[str, ...]:
        """The kernel of each call of the record of `rows`-row steps, in order (empty: no record)."""
        record = self._records.get(rows)
        return () if record is None else record.replay.kernels

    def __call__(self, chunks, argmax: bool = False) -> DecodeOutput:
        """One decode step of `chunks` (each an engine `Chunk` of one token: its slot, token and position), each
        row's argmax too when `argmax`; extends each slot as the eager forward does."""
        model = self.model
        model.require_ready()
        record = self._records.pop(len(chunks), None)
        if record is None or record.generation != model.weights_generation or record.threads != self._threads():
            return self._record_step(chunks, argmax)
        self._records[len(chunks)] = record  # now the most recently used
        self.replayed_steps += 1
        self.cache.begin_step(tuple(Segment(slot=chunk.slot, start=chunk.start, begin=i, end=i + 1)
                                    for i, chunk in enumerate(chunks)))
        token_view, position_view, slot_view = record.step_values
        token_view[:] = [chunk.token_ids[0] for chunk in chunks]
        position_view[:] = [chunk.start for chunk in chunks]
        slot_view[:] = [chunk.slot for chunk in chunks]
        if not record.gathers_embeds:
            # The recorded buffers are inference tensors when the step was recorded in inference mode (the engine's).
            with torch.inference_mode(record.embeds.is_inference()):
                record.embeds.copy_(model.embed_tokens(record.token_ids))
        picked = record.argmax if argmax else None
        record.replay.run(None if picked is not None else record.forward_calls)
        return DecodeOutput(record.streams, record.logits if record.fp32_logits else record.logits.float(), picked)

    def _threads(self) -> int | None:
        return self.model.kernels.few_row_threads()

    def _record_step(self, chunks, argmax: bool) -> DecodeOutput:
        """The eager step, recorded; the record kept unless the forward ran ops a replay would not."""
        model, generation, rows = self.model, self.model.weights_generation, len(chunks)
        self._records.pop(rows, None)
        batch = ForwardBatch.build([(chunk.slot, list(chunk.token_ids), chunk.start) for chunk in chunks], device="cpu")
        decode = batch.plan.decode
        self.cache.begin_step(batch.segments)
        table = model.embed.weight
        gather = (model.kernels.kernel(EMBEDDING_ROWS, table, batch.token_ids)
                  if table.dtype == model.activation_dtype else None)
        if gather is None:
            embeds = model.embed_tokens(batch.token_ids)
        guard = _AllocationsOnly()
        with recording() as calls, guard:
            if gather is not None:
                embeds = gather(table, batch.token_ids)  # the table's rows: what embed_tokens returns
            streams, _ = model.forward_embedded(embeds, batch, self.cache.layers)
            logits = model.head_output(streams, decode_rows=True)
        reason = None
        if guard.foreign:
            reason = f"the {rows}-row forward ran torch ops besides its kernels: {sorted(set(guard.foreign))}"
        elif decode is None or not decode.pure or decode.pos is not batch.positions:
            reason = f"the {rows}-row step's plan reads positions from another tensor than the batch's"
        if reason is not None:
            self.refused = reason
            self._refused[rows] = generation
            return DecodeOutput(streams, logits.float(), None)
        forward_calls = len(calls)
        picked = self._argmax(logits, calls)
        step_tensors = (batch.token_ids, batch.positions, decode.slots)
        while len(self._records) >= self.max_records:
            self._records.pop(next(iter(self._records)))  # the least recently used
        fp32_logits = logits.dtype == torch.float32
        self._records[rows] = _Record(
            replay=Replay(calls), generation=generation, threads=self._threads(), token_ids=batch.token_ids,
            embeds=embeds, gathers_embeds=gather is not None, streams=streams, logits=logits,
            fp32_logits=fp32_logits, forward_calls=forward_calls, argmax=picked,
            step_values=tuple(t.numpy() for t in step_tensors),
            held=(*step_tensors, *guard.allocated, calls))
        return DecodeOutput(streams, logits if fp32_logits else logits.float(), picked if argmax else None)

    def _argmax(self, logits: torch.Tensor, calls: list) -> torch.Tensor | None:
        """The model's argmax kernel over `logits`, called once and recorded after the forward's `calls`: its output;
        None when no kernel takes these logits (then the sampler computes the argmax)."""
        kernel = self.model.kernels.kernel(GREEDY_ARGMAX, logits)
        if kernel is None:
            return None
        with recording() as argmax_calls:
            picked = kernel(logits)
        calls.extend(argmax_calls)
        return picked
