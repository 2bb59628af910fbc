"""Draft models: MTP and DSpark. Each is a separate top-level model with its own load -> finalize
lifecycle; both alias the target's embedding and head (the target owns them, nothing is copied).

MTP (native `mtp.{i}.*`): the target's pre-hc_head stream S at position t plus the embedding of token
t+1 predict token t+2. The draft sequence runs at the positions t of S (its attention is relative, and
its cache slot then holds positions from 0 like every sequence's):
    R0 = h_proj(hnorm(S)) + e_proj(enorm(embed(x_{t+1})))     [T, hc, D]  (hnorm per stream)
    R  = block(R0)                                             sliding-window attention + routed MoE
    logits = head(norm(hc_head(R)))
R is the next draft step's S.

DSpark (checkpoints with `dspark_*` config fields; native `mtp.{s}.*` for s < dspark_num_layers). Its
public description leaves the exact input coupling open; dsv4 reads it as: the target's streams after
each layer in `dspark_target_layer_ids`, averaged over hc, are concatenated and projected,
    f = main_norm(main_proj(concat_l mean_hc(S_l)))            [T, D]
then the drafter runs its own blocks on the broadcast of embed(x) + f (its first block uses the
pre-summed broadcast matrix, a derived tensor), and the logits get a low-rank token-transition term
    logits += markov_w1[x] @ markov_w2                         ([V, r] and [r, V]).
"""

import re

import torch
from torch import nn

from dsv4.config import MOE, SLIDING, ModelConfig
from dsv4.errors import ConfigError
from dsv4.model.batch import ForwardBatch
from dsv4.model.block import Block
from dsv4.model.cache import ModelCache, allocate_layer_cache
from dsv4.model.deepseek_v4 import (
    FIRST_LAYER_BROADCAST,
    DeepseekV4,
    add_hyper_head,
    first_layer_broadcast,
    hyper_head,
    register_first_layer_broadcast,
)
from dsv4.model.derived import DerivedTensor, TopLevelModel
from dsv4.model.linear import Linear
from dsv4.model.norm import RMSNorm


class _SharedWithTarget:
    """Holds the target without registering it as a submodule: its tensors have one owner."""

    def __init__(self, target: DeepseekV4):
        self._target = (target,)

    @property
    def target(self) -> DeepseekV4:
        return self._target[0]


