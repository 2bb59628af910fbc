"""The collectives a tensor parallel forward needs, on the state's group, each the identity for one process.

A collective that fails (a peer died, or did not answer within the group's timeout) raises ParallelError
naming the operation, the rank and the timeout: never a silent hang, never a bare backend error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4.errors import ParallelError
from dsv4.parallel.state import ParallelState


def _failed(op: str, state: ParallelState, exc: Exception) -> ParallelError:
    return ParallelError(
        f"tensor parallel group (rank {state.rank} of {state.world_size}): {op} failed within the "
        f"{state.timeout_s:g} s timeout; a peer rank died or stopped answering ({type(exc).__name__}: {exc})")


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum over ranks of each rank's partial x, in place; every rank gets the same bits."""
    if not state.is_parallel:
        return x
    try:
        dist.all_reduce(x, group=state.group)
    except RuntimeError as exc:  # gloo and NCCL errors, timeouts included (DistError is one)
        raise _failed("all_reduce", state, exc) from None
    return x


def all_gather_last(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Each rank's [..., n] -> [..., world_size * n], the ranks' parts in rank order along the last dim."""
    if not state.is_parallel:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    try:
        dist.all_gather(parts, x, group=state.group)
    except RuntimeError as exc:  # gloo and NCCL errors, timeouts included (DistError is one)
        raise _failed("all_gather", state, exc) from None
    return torch.cat(parts, dim=-1)


def all_gather_objects(value, state: ParallelState) -> list:
    """Every rank's picklable `value`, in rank order (for reports and agreement checks, not the forward)."""
    if not state.is_parallel:
        return [value]
    out = [None] * state.world_size
    try:
        dist.all_gather_object(out, value, group=state.group)
    except RuntimeError as exc:  # gloo and NCCL errors, timeouts included (DistError is one)
        raise _failed("all_gather_object", state, exc) from None
    return out
