"""dsv4 against the transformers 5.23 ``DeepseekV4ForCausalLM`` fp32 oracle (docs/model.md).

Every checkpoint here is written from a randomised transformers model (tests/reference.py) and loaded by dsv4
through its public API (``LLM``) or its loader (``load_models``). What is compared:

* ``forward_logprobs`` vs transformers' no-cache forward, at every position (fp32, <= 1e-4);
* greedy generation of 32 tokens vs transformers' cached greedy ``generate`` (identical tokens);
* chunked prefill + token-by-token decode, two sequences of different lengths sharing one batch in several cache
  slots, vs each sequence's single full forward (<= 1e-4);
* native FP8 dense + FP4 experts (ue8m0 scales as float8_e8m0fnu and as uint8) and FP8 experts with fp32 scales vs
  transformers loading the very same files;
* bf16 weights/activations vs fp32 (loose, statistical bounds: bf16 is far from fp32 with random weights).

Configurations: the tiny config (sliding, CSA, HCA, CSA; hash, hash, moe, moe), an all-CSA model with a routed
first layer, a non-prefix hash layer and sigmoid scoring, an HCA-first model with a small window and HCA rate 8,
and softmax scoring (transformers has no "softmax" activation, so its routers are patched with a hand-written
softmax score function; everything else stays transformers'). The sequences are 200 tokens: > the sliding window
(so the window ring wraps), many HCA windows and > index_topk CSA entries (so the indexer really selects).
"""

from __future__ import annotations

import json

import pytest
import torch

import reference as ref
from dsv4 import LLM, SamplingParams
from dsv4.model.batch import ForwardBatch

FP32_TOL = 1e-4  # dsv4 fp32 vs transformers fp32 (observed <= 1.3e-5, docs/model.md)
SEQ_LEN = 200
GREEDY_TOKENS = 32
GREEDY_PROMPT_LENS = (40, 23)

SLIDING, CSA, HCA, HASH_MOE, MOE = ref.SLIDING, ref.CSA, ref.HCA, ref.HASH_MOE, ref.MOE

CONFIGS = {
    "tiny": ref.tiny_config(),
    # All-CSA, a learned (moe) first layer, a hash layer that is not a prefix, sigmoid scoring, CSA rate 8.
    "all_csa_sigmoid": ref.tiny_config(
        num_hidden_layers=3,
        layer_types=[CSA, CSA, CSA],
        mlp_layer_types=[MOE, HASH_MOE, MOE],
        scoring_func="sigmoid",
        compress_rates={CSA: 8, HCA: 16},
        index_topk=4,
        swiglu_limit=10.0,
    ),
    # HCA first (the first-layer broadcast path with a compressor), small window (24, not a power of two), HCA rate 8.
    "hca_first": ref.tiny_config(
        layer_types=[HCA, SLIDING, CSA, HCA],
        mlp_layer_types=[HASH_MOE, MOE, MOE, MOE],
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=24,
    ),
    # softmax scoring: transformers' routers get a hand-written softmax (see _patch_softmax_routing).
    "softmax": ref.tiny_config(scoring_func="sqrtsoftplus"),
}
SEEDS = {"tiny": 11, "all_csa_sigmoid": 12, "hca_first": 13, "softmax": 14}


def _ids(seed: int, length: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=generator).tolist()


class _SoftmaxScore(torch.nn.Module):
    """Hand-written softmax routing score: softmax of the router logits over the experts."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float(), dim=-1).to(logits.dtype)


def _patch_softmax_routing(model) -> None:
    """Replace every router's score function by softmax over the experts (the oracle of scoring_func="softmax")."""
    patched = 0
    for module in model.modules():
        if type(module).__name__ in ("DeepseekV4TopKRouter", "DeepseekV4HashRouter"):
            module.score_fn = _SoftmaxScore()
            patched += 1
    assert patched == model.config.num_hidden_layers


class Case:
    """One randomised reference model, the directories it was written to, and its expected outputs."""

    def __init__(self, name: str, tmp_path_factory):
        self.name = name
        self.config = CONFIGS[name]
        self.model = ref.build_reference_model(self.config, SEEDS[name])
        if name == "softmax":
            _patch_softmax_routing(self.model)
        self.root = tmp_path_factory.mktemp(name)
        self.hf_dir = self.root / "hf"
        ref.save_hf_checkpoint(self.model, self.hf_dir)
        if name == "softmax":
            config_file = self.hf_dir / "config.json"
            raw = json.loads(config_file.read_text())
            raw["scoring_func"] = "softmax"
            config_file.write_text(json.dumps(raw))
        self.ids = _ids(SEEDS[name] + 100, SEQ_LEN, self.config["vocab_size"])
        self.logprobs = ref.reference_logprobs(self.model, self.ids)
        self._llm = None

    @property
    def llm(self) -> LLM:
        if self._llm is None:
            self._llm = LLM(str(self.hf_dir), dtype="float32")
        return self._llm


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            built[name] = Case(name, tmp_path_factory)
        return built[name]

    return get


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert len(outputs) == len(prompts)
    for out in outputs:
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == GREEDY_TOKENS
    return [list(out.outputs[0].token_ids) for out in outputs]


