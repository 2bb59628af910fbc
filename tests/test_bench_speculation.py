"""benchmarks/bench_speculation.py --quick runs end to end and writes every figure it promises (JSON + plot).

Only the machinery is checked: timings on a shared machine are not results, so no speedup is held to its goal (the
benchmark records whether each goal is met). Acceptance is deterministic (greedy), so the quick run's is checked to be
real: some drafts accepted at every k.
"""

import json


def test_quick_mode_writes_every_figure(tmp_path, benchmark_script):
    module = benchmark_script("bench_speculation")
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_speculation_quick.json").read_text())
    rows = result["rows"]
    assert {(r["k"], r["batch"]) for r in rows} == {(k, b) for k in module.QUICK["ks"] for b in module.QUICK["batches"]}
    for r in rows:
        assert 0 < r["acceptance_rate"] <= 1 and 1 < r["mean_accepted_length"] <= r["k"] + 1
        assert len(r["per_position"]) == r["k"] and r["tok_s_off"] > 0 and r["tok_s_on"] > 0 and r["speedup"] > 0
        # The decode phase alone (TPOT), paired like the headline; the bound only at batch 1.
        assert r["decode_tok_s_off"] > 0 and r["decode_tok_s_on"] > 0
        assert r["decode_speedup_min"] <= r["decode_speedup"] <= r["decode_speedup_max"]
        assert len(r["answer_lengths"]) == module.QUICK["prompts"] and sum(r["answer_lengths"]) == r["tokens"]
        assert (r["speedup_bound_perfect_drafter"] > 0) if r["batch"] == 1 else "speedup_bound_perfect_drafter" not in r
        costs = r["costs"]  # where the steps' time went: plain decode steps, verify steps with their MTP forwards
        assert costs["off"]["decode"]["steps"] > 0 and costs["off"]["decode"]["draft_ms"] == 0
        verify = costs["on"]["verify"]
        assert verify["steps"] > 0 and verify["forward_ms"] > 0 and verify["draft_ms"] > 0
        # At most k: one commit (none after a step that finished its sequence), then one per draft after the first.
        assert 0 < verify["mtp_forwards_per_step"] <= r["k"]
    lengths = [row["tokens"] for row in result["verify_cost"]]
    assert lengths == list(range(1, max(module.QUICK["ks"]) + 2))
    assert all(row["decode_rows_ms"] > 0 and row["prefill_path_ms"] > 0 for row in result["verify_cost"])
    assert set(result["goals"]) == set(module.GOALS) and set(result["break_even_batch"]) == {"1", "3"}
    assert (tmp_path / "bench_speculation_quick.png").stat().st_size > 0


def test_perfect_drafter_bound_counts_the_fewest_verify_chunks(benchmark_script):
    module = benchmark_script("bench_speculation")
    plain = {"prefill": {"steps": 2, "forward_ms": 5.0, "draft_ms": 0.0, "other_ms": 1.0},
             "decode": {"steps": 4, "forward_ms": 3.0, "draft_ms": 0.0, "other_ms": 0.5}}
    row = {"k": 2, "answer_lengths": [1, 6], "costs": {"off": plain}}
    # Answer 1: its prompt forward only. Answer 2: prompt, then 5 tokens left: chunks of 3 and 2 tokens, at
    # 2.0 and 1.5 decode forwards (3 ms each).
    bound_ms = 5.0 + 5.0 + 2.0 * 3.0 + 1.5 * 3.0
    assert module.perfect_drafter_bound(row, {1: 1.0, 2: 1.5, 3: 2.0}) == (2 * 6.0 + 4 * 3.5) / bound_ms
