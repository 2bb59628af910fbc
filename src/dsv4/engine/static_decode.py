"""A pure-decode step as one fixed-shape tensor program, so `torch.compile` can capture it whole.

A decode step on CPU is dispatch-bound: hundreds of framework calls of a few microseconds each around
GEMMs that take as long. `decode_forward` runs the model's own forward
(`DeepseekV4.forward_layers` and `logits`) over a step plan built from tensors (`DecodeMeta.of_tensors`),
which has what would break a compiled graph taken out:

- every row pools its compressor's current window and keeps the entry only where the row's token
  completes it (`torch.where`), instead of a host-side list of completing rows;
- each layer reads `entry_reads[rate]` compressed entries per row, masked by the row's own count: an
  int the host rounds up to a power of two, so a compiled graph sees few distinct values;
- the C kernels decline inside the graph (the registry's, and those bound to weights), so norms, RoPE
  and mHC run the readable torch formulas, which the compiler fuses into a few loops; dense routed experts
  pick a fixed-shape strategy or one opaque op by shape (`kernels/gathered_experts.py`); FP8 / FP4 experts
  run as one opaque op that calls the fused C kernel where the eager step would and dequantizes the used
  experts elsewhere (`kernels/quant_experts.py`), the stacks staying quantized.

Compiled (`torch.compile(fullgraph=True)`), parameters and cache tensors are graph inputs read by address:
an in-place refit is seen by the next step with no recompilation (tests/test_static_decode.py).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dsv4.kernels.gathered_experts import GroupedExperts, swiglu
from dsv4.kernels.registry import KernelRegistry
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import LayerCache, ModelCache
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.moe import DENSE
from dsv4.model.step_plan import DecodeMeta, StepPlan

if TYPE_CHECKING:  # the runner imports this module
    from dsv4.engine.model_runner import Chunk
from dsv4.parallel.state import ParallelState


def unsupported_reason(model: DeepseekV4) -> str | None:
    """Why `decode_forward` cannot serve this model (None when it can)."""
    if model.activation_dtype != model.dtype:
        return (f"activation_dtype {model.activation_dtype} differs from dtype {model.dtype} (widened weights "
                f"take the routed experts off the static step's paths): compile needs activation_dtype == dtype")
    for i, layer in enumerate(model.layers):
        experts = layer.ffn.experts
        if experts.format != DENSE:  # FP8 / FP4 stacks run as one op whatever their shapes (quant_experts.py)
            continue
        probe = torch.empty(0, dtype=model.dtype)
        if not GroupedExperts.supports(probe, probe, probe, experts.w1, experts.w3, experts.w2, experts.limit, swiglu):
            return f"layer {i}: expert shapes {tuple(experts.w1.shape)} are not 16-byte aligned for _grouped_mm"
    return None


def entry_reads(positions: list[int], capacity: dict[int, int], least: int) -> dict[int, int]:
    """For each compress rate, how many entries every row reads: the most any row has completed,
    rounded up to a power of two and to at least `least`, at most the cache's capacity. A compiled
    step sees few distinct values; reading a few masked entries more costs nothing."""
    latest = max(positions)  # the row that has completed the most entries, at every rate
    reads = {}
    for rate, cap in capacity.items():
        most = (latest + 1) // rate
        reads[rate] = min(cap, max(least, 1 << max(0, most - 1).bit_length()))
    return reads


@torch.no_grad()
def decode_forward(
    model: DeepseekV4, cache: list[LayerCache], token_ids: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, reads: dict[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids, positions, slots [B] -> (streams S [B, hc, D], fp32 logits [B, V]).
    Writes each row's window ring, compressor rings and completed entries in its cache slot."""
    plan = StepPlan(decode=DecodeMeta.of_tensors(positions, slots, reads), prefill=None)
    batch = ForwardBatch(token_ids=token_ids, positions=positions, segments=(), plan=plan)
    streams, _ = model.forward_layers(batch, cache)
    return streams, model.logits(streams)


