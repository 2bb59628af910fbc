"""Tests of the reference harness itself (tests/reference.py): the oracle has to be right before anything is
compared against it. Everything runs on the tiny config, fp32, CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

import reference as ref

SEED = 1234
MTP_SEED = 99
PROMPT_LEN = 70  # > sliding window (32), > one HCA window (16), 17 CSA windows (> index_topk 8)
TINY_PARAMETERS = 462_541  # the tiny config's parameter count (embedding, layers, MTP and head)
TINY_HF_KEYS = 122
TINY_NATIVE_TENSORS = 210
EXACT = 1e-6  # same weights through a different file layout
DEQUANT_TOL = 1e-5  # transformers' dequantized load vs a model built from our dequantized values


@pytest.fixture(scope="module")
def config():
    return ref.tiny_config()


@pytest.fixture(scope="module")
def model(config):
    return ref.build_reference_model(config, SEED)


@pytest.fixture(scope="module")
def native(model):
    return ref.native_state_dict(model)


@pytest.fixture(scope="module")
def mtp(config):
    return ref.random_mtp_tensors(config, MTP_SEED)


@pytest.fixture(scope="module")
def ids(config):
    generator = torch.Generator().manual_seed(7)
    return torch.randint(2, config["vocab_size"], (PROMPT_LEN,), generator=generator).tolist()


@pytest.fixture(scope="module")
def model_logprobs(model, ids):
    return ref.reference_logprobs(model, ids)


# ---------------------------------------------------------------------------------------------------------------------
# Model construction and randomisation
# ---------------------------------------------------------------------------------------------------------------------


def test_tiny_model_matches_anchor_totals(model, config):
    assert sum(p.numel() for p in model.parameters()) == TINY_PARAMETERS
    assert len(model.state_dict()) == TINY_HF_KEYS
    assert model.config.index_n_heads >= 16
    assert model.config._attn_implementation == "eager"
    assert not model.training
    assert all(t.dtype in (torch.float32, torch.int64) for t in model.state_dict().values())
    assert config == ref.tiny_config(), "building a model must not mutate the config dict"


def test_overrides_merge_and_small_config():
    assert ref.tiny_config(swiglu_limit=10.0)["swiglu_limit"] == 10.0
    assert ref.tiny_config()["swiglu_limit"] == 1.0
    small = ref.small_config()
    assert small["hidden_size"] == 512 and len(small["layer_types"]) == small["num_hidden_layers"] == 8


def test_build_is_seeded(config, model):
    again = ref.build_reference_model(config, SEED).state_dict()
    other = ref.build_reference_model(config, SEED + 1).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again[name]), name
        assert not torch.equal(tensor, other[name]), name


def test_every_tensor_is_randomised_by_its_rule(model):
    """Spot-check each init kind against the randomisation recipe's statistics, so a wrong rule order is caught."""
    state = model.state_dict()
    layer = "model.layers.2."
    assert torch.all(state[layer + "attn_hc.scale"] >= 0.5) and torch.all(state[layer + "attn_hc.scale"] <= 1.5)
    assert abs(state["model.norm.weight"].mean().item() - 1.0) < 0.1
    assert state[layer + "self_attn.q_a_norm.weight"].std().item() < 0.3
    assert state[layer + "mlp.gate.e_score_correction_bias"].abs().max().item() < 1.0
    gate_up = state[layer + "mlp.experts.gate_up_proj"]
    hidden = gate_up.shape[-1]
    assert abs(gate_up.std().item() * math.sqrt(hidden) - 1.0) < 0.1  # N(0,1)/sqrt(fan_in)
    hc_fn = state[layer + "attn_hc.fn"]
    assert abs(hc_fn.std().item() * math.sqrt(hc_fn.shape[-1]) - 1.0) < 0.1
    assert abs(state[layer + "self_attn.compressor.position_bias"].std().item() - ref.APE_STD) < 0.1


def test_untouched_tensor_is_detected(model):
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    after = {name: tensor + 1 for name, tensor in before.items()}
    ref.check_fully_randomised(before, after)  # everything changed: fine
    after["model.layers.1.mlp.gate.tid2eid"] = before["model.layers.1.mlp.gate.tid2eid"]
    with pytest.raises(RuntimeError, match="default init"):
        ref.check_fully_randomised(before, after)
    with pytest.raises(KeyError):
        ref.check_fully_randomised({"model.mystery": torch.zeros(1)}, {"model.mystery": torch.ones(1)})


