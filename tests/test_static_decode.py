"""The fixed-shape decode step (`engine/static_decode.py`): eager, it equals the batched decode path row for
row and cache row for cache row; compiled (`LLM(compile=True)`), generation equals the eager engine, and a
refit is seen by the compiled graph in place: no recompilation, results bit-identical to a fresh compiled
load of the new weights."""

import pytest
import torch
from torch._dynamo.types import GuardFilterEntry

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.engine.static_decode import StaticDecode, entry_reads, keep_guard
from dsv4.kernels.gathered_experts import loop_experts, routed_experts, swiglu
from dsv4.kernels.registry import KernelRegistry
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import cache_tensors
from dsv4.parallel.state import SINGLE

SEED, NEW_SEED = 5, 6
LOGIT_TOL = 1e-4  # two fp32 paths: different op order, same values
LOGPROB_TOL = 1e-4
CONFIG = ref.tiny_config(num_hidden_layers=5, layer_types=["sliding_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                         mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"])


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("static_decode")
    for name, seed in (("old", SEED), ("new", NEW_SEED)):
        ref.save_hf_checkpoint(ref.build_reference_model(CONFIG, seed), root / name)
    return root / "old", root / "new"


def test_entry_reads_round_up_and_stay_within_capacity():
    capacity = {4: 40, 16: 10}
    assert entry_reads([0, 3], capacity, least=2) == {4: 2, 16: 2}  # one complete CSA entry; none for HCA
    assert entry_reads([20, 35], capacity, least=2) == {4: 16, 16: 2}  # 9 CSA entries -> 16, 2 HCA entries
    assert entry_reads([159], capacity, least=8) == {4: 40, 16: 10}  # capped by the cache


# slot -> prompt length: slots out of order, positions differ. 3 rows route through gathered expert
# weights, 6 rows through every expert (GroupedExperts.uses_all_experts): both in-graph strategies of GroupedExperts.
ROW_SETS = {"3 rows": {3: 7, 0: 30, 2: 16}, "6 rows": {5: 3, 1: 22, 7: 9, 0: 41, 4: 1, 2: 16}}


def test_compiled_step_drops_only_identity_guards_between_paths_to_the_registry_parallel_state_or_a_module():
    """Identity checks between two paths to the kernel registry, the parallel state or a module are dropped;
    every other guard on them, and identity checks between other objects (tensors), are kept."""
    def entry(guard_type, value):
        return GuardFilterEntry(name="L['model'].x", has_value=True, value=value, guard_type=guard_type,
                                derived_guard_types=(), is_global=False, orig_guard=None)

    registry = KernelRegistry()
    assert not keep_guard(entry("DUPLICATE_INPUT", registry))
    assert not keep_guard(entry("DUPLICATE_INPUT", SINGLE))
    assert not keep_guard(entry("DUPLICATE_INPUT", torch))
    assert keep_guard(entry("DUPLICATE_INPUT", torch.zeros(1)))
    assert keep_guard(entry("ID_MATCH", torch))
    assert keep_guard(entry("TYPE_MATCH", registry))
    assert keep_guard(entry("ID_MATCH", SINGLE))


@pytest.mark.parametrize("prompts", ROW_SETS.values(), ids=ROW_SETS.keys())
def test_static_step_equals_batched_decode_rows_and_caches(hf_dirs, prompts):
    """Rows at different positions in scattered slots, for 40 steps: every compressor window completes
    at some step in some row (CSA m=4, HCA m=16); logits, greedy tokens and every cache tensor agree."""
    llm = LLM(str(hf_dirs[0]), dtype="float32", max_num_seqs=8, max_model_len=128)
    model = llm.loaded.target
    g = torch.Generator().manual_seed(SEED)
    caches = [model.allocate_cache(8, 128) for _ in range(2)]
    tokens = {}
    with torch.inference_mode():
        prefill = ForwardBatch.build([(slot, torch.randint(2, 512, (n,), generator=g).tolist(), 0)
                                      for slot, n in prompts.items()])
        for cache in caches:
            streams, _ = model(prefill, cache)
        last = model.logits(streams[[seg.end - 1 for seg in prefill.segments]]).argmax(-1)
        tokens = dict(zip(prompts, last.tolist()))
        positions = dict(prompts)
        static = StaticDecode(model, compile=False)
        for _ in range(40):
            batch = ForwardBatch.build([(slot, [tokens[slot]], positions[slot]) for slot in prompts])
            expected = model.logits(model(batch, caches[0])[0])
            _, got = static(batch, caches[1])
            assert (got - expected).abs().max().item() <= LOGIT_TOL
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
            tokens = dict(zip(prompts, expected.argmax(-1).tolist()))
            positions = {slot: p + 1 for slot, p in positions.items()}
    for a, b in zip(cache_tensors(caches[0].layers), cache_tensors(caches[1].layers)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert caches[0].lengths == caches[1].lengths


def test_routed_experts_op_equals_the_reference_loop():
    """The opaque op a compiled graph calls for large experts, against `loop_experts`."""
    g = torch.Generator().manual_seed(SEED)
    E, inter, D, T, k = 8, 32, 64, 5, 2
    w1, w3 = torch.randn(E, inter, D, generator=g), torch.randn(E, inter, D, generator=g)
    w2 = torch.randn(E, D, inter, generator=g)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    stacks = {"w1": w1, "w3": w3, "w2": w2}
    expected = loop_experts(x, ids, weights, lambda name, e: stacks[name][e], E, 1.0, swiglu)
    torch.testing.assert_close(routed_experts(x, ids, weights, w1, w3, w2, 1.0), expected, rtol=1e-5, atol=1e-5)


PROMPTS = [[5, 9, 31, 2, 77, 3, 8], list(range(40, 75)), [300, 12, 7, 7, 7, 41, 90, 16, 3, 3, 200, 18]]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)


