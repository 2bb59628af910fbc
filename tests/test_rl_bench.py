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
    assert len(rows) == len(bench.MODES) * len(bench.FRACTIONS) * len(bench.QUICK_BUCKETS)
    assert {r["mode"] for r in rows} == set(bench.MODES)
    assert len({r["tensors"] for r in rows}) == len(bench.FRACTIONS)  # partial and full updates
    for r in rows:
        assert r["bytes"] > 0 and r["memcpy_s"] > 0 and r["ratio"] == r["sync_s"] / r["memcpy_s"]
        assert r["buckets"] >= 1
        assert r["receive_wait_s"] + r["apply_s"] + r["commit_s"] <= r["unavailable_s"]
    small, large = sorted(bench.QUICK_BUCKETS)
    for n in {r["tensors"] for r in rows}:  # smaller buckets split the same update into more of them
        count = {r["bucket_bytes"]: r["buckets"] for r in rows if r["tensors"] == n and r["mode"] == bench.REFIT}
        assert count[small] >= count[large]
    assert max(r["buckets"] for r in rows if r["bucket_bytes"] == small) > 1
    assert (tmp_path / "bench_weight_sync_quick.json").exists()
