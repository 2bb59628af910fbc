"""The embedded default model: shipped in DeepSeek's native FP8/FP4 layout, loads through `LLM()`, and
answers its task, as a prompt and as a chat (its chat template ships with it); the eval's JSON schema; a
seconds-long smoke run of the training script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4.config import ModelConfig
from dsv4.embedded import BF16_MODEL, DEFAULT_MODEL, EMBEDDED_MODELS
from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.tasks import sort_digits as task

REPO = Path(__file__).resolve().parents[1]
NATIVE_DIR = EMBEDDED_MODELS[DEFAULT_MODEL][0]
BF16_DIR = EMBEDDED_MODELS[BF16_MODEL][0]
GREEDY = SamplingParams(temperature=0.0, max_tokens=task.MAX_DIGITS + 2)


@pytest.fixture(scope="module")
def shipped() -> LLM:
    return LLM(max_num_seqs=64)


def _dtypes(path: Path) -> dict[str, torch.dtype]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def test_default_model_is_the_native_fp4_checkpoint(shipped: LLM):
    assert shipped.path == NATIVE_DIR
    assert shipped.loaded.load_format == "safetensors"
    assert shipped.loaded.expert_format == "fp4"
    raw = json.loads((NATIVE_DIR / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "fp8"
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    assert raw["quantization_config"]["scale_fmt"] == "ue8m0"
    assert raw["quantization_config"]["expert_dtype"] == "fp4"
    assert "compress_ratios" in raw and "layer_types" not in raw  # native spelling
    cfg = shipped.config
    assert set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}
    assert cfg.num_nextn_predict_layers == 1 and cfg.hc_mult > 1


def test_native_tensor_formats():
    dtypes = _dtypes(NATIVE_DIR)
    expert_weights = [n for n in dtypes if ".experts." in n and n.endswith(".weight")]
    assert expert_weights and all(dtypes[n] == "I8" for n in expert_weights)
    assert all(dtypes[n[: -len(".weight")] + ".scale"] == "F8_E8M0" for n in expert_weights)
    fp8 = [n for n, d in dtypes.items() if d == "F8_E4M3"]
    assert any(".attn.wq_a." in n for n in fp8) and any(n.startswith("mtp.0.") for n in fp8)
    assert all(dtypes[n[: -len(".weight")] + ".scale"] == "F8_E8M0" for n in fp8)
    assert dtypes["embed.weight"] == "BF16" and dtypes["layers.0.ffn.gate.tid2eid"] == "I32"


def test_bf16_model_is_hf_layout():
    dtypes = _dtypes(BF16_DIR)
    assert "model.embed_tokens.weight" in dtypes and "lm_head.weight" in dtypes
    assert dtypes["model.layers.1.mlp.experts.gate_up_proj"] == "BF16"
    assert not any(d.startswith("F8") or d == "I8" for d in dtypes.values())
    assert ModelConfig.from_file(BF16_DIR).quant is None


def test_shipped_size_under_10_mb():
    total = sum(f.stat().st_size for d in (NATIVE_DIR, BF16_DIR) for f in d.iterdir())
    assert total < 10 * 1024 * 1024


def test_tokenizer_is_character_level(shipped: LLM):
    enc = shipped.tokenizer.encode("sort 31402=")
    assert enc.ids[0] == task.BOS_ID and enc.tokens[1:] == list("sort 31402=")
    assert shipped.tokenizer.decode([*task.encode("01234"), task.EOS_ID]) == "01234"


def test_shipped_model_answers_held_out_prompts(shipped: LLM):
    examples = task.examples(64, seed=777)
    outputs = shipped.generate([ex.prompt for ex in examples], GREEDY)
    correct = sum(o.outputs[0].text == ex.answer for o, ex in zip(outputs, examples))
    assert correct / len(examples) >= 0.95, [(ex.prompt, o.outputs[0].text) for o, ex in zip(outputs, examples)]


def test_training_script_smoke(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("train_embedded", REPO / "scripts" / "train_embedded.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        summary = module.main(["--smoke", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] > 0
    for name in (DEFAULT_MODEL, BF16_MODEL):
        llm = LLM(tmp_path / name, draft="mtp")
        out = llm.generate("sort 321=", SamplingParams(temperature=0.0, max_tokens=4))
        assert out[0].outputs[0].token_ids
        # what the script writes is what ships: the same tokenizer files, so the same chat behaviour
        for file in ("tokenizer.json", "tokenizer_config.json"):
            assert (tmp_path / name / file).read_text() == (EMBEDDED_MODELS[name].path / file).read_text()
        assert llm.chat([{"role": "user", "content": "sort 321="}], GREEDY)[0].error is None


@pytest.mark.parametrize("name", [DEFAULT_MODEL, BF16_MODEL])
def test_chat_works_on_the_shipped_models(name, shipped: LLM):
    """The shipped tokenizer_config.json renders chats exactly as transformers renders it (the oracle), and
    the model answers them."""
    from transformers import AutoTokenizer

    llm = shipped if name == DEFAULT_MODEL else LLM(name, max_num_seqs=8)
    examples = task.examples(8, seed=4242)
    chats = [[{"role": "user", "content": "sort 1="}, {"role": "assistant", "content": "1"},
              {"role": "user", "content": ex.prompt}] for ex in examples]
    outputs = llm.chat(chats, GREEDY, use_tqdm=False)
    reference = AutoTokenizer.from_pretrained(EMBEDDED_MODELS[name].path)
    for chat, out, ex in zip(chats, outputs, examples):
        assert out.prompt_token_ids == reference.apply_chat_template(chat, tokenize=True)["input_ids"]
        assert out.outputs[0].text == ex.answer
    assert json.loads((EMBEDDED_MODELS[name].path / "tokenizer_config.json").read_text()) == task.tokenizer_config()


def test_cli_eval_json(capsys):
    """`dsv4 eval --json`: its schema, and the shipped model's accuracy on fresh held-out prompts."""
    from dsv4.cli import main

    assert main(["eval", "--n", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"n", "accuracy", "mtp_top1_agreement", "speculation"} and result["n"] == 16
    assert 0.0 < result["speculation"]["acceptance_rate"] <= 1.0
    assert set(result["accuracy"]) == {"bf16", "fp8", "fp4", "shipped"}
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in result["accuracy"].values())
    assert result["accuracy"]["shipped"] >= 0.9
    assert isinstance(result["mtp_top1_agreement"], float) and 0.0 <= result["mtp_top1_agreement"] <= 1.0
