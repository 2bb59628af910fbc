"""The DSpark drafter as DeepSeek released it (DeepSeek-V4-Flash-DSpark; V4.1-Flash's variant too).

A top-level model with its own load -> finalize lifecycle, under the release's names: stage s of
`num_stages` is a decoder block `mtp.{s}` (sliding attention, routed MoE); `mtp.0` also holds main_proj
and main_norm, the last stage norm, hc_head_* (V4 only), markov_head and confidence_head. The target's
embedding and head are used through `hold_target` (the target owns them).

Context. For each committed target position t (prefill chunks, accepted drafts):
    f_t     = concat over target_layer_ids (ascending) of the target's streams at t averaged over hc
              (V4-Flash-DSpark: each layer's output; V4.1: each layer's input)
    main_x  = main_norm(main_proj(f_t))
    key_s,t = kv_norm_s(wkv_s(main_x)) rotated at t, for every stage s      -> the context ring
Draft. A block of B = dspark_block_size rows [anchor, noise x (B-1)] at positions p+1 .. p+B (p: the last
committed position, the anchor the token after it) runs through the stages in one pass. Each stage's
queries come from the block only; they attend to the last `sliding_window` context keys of the sequence
and to every row of the block (bidirectional inside the block); the block's own keys are never cached.
    V4-Flash-DSpark: streams = broadcast(embed(block)); stage_s; hidden = hc_head(streams)
    V4.1:            each stage collapses a sublayer's input with the mHC `pre` mix computed one
                     sublayer earlier (the first with stream 0); hidden = collapse with the last mix
    base logits = head(norm(hidden)); then the Markov head and confidence head (engine/dspark_draft.py).
The first stage sees a broadcast input, so its attention mHC mix uses the pre-summed matrix
hc_attn_fn.view(mix, hc, D).sum(1) (a registered derived tensor).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from dsv4.config import DSPARK_V4, MOE, SLIDING, ModelConfig
from dsv4.errors import ConfigError
from dsv4.kernels.registry import KernelRegistry
from dsv4.model import mhc
from dsv4.model.attention import Attention, softmax_with_sink
from dsv4.model.batch import ForwardBatch
from dsv4.model.block import Block
from dsv4.model.deepseek_v4 import (
    FIRST_LAYER_BROADCAST,
    DeepseekV4,
    add_first_layer_broadcast,
    add_hyper_head,
    hyper_head,
)
from dsv4.model.derived import TopLevelModel
from dsv4.model.dspark_cache import DSparkCache
from dsv4.model.dspark_heads import ConfidenceHead, MarkovHead
from dsv4.model.linear import Linear
from dsv4.model.norm import RMSNorm
from dsv4.model.rope import norm_rope_


@dataclass(frozen=True)
class DraftBlocks:
    """N draft blocks of B rows, flattened block-major (row n * B + i is position i of block n)."""

    token_ids: torch.Tensor  # [N * B] int64: [anchor, noise, ..., noise] per block
    positions: torch.Tensor  # [N * B] int64: anchor position + 0 .. B-1
    n_blocks: int
    block_size: int

    @property
    def decode_rows(self) -> bool:
        """Never a decode step's rows (`ForwardBatch.decode_rows`): a draft block is B rows of one sequence."""
        return False


@dataclass(frozen=True)
class StageContext:
    """One stage's context for N blocks: its keys of the last `window` committed positions per block."""

    keys: torch.Tensor  # [N, window, hd]
    bias: torch.Tensor  # [N, window] fp32: 0 visible, -inf for rows before position 0


