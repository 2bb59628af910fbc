"""Single-token decode rows of an attention layer on CPU, in C (decode_attention_cpu.c).

A decode row's attention in eager PyTorch is ~100 framework calls per layer (ring writes, window pooling,
the indexer's scores and tie-safe top-k, three score blocks, the sink softmax), each a few microseconds
around arithmetic that takes less: at batch 1 the layer is dispatch-bound. Two C calls per compressor and
one for the rest replace them. The formulas are model/attention.py's torch path (`Compressor.emit`,
`Indexer.select`, `Attention._attend_decode`), which stays the reference the kernel is tested against
(tests/test_kernels_attention.py). The arithmetic is fp32, summed in another order than torch's; bf16 rows
and caches are widened on load and rounded where the torch path rounds them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from dsv4.kernels.c_library import NATIVE, compile_library, cpu_features
from dsv4.kernels.gemv_cpu import MAX_F32_DECODE_ROWS, WorkerPool, pool_call_args
from dsv4.kernels.mhc_cpu import check_status, eager_cpu
from dsv4.kernels.native_calls import bind_packed, native_call
from dsv4.kernels.norm_rope_cpu import MAX_ROTARY_PAIRS

SOURCE = Path(__file__).with_name("decode_attention_cpu.c")
# The kernels a recorded step may call (native_call), each with a packed twin for the replay (packed_call.h).
REPLAYED = ("compress_decode", "attend_decode")

# Rows one call serves: every decode row a step of the few-row kernels has (`gemv_cpu.MAX_F32_DECODE_ROWS`). The
# kernel spreads them over that pool's threads in chunks, where the torch path (torch at one thread on such
# steps: `KernelRegistry.threads_for_rows`) runs batched GEMMs on one. Measured (small config, fp32 dense
# experts, 2 threads, engine decode step, paired in one session): b=16 15.3-16.3 -> 14.2-14.5 ms, b=64
# 30.9-34.9 -> 28.9-30.6 ms against a limit of 8 rows; before the pool (one thread) the kernel was 1.08-1.14x
# the torch path at 1-8 rows, even at 16, 0.97x at 32.
MAX_DECODE_ROWS = MAX_F32_DECODE_ROWS


def build_library(march: str = NATIVE) -> ctypes.CDLL:
    """Compile decode_attention_cpu.c for this machine (once, cached) and load it; raises OSError/RuntimeError."""
    lib = compile_library(SOURCE, (f"-march={march}",), cpu_features())
    P, L, Int, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    lib.compress_decode.restype = Int
    lib.compress_decode.argtypes = [L, Int, P, P, P, P, P, P, L, L, P, L, Int, P, F, P, L, P, L, L]
    lib.attend_decode.restype = Int
    lib.attend_decode.argtypes = [L, Int, L, L, P, P, P, P, P, L, P, L, L, P, P, P, L, L, L, P, P, P, P, Int]
    bind_packed(lib, REPLAYED)
    return lib


# Dtypes of the rows and caches (one dtype per call); parameters (ape, norm weights, sinks) are fp32.
ROW_DTYPES = (torch.float32, torch.bfloat16)


def _rows(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Contiguous CPU tensors of `dtype`."""
    return all(t.dtype == dtype and t.is_contiguous() and t.is_cpu for t in tensors)


