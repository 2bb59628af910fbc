"""The weight report: what every resident tensor holds, where it lives, and whether the models serve.

It makes the lifecycle invariant checkable from outside the process: after any sequence of loads and
refits ending with weights W, every tensor (derived ones included) must have the checksum of a fresh load
of W, and no address may have changed since build (a captured graph would still read the old one).

Keys: a target tensor by its resident name (`layers.0.ffn.experts.w1`, `...w1_scale`,
`hc_attn_fn_broadcast`); a drafter's as `{role}:{resident name}`, because DSpark's resident names
(`layers.0...`) would otherwise collide with the target's. Config-derived buffers (RoPE inverse
frequencies) and per-sequence caches are not weights and are not listed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from dsv4.model.derived import TopLevelModel
from dsv4.weights.loader import TARGET, LoadedModels

ROLE_SEPARATOR = ":"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 (hex) of the tensor's raw bytes in row-major order: bit-exact, dtype-agnostic."""
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _entry(tensor: torch.Tensor, derived: bool, role: str) -> dict[str, Any]:
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "data_ptr": tensor.data_ptr(),
        "checksum": tensor_checksum(tensor),
        "derived": derived,
        "model": role,
    }


def model_tensors(model: TopLevelModel) -> list[tuple[str, torch.Tensor, bool]]:
    """(resident name, tensor, derived) for every parameter and registered derived tensor of a model."""
    tensors = [(name, param, False) for name, param in model.named_parameters()]
    tensors += [(d.name, model.get_buffer(d.name), True) for d in model.derived_tensors()]
    return tensors


def weight_report(loaded: LoadedModels, version: int) -> dict[str, Any]:
    """{"version", "ready", "activation_dtype", "tensors": {key: {shape, dtype, data_ptr, checksum, derived,
    model}}}; "activation_dtype" is what the models compute in (the tensors' own dtypes are what they hold)."""
    tensors: dict[str, dict[str, Any]] = {}
    for role, model in loaded.models.items():
        for name, tensor, derived in model_tensors(model):
            key = name if role == TARGET else f"{role}{ROLE_SEPARATOR}{name}"
            tensors[key] = _entry(tensor, derived, role)
    ready = all(model.ready for model in loaded.models.values())
    activations = str(loaded.target.activation_dtype).removeprefix("torch.")
    return {"version": version, "ready": ready, "activation_dtype": activations, "tensors": tensors}
