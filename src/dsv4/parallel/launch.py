"""Joining the tensor parallel group of an SPMD launch (torchrun, or any launcher that sets torchrun's
environment): every rank runs the same program, builds the same `LLM`, and this module turns the
environment (or a process group the caller already initialised) into the rank's `ParallelState`.

Forming the group waits at most the timeout for every rank to arrive (the c10d rendezvous of
`init_method="env://"`); a group that cannot form raises ParallelError naming the group size, the rank,
the rendezvous address and the timeout instead of hanging.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch.distributed as dist

from dsv4.errors import ConfigError, ParallelError
from dsv4.parallel.collectives import all_gather_objects
from dsv4.parallel.state import SINGLE, ParallelState

# What torchrun sets for every rank, and the env:// rendezvous reads.
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
GLOO, NCCL = "gloo", "nccl"


def backend_for(device: str) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return NCCL if device.startswith("cuda") else GLOO


def join_group(tensor_parallel_size: int, expert_parallel: bool, device: str, timeout_s: float) -> ParallelState:
    """This rank's state in a group of `tensor_parallel_size` ranks, forming the default process group
    from torchrun's environment unless the caller already did.

    Raises:
        ConfigError: no launch environment, or a world size other than tensor_parallel_size.
        ParallelError: the group did not form within timeout_s (a rank never arrived, a wrong address).
    """
    if tensor_parallel_size == 1:
        return SINGLE
    if not dist.is_initialized():
        missing = [name for name in LAUNCH_ENV if name not in os.environ]
        if missing:
            raise ConfigError(
                f"LLM: tensor_parallel_size={tensor_parallel_size} runs one process per rank: launch the program "
                f"with `torchrun --nproc-per-node {tensor_parallel_size} ...` (or initialise torch.distributed "
                f"first); the environment lacks {', '.join(missing)}")
        world = int(os.environ["WORLD_SIZE"])
        if world != tensor_parallel_size:
            raise ConfigError(f"LLM: tensor_parallel_size={tensor_parallel_size}, but the launch has "
                              f"WORLD_SIZE={world} processes; they must be equal")
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            dist.init_process_group(backend_for(device), init_method="env://", timeout=timedelta(seconds=timeout_s))
            # The group is ours: leave it before the interpreter ends. A rank that exits holding it lets the other
            # ranks' gloo threads see its sockets close mid-read, and they abort their process (std::terminate).
            atexit.register(leave_group)
        except RuntimeError as exc:  # the store's timeout (DistStoreError) and connection failures
            raise ParallelError(
                f"tensor parallel group of {world} ranks at {address}: rank {os.environ['RANK']} could not form it "
                f"within the {timeout_s:g} s timeout (a rank never arrived?): {type(exc).__name__}: {exc}") from None
    world = dist.get_world_size()
    if world != tensor_parallel_size:
        raise ConfigError(f"LLM: tensor_parallel_size={tensor_parallel_size}, but the initialised process group "
                          f"has {world} ranks; they must be equal")
    try:  # a group of its own, so that this LLM's collectives wait timeout_s, whatever the default group's is
        group = dist.new_group(ranks=list(range(world)), timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise ParallelError(f"tensor parallel group of {world} ranks: rank {dist.get_rank()} could not form the "
                            f"LLM's group within the {timeout_s:g} s timeout: {type(exc).__name__}: {exc}") from None
    return ParallelState(rank=dist.get_rank(), world_size=world, expert_parallel=expert_parallel,
                         timeout_s=timeout_s, group=group)


def leave_group() -> None:
    """Destroy the default process group if it is still up (registered at exit by `join_group` when it formed
    the group itself)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def require_agreement(what: dict, state: ParallelState) -> None:
    """Every rank must run the same model with the same options: ranks that disagree would sample from
    different logits or wait on different collectives. Compares `what` (picklable) across ranks.

    Raises:
        ParallelError: naming the first rank and the fields that differ from rank 0's.
    """
    everyone = all_gather_objects(what, state)
    for rank, theirs in enumerate(everyone):
        differ = sorted(k for k in set(theirs) | set(everyone[0]) if theirs.get(k) != everyone[0].get(k))
        if differ:
            raise ParallelError(f"tensor parallel group: rank {rank} was started with different {', '.join(differ)} "
                                f"than rank 0 ({[theirs.get(k) for k in differ]} vs "
                                f"{[everyone[0].get(k) for k in differ]}); every rank must build the same LLM")
