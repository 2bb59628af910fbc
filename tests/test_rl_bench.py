"""benchmarks/bench_weight_sync.py --quick keeps working: every configuration is measured, paired with its
memcpy, and the engine's unavailable window is accounted for by its phases."""

from __future__ import annotations

import importlib
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_mode_measures_every_configuration(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned trainer process imports the module by name
    bench = importlib.import_module("bench_weight_sync")
    results = bench.main(["--quick", "--out", str(tmp_path), "--no-plot"])
    rows = results["rows"]
    assert len(rows) == len(bench.FRACTIONS) * len(bench.QUICK_BUCKETS)
    assert len({r["tensors"] for r in rows}) == len(bench.FRACTIONS)  # partial and full updates
    for r in rows:
        assert r["bytes"] > 0 and r["memcpy_s"] > 0 and r["ratio"] == r["sync_s"] / r["memcpy_s"]
        assert r["buckets"] >= -(-r["bytes"] // r["bucket_bytes"])  # at least as many buckets as bytes demand
        assert r["receive_wait_s"] + r["apply_s"] + r["commit_s"] <= r["unavailable_s"]
    assert (tmp_path / "bench_weight_sync_quick.json").exists()
