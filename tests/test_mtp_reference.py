"""dsv4's MTP drafter against an independent oracle built from transformers 5.23 pieces (docs/model.md).

transformers has no MTP module, so the oracle is assembled here, never from dsv4 code:

* the target's pre-hc_head stream S [T, hc, D] is the input of transformers' ``model.model.hc_head`` (a forward hook
  captures it during the ordinary no-cache forward of ``DeepseekV4ForCausalLM``);
* the MTP block is transformers' own ``DeepseekV4DecoderLayer``: a one-layer ``sliding_attention`` + ``moe`` model is
  loaded with the ``mtp.0.`` block tensors renamed ``layers.0.*`` (``reference.model_from_native_state``), with the
  MTP layer's ``hc_head_*`` / ``norm`` as its top-level hc_head / norm and the TARGET's embed / head. Its decoder
  layer is called the way ``DeepseekV4Model.forward`` calls it (rotary embeddings and sliding-window causal mask from
  transformers, no cache), but on the 3-D stream R0 at positions t+1, never on the first-layer broadcast;
* enorm / hnorm (fp32 RMSNorm over D, per stream) and e_proj / h_proj are four lines of plain torch:

    R0     = h_proj(hnorm(S_t)) + e_proj(enorm(embed(x_{t+1}))).unsqueeze(-2)     [T-1, hc, D]
    R      = block(R0) at positions t+1
    logits = head(norm(hc_head(R)))                                               predicts x_{t+2}

Compared in fp32: dsv4's S vs transformers' (<= 1e-4), dsv4's MTP log-softmax and R vs the oracle at every position
(<= 1e-4), the drafter fed token by token (and in uneven chunks) with its own cache vs its full forward, and a second
draft step (depth 1, fed R) vs the oracle applied to the oracle's R; and, dsv4 alone, that a fresh cache slot refuses
a start past position 0 (dsv4 runs the draft at the positions t of S; attention is relative, so the oracle's t+1
gives the same values). The oracle's way of calling decoder layers is itself checked against transformers' full
forward on the target. The sequence (60 tokens) is longer than the sliding window (32), and controls show that both
the window and h_proj change the logits by far more than the tolerance (so the comparisons have teeth).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import create_sliding_window_causal_mask

import reference as ref
from dsv4 import LLM
from dsv4.model.batch import ForwardBatch

FP32_TOL = 1e-4
CONTROL_MIN = 1e-2  # a perturbation the comparison must detect changes the logits by more than this
SEQ_LEN = 60  # > sliding_window (32): the MTP block's window really slides
TARGET_SEED, MTP_SEED, IDS_SEED = 21, 22, 23
CACHE_LEN = 64

CONFIG = ref.tiny_config()
MTP_PREFIX = "mtp.0."
# Tensors of an MTP layer outside its decoder block (docs/model.md).
MTP_INPUT_STACK = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight")
MTP_HEAD_STACK = ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")


# ------------------------------------------------------------------------------------------------------------------
# Oracle
# ------------------------------------------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """docs/model.md: RMSNorm over the last dim, in fp32."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class MTPOracle:
    """The MTP layer (docs/model.md) from transformers modules + plain torch, on batch-1 HF-layout tensors."""

    def __init__(self, target, native: dict[str, torch.Tensor], mtp: dict[str, torch.Tensor], config: dict):
        self.target = target
        self.eps = config["rms_norm_eps"]
        self.extra = {name: mtp[MTP_PREFIX + name].clone() for name in MTP_INPUT_STACK}
        block_config = dict(config, num_hidden_layers=1, layer_types=[ref.SLIDING], mlp_layer_types=[ref.MOE])
        block_native = {"embed.weight": native["embed.weight"], "head.weight": native["head.weight"]}
        for name, tensor in mtp.items():
            suffix = name.removeprefix(MTP_PREFIX)
            if suffix in MTP_INPUT_STACK:
                continue
            block_native[suffix if suffix in MTP_HEAD_STACK else f"layers.0.{suffix}"] = tensor
        # Raises on any mtp.0. tensor with no slot in a sliding + moe layer, and on a missing one.
        self.block_model = ref.model_from_native_state(block_config, block_native)
        self.config = self.block_model.config
        self.layer = self.block_model.model.layers[0]
        assert type(self.layer).__name__ == "DeepseekV4DecoderLayer"
        assert self.layer.self_attn.compressor is None and not self.layer.mlp.is_hash

    @torch.no_grad()
    def forward(self, streams: torch.Tensor, next_ids: list[int], start: int, full_window: bool = False, **extra):
        """streams: S at positions start-1.. [1, n, hc, D]; next_ids: x at positions start.. (n tokens).
        -> (R [1, n, hc, D], fp32 logits [n, V])."""
        weights = {**self.extra, **extra}
        input_ids = torch.tensor([next_ids], dtype=torch.long)
        embeds = self.target.model.embed_tokens(input_ids)  # the TARGET's embedding
        hnorm = _rms_norm(streams, weights["hnorm.weight"], self.eps)
        enorm = _rms_norm(embeds, weights["enorm.weight"], self.eps)
        r0 = F.linear(hnorm, weights["h_proj.weight"]) + F.linear(enorm, weights["e_proj.weight"]).unsqueeze(-2)
        r = run_decoder_layers(self.block_model.model, r0, input_ids, start, full_window=full_window)
        hidden = self.block_model.model.norm(self.block_model.model.hc_head(r))  # the MTP layer's own hc_head, norm
        logits = self.target.lm_head(hidden)  # the TARGET's head
        return r, logits[0].float()


