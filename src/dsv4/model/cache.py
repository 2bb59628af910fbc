"""Per-sequence attention state in preallocated slots (fixed addresses; nothing is allocated per step).

Positions index everything: a sequence's state is its slot plus how many positions the slot holds
(`ModelCache.lengths`). A chunk must start at or before that length: the window and the compressor
rings are read by position, so starting later would read rows that were never written.

  window ring      [S, W, hd]       K=V after kv_norm + RoPE, token p at p % W
  compressor ring  [S, R, width]    raw kv / gate projections (gate before ape) of the last R tokens;
                                    R = 2m for overlapping (CSA) compressors, m for HCA
  entries          [S, E_max, hd]   emitted compressed entries, entry w at index w
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from dsv4.config import CSA, SLIDING, ModelConfig
from dsv4.lazy_memory import lazy_zeros


@dataclass
class CompressorCache:
    ring_kv: torch.Tensor  # [S, R, width]
    ring_gate: torch.Tensor  # [S, R, width]
    entries: torch.Tensor  # [S, E_max, out_dim]
    rate: int  # the compress rate m: entry w is completed by position (w + 1) m - 1


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
        rate=rate,
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


@dataclass(frozen=True)
class RingSnapshot:
    """The rows of a model cache that chunks are about to overwrite, as they were before (`ModelCache.snapshot`).

    Attributes:
        starts: per snapshotted slot, the first position its chunk writes (the slot held no row past it
            afterwards that a rewind to before it would need).
        saved: per group of cache tensors whose rows the chunks overwrite alike (one ring length and rate:
            every layer's window, the compressors' rings), (flat row indices into a [S * rows, width] view,
            the position whose write changed each row, the slot of each row, the group's tensors so viewed,
            their saved rows).
    """

    starts: dict[int, int]
    saved: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]], ...]


class ModelCache:
    """One model's per-layer slot caches (indexable by layer) and how many positions each slot holds."""

    def __init__(self, layers: list[LayerCache], slots: int):
        self.layers = layers
        self.lengths = [0] * slots

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def begin_step(self, segments) -> None:
        """Check that every chunk continues (or rewrites) what its slot holds, then record the new lengths.
        Starting before the held length is allowed: it overwrites, e.g. after rejected draft tokens."""
        for seg in segments:
            # The kernels index the caches by slot and position: neither may point outside them.
            if not 0 <= seg.slot < len(self.lengths):
                raise ValueError(f"cache slot {seg.slot} outside the cache's {len(self.lengths)} slots")
            if seg.start < 0:
                raise ValueError(f"cache slot {seg.slot}: a chunk cannot start at negative position {seg.start}")
            held = self.lengths[seg.slot]
            if seg.start > held:
                raise ValueError(
                    f"cache slot {seg.slot} holds positions [0, {held}); a chunk starting at position "
                    f"{seg.start} would attend to rows that were never written (start sequences at 0)"
                )
        for seg in segments:
            self.lengths[seg.slot] = seg.start + seg.length

    def fork(self, source: int, targets: Sequence[int], length: int) -> None:
        """Give each target slot the state of `source`'s positions [0, length): sequences whose tokens
        agree up to `length` (one prompt) then continue from it as if each had computed them itself.

        Only the rows those positions wrote are copied (ring rows p % rows, entries of the windows they
        completed), one copy per cache tensor for all targets: a target's cache memory is taken as a
        prefill of its own would take it (`lazy_memory`), and rows past them keep whatever they held,
        which nothing reads before a later position writes them.

        Args:
            source: the slot holding the positions (it keeps them).
            targets: slots that take them, distinct and other than `source`.
            length: positions to copy, at most what `source` holds; each target then holds exactly these.

        Raises:
            ValueError: `source` holds fewer than `length` positions, or a target is `source` or repeats.
        """
        check_fork(source, targets, length, self.lengths[source])
        copy_slot_rows(((tensor, min(length if rate is None else length // rate, tensor.shape[1]))
                        for tensor, rate in _tensors_and_rates(self.layers)), source, targets)
        for slot in targets:
            self.lengths[slot] = length

    def rollback_limit(self) -> int:
        """The longest chunk `snapshot` can save and `rewind` undo: the smallest ring's rows."""
        return min(tensor.shape[1] for tensor, rate in _tensors_and_rates(self.layers) if rate is None)

    def snapshot(self, chunks: Sequence[tuple[int, int, int]]) -> RingSnapshot:
        """Save the rows that chunks about to run will overwrite, so that `rewind` can undo them.

        A verify chunk writes its draft tokens into the window ring (row p % W) and the compressor rings
        (row p % R): rows the positions before it still need once the chunk is rejected, because they
        belong to the positions W (or R) earlier. It may also complete a compressed window (entry w).

        Args:
            chunks: per chunk, (slot, first position, number of positions); at most one per slot.

        Returns:
            The snapshot (for `rewind`; valid until the next step writes these slots).

        Raises:
            ValueError: a chunk longer than a ring (a row it writes twice could not be restored).
        """
        if not chunks:
            return RingSnapshot({}, ())
        groups: dict[tuple[int, int | None, torch.device], tuple] = {}
        for tensor, rate in _tensors_and_rates(self.layers):
            # Tensors of one ring length and rate overwrite the same rows: their index, writers and owners are
            # built once per group.
            key = (tensor.shape[1], rate, tensor.device)
            if key not in groups:
                groups[key] = (*_overwritten_rows(chunks, tensor.shape[1], rate, tensor.device), [], [])
            index, _, _, flats, saved = groups[key]
            if index.numel():  # else nothing of it is overwritten (e.g. no compressed entry completes)
                flats.append(tensor.view(-1, tensor.shape[2]))
                saved.append(flats[-1].index_select(0, index))
        return RingSnapshot({slot: start for slot, start, _ in chunks}, tuple(g for g in groups.values() if g[3]))

    def rewind(self, lengths: dict[int, int], snapshot: RingSnapshot | None = None) -> None:
        """Forget positions >= lengths[slot] of each slot: their rows go back to what `snapshot` saved
        before the chunk that wrote them (rejected draft tokens leave no trace), and the slot's length
        goes back. A slot outside the snapshot only has its length lowered (rewinding to 0 frees it).

        Args:
            lengths: slot -> the number of positions it keeps.
            snapshot: taken before the step that wrote the rejected positions.

        Raises:
            ValueError: a snapshotted slot rewound before its chunk's first position (those rows were
                not saved).
        """
        restore = {}
        for slot, start in snapshot.starts.items() if snapshot is not None else ():
            if slot in lengths and lengths[slot] > 0:
                if lengths[slot] < start:
                    raise ValueError(f"cache slot {slot}: rewinding to {lengths[slot]} needs the rows before "
                                     f"position {start}, which the snapshot did not save")
                restore[slot] = lengths[slot]
        for index, writers, owners, flats, saved in snapshot.saved if restore else ():
            keep = torch.tensor([restore.get(s, 1 << 62) for s in owners.tolist()], dtype=torch.int64)
            undo = (writers >= keep).nonzero().squeeze(1).to(index.device)
            if undo.numel():
                rows_to_restore = index[undo]
                for flat, rows in zip(flats, saved):
                    flat.index_copy_(0, rows_to_restore, rows[undo])
        for slot, length in lengths.items():
            self.lengths[slot] = min(self.lengths[slot], length)


def _overwritten_rows(
    chunks: Sequence[tuple[int, int, int]], rows: int, rate: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of a [S, rows, width] cache tensor that `chunks` overwrite (`ModelCache.snapshot`): (flat row
    indices into its [S * rows, width] view on `device`, the position whose write changes each row, the
    slot of each row). `rate` None: a ring read by position (row p % rows); a rate m: entries (entry w,
    completed by position (w + 1) m - 1).

    Raises:
        ValueError: a chunk longer than a ring (a row it writes twice could not be restored).
    """
    flat_rows, writers, owners = [], [], []
    for slot, start, length in chunks:
        end = start + length
        if rate is None:
            if length > rows:
                raise ValueError(f"a chunk of {length} positions cannot be rolled back in a ring of "
                                 f"{rows} rows (at most {rows} positions)")
            positions = range(start, end)
            flat_rows.extend(slot * rows + p % rows for p in positions)
            writers.extend(positions)
        else:
            entries = range(start // rate, min(end // rate, rows))
            flat_rows.extend(slot * rows + w for w in entries)
            writers.extend((w + 1) * rate - 1 for w in entries)
        owners.extend([slot] * (len(flat_rows) - len(owners)))
    return (torch.tensor(flat_rows, dtype=torch.int64, device=device), torch.tensor(writers, dtype=torch.int64),
            torch.tensor(owners, dtype=torch.int64))


def check_fork(source: int, targets: Sequence[int], length: int, held: int) -> None:
    """Raises ValueError unless `source` holds at least `length` positions (`held`) and the targets are
    distinct slots other than `source` (what a fork of a slot's positions into others needs)."""
    if length > held:
        raise ValueError(f"cache slot {source} holds positions [0, {held}); cannot fork {length} positions from it")
    if source in targets or len(set(targets)) != len(targets):
        raise ValueError(f"fork from cache slot {source} into slots {list(targets)}: the targets must be "
                         f"distinct slots other than the source")


def copy_slot_rows(tensors: Iterable[tuple[torch.Tensor, int]], source: int, targets: Sequence[int]) -> None:
    """For each (tensor [S, rows, ...], n): rows [0, n) of slot `source` into the same rows of every target
    slot, one copy per tensor (rows past n are not touched, so their lazily taken memory stays untaken)."""
    if not targets:
        return
    index = None
    for tensor, rows in tensors:
        if rows:
            if index is None:
                index = torch.tensor(list(targets), dtype=torch.int64, device=tensor.device)
            # A copy of the source rows first: torch refuses a source that shares the destination's storage.
            rows_of_source = tensor[source, :rows].clone()
            tensor[:, :rows].index_copy_(0, index, rows_of_source.expand(len(targets), *rows_of_source.shape))


def _tensors_and_rates(layers: list[LayerCache]):
    """Per cache tensor: (tensor, compress rate or None for rings read by position, i.e. rows p % rows; a
    rate m for entries, entry w written by position (w + 1) m - 1)."""
    for layer in layers:
        yield layer.window, None
        for comp in (layer.compressor, layer.indexer):
            if comp is not None:
                yield comp.ring_kv, None
                yield comp.ring_gate, None
                yield comp.entries, comp.rate


def cache_tensors(layers: list[LayerCache]) -> list[torch.Tensor]:
    """Every tensor of a model cache (for byte accounting and address checks)."""
    return [tensor for tensor, _ in _tensors_and_rates(layers)]
