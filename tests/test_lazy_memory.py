"""lazy_zeros: a zero tensor whose memory is taken where it is written; the engine's caches are built of them.

Two ways of seeing memory: RssAnon (the process's anonymous resident pages) read in a fresh interpreter, so
that nothing else this test process allocates moves the numbers; and mincore(2) on one tensor's pages, which
says exactly which pages of it were ever touched (read or written) whatever else the process does.
"""

import ctypes
import json
import mmap
import subprocess
import sys
import textwrap

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.lazy_memory import LAZY_MIN_BYTES, lazy_zeros
from dsv4.model.cache import cache_tensors

MIB = 2**20
LIBC = ctypes.CDLL(None, use_errno=True)

PROBE = textwrap.dedent(
    """
    import json, torch
    from dsv4.lazy_memory import lazy_zeros

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    out = {"start": anon()}
    buffer = lazy_zeros((64, 1024, 1024), torch.float32)  # 256 MiB: 64 rows of 4 MiB
    out["created"] = anon()
    out["reads_zero"] = bool((buffer.sum(dim=(1, 2)) == 0).all())
    out["after_read"] = anon()
    buffer[:4].fill_(1.5)  # 16 MiB written
    out["after_write"] = anon()
    out["written_values"] = float(buffer[:4].mean()) == 1.5 and float(buffer[4:].abs().max()) == 0
    view = buffer[8:12]
    del buffer
    out["view_alive"] = anon()
    view.fill_(2.0)
    del view
    out["after_free"] = anon()
    print(json.dumps(out))
    """
)


def test_memory_is_taken_where_written_and_given_back_with_the_last_tensor():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["created"] - m["start"] < 4 * MIB  # a 256 MiB zero tensor costs nothing up front
    assert m["reads_zero"] and m["after_read"] - m["start"] < 4 * MIB  # reading maps the zero page
    assert 15 * MIB < m["after_write"] - m["after_read"] < 20 * MIB  # the 16 MiB written, about nothing more
    assert m["written_values"]
    assert m["view_alive"] - m["after_write"] > -2 * MIB  # a view keeps the mapping
    assert m["after_free"] - m["start"] < 4 * MIB  # the mapping goes with its last tensor


def test_tensor_is_plain_contiguous_and_owns_its_storage():
    buffer = lazy_zeros((200, 250), torch.bfloat16)
    assert buffer.nbytes >= LAZY_MIN_BYTES and _lazy(buffer)
    assert buffer.is_contiguous() and buffer._base is None and buffer.dtype == torch.bfloat16
    assert buffer.shape == (200, 250) and not bool(buffer.any())
    with torch.inference_mode():  # an engine may allocate a scratch cache inside inference mode
        assert not bool(lazy_zeros((200, 250), torch.float32).any())


