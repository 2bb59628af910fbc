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
from dsv4.model.cache import cache_tensors
from dsv4.model.lazy_memory import LAZY_MIN_BYTES, lazy_zeros

MIB = 2**20
LIBC = ctypes.CDLL(None, use_errno=True)

PROBE = textwrap.dedent(
    """
    import json, torch
    from dsv4.model.lazy_memory import lazy_zeros

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
