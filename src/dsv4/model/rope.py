"""Partial, interleaved rotary embeddings with the main and the (YaRN-scaled) compress tables.

Each head is laid out [nope (hd - r) | rope (r)]; only the trailing r channels rotate, in interleaved
pairs (2i, 2i+1) at frequency f_i. Rotation runs in fp32 and casts back.
"""

import math

import torch
from torch import nn

from dsv4.config import RopeConfig
from dsv4.kernels.registry import NORM_ROPE, KernelRegistry, default_registry
from dsv4.model.norm import rms_norm, rms_normalize


def inverse_frequencies(cfg: RopeConfig) -> torch.Tensor:
    """[r/2] fp32 frequencies f_i = theta^(-2i/r), YaRN-blended when configured (DeepSeek's form)."""
    r = cfg.rotary_dim
    pos_freqs = cfg.theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    extrapolated = 1.0 / pos_freqs
    if cfg.yarn_factor is None:
        return extrapolated
    interpolated = 1.0 / (cfg.yarn_factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return r * math.log(cfg.yarn_original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), r - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = ((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_high_freq = 1 - ramp
    return interpolated * (1 - keep_high_freq) + extrapolated * keep_high_freq


class RotaryTable(nn.Module):
    """One rotary table; cos/sin are computed from positions on the fly (no max-length table). `kernels`
    serves `norm_rope_` with this table."""

    def __init__(self, cfg: RopeConfig, kernels: KernelRegistry | None = None):
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        self.kernels = kernels or default_registry()
        # Config-derived, not a weight: non-persistent so it never appears in checkpoints or reports.
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, r/2] fp32."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing r channels of x [T, ..., hd] by cos/sin [T, r/2]; `inverse` rotates by -angle."""
    r = cos.shape[-1] * 2
    extra = x.dim() - 2
    cos = cos.view(cos.shape[0], *([1] * extra), -1)
    sin = sin.view(sin.shape[0], *([1] * extra), -1)
    if inverse:
        sin = -sin
    rope = x[..., -r:].float()
    a, b = rope[..., 0::2], rope[..., 1::2]  # even / odd channel of each pair
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], rotated), dim=-1)


def norm_rope_(
    x: torch.Tensor, eps: float | None, weight: torch.Tensor | None, positions: torch.Tensor, table: RotaryTable,
    inverse: bool = False,
) -> torch.Tensor:
    """Optional RMSNorm over the last dim (weighted when `weight` is given; eps None: no norm), then RoPE
    at `positions` with `table`. x [T, ..., hd] must be a fresh tensor: the fast path (the table's
    registry's norm/RoPE kernel, one C call) overwrites it; the reference composes `rms_norm` /
    `rms_normalize` and `apply_rotary`."""
    kernel = table.kernels.kernel(NORM_ROPE, x, eps, weight, positions, table.inv_freq, inverse)
    if kernel is not None:
        return kernel(x, eps, weight, positions, table.inv_freq, inverse)
    if eps is not None:
        x = rms_normalize(x, eps) if weight is None else rms_norm(x, eps, weight)
    cos, sin = table.cos_sin(positions)
    return apply_rotary(x, cos, sin, inverse=inverse)
