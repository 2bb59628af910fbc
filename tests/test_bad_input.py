"""Bad checkpoints and configs: each must fail with a CheckpointError / ConfigError that names the file AND the
tensor or field at fault, and the failing call must leave nothing behind (no model object survives it, and a good
checkpoint loaded right after gives the transformers reference numbers).

Checkpoints are written directly with ``safetensors.torch.save_file`` from the native tensors of the shared randomised
tiny transformers model (tests/conftest.py), then mutated.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reference as ref
from dsv4 import LLM
from dsv4.errors import CheckpointError, ConfigError, Dsv4Error
from dsv4.weights.loader import load_models

GOOD_TOL = 1e-4
WEIGHT = "model.safetensors"


# The shared tiny model (conftest.py) under this file's names.
@pytest.fixture(scope="module")
def config(tiny_config):
    return tiny_config


@pytest.fixture(scope="module")
def native(tiny_native):
    """fp32 native tensors (210 for the tiny config)."""
    return tiny_native


@pytest.fixture(scope="module")
def fp8_native(native):
    """The same model as stored by an FP8 dense + FP4 experts (ue8m0) release."""
    return ref.quantize_native_tensors(native, dense="fp8", expert_dtype="fp4")


@pytest.fixture(scope="module")
def prompt(tiny_prompt):
    return tiny_prompt


@pytest.fixture(scope="module")
def good_dir(tiny_native_dir):
    return tiny_native_dir


@pytest.fixture(scope="module")
def good_logprobs(tiny_logprobs):
    return tiny_logprobs


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor], file: str = WEIGHT) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / file), metadata={"format": "pt"})
    return path / file


def _fails_cleanly(
    path: Path, error: type[Exception], needles: list[str], live_models, good_dir, good_logprobs, prompt
):
    """Both entry points raise `error` (a Dsv4Error that is also a ValueError) with a one-line message naming
    every needle; no model built by the failed call survives; a good load right after is correct."""
    for load in (lambda: LLM(str(path), dtype="float32"), lambda: load_models(path, dtype=torch.float32)):
        with pytest.raises(error) as excinfo:
            load()
        assert isinstance(excinfo.value, Dsv4Error) and isinstance(excinfo.value, ValueError)
        message = str(excinfo.value)
        assert "\n" not in message, f"not one line: {message!r}"
        for needle in needles:
            assert needle in message, f"{needle!r} not in error message {message!r}"
        del excinfo
    gc.collect()
    assert len(live_models) == 0, "a model built by a failed load is still alive"
    good = LLM(str(good_dir), dtype="float32")
    assert float((good.forward_logprobs([prompt])[0] - good_logprobs).abs().max()) <= GOOD_TOL
    return message


# ---------------------------------------------------------------------------------------------------------------------
# Tensor-level problems: (mutation of the native tensors, needles that must appear besides the file)
# ---------------------------------------------------------------------------------------------------------------------


def _drop(name):
    def mutate(t):
        del t[name]

    return mutate


def _set(name, value_fn):
    def mutate(t):
        t[name] = value_fn(t[name])

    return mutate


def _add(name, value):
    def mutate(t):
        t[name] = value

    return mutate


def _with_nan(index):
    def value(x):
        x = x.clone()
        x.view(-1)[index] = float("nan")
        return x

    return value


def _with_inf(x):
    x = x.clone()
    x.view(-1)[0] = float("inf")
    return x


FP32_CASES = {
    "missing_tensor": (_drop("layers.1.attn.wq_a.weight"), ["layers.1.attn.wq_a.weight", "missing"]),
    "missing_expert": (_drop("layers.3.ffn.experts.5.w2.weight"), ["layers.3.ffn.experts.5.w2.weight", "missing"]),
    "unexpected_tensor": (_add("layers.1.attn.bogus.weight", torch.zeros(4, 4)), ["layers.1.attn.bogus.weight"]),
    "unexpected_layer": (_add("layers.9.attn_norm.weight", torch.ones(64)), ["layers.9.attn_norm.weight"]),
    "misshaped_linear": (_set("layers.2.ffn.shared_experts.w1.weight", lambda x: x.t()),
                         ["layers.2.ffn.shared_experts.w1.weight", "shape"]),
    "misshaped_expert": (_set("layers.2.ffn.experts.3.w2.weight", lambda x: x[:, :16]),
                         ["layers.2.ffn.experts.3.w2.weight", "shape"]),
    "misshaped_norm": (_set("norm.weight", lambda x: x[:-1]), ["norm.weight", "shape"]),
    "float_tid2eid": (_set("layers.0.ffn.gate.tid2eid", lambda x: x.float()), ["layers.0.ffn.gate.tid2eid"]),
    "int_linear": (_set("layers.1.attn.wq_b.weight", lambda x: x.to(torch.int32)), ["layers.1.attn.wq_b.weight"]),
    "int_norm": (_set("layers.2.attn_norm.weight", lambda x: x.to(torch.int32)),
                 ["layers.2.attn_norm.weight", "int32"]),
    "nan_in_linear": (_set("layers.2.attn.wo_a.weight", _with_nan(17)), ["layers.2.attn.wo_a.weight", "non-finite"]),
    "nan_in_expert": (_set("layers.3.ffn.experts.0.w3.weight", _with_nan(5)),
                      ["layers.3.ffn.experts.0.w3.weight", "non-finite"]),
    "inf_in_ape": (_set("layers.2.attn.compressor.ape", _with_inf), ["layers.2.attn.compressor.ape", "non-finite"]),
    # tid2eid rows must be k distinct expert ids in [0, E) (docs/model.md, "Loading rules"); E = 8 here.
    "tid2eid_out_of_range": (_set("layers.1.ffn.gate.tid2eid", lambda x: torch.where(x == 0, 8, x).to(x.dtype)),
                             ["layers.1.ffn.gate.tid2eid"]),
    "tid2eid_negative": (_set("layers.0.ffn.gate.tid2eid", lambda x: torch.where(x == 3, -1, x).to(x.dtype)),
                         ["layers.0.ffn.gate.tid2eid"]),
    "tid2eid_repeated_expert_in_row": (_set("layers.1.ffn.gate.tid2eid", lambda x: x[:, :1].expand_as(x).clone()),
                                       ["layers.1.ffn.gate.tid2eid"]),
}


# Cases a load can only detect by reading values: `dsv4 inspect` (headers only) cannot see them.
VALUE_CASES = {"nan_in_linear", "nan_in_expert", "inf_in_ape", "tid2eid_out_of_range", "tid2eid_negative",
               "tid2eid_repeated_expert_in_row", "fp8_scale_nan_byte", "fp8_nan_code", "fp4_scale_nan_byte"}


def _inspection_agrees(case: str, path: Path, load_message: str, needles: list[str]) -> None:
    """`dsv4 inspect`'s dry run (headers only) finds every problem a load finds without reading values, and
    says it in the load's own words."""
    from dsv4.weights.inspection import inspect_checkpoint

    inspection = inspect_checkpoint(path)
    if case in VALUE_CASES:
        assert inspection.loadable, inspection.to_json()  # values are beyond a header-only check
        return
    assert not inspection.loadable
    if "missing" in case:
        assert [n for n in needles if n in inspection.missing], inspection.missing
    elif "without_scale" in case:
        assert any(needles[0] in line and "has no scale" in line for line in inspection.unpaired)
    else:
        assert load_message in inspection.rejected, (load_message, inspection.rejected)


