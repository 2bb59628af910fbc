"""benchmarks/bench_parallel.py --quick runs end to end (one process and two spawned ranks) and writes every
figure it promises (JSON + plot). Only the machinery is checked: timings on a shared machine are not results."""

import importlib
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_quick_mode_writes_every_figure(tmp_path, monkeypatch):
    # Imported by name from its folder: the ranks it spawns import it the same way.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("bench_parallel")
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
