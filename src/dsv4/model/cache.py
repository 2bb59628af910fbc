"""Per-sequence attention state in preallocated slots (fixed addresses; nothing is allocated per step).

Positions index everything: a sequence's state is its slot plus how many positions the slot holds
(`ModelCache.lengths`). A chunk must start at or before that length: the window and the compressor
rings are read by position, so starting later would read rows that were never written.

  window ring      [S, W, hd]       K=V after kv_norm + RoPE, token p at p % W
  compressor ring  [S, R, width]    raw kv / gate projections (gate before ape) of the last R tokens;
                                    R = 2m for overlapping (CSA) compressors, m for HCA
  entries          [S, E_max, hd]   emitted compressed entries, entry w at index w
"""

from dataclasses import dataclass

import torch

from dsv4.config import CSA, SLIDING, ModelConfig
from dsv4.model.lazy_memory import lazy_zeros


@dataclass
class CompressorCache:
    ring_kv: torch.Tensor  # [S, R, width]
    ring_gate: torch.Tensor  # [S, R, width]
    entries: torch.Tensor  # [S, E_max, out_dim]


@dataclass
class LayerCache:
    window: torch.Tensor  # [S, W, hd]
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None


def _compressor_cache(
    slots: int, rate: int, overlap: bool, out_dim: int, max_len: int, dtype, device
) -> CompressorCache:
    ring = 2 * rate if overlap else rate
    width = 2 * out_dim if overlap else out_dim
    max_entries = -(-max_len // rate)
    return CompressorCache(
        ring_kv=lazy_zeros((slots, ring, width), dtype, device),
        ring_gate=lazy_zeros((slots, ring, width), dtype, device),
        entries=lazy_zeros((slots, max_entries, out_dim), dtype, device),
    )


def allocate_layer_cache(cfg: ModelConfig, layer_type: str, slots: int, max_len: int, dtype, device) -> LayerCache:
    """One layer's cache for `slots` sequences of up to `max_len` positions, all zeros.

    On CPU the tensors are `lazy_zeros`: their memory is taken page by page as sequences write rows, so
    start-up costs nothing per slot and a sequence takes memory for the positions it holds, not for
    max_len. Rows never written read as zeros (attention masks them anyway).
    """
    cache = LayerCache(window=lazy_zeros((slots, cfg.sliding_window, cfg.head_dim), dtype, device))
    if layer_type != SLIDING:
        rate = cfg.compress_rate(layer_type)
        overlap = layer_type == CSA
        cache.compressor = _compressor_cache(slots, rate, overlap, cfg.head_dim, max_len, dtype, device)
        if layer_type == CSA:
            cache.indexer = _compressor_cache(slots, rate, True, cfg.index_head_dim, max_len, dtype, device)
    return cache


class ModelCache:
    """One model's per-layer slot caches (indexable by layer) and how many positions each slot holds."""

    def __init__(self, layers: list[LayerCache], slots: int):
        self.layers = layers
        self.lengths = [0] * slots

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    def begin_step(self, segments) -> None:
        """Check that every chunk continues (or rewrites) what its slot holds, then record the new lengths.
        Starting before the held length is allowed: it overwrites, e.g. after rejected draft tokens."""
        for seg in segments:
            held = self.lengths[seg.slot]
            if seg.start > held:
                raise ValueError(
                    f"cache slot {seg.slot} holds positions [0, {held}); a chunk starting at position "
                    f"{seg.start} would attend to rows that were never written (start sequences at 0)"
                )
        for seg in segments:
            self.lengths[seg.slot] = seg.start + seg.length


def cache_tensors(layers: list[LayerCache]) -> list[torch.Tensor]:
    """Every tensor of a model cache (for byte accounting and address checks)."""
    out = []
    for layer in layers:
        out.append(layer.window)
        for comp in (layer.compressor, layer.indexer):
            if comp is not None:
                out.extend((comp.ring_kv, comp.ring_gate, comp.entries))
    return out
