"""The sharding plan: which native tensor is split along which dimension, and by what; everything the plan
does not name is replicated on every rank (docs/parallel.md says why for each part).

Splits are contiguous and equal: rank r holds [r * n / N, (r + 1) * n / N) of the split dimension. Routed
experts are split by expert id with expert parallelism, by intermediate width without. The model builds
its modules with these local sizes (`ParallelState`), and tests/test_parallel.py checks that every
resident tensor matches the plan, so the two cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv4.parallel.state import ParallelState

# What a split dimension is made of (for messages and docs).
VOCAB, HEADS, GROUPS, WIDTH, EXPERT_WIDTH = "vocab rows", "heads", "output groups", "width", "expert width"


@dataclass(frozen=True)
class Split:
    """A tensor split along `dim` (of its logical [out, in] shape), in units of `unit`."""

    dim: int
    unit: str


SHARDING_PLAN: tuple[tuple[re.Pattern[str], Split], ...] = tuple((re.compile(p), s) for p, s in (
    (r"^embed\.weight$", Split(0, VOCAB)),  # vocab-parallel embedding: masked lookup + all-reduce
    (r"^head\.weight$", Split(0, VOCAB)),  # vocab-parallel head: logits all-gathered
    (r"\.attn\.wq_b\.weight$", Split(0, HEADS)),  # q up-projection: the rank's heads
    (r"\.attn\.attn_sink$", Split(0, HEADS)),  # one sink per head
    (r"\.attn\.wo_a\.weight$", Split(0, GROUPS)),  # grouped output projection: the rank's groups
    (r"\.attn\.wo_b\.weight$", Split(1, GROUPS)),  # row-parallel final projection + all-reduce
    (r"\.shared_experts\.w[13]\.weight$", Split(0, WIDTH)),  # column-parallel gate / up
    (r"\.shared_experts\.w2\.weight$", Split(1, WIDTH)),  # row-parallel down + all-reduce
    (r"\.experts\.\d+\.w[13]\.weight$", Split(0, EXPERT_WIDTH)),  # routed experts without expert parallel
    (r"\.experts\.\d+\.w2\.weight$", Split(1, EXPERT_WIDTH)),
))

# A routed expert's per-expert native name: its global id.
ROUTED_EXPERT = re.compile(r"\.experts\.(?P<expert>\d+)\.w[123]\.(weight|scale)$")


def split_of(native: str, state: ParallelState) -> Split | None:
    """How this rank's copy of the native weight `native` is cut from the full tensor (None: whole)."""
    if not state.is_parallel:
        return None
    for pattern, split in SHARDING_PLAN:
        if pattern.search(native):
            if split.unit == EXPERT_WIDTH and state.expert_parallel:
                return None  # whole experts, some of them
            return split
    return None


def routed_expert_id(native: str) -> int | None:
    """The global expert id of a per-expert native name (weight or scale), else None."""
    match = ROUTED_EXPERT.search(native)
    return None if match is None else int(match["expert"])


def holds_expert(expert: int, n_experts: int, state: ParallelState) -> bool:
    first, stop = state.expert_range(n_experts)
    return first <= expert < stop
