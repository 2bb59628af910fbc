"""Where each native checkpoint tensor lands: native name -> its resident destination.

Built from the models themselves, so the table can never disagree with what was allocated, and built once
per set of models (`LoadedModels.slot_table()` keeps it while no parameter has moved): every slot holds the
views it writes into (the parameter, or one expert's slice of a stacked parameter and of its scale), so a
load or a refit indexes a dict instead of walking modules and parsing parameter names for every tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dsv4.config import DENSE, FP4
from dsv4.model.derived import TopLevelModel
from dsv4.model.moe import RoutedExperts

# Kinds of non-expert slots; an expert slot's kind is its resident format (dense | fp8 | fp4).
FLOAT, TABLE = "float", "table"
_TABLE_DTYPES = (torch.int32, torch.int64)
_STACKED_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<w>w[123])$")
_SCALE_SUFFIX = "_scale"
WEIGHT_SUFFIX = ".weight"


@dataclass(frozen=True, eq=False)
class Slot:
    """One native weight name and the resident storage it is written into (compared by identity)."""

    native: str  # native weight name, e.g. "layers.2.ffn.experts.5.w1.weight"
    role: str  # which top-level model: "target" | "mtp" | "dspark"
    param: str  # parameter name inside that model
    kind: str  # FLOAT | TABLE | DENSE | FP8 | FP4
    resident: torch.Tensor = field(repr=False)  # the whole parameter
    dest: torch.Tensor = field(repr=False)  # what this slot writes: the parameter, or its expert's slice
    scale_resident: torch.Tensor | None = field(default=None, repr=False)  # the stacked experts' scales
    scale_dest: torch.Tensor | None = field(default=None, repr=False)  # this expert's slice of them
    expert: int | None = None  # index into a stacked expert parameter
    n_experts: int = 0  # routed experts of its model (the id range of a routing table)

    @property
    def is_expert(self) -> bool:
        return self.expert is not None

    @property
    def logical(self) -> tuple[int, ...]:
        """Shape of the values this slot holds: FP4 bytes pack two inputs each."""
        shape = tuple(self.dest.shape)
        return (shape[0], shape[1] * 2) if self.kind == FP4 else shape


@dataclass(frozen=True, eq=False)
class ExpertStack:
    """Matrix `w` of every expert of one MoE layer: where a stacked (HF layout) tensor lands."""

    native_prefix: str  # e.g. "layers.3.ffn.experts"
    w: str  # "w1" | "w2" | "w3"
    kind: str  # the experts' resident format
    dest: torch.Tensor = field(repr=False)  # [E, out, in] (fp4: [E, out, in/2])
    scale_dest: torch.Tensor | None = field(repr=False)
    slots: tuple[Slot, ...] = field(repr=False)

    @property
    def logical(self) -> tuple[int, int, int]:
        experts, out_dim, in_dim = self.dest.shape
        return experts, out_dim, in_dim * 2 if self.kind == FP4 else in_dim


def parameter_addresses(models: dict[str, TopLevelModel]) -> dict[tuple[str, str], int]:
    """data_ptr of every parameter: the slots' views are valid exactly while these are unchanged."""
    return {(role, name): p.data_ptr() for role, model in models.items() for name, p in model.named_parameters()}


class SlotTable:
    """All slots of a set of top-level models (the target and any drafters)."""

    def __init__(self, models: dict[str, TopLevelModel]):
        self.models = models
        self.addresses = parameter_addresses(models)
        self._slots: dict[str, Slot] = {}
        self._stacks: dict[str, ExpertStack] = {}
        for role, model in models.items():
            params = dict(model.named_parameters())
            for param_name, param in params.items():
                if param_name.endswith(_SCALE_SUFFIX) and param_name.removesuffix(_SCALE_SUFFIX) in params:
                    continue  # an expert scale: written with its weight
                if match := _STACKED_EXPERT_PARAM.match(param_name):
                    self._add_stack(role, model, match["prefix"], match["w"], param, params)
                    continue
                kind = TABLE if param.dtype in _TABLE_DTYPES else FLOAT
                n_experts = model.cfg.n_routed_experts
                # parameters carry their native (checkpoint) names
                self._add(Slot(param_name, role, param_name, kind, param, param,
                               n_experts=n_experts))

    def _add_stack(self, role: str, model: TopLevelModel, prefix: str, w: str, param: torch.Tensor,
                   params: dict[str, torch.Tensor]) -> None:
        experts = model.get_submodule(prefix)
        if not isinstance(experts, RoutedExperts):
            raise RuntimeError(f"{role} model: {prefix}.{w} looks like stacked experts but is a {type(experts)}")
        scale = params.get(f"{prefix}.{w}{_SCALE_SUFFIX}")
        if (scale is None) != (experts.format == DENSE):
            raise RuntimeError(f"{role} model: {prefix}.{w} ({experts.format}) has scale {scale is not None}")
        param_name = f"{prefix}.{w}"
        n_experts = model.cfg.n_routed_experts
        slots = []
        first = experts.first_expert  # expert parallel: the global id of this rank's first expert
        # Every expert's view in one call each (an index per expert cost a third of planning a large model).
        views = param.unbind(0)
        scale_views = (None,) * len(views) if scale is None else scale.unbind(0)
        for e in range(param.shape[0]):
            native = f"{prefix}.{first + e}.{w}{WEIGHT_SUFFIX}"
            slot = Slot(native, role, param_name, experts.format, param, views[e], scale,
                        scale_views[e], e, n_experts)
            self._add(slot)
            slots.append(slot)
        native_prefix = slots[0].native.removesuffix(f".{first}.{w}{WEIGHT_SUFFIX}") if slots else prefix
        self._stacks[f"{native_prefix}.{w}"] = ExpertStack(native_prefix, w, experts.format, param, scale, tuple(slots))

    def _add(self, slot: Slot) -> None:
        if slot.native in self._slots:
            raise RuntimeError(f"two resident tensors claim the native name {slot.native}")
        self._slots[slot.native] = slot

    def get(self, native: str) -> Slot | None:
        return self._slots.get(native)

    def stack(self, native_prefix: str, w: str) -> ExpertStack | None:
        """The stacked experts `{native_prefix}.{e}.{w}.weight` for every e, e.g. ("layers.3.ffn.experts", "w1")."""
        return self._stacks.get(f"{native_prefix}.{w}")

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    def names(self, role: str | None = None) -> set[str]:
        return {s.native for s in self._slots.values() if role is None or s.role == role}

    def param(self, slot: Slot) -> torch.Tensor:
        return slot.resident

    def scale_param(self, slot: Slot) -> torch.Tensor | None:
        return slot.scale_resident

    def expert_format(self, slot: Slot) -> str:
        return slot.kind
