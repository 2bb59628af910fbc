"""Checkpoint names -> dsv4's canonical names (DeepSeek's native release names).

Three dialects arrive: native (`layers.3.attn.wq_a.weight`), HF as transformers defines it
(`model.layers.3.self_attn.q_a_proj.weight`), and what transformers' `save_pretrained` actually writes,
a mix of both (`model.layers.3.attn.wq_a.weight`, `model.embed_tokens.weight`, the main kv norm as
`attn.norm.weight`). One ordered, declarative rename table folds all three into native names; HF's
stacked expert tensors are split per expert.
"""

import re
from collections.abc import Iterator

import torch

# Scale spellings: native `.scale`, V3-style `.weight_scale_inv`, transformers' FP8 `.weight_scale_inv`.
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
SCALE_SUFFIX = ".scale"  # the native one
WEIGHT_SUFFIX = ".weight"
HF_PREFIX = "model."
DRAFTER_PREFIX = "mtp."
# Drafter copies of the target's embedding and head: the target owns them, drafters alias them.
ALIASED_DRAFTER_TENSORS = re.compile(r"^mtp\.\d+\.(emb\.tok_emb\.weight|head\.weight|embed\.weight)$")

# (pattern, replacement), applied in order to the name without its `model.` prefix. Every pattern is
# anchored so that an already-native name passes through unchanged.
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^(layers\.\d+)\.self_attn\.", r"\1.attn."),
    (r"^(layers\.\d+)\.mlp\.", r"\1.ffn."),
    (r"^(layers\.\d+)\.input_layernorm\.", r"\1.attn_norm."),
    (r"^(layers\.\d+)\.post_attention_layernorm\.", r"\1.ffn_norm."),
    (r"^(layers\.\d+)\.(attn|ffn)_hc\.(fn|base|scale)$", r"\1.hc_\2_\3"),
    # attention (the indexer lives inside the compressor in HF, beside it natively)
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    # transformers' save_pretrained reverses `.kv_norm.` -> `.norm.` everywhere, main kv norm included
    (r"^(layers\.\d+)\.attn\.norm\.", r"\1.attn.kv_norm."),
    # MoE
    (r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.ffn\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.ffn\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.ffn\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    # DSpark: V4.1-Flash names the Markov head's two matrices embed / head; V4-Flash-DSpark (canonical)
    # markov_w1 / markov_w2. Both [vocab, rank].
    (r"^(mtp\.\d+)\.markov_head\.embed\.", r"\1.markov_head.markov_w1."),
    (r"^(mtp\.\d+)\.markov_head\.head\.", r"\1.markov_head.markov_w2."),
)
_COMPILED = tuple((re.compile(p), r) for p, r in _RENAMES)

# HF stacks every routed expert of a layer in one tensor: name -> the native matrices it carries, stacked
# along dim 1 in this order (gate rows first): gate_up_proj [E, 2I, D] = (w1, w3), down_proj [E, D, I] = (w2,).
STACKED_EXPERTS: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = (
    (re.compile(r"^(layers\.\d+\.ffn\.experts)\.gate_up_proj$"), ("w1", "w3")),
    (re.compile(r"^(layers\.\d+\.ffn\.experts)\.down_proj$"), ("w2",)),
)


def canonical_name(name: str) -> str:
    """Fold one incoming name to its native spelling (unknown names pass through, to be rejected later)."""
    if name.startswith(HF_PREFIX):
        name = name[len(HF_PREFIX) :]
    for pattern, replacement in _COMPILED:
        name = pattern.sub(replacement, name)
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix) and suffix != SCALE_SUFFIX:
            name = name[: -len(suffix)] + SCALE_SUFFIX
    return name


def stacked_experts(native: str) -> tuple[str, tuple[str, ...]] | None:
    """(native experts prefix, matrices) when a canonical name is an HF stacked-experts tensor, else None."""
    for pattern, matrices in STACKED_EXPERTS:
        if match := pattern.match(native):
            return match[1], matrices
    return None


def split_stacked(name: str, tensor: torch.Tensor, matrices: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """A stacked-experts tensor [E, len(matrices) * out, in] -> one [E, out, in] view per matrix."""
    if tensor.dim() != 3 or tensor.shape[1] % len(matrices):
        rows = f"{len(matrices)}*out" if len(matrices) > 1 else "out"
        raise ValueError(f"{name}: expected [experts, {rows}, in], got {tuple(tensor.shape)}")
    return tensor.chunk(len(matrices), dim=1)


def canonical_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One incoming (name, tensor) -> the native (name, tensor) pairs it carries: HF stacked experts become
    per-expert w1/w3/w2 views (works on meta tensors: nothing is read)."""
    native = canonical_name(name)
    stacked = stacked_experts(native)
    if stacked is None:
        yield native, tensor
        return
    prefix, matrices = stacked
    for w, part in zip(matrices, split_stacked(name, tensor, matrices), strict=True):
        for e in range(part.shape[0]):
            yield f"{prefix}.{e}.{w}{WEIGHT_SUFFIX}", part[e]


def to_hf_name(native: str) -> str:
    """Native -> transformers' HF name (for `dsv4 convert --layout hf`), experts excluded (stacked apart)."""
    return _to_hf(native)


# The inverse table, used only for writing HF-layout checkpoints.
_HF_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.(compressor|indexer)\.wkv\.", r".\1.kv_proj."),
    (r"\.(compressor|indexer)\.wgate\.", r".\1.gate_proj."),
    (r"\.(compressor|indexer)\.ape$", r".\1.position_bias"),
    (r"\.(compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.attn\.attn_sink$", ".attn.sinks"),
    (r"\.attn\.wq_a\.", ".attn.q_a_proj."),
    (r"\.attn\.q_norm\.", ".attn.q_a_norm."),
    (r"\.attn\.wq_b\.", ".attn.q_b_proj."),
    (r"\.attn\.wkv\.", ".attn.kv_proj."),
    (r"\.attn\.wo_a\.", ".attn.o_a_proj."),
    (r"\.attn\.wo_b\.", ".attn.o_b_proj."),
    (r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
    (r"\.ffn\.shared_experts\.w1\.", ".ffn.shared_experts.gate_proj."),
    (r"\.ffn\.shared_experts\.w3\.", ".ffn.shared_experts.up_proj."),
    (r"\.ffn\.shared_experts\.w2\.", ".ffn.shared_experts.down_proj."),
    (r"^(layers\.\d+)\.attn_norm\.", r"\1.input_layernorm."),
    (r"^(layers\.\d+)\.ffn_norm\.", r"\1.post_attention_layernorm."),
    (r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$", r"\1.\2_hc.\3"),
    (r"^(layers\.\d+)\.attn\.", r"\1.self_attn."),
    (r"^(layers\.\d+)\.ffn\.", r"\1.mlp."),
    (r"^layers\.", "model.layers."),
)
_HF_COMPILED = tuple((re.compile(p), r) for p, r in _HF_RENAMES)


def _to_hf(native: str) -> str:
    for pattern, replacement in _HF_COMPILED:
        native = pattern.sub(replacement, native)
    return native
