"""Config parsing (docs/model.md, "Config"): transformers' DeepseekV4Config form and DeepSeek's native spellings must
give the same ModelConfig; precedence layer_types > compress_ratios; lists truncated to num_hidden_layers.

Every form is compared against one expected ModelConfig whose values are written out here, so two forms cannot
agree on a wrong value unnoticed.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import transformers

import reference as ref
from dsv4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig, QuantConfig, RopeConfig
from dsv4.errors import ConfigError

TINY = ref.tiny_config()

EXPECTED = {
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "swiglu_limit": 1.0,
    "sliding_window": 32, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "layer_types": (SLIDING, CSA, HCA, CSA),
    "mlp_layer_types": (HASH_MOE, HASH_MOE, MOE, MOE),
    "compress_rate_csa": 4, "compress_rate_hca": 16,
    "rope_main": RopeConfig(theta=10000.0, rotary_dim=16),
    "rope_compress": RopeConfig(theta=160000.0, rotary_dim=16, yarn_factor=4.0, yarn_original_max_position=256,
                                yarn_beta_fast=32.0, yarn_beta_slow=1.0),
    "max_position_embeddings": 1024, "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_ids": (1,),
    "quant": None, "dspark": None,
}


def _parse(raw: dict) -> ModelConfig:
    cfg = ModelConfig.from_dict(copy.deepcopy(raw), source="test-config.json")
    return dataclasses.replace(cfg, torch_dtype=None)  # the saved dtype is not part of the model's shape


def _assert_expected(cfg: ModelConfig, **changes) -> None:
    expected = dict(EXPECTED, **changes)
    got = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in expected}
    assert got == expected


def _native(**changes) -> dict:
    raw = ref.native_config(TINY)
    raw.update(changes)
    return raw


# ---------------------------------------------------------------------------------------------------------------------
# The HF form
# ---------------------------------------------------------------------------------------------------------------------


def test_hf_dict_as_written_by_tests():
    _assert_expected(_parse(TINY))


def test_hf_config_to_dict():
    """transformers normalises rope_parameters to {main, compress} and adds its own extra keys."""
    raw = transformers.DeepseekV4Config(**copy.deepcopy(TINY)).to_dict()
    assert set(raw["rope_parameters"]) == {"main", "compress"}
    _assert_expected(_parse(raw))


def test_hf_saved_config_json(tmp_path):
    transformers.DeepseekV4Config(**copy.deepcopy(TINY)).save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_file(tmp_path)
    assert cfg.source.endswith("config.json")
    _assert_expected(cfg)


# ---------------------------------------------------------------------------------------------------------------------
# Native spellings, one at a time and all together
# ---------------------------------------------------------------------------------------------------------------------


def test_native_config_all_spellings():
    raw = ref.native_config(TINY)
    for hf_only in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters"):
        assert hf_only not in raw
    assert raw["compress_ratios"] == [0, 4, 128, 4, 0]  # + the MTP layer's entry, truncated to L
    assert raw["rope_scaling"]["type"] == "yarn"
    assert _parse(raw) == _parse(TINY)
    _assert_expected(_parse(raw))


def test_compress_ratios_and_rates():
    raw = dict(TINY)
    del raw["layer_types"], raw["compress_rates"]
    raw.update(compress_ratios=[0, 4, 128, 4], compress_rate_csa=4, compress_rate_hca=16)
    _assert_expected(_parse(raw))


def test_compress_ratios_default_rates():
    """Without compress_rate_csa/hca the codes are the rates themselves: CSA 4, HCA 128."""
    raw = dict(TINY)
    del raw["layer_types"], raw["compress_rates"]
    raw["compress_ratios"] = [128, 0, 4, 128]
    _assert_expected(_parse(raw), layer_types=(HCA, SLIDING, CSA, HCA), compress_rate_hca=128)


def test_num_hash_layers():
    raw = dict(TINY)
    del raw["mlp_layer_types"]
    raw["num_hash_layers"] = 2
    _assert_expected(_parse(raw))
    raw["num_hash_layers"] = 0
    _assert_expected(_parse(raw), mlp_layer_types=(MOE,) * 4)
    raw["num_hash_layers"] = 9  # more than L: every layer hashed
    _assert_expected(_parse(raw), mlp_layer_types=(HASH_MOE,) * 4)


def test_qk_rope_head_dim():
    raw = dict(TINY)
    del raw["partial_rotary_factor"]
    raw["qk_rope_head_dim"] = 16
    _assert_expected(_parse(raw))
    raw["qk_rope_head_dim"] = 8
    cfg = _parse(raw)
    assert cfg.rope_main.rotary_dim == cfg.rope_compress.rotary_dim == 8


def test_rope_spellings_agree():
    yarn = {"factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
    flat_hf = dict(TINY, rope_parameters={"rope_type": "yarn", **yarn})
    v3_style = dict(TINY, rope_scaling={"type": "yarn", **yarn})
    del v3_style["rope_parameters"]
    nested = dict(TINY, rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.5,
                     "attention_factor": 1.0, **yarn},
    })
    for raw in (flat_hf, v3_style, nested):
        _assert_expected(_parse(raw))


def test_no_yarn():
    raw = dict(TINY)
    del raw["rope_parameters"]
    _assert_expected(_parse(raw), rope_compress=RopeConfig(theta=160000.0, rotary_dim=16))


def test_rope_thetas():
    cfg = _parse(dict(TINY, rope_theta=5000.0, compress_rope_theta=80000.0))
    assert cfg.rope_main.theta == 5000.0 and cfg.rope_compress.theta == 80000.0
    assert cfg.rope_main.yarn_factor is None  # YaRN never applies to the main table


QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "scale_fmt": "float"}


def test_top_level_expert_dtype_is_folded_into_quantization_config():
    inside = ref.native_config(TINY, dict(QUANT, expert_dtype="fp8"))
    top_level = ref.native_config(TINY, dict(QUANT, expert_dtype="fp8"), expert_dtype_top_level=True)
    assert "expert_dtype" not in top_level["quantization_config"] and top_level["expert_dtype"] == "fp8"
    expected_quant = QuantConfig(weight_block_size=(128, 128), scale_fmt="float", expert_dtype="fp8")
    assert _parse(inside).quant == _parse(top_level).quant == expected_quant
    _assert_expected(_parse(top_level), quant=expected_quant)


def test_expert_dtype_inside_wins_and_default_is_fp4():
    both = _native(expert_dtype="fp8", quantization_config=dict(QUANT, expert_dtype="fp4"))
    assert _parse(both).quant.expert_dtype == "fp4"
    neither = _native(quantization_config=dict(QUANT, scale_fmt="ue8m0"))
    assert _parse(neither).quant == QuantConfig(scale_fmt="ue8m0", expert_dtype="fp4")


def test_no_quantization_config():
    assert _parse(_native(expert_dtype="fp8")).quant is None  # a top-level expert_dtype alone does not quantize


# ---------------------------------------------------------------------------------------------------------------------
# Precedence and truncation
# ---------------------------------------------------------------------------------------------------------------------


def test_layer_types_win_over_compress_ratios():
    raw = dict(TINY, compress_ratios=[128, 128, 128, 128])
    _assert_expected(_parse(raw))
    native = _native(layer_types=[CSA, SLIDING, HCA, HCA])
    _assert_expected(_parse(native), layer_types=(CSA, SLIDING, HCA, HCA))


def test_mlp_layer_types_win_over_num_hash_layers():
    raw = dict(TINY, num_hash_layers=3, mlp_layer_types=[MOE, HASH_MOE, MOE, HASH_MOE])
    _assert_expected(_parse(raw), mlp_layer_types=(MOE, HASH_MOE, MOE, HASH_MOE))


def test_lists_truncated_to_num_hidden_layers():
    raw = dict(TINY, layer_types=[SLIDING, CSA, HCA, CSA, HCA, SLIDING],
               mlp_layer_types=[HASH_MOE, HASH_MOE, MOE, MOE, HASH_MOE])
    _assert_expected(_parse(raw))
    native = _native(compress_ratios=[0, 4, 128, 4, 128, 0, 0])
    _assert_expected(_parse(native))


def test_fewer_layers_than_the_lists():
    raw = dict(TINY, num_hidden_layers=2)
    _assert_expected(_parse(raw), num_hidden_layers=2, layer_types=(SLIDING, CSA), mlp_layer_types=(HASH_MOE,) * 2)


# ---------------------------------------------------------------------------------------------------------------------
# Round trips and errors on the parsed form
# ---------------------------------------------------------------------------------------------------------------------


def test_round_trips():
    cfg = _parse(_native(quantization_config=dict(QUANT, expert_dtype="fp8")))
    assert _parse(cfg.to_hf_dict()) == cfg
    assert _parse(cfg.to_native_dict()) == cfg
    # transformers reads dsv4's HF form back to the same model shape.
    hf = transformers.DeepseekV4Config(**{k: v for k, v in cfg.to_hf_dict().items() if k != "quantization_config"})
    assert _parse(hf.to_dict()) == dataclasses.replace(cfg, quant=None)


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: no config\.json in this directory"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'gone'}: no such file or directory$"):
        ModelConfig.from_file(tmp_path / "gone")
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match=r"config\.json"):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize(
    "changes, field_name",
    [
        ({"layer_types": [SLIDING, "dense", HCA, CSA]}, "layer_types"),
        ({"layer_types": [SLIDING, CSA]}, "layer_types"),
        ({"mlp_layer_types": [MOE, MOE, "dense", MOE]}, "mlp_layer_types"),
        ({"compress_rates": {CSA: 0, HCA: 16}}, "compress_rates"),
        ({"partial_rotary_factor": 0.46875}, "partial_rotary_factor"),  # 15 channels
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"hc_eps": -1.0}, "hc_eps"),
        ({"scoring_func": "softplus"}, "scoring_func"),
        ({"o_groups": 3}, "o_groups"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"model_type": "deepseek_v3"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 256}},
         "rope_parameters.factor"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        ({"quantization_config": dict(QUANT, scale_fmt="e4m3")}, "quantization_config.scale_fmt"),
        ({"quantization_config": dict(QUANT, expert_dtype="nf4")}, "quantization_config.expert_dtype"),
    ],
)
def test_invalid_field_is_named(changes, field_name):
    with pytest.raises(ConfigError) as excinfo:
        ModelConfig.from_dict(dict(copy.deepcopy(TINY), **changes), source="my/config.json")
    message = str(excinfo.value)
    assert "my/config.json" in message and f"'{field_name}'" in message, message
