"""benchmarks/bench_parallel.py --quick runs end to end (one process and two spawned ranks) and writes every
figure it promises (JSON + plot). Only the machinery is checked: timings on a shared machine are not results."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_parallel.py"


def test_quick_mode_writes_every_figure(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_parallel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench_parallel_quick.json").read_text())
    row = results["sizes"]["tiny"]
    assert set(row["launches"]) == {name for name, _, _ in module.QUICK_LAUNCHES}
    figures = row["tp2_ep"]
    for metric in ("load_s", "prefill_s", "decode_s"):
        assert figures[metric]["ratio"] > 0 and figures[metric]["one_s"] > 0 and figures[metric]["two_s"] > 0
    assert figures["resident_bytes_ratio"] > 1  # each rank holds less than the whole model
    assert figures["decode_tokens"] == module.BATCH * module.QUICK_NEW_TOKENS
    assert (tmp_path / "bench_parallel_quick.png").stat().st_size > 0
