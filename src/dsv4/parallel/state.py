"""The parallel state one rank's model is built with: its rank, the group's size, whether routed experts
are split by expert (expert parallel) or by their width (tensor parallel), the group and its timeout.

A frozen value handed to every module at build; nothing reads a process-wide global. `SINGLE` is one
process: every size is the full one and every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4.config import DENSE, FP4, FP8, ModelConfig
from dsv4.errors import ConfigError

# How long any one collective (or the group's rendezvous) may wait for a peer before it fails.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ParallelState:
    """One rank's place in a tensor parallel group.

    Attributes:
        rank: this process's rank in the group, 0 .. world_size - 1.
        world_size: ranks in the group (`tensor_parallel_size`).
        expert_parallel: routed experts split by expert (each rank holds n_routed_experts / world_size whole
            experts) instead of every expert's intermediate width split.
        timeout_s: seconds a collective may wait for a peer.
        group: the torch.distributed process group (None for one process).
    """

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def split(self, size: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous, equal share of `size` (divisibility checked up front)."""
        share = size // self.world_size
        return self.rank * share, (self.rank + 1) * share

    def local(self, size: int) -> int:
        """This rank's share of a split dimension of `size`."""
        return size // self.world_size

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        """[first, stop) of the global ids of the routed experts this rank holds."""
        return self.split(n_experts) if self.expert_parallel else (0, n_experts)

    def expert_width(self, intermediate: int) -> int:
        """The intermediate width of this rank's part of each routed expert it holds."""
        return intermediate if self.expert_parallel else self.local(intermediate)


SINGLE = ParallelState()


def check_divisible(cfg: ModelConfig, state: ParallelState, expert_format: str) -> None:
    """Refuse, before anything is allocated, a config whose split dimensions do not divide evenly among the
    ranks, or whose split would cut through a resident quantized expert's scale block.

    Raises:
        ConfigError: naming the config field, its value and tensor_parallel_size.
    """
    n = state.world_size
    if n == 1:
        return

    def need(field_name: str, value: int, divisor: int, why: str) -> None:
        if value % divisor:
            raise ConfigError(f"{cfg.source}: field '{field_name}': {value} is not divisible by {divisor} "
                              f"(tensor_parallel_size={n}: {why})")

    need("vocab_size", cfg.vocab_size, n, "the embedding and the head are split by vocabulary rows")
    need("o_groups", cfg.o_groups, n, "attention heads are split by output-projection group")
    need("moe_intermediate_size", cfg.moe_intermediate_size, n, "the shared expert is split by its width")
    if state.expert_parallel:
        need("n_routed_experts", cfg.n_routed_experts, n, "expert_parallel gives each rank whole experts")
        return
    need("moe_intermediate_size", cfg.moe_intermediate_size, n, "each routed expert is split by its width")
    width = cfg.moe_intermediate_size // n
    quant = cfg.quant
    if expert_format == FP8:
        block = quant.weight_block_size if quant else (128, 128)
        for b in set(block):
            if width % b:
                raise ConfigError(
                    f"{cfg.source}: field 'moe_intermediate_size': {cfg.moe_intermediate_size} / "
                    f"tensor_parallel_size {n} = {width} is not a multiple of the FP8 scale block {b} "
                    f"(quantization_config.weight_block_size): each rank's part of an FP8 expert must hold whole "
                    f"scale blocks; use expert_parallel=True or expert_dtype='dense'")
    elif expert_format == FP4:
        group = quant.fp4_group_size if quant else 32
        if width % group:
            raise ConfigError(
                f"{cfg.source}: field 'moe_intermediate_size': {cfg.moe_intermediate_size} / tensor_parallel_size "
                f"{n} = {width} is not a multiple of the FP4 scale group {group}: each rank's part of an FP4 "
                f"expert's down projection must hold whole scale groups; use expert_parallel=True or "
                f"expert_dtype='dense'")
    elif expert_format != DENSE:
        raise ConfigError(f"expert format {expert_format!r} is unknown")
