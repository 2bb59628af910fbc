"""RMS norms. Statistics are always taken in fp32; one cast back to the input dtype at the end."""

import torch
from torch import nn

from dsv4.kernels.registry import NORM_ROPE, KernelRegistry, default_registry


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dim (per-head q norm, mHC input norm): x * rsqrt(mean(x^2) + eps)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """Weighted RMSNorm over the last dim, the weight multiplied in fp32 (the norm/RoPE kernel's reference)."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm. The weight stays fp32 and multiplies in fp32, as DeepSeek-V4 does."""

    def __init__(self, dim: int, eps: float, kernels: KernelRegistry | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.kernels = kernels or default_registry()

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """`inplace` lets the fast path overwrite x (only for a fresh tensor nobody else reads)."""
        kernel = self.kernels.kernel(NORM_ROPE, x, self.eps, self.weight)
        if kernel is not None:
            return kernel(x if inplace else x.clone(), self.eps, self.weight)
        return rms_norm(x, self.eps, self.weight)
