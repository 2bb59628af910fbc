"""A pure-decode step as one fixed-shape tensor program, so `torch.compile` can capture it whole.

A decode step on CPU is dispatch-bound: hundreds of framework calls of a few microseconds each around
GEMMs that take as long (anchors.md §6.4). The eager batched path (attention.py) already has no
per-sequence loop, but it reads the host (which rows complete a compressor window, how many entries
each row sees) and calls C kernels through ctypes, and both break a compiled graph. This module
computes the same step with neither:

- every row computes its compressor's candidate entry and writes it only where the row's token
  completes a window (`torch.where`), instead of a host-side list of completing rows;
- each layer reads `entry_reads[rate]` compressed entries per row, masked by the row's own count: an
  int the host rounds up to a power of two, so a compiled graph sees few distinct values;
- norms, RoPE and mHC are the readable torch formulas (`mhc.py`, `norm.py`, `rope.py`), which the
  compiler fuses into a few loops; routed experts pick a strategy of `kernels/gathered_experts.py` by
  shape (see `_moe`).

Eager, it is a second readable decode path, tested against the batched one. Compiled
(`torch.compile(fullgraph=True)`), parameters and cache tensors are graph inputs read by address:
an in-place refit is seen by the next step with no recompilation (tests/test_static_decode.py).

Shapes: B rows (one token each), D hidden, hc streams, H heads, hd head dim, W window, m compress rate,
n entries read, V vocab.
"""

from __future__ import annotations

import torch

from dsv4.kernels.gathered_experts import GatheredExperts, GroupedExperts
from dsv4.model import mhc
from dsv4.model.attention import Attention, Compressor, gather_entries
from dsv4.model.batch import ForwardBatch
from dsv4.model.block import Block
from dsv4.model.cache import CompressorCache, LayerCache, ModelCache
from dsv4.model.deepseek_v4 import FIRST_LAYER_BROADCAST, DeepseekV4
from dsv4.model.moe import DENSE, MoE, swiglu
from dsv4.model.norm import RMSNorm, rms_normalize
from dsv4.model.rope import RotaryTable, apply_rotary
from dsv4.model.step_plan import mask_to_bias


def unsupported_reason(model: DeepseekV4) -> str | None:
    """Why `decode_forward` cannot serve this model (None when it can)."""
    for i, layer in enumerate(model.layers):
        experts = layer.ffn.experts
        if experts.format != DENSE:
            return (f"layer {i}: {experts.format} routed experts (the static step needs dense experts: "
                    f"load with expert_dtype=\"dense\" to compile)")
        if not GroupedExperts.supports(torch.empty(0, dtype=model.dtype), experts.w1):
            return f"layer {i}: expert shapes {tuple(experts.w1.shape)} are not 16-byte aligned for _grouped_mm"
    return None


