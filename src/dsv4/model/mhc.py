"""mHC: manifold-constrained hyper-connections.

The residual is R [T, hc, D]: hc parallel streams. Before each sublayer a learned projection of all
streams gives three coefficient sets (all fp32):
  pre  [T, hc]      collapse the streams into the sublayer input  y = sum_k pre_k R_k
  post [T, hc]      expand the sublayer output o back into streams
  comb [T, hc, hc]  mix the old streams, projected by Sinkhorn to (nearly) doubly stochastic
and after it  R'_j = post_j * o + sum_i comb[i, j] R_i.
"""

import torch

from dsv4.model.norm import rms_normalize


def mix_logits(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, hc, D], fn [mix, hc*D] -> [T, mix] fp32: fn . unweighted_rmsnorm(flatten(streams))."""
    flat = rms_normalize(streams.flatten(1).float(), eps)
    return flat @ fn.float().t()


def mix_logits_broadcast(embeds: torch.Tensor, fn_broadcast: torch.Tensor, eps: float) -> torch.Tensor:
    """The same logits when every stream equals `embeds` [T, D] (first layer): fn_broadcast [mix, D] is
    fn summed over its hc stream blocks, and the RMS over hc*D equal copies is the RMS of one copy."""
    return rms_normalize(embeds.float(), eps) @ fn_broadcast.t()


def coefficients_reference(
    logits: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, sinkhorn_iters: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, mix] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (comb[i, j]: source i -> destination j)."""
    pre_l, post_l, comb_l = logits.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_l * s_pre + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_l * s_post + post_b)
    comb = torch.softmax(comb_l.unflatten(-1, (hc, hc)) * s_comb + comb_b.view(hc, hc), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column/row normalisation; the softmax above counts as the first row pass.
    Each division has its own +eps (the order and eps placement are part of the architecture)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """streams [T, hc, D], pre [T, hc] -> [T, D], weighted in fp32."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """R'_j = post_j * out + sum_i comb[i, j] R_i.  streams [T, hc, D], out [T, D] -> [T, hc, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


def expand_broadcast(embeds: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`expand` when every input stream equals embeds [T, D]: sum_i comb[i, j] R_i = (sum_i comb[i, j]) e."""
    dtype = embeds.dtype
    return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
            + comb.sum(dim=-2).to(dtype).unsqueeze(-1) * embeds.unsqueeze(-2))


def head_collapse(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, hc_eps: float
) -> torch.Tensor:
    """hc_head: pre-only collapse before the final norm. streams [T, hc, D] -> [T, D]."""
    pre = torch.sigmoid(mix_logits(streams, fn, eps) * scale.float() + base.float()) + hc_eps
    return collapse(streams, pre)
