"""A one-row decode step recorded once as its C kernel calls, then replayed: the host-side twin of a CUDA graph.

At batch 1 on CPU every op of the eager forward runs in a C kernel (the few-row products, the fused mHC steps,
norm + RoPE, the decode attention, the fused MoE layer), yet the Python around those ~150 calls (module calls,
`supports` checks, argument packing, output allocation, ctypes' argument conversion) took ~1.5-2 ms of a ~4 ms
small-config step, more than the weights take to stream. A replay makes the same calls with the same arguments
(kernels/native_calls.py) for a small fraction of that.

Why it computes exactly what the eager step computes:
- the record is the eager forward itself (`DeepseekV4.forward_embedded`) over the engine's cache, every kernel
  call kept with its arguments, and that step's result is the eager one;
- a step's values reach the calls only through tensors whose addresses they hold: the token id, its position
  and cache slot (written into the recorded step's tensors before each replay) and the embedding row
  (recomputed into the recorded buffer);
- the record is refused, and the steps stay eager, when the forward ran any torch op other than an allocation
  or a view (`_AllocationsOnly`): a kernel that declined the call, a weight widened per call, anything a replay
  would not redo;
- what the host decides in the eager forward does not differ between one-row decode steps (the plan's shape is
  fixed; which compressor windows complete, how many entries a row reads and the indexer's picks are decided in
  C from the position), which tests/test_decode_replay.py checks across every compress rate's windows.

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

from dsv4.kernels.native_calls import Replay, recording
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


@dataclass(frozen=True)
class _Record:
    """One recorded step: the replay, the step tensors its calls read, its output streams, and what it is valid for."""

    replay: Replay
    generation: int  # the model's weights generation when recorded
    threads: int | None  # the few-row pool's threads when recorded
    token_ids: torch.Tensor  # [1] int64
    embeds: torch.Tensor  # [1, D]: the embedding row the first block reads
    streams: torch.Tensor  # [1, hc, D]: what the last call writes
    step_values: tuple[np.ndarray, np.ndarray, np.ndarray]  # token id, position, slot: views of the step tensors
    held: tuple  # every tensor the calls address that nobody else keeps


class DecodeReplay:
    """Serves the one-row decode steps of `model` over `cache` by replaying one recorded step (module docstring)."""

    def __init__(self, model: DeepseekV4, cache: ModelCache):
        self.model = model
        self.cache = cache
        self._record: _Record | None = None
        self.refused: str | None = None  # why the last recording was refused (its generation: `_refused_generation`)
        self._refused_generation: int | None = None

    def serves(self, chunks, capture_layers: tuple[int, ...]) -> bool:
        """Whether a step of these chunks replays: one sequence, one token, no layer captured, on one CPU rank,
        and no refused recording for the current weights."""
        model = self.model
        return (len(chunks) == 1 and len(chunks[0].token_ids) == 1 and not capture_layers
                and not model.parallel.is_parallel and model.embed.weight.is_cpu
                and self._refused_generation != model.weights_generation)

    @property
    def recorded_calls(self) -> int:
        """Kernel calls of the current record (0: none)."""
        return 0 if self._record is None else len(self._record.replay)

    def __call__(self, slot: int, token: int, position: int) -> torch.Tensor:
        """One decode step of `token` at `position` in cache slot `slot` -> its streams [1, hc, D] (a fresh tensor);
        extends the slot as the eager forward does."""
        model = self.model
        model.require_ready()
        record = self._record
        if record is None or record.generation != model.weights_generation or record.threads != self._threads():
            return self._record_step(slot, token, position)
        self.cache.begin_step((Segment(slot=slot, start=position, begin=0, end=1),))
        token_view, position_view, slot_view = record.step_values
        token_view[0], position_view[0], slot_view[0] = token, position, slot
        # The recorded buffers are inference tensors when the step was recorded in inference mode (the engine's).
        with torch.inference_mode(record.embeds.is_inference()):
            record.embeds.copy_(model.embed_tokens(record.token_ids))
        record.replay.run()
        return record.streams.clone()

    def _threads(self) -> int | None:
        return self.model.kernels.few_row_threads()

    def _record_step(self, slot: int, token: int, position: int) -> torch.Tensor:
        """The eager step, recorded; the record kept unless the forward ran ops a replay would not."""
        model, generation = self.model, self.model.weights_generation
        self._record = None
        batch = ForwardBatch.build([(slot, [token], position)], device="cpu")
        decode = batch.plan.decode
        self.cache.begin_step(batch.segments)
        embeds = model.embed_tokens(batch.token_ids)
        guard = _AllocationsOnly()
        with recording() as calls, guard:
            streams, _ = model.forward_embedded(embeds, batch, self.cache.layers)
        self.refused = None
        if guard.foreign:
            self.refused = f"the one-row forward ran torch ops besides its kernels: {sorted(set(guard.foreign))}"
        elif decode is None or not decode.pure or decode.pos is not batch.positions:
            self.refused = "the one-row step's plan reads positions from another tensor than the batch's"
        if self.refused is not None:
            self._refused_generation = generation
            return streams
        step_tensors = (batch.token_ids, batch.positions, decode.slots)
        self._record = _Record(
            replay=Replay(calls), generation=generation, threads=self._threads(), token_ids=batch.token_ids,
            embeds=embeds, streams=streams, step_values=tuple(t.numpy() for t in step_tensors),
            held=(*step_tensors, *guard.allocated, calls))
        return streams.clone()