def entry_reads(positions: list[int], capacity: dict[int, int], least: int) -> dict[int, int]:
    """For each compress rate, how many entries every row reads: the most any row has completed,
    rounded up to a power of two and to at least `least`, at most the cache's capacity. A compiled
    step sees few distinct values; reading a few masked entries more costs nothing."""
    reads = {}
    for rate, cap in capacity.items():
        most = max((p + 1) // rate for p in positions)
        reads[rate] = min(cap, max(least, 1 << max(0, most - 1).bit_length()))
    return reads


@torch.no_grad()
def decode_forward(
    model: DeepseekV4, cache: list[LayerCache], token_ids: torch.Tensor, positions: torch.Tensor,
    slots: torch.Tensor, reads: dict[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids, positions, slots [B] -> (streams S [B, hc, D], fp32 logits [B, V]).
    Writes each row's window ring, compressor rings and completed entries in its cache slot."""
    embeds = model.embed(token_ids)  # [B, D]
    first = model.layers[0]
    streams = _broadcast_attention_sublayer(first, embeds, model.get_buffer(FIRST_LAYER_BROADCAST),
                                            positions, slots, cache[0], reads)
    streams = _ffn_sublayer(first, streams, token_ids)
    for layer, layer_cache in zip(list(model.layers)[1:], cache[1:]):
        block_in, post, comb = _mhc_pre(layer, streams, "attn", layer.attn_norm)
        attn_out = _attention(layer.attn, block_in, positions, slots, layer_cache, reads)
        streams = _ffn_sublayer(layer, mhc.expand(streams, attn_out, post, comb), token_ids)
    collapsed = mhc.head_collapse(streams, model.hc_head_fn, model.hc_head_base, model.hc_head_scale,
                                  model.cfg.rms_norm_eps, model.cfg.hc_eps)  # [B, D]
    return streams, model.head(_rms_norm(model.norm, collapsed)).float()


# ---- mHC ----
def _coefficients(block: Block, logits: torch.Tensor, sub: str):
    cfg = block.cfg
    return mhc.coefficients_reference(logits, getattr(block, f"hc_{sub}_base"), getattr(block, f"hc_{sub}_scale"),
                                      cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)


def _mhc_pre(block: Block, streams: torch.Tensor, sub: str, norm: RMSNorm):
    """streams [B, hc, D] -> (normed sublayer input [B, D], post [B, hc], comb [B, hc, hc])."""
    logits = mhc.mix_logits(streams, getattr(block, f"hc_{sub}_fn"), block.cfg.rms_norm_eps)
    pre, post, comb = _coefficients(block, logits, sub)
    return _rms_norm(norm, mhc.collapse(streams, pre)), post, comb


def _broadcast_attention_sublayer(block: Block, embeds, fn_broadcast, positions, slots, cache, reads) -> torch.Tensor:
    """The first block's attention sublayer, whose hc input streams all equal the embedding [B, D]."""
    logits = mhc.mix_logits_broadcast(embeds, fn_broadcast, block.cfg.rms_norm_eps)
    pre, post, comb = _coefficients(block, logits, "attn")
    block_in = (pre.sum(dim=-1, keepdim=True) * embeds.float()).to(embeds.dtype)
    attn_out = _attention(block.attn, _rms_norm(block.attn_norm, block_in), positions, slots, cache, reads)
    return mhc.expand_broadcast(embeds, attn_out, post, comb)


def _ffn_sublayer(block: Block, streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    block_in, post, comb = _mhc_pre(block, streams, "ffn", block.ffn_norm)
    return mhc.expand(streams, _moe(block.ffn, block_in, token_ids), post, comb)


# ---- norms and RoPE (the reference formulas: no C kernel, so the compiler can fuse them) ----
def _rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm.forward_reference(x)


def _rope(x: torch.Tensor, positions: torch.Tensor, table: RotaryTable, inverse: bool = False) -> torch.Tensor:
    cos, sin = table.cos_sin(positions)
    return apply_rotary(x, cos, sin, inverse=inverse)


# ---- attention ----
def _attention(attn: Attention, x, positions, slots, cache: LayerCache, reads: dict[int, int]) -> torch.Tensor:
    """x [B, D] (normed block input) -> [B, D]."""
    B = x.shape[0]
    q_low = _rms_norm(attn.q_norm, attn.wq_a(x))  # [B, q_lora_rank]
    q = _rope(rms_normalize(attn.wq_b(q_low).view(B, attn.n_heads, attn.head_dim), attn.eps), positions, attn.rope)
    kv = _rope(_rms_norm(attn.kv_norm, attn.wkv(x)), positions, attn.rope)  # [B, hd]

    W = attn.window
    cache.window.index_put_((slots, positions % W), kv)
    # Ring row i holds the latest position = i (mod W), <= pos; only never-written rows are hidden.
    held = positions.unsqueeze(-1) - (positions.unsqueeze(-1) - torch.arange(W, device=x.device)) % W  # [B, W]
    blocks = [(cache.window[slots], mask_to_bias(held >= 0))]  # keys (= values) [B, W, hd], bias [B, W]

    if attn.compressor is not None:
        rate = attn.compressor.rate
        _emit(attn.compressor, x, positions, slots, cache.compressor, attn.rope)
        counts = (positions + 1) // rate  # [B] complete entries of each row
        n = reads[rate]
        if attn.indexer is not None:
            indexer = attn.indexer
            idx_q = _rope(indexer.wq_b(q_low).view(B, indexer.n_heads, indexer.head_dim), positions, attn.rope)
            _emit(indexer.compressor, x, positions, slots, cache.indexer, attn.rope)
            index_keys = cache.indexer.entries[slots, :n]  # [B, n, dI]
            picks = indexer.select_decode(idx_q, indexer.weights_proj(x), index_keys, counts)  # [B, k], -1: none
            entries = gather_entries(cache.compressor.entries, slots, picks.clamp(min=0))  # [B, k, hd]
            blocks.append((entries, mask_to_bias(picks >= 0)))
        else:
            visible = torch.arange(n, device=x.device) < counts.unsqueeze(-1)  # [B, n]
            blocks.append((cache.compressor.entries[slots, :n], mask_to_bias(visible)))
    out = attn._attend_decode(q, blocks)  # [B, H, hd]
    return attn._project_out(_rope(out, positions, attn.rope, inverse=True))  # V carried RoPE: de-rotate


def _emit(comp: Compressor, x, positions, slots, cache: CompressorCache, rope: RotaryTable) -> None:
    """Record each row's token in its compressor ring, then write entry w = pos // m of the rows whose
    token completes window w. Every row computes a candidate entry from its ring (rows mid-window pool
    stale rows and are discarded): no host-side list of completing rows."""
    m, ring_len = comp.rate, cache.ring_kv.shape[1]
    kv, gate = comp.project(x)  # [B, width]
    cache.ring_kv.index_put_((slots, positions % ring_len), kv)
    cache.ring_gate.index_put_((slots, positions % ring_len), gate)
    ring_kv, ring_gate = cache.ring_kv[slots].float(), cache.ring_gate[slots].float()  # [B, R, width]
    window = positions // m  # [B]
    B = x.shape[0]
    if not comp.overlap:
        # R == m: ring row j holds the window's token j, whose ape row is j.
        slots_kv, slots_gate = ring_kv, ring_gate + comp.ape
    else:
        # R == 2m: window w fills ring half w % 2, window w - 1 the other half.
        d = comp.out_dim
        odd = (window % 2 == 1).view(B, 1, 1)
        halves_kv, halves_gate = ring_kv.view(B, 2, m, 2 * d), (ring_gate.view(B, 2, m, 2 * d) + comp.ape)
        cur_kv = torch.where(odd, halves_kv[:, 1], halves_kv[:, 0])
        prev_kv = torch.where(odd, halves_kv[:, 0], halves_kv[:, 1])
        cur_gate = torch.where(odd, halves_gate[:, 1], halves_gate[:, 0])
        prev_gate = torch.where(odd, halves_gate[:, 0], halves_gate[:, 1])
        first = (window == 0).view(B, 1, 1)  # window 0 has no previous window: its Ca slots weigh nothing
        prev_kv = prev_kv[..., :d].masked_fill(first, 0.0)
        prev_gate = prev_gate[..., :d].masked_fill(first, float("-inf"))
        slots_kv = torch.cat((prev_kv, cur_kv[..., d:]), dim=1)  # [B, 2m, d]
        slots_gate = torch.cat((prev_gate, cur_gate[..., d:]), dim=1)
    pooled = (slots_kv * slots_gate.softmax(dim=1)).sum(dim=1)  # [B, d] fp32
    entry = _rope(_rms_norm(comp.norm, pooled.to(kv.dtype)), window * m, rope)  # [B, d]
    complete = ((positions + 1) % m == 0).unsqueeze(-1)  # [B, 1]
    cache.entries.index_put_((slots, window), torch.where(complete, entry, cache.entries[slots, window]))


# ---- MoE ----
_GROUPED = GroupedExperts()
_GATHERED = GatheredExperts()


# The routed experts enter a compiled graph as one opaque op: which experts run, and on how many rows
# each, is data-dependent (and `_grouped_mm` has no fp32 meta kernel), so the graph keeps the eager
# GroupedExperts call, ~20 framework ops per layer, while everything around it is fused.
@torch.library.custom_op("dsv4::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
) -> torch.Tensor:
    """x [B, D], ids/weights [B, k], dense w1/w3 [E, I, D], w2 [E, D, I] -> [B, D]."""
    return _GROUPED(x, ids, weights, w1, w3, w2, limit, swiglu)


@routed_experts.register_fake
def _routed_experts_shape(x, ids, weights, w1, w3, w2, limit):
    return torch.empty_like(x)


def _moe(moe: MoE, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """x [B, D] -> [B, D]: routed dense experts plus the shared expert. Shape tests pick the strategy, so
    each is its own graph: every expert on every row (`uses_all_experts`) or gathered expert weights
    (small experts, few rows) stay in the graph, where the compiler fuses the routing and activation
    around the GEMMs; otherwise the opaque `routed_experts` op."""
    ids, weights = moe.gate(x, token_ids)  # [B, k]
    e = moe.experts
    if GroupedExperts.uses_all_experts(ids.shape[0], ids.shape[1], e.w1):
        routed = GroupedExperts.all_experts(x, ids, weights, e.w1, e.w3, e.w2, e.limit, swiglu)
    elif _GATHERED.supports(x, ids.numel(), e.w1):
        routed = GatheredExperts.gathered(x, ids, weights, e.w1, e.w3, e.w2, e.limit, swiglu)
    else:
        routed = routed_experts(x, ids, weights, e.w1, e.w3, e.w2, e.limit)
    return routed + moe.shared_experts(x)


# ---- the engine's entry point ----
# Inductor options of the compiled step. `cpp_wrapper`: the generated code calls its kernels, GEMMs and
# buffer allocations from C++ instead of a Python wrapper, whose per-call cost (hundreds of allocations
# and stride checks per step) dominates a dispatch-bound step: tiny config, 16 rows, 2.90 -> 2.38 ms per
# step (measured back to back in one process). A cold compile also builds the C++ wrapper.
COMPILE_OPTIONS = {"cpp_wrapper": True}


class StaticDecode:
    """Runs pure-decode steps (every segment one token) through `decode_forward`, compiled with
    `torch.compile` when `compile` is set. Shapes are symbolic (`dynamic=True`): a graph serves a
    range of batch sizes and every entry count. Batch size 1 gets its own graph (torch specialises
    sizes 0 and 1), and so does each batch-size range with another expert strategy (`_moe`), so a
    process compiles two to four graphs (one to four minutes each on a 2-core CPU, the C++ wrapper
    included; torch caches the generated code on disk, so a later process reuses it)."""

    def __init__(self, model: DeepseekV4, compile: bool):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"static decode step unavailable: {reason}")
        self.model = model
        # Entry reads never drop below the indexer's k (nor 2): `min(k, n)` and size-1 specialisation
        # would otherwise split the graph by entry count.
        self._least_reads = max(2, model.cfg.index_topk)
        self._forward = decode_forward
        if compile:
            compiled = torch.compile(decode_forward, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS)
            # The floats the step reads (norm eps, SwiGLU limit, routing scale) are model constants: specialised,
            # they are baked into the graph (a guard recompiles for another model) instead of ~30 scalars boxed
            # into tensors on every call (~5% of a tiny-config step).
            self._forward = torch._dynamo.config.patch(specialize_float=True)(compiled)

    @staticmethod
    def serves(batch: ForwardBatch) -> bool:
        return all(seg.length == 1 for seg in batch.segments)

    def __call__(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """A pure-decode batch -> (streams [B, hc, D], fp32 logits [B, V]); extends the rows' cache slots."""
        self.model.require_ready()
        cache.begin_step(batch.segments)
        slots = torch.tensor([seg.slot for seg in batch.segments], device=batch.token_ids.device)
        capacity = {  # compress rate -> entries a slot holds
            layer.attn.compressor.rate: layer_cache.compressor.entries.shape[1]
            for layer, layer_cache in zip(self.model.layers, cache) if layer.attn.compressor is not None
        }
        reads = entry_reads([seg.start for seg in batch.segments], capacity, self._least_reads)
        return self._forward(self.model, cache.layers, batch.token_ids, batch.positions, slots, reads)
