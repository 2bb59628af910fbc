"""The batched decode and prefill attention paths against the per-segment oracle (segment_attention.py;
fp32, <= 1e-5).

Each case prefills sequences of assorted lengths into identical caches, then runs decode steps in
which every sequence contributes one token (plus, in some steps, a prefill chunk of another
sequence): once through the oracle, once through the model. Outputs and every cache
tensor (window rings, compressor rings, emitted entries, indexer keys) must agree. The lengths
cover window wrap-around and tokens that complete CSA (m=4) and HCA (m=16) windows.
"""

import copy

import pytest
import torch

from dsv4.config import CSA, HCA, SLIDING, ModelConfig
from dsv4.embedded import EMBEDDED_MODELS
from dsv4.kernels.decode_attention_cpu import MAX_DECODE_ROWS
from dsv4.kernels.registry import DECODE_ATTENTION
from dsv4.model import attention as attention_module
from dsv4.model.attention import Attention
from dsv4.model.batch import ForwardBatch
from dsv4.model.cache import allocate_layer_cache, cache_tensors
from segment_attention import segment_attention

TOL = dict(rtol=1e-5, atol=1e-5)
SLOTS = 13  # one per prefill length, plus the late joiner
MAX_LEN = 160
# Prompt lengths: short (window not full), around W=32 (wrap), multiples of 4 and 16 +-1 (windows completing).
PREFILL_LENGTHS = [1, 2, 3, 7, 15, 16, 31, 32, 33, 47, 63, 64]
DECODE_STEPS = 20


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_file(EMBEDDED_MODELS["dsv4-tiny-dummy"][0])


def _random_attention(cfg: ModelConfig, layer_type: str, seed: int) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(cfg, layer_type, torch.float32)
    for name, p in attn.named_parameters():
        if name.endswith("norm.weight"):
            p.data.copy_(1 + 0.1 * torch.randn_like(p))
        else:
            p.data.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    return attn


def _run(attn, cache, chunks, x, batched: bool, decode_span: int = 1):
    batch = ForwardBatch.build(chunks, decode_span=decode_span)
    return attn(x, batch, cache) if batched else segment_attention(attn, x, batch, cache)


# How a decode step orders its rows' cache slots: one ascending run from slot 0 or from a later slot
# (the batched path reads the caches through views), or shuffled (it gathers them).
SLOT_ORDERS = ["ascending", "offset", "shuffled"]


def _order_chunks(chunks: list, order: str, step: int) -> list:
    if order == "offset":  # slots 0 and 1 sit this step out: the decode rows start at slot 2
        return [c for c in chunks if c[0] > 1 or len(c[1]) > 1]
    if order == "shuffled":
        perm = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(step))
        return [chunks[i] for i in perm]
    return chunks


def test_decode_meta_reads_contiguous_slots_as_views():
    cache = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    ascending = ForwardBatch.build([(slot, [0], 4) for slot in (2, 3, 4)]).plan.decode
    shuffled = ForwardBatch.build([(slot, [0], 4) for slot in (3, 2, 4)]).plan.decode
    assert ascending.slot_range == slice(2, 5) and shuffled.slot_range is None
    view = ascending.read(cache)
    # a view: no copy
    assert view.data_ptr() == cache[2].data_ptr()
    assert view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    torch.testing.assert_close(ascending.read(cache, 2), cache[2:5, :2], rtol=0, atol=0)
    torch.testing.assert_close(shuffled.read(cache, 2), cache[[3, 2, 4], :2], rtol=0, atol=0)