@pytest.mark.parametrize("case", list(FP32_CASES))
def test_bad_tensor(case, tmp_path, config, native, live_models, good_dir, good_logprobs, prompt):
    mutate, needles = FP32_CASES[case]
    tensors = dict(native)
    mutate(tensors)
    file = _write(tmp_path, ref.native_config(config), tensors)
    # A missing tensor is reported for the checkpoint directory; anything else for the file that holds it.
    where = str(tmp_path) if case.startswith("missing") else str(file)
    message = _fails_cleanly(tmp_path, CheckpointError, [where, *needles], live_models, good_dir, good_logprobs,
                             prompt)
    _inspection_agrees(case, tmp_path, message, needles)


def _with_fp8_nan_code(q):
    raw = q.view(torch.uint8).clone()
    raw.view(-1)[3] = 0x7F  # e4m3fn NaN
    return raw.view(torch.float8_e4m3fn)


FP8_CASES = {
    "fp8_weight_without_scale": (_drop("layers.0.attn.wq_a.scale"), ["layers.0.attn.wq_a", "scale"]),
    "fp4_expert_without_scale": (_drop("layers.2.ffn.experts.1.w1.scale"), ["layers.2.ffn.experts.1.w1", "scale"]),
    "fp4_scale_as_float32": (_set("layers.3.ffn.experts.2.w2.scale", lambda s: torch.ones(s.shape)),
                             ["layers.3.ffn.experts.2.w2"]),
    "fp8_scale_misshaped": (_set("layers.1.attn.wkv.scale", lambda s: torch.cat([s, s])), ["layers.1.attn.wkv"]),
    "fp8_scale_nan_byte": (_set("layers.1.attn.wo_b.scale", lambda s: torch.full_like(s.view(torch.uint8), 255)
                                .view(torch.float8_e8m0fnu)), ["layers.1.attn.wo_b"]),
    "fp8_nan_code": (_set("layers.3.attn.wq_b.weight", _with_fp8_nan_code), ["layers.3.attn.wq_b", "non-finite"]),
    # Read straight into the model's own storage (an FP4 expert's scale is its resident bytes): checked there.
    "fp4_scale_nan_byte": (_set("layers.2.ffn.experts.1.w3.scale", lambda s: torch.full_like(s.view(torch.uint8), 255)
                                .view(torch.float8_e8m0fnu)), ["layers.2.ffn.experts.1.w3.scale", "0xFF"]),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_bad_quantized_tensor(case, tmp_path, config, fp8_native, live_models, good_dir, good_logprobs, prompt):
    mutate, needles = FP8_CASES[case]
    tensors = dict(fp8_native)
    mutate(tensors)
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    file = _write(tmp_path, ref.native_config(config, quant), tensors)
    where = str(tmp_path) if "without_scale" in case else str(file)
    message = _fails_cleanly(tmp_path, CheckpointError, [where, *needles], live_models, good_dir, good_logprobs,
                             prompt)
    _inspection_agrees(case, tmp_path, message, needles)


def test_unmutated_fp8_checkpoint_loads(tmp_path, config, fp8_native, prompt):
    """Control for the FP8 cases above: the same files without the mutation load and match transformers."""
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    _write(tmp_path, ref.native_config(config, quant), dict(fp8_native))
    expected = ref.reference_logprobs(ref.model_from_native_state(config, ref.dequantize_native_tensors(fp8_native)),
                                      prompt)
    got = LLM(str(tmp_path), dtype="float32").forward_logprobs([prompt])[0]
    assert float((got - expected).abs().max()) <= GOOD_TOL


# ---------------------------------------------------------------------------------------------------------------------
# File-level problems
# ---------------------------------------------------------------------------------------------------------------------


def test_truncated_file(tmp_path, config, native, live_models, good_dir, good_logprobs, prompt):
    file = _write(tmp_path, ref.native_config(config), native)
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    # The tensor stored last in the data section is the one cut off.
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    header.pop("__metadata__", None)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    message = _fails_cleanly(tmp_path, CheckpointError, [str(file), last], live_models, good_dir, good_logprobs,
                             prompt)
    assert "truncated" in message


@pytest.mark.parametrize("garbage", [b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!"])
def test_corrupt_header(tmp_path, garbage, config, native, live_models, good_dir, good_logprobs, prompt):
    file = _write(tmp_path, ref.native_config(config), native)
    data = file.read_bytes()
    file.write_bytes(garbage + data[len(garbage):])
    _fails_cleanly(tmp_path, CheckpointError, [str(file)], live_models, good_dir, good_logprobs, prompt)


def test_index_lists_missing_file(tmp_path, config, native, live_models, good_dir, good_logprobs, prompt):
    ref.write_native_checkpoint(tmp_path, config, native, shards=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    missing = "model-00002-of-00003.safetensors"
    (tmp_path / missing).unlink()
    assert missing in index["weight_map"].values()
    _fails_cleanly(tmp_path, CheckpointError, ["model.safetensors.index.json", missing], live_models, good_dir,
                   good_logprobs, prompt)


def test_index_names_tensor_absent_from_its_file(tmp_path, config, native, live_models, good_dir, good_logprobs,
                                                 prompt):
    ref.write_native_checkpoint(tmp_path, config, native, shards=2)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["layers.7.attn.ghost.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    _fails_cleanly(tmp_path, CheckpointError, ["model.safetensors.index.json", "layers.7.attn.ghost.weight"],
                   live_models, good_dir, good_logprobs, prompt)


def test_tensor_in_two_shards(tmp_path, config, native, live_models, good_dir, good_logprobs, prompt):
    names = sorted(native)
    _write(tmp_path, ref.native_config(config), {n: native[n] for n in names[:120]}, "a.safetensors")
    save_file({n: native[n] for n in names[100:]}, str(tmp_path / "b.safetensors"))
    _fails_cleanly(tmp_path, CheckpointError, ["b.safetensors", names[100]], live_models, good_dir, good_logprobs,
                   prompt)


def test_no_safetensors(tmp_path, config, live_models, good_dir, good_logprobs, prompt):
    (tmp_path / "config.json").write_text(json.dumps(ref.native_config(config)))
    _fails_cleanly(tmp_path, CheckpointError, [str(tmp_path), "safetensors", 'load_format="dummy"'], live_models,
                   good_dir, good_logprobs, prompt)


# ---------------------------------------------------------------------------------------------------------------------
# Invalid configs: (edit of the native config dict, field named in the message)
# ---------------------------------------------------------------------------------------------------------------------


def _cfg_set(**changes):
    def edit(c):
        c.update(changes)

    return edit


def _cfg_pop_set(pop, **changes):
    def edit(c):
        c.pop(pop, None)
        c.update(changes)

    return edit


def _bad_quant(c):
    c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                                "expert_dtype": "fp16"}


CONFIG_CASES = {
    "bad_layer_types_entry": (_cfg_set(layer_types=[ref.SLIDING, "full_attention", ref.HCA, ref.CSA]), "layer_types"),
    "layer_types_too_short": (_cfg_set(layer_types=[ref.SLIDING, ref.CSA, ref.HCA]), "layer_types"),
    "mlp_layer_types_too_short": (_cfg_set(mlp_layer_types=["hash_moe", "moe"]), "mlp_layer_types"),
    "compress_ratio_7": (_cfg_set(compress_ratios=[0, 4, 7, 4, 0]), "compress_ratios"),
    "odd_rotary_dim": (_cfg_set(qk_rope_head_dim=15), "qk_rope_head_dim"),
    "odd_partial_rotary_factor": (_cfg_pop_set("qk_rope_head_dim", partial_rotary_factor=15 / 32),
                                  "partial_rotary_factor"),
    "negative_rms_norm_eps": (_cfg_set(rms_norm_eps=-1e-6), "rms_norm_eps"),
    "unknown_scoring_func": (_cfg_set(scoring_func="relu"), "scoring_func"),
    "o_groups_not_dividing_heads": (_cfg_set(o_groups=3), "o_groups"),
    "bad_expert_dtype": (_bad_quant, "expert_dtype"),
    "bad_top_level_expert_dtype": (_cfg_set(expert_dtype="int4", quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}), "expert_dtype"),
    "missing_hidden_size": (lambda c: c.pop("hidden_size"), "hidden_size"),
    "string_vocab_size": (_cfg_set(vocab_size="512"), "vocab_size"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config(case, tmp_path, config, native, live_models, good_dir, good_logprobs, prompt):
    edit, field_name = CONFIG_CASES[case]
    native_cfg = ref.native_config(config)
    edit(native_cfg)
    _write(tmp_path, native_cfg, native)
    _fails_cleanly(tmp_path, ConfigError, [str(tmp_path / "config.json"), field_name], live_models, good_dir,
                   good_logprobs, prompt)


def test_config_not_json(tmp_path, native, live_models, good_dir, good_logprobs, prompt):
    (tmp_path / "config.json").write_text("{ not json")
    save_file(native, str(tmp_path / WEIGHT))
    _fails_cleanly(tmp_path, ConfigError, [str(tmp_path / "config.json"), "JSON"], live_models, good_dir,
                   good_logprobs, prompt)


def test_good_checkpoint_loads(good_dir, good_logprobs, prompt, live_models):
    """Control: the unmutated checkpoint every case above starts from loads and matches transformers."""
    llm = LLM(str(good_dir), dtype="float32")
    assert len(live_models) == 1
    assert float((llm.forward_logprobs([prompt])[0] - good_logprobs).abs().max()) <= GOOD_TOL
