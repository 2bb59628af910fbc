"""The load step: (name, tensor) pairs -> validated, converted values -> in-place writes.

Every load format (checkpoint files, dummy values, refit buckets) goes through `WeightWriter`, so name
mapping, pairing of weights with their scales, validation and conversion exist once. Staging (map +
validate + convert) is separate from writing, which lets a refit session validate everything before
it touches a single resident byte.

Staged values and pending weight/scale halves may alias the caller's tensors (no copy is made when
the incoming dtype and layout already match): whoever defers a write past the caller's next reuse of
its buffers must clone them first, as the atomic refit session does.
"""

import re
from dataclasses import dataclass, field

import torch

from dsv4.config import FP4
from dsv4.errors import CheckpointError
from dsv4.weights.convert import ConversionError, QuantLayout, needs_scale, to_expert, to_plain
from dsv4.weights.names import canonical_tensors
from dsv4.weights.slots import Slot, SlotTable

# Drafter copies of the target's embedding and head: the target owns them, drafters alias them.
ALIASED_DRAFTER_TENSORS = re.compile(r"^mtp\.\d+\.(emb\.tok_emb\.weight|head\.weight|embed\.weight)$")
_DRAFTER_PREFIX = "mtp."


@dataclass
class StagedWrite:
    slot: Slot
    value: torch.Tensor
    scale: torch.Tensor | None
    origin: str


@dataclass
class _Pending:
    weight: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    origin: str = ""


@dataclass
class WeightWriter:
    table: SlotTable
    layout: QuantLayout
    error_type: type[Exception] = CheckpointError
    written: set[str] = field(default_factory=set)
    ignored: set[str] = field(default_factory=set)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._has_drafter = any(s.native.startswith(_DRAFTER_PREFIX) for s in self.table)

    # ---- staging ----
    def stage(self, name: str, tensor: torch.Tensor, origin: str) -> list[StagedWrite]:
        """Map, pair, validate and convert one incoming tensor; returns the writes it completes."""
        try:
            pairs = list(canonical_tensors(name, tensor))
        except ValueError as exc:
            raise self.error_type(f"{origin}: tensor {name}: {exc}") from None
        staged = []
        for native, t in pairs:
            staged.extend(self._stage_native(native, t, origin, incoming=name))
        return staged

    def _stage_native(self, native: str, tensor: torch.Tensor, origin: str, incoming: str) -> list[StagedWrite]:
        if ALIASED_DRAFTER_TENSORS.match(native):
            self.ignored.add(native)
            return []
        is_scale = native.endswith(".scale")
        weight_name = native[: -len(".scale")] + ".weight" if is_scale else native
        slot = self.table.get(weight_name)
        if slot is None:
            if native.startswith(_DRAFTER_PREFIX) and not self._has_drafter:
                self.ignored.add(native)  # drafter weights, but no drafter was requested
                return []
            raise self.error_type(f"{origin}: unexpected tensor {incoming!r} (no such weight in this model)")
        if not is_scale and not needs_scale(tensor, slot.is_expert):
            return [self._convert(slot, tensor, None, origin, incoming)]
        pending = self._pending.setdefault(weight_name, _Pending())
        if (pending.scale if is_scale else pending.weight) is not None:
            raise self.error_type(f"{origin}: tensor {incoming!r} arrived twice before its partner")
        if is_scale:
            pending.scale = tensor
        else:
            pending.weight = tensor
        pending.origin = origin
        if pending.weight is None or pending.scale is None:
            return []
        del self._pending[weight_name]
        return [self._convert(slot, pending.weight, pending.scale, origin, incoming)]

    def _convert(
        self, slot: Slot, weight: torch.Tensor, scale: torch.Tensor | None, origin: str, incoming: str
    ) -> StagedWrite:
        resident = self.table.param(slot)
        try:
            if slot.is_expert:
                fmt = self.table.expert_format(slot)
                resident_scale = self.table.scale_param(slot)
                logical = tuple(resident.shape[1:])
                if fmt == FP4:
                    logical = (logical[0], logical[1] * 2)
                value, value_scale = to_expert(
                    weight, scale, fmt, resident[slot.expert],
                    None if resident_scale is None else resident_scale[slot.expert], self.layout, logical,
                )
            else:
                n_experts = self.table.models[slot.role].cfg.n_routed_experts
                value, value_scale = to_plain(weight, scale, resident, self.layout, n_experts), None
        except ConversionError as exc:
            raise self.error_type(f"{origin}: tensor {incoming} ({slot.native}): {exc}") from None
        return StagedWrite(slot=slot, value=value, scale=value_scale, origin=origin)

    # ---- writing ----
    @torch.no_grad()
    def write(self, staged: StagedWrite) -> None:
        """Copy into the resident storage (never rebinds)."""
        resident = self.table.param(staged.slot)
        if staged.slot.is_expert:
            resident[staged.slot.expert].copy_(staged.value)
            if staged.scale is not None:
                self.table.scale_param(staged.slot)[staged.slot.expert].copy_(staged.scale)
        else:
            resident.copy_(staged.value)
        self.written.add(staged.slot.native)

    def load(self, name: str, tensor: torch.Tensor, origin: str) -> None:
        for staged in self.stage(name, tensor, origin):
            self.write(staged)

    # ---- accounting ----
    def unpaired(self) -> list[str]:
        out = []
        for name, p in sorted(self._pending.items()):
            missing = "scale" if p.scale is None else "weight"
            out.append(f"{name} (from {p.origin}) has no {missing}")
        return out

    def check_complete(self, expected: set[str], what: str) -> None:
        """Raise unless every expected weight was written and no weight waits for its scale partner."""
        problems = self.unpaired()
        missing = sorted(expected - self.written)
        if missing:
            shown = ", ".join(missing[:10]) + (f" ... (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            problems.append(f"{len(missing)} missing tensor(s): {shown}")
        if problems:
            raise self.error_type(f"{what}: " + "; ".join(problems))
