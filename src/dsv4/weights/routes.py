"""Incoming tensor name -> where it goes (a Route), planned once per set of models.

Resolving a name is one dict lookup. The table is filled on first sight of each spelling: a native name
(with or without transformers' `model.` prefix) and its `.scale` partner resolve by slot lookup alone; any
other spelling (HF, `save_pretrained`'s mix, `.weight_scale_inv`) is folded once by
`names.canonical_name` and remembered. A refit of N tensors is N lookups: the rename rules and module
walks run once per spelling per model, never per tensor per update.
"""

from __future__ import annotations

from typing import NamedTuple

from dsv4.weights.names import (
    ALIASED_DRAFTER_TENSORS,
    DRAFTER_PREFIX,
    HF_PREFIX,
    SCALE_SUFFIX,
    WEIGHT_SUFFIX,
    canonical_name,
    stacked_experts,
)
from dsv4.weights.slots import ExpertStack, Slot, SlotTable

WEIGHT, SCALE, STACKED, IGNORED = "weight", "scale", "stacked", "ignored"


class Route(NamedTuple):
    """What one incoming name feeds (immutable; a named tuple: a load plans one per tensor, and a frozen
    dataclass cost ~1 us more each)."""

    kind: str  # WEIGHT | SCALE | STACKED | IGNORED
    native: str  # its canonical (native) spelling
    slot: Slot | None = None  # WEIGHT / SCALE: the weight's slot
    stacks: tuple[ExpertStack, ...] = ()  # STACKED: one stack per matrix, in the tensor's dim-1 order


class RouteTable:
    """Every accepted spelling seen so far -> its Route, for one SlotTable."""

    def __init__(self, table: SlotTable):
        self.table = table
        self._routes: dict[str, Route] = {}
        self._has_drafter = any(slot.native.startswith(DRAFTER_PREFIX) for slot in table)

    def resolve(self, name: str) -> Route | None:
        """The route of an incoming name, or None for a name this model has no tensor for."""
        route = self._routes.get(name)
        if route is None:
            route = self._plan(name)
            if route is not None:  # unknown names are not remembered: they fail the load or the update
                self._routes[name] = route
        return route

    def _plan(self, name: str) -> Route | None:
        short = name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else name
        route = self._native_route(short)
        if route is not None:
            return route
        native = canonical_name(name)
        return self._native_route(native) or self._stacked_route(native) or self._ignored_route(native)

    def _native_route(self, native: str) -> Route | None:
        # Drafter copies of the target's embedding / head are ignored even though they look native (the prefix
        # test first: a regex match per name cost a third of planning a load's routes).
        if native.startswith(DRAFTER_PREFIX) and ALIASED_DRAFTER_TENSORS.match(native):
            return Route(IGNORED, native)
        if (slot := self.table.get(native)) is not None:
            return Route(WEIGHT, native, slot)
        if native.endswith(SCALE_SUFFIX):
            slot = self.table.get(native[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX)
            if slot is not None:
                return Route(SCALE, native, slot)
        return None

    def _stacked_route(self, native: str) -> Route | None:
        stacked = stacked_experts(native)
        if stacked is None:
            return None
        prefix, matrices = stacked
        stacks = []
        for w in matrices:
            stack = self.table.stack(prefix, w)
            if stack is None:
                return None
            stacks.append(stack)
        return Route(STACKED, native, stacks=tuple(stacks))

    def _ignored_route(self, native: str) -> Route | None:
        """Drafter weights when no drafter was requested: the checkpoint carries them, this load skips them."""
        if native.startswith(DRAFTER_PREFIX) and not self._has_drafter:
            return Route(IGNORED, native)
        return None
