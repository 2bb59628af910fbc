"""The DeepSeek-V4 target model.

  e = embed[ids]                       [T, D]
  R = block_0(broadcast(e))            [T, hc, D]  (first block projects the un-repeated embedding)
  R = block_l(R)  for l = 1..L-1
  S = R                                pre-hc_head stream: the MTP drafter's input
  logits = head(norm(hc_head(S)))      [T, V]
"""

import torch
from torch import nn

from dsv4.config import ModelConfig
from dsv4.kernels.registry import MHC_HEAD, KernelRegistry, default_registry
from dsv4.model import mhc
from dsv4.model.batch import ForwardBatch
from dsv4.model.block import Block
from dsv4.model.cache import LayerCache, ModelCache, allocate_layer_cache
from dsv4.model.derived import TopLevelModel
from dsv4.model.linear import Linear
from dsv4.model.norm import RMSNorm
from dsv4.model.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from dsv4.parallel.state import SINGLE, ParallelState

FIRST_LAYER_BROADCAST = "hc_attn_fn_broadcast"


def broadcast_fn(fn: torch.Tensor, hc: int) -> torch.Tensor:
    """fn [mix, hc*D] -> F_b [mix, D] = sum over the hc stream blocks (exact when all streams are equal)."""
    return fn.view(fn.shape[0], hc, -1).sum(dim=1)


def add_first_layer_broadcast(model: TopLevelModel, layers: nn.ModuleList, cfg: ModelConfig) -> None:
    """Register F_b, the derived matrix of a model whose first block sees a broadcast input (target, DSpark),
    computed from layers[0].hc_attn_fn."""
    model.register_derived(FIRST_LAYER_BROADCAST, lambda: broadcast_fn(layers[0].hc_attn_fn.float(), cfg.hc_mult),
                           (cfg.hc_mix, cfg.hidden_size))


def add_hyper_head(module: nn.Module, cfg: ModelConfig) -> None:
    """Register the final pre-only mHC collapse's parameters under their native names `hc_head_*`."""
    hc = cfg.hc_mult
    module.register_parameter("hc_head_fn", nn.Parameter(torch.zeros(hc, hc * cfg.hidden_size), requires_grad=False))
    module.register_parameter("hc_head_base", nn.Parameter(torch.zeros(hc), requires_grad=False))
    module.register_parameter("hc_head_scale", nn.Parameter(torch.ones(1), requires_grad=False))


def hyper_head(module: nn.Module, streams: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[T, hc, D] -> [T, D] with `module`'s hc_head_* parameters, through its registry's MHC_HEAD kernel when that
    supports the call (else `mhc.head_collapse`, its reference)."""
    args = (streams, module.hc_head_fn, module.hc_head_base, module.hc_head_scale, cfg.rms_norm_eps, cfg.hc_eps)
    kernel = module.kernels.kernel(MHC_HEAD, *args)
    return kernel(*args) if kernel is not None else mhc.head_collapse(*args)


class DeepseekV4(TopLevelModel):
    """The target model; `kernels` (default: the process-wide registry) serves every fast path of its
    modules; `parallel`: this rank's share of a tensor / expert parallel group (docs/parallel.md).

    `dtype` is the resident dtype of the dense weights; `activation_dtype` (None: `dtype`) that of the
    activations and the caches. Only the embedding (`embed_tokens`) and the cache allocation read it: every
    module downstream computes in its input's dtype, widening a narrower weight per call (`compute_weight`).
    """

    role = "target"

    def __init__(self, cfg: ModelConfig, expert_format: str, dtype: torch.dtype, kernels: KernelRegistry | None = None,
                 parallel: ParallelState = SINGLE, activation_dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.activation_dtype = dtype if activation_dtype is None else activation_dtype
        self.kernels = kernels or default_registry()
        self.parallel = parallel
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i], expert_format, dtype, self.kernels, parallel)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.kernels)
        if parallel.is_parallel:
            self.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, dtype, parallel)
        else:
            self.head = Linear(cfg.hidden_size, cfg.vocab_size, dtype, self.kernels)
        add_hyper_head(self, cfg)
        add_first_layer_broadcast(self, self.layers, cfg)
        self.requires_grad_(False)

    def allocate_cache(self, slots: int, max_len: int) -> ModelCache:
        device = self.embed.weight.device
        layers = [allocate_layer_cache(self.cfg, t, slots, max_len, self.activation_dtype, device)
                  for t in self.cfg.layer_types]
        return ModelCache(layers, slots)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> embeddings [T, D] in the activation dtype (the table's rows, widened when the
        activations are wider than the weights; exact)."""
        return self.embed(token_ids).to(self.activation_dtype)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, cache: ModelCache, capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """-> (pre-hc_head streams S [T, hc, D], {layer id: that layer's output streams} for capture_layers)."""
        self.require_ready()
        cache.begin_step(batch.segments)
        return self.forward_layers(batch, cache.layers, capture_layers)

    def forward_layers(
        self, batch: ForwardBatch, cache: list[LayerCache], capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward` after its checks: the embedding and the blocks over the layers' caches (the code a
        compiled decode step captures)."""
        return self.forward_embedded(self.embed_tokens(batch.token_ids), batch, cache, capture_layers)

    def forward_embedded(
        self, embeds: torch.Tensor, batch: ForwardBatch, cache: list[LayerCache], capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`forward_layers` from the step's embeddings [T, D] (`embed_tokens`): the blocks alone, what a replayed
        decode step records (engine/decode_replay.py)."""
        streams = self.layers[0].forward_broadcast(embeds, self.get_buffer(FIRST_LAYER_BROADCAST), batch, cache[0])
        captured = {0: streams} if 0 in capture_layers else {}
        for i in range(1, len(self.layers)):
            # A captured layer output must survive the next layers; any other is dead once read.
            streams = self.layers[i](streams, batch, cache[i], overwrite_input=i - 1 not in capture_layers)
            if i in capture_layers:
                captured[i] = streams
        return streams, captured

    @torch.no_grad()
    def logits(self, streams: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """S [T, hc, D] -> fp32 logits [T, V]; decode_rows: a decode step's rows (`Linear.forward`)."""
        return self.head_output(streams, decode_rows).float()

    def head_output(self, streams: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """`logits` in the activation dtype (what a replayed decode step records, engine/decode_replay.py)."""
        # The collapse's output is a fresh tensor: the norm may overwrite it.
        return self.head(self.norm(hyper_head(self, streams, self.cfg), inplace=True), decode_rows)