@pytest.mark.parametrize("order", SLOT_ORDERS)
@pytest.mark.parametrize("layer_type", [SLIDING, CSA, HCA])
@torch.no_grad()
def test_batched_decode_equals_reference(cfg, layer_type, order):
    attn = _random_attention(cfg, layer_type, seed=len(layer_type))
    g = torch.Generator().manual_seed(7)
    ref_cache = allocate_layer_cache(cfg, layer_type, SLOTS, MAX_LEN, torch.float32, "cpu")
    # Stale data in the slots, as left by earlier sequences: must never leak into a new sequence.
    for t in cache_tensors([ref_cache]):
        t.copy_(torch.randn(t.shape, generator=g))
    lengths = {}
    for slot, n in enumerate(PREFILL_LENGTHS):  # fresh sequences: prefill through the reference path
        _run(attn, ref_cache, [(slot, [0] * n, 0)], torch.randn(n, cfg.hidden_size, generator=g), False)
        lengths[slot] = n
    fast_cache = copy.deepcopy(ref_cache)
    late_slot = len(PREFILL_LENGTHS)  # a sequence that joins mid-flight with a multi-token chunk
    for step in range(DECODE_STEPS):
        joining = step % 5 == 2
        chunks = [(slot, [0], lengths[slot]) for slot in sorted(lengths) if not (joining and slot == late_slot)]
        if joining:
            chunks.insert(step % 3, (late_slot, [0] * 5, lengths.get(late_slot, 0)))
        chunks = _order_chunks(chunks, order, step)
        x = torch.randn(sum(len(c[1]) for c in chunks), cfg.hidden_size, generator=g)
        want = _run(attn, ref_cache, chunks, x, False)
        got = _run(attn, fast_cache, chunks, x, True)
        torch.testing.assert_close(got, want, **TOL)
        for a, b in zip(cache_tensors([fast_cache]), cache_tensors([ref_cache])):
            torch.testing.assert_close(a, b, **TOL)
        for slot, tokens, start in chunks:
            lengths[slot] = start + len(tokens)


# Prefill steps: (cache slot, chunk length, start position). They mix lengths in one step, continue
# chunks that start mid-window (W=32) and mid compressor window (m=4, 16), add decode rows (length 1),
# and reuse slots 1 and 2 for new sequences (start 0 over the previous sequences' data).
PREFILL_STEPS = [
    [(0, 7, 0), (1, 33, 0), (2, 1, 0), (3, 64, 0)],
    [(0, 10, 7), (1, 5, 33), (3, 17, 64), (4, 40, 0), (2, 3, 1)],
    [(0, 1, 17), (1, 1, 38), (2, 30, 4), (3, 1, 81), (4, 9, 40)],
    [(1, 20, 0), (0, 1, 18), (4, 2, 49), (2, 1, 34), (3, 45, 82)],
    [(2, 66, 0), (1, 1, 20), (0, 13, 19)],
]


@pytest.mark.parametrize("layer_type", [SLIDING, CSA, HCA])
@torch.no_grad()
def test_batched_prefill_equals_reference(cfg, layer_type):
    """All chunks of a step at once (padded; the single-token segments by the decode path) vs one
    segment at a time."""
    _check_prefill_steps(cfg, layer_type, PREFILL_STEPS, 3 + len(layer_type))


# Steps for the batched prefill's special layouts: only short chunks (at most topk = 8 CSA entries, so
# every visible entry is picked without scoring), chunks longer than 2 windows (W=32: query blocks of
# one window, with and without ring history), and equal-length chunks back to back (the padded layout
# is a view of the flat batch) in ascending and in shuffled slots.
SPECIAL_PREFILL_STEPS = [
    [(0, 7, 0), (1, 20, 0), (2, 16, 0)],
    [(0, 100, 7), (1, 70, 20), (2, 1, 16)],
    [(0, 50, 107), (1, 3, 90), (2, 16, 17)],
    [(3, 24, 0), (4, 24, 0), (5, 24, 0)],
    [(4, 24, 24), (5, 24, 24), (3, 24, 24)],
    [(3, 24, 48), (4, 24, 48), (5, 24, 48)],
]


@pytest.mark.parametrize("layer_type", [SLIDING, CSA, HCA])
@torch.no_grad()
def test_batched_prefill_tiles_blocks_and_views_equal_reference(cfg, layer_type, monkeypatch):
    """The batched prefill with the smallest attention tiles (one segment each) and one-window query
    blocks, over SPECIAL_PREFILL_STEPS, against the per-segment reference."""
    monkeypatch.setattr(attention_module, "TILE_LOGITS", 1)
    monkeypatch.setattr(attention_module, "QUERY_BLOCK_WINDOWS", 1)
    _check_prefill_steps(cfg, layer_type, SPECIAL_PREFILL_STEPS, 5 + len(layer_type))