class DecodeAttentionKernel:
    """`attend` serves a layer's single-token decode rows, spread over `pool`'s threads; `compress` (called
    first, per compressor) the same rows' compressor rings and entries. `supports` takes `attend`'s arguments:
    fp32 or bf16 rows and caches, fp32 sinks, at most MAX_DECODE_ROWS rows."""

    def __init__(self, lib: ctypes.CDLL, pool: WorkerPool | None = None):
        """pool: the few-row kernels' worker pool, which `attend` spreads its rows over (None: one thread)."""
        self._compress = lib.compress_decode
        self._attend = lib.attend_decode
        self._pool = pool

    @staticmethod
    def supports(q: torch.Tensor, kv: torch.Tensor, window: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, entries: torch.Tensor | None, rate: int | None,
                 indexer: tuple | None, sink: torch.Tensor) -> bool:
        if not eager_cpu(q) or q.shape[0] > MAX_DECODE_ROWS:
            return False
        caches = [window] + ([] if entries is None else [entries]) + ([] if indexer is None else list(indexer[:3]))
        # The indexer's entries are read with the attention entries' capacity (one compress rate, one max_len).
        same_capacity = indexer is None or indexer[2].shape[1] == entries.shape[1]
        return (q.dtype in ROW_DTYPES and _rows(q.dtype, q, kv, *caches) and _rows(torch.float32, sink)
                and same_capacity and _rows(torch.int64, slots, positions))

    def compress(self, kv: torch.Tensor, gate: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 ring_kv: torch.Tensor, ring_gate: torch.Tensor, ape: torch.Tensor, rate: int, overlap: bool,
                 norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, entries: torch.Tensor) -> None:
        """Record rows kv, gate [B, width] (raw projections) in the rings [S, R, width] and write the entries
        [S, E_max, d] of the windows they complete (`Compressor.emit` for single-token rows)."""
        if not (kv.dtype in ROW_DTYPES and _rows(kv.dtype, kv, gate, ring_kv, ring_gate, entries)
                and _rows(torch.float32, ape, norm_weight, inv_freq) and inv_freq.numel() <= MAX_ROTARY_PAIRS):
            raise ValueError("compress: contiguous CPU rows and caches of one dtype (fp32 or bf16) and fp32 "
                             "parameters expected (`supports` gates the call)")
        B, width = kv.shape
        native_call(self._compress, (B, int(kv.dtype == torch.bfloat16), slots.data_ptr(), positions.data_ptr(),
                                     kv.data_ptr(), gate.data_ptr(), ring_kv.data_ptr(), ring_gate.data_ptr(),
                                     ring_kv.shape[1], width, ape.data_ptr(), rate, int(overlap),
                                     norm_weight.data_ptr(), eps, inv_freq.data_ptr(), inv_freq.numel(),
                                     entries.data_ptr(), entries.shape[1], entries.shape[2]),
                    check_status, "compress_decode", B)

    def serve_layer(self, attn, meta, cache, side, args: tuple) -> torch.Tensor:
        """An attention layer's single-token decode rows (`model.attention.Attention._decode`, the reference):
        each compressor's rings and entries (`compress`; the indexer's too on CSA layers), then `attend(*args)`
        (`attend_args`, which `supports` accepted)."""
        for comp, kv, gate, comp_cache in attn.compressor_parts(side, cache):
            self.compress(kv, gate, meta.slots, meta.pos, comp_cache.ring_kv, comp_cache.ring_gate, comp.ape,
                          comp.rate, comp.overlap, comp.norm.weight, comp.norm.eps, attn.rope.inv_freq,
                          comp_cache.entries)
        return self.attend(*args)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, window: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor, entries: torch.Tensor | None, rate: int | None, indexer: tuple | None,
               sink: torch.Tensor) -> torch.Tensor:
        """q [B, H, hd] (normed, rotated), kv [B, hd] -> [B, H, hd]: writes kv into the window ring [S, W, hd],
        then attends to the window, the complete entries [S, E_max, hd] (None: sliding) of compress `rate`, or
        with `indexer` = (index q [B, nI, dI], head weights [B, nI], index entries [S, E_max, dI], topk) the
        entries it picks, and the per-head sink [H]."""
        B, H, hd = q.shape
        out = torch.empty_like(q)
        index_q = index_w = index_entries = None
        nI = dI = topk = 0
        if indexer is not None:
            index_q, index_w, index_entries, topk = indexer
            nI, dI = index_q.shape[1], index_q.shape[2]
        native_call(self._attend, (
            B, int(q.dtype == torch.bfloat16), H, hd, slots.data_ptr(), positions.data_ptr(), q.data_ptr(),
            kv.data_ptr(), window.data_ptr(), window.shape[1], None if entries is None else entries.data_ptr(),
            0 if entries is None else entries.shape[1], rate or 1,
            None if index_q is None else index_q.data_ptr(), None if index_w is None else index_w.data_ptr(),
            None if index_entries is None else index_entries.data_ptr(), nI, dI, topk, sink.data_ptr(),
            out.data_ptr(), *pool_call_args(self._pool)), check_status, "attend_decode", B)
        return out


def attend_args(attn, q: torch.Tensor, kv: torch.Tensor, meta, cache, side) -> tuple:
    """The arguments of `attend` (and `supports`) for an attention layer's single-token rows q [B, H, hd],
    kv [B, hd]: its window ring, the rows' slots and positions (`meta`, a DecodeMeta), its compressed entries and
    rate (CSA / HCA), the indexer's query, head weights, entries and top-k (CSA; `side`: the layer's projections
    of these rows) and the sinks."""
    entries = rate = indexer = None
    if attn.compressor is not None:
        entries, rate = cache.compressor.entries, attn.compressor.rate
    if attn.indexer is not None:
        indexer = (side.idx_q, side.idx_w, cache.indexer.entries, attn.indexer.topk)
    return q, kv, cache.window, meta.slots, meta.pos, entries, rate, indexer, attn.attn_sink
