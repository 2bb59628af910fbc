"""The llama.cpp side-by-side benchmark's pieces: the checkpoint both engines load, the converter adapter's
FP4 decode, and (when the peer is built) a quick end-to-end run whose logits check must pass.

The peer itself takes tens of minutes to build (benchmarks/peer/build_llamacpp.sh), so the end-to-end run
only happens where it has been built; everything it relies on from dsv4 is tested here without it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))

import convert_gguf  # noqa: E402
import llama_peer  # noqa: E402

import bench_llamacpp  # noqa: E402
from bench_generate import _prompts, dsv4_logits  # noqa: E402
from dsv4 import LLM  # noqa: E402
from dsv4.quant import dequantize_fp4, quantize_fp4  # noqa: E402

# Same values, two expert kernels (dense stacks vs FP4 dequantised per expert): fp32 summation order only.
SAME_VALUES_TOL = 1e-4


def test_adapter_fp4_decode_matches_dsv4():
    """The converter adapter's independent FP4 decode (which the F32 GGUF is checked against) reads the bytes
    exactly as dsv4 does: every code in both nibbles, scales from 2^-30 to 2^30."""
    codes = np.arange(16, dtype=np.uint8)
    packed = np.tile(codes | (codes[::-1] << 4), (4, 4))  # 4 rows x 64 bytes = 128 inputs a row
    scale = np.array([[97, 127, 157, 120]] * 4, dtype=np.uint8)
    ours = convert_gguf.fp4_values(packed.view(np.int8), scale)
    want = dequantize_fp4(torch.from_numpy(packed.view(np.int8)), torch.from_numpy(scale)).numpy()
    assert np.array_equal(ours, want)
    w = torch.randn(8, 64)
    packed_t, scale_t = quantize_fp4(w)
    assert np.array_equal(convert_gguf.fp4_values(packed_t.numpy(), scale_t.numpy()),
                          dequantize_fp4(packed_t, scale_t).numpy())


@pytest.fixture(scope="module")
def quick_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "checkpoint"
    llama_peer.write_bench_checkpoint(path, bench_llamacpp.CONFIGS["quick"](), seed=0)
    return path


def test_bench_checkpoint_is_native_with_fp4_experts(quick_checkpoint):
    config = json.loads((quick_checkpoint / "config.json").read_text())
    assert config["quantization_config"]["expert_dtype"] == "fp4" and "compress_ratios" in config
    with safe_open(str(quick_checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        expert = f.get_tensor("layers.1.ffn.experts.0.w1.weight")
        scale = f.get_tensor("layers.1.ffn.experts.0.w1.scale")
        dense = f.get_tensor("layers.1.attn.wq_a.weight")
    assert expert.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu and dense.dtype == torch.float32
    assert "embed.weight" in names and "layers.0.ffn.gate.tid2eid" in names


def test_bench_checkpoint_dense_and_fp4_experts_compute_the_same(quick_checkpoint):
    """The fp32 and fp4 variants' dsv4 engines hold the same values: the FP4 experts, and their fp32 copy."""
    prompt = _prompts(1, 24, bench_llamacpp.CONFIGS["quick"]()["vocab_size"])[0]
    logits = {}
    for experts in ("dense", "fp4"):
        llm = LLM(quick_checkpoint, dtype="float32", expert_dtype=experts, max_num_seqs=1, max_model_len=64)
        logits[experts] = dsv4_logits(llm, prompt, llm.loaded.target.allocate_cache(1, len(prompt) + 1))
    torch.testing.assert_close(logits["dense"], logits["fp4"], rtol=SAME_VALUES_TOL, atol=SAME_VALUES_TOL)


def test_contention_rounds_divide_each_engines_loaded_by_its_idle_time(monkeypatch):
    """bench_contention's rounds: every workload timed once per half per round, the loaded half inside the
    background load and the idle one outside it, an engine's slowdown its own loaded / idle seconds."""
    import bench_contention

    loaded = {"now": False}

    class FakeLoad:
        def __init__(self, count: int):
            self.count = count

        def __enter__(self):
            loaded["now"] = self.count > 0

        def __exit__(self, *exc):
            loaded["now"] = False

    monkeypatch.setattr(bench_contention, "_background_load", FakeLoad)
    calls = []

    def workload(name: str, idle_s: float, loaded_s: float):
        def run() -> float:
            calls.append((name, loaded["now"]))
            return loaded_s if loaded["now"] else idle_s
        return run

    rows = bench_contention._rounds({"llama": workload("llama", 1.0, 3.0), "dsv4": workload("dsv4", 2.0, 3.0)},
                                    load=1, repeats=3)
    assert rows["llama"]["slowdown"] == 3.0 and rows["dsv4"]["slowdown"] == 1.5
    assert rows["dsv4"]["idle_s"] == 2.0 and rows["dsv4"]["loaded_s"] == 3.0
    # one warm-up each (idle), then 3 rounds x 2 halves x 2 engines
    assert calls.count(("llama", True)) == calls.count(("dsv4", True)) == 3
    assert calls.count(("llama", False)) == calls.count(("dsv4", False)) == 4
