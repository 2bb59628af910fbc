"""Decode roofline for bench_generate.py: this machine's measured peaks and a decode step's bytes and FLOPs.

A decode step of B rows must at least (a) read every weight it uses once and every cache entry its
attention reads, at the measured memory bandwidth, and (b) do its matmul FLOPs at the measured matmul
peak; the roofline time is the larger of the two, and the achieved fraction is roofline / measured.

Counting rules (per decode step, B rows at position `pos`, model dtype for weights and caches):
  dense weights   every non-expert parameter read in full (attention, router, shared expert, mHC, head),
                  2 FLOPs per weight per row for matrices; the embedding and the hash-routing table
                  only read their B rows (lookups, no FLOPs)
  routed experts  the distinct experts the B*k picks touch, expected under uniform routing:
                  E * (1 - (1 - k/E)^B) experts per MoE layer; FLOPs for the k picked experts per row
  caches          per row and layer: the window (min(pos+1, W) keys); HCA: all complete entries;
                  CSA: the indexer keys of all complete entries + the k picked entries;
                  attention FLOPs 4 * H * hd per key (q.k and p.v), indexer 2 * nI * dI per key
Ignored (small next to the above at these sizes): norms, RoPE, mHC mixing arithmetic, softmaxes,
compressor ring writes/pooling, sampling.
"""

from __future__ import annotations

import time

import torch

BANDWIDTH_BYTES = 256 * 2**20  # well past any last-level cache, so the sum streams from DRAM
MATMUL_SIZE = 1024  # square matmul: large enough that packing / dispatch costs vanish
PEAK_REPEATS = 5  # best of N: peaks are upper bounds, contention only ever lowers a sample
SLIDING, CSA = "sliding_attention", "compressed_sparse_attention"


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, packing buffers)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(repeats: int = PEAK_REPEATS) -> dict:
    """Read bandwidth (a large fp32 sum, bytes read / s), copy bandwidth (read + write bytes / s) and the
    fp32 / bf16 matmul peaks (FLOP/s), each the best of `repeats`, at the current torch thread count."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    dest = torch.empty_like(data)
    read_s = _best_seconds(lambda: data.sum(), repeats)
    copy_s = _best_seconds(lambda: dest.copy_(data), repeats)
    peaks = {"read_bw_gb_s": BANDWIDTH_BYTES / read_s / 1e9, "copy_bw_gb_s": 2 * BANDWIDTH_BYTES / copy_s / 1e9}
    n = MATMUL_SIZE
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        peaks[f"matmul_{name}_gflop_s"] = 2 * n**3 / _best_seconds(lambda a=a, b=b: a @ b, repeats) / 1e9
    return peaks


def _expected_distinct(experts: int, k: int, rows: int) -> float:
    """Expected distinct experts among `rows` rows each picking k of `experts` uniformly (without replacement)."""
    return experts * (1.0 - (1.0 - k / experts) ** rows)


def decode_step_cost(model: torch.nn.Module, cfg, batch: int, pos: int) -> dict:
    """Bytes moved and FLOPs of one decode step of `batch` rows at position `pos` (rules in the module doc)."""
    weight_bytes = expert_bytes = 0.0
    flops = 0.0
    per_expert: dict[str, float] = {}  # MoE layer prefix -> bytes of one expert's three matrices
    for name, p in model.named_parameters():
        size = p.element_size()
        if name in ("embed.weight",) or name.endswith("gate.tid2eid"):
            weight_bytes += batch * p.shape[-1] * size  # a lookup reads B rows
        elif ".experts.w" in name:
            prefix = name.rsplit(".", 1)[0]
            per_expert[prefix] = per_expert.get(prefix, 0.0) + p[0].numel() * size
            flops += 2 * batch * cfg.num_experts_per_tok * p[0].numel()
        else:
            weight_bytes += p.numel() * size
            if p.dim() >= 2:
                flops += 2 * batch * p.numel()
    distinct = _expected_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, batch)
    expert_bytes = sum(distinct * b for b in per_expert.values())

    itemsize = torch.finfo(model.dtype).bits // 8
    cache_elems = 0
    for layer_type in cfg.layer_types:
        keys = min(pos + 1, cfg.sliding_window)
        cache_elems += keys * cfg.head_dim
        if layer_type != SLIDING:
            entries = (pos + 1) // cfg.compress_rate(layer_type)
            if layer_type == CSA:
                picked = min(cfg.index_topk, entries)
                cache_elems += entries * cfg.index_head_dim + picked * cfg.head_dim
                flops += batch * 2 * cfg.index_n_heads * cfg.index_head_dim * entries
                keys += picked
            else:
                cache_elems += entries * cfg.head_dim
                keys += entries
        flops += batch * 4 * cfg.num_attention_heads * cfg.head_dim * keys
    cache_bytes = batch * cache_elems * itemsize
    return {"weight_bytes": weight_bytes, "expert_bytes": expert_bytes, "expected_distinct_experts": distinct,
            "cache_bytes": cache_bytes, "bytes": weight_bytes + expert_bytes + cache_bytes, "flops": flops}


def roofline_fraction(cost: dict, peaks: dict, dtype_name: str, step_s: float) -> dict:
    """The roofline time of `cost` on `peaks` (memory: read bandwidth; compute: the dtype's matmul peak),
    which bound it, and the achieved fraction roofline / measured step time."""
    memory_s = cost["bytes"] / (peaks["read_bw_gb_s"] * 1e9)
    compute_s = cost["flops"] / (peaks[f"matmul_{dtype_name}_gflop_s"] * 1e9)
    roofline_s = max(memory_s, compute_s)
    return {"memory_ms": memory_s * 1e3, "compute_ms": compute_s * 1e3,
            "bound": "memory" if memory_s >= compute_s else "compute",
            "roofline_ms": roofline_s * 1e3, "measured_ms": step_s * 1e3, "fraction": roofline_s / step_s}
