"""benchmarks/bench_layout_copy.py --quick runs end to end and writes its JSON + plot (the machinery only:
timings on a shared machine are not results; the benchmark itself checks every arm's bytes against torch)."""

import json


def test_quick_mode_writes_every_case(tmp_path, benchmark_script):
    module = benchmark_script("bench_layout_copy")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_layout_copy_quick.json").read_text())
    assert len(results["cases"]) == len(module.QUICK_SHAPES) * len(module.DTYPES)
    for case in results["cases"]:
        for arm in ("kernel", "torch"):
            assert case[arm]["ratio"] > 0 and case[arm]["baseline_s"] > 0, (case["dtypes"], arm)
    assert (tmp_path / "bench_layout_copy_quick.png").stat().st_size > 0
