"""One decoder block: mHC around an attention sublayer and an MoE sublayer."""

import torch
from torch import nn

from dsv4.config import ModelConfig
from dsv4.model import mhc
from dsv4.model.attention import Attention
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import LayerCache
from dsv4.model.moe import MoE
from dsv4.model.norm import RMSNorm


class Block(nn.Module):
    """Streams [T, hc, D] in and out. Parameter names follow DeepSeek's native checkpoint names."""

    def __init__(self, cfg: ModelConfig, layer_type: str, mlp_type: str, expert_format: str, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_type, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, mlp_type, expert_format, dtype)
        hc, mix = cfg.hc_mult, cfg.hc_mix
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size), requires_grad=False))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.zeros(mix), requires_grad=False))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.ones(3), requires_grad=False))

    def _coefficients(self, logits: torch.Tensor, sub: str):
        cfg = self.cfg
        return mhc.coefficients(
            logits, getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale"),
            cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps,
        )

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        pre, post, comb = self._coefficients(mhc.mix_logits(streams, self.hc_attn_fn, self.cfg.rms_norm_eps), "attn")
        attn_out = self.attn(self.attn_norm(mhc.collapse(streams, pre)), batch, cache)
        streams = mhc.expand(streams, attn_out, post, comb)
        return self._ffn(streams, batch)

    def forward_broadcast(
        self, embeds: torch.Tensor, fn_broadcast: torch.Tensor, batch: ForwardBatch, cache: LayerCache
    ) -> torch.Tensor:
        """First block of the model: every input stream is the embedding [T, D], so the attention mHC step
        projects the un-repeated embedding with the pre-summed fn_broadcast [mix, D]."""
        logits = mhc.mix_logits_broadcast(embeds, fn_broadcast, self.cfg.rms_norm_eps)
        pre, post, comb = self._coefficients(logits, "attn")
        block_in = (pre.sum(dim=-1, keepdim=True) * embeds.float()).to(embeds.dtype)
        attn_out = self.attn(self.attn_norm(block_in), batch, cache)
        streams = mhc.expand_broadcast(embeds, attn_out, post, comb)
        return self._ffn(streams, batch)

    def _ffn(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pre, post, comb = self._coefficients(mhc.mix_logits(streams, self.hc_ffn_fn, self.cfg.rms_norm_eps), "ffn")
        ffn_out = self.ffn(self.ffn_norm(mhc.collapse(streams, pre)), batch.token_ids)
        return mhc.expand(streams, ffn_out, post, comb)
