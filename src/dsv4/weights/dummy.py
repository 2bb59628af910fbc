"""Dummy weights: seeded, valid values for every tensor, fed through the same writer as a checkpoint.

Each tensor's generator is seeded from (seed, name), so values do not depend on load order. Integer
tables get valid values (tid2eid: k distinct expert ids per row); FP4 codes and ue8m0 scales are valid
bytes (no NaN scale), FP8 codes come from finite floats.
"""

import zlib
from collections.abc import Iterator

import torch

from dsv4.config import DENSE, FP4, FP8
from dsv4.weights.slots import SlotTable

# Small values keep activations in a sane range through many layers of random weights.
_DUMMY_INIT_RANGE = 1e-2
_NORM_WEIGHT = 1.0
_UNIT_SCALE_BYTE = 127  # ue8m0 2^0
_SCALE_BYTE_SPREAD = 4  # scales 2^-4 .. 2^0
_PACKED_BYTE_RANGE = 256


def _generator(seed: int, name: str) -> torch.Generator:
    # The CPU generator keeps only 32 bits of its seed, so hash seed and name together.
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _random_rows_of_distinct_ids(rows: int, k: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, k] int32: each row k distinct ids in [0, n) (a random permutation prefix)."""
    return torch.rand(rows, n, generator=gen).argsort(dim=-1)[:, :k].to(torch.int32)


def dummy_tensors(table: SlotTable, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    for slot in table:
        gen = _generator(seed, slot.native)
        resident = table.param(slot)
        if slot.is_expert:
            fmt = table.expert_format(slot)
            shape = tuple(resident.shape[1:])
            scale_shape = tuple(table.scale_param(slot).shape[1:]) if fmt != DENSE else None
            base = slot.native[: -len(".weight")]
            if fmt == FP4:
                packed = torch.randint(0, _PACKED_BYTE_RANGE, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
                scale = _UNIT_SCALE_BYTE - torch.randint(0, _SCALE_BYTE_SPREAD + 1, scale_shape, generator=gen)
                yield slot.native, packed.view(torch.int8)
                yield f"{base}.scale", scale.to(torch.uint8).view(torch.float8_e8m0fnu)
            elif fmt == FP8:
                values = (torch.rand(shape, generator=gen) * 2 - 1) * _DUMMY_INIT_RANGE
                yield slot.native, values.to(torch.float8_e4m3fn)
                yield f"{base}.scale", torch.ones(scale_shape)
            else:
                yield slot.native, (torch.rand(shape, generator=gen) * 2 - 1) * _DUMMY_INIT_RANGE
        elif resident.dtype == torch.int32:
            rows, k = resident.shape
            n_experts = table.models[slot.role].cfg.n_routed_experts
            yield slot.native, _random_rows_of_distinct_ids(rows, k, n_experts, gen)
        elif slot.native.endswith("norm.weight"):
            yield slot.native, torch.full(tuple(resident.shape), _NORM_WEIGHT)
        else:
            yield slot.native, (torch.rand(tuple(resident.shape), generator=gen) * 2 - 1) * _DUMMY_INIT_RANGE