@torch.no_grad()
def run_decoder_layers(hf_model, streams, input_ids, start: int, full_window: bool = False) -> torch.Tensor:
    """Run ``hf_model.layers`` (transformers ``DeepseekV4DecoderLayer``s) on the 3-D stream [1, n, hc, D] at positions
    start.., no cache, exactly as ``DeepseekV4Model.forward`` calls them (its rotary module, its sliding-window causal
    mask). ``full_window`` (controls only): plain causal attention over everything instead."""
    n = streams.shape[1]
    position_ids = torch.arange(start, start + n).unsqueeze(0)
    embeds = streams[:, :, 0]  # only shape / dtype / device are read from it
    if full_window:
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    else:
        mask = create_sliding_window_causal_mask(
            config=hf_model.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
            position_ids=position_ids,
        )
    rotary = hf_model.rotary_emb
    position_embeddings = {kind: rotary(embeds, position_ids=position_ids, layer_type=kind)
                           for kind in ("main", "compress")}
    for layer in hf_model.layers:  # eager attention windows through the mask only
        streams = layer(
            streams, position_embeddings=position_embeddings, position_ids=position_ids, attention_mask=mask,
            input_ids=input_ids, past_key_values=None,
        )
    return streams


# ------------------------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = ref.build_reference_model(CONFIG, TARGET_SEED)
    native = ref.native_state_dict(target)
    mtp = ref.random_mtp_tensors(CONFIG, MTP_SEED)
    path = tmp_path_factory.mktemp("mtp_ref") / "ckpt"
    ref.write_native_checkpoint(path, CONFIG, {**native, **mtp})
    llm = LLM(path, draft="mtp", dtype="float32")
    generator = torch.Generator().manual_seed(IDS_SEED)
    ids = torch.randint(2, CONFIG["vocab_size"], (SEQ_LEN,), generator=generator).tolist()
    return target, native, mtp, llm, ids


@pytest.fixture(scope="module")
def reference_streams(setup):
    """transformers' pre-hc_head stream S [1, T, hc, D] (the input of model.model.hc_head)."""
    target, _, _, _, ids = setup
    captured = []
    handle = target.model.hc_head.register_forward_hook(lambda module, args, output: captured.append(args[0]))
    try:
        with torch.no_grad():
            target(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        handle.remove()
    assert len(captured) == 1
    return captured[0].float()


@pytest.fixture(scope="module")
def oracle(setup):
    target, native, mtp, _, _ = setup
    return MTPOracle(target, native, mtp, CONFIG)


@pytest.fixture(scope="module")
def dsv4_full(setup):
    """dsv4's target streams S [T, hc, D] and the drafter's full forward (R [T-1, hc, D], logits [T-1, V])."""
    _, _, _, llm, ids = setup
    target, drafter = llm.loaded.target, llm.loaded.models["mtp"]
    streams, _ = target(ForwardBatch.build([(0, ids, 0)]), target.allocate_cache(1, CACHE_LEN))
    # The draft sequence runs at the positions t of S (relative attention: the oracle runs at t+1).
    r, logits = drafter(ForwardBatch.build([(0, ids[1:], 0)]), streams[:-1], drafter.allocate_cache(1, CACHE_LEN))
    return streams, r, logits


def _max_logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.log_softmax(a.float(), -1) - torch.log_softmax(b.float(), -1)).abs().max().item()


