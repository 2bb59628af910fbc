"""dsv4's DSpark drafter against the independent fp32 re-implementation of the released forward
(tests/dspark_reference.py), on a tiny checkpoint written by hand (target from transformers' randomised
model, drafter tensors under their released names), for both releases (V4-Flash-DSpark and V4.1).

The target's features come from transformers (forward hooks on its decoder layers: outputs for V4, inputs
for V4.1), dsv4's from its own target with `capture_layers`; each side then builds its context ring and
drafts. Compared in fp32: the features, main_x, every stage's ring (in position order, before and after it
wraps, filled by prefill chunks and by multi-token accepts), the head hidden (hc_head output), the base and
Markov-corrected logits, the greedy drafts and the confidences. Controls show the comparisons have teeth:
the ring's oldest row and the last noise slot both move the compared values by far more than the tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import dspark_reference as dref
import reference as ref
from dsv4 import LLM
from dsv4.engine import dspark_draft
from dsv4.model.batch import ForwardBatch
from dsv4.model.dspark import StageContext

FP32_TOL = 1e-4
CONTROL_MIN = 1e-2  # a change the comparisons must see moves the values by more than this
TARGET_SEED, DSPARK_SEED, IDS_SEED = 31, 32, 33
CACHE_LEN = 96
SEQ_LEN = 58  # > sliding_window (32): the ring wraps
SHORT = 20  # < sliding_window: the ring has not wrapped yet
# How the positions are committed: two prefill chunks, then accepts of 1..4 tokens (anchor + accepted drafts).
COMMITS = (13, 7, 1, 3, 2, 4, 1, 11, 2, 4, 3, 2, 5)
assert sum(COMMITS) == SEQ_LEN and sum(COMMITS[:2]) == SHORT

DSPARK_FIELDS = {"dspark_block_size": 5, "dspark_noise_token_id": 7, "dspark_markov_rank": 8, "n_mtp_layers": 3}
VARIANTS = {
    "v4-flash-dspark": {"dspark_target_layer_ids": [1, 3]},
    # V4.1 reads layer inputs: layer 0's is the embedding itself.
    "v4.1": {"dspark_target_layer_ids": [0, 2], "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2},
}


class Setup:
    def __init__(self, root, variant: str):
        self.config = ref.tiny_config(**DSPARK_FIELDS, **VARIANTS[variant])
        self.v41 = variant == "v4.1"
        self.hf = ref.build_reference_model(ref.tiny_config(), TARGET_SEED)
        native = ref.native_state_dict(self.hf)
        drafter_tensors = dref.released_dspark_tensors(self.config, DSPARK_SEED)
        root.mkdir(parents=True, exist_ok=True)
        (root / "config.json").write_text(json.dumps(dict(self.config, torch_dtype="float32")))
        tensors = {name: t.contiguous() for name, t in {**native, **drafter_tensors}.items()}
        save_file(tensors, str(root / "model.safetensors"))
        self.llm = LLM(root, draft="dspark", dtype="float32")
        self.oracle = dref.DSparkReference(self.config, {**native, **drafter_tensors})
        generator = torch.Generator().manual_seed(IDS_SEED)
        self.ids = torch.randint(2, self.config["vocab_size"], (SEQ_LEN + 1,), generator=generator).tolist()
        self.features = self._hf_features()

    @torch.no_grad()
    def _hf_features(self) -> torch.Tensor:
        """transformers' features [SEQ_LEN, D * n]: per target layer, its output (V4) or input (V4.1) stream
        averaged over hc, concatenated in ascending layer order."""
        captured, handles = {}, []
        for i, layer in enumerate(self.hf.model.layers):
            if self.v41:
                hook = lambda module, args, kwargs, i=i: captured.__setitem__(i, kwargs.get("hidden_states", args[0]))
                handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                handles.append(layer.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out)))
        try:
            self.hf(input_ids=torch.tensor([self.ids[:SEQ_LEN]]), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        layers = self.config["dspark_target_layer_ids"]
        return torch.cat([captured[i][0].float().mean(dim=1) for i in layers], dim=-1)


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request, tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("dspark_ref") / request.param, request.param)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= FP32_TOL * max(1.0, want.abs().max().item()), f"{what}: max diff {diff}"


@torch.no_grad()
def _run(setup: Setup, commits: tuple[int, ...], rollback: int = 0):
    """dsv4 and the oracle each commit `commits` positions in turn; returns their drafts from there."""
    target, drafter = setup.llm.loaded.target, setup.llm.loaded.models["dspark"]
    target_cache = target.allocate_cache(1, CACHE_LEN)
    cache = drafter.allocate_cache(1, CACHE_LEN, rollback=rollback)
    ring = setup.oracle.new_ring()
    start = 0
    for count in commits:
        batch = ForwardBatch.build([(0, setup.ids[start : start + count], start)])
        _, captured = target(batch, target_cache, capture_layers=drafter.capture_layers)
        features = drafter.features(captured, batch.token_ids)
        _close(features, setup.features[start : start + count], f"features at {start}")
        _close(drafter.main_x(features), setup.oracle.main_x(setup.features[start : start + count]), "main_x")
        drafter.commit(cache, batch, captured)
        setup.oracle.commit(ring, setup.features[start : start + count], start)
        start += count
    return drafter, cache, ring, start


@pytest.mark.parametrize("commits", [(SHORT,), COMMITS[:2], COMMITS], ids=["prefill", "chunks", "wrapped+accepts"])
def test_draft_matches_reference(setup, commits):
    drafter, cache, ring, length = _run(setup, commits)
    oracle = setup.oracle
    rows = cache.context_rows([0])
    assert cache.lengths == [length] == [ring["count"]]
    for stage in range(oracle.stages):
        want = oracle.ring_by_position(ring, stage)  # [min(length, window), hd]
        got = cache.read(stage, rows)[0, -want.shape[0] :]
        _close(got, want, f"ring of stage {stage}")
        assert bool((rows.bias[0, : -want.shape[0]] == float("-inf")).all())  # rows before position 0: hidden

    anchor = setup.ids[length]
    hidden_ref, base_ref = oracle.draft_hidden(ring, oracle.block_tokens(anchor))
    tokens_ref, logits_ref, confidence_ref = oracle.markov_greedy(base_ref, anchor, hidden_ref)
    contexts = [StageContext(cache.read(s, rows), rows.bias) for s in range(oracle.stages)]
    with torch.no_grad():
        hidden, base = drafter.forward(drafter.draft_blocks(torch.tensor([anchor]), torch.tensor([length])), contexts)
    _close(hidden[0], hidden_ref, "head hidden (hc_head output)")
    _close(base[0], base_ref, "base logits")
    draft = dspark_draft.draft(drafter, cache, [0], [anchor])
    _close(draft.logits[0], logits_ref, "Markov-corrected logits")
    assert draft.tokens[0].tolist() == tokens_ref.tolist()
    _close(draft.confidence[0], confidence_ref, "confidence")


def test_ring_with_rollback_rows_reads_the_same_window(setup):
    """A ring with rollback rows places positions differently but shows a draft the same last window."""
    drafter, cache, _, length = _run(setup, COMMITS)
    _, wider, _, _ = _run(setup, COMMITS, rollback=5)
    assert wider.ring_len == cache.ring_len + 5
    for stage in range(len(drafter.mtp)):
        wide, narrow = wider.read(stage, wider.context_rows([0])), cache.read(stage, cache.context_rows([0]))
        assert torch.equal(wide, narrow)
    one = dspark_draft.draft(drafter, cache, [0], [setup.ids[length]])
    two = dspark_draft.draft(drafter, wider, [0], [setup.ids[length]])
    assert torch.equal(one.logits, two.logits)


def test_oldest_context_row_matters(setup):
    """Control for the ring comparison: hiding the oldest visible context row changes the draft's logits."""
    drafter, cache, _, length = _run(setup, COMMITS)
    rows = cache.context_rows([0])
    contexts = [StageContext(cache.read(s, rows), rows.bias) for s in range(len(drafter.mtp))]
    hidden_oldest = rows.bias.clone()
    hidden_oldest[0, 0] = float("-inf")
    fewer = [StageContext(c.keys, hidden_oldest) for c in contexts]
    blocks = drafter.draft_blocks(torch.tensor([setup.ids[length]]), torch.tensor([length]))
    with torch.no_grad():
        _, base = drafter.forward(blocks, contexts)
        _, base_fewer = drafter.forward(blocks, fewer)
    assert (base - base_fewer).abs().max().item() > CONTROL_MIN


