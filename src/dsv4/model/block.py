"""One decoder block: mHC around an attention sublayer and an MoE sublayer."""

import torch
from torch import nn

from dsv4.config import ModelConfig
from dsv4.kernels.registry import MHC_COEFFICIENTS, MHC_FUSED, KernelRegistry, default_registry
from dsv4.model import mhc
from dsv4.model.attention import Attention
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import LayerCache
from dsv4.model.moe import MoE
from dsv4.model.norm import RMSNorm
from dsv4.parallel.state import SINGLE, ParallelState


class Block(nn.Module):
    """Streams [T, hc, D] in and out. Parameter names follow DeepSeek's native checkpoint names.

    With the registry's fused mHC kernel the streams are updated in place wherever nobody else holds
    them: always between the two sublayers, and the block's input too when the caller says it may be
    overwritten. Without it (or inside a compiled graph) the `mhc` formulas run."""

    def __init__(self, cfg: ModelConfig, layer_type: str, mlp_type: str, expert_format: str, dtype: torch.dtype,
                 kernels: KernelRegistry | None = None, parallel: ParallelState = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels or default_registry()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.kernels)
        self.attn = Attention(cfg, layer_type, dtype, self.kernels, parallel)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.kernels)
        self.ffn = MoE(cfg, mlp_type, expert_format, dtype, self.kernels, parallel)
        hc, mix = cfg.hc_mult, cfg.hc_mix
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn",
                                    nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size), requires_grad=False))
            self.register_parameter(f"hc_{sub}_base", nn.Parameter(torch.zeros(mix), requires_grad=False))
            self.register_parameter(f"hc_{sub}_scale", nn.Parameter(torch.ones(3), requires_grad=False))

    def _coefficients(self, logits: torch.Tensor, sub: str):
        """`mhc.coefficients_reference` of sublayer `sub`, through the registry's C kernel when it supports it."""
        cfg = self.cfg
        args = (logits, getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale"), cfg.hc_mult,
                cfg.hc_sinkhorn_iters, cfg.hc_eps)
        kernel = self.kernels.kernel(MHC_COEFFICIENTS, *args)
        return kernel(*args) if kernel is not None else mhc.coefficients_reference(*args)

    def _fused_pre(self, streams: torch.Tensor, fn: torch.Tensor, sub: str, norm: RMSNorm):
        """The fused kernel's mix_logits + coefficients + collapse + norm: (kernel, coef, normed block
        input), or None when the registry's kernel does not support these streams."""
        cfg = self.cfg
        args = (streams, fn, getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale"), cfg.hc_mult,
                cfg.hc_sinkhorn_iters, cfg.rms_norm_eps, cfg.hc_eps, norm.weight, norm.eps)
        kernel = self.kernels.kernel(MHC_FUSED, *args)
        return None if kernel is None else (kernel, *kernel.pre(*args))

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: LayerCache, overwrite_input: bool = False
    ) -> torch.Tensor:
        """overwrite_input: the caller no longer needs `streams`, so the fused path may write the new
        streams into it (the result is then that same tensor)."""
        streams = self._sublayer(streams, "attn", self.attn_norm, lambda x: self.attn(x, batch, cache), overwrite_input)
        return self._ffn(streams, batch)

    def forward_broadcast(
        self, embeds: torch.Tensor, fn_broadcast: torch.Tensor, batch: ForwardBatch, cache: LayerCache
    ) -> torch.Tensor:
        """First block of the model: every input stream is the embedding [T, D], so the attention mHC step
        projects the un-repeated embedding with the pre-summed fn_broadcast [mix, D]."""
        one_stream = embeds.unsqueeze(1)  # [T, 1, D]
        fused = self._fused_pre(one_stream, fn_broadcast, "attn", self.attn_norm)
        if fused is not None:
            kernel, coef, block_in = fused
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
        decode_rows = batch.decode_rows
        return self._sublayer(streams, "ffn", self.ffn_norm, lambda x: self.ffn(x, batch.token_ids, decode_rows),
                              in_place=True)

    def _sublayer(self, streams: torch.Tensor, sub: str, norm: RMSNorm, run, in_place: bool) -> torch.Tensor:
        """One mHC-wrapped sublayer over [T, hc, D] streams: collapse them into the normed input of `run`
        ([T, D] -> [T, D]), then mix its output back in (in place only when `in_place` and the fused kernel
        serves the streams)."""
        fn = getattr(self, f"hc_{sub}_fn")
        fused = self._fused_pre(streams, fn, sub, norm)
        if fused is not None:
            kernel, coef, block_in = fused
            return kernel.post(streams, run(block_in), coef, self.cfg.hc_mult, in_place=in_place)
        pre, post, comb = self._coefficients(mhc.mix_logits(streams, fn, self.cfg.rms_norm_eps), sub)
        return mhc.expand(streams, run(norm(mhc.collapse(streams, pre))), post, comb)