def test_tid2eid_rows_are_distinct_and_in_range(model, config):
    n_experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    tables = {n: t for n, t in model.state_dict().items() if n.endswith("tid2eid")}
    assert len(tables) == config["mlp_layer_types"].count("hash_moe")
    for name, table in tables.items():
        assert table.shape == (config["vocab_size"], top_k), name
        assert table.min() >= 0 and table.max() < n_experts, name
        assert torch.all(table.sort(dim=-1).values.diff(dim=-1) > 0), f"{name}: a row repeats an expert"
        assert len(torch.unique(table)) == n_experts, f"{name}: some expert is never used"


# ---------------------------------------------------------------------------------------------------------------------
# Native names
# ---------------------------------------------------------------------------------------------------------------------


def test_native_state_dict_covers_every_hf_tensor_once(model, native, config):
    state = model.state_dict()
    assert len(native) == TINY_NATIVE_TENSORS
    assert sum(t.numel() for t in native.values()) == sum(t.numel() for t in state.values())
    assert not any(name.startswith("model.") for name in native)
    for name in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
                 "layers.0.attn.wq_a.weight", "layers.0.attn.kv_norm.weight", "layers.0.attn.attn_sink",
                 "layers.0.hc_attn_fn", "layers.0.ffn.gate.tid2eid", "layers.2.ffn.gate.bias",
                 "layers.1.attn.indexer.compressor.ape", "layers.1.attn.indexer.weights_proj.weight",
                 "layers.2.attn.compressor.norm.weight", "layers.3.ffn.experts.7.w3.weight"):
        assert name in native, name
    assert native["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert all(t.dtype == torch.float32 for n, t in native.items() if not n.endswith("tid2eid"))
    # experts: gate rows first
    gate_up = state["model.layers.3.mlp.experts.gate_up_proj"]
    intermediate = config["moe_intermediate_size"]
    assert torch.equal(native["layers.3.ffn.experts.5.w1.weight"], gate_up[5, :intermediate])
    assert torch.equal(native["layers.3.ffn.experts.5.w3.weight"], gate_up[5, intermediate:])
    assert torch.equal(native["layers.3.ffn.experts.5.w2.weight"], state["model.layers.3.mlp.experts.down_proj"][5])
    # exact inverse
    back = ref.hf_state_from_native(native, config)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_hf_state_from_native_rejects_bad_names(native, config):
    with pytest.raises(KeyError):
        ref.hf_state_from_native({**native, "layers.0.attn.bogus.weight": torch.zeros(1)}, config)
    incomplete = dict(native)
    del incomplete["layers.2.attn.compressor.ape"]
    with pytest.raises(KeyError):
        ref.hf_state_from_native(incomplete, config)


def test_random_mtp_tensors(mtp, config):
    hidden, hc = config["hidden_size"], config["hc_mult"]
    assert mtp["mtp.0.e_proj.weight"].shape == mtp["mtp.0.h_proj.weight"].shape == (hidden, hidden)
    assert mtp["mtp.0.enorm.weight"].shape == mtp["mtp.0.hnorm.weight"].shape == (hidden,)
    assert mtp["mtp.0.hc_head_fn"].shape == (hc, hc * hidden)
    assert mtp["mtp.0.hc_head_base"].shape == (hc,) and mtp["mtp.0.hc_head_scale"].shape == (1,)
    assert mtp["mtp.0.norm.weight"].shape == (hidden,)
    assert mtp["mtp.0.ffn.gate.bias"].shape == (config["n_routed_experts"],)
    assert not any("compressor" in n or "indexer" in n or "tid2eid" in n for n in mtp)
    assert all(n.startswith("mtp.0.") for n in mtp)
    expected_experts = 3 * config["n_routed_experts"]
    assert sum(".ffn.experts." in n for n in mtp) == expected_experts
    non_expert = 8 + 5 + 2 + 6 + 4 + 4  # attn, ffn router+shared, norms, hc_attn/ffn, norm+hc_head, e/h
    assert len(mtp) == non_expert + expected_experts
    assert all(torch.equal(t, ref.random_mtp_tensors(config, MTP_SEED)[n]) for n, t in mtp.items())
    two = ref.random_mtp_tensors(config, MTP_SEED, n_layers=2)
    assert not torch.equal(two["mtp.0.attn.wq_a.weight"], two["mtp.1.attn.wq_a.weight"])


# ---------------------------------------------------------------------------------------------------------------------
# Independent quantizer
# ---------------------------------------------------------------------------------------------------------------------


def test_fp4_nibble_order_and_values():
    values = torch.tensor([0.5, -1.0, 6.0, 0.0, -6.0, 1.5, 3.0, -0.5] * 4)  # one 32-block, amax 6 -> scale 1
    packed, scale = ref.quantize_fp4(values[None, :])
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (1, 1)
    assert scale.view(torch.uint8).item() == ref.E8M0_BIAS  # 2^0
    raw = packed.view(torch.uint8)[0].tolist()
    assert raw[:4] == [0x1 | (0xA << 4), 0x7 | (0x0 << 4), 0xF | (0x3 << 4), 0x5 | (0x9 << 4)]
    assert torch.equal(ref.dequantize_fp4(packed, scale)[0], values)


def test_fp4_rounding_and_scales():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 96, generator=generator) * torch.logspace(-3, 1, 16)[:, None]
    weight[3, :32] = 0.0  # an all-zero block keeps a valid (2^-126) scale
    packed, scale = ref.quantize_fp4(weight, scale_storage="uint8")
    assert scale.dtype == torch.uint8 and scale.shape == (16, 3) and scale.min() >= 1
    restored = ref.dequantize_fp4(packed, scale)
    assert torch.equal(restored[3, :32], torch.zeros(32))
    step = ref._pow2(scale.to(torch.int32) - ref.E8M0_BIAS).repeat_interleave(ref.FP4_BLOCK, dim=1)
    assert torch.all((restored - weight).abs() <= step + 1e-30)  # e2m1 spacing is at most 2 · scale
    assert torch.equal(ref.dequantize_fp4(*ref.quantize_fp4(restored)), restored)  # representable values are exact


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_fp8_block_quantizer(scale_fmt):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 300, generator=generator) * 0.02
    weight[130:, 260:] *= 1000.0  # blocks with very different ranges
    q, scale = ref.quantize_fp8_block(weight, scale_fmt=scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == weight.shape
    assert scale.shape == (2, 3)  # ceil(200/128), ceil(300/128)
    if scale_fmt == "ue8m0":
        assert scale.dtype == torch.float8_e8m0fnu
        multipliers = ref._decode_scale(scale)
        assert torch.equal(multipliers, torch.exp2(torch.log2(multipliers).round()))
    else:
        assert scale.dtype == torch.float32
    assert q.to(torch.float32).abs().max() <= ref.E4M3_MAX
    restored = ref.dequantize_fp8_block(q, scale)
    relative = (restored - weight).abs() / weight.abs().clamp(min=1e-3)
    assert relative[weight.abs() > 1e-2].max() < 2.0**-3  # e4m3: 3 mantissa bits
    q_again, scale_again = ref.quantize_fp8_block(restored, scale_fmt=scale_fmt)
    assert torch.equal(ref.dequantize_fp8_block(q_again, scale_again), restored)


# ---------------------------------------------------------------------------------------------------------------------
# transformers save/load round trips
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_shard_size", [None, "200KB"])
def test_save_hf_checkpoint_round_trip(tmp_path, model, ids, model_logprobs, max_shard_size):
    ref.save_hf_checkpoint(model, tmp_path, max_shard_size=max_shard_size)
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists() == (max_shard_size is not None)
    names = set(ref.read_safetensors_dir(tmp_path))
    assert len(names) == TINY_NATIVE_TENSORS
    # the mixed dialect documented in save_hf_checkpoint
    for name in ("model.embed_tokens.weight", "head.weight", "model.norm.weight", "model.hc_head.hc_fn",
                 "model.layers.0.attn.wq_a.weight", "model.layers.0.attn.norm.weight",
                 "model.layers.0.ffn.experts.0.w1.weight", "model.layers.0.hc_attn_fn",
                 "model.layers.1.attn.indexer.compressor.ape"):
        assert name in names, name
    assert "model.layers.0.attn.kv_norm.weight" not in names
    loaded = ref.load_reference(tmp_path)
    assert (ref.reference_logprobs(loaded, ids) - model_logprobs).abs().max() <= EXACT


def test_native_fp32_checkpoint_matches_original(tmp_path, model, native, mtp, config, ids, model_logprobs):
    stored = ref.write_native_checkpoint(tmp_path, config, {**native, **mtp}, dense="fp32", shards=3)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["compress_ratios"] == [0, 4, 128, 4, 0]
    assert written["compress_rate_hca"] == 16 and written["num_hash_layers"] == 2
    assert written["qk_rope_head_dim"] == 16 and written["rope_scaling"]["type"] == "yarn"
    assert not {"layer_types", "mlp_layer_types", "compress_rates", "quantization_config"} & written.keys()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored) and len(set(index["weight_map"].values())) == 3
    on_disk = ref.read_safetensors_dir(tmp_path)
    assert on_disk.keys() == stored.keys()
    assert on_disk["layers.0.ffn.gate.tid2eid"].dtype == torch.int32

    loaded = ref.load_reference(tmp_path)
    hf = loaded.config
    assert hf.layer_types == config["layer_types"] and hf.mlp_layer_types == config["mlp_layer_types"]
    assert hf.compress_rates == config["compress_rates"] and hf.partial_rotary_factor == 0.5
    compress = hf.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["factor"] == 4.0 and compress["attention_factor"] == 1.0
    assert (ref.reference_logprobs(loaded, ids) - model_logprobs).abs().max() <= EXACT


