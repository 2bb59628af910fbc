"""benchmarks/bench_shared_prefill.py --quick runs end to end and writes every figure it promises (JSON + plot).

Only the machinery is checked (timings on a shared machine are not results): both sides returned the same
tokens, and sharing computed each prompt once where sharing off computed it once per sample.
"""

import json


def test_quick_mode_writes_every_figure(tmp_path, benchmark_script):
    module = benchmark_script("bench_shared_prefill")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_shared_prefill_quick.json").read_text())
    quick = module.QUICK
    (row,) = result["rows"]
    prompt_tokens = quick["prompts"] * quick["prompt_len"]
    assert row["outputs_identical"] is True
    assert row["prompt_tokens_on"] == prompt_tokens and row["prompt_tokens_off"] == prompt_tokens * quick["samples"]
    assert row["off_s"] > 0 and row["on_s"] > 0 and len(row["pairs"]) == quick["repeats"]
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    assert (tmp_path / "bench_shared_prefill_quick.png").stat().st_size > 0
