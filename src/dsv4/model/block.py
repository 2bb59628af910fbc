"""One decoder block: mHC around an attention sublayer and an MoE sublayer."""

import torch
from torch import nn

from dsv4.config import ModelConfig
from dsv4.kernels.registry import MHC_FUSED, default_registry
from dsv4.kernels.row_chunks import row_chunks
from dsv4.model import mhc
from dsv4.model.attention import Attention
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import LayerCache
from dsv4.model.moe import MoE
from dsv4.model.norm import RMSNorm


def mix_gemm(streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """streams [T, hc, D] (fp32 or bf16), fn [mix, hc*D] fp32 -> flatten(streams) @ fn^T in fp32 [T, mix]:
    the GEMM of `mhc.mix_logits`, before its RMS scaling."""
    flat = streams.view(streams.shape[0], -1)
    fn_t = fn.float().t()
    if flat.dtype == torch.float32:
        return flat @ fn_t
    raw = flat.new_empty(flat.shape[0], fn.shape[0], dtype=torch.float32)
    for chunk in row_chunks(*flat.shape):  # bf16 rows widened a chunk at a time, not all [T, hc*D] at once
        torch.mm(flat[chunk].float(), fn_t, out=raw[chunk])
    return raw


class Block(nn.Module):
    """Streams [T, hc, D] in and out. Parameter names follow DeepSeek's native checkpoint names.

    With the fused mHC kernel the streams are updated in place wherever nobody else holds them: always
    between the two sublayers, and the block's input too when the caller says it may be overwritten."""

    def __init__(self, cfg: ModelConfig, layer_type: str, mlp_type: str, expert_format: str, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_type, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, mlp_type, expert_format, dtype)
        hc, mix = cfg.hc_mult, cfg.hc_mix
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn",
                                    nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size), requires_grad=False))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.zeros(mix), requires_grad=False))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.ones(3), requires_grad=False))

    def _coefficients(self, logits: torch.Tensor, sub: str):
        cfg = self.cfg
        return mhc.coefficients(
            logits, getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale"),
            cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps,
        )

    def _fused(self, streams: torch.Tensor):
        """The registry's fused mHC pre/post kernel when it supports these streams, else None."""
        kernel = default_registry().choose(MHC_FUSED).impl
        cfg = self.cfg
        return kernel if kernel is not None and kernel.supports(streams, cfg.hc_mult, cfg.hc_sinkhorn_iters) else None

    def _fused_pre(self, kernel, streams: torch.Tensor, fn: torch.Tensor, sub: str, norm: RMSNorm):
        """Fast path of mix_logits + coefficients + collapse + norm: (coef, normed block input)."""
        cfg = self.cfg
        return kernel.pre(
            streams, mix_gemm(streams, fn), getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale"),
            cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps, cfg.hc_eps, norm.weight, norm.eps,
        )

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: LayerCache, overwrite_input: bool = False
    ) -> torch.Tensor:
        """overwrite_input: the caller no longer needs `streams`, so the fused path may write the new
        streams into it (the result is then that same tensor)."""
        kernel = self._fused(streams)
        if kernel is not None:
            coef, block_in = self._fused_pre(kernel, streams, self.hc_attn_fn, "attn", self.attn_norm)
            streams = kernel.post(streams, self.attn(block_in, batch, cache), coef, self.cfg.hc_mult,
                                  in_place=overwrite_input)
            return self._ffn(streams, batch)
        pre, post, comb = self._coefficients(mhc.mix_logits(streams, self.hc_attn_fn, self.cfg.rms_norm_eps), "attn")
        attn_out = self.attn(self.attn_norm(mhc.collapse(streams, pre)), batch, cache)
        streams = mhc.expand(streams, attn_out, post, comb)
        return self._ffn(streams, batch)

    def forward_broadcast(
        self, embeds: torch.Tensor, fn_broadcast: torch.Tensor, batch: ForwardBatch, cache: LayerCache
    ) -> torch.Tensor:
        """First block of the model: every input stream is the embedding [T, D], so the attention mHC step
        projects the un-repeated embedding with the pre-summed fn_broadcast [mix, D]."""
        one_stream = embeds.unsqueeze(1)  # [T, 1, D]
        kernel = self._fused(one_stream)
        if kernel is not None:
            coef, block_in = self._fused_pre(kernel, one_stream, fn_broadcast, "attn", self.attn_norm)
            streams = kernel.post(one_stream, self.attn(block_in, batch, cache), coef, self.cfg.hc_mult)
            return self._ffn(streams, batch)
        logits = mhc.mix_logits_broadcast(embeds, fn_broadcast, self.cfg.rms_norm_eps)
        pre, post, comb = self._coefficients(logits, "attn")
        block_in = (pre.sum(dim=-1, keepdim=True) * embeds.float()).to(embeds.dtype)
        attn_out = self.attn(self.attn_norm(block_in), batch, cache)
        streams = mhc.expand_broadcast(embeds, attn_out, post, comb)
        return self._ffn(streams, batch)

    def _ffn(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """streams: the block's own (the attention sublayer's output), so the fused path updates them in place."""
        kernel = self._fused(streams)
        if kernel is not None:
            coef, block_in = self._fused_pre(kernel, streams, self.hc_ffn_fn, "ffn", self.ffn_norm)
            return kernel.post(streams, self.ffn(block_in, batch.token_ids), coef, self.cfg.hc_mult, in_place=True)
        pre, post, comb = self._coefficients(mhc.mix_logits(streams, self.hc_ffn_fn, self.cfg.rms_norm_eps), "ffn")
        ffn_out = self.ffn(self.ffn_norm(mhc.collapse(streams, pre)), batch.token_ids)
        return mhc.expand(streams, ffn_out, post, comb)
