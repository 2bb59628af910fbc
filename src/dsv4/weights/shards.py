"""One rank's shard of incoming full tensors: what a tensor / expert parallel rank keeps of each
checkpoint tensor or refit tensor, before the writer validates and copies it.

Every load path hands the writer full tensors (checkpoint files, trainer buckets); `ShardSlicer` cuts
this rank's part out of each per the sharding plan (`dsv4.parallel.plan`), after checking the full
tensor's size along the split dimension (a wrong-sized tensor must fail on every rank, not only on the
ranks whose slice happens to come up short):

  replicated tensor                   passed through whole
  routed expert of another rank       dropped (expert parallel); a checkpoint load never reads its bytes
  split float tensor                  a view of the rank's rows / columns (of the mapped file: only its
                                      pages are read)
  split quantized resident expert     weight bytes and scale grid sliced apart (the split falls on scale
  (FP8 / FP4, width split)            block boundaries, checked when the model was built)
  split quantized tensor kept float   weight and scale paired here, the scale blocks that cover the
  (FP8 dense linears, FP4 -> dense)   rank's part dequantized, then cropped: a split need not fall on a
                                      block boundary, and the values equal a full dequantize's bit for bit
HF stacked experts become per-expert native tensors first (`names.canonical_tensors`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dsv4.config import DENSE, FP4, FP8
from dsv4.parallel.plan import holds_expert, routed_expert_id, split_of
from dsv4.parallel.state import ParallelState
from dsv4.weights.convert import E4M3, PACKED_DTYPES, ConversionError, QuantLayout, dequantize
from dsv4.weights.names import canonical_tensors
from dsv4.weights.routes import SCALE, WEIGHT, RouteTable
from dsv4.weights.slots import FLOAT, Slot

_QUANTIZED_RESIDENT = (FP8, FP4)
_FLOAT_RESIDENT = (FLOAT, DENSE)


class ShardSlicer:
    """Cuts this rank's shard out of incoming full tensors (module docstring).

    Args:
        routes: the rank's route table (its slots hold the local shapes).
        layout: block sizes of quantized incoming tensors.
        state: this rank's parallel state.
        n_experts: routed experts of the full model (the id range of per-expert names).
    """

    def __init__(self, routes: RouteTable, layout: QuantLayout, state: ParallelState, n_experts: int):
        self.routes = routes
        self.layout = layout
        self.state = state
        self.n_experts = n_experts
        self._halves: dict[Slot, dict[str, torch.Tensor]] = {}  # quantized halves awaiting their partner

    def held_elsewhere(self, name: str) -> bool:
        """Whether `name` (native spelling) is a routed expert tensor only other ranks hold."""
        expert = routed_expert_id(name)
        return expert is not None and expert < self.n_experts and not holds_expert(expert, self.n_experts, self.state)

    def pieces(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs of this rank's shard of one incoming tensor (possibly none).

        Raises:
            ConversionError: a split tensor whose full size along the split dimension is wrong.
        """
        for native, part in canonical_tensors(name, tensor):
            if self.held_elsewhere(native):
                continue
            route = self.routes.resolve(native)
            if route is None or route.kind not in (WEIGHT, SCALE):
                yield native, part  # the writer decides (an unknown name fails there)
                continue
            split = split_of(route.slot.native, self.state)
            if split is None:
                yield native, part
            elif route.slot.kind in _FLOAT_RESIDENT and (route.kind == SCALE or _quantized(part)):
                yield from self._pair(route.slot, route.kind, part)
            else:
                yield native, self._slice(route.slot, route.kind == SCALE, part, split.dim)

    def _slice(self, slot: Slot, is_scale: bool, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank's part of a float tensor, or of a quantized resident expert's bytes or scale grid."""
        local = slot.logical[dim]
        unit = 1
        if is_scale:
            unit = self.layout.fp8_block[dim] if slot.kind == FP8 else (self.layout.fp4_group if dim == 1 else 1)
        elif t.dtype in PACKED_DTYPES and dim == 1:
            unit = 2  # two e2m1 codes per byte
        full = local * self.state.world_size // unit
        if t.dim() <= dim or t.shape[dim] != full:
            raise ConversionError(f"shape {tuple(t.shape)}: expected {full} along dim {dim} (the full tensor, "
                                  f"of which rank {self.state.rank} keeps 1/{self.state.world_size})")
        return t.narrow(dim, self.state.rank * local // unit, local // unit)

    def _pair(self, slot: Slot, kind: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        halves = self._halves.setdefault(slot, {})
        key = "scale" if kind == SCALE else "weight"
        if key in halves:
            raise ConversionError(f"its {key} arrived twice")
        halves[key] = t
        if len(halves) == 2:
            del self._halves[slot]
            yield slot.native, self._dequantized_part(slot, halves["weight"], halves["scale"])

    def _dequantized_part(self, slot: Slot, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Dequantize the scale blocks covering the rank's part of a split [out, in] weight, then crop."""
        split = split_of(slot.native, self.state)
        dim, local = split.dim, slot.logical[split.dim]
        fp8 = weight.dtype == E4M3
        block = self.layout.fp8_block[dim] if fp8 else (self.layout.fp4_group if dim == 1 else 1)
        packing = 2 if not fp8 and dim == 1 else 1
        full = local * self.state.world_size
        if weight.dim() != 2 or weight.shape[dim] * packing != full:
            raise ConversionError(f"quantized weight shape {tuple(weight.shape)}: expected {full} values along "
                                  f"dim {dim} (the full tensor, of which rank {self.state.rank} keeps "
                                  f"1/{self.state.world_size})")
        start = self.state.rank * local
        lo = start // block * block
        hi = min(-(-(start + local) // block) * block, full)
        covering_weight = weight.narrow(dim, lo // packing, (hi - lo) // packing)
        covering_scale = scale.narrow(dim, lo // block, -(-(hi - lo) // block))
        logical = list(slot.logical)
        logical[dim] = hi - lo
        values = dequantize(covering_weight, covering_scale, self.layout, tuple(logical), slot.dest.dtype)
        return values.narrow(dim, start - lo, local)

    def unpaired(self) -> list[str]:
        """Messages for quantized halves still waiting for their partner."""
        return [f"{slot.native}: {'scale' if 'weight' in h else 'weight'} never arrived"
                for slot, h in self._halves.items()]

    def own_pending(self) -> None:
        """Copy the waiting halves out of the caller's buffers (a trainer reuses them for the next bucket)."""
        for halves in self._halves.values():
            for key, t in halves.items():
                halves[key] = t.clone()

    def discard(self) -> None:
        self._halves.clear()


def _quantized(t: torch.Tensor) -> bool:
    return t.dtype == E4M3 or t.dtype in PACKED_DTYPES