# ------------------------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------------------------


def test_oracle_is_a_sliding_moe_layer_with_every_mtp_tensor(setup, oracle):
    _, _, mtp, _, _ = setup
    # model_from_native_state loads strictly and raises on a native name it does not place, so every mtp.0 tensor
    # has a slot; count them anyway: block + head stack, plus the target's embed and head, = the one-layer model
    # (whose routed experts are 2 stacked tensors instead of 3 per expert).
    n_placed = sum(1 for n in mtp if n.removeprefix(MTP_PREFIX) not in MTP_INPUT_STACK) + 2
    assert n_placed == len(oracle.block_model.state_dict()) + 3 * CONFIG["n_routed_experts"] - 2
    assert oracle.layer.self_attn.sliding_window == CONFIG["sliding_window"] < SEQ_LEN - 1


def test_oracle_layer_calls_reproduce_transformers_forward(setup, reference_streams):
    """The way the oracle calls decoder layers reproduces DeepseekV4Model.forward: run on the target's own layers
    (first-layer broadcast input, positions 0..), it gives transformers' pre-hc_head stream."""
    target, _, _, _, ids = setup
    input_ids = torch.tensor([ids])
    embeds = target.model.embed_tokens(input_ids)
    broadcast = embeds.unsqueeze(2).expand(-1, -1, CONFIG["hc_mult"], -1).contiguous()
    streams = run_decoder_layers(target.model, broadcast, input_ids, start=0)
    assert (streams - reference_streams).abs().max().item() <= 1e-6


def test_target_stream_matches_transformers(dsv4_full, reference_streams):
    streams, _, _ = dsv4_full
    assert streams.shape == reference_streams.shape[1:]
    diff = (streams.float() - reference_streams[0]).abs().max().item()
    assert diff <= FP32_TOL, f"pre-hc_head stream S: max abs diff {diff:.3g}"


def _per_position_report(logits: torch.Tensor, logits_ref: torch.Tensor) -> tuple[float, str]:
    per_position = (torch.log_softmax(logits.float(), -1) - torch.log_softmax(logits_ref.float(), -1)).abs().amax(-1)
    bad = (per_position > FP32_TOL).nonzero().flatten().tolist()
    detail = f"max diff {per_position.max():.3g}; rows over {FP32_TOL:g}: {bad[:3]}..{bad[-3:]} ({len(bad)} rows)"
    return per_position.max().item(), detail


def test_mtp_logits_match_oracle(setup, dsv4_full, reference_streams, oracle):
    _, _, _, _, ids = setup
    _, r, logits = dsv4_full
    r_ref, logits_ref = oracle.forward(reference_streams[:, :-1], ids[1:], start=1)
    assert logits.shape == logits_ref.shape == (SEQ_LEN - 1, CONFIG["vocab_size"])
    assert logits.dtype == torch.float32
    diff, detail = _per_position_report(logits, logits_ref)
    assert diff <= FP32_TOL, f"MTP log-softmax vs oracle (row i = position i+1): {detail}"
    r_diff = (r.float() - r_ref[0]).abs().max().item()
    assert r_diff <= FP32_TOL, f"MTP output stream R: max abs diff {r_diff:.3g}"


def test_mtp_logits_match_oracle_on_dsv4_streams(setup, dsv4_full, oracle):
    """The drafter alone: the oracle fed dsv4's own S (isolates the MTP layer from the target)."""
    _, _, _, _, ids = setup
    streams, _, logits = dsv4_full
    _, logits_ref = oracle.forward(streams[:-1].float().unsqueeze(0), ids[1:], start=1)
    diff, detail = _per_position_report(logits, logits_ref)
    assert diff <= FP32_TOL, f"MTP log-softmax vs oracle on dsv4's S (row i = position i+1): {detail}"


def test_fresh_slot_refuses_a_start_past_zero(setup, dsv4_full):
    """A fresh slot holds no positions: a chunk starting at p > 0 would attend to the never-written rows
    max(0, p-W+1)..p-1 (zero K/V taking softmax mass). dsv4 refuses it rather than compute wrong logits;
    the draft sequence therefore runs at the positions t of its stream S, from 0."""
    _, _, _, llm, ids = setup
    drafter = llm.loaded.models["mtp"]
    streams, _, _ = dsv4_full
    with pytest.raises(ValueError, match="never written"):
        drafter(ForwardBatch.build([(0, ids[1:], 1)]), streams[:-1], drafter.allocate_cache(1, CACHE_LEN + 1))