def _check_prefill_steps(cfg, layer_type, prefill_steps, seed):
    attn = _random_attention(cfg, layer_type, seed=seed)
    g = torch.Generator().manual_seed(11)
    ref_cache = allocate_layer_cache(cfg, layer_type, SLOTS, MAX_LEN, torch.float32, "cpu")
    for t in cache_tensors([ref_cache]):  # stale data from earlier sequences must never leak in
        t.copy_(torch.randn(t.shape, generator=g))
    fast_cache = copy.deepcopy(ref_cache)
    for steps in prefill_steps:
        chunks = [(slot, [0] * length, start) for slot, length, start in steps]
        x = torch.randn(sum(length for _, length, _ in steps), cfg.hidden_size, generator=g)
        want = _run(attn, ref_cache, chunks, x, False)
        got = _run(attn, fast_cache, chunks, x, True)
        torch.testing.assert_close(got, want, **TOL)
        for a, b in zip(cache_tensors([fast_cache]), cache_tensors([ref_cache])):
            torch.testing.assert_close(a, b, **TOL)


# Verify-shaped steps (cache slot, chunk length, start position), run with decode_span=5 so that every
# chunk of up to 5 tokens is decoded as rows of its slot: single rows and 2..5-token chunks mixed, chunks
# that cross the window ring's wrap (W=32) and complete CSA (m=4) and HCA (m=16) windows, a fresh sequence
# starting at 0 over a slot's stale data, a chunk rewritten from an earlier position (after rejected
# drafts), and a longer prefill chunk in the same step (the prefill path).
VERIFY_SPAN = 5
VERIFY_STEPS = [
    [(0, 30, 0), (1, 14, 0), (2, 62, 0), (3, 5, 0)],
    [(0, 4, 30), (1, 3, 14), (2, 5, 62), (3, 1, 5), (4, 2, 0)],
    [(0, 5, 31), (1, 1, 17), (2, 2, 64), (3, 4, 6), (4, 3, 2), (5, 9, 0)],
    [(2, 5, 65), (0, 3, 34), (1, 5, 15), (4, 1, 5), (3, 2, 10)],
    [(0, 5, 36), (1, 4, 19), (2, 3, 70), (3, 5, 12), (5, 40, 9)],
]


@pytest.mark.parametrize("layer_type", [SLIDING, CSA, HCA])
@torch.no_grad()
def test_verify_chunks_as_decode_rows_equal_reference_and_prefill_path(cfg, layer_type):
    """Short chunks decoded as rows of their slot (decode_span) against the per-segment reference, and
    against the same steps through the prefill path (decode_span=1): outputs and every cache tensor."""
    attn = _random_attention(cfg, layer_type, seed=9 + len(layer_type))
    g = torch.Generator().manual_seed(13)
    ref_cache = allocate_layer_cache(cfg, layer_type, SLOTS, MAX_LEN, torch.float32, "cpu")
    for t in cache_tensors([ref_cache]):  # stale data from earlier sequences must never leak in
        t.copy_(torch.randn(t.shape, generator=g))
    rows_cache, prefill_cache = copy.deepcopy(ref_cache), copy.deepcopy(ref_cache)
    decoded_as_rows = 0
    for steps in VERIFY_STEPS:
        chunks = [(slot, [0] * length, start) for slot, length, start in steps]
        x = torch.randn(sum(length for _, length, _ in steps), cfg.hidden_size, generator=g)
        plan = ForwardBatch.build(chunks, decode_span=VERIFY_SPAN).plan
        decoded_as_rows += plan.decode is not None and plan.decode.spans is not None
        want = _run(attn, ref_cache, chunks, x, False)
        got = _run(attn, rows_cache, chunks, x, True, decode_span=VERIFY_SPAN)
        prefill = _run(attn, prefill_cache, chunks, x, True)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got, prefill, **TOL)
        for a, b, c in zip(cache_tensors([rows_cache]), cache_tensors([ref_cache]), cache_tensors([prefill_cache])):
            torch.testing.assert_close(a, b, **TOL)
            torch.testing.assert_close(a, c, **TOL)
    assert decoded_as_rows == len(VERIFY_STEPS)  # every step has a multi-row segment (slot 3 first at 0)


