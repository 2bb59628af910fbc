"""The transposing copy into input-major weights (`dsv4.weights.layout_copy`) against a straight copy of the
same bytes.

Resident dense weights are stored input-major while checkpoints and trainers hold them row-major, so every
load and refit of such a weight is a transposing copy. For each shape and dtype pair (fp32, bf16, bf16 ->
fp32, fp32 -> bf16) this times, back to back in pairs after one warm-up each:

  baseline    `b.copy_(a)` between two contiguous tensors of the same shape (the incoming and the resident
              dtype): the same bytes read and written, in memory order, with the same conversion (a memcpy
              where the dtypes match)
  kernel      `layout_copy.transpose_into` with the library built for this CPU (its vector path:
              `vector_isa`)
  scalar      the same kernel built without AVX2 (the tiled scalar walk: what ran before the register
              blocks, and what a CPU without AVX2 gets)
  torch       torch's own strided copy, `dest.copy_(value)` into the input-major view

Each figure is the median over `--repeats` pairs of (copy / baseline) ratios, so that a neighbour slowing the
machine slows both halves of a pair (`ratio_min` / `ratio_max`: the spread). Target: near a memcpy (1x).

Writes <out>/bench_layout_copy[_quick].json and .png.
Usage: PYTHONPATH=src python benchmarks/bench_layout_copy.py [--repeats 7] [--threads 1] [--quick]
Needs the `bench` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsv4.weights import layout_copy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import write_report  # noqa: E402

MIB = 2**20
# [out, in] of the incoming row-major values: square and skinny projections from 1 MiB to 64 MiB of fp32,
# and one whose sides are no multiple of a register block.
SHAPES = [(512, 512), (1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096), (1000, 3000)]
QUICK_SHAPES = [(256, 512), (130, 70)]
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "bf16->fp32": (torch.bfloat16, torch.float32), "fp32->bf16": (torch.float32, torch.bfloat16)}
SCALAR_MARCH = "x86-64-v2"  # a build without AVX2: the tiled scalar walk
ARMS = ("kernel", "scalar", "torch")
TARGET = 1.0


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_case(shape: tuple[int, int], incoming: torch.dtype, resident: torch.dtype, repeats: int,
                 scalar_lib) -> dict:
    rows, cols = shape
    value = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(incoming)
    dest = torch.ones(cols, rows, dtype=resident).t()  # input-major, pages touched
    straight_src = value.clone()
    straight_dst = torch.ones(shape, dtype=resident)
    expected = value.to(resident)
    arms = {
        "kernel": lambda: layout_copy.transpose_into(dest, value),
        "scalar": (lambda: layout_copy.transpose_into(dest, value, scalar_lib)) if scalar_lib is not None else None,
        "torch": lambda: dest.copy_(value),
    }
    baseline = lambda: straight_dst.copy_(straight_src)
    out: dict = {"shape": list(shape), "incoming_bytes": value.nbytes, "resident_bytes": dest.nbytes}
    for name, arm in arms.items():
        if arm is None:
            continue
        baseline(), arm()
        if not torch.equal(dest.contiguous().view(torch.uint8), expected.view(torch.uint8)):
            raise AssertionError(f"{name} gave other bytes than torch for {shape} {incoming} -> {resident}")
        pairs = [(_timed(baseline), _timed(arm)) for _ in range(repeats)]
        ratios = [mine / base for base, mine in pairs]
        out[name] = {"baseline_s": statistics.median(b for b, _ in pairs),
                     "s": statistics.median(m for _, m in pairs), "ratio": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    labels = [f"{c['dtypes']}\n{c['shape'][0]}x{c['shape'][1]}" for c in cases]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(cases)), 5))
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        xs = [j + (i - (len(ARMS) - 1) / 2) * width for j in range(len(cases))]
        values = [c[arm]["ratio"] if arm in c else float("nan") for c in cases]
        ax.bar(xs, values, width, label=arm)
    ax.axhline(TARGET, color="red", linewidth=1.2)
    ax.legend(fontsize=7)
    ax.set(yscale="log", ylabel="transposing copy / straight copy (median pair; red: 1x)")
    ax.set_xticks(range(len(cases)), labels, fontsize=6)
    ax.set_title(f"layout_copy vs a straight copy, {results['threads']} thread(s), {results['machine']}, "
                 f"vector path: {results['vector_path']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    lib = layout_copy._library()
    if lib is None:
        raise SystemExit("no C compiler: the layout kernels cannot be built")
    on_x86 = platform.machine().lower() in ("x86_64", "amd64")
    scalar_lib = layout_copy.build_library(march=SCALAR_MARCH) if on_x86 else None
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": args.threads,
               "repeats": args.repeats, "torch": torch.__version__,
               "vector_path": layout_copy.VECTOR_ISAS[lib.vector_isa()],
               "stream_bytes": layout_copy.stream_bytes(), "load_average": os.getloadavg(), "cases": []}
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        for label, (incoming, resident) in DTYPES.items():
            case = measure_case(shape, incoming, resident, args.repeats, scalar_lib)
            case["dtypes"] = label
            results["cases"].append(case)
            print(f"[bench_layout_copy] {label} {shape}: " + ", ".join(
                f"{arm} x{case[arm]['ratio']:.2f}" for arm in ARMS if arm in case), flush=True)
    results["load_average_after"] = os.getloadavg()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="back-to-back (baseline, copy) pairs per figure")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the baseline's copy)")
    parser.add_argument("--quick", action="store_true", help="two small shapes, one pair each (smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    results = run(args)
    stem = args.out / ("bench_layout_copy_quick" if args.quick else "bench_layout_copy")
    write_report(stem, results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
