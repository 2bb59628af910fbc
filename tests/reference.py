"""Independent reference harness for DeepSeek-V4 tests.

This module is the test-side *oracle*. It is built only on transformers 5.23
``DeepseekV4ForCausalLM`` (fp32, CPU, eager attention), safetensors and plain
torch, and it deliberately never imports ``dsv4``: anything the package computes
is checked against what this module computes independently.

What it provides:

* ``tiny_config`` / ``small_config``: the HF config dicts of the test model and the benchmark model.
* ``build_reference_model``: a transformers model whose every parameter and
  persistent buffer is randomised by ``build_reference_model``'s recipe (and checked to be so).
* ``native_state_dict`` / ``hf_state_from_native`` / ``model_from_native_state``:
  conversion between the HF tensor names and the native DeepSeek release names
  (docs/model.md, "Native names" / "HF names"), driven by one declarative name table.
* ``random_mtp_tensors``: native ``mtp.{i}.*`` drafter tensors (docs/model.md).
* ``write_native_checkpoint`` / ``quantize_native_tensors`` /
  ``dequantize_native_tensors`` / ``dequantized_native_state``: native
  checkpoints in fp32, bf16 or FP8 (+ FP4 or FP8 routed experts), with an
  independent quantizer written from the formulas in docs/model.md.
* ``save_hf_checkpoint`` / ``load_reference``: transformers' own save and load.
* ``reference_logprobs`` / ``reference_greedy``: what a test compares against.

transformers caveats that shape this harness (docs/model.md, "The transformers oracle and its caveats"): use at
least 16 indexer heads (fewer gives top-k ties), never left-pad, and compare in
fp32 only.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

__all__ = [
    "build_reference_model",
    "check_fully_randomised",
    "dequantize_fp4",
    "dequantize_fp8_block",
    "dequantize_native_tensors",
    "dequantized_native_state",
    "hf_state_from_native",
    "load_reference",
    "model_from_native_state",
    "native_config",
    "native_state_dict",
    "quantize_fp4",
    "quantize_fp8_block",
    "quantize_native_tensors",
    "random_mtp_tensors",
    "read_safetensors_dir",
    "reference_greedy",
    "reference_logprobs",
    "save_hf_checkpoint",
    "small_config",
    "tiny_config",
    "write_native_checkpoint",
]

# --------------------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------------------

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"

_TINY_CONFIG = {
    "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.5,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 1.0,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": [HASH_MOE, HASH_MOE, MOE, MOE],
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 32, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                        "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.02,
}

_SMALL_CONFIG = {
    "vocab_size": 16384, "hidden_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 64, "partial_rotary_factor": 0.25,
    "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 128,
    "n_routed_experts": 16, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "layer_types": [SLIDING, SLIDING, CSA, HCA, CSA, HCA, CSA, HCA],
    "mlp_layer_types": [HASH_MOE, HASH_MOE, HASH_MOE, MOE, MOE, MOE, MOE, MOE],
    "compress_rates": {CSA: 4, HCA: 128},
    "sliding_window": 128, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                        "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 65536, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.02,
}


def tiny_config(**overrides) -> dict:
    """The tiny HF config (462,541 parameters, 16 indexer heads), with ``overrides`` merged in.

    The merge is shallow: overriding ``num_hidden_layers`` also needs ``layer_types`` and ``mlp_layer_types``
    of the new length. Every call returns a fresh deep copy (transformers mutates nested dicts it is given).
    """
    config = copy.deepcopy(_TINY_CONFIG)
    config.update(copy.deepcopy(overrides))
    return config


def small_config(**overrides) -> dict:
    """The ~77M-parameter small HF config, for benchmarks.

    It has only 8 indexer heads, as in the first benchmark measurements: fine for timing, too few for tie-free
    correctness comparisons (docs/model.md, the oracle's caveats); override ``index_n_heads=16`` for those.
    """
    config = copy.deepcopy(_SMALL_CONFIG)
    config.update(copy.deepcopy(overrides))
    return config


def _hf_config(config: dict) -> DeepseekV4Config:
    """A ``DeepseekV4Config`` with eager attention, built from a deep copy (the constructor mutates rope dicts)."""
    return DeepseekV4Config(**copy.deepcopy(config), attn_implementation="eager")


# --------------------------------------------------------------------------------------------------------------------
# Randomisation recipe (docs/model.md, "Test models and the randomisation recipe")
# --------------------------------------------------------------------------------------------------------------------

NORM_WEIGHT_JITTER = 0.1  # norm weights: 1 + 0.1·N(0,1)
APE_STD = 0.5  # compressor/indexer ape (position_bias): 0.5·N(0,1)
HC_BASE_STD = 0.5  # mHC base: 0.5·N(0,1)
HC_SCALE_RANGE = (0.5, 1.5)  # mHC scale: U(0.5, 1.5)
CORRECTION_BIAS_STD = 0.1  # e_score_correction_bias: 0.1·N(0,1)
SINK_STD = 1.0  # attention sinks: N(0,1)

# Init kinds, applied by name. Linear-like weights (every projection, the embedding, the head, the expert stacks
# and the mHC `fn` matrices) get N(0,1)/sqrt(fan_in), where fan_in is always the LAST dimension (the input width of
# a [out, in] linear, of an [E, out, in] expert stack, and D for the [V, D] embedding).
LINEAR, NORM, SINK, APE, HC_BASE, HC_SCALE, CORRECTION_BIAS, HASH_TABLE = (
    "linear", "norm", "sink", "ape", "hc_base", "hc_scale", "correction_bias", "hash_table",
)

# Ordered (regex on the HF state_dict name, init kind); the FIRST matching rule wins. Every parameter and persistent
# buffer must match one rule (check_fully_randomised enforces it).
_HF_INIT_RULES: tuple[tuple[str, str], ...] = (
    (r"\.mlp\.gate\.tid2eid$", HASH_TABLE),
    (r"\.mlp\.gate\.e_score_correction_bias$", CORRECTION_BIAS),
    (r"\.self_attn\.sinks$", SINK),
    (r"\.position_bias$", APE),
    (r"(\.(attn|ffn)_hc\.base|\.hc_head\.hc_base)$", HC_BASE),
    (r"(\.(attn|ffn)_hc\.scale|\.hc_head\.hc_scale)$", HC_SCALE),
    (r"(\.(attn|ffn)_hc\.fn|\.hc_head\.hc_fn)$", LINEAR),
    (r"norm\.weight$", NORM),  # input/post_attention_layernorm, q_a_norm, kv_norm (all), model.norm
    (r"(\.weight|\.experts\.gate_up_proj|\.experts\.down_proj)$", LINEAR),
)


def _init_kind(hf_name: str) -> str:
    for pattern, kind in _HF_INIT_RULES:
        if re.search(pattern, hf_name):
            return kind
    raise KeyError(f"no randomisation rule for tensor {hf_name!r}")


def _random_tensor(kind: str, shape, generator: torch.Generator, n_experts: int | None = None) -> torch.Tensor:
    """One tensor drawn by the randomisation recipe (fp32, or int64 for the hash table)."""
    if kind == HASH_TABLE:
        # k distinct experts per token row: the prefix of a random permutation of the E experts.
        vocab, top_k = shape
        keys = torch.rand(vocab, n_experts, generator=generator)
        return keys.argsort(dim=-1)[:, :top_k].contiguous().to(torch.int64)
    normal = torch.randn(shape, generator=generator, dtype=torch.float32)
    if kind == LINEAR:
        return normal / math.sqrt(shape[-1])
    if kind == NORM:
        return 1.0 + NORM_WEIGHT_JITTER * normal
    if kind == SINK:
        return SINK_STD * normal
    if kind == APE:
        return APE_STD * normal
    if kind == HC_BASE:
        return HC_BASE_STD * normal
    if kind == CORRECTION_BIAS:
        return CORRECTION_BIAS_STD * normal
    if kind == HC_SCALE:
        low, high = HC_SCALE_RANGE
        return low + (high - low) * torch.rand(shape, generator=generator, dtype=torch.float32)
    raise ValueError(f"unknown init kind {kind!r}")


def check_fully_randomised(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    """Raise if any tensor of ``after`` is missing a randomisation rule or still equals its default-init value.

    ``before`` is a snapshot of the state_dict (parameters + persistent buffers) taken right after construction.
    """
    if before.keys() != after.keys():
        raise RuntimeError(f"state_dict keys changed: {sorted(before.keys() ^ after.keys())}")
    for name in after:
        _init_kind(name)  # raises KeyError for a tensor no rule covers
    untouched = [name for name in after if torch.equal(before[name], after[name])]
    if untouched:
        raise RuntimeError(f"{len(untouched)} tensors left at default init: {untouched[:10]}")


@torch.no_grad()
def build_reference_model(config: dict, seed: int) -> DeepseekV4ForCausalLM:
    """A transformers ``DeepseekV4ForCausalLM`` in fp32 eval mode, eager attention, every tensor randomised.

    Every parameter and persistent buffer (``tid2eid``, ``e_score_correction_bias``) is drawn by the recipe above
    from one ``torch.Generator`` seeded with ``seed``, in state_dict order, so the same (config, seed) always gives
    the same weights. Non-persistent buffers (the RoPE inverse frequencies) are derived from the config and left
    alone. Raises if any tensor is left at its default init.
    """
    hf_config = _hf_config(config)
    model = DeepseekV4ForCausalLM(hf_config).to(torch.float32).eval()
    state = model.state_dict()
    before = {name: tensor.clone() for name, tensor in state.items()}
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        value = _random_tensor(_init_kind(name), tuple(tensor.shape), generator, hf_config.n_routed_experts)
        tensor.copy_(value)  # state_dict tensors alias the live parameters and buffers
    check_fully_randomised(before, model.state_dict())
    return model


# --------------------------------------------------------------------------------------------------------------------
# HF <-> native names (docs/model.md, "Native names", "HF names")
# --------------------------------------------------------------------------------------------------------------------

# Top-level tensors: full HF name -> full native name.
_HF_TO_NATIVE_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}

# Per-layer tensors: HF suffix under `model.layers.{i}.` -> native suffix under `layers.{i}.`.
_HF_TO_NATIVE_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    # attention
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    # compressor (CSA and HCA layers)
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    # lightning indexer (CSA layers)
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    # MoE router and shared expert
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}

# Packed routed experts: HF suffix -> native per-expert templates, one per row block of the [E, rows, in] stack.
# gate_up_proj [E, 2I, D] holds the gate (w1) rows first, then the up (w3) rows; down_proj [E, D, I] is w2.
_HF_TO_NATIVE_EXPERTS = {
    "mlp.experts.gate_up_proj": ("ffn.experts.{e}.w1.weight", "ffn.experts.{e}.w3.weight"),
    "mlp.experts.down_proj": ("ffn.experts.{e}.w2.weight",),
}

_HF_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_NATIVE_INT_DTYPE = torch.int32  # tid2eid is int32 on disk, int64 in transformers


def _native_names(hf_name: str, n_experts: int) -> list[str]:
    """The native names one HF tensor becomes (several for a packed expert stack), from the tables above."""
    if hf_name in _HF_TO_NATIVE_TOP:
        return [_HF_TO_NATIVE_TOP[hf_name]]
    match = _HF_LAYER_NAME.match(hf_name)
    if match is None:
        raise KeyError(f"HF tensor {hf_name!r} has no native name")
    layer, suffix = match.groups()
    if suffix in _HF_TO_NATIVE_LAYER:
        return [f"layers.{layer}.{_HF_TO_NATIVE_LAYER[suffix]}"]
    if suffix in _HF_TO_NATIVE_EXPERTS:
        templates = _HF_TO_NATIVE_EXPERTS[suffix]
        return [f"layers.{layer}.{t.format(e=e)}" for e in range(n_experts) for t in templates]
    raise KeyError(f"HF tensor {hf_name!r} has no native name")


@torch.no_grad()
def native_state_dict(model: DeepseekV4ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under native DeepSeek release names (no ``model.`` prefix), fp32 / int32, fresh copies.

    Routed experts are split per expert (``gate_up_proj`` rows [0, I) -> ``w1``, [I, 2I) -> ``w3``;
    ``down_proj`` -> ``w2``); ``tid2eid`` becomes int32. Asserts that every HF tensor is mapped exactly once and that
    no two HF tensors map to the same native name. The tiny config gives 210 tensors.
    """
    n_experts = model.config.n_routed_experts
    native: dict[str, torch.Tensor] = {}
    for hf_name, tensor in model.state_dict().items():
        names = _native_names(hf_name, n_experts)
        if hf_name.endswith(tuple(_HF_TO_NATIVE_EXPERTS)):
            per_expert = len(names) // n_experts
            pieces = [block for expert in tensor for block in expert.chunk(per_expert, dim=0)]
        else:
            pieces = [tensor]
        assert len(pieces) == len(names), hf_name
        for name, piece in zip(names, pieces):
            assert name not in native, f"two HF tensors map to native {name!r}"
            is_int = not piece.is_floating_point()
            native[name] = piece.to(_NATIVE_INT_DTYPE if is_int else torch.float32).contiguous().clone()
    expected = sum(len(_native_names(n, n_experts)) for n in model.state_dict())
    assert len(native) == expected, "an HF tensor was mapped more or less than once"
    return native


def hf_state_from_native(native: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Invert ``native_state_dict``: HF state_dict names, expert stacks rebuilt, ``tid2eid`` as int64.

    ``mtp.*`` tensors are ignored (transformers has no MTP module). Raises on any other native tensor the table does
    not account for, and on a missing one.
    """
    hf_config = _hf_config(config)
    n_experts = hf_config.n_routed_experts
    hf_names = _hf_state_names(config)
    used: set[str] = set()
    hf: dict[str, torch.Tensor] = {}
    for hf_name in hf_names:
        names = _native_names(hf_name, n_experts)
        used.update(names)
        if hf_name.endswith(tuple(_HF_TO_NATIVE_EXPERTS)):
            per_expert = len(names) // n_experts
            experts = [
                torch.cat([native[names[e * per_expert + j]] for j in range(per_expert)], dim=0)
                for e in range(n_experts)
            ]
            hf[hf_name] = torch.stack(experts).to(torch.float32)
        else:
            tensor = native[names[0]]
            hf[hf_name] = tensor.to(torch.int64) if not tensor.is_floating_point() else tensor.to(torch.float32)
    extra = sorted(n for n in native if n not in used and not n.startswith("mtp."))
    if extra:
        raise KeyError(f"native tensors with no HF counterpart: {extra[:10]}")
    return hf


_HF_NAME_CACHE: dict[str, list[str]] = {}


def _hf_state_names(config: dict) -> list[str]:
    """The HF state_dict names of a model with this config (built once per config on the meta device)."""
    key = json.dumps(config, sort_keys=True)
    if key not in _HF_NAME_CACHE:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(_hf_config(config))
        _HF_NAME_CACHE[key] = list(model.state_dict())
    return _HF_NAME_CACHE[key]


@torch.no_grad()
def model_from_native_state(config: dict, native: dict[str, torch.Tensor]) -> DeepseekV4ForCausalLM:
    """A fp32 eval-mode transformers model holding exactly the given native tensors (``mtp.*`` ignored)."""
    model = DeepseekV4ForCausalLM(_hf_config(config)).to(torch.float32).eval()
    model.load_state_dict(hf_state_from_native(native, config), strict=True)
    return model


# --------------------------------------------------------------------------------------------------------------------
# MTP drafter tensors (docs/model.md)
# --------------------------------------------------------------------------------------------------------------------

# Tensors of an MTP layer outside its decoder block: native suffix -> init kind. Shapes: norms [D], projections [D, D].
_MTP_EXTRA_KINDS = {
    "enorm.weight": NORM,
    "hnorm.weight": NORM,
    "e_proj.weight": LINEAR,
    "h_proj.weight": LINEAR,
}


def random_mtp_tensors(config: dict, seed: int, n_layers: int = 1) -> dict[str, torch.Tensor]:
    """Native ``mtp.{i}.*`` tensors for ``n_layers`` MTP drafter layers of a target with ``config``.

    Each layer has ``enorm``/``hnorm`` [D], ``e_proj``/``h_proj`` [D, D], its own ``hc_head_{fn,base,scale}`` and
    ``norm.weight`` [D], plus one full decoder block with sliding-window attention only (no compressor, no indexer)
    and a routed ``moe`` FFN (``gate.weight`` + ``gate.bias``, no ``tid2eid``), with the target's layer shapes.
    The block, hc_head and norm come from a randomised one-layer model of the same widths (the same recipe);
    embed/head are the target's and are not included.
    """
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        block_config = dict(config, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=[MOE])
        block_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        block = native_state_dict(build_reference_model(block_config, block_seed))
        for name, tensor in block.items():
            if name.startswith("layers.0."):
                tensors[f"mtp.{i}.{name.removeprefix('layers.0.')}"] = tensor
            elif name.startswith("hc_head_") or name == "norm.weight":
                tensors[f"mtp.{i}.{name}"] = tensor
        for suffix, kind in _MTP_EXTRA_KINDS.items():
            shape = (hidden,) if kind == NORM else (hidden, hidden)
            tensors[f"mtp.{i}.{suffix}"] = _random_tensor(kind, shape, generator)
    return tensors


# --------------------------------------------------------------------------------------------------------------------
# Independent FP8 / FP4 quantizer (docs/model.md)
# --------------------------------------------------------------------------------------------------------------------

FP8_BLOCK = 128  # FP8 weights: one scale per 128 x 128 block (ceil grid at the edges)
FP4_BLOCK = 32  # FP4 experts: one scale per 32 consecutive inputs of a row
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest FP4 e2m1 magnitude
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the negative
E2M1_SIGN_BIT = 8
NIBBLE_BITS = 4
NIBBLE_MASK = 0xF
E8M0_BIAS = 127  # ue8m0 byte b encodes 2^(b - 127)
MIN_SCALE_EXPONENT = -126  # scales are floored at 2^-126 (byte 1), so an all-zero block still has a valid scale
MIN_FLOAT_SCALE = 2.0**MIN_SCALE_EXPONENT
UE8M0, FLOAT = "ue8m0", "float"


def _ceil_pow2_exponent(x: torch.Tensor) -> torch.Tensor:
    """Integer e with 2^e = the smallest power of two >= max(x, 2^-126), computed exactly via frexp."""
    mantissa, exponent = torch.frexp(x.to(torch.float32).clamp(min=MIN_FLOAT_SCALE))
    # x = m·2^e with m in [0.5, 1): ceil(log2 x) = e, except e - 1 when x is an exact power of two (m == 0.5).
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.int32))


def _encode_e8m0(exponent: torch.Tensor, storage: str) -> torch.Tensor:
    """ue8m0 bytes (exponent + 127) as ``float8_e8m0fnu`` (storage "e8m0") or raw ``uint8`` (storage "uint8")."""
    raw = (exponent + E8M0_BIAS).to(torch.uint8)
    if storage == "e8m0":
        return raw.view(torch.float8_e8m0fnu)
    if storage == "uint8":
        return raw
    raise ValueError(f"scale_storage must be 'e8m0' or 'uint8', got {storage!r}")


def _decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 multipliers from a stored scale: e8m0/uint8 bytes are raw exponent bits (never a numeric cast)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return _pow2(scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS)
    return scale.to(torch.float32)


def quantize_fp8_block(weight: torch.Tensor, scale_fmt: str = UE8M0, scale_storage: str = "e8m0"):
    """Block FP8: ``(q float8_e4m3fn [out, in], scale [ceil(out/128), ceil(in/128)])``,
    with W ≈ q · S[i // 128, j // 128].

    ue8m0: per block ``s = 2^ceil(log2(max(amax/448, 2^-126)))``, stored as e8m0 or uint8 bytes.
    float: per block ``s = max(amax/448, 2^-126)`` as fp32. Then ``q = e4m3(clamp(w/s, ±448))`` (round to nearest).
    """
    rows, cols = weight.shape
    grid_rows, grid_cols = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = torch.zeros(grid_rows * FP8_BLOCK, grid_cols * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(grid_rows, FP8_BLOCK, grid_cols, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    if scale_fmt == UE8M0:
        exponent = _ceil_pow2_exponent(amax / E4M3_MAX)
        scale_value, stored_scale = _pow2(exponent), _encode_e8m0(exponent, scale_storage)
    elif scale_fmt == FLOAT:
        scale_value = (amax / E4M3_MAX).clamp(min=MIN_FLOAT_SCALE)
        stored_scale = scale_value.clone()
    else:
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'float', got {scale_fmt!r}")
    scaled = (blocks / scale_value[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = scaled.reshape(grid_rows * FP8_BLOCK, grid_cols * FP8_BLOCK)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), stored_scale.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``W[i, j] = q[i, j] · S[i // 128, j // 128]`` (128 x 128 blocks, ceil grid)."""
    rows, cols = q.shape
    multipliers = _decode_scale(scale)
    expanded = multipliers.repeat_interleave(FP8_BLOCK, dim=0).repeat_interleave(FP8_BLOCK, dim=1)
    return q.to(torch.float32) * expanded[:rows, :cols]


def quantize_fp4(weight: torch.Tensor, scale_storage: str = "e8m0"):
    """MXFP4-style e2m1: ``(packed int8 [out, in/2], ue8m0 scale [out, in/32])``.

    Per 32-block ``s = 2^ceil(log2(max(amax/6, 2^-126)))``; each code is the nearest e2m1 value of w/s (ties go to
    the smaller magnitude; a zero magnitude is stored with a clear sign bit). Byte j of a row holds input 2j in its
    low nibble and input 2j+1 in its high nibble.
    """
    rows, cols = weight.shape
    if cols % FP4_BLOCK:
        raise ValueError(f"FP4 needs the input width to be a multiple of {FP4_BLOCK}, got {cols}")
    blocks = weight.to(torch.float32).reshape(rows, cols // FP4_BLOCK, FP4_BLOCK)
    exponent = _ceil_pow2_exponent(blocks.abs().amax(dim=-1) / E2M1_MAX)
    scaled = blocks / _pow2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # first (smaller) magnitude on a tie
    negative = (scaled < 0) & (index > 0)
    codes = (index | torch.where(negative, E2M1_SIGN_BIT, 0)).reshape(rows, cols).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << NIBBLE_BITS)
    return packed.view(torch.int8).contiguous(), _encode_e8m0(exponent, scale_storage).contiguous()


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``W[i, 2j] = E2M1[low nibble] · s[i, 2j // 32]`` and
    ``W[i, 2j+1] = E2M1[high nibble] · s[i, (2j+1) // 32]``."""
    raw = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([raw & NIBBLE_MASK, raw >> NIBBLE_BITS], dim=-1).reshape(raw.shape[0], -1)
    values = torch.tensor(E2M1_MAGNITUDES)[codes & (E2M1_SIGN_BIT - 1)]
    values = torch.where(codes & E2M1_SIGN_BIT > 0, -values, values)
    return values * _decode_scale(scale).repeat_interleave(FP4_BLOCK, dim=1)


# --------------------------------------------------------------------------------------------------------------------
# Native checkpoints (docs/model.md)
# --------------------------------------------------------------------------------------------------------------------

# Dense linears stored as block FP8 when dense="fp8" (main model and MTP layers).
_FP8_LINEAR = re.compile(
    r"^(layers|mtp)\.\d+\."
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$"
)
_ROUTED_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
# Tensors DeepSeek ships in fp32 whatever the checkpoint dtype: mHC, sinks, correction bias.
_ALWAYS_FP32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|\.attn_sink|\.gate\.bias)$")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SCALE_SUFFIX = ".scale"  # native names: `<linear>.weight` + `<linear>.scale`

# Native attention codes of `compress_ratios` (transformers accepts only these; real small rates go in
# compress_rate_csa / compress_rate_hca).
_COMPRESS_RATIO_CODE = {SLIDING: 0, CSA: 4, HCA: 128}
_HF_ONLY_CONFIG_KEYS = ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters")


def native_config(config: dict, quantization: dict | None = None, expert_dtype_top_level: bool = False) -> dict:
    """The HF config dict rewritten in DeepSeek native spelling (docs/model.md).

    * ``layer_types`` -> ``compress_ratios`` (0 sliding / 4 CSA / 128 HCA), with ``num_nextn_predict_layers``
      trailing 0 entries for the MTP layers (their attention is sliding-only; transformers truncates the list to L),
      plus ``compress_rate_csa`` / ``compress_rate_hca`` carrying the real rates.
    * ``mlp_layer_types`` -> ``num_hash_layers`` (the hash layers must be a prefix).
    * ``partial_rotary_factor`` -> ``qk_rope_head_dim`` = head_dim · factor.
    * flat YaRN ``rope_parameters`` -> V3-style ``rope_scaling`` {type: yarn, factor, original_max_position_embeddings,
      beta_fast, beta_slow}; ``rope_theta`` / ``compress_rope_theta`` stay top-level.
    * ``quantization``, when given, becomes ``quantization_config``; with ``expert_dtype_top_level`` its
      ``expert_dtype`` moves to a top-level key (the V4 spelling; V4.1 ships it inside).
    """
    native = {k: copy.deepcopy(v) for k, v in config.items() if k not in _HF_ONLY_CONFIG_KEYS}
    n_layers = config["num_hidden_layers"]
    layer_types = config["layer_types"]
    mlp_layer_types = config["mlp_layer_types"]
    rates = config.get("compress_rates", {})
    n_hash = sum(1 for t in mlp_layer_types if t == HASH_MOE)
    if len(layer_types) != n_layers or mlp_layer_types != [HASH_MOE] * n_hash + [MOE] * (n_layers - n_hash):
        raise ValueError("native configs need len(layer_types) == L and the hash_moe layers as a prefix")
    n_mtp = config.get("num_nextn_predict_layers", 0)
    native["compress_ratios"] = [_COMPRESS_RATIO_CODE[t] for t in layer_types] + [0] * n_mtp
    native["compress_rate_csa"] = rates.get(CSA, 4)
    native["compress_rate_hca"] = rates.get(HCA, 128)
    native["num_hash_layers"] = n_hash
    native["qk_rope_head_dim"] = round(config["head_dim"] * config["partial_rotary_factor"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("compress", rope)
    if rope.get("rope_type", rope.get("type", "default")) == "yarn":
        native["rope_scaling"] = {
            "type": "yarn",
            **{k: rope[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")},
        }
    native["model_type"] = "deepseek_v4"
    native["architectures"] = ["DeepseekV4ForCausalLM"]
    if quantization is not None:
        quantization = dict(quantization)
        if expert_dtype_top_level:
            native["expert_dtype"] = quantization.pop("expert_dtype")
        native["quantization_config"] = quantization
    return native


def _check_format(dense: str, expert_dtype: str | None, scale_fmt: str | None) -> str | None:
    """Validate a checkpoint format and resolve the default scale_fmt (fp4 experts -> ue8m0, fp8 -> float)."""
    if dense not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"dense must be 'fp32', 'bf16' or 'fp8', got {dense!r}")
    if dense == "fp8":
        if expert_dtype not in ("fp4", "fp8"):
            raise ValueError("dense='fp8' needs expert_dtype 'fp4' or 'fp8' (transformers quantizes the experts too)")
        scale_fmt = scale_fmt or (UE8M0 if expert_dtype == "fp4" else FLOAT)
        if scale_fmt not in (UE8M0, FLOAT):
            raise ValueError(f"scale_fmt must be 'ue8m0' or 'float', got {scale_fmt!r}")
        if expert_dtype == "fp4" and scale_fmt != UE8M0:
            raise ValueError("FP4 experts always carry ue8m0 scales; use scale_fmt='ue8m0'")
        return scale_fmt
    if expert_dtype is not None:
        raise ValueError("expert_dtype needs dense='fp8'")
    return None


def quantize_native_tensors(
    tensors: dict[str, torch.Tensor],
    dense: str = "fp32",
    expert_dtype: str | None = None,
    scale_fmt: str | None = None,
    scale_storage: str = "e8m0",
    plain_dtype: str | None = None,
) -> dict[str, torch.Tensor]:
    """The exact tensors a native checkpoint stores for fp32 native ``tensors`` (see ``write_native_checkpoint``)."""
    scale_fmt = _check_format(dense, expert_dtype, scale_fmt)
    # Unquantized float tensors (embed, head, norms, routers, compressors, ape, ...): fp32 for an fp32 checkpoint,
    # else bf16 as the releases ship them, unless plain_dtype says otherwise.
    plain = _DTYPES[plain_dtype or ("fp32" if dense == "fp32" else "bf16")]
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            stored[name] = tensor.to(_NATIVE_INT_DTYPE)
            continue
        quantized = None
        if dense == "fp8" and _FP8_LINEAR.match(name):
            quantized = quantize_fp8_block(tensor, scale_fmt, scale_storage)
        elif dense == "fp8" and _ROUTED_EXPERT.match(name):
            if expert_dtype == "fp4":
                quantized = quantize_fp4(tensor, scale_storage)
            else:
                quantized = quantize_fp8_block(tensor, scale_fmt, scale_storage)
        if quantized is not None:
            stored[name], stored[name.removesuffix(".weight") + _SCALE_SUFFIX] = quantized
        elif _ALWAYS_FP32.search(name):
            stored[name] = tensor.to(torch.float32).contiguous()
        elif _FP8_LINEAR.match(name) or _ROUTED_EXPERT.match(name):
            stored[name] = tensor.to(_DTYPES[dense]).contiguous()  # dense is fp32 or bf16 here
        else:
            stored[name] = tensor.to(plain).contiguous()
    return stored


def dequantize_native_tensors(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 values of stored native tensors: int8 + ``.scale`` is FP4, e4m3 + ``.scale`` is block FP8, floats are
    upcast, integer tables (tid2eid) are kept as they are. The ``.scale`` tensors are consumed."""
    values: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        if name.endswith(_SCALE_SUFFIX) and name.removesuffix(_SCALE_SUFFIX) + ".weight" in stored:
            continue
        scale_name = name.removesuffix(".weight") + _SCALE_SUFFIX
        if tensor.dtype == torch.int8 and scale_name in stored:
            values[name] = dequantize_fp4(tensor, stored[scale_name])
        elif tensor.dtype == torch.float8_e4m3fn:
            values[name] = dequantize_fp8_block(tensor, stored[scale_name])
        elif tensor.is_floating_point():
            values[name] = tensor.to(torch.float32)
        else:
            values[name] = tensor.clone()
    return values


def dequantized_native_state(tensors: dict[str, torch.Tensor], **format_kwargs) -> dict[str, torch.Tensor]:
    """The fp32 values a native checkpoint written with ``format_kwargs`` represents (same keywords as
    ``write_native_checkpoint``'s format options: dense, expert_dtype, scale_fmt, scale_storage, plain_dtype)."""
    return dequantize_native_tensors(quantize_native_tensors(tensors, **format_kwargs))


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], shards: int, single_name: str) -> None:
    """One file, or ``shards`` files of contiguous runs of the sorted names plus ``model.safetensors.index.json``."""
    names = sorted(tensors)
    if shards <= 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / single_name), metadata={"format": "pt"})
        return
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for index in range(shards):
        file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[index * per_shard:(index + 1) * per_shard]
        save_file({n: tensors[n].contiguous() for n in chunk}, str(path / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in chunk})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def write_native_checkpoint(
    path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    dense: str = "fp32",
    expert_dtype: str | None = None,
    scale_fmt: str | None = None,
    scale_storage: str = "e8m0",
    shards: int = 1,
    plain_dtype: str | None = None,
    expert_dtype_top_level: bool = False,
) -> dict[str, torch.Tensor]:
    """Write a native DeepSeek checkpoint directory (``config.json`` + safetensors) and return the stored tensors.

    ``tensors``: fp32 native tensors (``native_state_dict`` plus optionally ``random_mtp_tensors``); ``config``: the
    HF config dict, written in native spelling by ``native_config``.

    Formats:
      * ``dense="fp32"``: everything fp32 (``tid2eid`` int32), no quantization_config.
      * ``dense="bf16"``: everything bf16 except mHC (``hc_*``), ``attn_sink`` and ``gate.bias``, kept fp32.
      * ``dense="fp8"``: the FP8 linears (attn wq_a/wq_b/wkv/wo_a/wo_b, indexer wq_b, shared-expert w1/w2/w3, MTP
        e_proj/h_proj and the MTP block's same linears) as e4m3 + ``.scale`` [ceil(out/128), ceil(in/128)];
        routed experts as FP4 (``expert_dtype="fp4"``: int8 [out, in/2] + ue8m0 [out, in/32]) or block FP8
        (``"fp8"``); other float tensors in ``plain_dtype`` (default bf16, as the releases ship) except the fp32 set
        above. ``scale_fmt`` "ue8m0" (power-of-two scales, default for fp4) or "float" (fp32 scales, default for fp8
        experts); ue8m0 bytes are stored as ``float8_e8m0fnu`` (``scale_storage="e8m0"``) or ``uint8``.
        ``quantization_config`` = {quant_method: fp8, activation_scheme: dynamic, weight_block_size: [128, 128],
        scale_fmt, expert_dtype}.
    ``shards`` > 1 splits the sorted tensor names into that many files with a ``model.safetensors.index.json``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    stored = quantize_native_tensors(tensors, dense, expert_dtype, scale_fmt, scale_storage, plain_dtype)
    quantization = None
    if dense == "fp8":
        quantization = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "scale_fmt": _check_format(dense, expert_dtype, scale_fmt),
            "expert_dtype": expert_dtype,
        }
    native = native_config(config, quantization, expert_dtype_top_level)
    (path / "config.json").write_text(json.dumps(native, indent=2))
    _write_safetensors(path, stored, shards, "model.safetensors")
    return stored


def read_safetensors_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (single file or index + shards), under its stored name."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"
    ]
    tensors: dict[str, torch.Tensor] = {}
    for file_name in files:
        tensors.update(load_file(str(path / file_name)))
    return tensors


# --------------------------------------------------------------------------------------------------------------------
# transformers save / load
# --------------------------------------------------------------------------------------------------------------------


def save_hf_checkpoint(model: DeepseekV4ForCausalLM, path, max_shard_size=None) -> None:
    """``model.save_pretrained(path)``: one ``model.safetensors``, or shards + ``model.safetensors.index.json`` when
    ``max_shard_size`` (e.g. ``"200KB"``) is given.

    transformers 5.23 applies the native->HF conversion only partly in reverse (docs/model.md), so the file
    holds a THIRD dialect, neither HF nor native (210 tensors for the tiny config, like native):
      * top-level tensors keep their HF spelling with the ``model.`` prefix (the native rules are anchored at the start
        of the name): ``model.embed_tokens.weight``, ``model.norm.weight``, ``model.hc_head.hc_fn`` /
        ``hc_base`` / ``hc_scale``; but the head becomes ``head.weight`` (no prefix);
      * layer tensors get native suffixes under ``model.layers.N.``: ``model.layers.N.attn.wq_a.weight``,
        ``.attn.attn_sink``, ``.attn_norm.weight``, ``.hc_attn_fn``, ``.attn.compressor.ape``,
        ``.attn.indexer.compressor.wkv.weight``, ``.attn.indexer.weights_proj.weight``, ``.ffn.gate.bias``,
        per-expert ``.ffn.experts.E.w1.weight`` / ``w2`` / ``w3``, ``.ffn.shared_experts.w1.weight``;
      * EXCEPT the main attention kv norm, written ``model.layers.N.attn.norm.weight`` (native: ``attn.kv_norm``),
        because the reversed ``.norm.`` -> ``.kv_norm.`` rule hits it;
      * ``tid2eid`` stays int64.
    transformers itself reads these files back exactly.
    """
    model.save_pretrained(str(path), **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))


def load_reference(path) -> DeepseekV4ForCausalLM:
    """``DeepseekV4ForCausalLM.from_pretrained(path)`` in fp32 eval mode with eager attention.

    Works for a ``save_hf_checkpoint`` directory and for a native directory (transformers renames native names and,
    on CPU, dequantizes FP8 / FP4 weights at load; this needs ``accelerate``). Raises if any key is missing or
    mismatched, if an unexpected key is not ``mtp.*``, or if a quantized tensor or scale survived the load. The
    returned model is all fp32 (``tid2eid`` int64).
    """
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    problems = {
        "missing": sorted(info.get("missing_keys", [])),
        "unexpected": sorted(k for k in info.get("unexpected_keys", []) if not re.match(r"^(model\.)?mtp\.", k)),
        "mismatched": sorted(map(str, info.get("mismatched_keys", []))),
        "errors": list(info.get("error_msgs", [])),
    }
    state = model.state_dict()
    problems["still quantized"] = [
        n for n, t in state.items() if n.endswith("scale_inv") or t.dtype in _QUANTIZED_DTYPES
    ]
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise RuntimeError(f"loading {path} was not clean: {problems}")
    # Quirk (transformers 5.23, CPU): when a checkpoint has an FP8 quantization_config, the dequantized weights come
    # out fp32 but every UNquantized tensor keeps its on-disk dtype (bf16 norms/embeddings, even the fp32-strict
    # modules, and int32 tid2eid). Upcast them; bf16 -> fp32 and int32 -> int64 are exact.
    model.to(torch.float32)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if table is not None and table.dtype != torch.int64:
            module.tid2eid = table.to(torch.int64)
    return model.eval()


_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)


# --------------------------------------------------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def reference_logprobs(model: DeepseekV4ForCausalLM, ids: list[int]) -> torch.Tensor:
    """fp32 ``log_softmax`` of the no-cache forward over one unpadded sequence: [len(ids), vocab]."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long)
    logits = model(input_ids=input_ids, use_cache=False).logits[0]
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


@torch.no_grad()
def reference_greedy(model: DeepseekV4ForCausalLM, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy ``generate`` with the KV cache over one unpadded sequence; returns exactly ``max_new_tokens`` new tokens.

    Ignore-eos semantics: eos is neither a stopping token nor suppressed (it can be generated, and generation goes
    on). Quirk: passing ``eos_token_id=None`` to ``generate`` does not work in transformers 5.23, because ``None``
    fields are refilled from ``model.generation_config``; so the model's own eos is cleared for the call and restored.
    """
    input_ids = torch.tensor([list(ids)], dtype=torch.long)
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            use_cache=True,
        )
    finally:
        model.generation_config.eos_token_id = saved_eos
    new_tokens = output[0, input_ids.shape[1]:].tolist()
    if len(new_tokens) != max_new_tokens:
        raise RuntimeError(f"generate returned {len(new_tokens)} tokens, expected {max_new_tokens}")
    return new_tokens
