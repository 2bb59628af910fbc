"""scripts/train_dspark.py: its objective learns (a few steps on one batch lower the loss, and the loss
reacts to the drafter, not to the frozen target), and its smoke run writes a DSpark variant checkpoint that
loads with draft="dspark" and keeps the target's tensors bit for bit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dsv4 import LLM
from dsv4.embedded import DEFAULT_MODEL, resolve_model
from dsv4.kernels.registry import KernelRegistry
from dsv4.model.dspark import DSparkDrafter
from dsv4.model.moe import DENSE
from dsv4.tasks import sort_digits as task
from dsv4.weights.loader import load_models

REPO = Path(__file__).resolve().parent.parent
STEPS = 8


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_dspark", REPO / "scripts" / "train_dspark.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_a_few_steps_lower_the_loss(script):
    args = script.parse_args(["--smoke"])
    # the fast paths are inference kernels without a backward: train through the torch reference
    loaded = load_models(resolve_model(DEFAULT_MODEL, "auto")[0], dtype=torch.float32,
                         kernels=KernelRegistry(force_reference=True))
    target = loaded.target
    target_before = {n: p.clone() for n, p in target.named_parameters()}
    drafter = DSparkDrafter(script.dspark_config(loaded.config, args), target, DENSE, torch.float32)
    script.init_drafter(drafter, seed=0)
    drafter.process_weights_after_loading()
    params = [p.requires_grad_(True) for p in drafter.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    batch = task.examples(8, seed=3)
    losses = []
    for _ in range(STEPS):
        loss = script.dspark_objective(target, drafter, batch, script.LossWeights())
        opt.zero_grad()
        loss.total.backward()
        opt.step()
        losses.append(loss.total.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(torch.equal(p, target_before[n]) for n, p in target.named_parameters())  # frozen
    # every part of the objective received a gradient: the block's stages, the context stack, both heads
    for name in ("mtp.0.main_proj.weight", "mtp.0.attn.wkv.weight", "mtp.0.attn.wq_a.weight", "mtp.0.hc_attn_fn",
                 "mtp.0.markov_head.markov_w2.weight", "mtp.0.confidence_head.proj.weight", "mtp.0.hc_head_fn"):
        assert drafter.get_parameter(name).grad is not None and bool(drafter.get_parameter(name).grad.abs().sum() > 0)


def test_smoke_run_writes_a_loadable_dspark_variant(script, tmp_path):
    threads = torch.get_num_threads()
    try:
        summary = script.main(["--smoke", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] > 0 and len(summary["held_out_accept_per_position"]) == 5
    variant = LLM(tmp_path / script.OUT_NAME, draft="dspark")
    shipped = LLM(DEFAULT_MODEL)
    assert variant.loaded.target.dtype == shipped.loaded.target.dtype == torch.bfloat16  # as the original stores it
    assert variant.config.dspark.block_size == 5
    report, shipped_report = variant.weight_report()["tensors"], shipped.weight_report()["tensors"]
    target_sums = {n: t["checksum"] for n, t in report.items() if t["model"] == "target"}
    assert target_sums == {n: t["checksum"] for n, t in shipped_report.items()}
    prompt = task.make_prompt("3142")
    assert variant.generate(prompt)[0].outputs[0].token_ids == shipped.generate(prompt)[0].outputs[0].token_ids


def test_shipped_dspark_variant():
    """The shipped dsv4-sort-dspark: DeepSeek's native layout (block-FP8 main_proj with its scale, FP4 experts),
    dsv4-sort's target bit for bit, and a real drafter: on held-out prompts, speculating with it answers
    them all and a verify step adds at least 3 tokens on average (the issue's goal at block size 5)."""
    from safetensors import safe_open

    from dsv4 import SamplingParams
    from dsv4.embedded import DSPARK_MODEL, EMBEDDED_MODELS

    with safe_open(str(EMBEDDED_MODELS[DSPARK_MODEL].path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("mtp.0.main_proj.weight").get_dtype() == "F8_E4M3" and "mtp.0.main_proj.scale" in f.keys()
        assert f.get_slice("mtp.0.ffn.experts.0.w1.weight").get_dtype() == "I8"  # FP4 pairs
    variant = LLM(DSPARK_MODEL, draft="dspark", max_num_seqs=4)
    assert variant.config.dspark.block_size == 5
    shipped = LLM(DEFAULT_MODEL)
    target_sums = {n: t["checksum"] for n, t in variant.weight_report()["tensors"].items() if t["model"] == "target"}
    assert target_sums == {n: t["checksum"] for n, t in shipped.weight_report()["tensors"].items()
                           if t["model"] == "target"}
    examples = task.examples(32, seed=777)
    outputs = variant.generate([ex.prompt for ex in examples], SamplingParams(max_tokens=task.MAX_SEQ_LEN),
                               use_tqdm=False)
    assert all(task.is_correct(ex.prompt, o.outputs[0].text) for ex, o in zip(examples, outputs))
    produced = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)  # the first token: from the prefill
    assert produced / variant.engine.proposer.stats.verifies >= 3.0
