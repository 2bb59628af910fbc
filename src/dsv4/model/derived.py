"""What every top-level model (target, MTP, DSpark) shares: derived tensors, the READY state, and (drafters)
the reach to the target.

A derived tensor is a registered buffer computed from weights (e.g. the first-layer mHC broadcast
matrix). `process_weights_after_loading` recomputes every one of them from its sources and copies the
result into the existing storage, so addresses never change (captured graphs stay valid) and a second
call changes nothing. Forward never finalizes: it only checks the READY flag.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dsv4.errors import WeightsNotReadyError


@dataclass(frozen=True)
class DerivedTensor:
    name: str  # buffer name inside the top-level model
    compute: Callable[[], torch.Tensor]  # its value from the model's current parameters


class TopLevelModel(nn.Module):
    """Base of every separately loaded model: READY flag, derived-tensor registry, finalize, a drafter's target."""

    role: str = "model"  # "target" | "mtp" | "dspark"

    def __init__(self) -> None:
        super().__init__()
        self._ready = False
        self._derived: list[DerivedTensor] = []
        # Finalizes so far: whatever holds what a finalize rebinds (a replayed decode step's kernel arguments)
        # is valid for one generation.
        self.weights_generation = 0

    def register_derived(self, name: str, compute: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> None:
        """Register a derived tensor: its buffer is allocated here, once, and from then on only written in place."""
        self.register_buffer(name, torch.zeros(shape), persistent=False)
        self._derived.append(DerivedTensor(name, compute))

    def hold_target(self, target: nn.Module) -> None:
        """Reach the target model (a drafter: its embedding and head) as `self.target` without registering it
        as a submodule, so the target's tensors have exactly one owner: they appear once in parameter
        listings, the slot table and the weight report, and a refit writes them once (a second owner would
        make load order decide the values)."""
        object.__setattr__(self, "target", target)  # nn.Module.__setattr__ would register it

    def derived_tensors(self) -> list[DerivedTensor]:
        """The derived tensors of this model, in registration order (`register_derived`)."""
        return list(self._derived)

    @property
    def ready(self) -> bool:
        return self._ready

    def mark_loading(self) -> None:
        """Called by the loader before the first write of a load or refit commit."""
        self._ready = False

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Recompute every derived tensor in place, bind the modules' kernels to their weights
        (`bind_kernels`), then mark the model READY. Idempotent."""
        for derived in self.derived_tensors():
            target = self.get_buffer(derived.name)
            value = derived.compute()
            if value.shape != target.shape or value.dtype != target.dtype or value.device != target.device:
                raise RuntimeError(
                    f"{self.role} model: derived tensor {derived.name} would change from "
                    f"{tuple(target.shape)}/{target.dtype}/{target.device} to "
                    f"{tuple(value.shape)}/{value.dtype}/{value.device}; it is only ever updated in place"
                )
            target.copy_(value)
        for module in self.modules():
            if hasattr(module, "bind_kernels"):
                module.bind_kernels()
        self.weights_generation += 1
        self._ready = True

    def require_ready(self) -> None:
        if not self._ready:
            raise WeightsNotReadyError(
                f"{self.role} model: weights are not READY (not loaded, not finalized, or a failed weight "
                f"update left them incomplete); load weights and run process_weights_after_loading() first"
            )