QUANTIZED_FORMATS = {
    "fp8-dense-fp4-experts-e8m0": dict(dense="fp8", expert_dtype="fp4", scale_fmt="ue8m0", scale_storage="e8m0"),
    "fp8-dense-fp4-experts-uint8": dict(dense="fp8", expert_dtype="fp4", scale_fmt="ue8m0", scale_storage="uint8"),
    "fp8-experts-float-scales": dict(dense="fp8", expert_dtype="fp8", scale_fmt="float"),
    "bf16": dict(dense="bf16"),
}


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS.values(), ids=QUANTIZED_FORMATS.keys())
def test_native_quantized_checkpoint_matches_dequantized(tmp_path, native, mtp, config, ids, model_logprobs, fmt):
    tensors = {**native, **mtp}
    stored = ref.write_native_checkpoint(tmp_path, config, tensors, **fmt)
    on_disk = ref.read_safetensors_dir(tmp_path)
    assert on_disk.keys() == stored.keys()
    assert all(on_disk[n].dtype == t.dtype and torch.equal(on_disk[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in stored.items() if t.dtype.itemsize == 1)
    expected = ref.dequantized_native_state(tensors, **fmt)
    assert ref.dequantize_native_tensors(on_disk).keys() == expected.keys() == tensors.keys()

    if fmt["dense"] == "fp8":
        written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
        assert written == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                           "scale_fmt": fmt["scale_fmt"], "expert_dtype": fmt["expert_dtype"]}
        scale_names = {n for n in stored if n.endswith(".scale")}
        fp8_names = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
        expert_names = {n for n in tensors if ".ffn.experts." in n}
        dense_fp8 = {n for n in tensors if ref._FP8_LINEAR.match(n)}
        assert "mtp.0.e_proj.weight" in dense_fp8 and "mtp.0.attn.wo_b.weight" in dense_fp8
        # 34 in the main model (5 attn x 4 layers, indexer wq_b x 2 CSA layers, 3 shared x 4) + 10 in the MTP layer
        assert len(dense_fp8) == 5 * 4 + 2 + 3 * 4 + (2 + 5 + 3)
        assert scale_names == {n.removesuffix(".weight") + ".scale" for n in dense_fp8 | expert_names}
        wq_b = stored["layers.1.attn.indexer.wq_b.scale"]
        assert wq_b.shape == (4, 1)  # [512, 32] weight -> ceil grid
        w1, w1_scale = stored["layers.0.ffn.experts.3.w1.weight"], stored["layers.0.ffn.experts.3.w1.scale"]
        if fmt["expert_dtype"] == "fp4":
            assert w1.dtype == torch.int8 and w1.shape == (32, 32) and w1_scale.shape == (32, 2)
            assert w1_scale.dtype == (torch.uint8 if fmt["scale_storage"] == "uint8" else torch.float8_e8m0fnu)
            assert fp8_names == dense_fp8
        else:
            assert w1.dtype == torch.float8_e4m3fn and w1_scale.dtype == torch.float32 and w1_scale.shape == (1, 1)
            assert fp8_names == dense_fp8 | expert_names
        assert stored["embed.weight"].dtype == torch.bfloat16
    assert stored["layers.0.hc_attn_fn"].dtype == stored["layers.0.attn.attn_sink"].dtype == torch.float32

    loaded = ref.load_reference(tmp_path)
    oracle = ref.model_from_native_state(config, expected)
    loaded_state, oracle_state = loaded.state_dict(), oracle.state_dict()
    for name, tensor in oracle_state.items():
        assert torch.equal(loaded_state[name], tensor), name
    loaded_logprobs = ref.reference_logprobs(loaded, ids)
    assert (loaded_logprobs - ref.reference_logprobs(oracle, ids)).abs().max() <= DEQUANT_TOL
    assert (loaded_logprobs - model_logprobs).abs().max() > DEQUANT_TOL, "the format should not be lossless"


def test_write_native_checkpoint_rejects_bad_formats(tmp_path, native, config):
    with pytest.raises(ValueError):
        ref.write_native_checkpoint(tmp_path, config, native, dense="fp8")
    with pytest.raises(ValueError):
        ref.write_native_checkpoint(tmp_path, config, native, dense="fp8", expert_dtype="fp4", scale_fmt="float")
    with pytest.raises(ValueError):
        ref.write_native_checkpoint(tmp_path, config, native, dense="fp32", expert_dtype="fp4")
    with pytest.raises(ValueError):
        ref.native_config(dict(config, mlp_layer_types=["moe", "hash_moe", "moe", "moe"]))


# ---------------------------------------------------------------------------------------------------------------------
# Reference outputs
# ---------------------------------------------------------------------------------------------------------------------


def test_reference_logprobs(model_logprobs, config):
    assert model_logprobs.shape == (PROMPT_LEN, config["vocab_size"]) and model_logprobs.dtype == torch.float32
    assert torch.allclose(model_logprobs.exp().sum(-1), torch.ones(PROMPT_LEN), atol=1e-5)


def test_reference_greedy_ignores_eos_and_matches_teacher_forcing(model, ids):
    prompt, n_new = ids[:40], 12
    tokens = ref.reference_greedy(model, prompt, n_new)
    assert len(tokens) == n_new
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = tokens[0]  # eos would stop after one token if it were honoured
    try:
        assert ref.reference_greedy(model, prompt, n_new) == tokens
    finally:
        model.generation_config.eos_token_id = saved
    assert model.generation_config.eos_token_id == saved
    logprobs = ref.reference_logprobs(model, prompt + tokens)[len(prompt) - 1:-1]
    top2 = logprobs.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-4  # near-ties may flip between cached and uncached paths
    assert torch.equal(logprobs.argmax(-1)[decided], torch.tensor(tokens)[decided])


# ---------------------------------------------------------------------------------------------------------------------
# The DSpark oracle (tests/dspark_reference.py)
# ---------------------------------------------------------------------------------------------------------------------

DSPARK_BLOCK_SEED = 77
DSPARK_STREAM_LEN = 40  # > sliding window (32): the causal window matters


def test_dspark_oracle_stage_is_transformers_decoder_layer(config):
    """The oracle's stage arithmetic (mHC, attention with sink and RoPE, routed + shared MoE), run as an ordinary
    causal sliding-window layer, equals transformers' DeepseekV4DecoderLayer holding the same tensors; so its
    DSpark forward, which changes only which keys the queries see, is built from verified pieces."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    import dspark_reference as dref

    block_config = dict(config, num_hidden_layers=1, layer_types=[ref.SLIDING], mlp_layer_types=[ref.MOE])
    hf = ref.build_reference_model(block_config, DSPARK_BLOCK_SEED)
    native = ref.native_state_dict(hf)
    tensors = {f"mtp.0.{name.removeprefix('layers.0.')}": t for name, t in native.items() if name.startswith("layers.")}
    rank = 4
    tensors["mtp.0.markov_head.markov_w1.weight"] = torch.zeros(config["vocab_size"], rank)
    tensors["mtp.0.markov_head.markov_w2.weight"] = torch.zeros(config["vocab_size"], rank)
    oracle_config = dict(block_config, n_mtp_layers=1, dspark_block_size=5, dspark_noise_token_id=3,
                         dspark_target_layer_ids=[0], dspark_markov_rank=rank)
    oracle = dref.DSparkReference(oracle_config, tensors)

    generator = torch.Generator().manual_seed(5)
    streams = torch.randn(1, DSPARK_STREAM_LEN, config["hc_mult"], config["hidden_size"], generator=generator)
    input_ids = torch.randint(2, config["vocab_size"], (1, DSPARK_STREAM_LEN), generator=generator)
    positions = torch.arange(DSPARK_STREAM_LEN).unsqueeze(0)
    model = hf.model
    mask = create_sliding_window_causal_mask(config=model.config, inputs_embeds=streams[:, :, 0], attention_mask=None,
                                             past_key_values=None, position_ids=positions)
    embeddings = {kind: model.rotary_emb(streams[:, :, 0], position_ids=positions, layer_type=kind)
                  for kind in ("main", "compress")}
    with torch.no_grad():
        want = model.layers[0](streams, position_embeddings=embeddings, position_ids=positions, attention_mask=mask,
                               input_ids=input_ids, past_key_values=None)[0]
    got = oracle.block_causal(0, streams[0], positions[0])
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    # control: the window matters (full causal attention gives something else)
    oracle.window = DSPARK_STREAM_LEN
    assert (oracle.block_causal(0, streams[0], positions[0]) - want).abs().max().item() > 1e-2
