"""RMS norms. Statistics are always taken in fp32; one cast back to the input dtype at the end."""

import torch
from torch import nn

from dsv4.kernels.registry import NORM_ROPE, default_registry


def norm_rope_kernel(x: torch.Tensor, inv_freq: torch.Tensor | None = None):
    """The registry's in-place C norm/RoPE kernel when it supports x (fp32, contiguous, CPU), else None."""
    kernel = default_registry().choose(NORM_ROPE).impl
    return kernel if kernel is not None and kernel.supports(x, inv_freq) else None


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dim (per-head q norm, mHC input norm): x * rsqrt(mean(x^2) + eps)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm. The weight stays fp32 and multiplies in fp32, as DeepSeek-V4 does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """`inplace` lets the fast path overwrite x (only for a fresh tensor nobody else reads)."""
        kernel = norm_rope_kernel(x)
        if kernel is not None:
            return kernel(x if inplace else x.clone(), self.eps, self.weight)
        return self.forward_reference(x)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)
