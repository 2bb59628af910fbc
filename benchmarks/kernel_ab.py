"""A kernel switched off and on inside one engine, in one process: the decode step timed both ways, paired.

The two sides of a pair share weights, caches, threads and the machine's state of the moment, so a change
of a few percent resolves where two processes (each with its own memory layout) would not. Workload: the
median decode engine step (bench_generate's `dsv4_decode_step`: forward + sampling) with B running sequences
after --prompt-len random prompts; ratio = off seconds / on seconds (> 1: the kernel is faster), the median
of `repeats` back-to-back pairs (`paired.py`). Used by bench_kernel_switch.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import bench_generate as bench
from dsv4 import LLM
from paired import paired


def decode_step_ab(llm: LLM, use: Callable[[bool], None], batches: list[int], prompt_len: int, steps: int,
                   repeats: int, vocab: int, sides: tuple[str, str]) -> list[dict]:
    """Per batch size, the paired decode step with `use(False)` then `use(True)`; rows keyed by `sides`
    (names of the off and on side: "<side>_ms"). The kernel is left on."""
    rows = []
    for batch in batches:
        prompts = bench._prompts(batch, prompt_len, vocab)

        def step(on: bool, p=prompts) -> float:
            use(on)
            return bench.dsv4_decode_step(llm, p, steps)

        t = paired(lambda: step(False), lambda: step(True), repeats)
        row = {"batch": batch, f"{sides[0]}_ms": t.peer_s * 1e3, f"{sides[1]}_ms": t.ds_s * 1e3,
               "pairs": list(t.ratios), **t.fields()}
        rows.append(row)
        print(f"b={batch}: {sides[0]} {t.peer_s * 1e3:.3f} ms, {sides[1]} {t.ds_s * 1e3:.3f} ms, x{t.ratio:.3f} "
              f"[{min(t.ratios):.3f}, {max(t.ratios):.3f}]", flush=True)
    use(True)
    return rows


def plot_decode_step_ab(rows: list[dict], path: Path, sides: tuple[str, str], labels: tuple[str, str],
                        title: str) -> None:
    """Both sides' step time against the batch size, each batch's ratio at the on side's point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for side, label in zip(sides, labels):
        ax.plot(batches, [r[f"{side}_ms"] for r in rows], "o-", label=label)
    for r in rows:
        ax.annotate(f"x{r['ratio']:.2f}", (r["batch"], r[f"{sides[1]}_ms"]), textcoords="offset points",
                    xytext=(4, -12))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running sequences (rows per decode step)")
    ax.set_ylabel("median decode step (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