def test_decode_span_longer_than_a_ring_is_refused(cfg):
    """A chunk decoded as rows must fit every ring (it writes each of its positions' rows once)."""
    attn = _random_attention(cfg, SLIDING, seed=1)
    cache = allocate_layer_cache(cfg, SLIDING, 1, MAX_LEN, torch.float32, "cpu")
    span = cfg.sliding_window + 1
    with pytest.raises(ValueError, match="does not fit a ring"):
        _run(attn, cache, [(0, [0] * span, 0)], torch.zeros(span, cfg.hidden_size), True, decode_span=span)


def test_indexer_picks_break_ties_by_the_lowest_entry():
    """Scores with many exact ties (relu makes every entry whose head dots are all negative score exactly 0,
    whatever the chunk shape; weighted, of either sign), negative scores and masked tails: the picks are the
    k best entries, ties at the k-th score going to the lowest indices, in the order a brute-force ranking
    by (score desc, index asc) gives. A decode row and a prefill chunk then pick the same entries for the
    same scores."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (3, 5, 40), generator=g).float()
    scores[0] -= 2  # scores <= 0 (head weights may be negative): the k-th among the zeros or below
    scores[0, :, ::2] = scores[0, :, ::2].where(scores[0, :, ::2] != 0, -0.0)  # either sign of zero is one tie
    scores[0, :2] -= 1  # rows with no zero: the k-th among negative scores
    scores[1, :, 30:] = float("-inf")  # fewer entries visible than the rest
    scores[2, 0, 2:] = float("-inf")  # fewer visible than k
    scores[2, 1] = torch.randperm(40, generator=g).float()  # distinct scores: best first is not index order
    k = 6
    picks = attention_module.top_k_lowest_index_on_ties(scores, k)
    for row, got in zip(scores.view(-1, 40).tolist(), picks.view(-1, k).tolist()):
        assert got == sorted(range(40), key=lambda j: (-row[j], j))[:k]  # the ranking, in its order
    # The same rows laid out as one chunk or as single rows pick alike.
    assert torch.equal(attention_module.top_k_lowest_index_on_ties(scores.view(15, 1, 40), k).view(3, 5, k), picks)


class _Spy:
    """Counts the calls of DECODE_ATTENTION's kernel that it served (the registry's own instance)."""

    def __init__(self, attn: Attention, monkeypatch):
        self.served = 0
        registry, spy = attn.kernels, self
        kernel = registry.choose(DECODE_ATTENTION).impl
        assert kernel is not None, "the decode-attention C kernel did not build here"
        real_attend = kernel.attend

        def counting_attend(*args):
            spy.served += 1
            return real_attend(*args)

        monkeypatch.setattr(kernel, "attend", counting_attend)


class _TorchDecode:
    """A registry view that declines DECODE_ATTENTION only: the layer's decode rows then run its torch path
    (the kernel's reference), everything else as before."""

    def __init__(self, registry):
        self.registry = registry

    def kernel(self, op: str, *args):
        return None if op == DECODE_ATTENTION else self.registry.kernel(op, *args)


# bf16 caches and rows, within bf16 rounding: the kernel rounds where the torch path does, but its sums run in
# another order, so an entry may differ from the torch path's by one bf16 step.
BF16_TOL = dict(rtol=3e-2, atol=3e-2)
DECODE_KERNEL_CASES = [  # (layer type, tied indexer scores, dtype, decode steps)
    (SLIDING, False, torch.float32, 72), (CSA, False, torch.float32, 72), (CSA, True, torch.float32, 72),
    (HCA, False, torch.float32, 72),
    # bf16 CSA stays below k + 1 entries (positions < 36): a one-step difference in an entry could flip a near
    # tie between the k-th and the next pick, which then attends to another entry.
    (CSA, False, torch.bfloat16, 30), (HCA, False, torch.bfloat16, 72),
]


@pytest.mark.parametrize(("layer_type", "tied", "dtype", "steps"), DECODE_KERNEL_CASES)
@torch.no_grad()
def test_decode_kernel_rows_equal_reference(cfg, layer_type, tied, dtype, steps, monkeypatch):
    """Decode steps of 1 to 4 single-token rows (the rows the C kernel serves, `MAX_DECODE_ROWS`), slots
    shuffled, sequences joining mid-flight at position 0 over stale slot data and others running past the window
    (W=32) and through many CSA (m=4) / HCA (m=16) windows: the kernel's outputs and every cache tensor equal
    the layer's torch decode path's and the per-segment oracle's. `tied`: the indexer's queries are zero, so
    every entry scores exactly 0 and the picks are the lowest-index entries (the tie rule, which the oracle's
    plain topk does not have: there the kernel is held to the torch path only). bf16: against the torch path,
    within bf16 rounding."""
    attn = _random_attention(cfg, layer_type, seed=len(layer_type) + 3)
    if tied and attn.indexer is not None:
        attn.indexer.wq_b.weight.zero_()
    if dtype != torch.float32:  # the same weights at rest in dtype (norm weights, ape and sinks stay fp32)
        weights = attn.state_dict()
        attn = Attention(cfg, layer_type, dtype)
        attn.load_state_dict(weights)
    tol = TOL if dtype == torch.float32 else BF16_TOL
    spy = _Spy(attn, monkeypatch)
    kernels = attn.kernels
    g = torch.Generator().manual_seed(11)
    oracle_cache = allocate_layer_cache(cfg, layer_type, 5, MAX_LEN, dtype, "cpu")
    for t in cache_tensors([oracle_cache]):
        t.copy_(torch.randn(t.shape, generator=g))
    torch_cache, kernel_cache = copy.deepcopy(oracle_cache), copy.deepcopy(oracle_cache)
    lengths = {}
    for step in range(steps):
        if step in (0, 20, 41, 60):  # a new sequence in the next free slot, or slot 1 reused
            lengths[len(lengths) if step < 60 else 1] = 0
        chunks = [(slot, [0], n) for slot, n in lengths.items()]
        chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=g)]
        x = torch.randn(len(chunks), cfg.hidden_size, generator=g).to(dtype)
        attn.kernels = _TorchDecode(kernels)
        want = _run(attn, torch_cache, chunks, x, True)
        attn.kernels = kernels
        got = _run(attn, kernel_cache, chunks, x, True)
        torch.testing.assert_close(got, want, **tol)
        if dtype == torch.float32 and not tied:
            torch.testing.assert_close(got, _run(attn, oracle_cache, chunks, x, False), **TOL)
        for slot, _, n in chunks:
            lengths[slot] = n + 1
    for a, b in zip(cache_tensors([kernel_cache]), cache_tensors([torch_cache])):
        torch.testing.assert_close(a, b, **tol)
    assert spy.served == steps


