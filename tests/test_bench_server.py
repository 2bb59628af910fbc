"""benchmarks/bench_server.py --quick runs end to end (a server, offline generation, streaming clients, the
load test at a few clients) and writes a JSON report with every section filled."""

import json
import subprocess
import sys

from server_harness import REPO

BENCH_TIMEOUT_S = 600


def test_quick_server_benchmark_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_server.py"), "--quick", "--concurrency", "2",
         "--max-tokens", "4", "--no-plot", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "bench_server_quick.json").read_text())
    (row,) = report["dsv4"]
    assert row["concurrency"] == 2 and row["server_tok_s"] > 0 and row["offline_tok_s"] > 0
    assert row["ttft_s"]["p50"] is not None and row["itl_s"]["p99"] is not None
    assert report["load"]["ok"] and report["load"]["disconnect"]["slots_used_after"] == 0
    assert report["transformers"]["runs"] is None