def test_block_is_bidirectional(setup):
    """Every block query sees every block row: changing the LAST noise slot changes slot 0's logits (a causal
    block would leave them untouched), and dsv4 and the oracle agree on the changed block too."""
    drafter, cache, ring, length = _run(setup, COMMITS[:2])
    anchor = setup.ids[length]
    tokens = setup.oracle.block_tokens(anchor)
    changed = [*tokens[:-1], tokens[-1] + 1]
    rows = cache.context_rows([0])
    contexts = [StageContext(cache.read(s, rows), rows.bias) for s in range(len(drafter.mtp))]
    outs = []
    for block in (tokens, changed):
        blocks = drafter.draft_blocks(torch.tensor([anchor]), torch.tensor([length]))
        blocks = type(blocks)(torch.tensor(block), blocks.positions, blocks.n_blocks, blocks.block_size)
        with torch.no_grad():
            _, base = drafter.forward(blocks, contexts)
        _close(base[0], setup.oracle.draft_hidden(ring, block)[1], "base logits of the block")
        outs.append(base[0])
    assert (outs[0][0] - outs[1][0]).abs().max().item() > CONTROL_MIN


def test_rewind_then_recommit_equals_never_rewound(setup):
    """Committing a wrong tail, rewinding and committing the right positions gives exactly the ring of a
    sequence that never rewound (the rollback rows keep what the rewind needs); a rewind further back than
    the rollback rows allow is refused."""
    target, drafter = setup.llm.loaded.target, setup.llm.loaded.models["dspark"]
    length, tail = SEQ_LEN, 4
    wrong = [(i * 7 + 3) % setup.config["vocab_size"] for i in range(tail)]

    def captured(ids: list[int]) -> dict[int, torch.Tensor]:
        batch = ForwardBatch.build([(0, ids, 0)])
        return target(batch, target.allocate_cache(1, CACHE_LEN), capture_layers=drafter.capture_layers)[1]

    def rows(streams: dict[int, torch.Tensor], begin: int, end: int) -> dict[int, torch.Tensor]:
        return {layer: s[begin:end] for layer, s in streams.items()}

    right = captured(setup.ids[:length])
    wrong_streams = captured(setup.ids[: length - tail] + wrong)
    clean = drafter.allocate_cache(1, CACHE_LEN)
    drafter.commit(clean, ForwardBatch.build([(0, setup.ids[:length], 0)]), right)
    cache = drafter.allocate_cache(1, CACHE_LEN, rollback=tail)
    drafter.commit(cache, ForwardBatch.build([(0, setup.ids[: length - tail], 0)]), rows(right, 0, length - tail))
    drafter.commit(cache, ForwardBatch.build([(0, wrong, length - tail)]), rows(wrong_streams, length - tail, length))
    cache.rewind(0, length - tail)
    drafter.commit(cache, ForwardBatch.build([(0, setup.ids[length - tail : length], length - tail)]),
                   rows(right, length - tail, length))
    assert cache.lengths == clean.lengths == [length]
    for stage in range(len(drafter.mtp)):
        assert torch.equal(cache.read(stage, cache.context_rows([0])), clean.read(stage, clean.context_rows([0])))
    with pytest.raises(ValueError, match="already overwritten"):
        cache.rewind(0, length - tail - 1)
