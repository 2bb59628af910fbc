"""Paired timing of dsv4 against a peer engine (transformers in bench_generate.py, llama.cpp in
bench_llamacpp.py): both warmed once, then alternated, and the ratio taken per back-to-back pair.

A neighbour that slows the machine for a while slows both runs of a pair alike, so the median of the
pairs' ratios moves far less than a ratio of medians taken minutes apart; the pairs' spread is kept.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Paired:
    peer_s: float  # median peer seconds
    ds_s: float  # median dsv4 seconds
    ratios: tuple[float, ...]  # peer / dsv4 seconds of each back-to-back pair: > 1 means dsv4 is faster

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    def fields(self) -> dict:
        return {"ratio": self.ratio, "ratio_min": min(self.ratios), "ratio_max": max(self.ratios)}


def paired(peer_seconds: Callable[[], float], ds_seconds: Callable[[], float], repeats: int) -> Paired:
    """Warm both (kernel builds, compilation, allocator, lazy init), then alternate them `repeats` times.

    Args:
        peer_seconds: runs the peer's workload once and returns its seconds.
        ds_seconds: the same for dsv4.
        repeats: timed pairs.

    Returns:
        Both medians and every pair's ratio.
    """
    peer_seconds(), ds_seconds()
    pairs = [(peer_seconds(), ds_seconds()) for _ in range(repeats)]
    return Paired(statistics.median(p for p, _ in pairs), statistics.median(d for _, d in pairs),
                  tuple(p / d for p, d in pairs))


def pooled(runs: list[Paired]) -> Paired:
    """Several runs of the same paired workload (e.g. each in fresh processes) as one: every pair's ratio,
    and the median of the runs' medians."""
    return Paired(statistics.median(r.peer_s for r in runs), statistics.median(r.ds_s for r in runs),
                  tuple(ratio for r in runs for ratio in r.ratios))