def _completions(llm: LLM):
    return [out.outputs[0] for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _close(a, b, tol):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t] - ly[t]) <= tol for t in lx)


def test_compiled_engine_generates_like_eager_and_refits_in_place(hf_dirs):
    old_dir, new_dir = hf_dirs
    limits = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 96}
    compiled = LLM(str(old_dir), compile=True, **limits)
    _close(_completions(compiled), _completions(LLM(str(old_dir), **limits)), LOGPROB_TOL)

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.update_weights(LLM(str(new_dir), **limits).iter_weights())
    after_refit = _completions(compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the same graphs, new weights
    _close(after_refit, _completions(LLM(str(new_dir), **limits)), LOGPROB_TOL)
    _close(after_refit, _completions(LLM(str(new_dir), compile=True, **limits)), 0.0)  # == a fresh compiled load


# FP8 / FP4 routed experts (`dsv4::quant_experts` in the graph): one CSA layer with a learned-router MoE, so each
# format's cold compile stays short (two layers took 4-7 minutes each on a loaded 2-core machine). Greedy, so
# the tokens must be identical.
QUANT_CONFIG = ref.tiny_config(num_hidden_layers=1, layer_types=["compressed_sparse_attention"],
                               mlp_layer_types=["moe"])
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, logprobs=2)


# FP4 only: a cold compile is ~50 s of the suite's budget per format on 2 cores, and FP8 experts enter the
# graph through the same `dsv4::quant_experts` op (tests/test_quant_experts.py checks both formats of the op
# against the reference loop, fake tensors included).
COMPILED_QUANT_FORMATS = ("fp4",)


@pytest.fixture(scope="module")
def quant_dirs(tmp_path_factory):
    """expert format -> (old weights, new weights) native checkpoints, experts quantized at rest."""
    root = tmp_path_factory.mktemp("static_decode_quant")
    dirs = {}
    for fmt in COMPILED_QUANT_FORMATS:
        for name, seed in (("old", SEED), ("new", NEW_SEED)):
            state = ref.native_state_dict(ref.build_reference_model(QUANT_CONFIG, seed))
            ref.write_native_checkpoint(root / fmt / name, QUANT_CONFIG, state, dense="fp8", expert_dtype=fmt)
        dirs[fmt] = (str(root / fmt / "old"), str(root / fmt / "new"))
    return dirs


def _greedy(llm: LLM):
    return [out.outputs[0] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("fmt", COMPILED_QUANT_FORMATS)
def test_compiled_quantized_experts_decode_like_eager_and_see_a_refit(quant_dirs, fmt):
    """compile=True with quantized (here FP4) experts: greedy tokens identical to the eager engine's and logprobs within
    LOGPROB_TOL (fp32, other op order); the experts stay quantized at rest; a refit after compiling is seen by
    the same graph (nothing baked in as a constant): the compiled engine then generates what a fresh load of
    the new weights does."""
    old_dir, new_dir = quant_dirs[fmt]
    limits = {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 96}
    compiled = LLM(old_dir, compile=True, **limits)
    experts = compiled.loaded.target.layers[0].ffn.experts
    assert experts.format == fmt and experts.w1.dtype in (torch.int8, torch.float8_e4m3fn)
    before = _greedy(compiled)
    _close(before, _greedy(LLM(old_dir, **limits)), LOGPROB_TOL)

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    fresh = LLM(new_dir, **limits)
    compiled.update_weights(fresh.iter_weights())
    after_refit = _greedy(compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the same graph, new weights
    assert [c.token_ids for c in after_refit] != [c.token_ids for c in before]
    _close(after_refit, _greedy(fresh), LOGPROB_TOL)