# ---- the engine's entry point ----
# Inductor options of the compiled step. `cpp_wrapper`: the generated code calls its kernels, GEMMs and
# buffer allocations from C++ instead of a Python wrapper, whose per-call cost (hundreds of allocations
# and stride checks per step) dominates a dispatch-bound step: tiny config, 16 rows, 2.90 -> 2.38 ms per
# step (measured back to back in one process). A cold compile also builds the C++ wrapper.
# `guard_filter_fn`: every module reaches the model's one kernel registry and parallel state through its own
# attribute, and dynamo guards each pair of such paths with an "a is b" check, 78 attribute walks in one
# Python lambda before every call (tiny config: the guard lookup measured 280 us, 124 us for a step without
# them). Both objects are fixed for the model's life (the registry's choices are resolved before capture and
# never change; ParallelState is frozen) and only read by the graph, and each path keeps its own guards on
# what the graph read, so those identity checks are dropped.
COMPILE_OPTIONS = {"cpp_wrapper": True, "guard_filter_fn": lambda entries: [keep_guard(e) for e in entries]}


def keep_guard(entry) -> bool:
    """Whether the compiled step keeps a dynamo guard (a `torch._dynamo.types.GuardFilterEntry`): all but
    identities between two paths to the kernel registry, the parallel state or a Python module (such as
    each source module's `torch`, which the process imports once)."""
    return not (entry.guard_type == "DUPLICATE_INPUT"
                and isinstance(entry.value, (KernelRegistry, ParallelState, types.ModuleType)))


class StaticDecode:
    """Runs pure-decode steps (every segment one token) through `decode_forward`, compiled with
    `torch.compile` when `compile` is set. Shapes are symbolic (`dynamic=True`): a graph serves a
    range of batch sizes and every entry count. Batch size 1 gets its own graph (torch specialises
    sizes 0 and 1), and so does each batch-size range with another expert strategy (`GroupedExperts`), so a
    process compiles two to four graphs (one to four minutes each on a 2-core CPU, the C++ wrapper
    included; torch caches the generated code on disk, so a later process reuses it)."""

    def __init__(self, model: DeepseekV4, compile: bool):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"static decode step unavailable: {reason}")
        self.model = model
        # Entry reads never drop below the indexer's k (nor 2): `min(k, n)` and size-1 specialisation
        # would otherwise split the graph by entry count.
        self._least_reads = max(2, model.cfg.index_topk)
        # One compressed layer per compress rate: where the step reads each rate's entry capacity.
        rate_layers = {}
        for i, layer in enumerate(model.layers):
            if layer.attn.compressor is not None:
                rate_layers.setdefault(layer.attn.compressor.rate, i)
        self._rate_layers = tuple(rate_layers.items())
        self._forward = decode_forward
        if compile:
            model.kernels.resolve_all()
            compiled = torch.compile(decode_forward, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS)
            # The floats the step reads (norm eps, SwiGLU limit, routing scale) are model constants: specialised,
            # they are baked into the graph (a guard recompiles for another model) instead of ~30 scalars boxed
            # into tensors on every call (~5% of a tiny-config step).
            self._forward = torch._dynamo.config.patch(specialize_float=True)(compiled)

    @staticmethod
    def serves(chunks: Sequence[Chunk]) -> bool:
        """Whether a step of these chunks is a pure-decode step: every chunk one token (the step plan then has
        single-token decode rows only)."""
        return bool(chunks) and all(len(chunk.token_ids) == 1 for chunk in chunks)

    def __call__(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A pure-decode batch -> (streams [B, hc, D], fp32 logits [B, V]); extends the rows' cache slots."""
        self.model.require_ready()
        cache.begin_step(batch.segments)
        decode = batch.plan.decode
        capacity = {rate: cache.layers[i].compressor.entries.shape[1] for rate, i in self._rate_layers}
        reads = entry_reads(decode.host_positions, capacity, self._least_reads)
        return self._forward(self.model, cache.layers, batch.token_ids, batch.positions, decode.slots, reads)
