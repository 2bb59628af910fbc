"""bf16 weights at rest, fp32 activations: `LLM(dtype="bfloat16", activation_dtype="float32")`.

The independent reference is transformers' fp32 `DeepseekV4ForCausalLM` holding exactly the bf16 weights the
engine keeps (its HF export, loaded back by transformers in fp32): with every activation, cache and sum in fp32,
the engine must match it to fp32 tolerance, in prefill and in cached decode (the few-row C kernels that read
the bf16 weights directly). The weights themselves are the bf16 engine's: same dtypes, bytes, bits, refit.
"""

from __future__ import annotations

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.errors import ConfigError

FP32_TOL = 1e-4  # as tests/test_model_reference.py: dsv4 fp32 vs transformers fp32
SEQ_LEN, PROMPT_LEN, NEW_TOKENS = 24, 8, 12
MIXED = dict(dtype="bfloat16", activation_dtype="float32")


def _ids(seed: int, length: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(config, HF checkpoint dir, the mixed engine, the oracle on its bf16 weights, a token sequence)."""
    config = ref.tiny_config()
    root = tmp_path_factory.mktemp("activation_dtype")
    ref.save_hf_checkpoint(ref.build_reference_model(config, seed=21), root / "fp32")
    llm = LLM(str(root / "fp32"), **MIXED)
    exported = llm.save_checkpoint(root / "resident_bf16", layout="hf")
    oracle = ref.load_reference(exported)
    return config, root / "fp32", llm, oracle, _ids(5, SEQ_LEN, config["vocab_size"])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def test_prefill_matches_transformers_fp32_on_the_bf16_weights(case):
    _, fp32_dir, llm, oracle, ids = case
    expected = ref.reference_logprobs(oracle, ids)
    assert _max_diff(llm.forward_logprobs([ids])[0], expected) <= FP32_TOL
    # Not vacuous: the bf16 engine (bf16 activations) on the same weights is far outside that tolerance.
    bf16 = LLM(str(fp32_dir), dtype="bfloat16")
    assert _max_diff(bf16.forward_logprobs([ids])[0], expected) > 10 * FP32_TOL


def test_cached_decode_matches_transformers_fp32_on_the_bf16_weights(case):
    _, _, llm, oracle, ids = case
    prompt = ids[:PROMPT_LEN]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    tokens = list(completion.token_ids)
    assert tokens == ref.reference_greedy(oracle, prompt, NEW_TOKENS)
    # Every decoded token's logprob (one-row steps over the cache) against the oracle's no-cache forward.
    full = ref.reference_logprobs(oracle, prompt + tokens)
    want = torch.tensor([float(full[PROMPT_LEN - 1 + i, t]) for i, t in enumerate(tokens)])
    got = torch.tensor([lp[t] for lp, t in zip(completion.logprobs, tokens)])
    assert _max_diff(got, want) <= FP32_TOL


def test_weights_at_rest_are_the_bf16_engines(case):
    _, fp32_dir, llm, _, _ = case
    bf16 = LLM(str(fp32_dir), dtype="bfloat16")
    assert (llm.weight_report()["activation_dtype"], bf16.weight_report()["activation_dtype"]) == ("float32",
                                                                                                  "bfloat16")
    ours, theirs = llm.weight_report()["tensors"], bf16.weight_report()["tensors"]
    assert ours.keys() == theirs.keys()
    for name, entry in ours.items():  # same dtype, shape and bits, tensor by tensor
        assert (entry["dtype"], entry["shape"], entry["checksum"]) == (
            theirs[name]["dtype"], theirs[name]["shape"], theirs[name]["checksum"]), name
    params = dict(llm.loaded.target.named_parameters())
    assert params["embed.weight"].dtype == torch.bfloat16
    assert params["layers.0.ffn.experts.w1"].dtype == torch.bfloat16
    assert params["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16

    def resident_bytes(engine: LLM) -> int:
        tensors = [*engine.loaded.target.parameters(), *engine.loaded.target.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    assert resident_bytes(llm) == resident_bytes(bf16)
    # ... while the caches hold fp32 activations.
    assert llm.engine.runner.cache.layers[0].window.dtype == torch.float32
    assert bf16.engine.runner.cache.layers[0].window.dtype == torch.bfloat16


def test_refit_equals_fresh_load_and_moves_no_tensor(case, tmp_path):
    config, fp32_dir, _, _, ids = case
    new_dir = tmp_path / "new"
    ref.save_hf_checkpoint(ref.build_reference_model(config, seed=22), new_dir)
    llm = LLM(str(fp32_dir), **MIXED)
    before = {name: t["data_ptr"] for name, t in llm.weight_report()["tensors"].items()}
    llm.update_weights(ref.read_safetensors_dir(new_dir).items(), full=True)
    fresh = LLM(str(new_dir), **MIXED)
    report, fresh_report = llm.weight_report()["tensors"], fresh.weight_report()["tensors"]
    assert {n: t["checksum"] for n, t in report.items()} == {n: t["checksum"] for n, t in fresh_report.items()}
    assert {name: t["data_ptr"] for name, t in report.items()} == before
    assert torch.equal(llm.forward_logprobs([ids])[0], fresh.forward_logprobs([ids])[0])


def test_default_is_the_weight_dtype_bit_for_bit(case):
    _, fp32_dir, llm, _, ids = case
    default = LLM(str(fp32_dir), dtype="bfloat16")
    same = LLM(str(fp32_dir), dtype="bfloat16", activation_dtype="bfloat16")
    assert default.activation_dtype == default.dtype == torch.bfloat16
    assert default.loaded.target.activation_dtype == torch.bfloat16
    assert torch.equal(default.forward_logprobs([ids])[0], same.forward_logprobs([ids])[0])
    assert not torch.equal(default.forward_logprobs([ids])[0], llm.forward_logprobs([ids])[0])


def test_compile_is_refused_with_wider_activations(case):
    """(The argument checks of activation_dtype itself: tests/test_api_validation.py's constructor table.)"""
    with pytest.raises(ConfigError, match=r"compile=True.*activation_dtype"):
        LLM(str(case[1]), compile=True, **MIXED)


def test_greedy_is_batch_invariant(case):
    config, _, llm, _, _ = case
    prompts = [_ids(30 + i, PROMPT_LEN + i, config["vocab_size"]) for i in range(4)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone


@pytest.mark.parametrize("model, draft", [("dsv4-sort-bf16", "mtp"), ("dsv4-sort-dspark", "dspark")])
def test_drafters_compute_in_the_activation_dtype_and_stay_lossless(model, draft):
    """The drafters read the target's embedding through `embed_tokens` and size their caches by its activation
    dtype; greedy speculative decoding then answers exactly what the target alone answers."""
    prompts = [[0, *range(3, 3 + n)] for n in (4, 7)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    plain = LLM(model, **MIXED)
    speculative = LLM(model, draft=draft, **MIXED)
    drafter = speculative.loaded.models[draft]
    assert all(t.dtype == torch.float32 for t in _cache_tensors(drafter.allocate_cache(1, 16)))
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in speculative.generate(prompts, params, use_tqdm=False)] == want


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Every floating tensor a drafter's cache holds (its layer caches' or its rings)."""
    found, stack = [], [cache]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found += [item] if item.is_floating_point() else []
        elif isinstance(item, (list, tuple)):
            stack += list(item)
        elif hasattr(item, "__dict__"):
            stack += list(vars(item).values())
    assert found
    return found
