"""Draft models: MTP and DSpark. Each is a separate top-level model with its own load -> finalize
lifecycle; both alias the target's embedding and head (the target owns them, nothing is copied).

MTP (native `mtp.{i}.*`): the target's pre-hc_head stream S at position t plus the embedding of token
t+1 predict token t+2. The draft sequence runs at the positions t of S (its attention is relative, and
its cache slot then holds positions from 0 like every sequence's):
    R0 = h_proj(hnorm(S)) + e_proj(enorm(embed(x_{t+1})))     [T, hc, D]  (hnorm per stream)
    R  = block(R0)                                             sliding-window attention + routed MoE
    logits = head(norm(hc_head(R)))
R is the next draft step's S.

DSpark: model/dspark.py.
"""

import torch
from torch import nn

from dsv4.config import MOE, SLIDING, ModelConfig
from dsv4.errors import ConfigError
from dsv4.kernels.registry import KernelRegistry
from dsv4.model.batch import ForwardBatch
from dsv4.model.block import Block
from dsv4.model.cache import ModelCache, allocate_layer_cache
from dsv4.model.deepseek_v4 import DeepseekV4, add_hyper_head, hyper_head
from dsv4.model.derived import TopLevelModel
from dsv4.model.dspark import DSparkDrafter
from dsv4.model.linear import Linear
from dsv4.model.norm import RMSNorm
from dsv4.parallel.state import SINGLE, ParallelState


class MTPLayer(Block):
    """One decoder block (sliding attention, routed MoE) plus the MTP input and head stack."""

    def __init__(self, cfg: ModelConfig, expert_format: str, dtype: torch.dtype, kernels: KernelRegistry,
                 parallel: ParallelState = SINGLE):
        super().__init__(cfg, SLIDING, MOE, expert_format, dtype, kernels, parallel)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.e_proj = Linear(cfg.hidden_size, cfg.hidden_size, dtype, kernels)
        self.h_proj = Linear(cfg.hidden_size, cfg.hidden_size, dtype, kernels)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        add_hyper_head(self, cfg)


class MTPDrafter(TopLevelModel):
    """The MTP layers as a drafter; its fast paths use the target's kernel registry."""

    role = "mtp"

    def __init__(self, cfg: ModelConfig, target: DeepseekV4, expert_format: str, dtype: torch.dtype):
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise ConfigError(f"{cfg.source}: field 'num_nextn_predict_layers': 0, so the checkpoint has no MTP layer")
        self.cfg = cfg
        self.hold_target(target)
        self.mtp = nn.ModuleList(MTPLayer(cfg, expert_format, dtype, target.kernels, target.parallel)
                                 for _ in range(cfg.num_nextn_predict_layers))
        self.requires_grad_(False)

    def allocate_cache(self, slots: int, max_len: int) -> ModelCache:
        device = self.mtp[0].e_proj.weight.device
        layers = [allocate_layer_cache(self.cfg, SLIDING, slots, max_len, self.target.activation_dtype, device)
                  for _ in self.mtp]
        return ModelCache(layers, slots)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, target_streams: torch.Tensor, cache: ModelCache, depth: int = 0,
        logit_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: tokens x_{t+1} at positions t; target_streams: S at t [T, hc, D].
        -> (R [T, hc, D] for the next draft step, fp32 logits [T, V] for token t+2, or only those of
        `logit_rows` (int64 row indices) when given: the head is the costly part of a long chunk).
        Depths beyond the checkpoint's MTP layers reuse the last layer autoregressively."""
        self.require_ready()
        cache.begin_step(batch.segments)
        layer = self.mtp[min(depth, len(self.mtp) - 1)]
        embeds = self.target.embed_tokens(batch.token_ids)
        streams = layer.h_proj(layer.hnorm(target_streams)) + layer.e_proj(layer.enorm(embeds)).unsqueeze(-2)
        streams = layer(streams, batch, cache[min(depth, len(cache) - 1)], overwrite_input=True)  # streams: ours
        picked = streams if logit_rows is None else streams.index_select(0, logit_rows)
        logits = self.target.head(layer.norm(hyper_head(layer, picked, self.cfg))).float()
        return streams, logits


DRAFTER_CLASSES = {"mtp": MTPDrafter, "dspark": DSparkDrafter}


def build_drafter(
    name: str, cfg: ModelConfig, target: DeepseekV4, expert_format: str, dtype: torch.dtype
) -> TopLevelModel:
    if name == "mtp" and cfg.dspark is not None:
        raise ConfigError(
            f"{cfg.source}: a DSpark checkpoint (dspark_* fields): its mtp.* tensors are DSpark blocks, "
            f"loading them as MTP would half-load them; use draft='dspark'"
        )
    if name == "dspark" and target.parallel.is_parallel:
        raise ConfigError("draft='dspark' runs in one process only; with tensor_parallel_size > 1 use draft='mtp'")
    return DRAFTER_CLASSES[name](cfg, target, expert_format, dtype)