def test_small_buffers_and_other_devices_are_plain_zeros():
    small = lazy_zeros((4, 8), torch.bfloat16)
    assert not _lazy(small) and small.dtype == torch.bfloat16 and not bool(small.any())
    meta = lazy_zeros((64, 1024, 1024), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (64, 1024, 1024)


# ---- the engine's caches ----
def _lazy(tensor: torch.Tensor) -> bool:
    """Whether a tensor sits on a mapping of its own (page-aligned, at least LAZY_MIN_BYTES)."""
    return tensor.nbytes >= LAZY_MIN_BYTES and tensor.data_ptr() % mmap.PAGESIZE == 0


def _touched_pages(tensor: torch.Tensor) -> list[int]:
    """Indices of the tensor's pages that were ever read or written (mincore: present in the page table)."""
    pages = -(-tensor.untyped_storage().nbytes() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if LIBC.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return [i for i, v in enumerate(vec) if v & 1]


def _slot_pages(tensor: torch.Tensor, slot: int) -> range:
    row = tensor.nbytes // tensor.shape[0]
    return range(slot * row // mmap.PAGESIZE, -(-(slot + 1) * row // mmap.PAGESIZE))


SLOTS, MAX_LEN = 16, 1024  # the tiny model: window rings of 64 KiB, CSA entries of 512 KiB per layer


@pytest.fixture(scope="module")
def llm():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM("dsv4-tiny-dummy", dtype="float32", max_num_seqs=SLOTS, max_model_len=MAX_LEN)
    torch.set_num_threads(saved)


def test_engine_caches_are_untouched_at_start_up_and_a_short_request_touches_its_slot_only(llm):
    """Start-up leaves every cache page untouched; a 12 + 8 token request writes its slot's first rows and
    reads nothing of the other slots; a second request reuses the freed slot (no fresh slot is touched)."""
    tensors = [t for t in cache_tensors(llm.engine.runner.cache.layers) if _lazy(t)]
    nominal = sum(t.nbytes for t in tensors)
    assert nominal > 2 * MIB and {tuple(t.shape[:1]) for t in tensors} == {(SLOTS,)}
    assert all(not _touched_pages(t) for t in tensors)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for seed in (0, 1):
        prompt = torch.randint(2, 256, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 8
        touched = 0
        for tensor in tensors:
            pages = _touched_pages(tensor)
            slot = _slot_pages(tensor, 0)
            assert pages and all(p in slot for p in pages), tuple(tensor.shape)
            # 20 positions: at most the rows they fill, rounded out to pages at both ends.
            row_bytes = tensor.nbytes // (tensor.shape[0] * tensor.shape[1])
            assert len(pages) <= -(-min(20, tensor.shape[1]) * row_bytes // mmap.PAGESIZE) + 1, tuple(tensor.shape)
            touched += len(pages) * mmap.PAGESIZE
        assert touched < nominal / SLOTS  # less than one slot's full size


def _prefilled(share: bool, n: int):
    """A fresh engine right after its one request's prompt: (its lazy cache tensors, the request's sequences)."""
    llm = LLM("dsv4-tiny-dummy", dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN, share_prompt_prefill=share)
    prompt = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    request = llm.engine.add_request("r", prompt, SamplingParams(n=n, max_tokens=4, ignore_eos=True))
    while any(not seq.output_ids for seq in request.seqs):
        llm.engine.step()
    assert llm.engine.shared_prefills == (n - 1 if share else 0)
    return [t for t in cache_tensors(llm.engine.runner.cache.layers) if _lazy(t)], request.seqs


def test_a_forked_prompt_touches_the_pages_a_prefill_of_its_own_would():
    """Shared prompt prefill copies only the rows a prompt wrote: right after the fork, the leader's and every
    follower's slot have exactly as many touched pages as a prefill of that prompt on its own, all in their slots."""
    shared, seqs = _prefilled(True, 3)
    alone, _ = _prefilled(False, 1)
    for tensor, reference in zip(shared, alone, strict=True):
        expected = len(_touched_pages(reference))
        pages = set(_touched_pages(tensor))
        per_slot = [pages & set(_slot_pages(tensor, seq.slot)) for seq in seqs]
        assert sum(map(len, per_slot)) == len(pages), tuple(tensor.shape)  # nothing outside their slots
        assert expected and [len(p) for p in per_slot] == [expected] * len(seqs), tuple(tensor.shape)


# ---- weight memory ----
ARENA_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from dsv4.config import ModelConfig
    from dsv4.weights.loader import build_models

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(1)
    cfg = ModelConfig.from_file(sys.argv[1])
    build_models(cfg, "dense", torch.float32, "cpu", None)  # warm-up (lazily imported modules); dropped
    start = anon()
    models = build_models(cfg, "dense", torch.float32, "cpu", None)
    built = anon()
    params = [p for m in models.values() for p in m.parameters()]
    zero = all(not bool(p.any()) for p in params if p.nbytes >= 1 << 20)
    for p in params:
        p.data.fill_(1)
    print(json.dumps({"params": sum(p.nbytes for p in params), "built": built - start,
                      "written": anon() - start, "zero": zero}))
    """
)


def test_a_built_model_takes_no_memory_until_its_weights_are_written(tmp_path):
    """The build's parameters come from a WeightArena: none of their bytes is written (or resident) until
    the load writes them, they read as zeros meanwhile, and written they take about their own size. (Reading
    them may take some memory: how a read fault in a huge-page region is backed is the kernel's choice.)"""
    import reference

    (tmp_path / "config.json").write_text(json.dumps(reference.small_config()))
    result = subprocess.run([sys.executable, "-c", ARENA_PROBE, str(tmp_path)], capture_output=True, text=True,
                            check=True, timeout=120)
    m = json.loads(result.stdout.strip().splitlines()[-1])
    assert m["params"] > 200 * MIB and m["zero"]
    assert m["built"] < 0.05 * m["params"]
    assert 0.95 * m["params"] < m["written"] < 1.1 * m["params"]


def test_arena_factories():
    """Within ArenaAllocation, large CPU factory calls come from the arena with torch's values, dtypes and
    flags; small ones, other devices and out= calls are torch's own."""
    from dsv4.lazy_memory import ARENA_MIN_BYTES, HUGE_PAGE_BYTES, ArenaAllocation, WeightArena

    arena = WeightArena()
    with ArenaAllocation(arena):
        zeros = torch.zeros(300, 100)
        ones = torch.ones((64, 64), dtype=torch.bfloat16, requires_grad=True)
        full = torch.full((128, 64), 2.5, dtype=torch.float32)
        empty = torch.empty(65536, dtype=torch.int8)
        small = torch.zeros(4, 4)
        meta = torch.zeros(300, 100, device="meta")
        out = torch.empty(300, 100)
        torch.zeros(300, 100, out=out)
        inferred = torch.full((128, 64), 7)
    assert arena.mapped_bytes > 0
    for tensor, value, dtype in ((zeros, 0, torch.float32), (ones, 1, torch.bfloat16), (full, 2.5, torch.float32),
                                 (empty, 0, torch.int8)):
        assert tensor.dtype == dtype and tensor.is_contiguous() and bool((tensor == value).all())
        assert tensor.untyped_storage().nbytes() == tensor.nbytes  # a storage of its own
    assert ones.requires_grad and not zeros.requires_grad
    assert zeros.untyped_storage().data_ptr() % HUGE_PAGE_BYTES == 0  # the first tensor opens a chunk
    assert small.nbytes < ARENA_MIN_BYTES and meta.device.type == "meta" and not out.any()
    assert inferred.dtype == torch.int64 and bool((inferred == 7).all())
    strided = arena.zeros_like(torch.empty(50, 70).t())
    assert strided.stride() == (1, 70) and not strided.any()
    arena.release()
    assert arena.zeros((16, 1024), torch.float32).data_ptr() % HUGE_PAGE_BYTES == 0  # a new chunk
