"""benchmarks/bench_lifecycle.py --quick runs end to end and writes every figure it promises (JSON + plot).

Only the machinery is checked here: timings on a shared machine are not results, so no ratio is held to
its target (the benchmark itself records whether each one meets it).
"""

import json


def test_quick_mode_writes_every_figure(tmp_path, benchmark_script):
    module = benchmark_script("bench_lifecycle")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_lifecycle_quick.json").read_text())
    row = results["sizes"]["tiny"]
    assert set(module.TARGETS) <= set(row)
    for key in module.TARGETS:
        figure = row[key]
        assert figure["ratio"] > 0 and figure["target"] == module.TARGETS[key], key
    for key in ("load_native_warm", "refit_native_fail_stop", "refit_bf16_fail_stop", "startup"):
        assert row[key]["baseline_s"] > 0 and row[key]["dsv4_s"] > 0
        assert row[key]["baseline_cpu_s"] > 0 and row[key]["dsv4_cpu_s"] > 0
    assert row["refit_tensors"] > 0 and row["refit_bytes"] > 0 and row["build_s"] > 0
    assert row["peak_rss"]["resident"] == row["resident_bytes"]
    phases = row["startup_rss"]
    assert phases["resident"] == row["resident_bytes"] and phases["max_num_seqs"] >= 1
    assert phases["cache_reserved_bytes"] == phases["max_num_seqs"] * phases["cache_bytes_per_sequence"]
    assert phases["cache_bytes_per_sequence"] > phases["cache_bytes_per_slot_fixed"] > 0
    assert phases["cache_bytes_per_token"] > 0
    for phase in ("before", "started", "served"):
        assert phases[phase]["VmRSS"] > 0 and phases[phase]["RssAnon"] > 0
    assert (tmp_path / "bench_lifecycle_quick.png").stat().st_size > 0


def test_a_subset_of_figures_measures_only_those(tmp_path, benchmark_script):
    """`--figures load`: the native load figures (warm, cold, and paired with a read into fresh memory), written
    beside a full run's results instead of over them."""
    module = benchmark_script("bench_lifecycle")
    assert module.main(["--quick", "--figures", "load", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "bench_lifecycle_quick.json").exists()
    results = json.loads((tmp_path / "bench_lifecycle_quick_load.json").read_text())
    row = results["sizes"]["tiny"]
    assert {"load_native_warm", "load_native_cold", "load_native_warm_vs_fresh_read"} <= set(row)
    assert not {"peak_rss", "startup", "refit_native_fail_stop", "load_hf_warm"} & set(row)
    fresh = row["load_native_warm_vs_fresh_read"]
    assert fresh["target"] is None and fresh["meets_target"] is None and fresh["baseline_s"] > 0
    assert row["load_native_warm"]["ratio_vs_read_into_fresh_memory"] == fresh["ratio"]
    floor = row["fresh_memory_floor"]  # the reads into fresh arena memory, warm and cold, against the targets
    for kind in ("warm", "cold"):
        assert floor[kind]["reused_read_s"] > 0 and floor[kind]["fresh_arena_read_s"] > 0
        assert floor[f"{kind}_target_below_floor"] == (floor[kind]["ratio"] > floor[f"{kind}_target"])
    assert results["figures"] == ["load"] and (tmp_path / "bench_lifecycle_quick_load.png").stat().st_size > 0
