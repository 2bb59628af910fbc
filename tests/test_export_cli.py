"""Checkpoint export (`save_checkpoint`, `dsv4 convert`) and the `dsv4` command line.

Round trips must preserve what the model computes: bit-exact weights when the resident format is kept,
identical logits across native <-> HF layouts (FP4/FP8 values are exactly representable in float and
re-quantize to the same values). `dsv4 inspect` must work from headers alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.cli import EXIT_OK, EXIT_USAGE, main
from dsv4.errors import ConfigError
from dsv4.weights.inspection import HF_FORMAT, MIXED_FORMAT, NATIVE_FORMAT, detect_format

PROMPT = [5, 17, 33, 65, 129, 257, 7, 8, 9, 10, 300, 301, 2, 44, 45, 46, 47, 480, 12, 13]
# dsv4 vs transformers, fp32, same weights (docs/model.md, "The transformers oracle and its caveats").
HF_AGREEMENT = 1e-4
# Same values, different expert kernel (dense experts may take a fused path): fp32 summation-order noise only.
CROSS_FORMAT = 1e-5


@pytest.fixture(scope="module")
def source(tiny_native, tiny_release_dir, tiny_transformers_saved_dir):
    """A native release-format checkpoint (FP8 dense, FP4 experts), its fp32 native tensors and its
    transformers-saved twin (conftest.py)."""
    return {"native": tiny_native, "fp4": tiny_release_dir, "saved": tiny_transformers_saved_dir}


@pytest.fixture(scope="module")
def original(source, make_llm) -> LLM:
    return make_llm(source["fp4"])


@pytest.fixture(scope="module")
def original_logprobs(original) -> torch.Tensor:
    return original.forward_logprobs([PROMPT])[0]


def _checksums(llm: LLM) -> dict[str, str]:
    return {name: t["checksum"] for name, t in llm.weight_report()["tensors"].items()}


def _stored_dtypes(path: Path) -> dict[str, torch.dtype]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


# ---- export ----
def test_native_resident_round_trip_is_bit_exact(tmp_path, original, original_logprobs):
    out = original.save_checkpoint(tmp_path / "resident")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["expert_dtype"] == "fp4" and config["torch_dtype"] == "float32"
    dtypes = _stored_dtypes(out)
    assert dtypes["layers.0.ffn.experts.0.w1.weight"] == "I8" and dtypes["layers.0.ffn.experts.0.w1.scale"] == "F8_E8M0"
    assert dtypes["layers.0.attn.wq_a.weight"] == "F32" and dtypes["layers.0.ffn.gate.tid2eid"] == "I32"
    copy = LLM(out, max_num_seqs=2, max_model_len=64)  # dtype "auto" reads torch_dtype
    assert copy.dtype == torch.float32
    assert _checksums(copy) == _checksums(original)
    assert torch.equal(copy.forward_logprobs([PROMPT])[0], original_logprobs)


def test_convert_native_fp8_dense_keeps_every_value(tmp_path, source, original, make_llm):
    """FP8 dense linears re-quantized from their own dequantized values: the same values, so the same
    resident tensors after loading, bit for bit."""
    out = tmp_path / "fp8"
    args = ["convert", str(source["fp4"]), str(out), "--layout", "native", "--dense", "fp8", "--dtype", "float32"]
    assert main(args) == EXIT_OK
    dtypes = _stored_dtypes(out)
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3"
    assert dtypes["layers.1.attn.indexer.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "F32"  # outside the FP8 set
    assert _checksums(make_llm(out)) == _checksums(original)


def test_native_hf_native_round_trip_gives_the_same_logits(tmp_path, source, original_logprobs, make_llm):
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    assert main(["convert", str(source["fp4"]), str(hf_dir), "--layout", "hf"]) == EXIT_OK
    hf_names = set(_stored_dtypes(hf_dir))
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_names and "lm_head.weight" in hf_names
    assert not any(".experts.0." in n for n in hf_names)
    hf = make_llm(hf_dir)
    assert hf.loaded.expert_format == "dense"
    torch.testing.assert_close(hf.forward_logprobs([PROMPT])[0], original_logprobs, rtol=0, atol=CROSS_FORMAT)

    # transformers reads dsv4's HF layout as its own
    reference = ref.load_reference(hf_dir)
    torch.testing.assert_close(ref.reference_logprobs(reference, PROMPT), original_logprobs, rtol=0,
                               atol=HF_AGREEMENT)

    args = ["convert", str(hf_dir), str(back), "--layout", "native", "--experts", "fp4", "--dense", "fp8"]
    assert main(args) == EXIT_OK
    again = make_llm(back)
    assert again.loaded.expert_format == "fp4"
    assert torch.equal(again.forward_logprobs([PROMPT])[0], original_logprobs)  # the same FP4 values again


def test_export_rejects_what_the_layout_cannot_hold(tmp_path, source, original, capsys):
    args = ["convert", str(source["fp4"]), str(tmp_path / "x"), "--layout", "hf", "--experts", "fp4"]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == "dsv4 convert: error: --layout hf stores every tensor in float: --experts fp4 needs --layout native\n"
    assert not (tmp_path / "x").exists()  # refused before anything was loaded or created
    with pytest.raises(ConfigError, match="HF layout stores every tensor in float"):
        original.save_checkpoint(tmp_path / "y", layout="hf", experts="fp4")
    original.save_checkpoint(tmp_path / "taken")
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        original.save_checkpoint(tmp_path / "taken")


# ---- inspect ----
def _inspect_json(path, capsys, *extra) -> tuple[int, dict]:
    code = main(["inspect", str(path), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def hf_export(source, tmp_path_factory, make_llm) -> Path:
    out = tmp_path_factory.mktemp("hf_export") / "hf"
    make_llm(source["fp4"]).save_checkpoint(out, layout="hf")
    return out


def test_inspect_reports_format_and_parameter_count(source, hf_export, capsys, no_tensor_reads):
    parameters = sum(t.numel() for t in source["native"].values())  # counted independently, fp32 tensors
    for path, fmt in ((source["fp4"], NATIVE_FORMAT), (hf_export, HF_FORMAT), (source["saved"], MIXED_FORMAT)):
        code, report = _inspect_json(path, capsys)
        assert code == EXIT_OK, report
        assert report["format"] == fmt
        assert report["parameters"] == parameters
        assert report["missing"] == report["rejected"] == report["unpaired"] == [] and report["loadable"]
    code, report = _inspect_json(source["fp4"], capsys)
    assert set(report["dtypes"]) == {"BF16", "F32", "F8_E4M3", "F8_E8M0", "I32", "I8"}
    assert main(["inspect", str(source["fp4"])]) == EXIT_OK
    text = capsys.readouterr().out
    assert f"format: {NATIVE_FORMAT}" in text and f"parameters: {parameters:,}" in text


def test_format_detection_from_names():
    assert detect_format(["embed.weight", "layers.0.attn.wq_a.weight", "mtp.0.e_proj.weight"]) == NATIVE_FORMAT
    assert detect_format(["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_a_proj.weight",
                          "model.layers.0.mlp.experts.gate_up_proj", "mtp.0.e_proj.weight"]) == HF_FORMAT
    # HF prefixes on native layer suffixes is the transformers-saved dialect, whatever the head is called
    prefixed_native = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.attn.wq_a.weight"]
    assert detect_format(prefixed_native) == MIXED_FORMAT
    unprefixed_head = ["model.embed_tokens.weight", "head.weight", "model.layers.0.self_attn.q_a_proj.weight"]
    assert detect_format(unprefixed_head) == MIXED_FORMAT


def test_inspect_reports_a_broken_checkpoint_without_reading_data(source, tmp_path, capsys, monkeypatch):
    broken = tmp_path / "broken"
    shutil.copytree(source["fp4"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["layers.2.attn_norm.weight"]
    tensors["layers.1.attn.kv_nrom.weight"] = tensors.pop("layers.1.attn.kv_norm.weight")
    tensors["norm.weight"] = tensors["norm.weight"][:-1].clone()
    del tensors["layers.0.ffn.experts.5.w2.scale"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})

    monkeypatch.setattr("dsv4.weights.checkpoint.map_file", lambda *a, **k: pytest.fail("inspect read tensor data"))
    code, report = _inspect_json(broken, capsys)
    assert code == EXIT_USAGE and not report["loadable"]
    file = broken / "model.safetensors"
    assert report["missing"] == ["layers.1.attn.kv_norm.weight", "layers.2.attn_norm.weight"]
    assert report["rejected"] == [
        f"{file}: unexpected tensor 'layers.1.attn.kv_nrom.weight' (no such weight in this model)",
        f"{file}: tensor norm.weight (norm.weight): tensor shape (63,) does not match the model's (64,)",
    ]
    assert report["unpaired"] == [f"layers.0.ffn.experts.5.w2.weight (from {file}) has no scale"]
    assert main(["inspect", str(broken)]) == EXIT_USAGE
    text = capsys.readouterr().out
    assert "missing (2)" in text and "layers.1.attn.kv_nrom.weight" in text and "loadable: no" in text


# ---- generate, env ----
def test_generate_prints_prompt_answer_and_timing(capsys):
    assert main(["generate", "--model", "dsv4-tiny-dummy", "--max-tokens", "3"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.count("prompt: ") == out.count("answer: ") >= 2
    assert "tok/s" in out

    assert main(["generate", "5,6,7", "--model", "dsv4-tiny-dummy", "--max-tokens", "2"]) == EXIT_OK
    out = capsys.readouterr().out
    expected = LLM("dsv4-tiny-dummy", load_format="dummy").generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert "prompt: 5,6,7" in out
    assert f"answer: {','.join(map(str, expected[0].outputs[0].token_ids))}" in out


def test_env_prints_the_runtime(capsys):
    assert main(["env"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "threads:" in out and "device:" in out
