"""The weight report of a whole tensor / expert parallel group: every rank's report merged.

Per tensor: the full shape (the ranks' shards put back together along the plan's split dimension), the
split dimension (None: replicated), and each rank's checksum; routed experts appear once each, under the
rank that holds them. `disagreeing` lists the replicated tensors whose ranks hold different bytes: a
rank that loaded or refitted differently from the others (it must stay empty).
"""

from __future__ import annotations

from typing import Any

from dsv4.parallel.collectives import all_gather_objects
from dsv4.parallel.plan import split_of
from dsv4.weights.loader import LoadedModels
from dsv4.weights.report import weight_report


def merged_weight_report(loaded: LoadedModels, version: int) -> dict[str, Any]:
    """{"version", "ready", "world_size", "disagreeing": [names], "tensors": {key: {shape, dtype, derived, model,
    split_dim, checksums: [per holding rank], ranks: [which]}}}. A collective: every rank calls it."""
    state = loaded.parallel
    reports = all_gather_objects(weight_report(loaded, version), state)
    split_dims = _split_dims(loaded)
    tensors: dict[str, dict[str, Any]] = {}
    for rank, report in enumerate(reports):
        for key, entry in report["tensors"].items():
            merged = tensors.setdefault(key, {
                "shape": list(entry["shape"]), "dtype": entry["dtype"], "derived": entry["derived"],
                "model": entry["model"], "split_dim": split_dims.get(key), "checksums": [], "ranks": []})
            merged["checksums"].append(entry["checksum"])
            merged["ranks"].append(rank)
            dim = merged["split_dim"]
            if dim is not None and rank > 0:
                merged["shape"][dim] += entry["shape"][dim]
    disagreeing = sorted(key for key, t in tensors.items()
                         if t["split_dim"] is None and len(set(t["checksums"])) > 1)
    return {"version": version, "ready": all(r["ready"] for r in reports), "world_size": state.world_size,
            "disagreeing": disagreeing, "tensors": tensors}


def _split_dims(loaded: LoadedModels) -> dict[str, int]:
    """Report key -> the resident dimension its shards split (the plan's dim of the logical [out, in]
    shape, for stacked experts one further in; dim 0 of stacked experts under expert parallelism)."""
    from dsv4.weights.loader import TARGET
    from dsv4.weights.report import ROLE_SEPARATOR

    dims = {}
    for slot in loaded.slot_table():
        split = split_of(slot.native, loaded.parallel)
        key = slot.param if slot.role == TARGET else f"{slot.role}{ROLE_SEPARATOR}{slot.param}"
        if slot.is_expert and loaded.parallel.expert_parallel:
            dims[key] = 0  # the stack of experts: each rank holds some of them
        elif split is not None:
            dims[key] = split.dim + (1 if slot.is_expert else 0)
        else:
            continue
        if slot.is_expert and slot.scale_resident is not None:
            dims[f"{key}_scale"] = dims[key]
    return dims