# ---------------------------------------------------------------------------------------------------------------------
# The reference itself must be a non-degenerate target
# ---------------------------------------------------------------------------------------------------------------------


def test_reference_outputs_are_not_degenerate(cases):
    case = cases("tiny")
    lp = case.logprobs
    assert lp.shape == (SEQ_LEN, case.config["vocab_size"])
    assert torch.isfinite(lp).all()
    # Different positions predict different things: a constant model would make a 1e-4 comparison vacuous.
    top1 = lp.argmax(dim=-1)
    assert len(set(top1.tolist())) > 20
    uniform = 1.0 / case.config["vocab_size"]
    assert float(lp.exp().max(dim=-1).values.mean()) > 5 * uniform
    assert float(lp.std(dim=-1).min()) > 0.3  # log-probabilities spread over units, not 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# forward_logprobs and greedy generation vs transformers
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_logprobs_match_transformers(cases, name):
    case = cases(name)
    ours = case.llm.forward_logprobs([case.ids])
    assert len(ours) == 1 and ours[0].dtype == torch.float32
    assert _max_diff(ours[0], case.logprobs) <= FP32_TOL


def test_softmax_oracle_is_not_sqrtsoftplus(cases):
    """The patched routers change the model, so the softmax comparison above cannot pass by accident."""
    case = cases("softmax")
    unpatched = ref.build_reference_model(case.config, SEEDS["softmax"])
    assert _max_diff(ref.reference_logprobs(unpatched, case.ids), case.logprobs) > 1e-2


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(cases, name):
    case = cases(name)
    prompt = case.ids[: GREEDY_PROMPT_LENS[0]]
    assert _greedy(case.llm, [prompt]) == [ref.reference_greedy(case.model, prompt, GREEDY_TOKENS)]


def test_batched_greedy_with_small_token_budget_matches_transformers(cases):
    """Two prompts of different lengths generated together, with prompts chunked by a 16-token step budget."""
    case = cases("tiny")
    llm = LLM(str(case.hf_dir), dtype="float32", max_num_batched_tokens=16)
    prompts = [case.ids[:n] for n in GREEDY_PROMPT_LENS]
    expected = [ref.reference_greedy(case.model, p, GREEDY_TOKENS) for p in prompts]
    assert _greedy(llm, prompts) == expected


def test_forward_logprobs_several_sequences(cases):
    case = cases("tiny")
    lengths = (SEQ_LEN, 57, 1)
    ours = case.llm.forward_logprobs([case.ids[:n] for n in lengths])
    for n, lp in zip(lengths, ours):
        # A prefix's no-cache forward equals the full sequence's first n rows (causal model).
        assert _max_diff(lp, case.logprobs[:n]) <= FP32_TOL


# ---------------------------------------------------------------------------------------------------------------------
# HF checkpoint layouts
# ---------------------------------------------------------------------------------------------------------------------