def test_decode_kernel_declines_what_it_cannot_serve(cfg):
    """More rows than it serves and rows of a dtype it has no path for run the torch path (inside a graph being
    captured the registry declines every C kernel's op: test_kernels.py)."""
    attn = _random_attention(cfg, CSA, seed=2)
    kernel = attn.kernels.choose(DECODE_ATTENTION).impl
    cache = allocate_layer_cache(cfg, CSA, MAX_DECODE_ROWS + 1, MAX_LEN, torch.float32, "cpu")

    def args(rows: int, dtype=torch.float32):
        q = torch.zeros(rows, attn.n_heads, attn.head_dim, dtype=dtype)
        kv = torch.zeros(rows, attn.head_dim, dtype=dtype)
        index_q = torch.zeros(rows, attn.indexer.n_heads, attn.indexer.head_dim)
        index = (index_q, torch.zeros(rows, attn.indexer.n_heads), cache.indexer.entries, attn.indexer.topk)
        slots = torch.arange(rows)
        return q, kv, cache.window, slots, slots, cache.compressor.entries, attn.compressor.rate, index, attn.attn_sink

    assert kernel.supports(*args(MAX_DECODE_ROWS))
    assert not kernel.supports(*args(MAX_DECODE_ROWS + 1))
    assert not kernel.supports(*args(1, torch.bfloat16))  # bf16 rows on fp32 caches
    assert not kernel.supports(*args(1, torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_type", [CSA, HCA, SLIDING])
def test_decode_kernel_rows_spread_over_the_pool_equal_one_thread(cfg, layer_type, dtype):
    """The kernel spreads a call's rows over the few-row kernels' worker pool in chunks: outputs and window
    rings bit for bit those of the same rows on one thread, for as many rows as it serves (slots shuffled,
    positions from the first to past the window and through many compressed entries)."""
    from dsv4.kernels.decode_attention_cpu import DecodeAttentionKernel, build_library

    pooled = _random_attention(cfg, layer_type, seed=5).kernels.choose(DECODE_ATTENTION).impl
    assert pooled._pool is not None, "the decode-attention kernel got no worker pool"
    alone = DecodeAttentionKernel(build_library(), None)
    attn = _random_attention(cfg, layer_type, seed=5)
    rows = MAX_DECODE_ROWS
    g = torch.Generator().manual_seed(17)
    cache = allocate_layer_cache(cfg, layer_type, rows, MAX_LEN, dtype, "cpu")
    for t in cache_tensors([cache]):
        t.copy_(torch.randn(t.shape, generator=g))
    slots = torch.randperm(rows, generator=g)
    positions = torch.randint(0, MAX_LEN - 1, (rows,), generator=g)
    positions[:3] = torch.tensor([0, 1, cfg.sliding_window - 1])
    q = torch.randn(rows, attn.n_heads, attn.head_dim, generator=g).to(dtype)
    kv = torch.randn(rows, attn.head_dim, generator=g).to(dtype)
    entries = rate = index = None
    if attn.compressor is not None:
        entries, rate = cache.compressor.entries, attn.compressor.rate
    if attn.indexer is not None:
        index_q = torch.randn(rows, attn.indexer.n_heads, attn.indexer.head_dim, generator=g).to(dtype)
        index_w = torch.randn(rows, attn.indexer.n_heads, generator=g).to(dtype)
        index = (index_q, index_w, cache.indexer.entries, attn.indexer.topk)
    window = cache.window.clone()
    args = (q, kv, window, slots, positions, entries, rate, index, attn.attn_sink)
    assert pooled.supports(*args)
    with pooled._pool.pinned_threads(4):  # chunks of two rows, taken by whichever threads the pool has
        got = pooled.attend(*args)
    got_window = window.clone()
    window.copy_(cache.window)
    want = alone.attend(*args)
    assert torch.equal(got.view(torch.uint8 if dtype == torch.float32 else torch.int16),
                       want.view(torch.uint8 if dtype == torch.float32 else torch.int16))
    assert torch.equal(got_window, window)


@pytest.mark.parametrize("layer_type", [CSA, HCA, SLIDING])
def test_decode_kernel_without_avx512_equals_the_vector_build(cfg, layer_type):
    """A build for a CPU without AVX-512 (the logits' dot products and the weighted keys in plain C)
    gives what this CPU's build gives, to fp32 rounding (its sums round each product where the vector build
    fuses them)."""
    import platform

    from dsv4.kernels.decode_attention_cpu import DecodeAttentionKernel, build_library

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-march names a CPU without AVX-512 on x86-64 only")
    attn = _random_attention(cfg, layer_type, seed=9)
    kernels = {"native": DecodeAttentionKernel(build_library(), None),
               "plain": DecodeAttentionKernel(build_library(march="x86-64-v2"), None)}
    rows = 6
    g = torch.Generator().manual_seed(29)
    cache = allocate_layer_cache(cfg, layer_type, rows, MAX_LEN, torch.float32, "cpu")
    for t in cache_tensors([cache]):
        t.copy_(torch.randn(t.shape, generator=g))
    slots, positions = torch.randperm(rows, generator=g), torch.randint(0, MAX_LEN - 1, (rows,), generator=g)
    q, kv = torch.randn(rows, attn.n_heads, attn.head_dim, generator=g), torch.randn(rows, attn.head_dim, generator=g)
    entries = rate = index = None
    if attn.compressor is not None:
        entries, rate = cache.compressor.entries, attn.compressor.rate
    if attn.indexer is not None:
        index = (torch.randn(rows, attn.indexer.n_heads, attn.indexer.head_dim, generator=g) * 0.1,
                 torch.randn(rows, attn.indexer.n_heads, generator=g), cache.indexer.entries, attn.indexer.topk)
    out = {}
    for name, kernel in kernels.items():
        window = cache.window.clone()
        out[name] = kernel.attend(q, kv, window, slots, positions, entries, rate, index, attn.attn_sink)
    torch.testing.assert_close(out["plain"], out["native"], **TOL)