class MTPLayer(Block):
    """One decoder block (sliding attention, routed MoE) plus the MTP input and head stack."""

    def __init__(self, cfg: ModelConfig, expert_format: str, dtype: torch.dtype):
        super().__init__(cfg, SLIDING, MOE, expert_format, dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.e_proj = Linear(cfg.hidden_size, cfg.hidden_size, dtype)
        self.h_proj = Linear(cfg.hidden_size, cfg.hidden_size, dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        add_hyper_head(self, cfg)


class MTPDrafter(TopLevelModel):
    role = "mtp"

    def __init__(self, cfg: ModelConfig, target: DeepseekV4, expert_format: str, dtype: torch.dtype):
        super().__init__()
        if cfg.num_nextn_predict_layers < 1:
            raise ConfigError(f"{cfg.source}: field 'num_nextn_predict_layers': 0, so the checkpoint has no MTP layer")
        self.cfg = cfg
        self.dtype = dtype
        self.shared = _SharedWithTarget(target)
        self.mtp = nn.ModuleList(MTPLayer(cfg, expert_format, dtype) for _ in range(cfg.num_nextn_predict_layers))
        self.requires_grad_(False)

    def allocate_cache(self, slots: int, max_len: int) -> ModelCache:
        device = self.mtp[0].e_proj.weight.device
        layers = [allocate_layer_cache(self.cfg, SLIDING, slots, max_len, self.dtype, device) for _ in self.mtp]
        return ModelCache(layers, slots)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, target_streams: torch.Tensor, cache: ModelCache, depth: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: tokens x_{t+1} at positions t; target_streams: S at t [T, hc, D].
        -> (R [T, hc, D] for the next draft step, fp32 logits [T, V] for token t+2).
        Depths beyond the checkpoint's MTP layers reuse the last layer autoregressively."""
        self.require_ready()
        cache.begin_step(batch.segments)
        layer = self.mtp[min(depth, len(self.mtp) - 1)]
        target = self.shared.target
        embeds = target.embed(batch.token_ids)
        streams = layer.h_proj(layer.hnorm(target_streams)) + layer.e_proj(layer.enorm(embeds)).unsqueeze(-2)
        streams = layer(streams, batch, cache[min(depth, len(cache) - 1)], overwrite_input=True)  # streams: ours
        logits = target.head(layer.norm(hyper_head(layer, streams, self.cfg))).float()
        return streams, logits


class MarkovHead(nn.Module):
    """Low-rank token-transition logits: markov_w1[x] @ markov_w2."""

    def __init__(self, cfg: ModelConfig, rank: int, dtype: torch.dtype):
        super().__init__()
        self.markov_w1 = nn.Parameter(torch.zeros(cfg.vocab_size, rank, dtype=dtype), requires_grad=False)
        self.markov_w2 = nn.Parameter(torch.zeros(rank, cfg.vocab_size, dtype=dtype), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return (self.markov_w1[token_ids] @ self.markov_w2).float()


# DSpark's head-stack tensors sit at model level; which `mtp.{s}` prefix a release uses for them is
# not documented: dsv4 writes the input stack under the first prefix and the output stack under the last.
_DSPARK_INPUT_STACK = re.compile(r"^(main_proj|main_norm)\.")
_DSPARK_OUTPUT_STACK = re.compile(r"^(norm\.|hc_head_|markov_head\.)")
_DSPARK_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


class DSparkDrafter(TopLevelModel):
    role = "dspark"

    def __init__(self, cfg: ModelConfig, target: DeepseekV4, expert_format: str, dtype: torch.dtype):
        super().__init__()
        if cfg.dspark is None:
            raise ConfigError(f"{cfg.source}: no dspark_* fields, so the checkpoint has no DSpark drafter")
        spec = cfg.dspark
        self.cfg = cfg
        self.dtype = dtype
        self.target_layer_ids = spec.target_layer_ids
        self.shared = _SharedWithTarget(target)
        D = cfg.hidden_size
        self.main_proj = Linear(D * len(spec.target_layer_ids), D, dtype)
        self.main_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Block(cfg, SLIDING, MOE, expert_format, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        add_hyper_head(self, cfg)
        self.markov_head = MarkovHead(cfg, spec.markov_rank, dtype)
        register_first_layer_broadcast(self, cfg)
        self.requires_grad_(False)

    def native_name(self, param_name: str) -> str:
        last = len(self.layers) - 1
        if match := _DSPARK_LAYER.match(param_name):
            return f"mtp.{match[1]}.{match[2]}"
        if _DSPARK_INPUT_STACK.match(param_name):
            return f"mtp.0.{param_name}"
        if _DSPARK_OUTPUT_STACK.match(param_name):
            return f"mtp.{last}.{param_name}"
        raise KeyError(f"dspark parameter {param_name} has no native name")

    def derived_tensors(self) -> list[DerivedTensor]:
        return [first_layer_broadcast(self.layers, self.cfg)]

    def allocate_cache(self, slots: int, max_len: int) -> ModelCache:
        device = self.main_proj.weight.device
        layers = [allocate_layer_cache(self.cfg, SLIDING, slots, max_len, self.dtype, device) for _ in self.layers]
        return ModelCache(layers, slots)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, captured: dict[int, torch.Tensor], cache: ModelCache
    ) -> torch.Tensor:
        """batch: draft input tokens; captured: the target's streams [T, hc, D] after each target layer id
        (from `DeepseekV4.forward(..., capture_layers=drafter.target_layer_ids)`). -> fp32 logits [T, V]."""
        self.require_ready()
        cache.begin_step(batch.segments)
        target = self.shared.target
        features = torch.cat([captured[i].mean(dim=1) for i in self.target_layer_ids], dim=-1)
        embeds = target.embed(batch.token_ids) + self.main_norm(self.main_proj(features))
        streams = self.layers[0].forward_broadcast(embeds, self.get_buffer(FIRST_LAYER_BROADCAST), batch, cache[0])
        for i in range(1, len(self.layers)):
            streams = self.layers[i](streams, batch, cache[i], overwrite_input=True)  # only this loop holds them
        logits = target.head(self.norm(hyper_head(self, streams, self.cfg))).float()
        return logits + self.markov_head(batch.token_ids)


DRAFTER_CLASSES = {"mtp": MTPDrafter, "dspark": DSparkDrafter}


def build_drafter(
    name: str, cfg: ModelConfig, target: DeepseekV4, expert_format: str, dtype: torch.dtype
) -> TopLevelModel:
    if name == "mtp" and cfg.dspark is not None:
        raise ConfigError(
            f"{cfg.source}: a DSpark checkpoint (dspark_* fields): its mtp.* tensors are DSpark blocks, "
            f"loading them as MTP would half-load them; use draft='dspark'"
        )
    return DRAFTER_CLASSES[name](cfg, target, expert_format, dtype)