def test_sharded_hf_checkpoint(cases, tmp_path):
    case = cases("tiny")
    ref.save_hf_checkpoint(case.model, tmp_path, max_shard_size="300KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), dtype="float32")
    assert _max_diff(llm.forward_logprobs([case.ids])[0], case.logprobs) <= FP32_TOL
    prompt = case.ids[: GREEDY_PROMPT_LENS[0]]
    assert _greedy(llm, [prompt]) == [ref.reference_greedy(case.model, prompt, GREEDY_TOKENS)]


def test_hf_state_dict_names_checkpoint(cases, tmp_path):
    """transformers' own state_dict names (``model.layers.N.self_attn.q_a_proj``, stacked experts), one file."""
    from safetensors.torch import save_file

    case = cases("hca_first")
    state = {k: v.contiguous() for k, v in case.model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(case.config))
    llm = LLM(str(tmp_path), dtype="float32")
    assert _max_diff(llm.forward_logprobs([case.ids])[0], case.logprobs) <= FP32_TOL


# ---------------------------------------------------------------------------------------------------------------------
# Chunked prefill and decode, several cache slots in one batch
# ---------------------------------------------------------------------------------------------------------------------

LEN_A, LEN_B = 130, 90
CHUNKS_A = (37, 20, 5)
CHUNKS_B = (5, 37, 20)  # different boundaries, so the two sequences' compressor windows never line up


def _full_logprobs(target, ids: list[int]) -> torch.Tensor:
    cache = target.allocate_cache(1, len(ids) + 1)
    streams, _ = target(ForwardBatch.build([(0, ids, 0)]), cache)
    return target.logits(streams).log_softmax(dim=-1)


def _schedule(length: int, chunks: tuple[int, ...]) -> list[tuple[int, int]]:
    """[(start, end)] pieces: the prefill chunks, then one token at a time."""
    pieces, pos = [], 0
    for size in chunks:
        pieces.append((pos, pos + size))
        pos += size
    pieces.extend((p, p + 1) for p in range(pos, length))
    return pieces


@pytest.mark.parametrize("name", ["tiny", "all_csa_sigmoid", "hca_first"])
def test_chunked_prefill_and_decode_in_shared_batch(cases, name):
    case = cases(name)
    target = case.llm.loaded.target
    seq_a, seq_b = case.ids[:LEN_A], _ids(SEEDS[name] + 200, LEN_B, case.config["vocab_size"])
    full_a, full_b = _full_logprobs(target, seq_a), _full_logprobs(target, seq_b)
    # The dsv4 full forward is itself the transformers forward.
    assert _max_diff(full_a, case.logprobs[:LEN_A]) <= FP32_TOL

    slot_a, slot_b = 2, 0  # of 3 slots; slot 1 stays unused
    cache = target.allocate_cache(3, max(LEN_A, LEN_B) + 1)
    plan_a, plan_b = _schedule(LEN_A, CHUNKS_A), _schedule(LEN_B, CHUNKS_B)
    got_a, got_b = [], []
    for step in range(max(len(plan_a), len(plan_b))):
        work = []  # (slot, seq, start, end, sink); B first in the batch on odd steps
        if step < len(plan_a):
            work.append((slot_a, seq_a, *plan_a[step], got_a))
        if step < len(plan_b):
            entry = (slot_b, seq_b, *plan_b[step], got_b)
            work.insert(step % 2, entry)
        batch = ForwardBatch.build([(slot, seq[s:e], s) for slot, seq, s, e, _ in work])
        streams, _ = target(batch, cache)
        logprobs = target.logits(streams).log_softmax(dim=-1)
        for segment, (_, _, s, e, sink) in zip(batch.segments, work):
            assert segment.length == e - s
            sink.append(logprobs[segment.begin : segment.end])
    assert _max_diff(torch.cat(got_a), full_a) <= FP32_TOL
    assert _max_diff(torch.cat(got_b), full_b) <= FP32_TOL


# ---------------------------------------------------------------------------------------------------------------------
# Native quantized checkpoints vs transformers loading the same files
# ---------------------------------------------------------------------------------------------------------------------

NATIVE_FORMATS = {
    "fp8_fp4_e8m0": dict(dense="fp8", expert_dtype="fp4", scale_storage="e8m0"),
    "fp8_fp4_uint8": dict(dense="fp8", expert_dtype="fp4", scale_storage="uint8", shards=3),
    "fp8_fp8_float": dict(dense="fp8", expert_dtype="fp8", scale_fmt="float", expert_dtype_top_level=True),
}


@pytest.mark.parametrize("fmt", list(NATIVE_FORMATS))
def test_native_quantized_checkpoint_matches_transformers(cases, tmp_path, fmt):
    case = cases("tiny")
    native = ref.native_state_dict(case.model)
    stored = ref.write_native_checkpoint(tmp_path, case.config, native, **NATIVE_FORMATS[fmt])
    # The file really is in the intended format.
    scales = {stored[n].dtype for n in stored if n.endswith(".scale")}
    expert = stored["layers.2.ffn.experts.0.w1.weight"]
    if fmt.startswith("fp8_fp4"):
        assert expert.dtype == torch.int8
        assert scales == {torch.float8_e8m0fnu if fmt.endswith("e8m0") else torch.uint8}
    else:
        assert expert.dtype == torch.float8_e4m3fn and scales == {torch.float32}
    assert stored["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn

    oracle = ref.load_reference(tmp_path)
    expected = ref.reference_logprobs(oracle, case.ids)
    # Quantization changed the model (else this would only re-test the fp32 path).
    assert _max_diff(expected, case.logprobs) > 1e-3

    llm = LLM(str(tmp_path), dtype="float32")
    assert _max_diff(llm.forward_logprobs([case.ids])[0], expected) <= FP32_TOL
    prompt = case.ids[: GREEDY_PROMPT_LENS[0]]
    assert _greedy(llm, [prompt]) == [ref.reference_greedy(oracle, prompt, GREEDY_TOKENS)]


# ---------------------------------------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------------------------------------


def test_bfloat16_stays_close_to_float32(cases):
    case = cases("tiny")
    llm = LLM(str(case.hf_dir), dtype="bfloat16")
    assert llm.dtype == torch.bfloat16
    lp16 = llm.forward_logprobs([case.ids])[0]
    assert lp16.dtype == torch.float32 and lp16.shape == case.logprobs.shape
    assert torch.isfinite(lp16).all()
    p16, p32 = lp16.exp(), case.logprobs.exp()
    total_variation = 0.5 * (p16 - p32).abs().sum(dim=-1)  # per position, in [0, 1]
    agreement = float((lp16.argmax(-1) == case.logprobs.argmax(-1)).float().mean())
    # Observed over 4 prompts: mean TV 0.021-0.034, agreement 0.875-0.94; a different random model: TV 0.53,
    # agreement 0.0 (docs/model.md: transformers' own bf16 agrees on 82% of argmaxes).
    assert float(total_variation.mean()) < 0.1
    assert agreement >= 0.75
    assert not torch.equal(lp16, case.logprobs)  # really ran in bf16
