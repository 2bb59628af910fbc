"""benchmarks/bench_weight_sync.py --quick keeps working: every configuration is measured, paired with its
memcpy, the engine's update call is accounted for by its phases, the serving mode sees requests wait, and the
colocated mode times the trainer's share and the engine's update."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_quick_mode_measures_every_configuration(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the spawned trainer process imports the module by name
    bench = importlib.import_module("bench_weight_sync")
    results = bench.main(["--quick", "--out", str(tmp_path), "--no-plot"])
    rows = results["rows"]
    num_tensors = max(r["tensors"] for r in rows)
    expected = sum(len(bench.schedule(m, num_tensors, list(bench.QUICK_BUCKETS), 1)) for m in bench.MODES)
    assert len(rows) == expected
    assert {r["mode"] for r in rows} == set(bench.MODES) and {r["config"] for r in rows} == {"tiny"}
    assert len({r["tensors"] for r in rows}) == len(bench.FRACTIONS)  # partial and full updates
    for r in rows:
        assert r["bytes"] > 0 and r["memcpy_s"] > 0 and r["ratio"] == r["sync_s"] / r["memcpy_s"]
        assert r["buckets"] >= 1
        assert r["receive_wait_s"] + r["apply_s"] + r["commit_s"] <= r["update_call_s"]
    small, large = sorted(bench.QUICK_BUCKETS)
    for n in {r["tensors"] for r in rows}:  # smaller buckets split the same update into more of them
        count = {r["bucket_bytes"]: r["buckets"] for r in rows if r["tensors"] == n and r["mode"] == bench.REFIT}
        assert count[small] >= count[large]
    assert max(r["buckets"] for r in rows if r["bucket_bytes"] == small) > 1
    serving = [r for r in rows if r["mode"] == bench.SERVING]
    assert serving and all(r["tensors"] == num_tensors and r["bucket_bytes"] == small for r in serving)
    for r in serving:  # the stream ran around the update (the gaps' arithmetic: the next test)
        assert r["token_gap_s"] > 0 and r["request_wait_s"] > 0 and r["commit_s"] > 0
        assert r["tokens_during_update"] >= 0
    assert {s["mode"] for s in results["summary"]} == set(bench.MODES)
    assert all(s["meets_target"] == (s["ratio"] <= bench.TARGET_RATIO) for s in results["summary"])
    floors = {(s["bytes"], s["bucket_bytes"]): s for s in results["summary"] if s["mode"] == bench.TRANSPORT}
    for s in results["summary"]:  # every gloo engine figure stands beside the transport floor of the same update
        if s["mode"] in (bench.REFIT, bench.SERVING):
            floor = floors[s["bytes"], s["bucket_bytes"]]
            assert (s["transport_sync_s"], s["transport_ratio"]) == (floor["sync_s"], floor["ratio"])
            assert s["over_transport_s"] == pytest.approx(s["sync_s"] - floor["sync_s"])
            assert s["ratio_over_transport"] == pytest.approx(s["sync_s"] / floor["sync_s"])
    colocated = [r for r in rows if r["mode"] == bench.COLOCATED]  # the trainer's share, then the engine's call
    assert colocated and all(r["sync_s"] == pytest.approx(r["share_s"] + r["update_call_s"]) for r in colocated)
    assert all(r["share_s"] > 0 and r["receive_wait_s"] == 0 and r["apply_s"] > 0 for r in colocated)
    assert (tmp_path / "bench_weight_sync_quick.json").exists()


def test_request_wait_reads_the_gaps_around_an_update(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_weight_sync")
    # request 0: submitted at 0, a token every 0.1 s up to 2.0, then nothing until 3.0 (the update runs over
    # [2.05, 2.5]); request 1, submitted at 2.2 during the update, gets its first token at 2.9.
    events = [(0.0, 0, 0)] + [(0.1 * i, 0, 1) for i in range(1, 21)] + [(3.0, 0, 1), (3.1, 0, 1)]
    events += [(2.2, 1, 0), (2.9, 1, 1)]
    got = bench.request_wait(events, 2.05, 2.5)
    assert got["request_wait_s"] == pytest.approx(1.0)  # request 0's 2.0 -> 3.0 beats request 1's 0.7
    assert got["token_gap_s"] == pytest.approx(0.1)
    assert got["tokens_during_update"] == 0
    assert bench.request_wait(events, 0.55, 0.65)["tokens_during_update"] == 1
