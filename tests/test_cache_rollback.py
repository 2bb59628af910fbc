"""Rolling back a verify chunk leaves no trace in the model cache (`ModelCache.snapshot` / `rewind`).

A verify chunk writes draft tokens into the window ring (row p % W) and the compressor rings (row p % R),
and may complete compressed windows (entries, indexer keys). Once a ring has wrapped, those rows belonged
to positions W (or R) earlier that the following queries still read, so rejecting two or more drafts
corrupts them unless they are restored.

Each case runs two contexts with the same chunk shapes, so that their arithmetic is identical: a prefix,
then a verify chunk of 1 + K tokens, rewound to keep its first 1 + KEEP tokens, then a replay of the
right continuation and decode steps. One context's verify chunk holds the right continuation, the other's
a wrong tail after the kept tokens; the replayed logits must be equal bit for bit, and close to a plain
run that never verified anything. Without the restore the same comparison fails (the control), so the
test can fail. Cases sit at the window's wrap (32, 64) and at windows of both compress rates (4 and 16)
completed inside the rejected tail, on the tiny config (sliding, CSA, HCA layers), with the chunks run
through the prefill path and as decode rows (`ForwardBatch.build`'s decode_span, what the engine does);
the two paths' logits also agree with each other.
"""

from __future__ import annotations

import pytest
import torch

import reference as ref
from dsv4 import LLM
from dsv4.engine.model_runner import Chunk
from dsv4.model.batch import ForwardBatch

VOCAB = 512
SEED = 5
K, KEEP = 4, 1  # a verify chunk of 1 + K tokens; the first KEEP drafts are accepted, K - KEEP rejected
DECODE_STEPS = 5
MAX_LEN = 96
PLAIN_TOL = 1e-4
# Prefix lengths L: the verify chunk covers positions [L, L + K]. 29: crosses the window wrap at 32 and
# completes a 4- and a 16-window at 31 inside the rejected tail; 44: completes the 16-window ending at 47;
# 61: crosses the second wrap (64) with a 4-window at 63.
PREFIXES = (29, 44, 61)
# decode_span: 1 runs every multi-token chunk through the prefill path; 8 (the tiny config's smallest ring,
# as the engine's runner sets it) runs the verify chunk and the replay as decode rows.
SPANS = {"prefill_path": 1, "decode_rows": 8}
PATH_TOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory, write_word_tokenizer):
    path = tmp_path_factory.mktemp("rollback")
    ref.save_hf_checkpoint(ref.build_reference_model(ref.tiny_config(), SEED), path)
    write_word_tokenizer(path, VOCAB)
    return LLM(str(path), dtype="float32", max_num_seqs=1, max_model_len=MAX_LEN).loaded.target


def _forward(model, cache, tokens, start, span=1):
    streams, _ = model(ForwardBatch.build([Chunk(0, list(tokens), start)], decode_span=span), cache)
    return model.logits(streams)


def _context(model, ids, prefix, verify_tokens, restore=True, span=1):
    """prefix tokens, the verify chunk (rewound to keep 1 + KEEP), the replay, then DECODE_STEPS single
    tokens; returns the logits of the replay and of every decode step."""
    cache = model.allocate_cache(1, MAX_LEN)
    _forward(model, cache, ids[:prefix], 0)
    snapshot = cache.snapshot([(0, prefix, 1 + K)])
    _forward(model, cache, verify_tokens, prefix, span)
    cache.rewind({0: prefix + 1 + KEEP}, snapshot if restore else None)
    assert cache.lengths[0] == prefix + 1 + KEEP
    replay_from = prefix + 1 + KEEP
    out = [_forward(model, cache, ids[replay_from : prefix + 1 + K], replay_from, span)]
    for p in range(prefix + 1 + K, prefix + 1 + K + DECODE_STEPS):
        out.append(_forward(model, cache, ids[p : p + 1], p))
    return torch.cat(out)


def _plain(model, ids, prefix):
    cache = model.allocate_cache(1, MAX_LEN)
    _forward(model, cache, ids[: prefix + 1 + KEEP], 0)
    return torch.cat([_forward(model, cache, ids[prefix + 1 + KEEP : prefix + 1 + K], prefix + 1 + KEEP)] + [
        _forward(model, cache, ids[p : p + 1], p) for p in range(prefix + 1 + K, prefix + 1 + K + DECODE_STEPS)])


def _ids(n):
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(SEED)).tolist()


@pytest.mark.parametrize("span", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("prefix", PREFIXES)
def test_rolled_back_tail_leaves_no_trace(model, prefix, span):
    ids = _ids(prefix + 1 + K + DECODE_STEPS)
    right = ids[prefix : prefix + 1 + K]
    wrong = right[: 1 + KEEP] + [(t + 7) % VOCAB for t in right[1 + KEEP :]]
    clean = _context(model, ids, prefix, right, span=span)
    rolled_back = _context(model, ids, prefix, wrong, span=span)
    assert torch.equal(clean, rolled_back)
    assert (clean - _plain(model, ids, prefix)).abs().max().item() <= PLAIN_TOL


@pytest.mark.parametrize("span", SPANS.values(), ids=SPANS.keys())
@pytest.mark.parametrize("prefix", PREFIXES)
def test_control_length_only_rewind_differs(model, prefix, span):
    """The same contexts rewound by length alone differ: the test above can fail."""
    ids = _ids(prefix + 1 + K + DECODE_STEPS)
    right = ids[prefix : prefix + 1 + K]
    wrong = right[: 1 + KEEP] + [(t + 7) % VOCAB for t in right[1 + KEEP :]]
    clean = _context(model, ids, prefix, right, restore=False, span=span)
    rolled_back = _context(model, ids, prefix, wrong, restore=False, span=span)
    assert (clean - rolled_back).abs().max().item() > PLAIN_TOL


@pytest.mark.parametrize("prefix", PREFIXES)
def test_verify_chunk_as_decode_rows_equals_prefill_path(model, prefix):
    """The verify chunk's logits (every row) and the decode steps after it: decode rows vs the prefill
    path, fp32, on the whole model (sliding, CSA and HCA layers)."""
    ids = _ids(prefix + 1 + K + DECODE_STEPS)
    runs = []
    for span in SPANS.values():
        cache = model.allocate_cache(1, MAX_LEN)
        _forward(model, cache, ids[:prefix], 0)
        out = [_forward(model, cache, ids[prefix : prefix + 1 + K], prefix, span)]
        out += [_forward(model, cache, ids[p : p + 1], p) for p in range(prefix + 1 + K, len(ids))]
        runs.append(torch.cat(out))
    assert (runs[0] - runs[1]).abs().max().item() <= PATH_TOL
    assert torch.equal(runs[0].argmax(-1), runs[1].argmax(-1))


def test_snapshot_refuses_a_chunk_longer_than_a_ring(model):
    cache = model.allocate_cache(1, MAX_LEN)
    limit = cache.rollback_limit()
    assert limit == 8  # the CSA compressor's ring: 2 * rate 4
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.snapshot([(0, 0, limit + 1)])


def test_rewind_before_the_snapshot_is_refused(model):
    cache = model.allocate_cache(1, MAX_LEN)
    _forward(model, cache, _ids(12), 0)
    snapshot = cache.snapshot([(0, 12, 3)])
    with pytest.raises(ValueError, match="did not save"):
        cache.rewind({0: 10}, snapshot)
