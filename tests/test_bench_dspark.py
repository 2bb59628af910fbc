"""benchmarks/bench_dspark.py --quick runs end to end and writes the figures it promises (JSON + plot).

Only the machinery is checked: timings on a shared machine are not results, so no speed is held to its goal
here (the benchmark records whether each figure meets it). What is checked is what cannot vary: every arm
produced plain greedy's tokens (the benchmark exits otherwise) and DSpark verified several tokens per step.
"""

import json


def test_quick_mode_writes_every_figure(tmp_path, benchmark_script):
    module = benchmark_script("bench_dspark")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_dspark_quick.json").read_text())
    assert {"plain", "dspark"} <= set(results["arms"])
    for arm in results["arms"].values():
        assert arm["tokens_per_s"] > 0
    assert results["accepted_length"]["value"] > 1.0 and results["accepted_length"]["block_size"] == 5
    assert results["dspark_vs_plain"]["ratio"] > 0
    assert ("mtp" in results["arms"]) == ("dspark_vs_mtp" in results) != bool(results["notes"])
    assert [r["threshold"] for r in results["threshold_sweep"]] == list(module.THRESHOLDS)
    assert (tmp_path / "bench_dspark_quick.png").stat().st_size > 0