@pytest.mark.parametrize("chunk", (1, 7))
def test_incremental_mtp_matches_full(setup, dsv4_full, chunk):
    """The drafter fed a chunk at a time, with its own cache, equals its full forward."""
    _, _, _, llm, ids = setup
    drafter = llm.loaded.models["mtp"]
    streams, r_full, logits_full = dsv4_full
    cache = drafter.allocate_cache(1, CACHE_LEN)
    rs, logits = [], []
    for begin in range(0, SEQ_LEN - 1, chunk):
        end = min(begin + chunk, SEQ_LEN - 1)
        batch = ForwardBatch.build([(0, ids[begin + 1:end + 1], begin)])
        r, step_logits = drafter(batch, streams[begin:end], cache)
        rs.append(r)
        logits.append(step_logits)
    diff = _max_logprob_diff(torch.cat(logits), logits_full)
    assert diff <= FP32_TOL, f"chunk={chunk}: incremental vs full MTP log-softmax max diff {diff:.3g}"
    r_diff = (torch.cat(rs).float() - r_full.float()).abs().max().item()
    assert r_diff <= FP32_TOL, f"chunk={chunk}: incremental vs full R max abs diff {r_diff:.3g}"


def test_second_draft_step_matches_oracle(setup, dsv4_full, reference_streams, oracle):
    """Depth 1 (R is the next step's S; the single MTP layer is reused): R at t+1 plus x_{t+2} predicts x_{t+3}."""
    _, _, _, llm, ids = setup
    drafter = llm.loaded.models["mtp"]
    _, r, _ = dsv4_full
    _, logits = drafter(ForwardBatch.build([(0, ids[2:], 0)]), r[:-1], drafter.allocate_cache(1, CACHE_LEN), depth=1)
    r_ref, _ = oracle.forward(reference_streams[:, :-1], ids[1:], start=1)
    _, logits_ref = oracle.forward(r_ref[:, :-1], ids[2:], start=2)
    diff, detail = _per_position_report(logits, logits_ref)
    assert diff <= FP32_TOL, f"depth-1 MTP log-softmax vs oracle (row i = position i+2): {detail}"


def test_controls_have_teeth(setup, reference_streams, oracle):
    """What the comparisons above must detect, measured on the oracle itself."""
    _, _, mtp, _, ids = setup
    _, logits = oracle.forward(reference_streams[:, :-1], ids[1:], start=1)
    # A perturbed mtp.0.h_proj.
    generator = torch.Generator().manual_seed(5)
    h_proj = mtp[MTP_PREFIX + "h_proj.weight"]
    perturbed = h_proj + 0.1 * torch.randn(h_proj.shape, generator=generator) / h_proj.shape[-1] ** 0.5
    _, logits_perturbed = oracle.forward(reference_streams[:, :-1], ids[1:], start=1, **{"h_proj.weight": perturbed})
    diff = _max_logprob_diff(logits, logits_perturbed)
    assert diff > CONTROL_MIN, f"perturbed h_proj changed the logits by only {diff:.3g}"
    # The sliding window matters: full causal attention changes the logits beyond the window only.
    _, logits_full_window = oracle.forward(reference_streams[:, :-1], ids[1:], start=1, full_window=True)
    window = CONFIG["sliding_window"]  # row i is position i+1; rows < W-1 see every earlier position either way
    inside = _max_logprob_diff(logits[:window - 1], logits_full_window[:window - 1])
    beyond = _max_logprob_diff(logits[window:], logits_full_window[window:])
    assert inside <= FP32_TOL, f"within the window, full attention should agree (diff {inside:.3g})"
    assert beyond > CONTROL_MIN, f"beyond the window, full attention changed the logits by only {beyond:.3g}"
    # The oracle itself is shift-invariant (what test_mtp_does_not_depend_on_absolute_start asks of dsv4).
    for start in (0, 5):
        _, shifted = oracle.forward(reference_streams[:, :-1], ids[1:], start=start)
        assert _max_logprob_diff(shifted, logits) <= FP32_TOL