class DSparkAttention(Attention):
    """A stage's attention: queries from the block rows; keys (= values) are the stage's context keys
    plus the block's own rows, all visible to every block query; a per-head sink as in every V4 layer."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, kernels: KernelRegistry):
        super().__init__(cfg, SLIDING, dtype, kernels)

    def forward(self, x: torch.Tensor, blocks: DraftBlocks, context: StageContext) -> torch.Tensor:
        """Block attention over context + block rows.

        Args:
            x: [N * B, D] the normed stage input of the block rows.
            blocks: the blocks' positions and shape.
            context: this stage's context keys and their visibility.

        Returns:
            [N * B, D].
        """
        rows, pos = x.shape[0], blocks.positions
        n, b, heads, hd = blocks.n_blocks, blocks.block_size, self.n_heads, self.head_dim
        q = norm_rope_(self.wq_b(self.q_norm(self.wq_a(x), inplace=True)).view(rows, heads, hd), self.eps, None,
                       pos, self.rope)
        kv = norm_rope_(self.wkv(x), self.kv_norm.eps, self.kv_norm.weight, pos, self.rope)  # [N * B, hd]
        keys = torch.cat((context.keys.to(kv.dtype), kv.view(n, b, hd)), dim=1)  # [N, window + B, hd]
        bias = torch.cat((context.bias, context.bias.new_zeros(n, b)), dim=1)  # block rows: always visible
        logits = torch.einsum("nqhd,nkd->nhqk", q.view(n, b, heads, hd), keys).float() * hd**-0.5
        logits = torch.cat((logits + bias[:, None, None, :], logits.new_empty(n, heads, b, 1)), dim=-1)
        probs = softmax_with_sink(logits, self.attn_sink.view(heads, 1))[..., :-1]  # the sink takes mass, adds no value
        out = torch.einsum("nhqk,nkd->nqhd", probs.to(keys.dtype), keys).reshape(rows, heads, hd)
        out = norm_rope_(out, None, None, pos, self.rope, inverse=True)  # V carried RoPE: de-rotate
        return self._project_out(out)


class DSparkStage(Block):
    """Drafter stage `mtp.{s}`: a sliding-attention, routed-MoE block whose attention reads the context
    ring; the first stage also holds the context input stack, the last one the head stack."""

    def __init__(self, cfg: ModelConfig, stage_cfg: ModelConfig, expert_format: str, dtype: torch.dtype,
                 kernels: KernelRegistry, first: bool, last: bool):
        super().__init__(stage_cfg, SLIDING, MOE, expert_format, dtype, kernels)
        spec = cfg.dspark
        D = cfg.hidden_size
        self.attn = DSparkAttention(stage_cfg, dtype, kernels)
        if first:
            self.main_proj = Linear(D * len(spec.target_layer_ids), D, dtype, kernels)
            self.main_norm = RMSNorm(D, cfg.rms_norm_eps, kernels)
        if last:
            self.norm = RMSNorm(D, cfg.rms_norm_eps, kernels)
            if spec.variant == DSPARK_V4:
                add_hyper_head(self, cfg)
            self.markov_head = MarkovHead(cfg.vocab_size, spec.markov_rank, dtype, kernels)
            self.confidence_head = ConfidenceHead(D, spec.markov_rank, kernels)

    # ---- V4.1: the mHC `pre` mix of each sublayer is applied one sublayer later ----
    def forward_carried(
        self, streams: torch.Tensor, carried_pre: torch.Tensor, blocks: DraftBlocks, context: StageContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One V4.1 stage.

        Args:
            streams: [T, hc, D] the stage input.
            carried_pre: [T, hc] the mix the previous sublayer computed, which collapses the attention input.
            blocks: the draft blocks.
            context: this stage's context.

        Returns:
            (the stage's output streams [T, hc, D], the FFN's mix [T, hc] for the next collapse).
        """
        pre, post, comb = self._coefficients(mhc.mix_logits(streams, self.hc_attn_fn, self.cfg.rms_norm_eps), "attn")
        attn_out = self.attn(self.attn_norm(mhc.collapse(streams, carried_pre)), blocks, context)
        return self._ffn_carried(mhc.expand(streams, attn_out, post, comb), pre, blocks)

    def forward_carried_broadcast(
        self, embeds: torch.Tensor, fn_broadcast: torch.Tensor, blocks: DraftBlocks, context: StageContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first V4.1 stage: every stream is the embedding, so the identity mix (stream 0) reads the
        embedding itself and the attention mix projects the un-repeated embedding with fn_broadcast.

        Args:
            embeds: [T, D] the block's embedding.
            fn_broadcast: [mix, D] the pre-summed attention mHC matrix.
            blocks: the draft blocks.
            context: this stage's context.

        Returns:
            (output streams [T, hc, D], the FFN's mix [T, hc]).
        """
        logits = mhc.mix_logits_broadcast(embeds, fn_broadcast, self.cfg.rms_norm_eps)
        pre, post, comb = self._coefficients(logits, "attn")
        attn_out = self.attn(self.attn_norm(embeds), blocks, context)
        return self._ffn_carried(mhc.expand_broadcast(embeds, attn_out, post, comb), pre, blocks)

    def _ffn_carried(
        self, streams: torch.Tensor, attn_pre: torch.Tensor, blocks: DraftBlocks
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pre, post, comb = self._coefficients(mhc.mix_logits(streams, self.hc_ffn_fn, self.cfg.rms_norm_eps), "ffn")
        ffn_out = self.ffn(self.ffn_norm(mhc.collapse(streams, attn_pre)), blocks.token_ids)
        return mhc.expand(streams, ffn_out, post, comb), pre


class DSparkDrafter(TopLevelModel):
    """DSpark's stages as a drafter; its fast paths use the target's kernel registry."""

    role = "dspark"

    def __init__(self, cfg: ModelConfig, target: DeepseekV4, expert_format: str, dtype: torch.dtype):
        super().__init__()
        if cfg.dspark is None:
            raise ConfigError(f"{cfg.source}: no dspark_* fields, so the checkpoint has no DSpark drafter")
        spec = cfg.dspark
        self.cfg = cfg
        self.spec = spec
        self.hold_target(target)
        # V4.1's stages route over their own expert bank; the rest of the block shape is the target's.
        stage_cfg = replace(
            cfg,
            n_routed_experts=spec.n_routed_experts or cfg.n_routed_experts,
            num_experts_per_tok=spec.num_experts_per_tok or cfg.num_experts_per_tok,
        )
        last = spec.num_stages - 1
        self.mtp = nn.ModuleList(
            DSparkStage(cfg, stage_cfg, expert_format, dtype, target.kernels, first=s == 0, last=s == last)
            for s in range(spec.num_stages)
        )
        add_first_layer_broadcast(self, self.mtp, cfg)
        self.requires_grad_(False)

    # ---- the target's side ----
    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose output streams `commit` needs: `DeepseekV4.forward(capture_layers=...)`.
        V4.1 reads each target layer's input, the previous layer's output (layer 0's is the embedding)."""
        ids = self.spec.target_layer_ids
        return ids if self.spec.variant == DSPARK_V4 else tuple(i - 1 for i in ids if i > 0)

    def features(self, captured: dict[int, torch.Tensor], token_ids: torch.Tensor) -> torch.Tensor:
        """The target's features: the streams read at each target layer, averaged over hc, concatenated in
        ascending layer order.

        Args:
            captured: {target layer: its output streams [T, hc, D]} for `capture_layers`.
            token_ids: [T] the tokens of those rows (V4.1 reading layer 0 reads their embedding).

        Returns:
            f [T, D * len(target_layer_ids)].

        Raises:
            ValueError: a needed layer was not captured.
        """
        parts = []
        for layer in self.spec.target_layer_ids:
            if self.spec.variant != DSPARK_V4 and layer == 0:
                # every stream entering layer 0 is the embedding
                parts.append(self.target.embed_tokens(token_ids))
                continue
            source = layer if self.spec.variant == DSPARK_V4 else layer - 1
            if source not in captured:
                raise ValueError(
                    f"dspark: the target's captured streams lack layer {source}; run the target with "
                    f"capture_layers={self.capture_layers}"
                )
            parts.append(captured[source].mean(dim=1))
        return torch.cat(parts, dim=-1)

    def main_x(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, D * n] -> main_x = main_norm(main_proj(features)) [T, D], the context's source."""
        first = self.mtp[0]
        return first.main_norm(first.main_proj(features), inplace=True)

    def context_keys(self, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each stage's context keys kv_norm(wkv(main_x)), rotated at the positions.

        Args:
            features: f [T, D * n] (`features`).
            positions: [T] their positions.

        Returns:
            One [T, hd] tensor per stage.
        """
        main_x = self.main_x(features)
        return [norm_rope_(s.attn.wkv(main_x), s.attn.kv_norm.eps, s.attn.kv_norm.weight, positions, s.attn.rope)
                for s in self.mtp]

    # ---- per-sequence context ----
    def allocate_cache(self, slots: int, max_len: int, rollback: int = 0) -> DSparkCache:
        """The context rings of `slots` sequences.

        Args:
            slots: sequences held at once.
            max_len: unused: the rings do not grow with the sequence (kept for the engine's uniform call).
            rollback: extra rows per ring, so that a rewind of up to that many positions finds its rows.

        Returns:
            A `DSparkCache` of `sliding_window + rollback` rows per stage and slot.
        """
        del max_len
        device = self.mtp[0].main_proj.weight.device
        return DSparkCache(len(self.mtp), slots, self.cfg.sliding_window, rollback, self.cfg.head_dim,
                           self.target.activation_dtype, device)

    @torch.no_grad()
    def commit(self, cache: DSparkCache, batch: ForwardBatch, captured: dict[int, torch.Tensor]) -> None:
        """Record every position of a target forward's batch (prefill chunks) in the context rings.

        Args:
            cache: from `allocate_cache`.
            batch: the target forward's batch.
            captured: that forward's captured streams (`capture_layers`), rows aligned with the batch.
        """
        self.require_ready()
        keys = self.context_keys(self.features(captured, batch.token_ids), batch.positions)
        cache.write([(s.slot, s.start, s.length) for s in batch.segments], keys)

    # ---- drafting ----
    def draft_blocks(self, anchors: torch.Tensor, positions: torch.Tensor) -> DraftBlocks:
        """The draft blocks [anchor, noise x (B-1)] at positions a .. a+B-1.

        Args:
            anchors: [N] int64 anchor tokens.
            positions: [N] int64 their positions a.

        Returns:
            `DraftBlocks` of N blocks.
        """
        n, b = anchors.shape[0], self.spec.block_size
        tokens = anchors.new_full((n, b), self.spec.noise_token_id)
        tokens[:, 0] = anchors
        block_positions = positions.unsqueeze(1) + torch.arange(b, device=positions.device)
        return DraftBlocks(tokens.reshape(-1), block_positions.reshape(-1), n, b)

    def forward(
        self, blocks: DraftBlocks, contexts: Sequence[StageContext], first_layer_fn: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the stages over the blocks.

        Args:
            blocks: the draft blocks (`draft_blocks`).
            contexts: one `StageContext` per stage.
            first_layer_fn: the first stage's pre-summed attention mHC matrix; None uses the finalized
                derived tensor (training passes the live `broadcast_fn` of mtp.0.hc_attn_fn instead, so that
                its gradient flows).

        Returns:
            (head hidden [N, B, D]: the last stage's collapse before its norm, fp32 base logits [N, B, V]).
        """
        self.require_ready()
        fn_broadcast = self.get_buffer(FIRST_LAYER_BROADCAST) if first_layer_fn is None else first_layer_fn
        embeds = self.target.embed_tokens(blocks.token_ids)  # [N * B, D]
        stages = self.mtp
        if self.spec.variant == DSPARK_V4:
            streams = stages[0].forward_broadcast(embeds, fn_broadcast, blocks, contexts[0])
            for s in range(1, len(stages)):
                streams = stages[s](streams, blocks, contexts[s], overwrite_input=True)  # only this loop holds them
            hidden = hyper_head(stages[-1], streams, self.cfg)
        else:
            streams, carried = stages[0].forward_carried_broadcast(embeds, fn_broadcast, blocks, contexts[0])
            for s in range(1, len(stages)):
                streams, carried = stages[s].forward_carried(streams, carried, blocks, contexts[s])
            hidden = mhc.collapse(streams, carried)
        logits = self.target.head(stages[-1].norm(hidden)).float()
        n, b = blocks.n_blocks, blocks.block_size
        return hidden.view(n, b, -1), logits.view(n, b, -1)

    @torch.no_grad()
    def score_blocks(
        self, cache: DSparkCache, slots: Sequence[int], anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the stages over a draft block per sequence, read from the sequences' context rings
        (the draft loop, engine/dspark_draft.py, turns the scores into draft tokens).

        Args:
            cache: the context rings; each slot must hold its committed positions [0, p].
            slots: the sequences' cache slots.
            anchors: [N] int64, each sequence's newest token (at position p + 1, not yet run by the target).

        Returns:
            (head hidden [N, B, D], fp32 base logits [N, B, V]), as `forward`.
        """
        self.require_ready()
        if anchors.numel() != len(slots):
            raise ValueError(f"{anchors.numel()} anchors for {len(slots)} slots")
        positions = torch.tensor(cache.anchor_positions(slots), dtype=torch.long, device=anchors.device)
        rows = cache.context_rows(slots)
        contexts = [StageContext(cache.read(s, rows), rows.bias) for s in range(len(self.mtp))]
        return self.forward(self.draft_blocks(anchors, positions), contexts)
