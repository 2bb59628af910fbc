"""The few-row CPU kernels (src/dsv4/kernels/gemv_cpu.py) against what dsv4 runs today, shape by shape.

Shapes are the small config's (tests/reference.py `small_config`): every dense projection of a decode step,
the output head, and the routed experts of one MoE layer. For each, at each row count:

  dense fp32 / bf16   DenseGemv vs `F.linear` on the same input-major weight
  fp8 / fp4           QuantGemv vs dequantise + matmul (the reference path: `dequantize_*` then `x @ W.T`)
  experts fp32/fp8/fp4  FusedExperts / FusedQuantExperts vs `loop_experts` (the model's loop, which
                      dequantises each used FP8/FP4 expert per call), k=2 random picks of E=16 per token
  fp8/fp4 vs fp32     the FP8 / FP4 experts as the model runs them (FusedQuantExperts, any row count) vs the
                      same values as dense fp32 experts as the model runs them (FusedExperts where its
                      `supports` takes the call, else GroupedExperts' grouped GEMMs), --expert-tokens tokens:
                      ratio > 1 means the quantized experts are faster (issue 18: at least as fast everywhere)

Weights are "cold": each call reads a different copy from a pool larger than the last-level cache
(--pool-mb), as a decode step reads each layer's weights once; --warm reuses one copy. The two
implementations alternate (paired.py): ratio = reference seconds / kernel seconds (> 1: the kernel is
faster), and each side's effective bandwidth = resident weight bytes / seconds.
Writes <out>/bench_gemv_t<threads>[_warm].json and .png.
Usage: python benchmarks/bench_gemv.py [--threads 2] [--rows 1 4 8 16] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from dsv4.kernels.gathered_experts import GroupedExperts, loop_experts  # noqa: E402
from dsv4.kernels.gemv_cpu import build_kernels  # noqa: E402
from dsv4.model.linear import input_major  # noqa: E402
from dsv4.model.moe import swiglu  # noqa: E402
from dsv4.quant import dequantize_fp4, dequantize_fp8_blockwise, quantize_fp4, quantize_fp8_blockwise  # noqa: E402
from paired import paired  # noqa: E402
from report import write_report  # noqa: E402

# The small config's projections [out, in] (attention, indexer, compressor, shared expert, mHC mix, head).
DENSE_SHAPES = {"wq_a": (256, 512), "wq_b": (512, 256), "wkv": (64, 512), "wo_a": (512, 128), "wo_b": (512, 512),
                "indexer.wq_b": (256, 256), "shared w1": (256, 512), "shared w2": (512, 256),
                "hc mix": (24, 2048), "head": (16384, 512)}
EXPERTS, DIM, INTER, TOPK = 16, 512, 256, 2
FP8_BLOCK, FP4_BLOCK = (128, 128), (1, 32)
LIMIT = 10.0
CALLS = 20  # calls per timed sample (their median)


class Pool:
    """Copies of one weight (tuple of tensors) cycled so each call reads a copy that is not in cache."""

    def __init__(self, make, nbytes: int, pool_bytes: int):
        self.items = [make() for _ in range(max(1, pool_bytes // max(1, nbytes)))]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def _median_call(fn, pool: Pool) -> float:
    times = []
    for _ in range(CALLS):
        w = pool.next()
        start = time.perf_counter()
        fn(*w)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(name: str, kind: str, rows: int, nbytes: int, kernel_fn, reference_fn, pool: Pool, repeats: int) -> dict:
    t = paired(lambda: _median_call(reference_fn, pool), lambda: _median_call(kernel_fn, pool), repeats)
    row = {"name": name, "kind": kind, "rows": rows, "weight_bytes": nbytes, "kernel_us": t.ds_s * 1e6,
           "reference_us": t.peer_s * 1e6, "kernel_gb_s": nbytes / t.ds_s / 1e9,
           "reference_gb_s": nbytes / t.peer_s / 1e9, **t.fields()}
    print(f"{kind:12s} {name:14s} R={rows:3d}: kernel {row['kernel_us']:8.1f} us {row['kernel_gb_s']:6.1f} GB/s | "
          f"reference {row['reference_us']:8.1f} us {row['reference_gb_s']:6.1f} GB/s | x{t.ratio:.2f}", flush=True)
    return row


def _dense_weight(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    w = input_major(out_features, in_features, dtype)
    w.copy_(torch.randn(out_features, in_features) / in_features**0.5)
    return w


def bench_dense(args, dense, quant) -> list[dict]:
    rows_out = []
    for name, (out_features, in_features) in DENSE_SHAPES.items():
        for dtype, kind in ((torch.float32, "dense fp32"), (torch.bfloat16, "dense bf16")):
            nbytes = out_features * in_features * torch.finfo(dtype).bits // 8
            pool = Pool(lambda o=out_features, i=in_features, d=dtype: (_dense_weight(o, i, d),), nbytes, args.pool)
            for rows in args.rows:
                x = torch.randn(rows, in_features).to(dtype)  # every row count, also where `supports` declines
                rows_out.append(_row(name, kind, rows, nbytes, lambda w, x=x: dense(x, w),
                                     lambda w, x=x: F.linear(x, w), pool, args.repeats))
        for kind, block in (("fp8", FP8_BLOCK), ("fp4", FP4_BLOCK)):
            if in_features % FP4_BLOCK[1]:
                continue

            def make(o=out_features, i=in_features, kind=kind):
                w = torch.randn(o, i) / i**0.5
                if kind == "fp8":
                    q, s = quantize_fp8_blockwise(w, FP8_BLOCK, scale_fmt="float")
                    return q, s.float()
                return quantize_fp4(w)

            nbytes = out_features * in_features // (1 if kind == "fp8" else 2)
            pool = Pool(make, nbytes, args.pool)

            def reference(q, s, x=None, kind=kind, block=block):
                w = dequantize_fp8_blockwise(q, s, block) if kind == "fp8" else dequantize_fp4(q, s)
                return x @ w.t()

            for rows in args.rows:
                x = torch.randn(rows, in_features)
                rows_out.append(_row(name, kind, rows, nbytes, lambda q, s, x=x, b=block: quant(x, q, s, b),
                                     lambda q, s, x=x, ref=reference: ref(q, s, x), pool, args.repeats))
    return rows_out


def bench_experts(args, fused, fused_quant) -> list[dict]:
    rows_out = []
    for kind in ("fp32", "fp8", "fp4"):
        def make(kind=kind):
            return tuple(_stacks(kind, _random_matrices()))

        per_expert = 3 * DIM * INTER * {"fp32": 4, "fp8": 1, "fp4": 0.5}[kind]
        pool = Pool(make, int(per_expert * EXPERTS), args.pool)
        block = FP8_BLOCK if kind == "fp8" else FP4_BLOCK
        for tokens in args.rows:
            x, ids, weights = _routing(tokens)
            used = ids.unique().numel()

            def kernel(w1, s1, w3, s3, w2, s2, x=x, ids=ids, weights=weights, kind=kind, block=block):
                if kind == "fp32":
                    return fused(x, ids, weights, w1, w3, w2, LIMIT)
                return fused_quant(x, ids, weights, w1, s1, w3, s3, w2, s2, block, LIMIT)

            def reference(w1, s1, w3, s3, w2, s2, x=x, ids=ids, weights=weights, kind=kind, block=block):
                stacks = {"w1": (w1, s1), "w3": (w3, s3), "w2": (w2, s2)}

                def expert_weight(name, e):
                    w, s = stacks[name]
                    if kind == "fp32":
                        return w[e]
                    if kind == "fp8":
                        return dequantize_fp8_blockwise(w[e], s[e], block)
                    return dequantize_fp4(w[e], s[e])

                return loop_experts(x, ids, weights, expert_weight, EXPERTS, LIMIT, swiglu)

            rows_out.append(_row(f"E={EXPERTS} k={TOPK}", f"experts {kind}", tokens, int(per_expert * used), kernel,
                                 reference, pool, args.repeats))
    return rows_out


def _stacks(kind: str, dense_matrices: list[torch.Tensor]) -> list:
    """[w1, s1, w3, s3, w2, s2] of `kind` ("fp32": input-major, scales None; "fp8" / "fp4") holding the
    matrices [E, out, in] given (w1, w3, w2)."""
    stacks = []
    for dense in dense_matrices:
        if kind == "fp32":
            w = input_major(dense.shape[1], dense.shape[2], torch.float32, stack=(EXPERTS,))
            w.copy_(dense)
            stacks += [w, None]
        elif kind == "fp8":
            pairs = [quantize_fp8_blockwise(m, FP8_BLOCK, scale_fmt="float") for m in dense]
            stacks += [torch.stack([q for q, _ in pairs]), torch.stack([s.float() for _, s in pairs])]
        else:
            pairs = [quantize_fp4(m) for m in dense]
            stacks += [torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])]
    return stacks


def _random_matrices() -> list[torch.Tensor]:
    return [torch.randn(EXPERTS, o, i) / i**0.5 for o, i in ((INTER, DIM), (INTER, DIM), (DIM, INTER))]


def _routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, DIM, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, TOPK, generator=g)


def bench_quant_vs_dense(args, fused, fused_quant) -> list[dict]:
    """FP8 / FP4 experts against dense fp32 experts of the same values, each as the model runs it."""
    rows_out, grouped = [], GroupedExperts()
    for kind in ("fp8", "fp4"):
        block = FP8_BLOCK if kind == "fp8" else FP4_BLOCK

        def make(kind=kind, block=block):
            quant = _stacks(kind, _random_matrices())
            # the quantized values as dense fp32: both sides compute the same experts
            dequantize = functools.partial(dequantize_fp8_blockwise, block=block) if kind == "fp8" else dequantize_fp4
            dense = _stacks("fp32", [torch.stack([dequantize(q[e], s[e]) for e in range(EXPERTS)])
                                     for q, s in zip(quant[::2], quant[1::2])])
            return (*quant, *dense[::2])

        per_expert = 3 * DIM * INTER * {"fp8": 1, "fp4": 0.5}[kind]
        pool = Pool(make, int((per_expert + 3 * DIM * INTER * 4) * EXPERTS), args.pool)
        for tokens in args.expert_tokens:
            x, ids, weights = _routing(tokens)

            def quant(w1, s1, w3, s3, w2, s2, d1, d3, d2, x=x, ids=ids, weights=weights, block=block):
                return fused_quant(x, ids, weights, w1, s1, w3, s3, w2, s2, block, LIMIT)

            def dense(w1, s1, w3, s3, w2, s2, d1, d3, d2, x=x, ids=ids, weights=weights):
                call = (x, ids, weights, d1, d3, d2, LIMIT)
                return fused(*call) if fused.supports(*call) else grouped(*call, swiglu)

            rows_out.append(_row(f"E={EXPERTS} k={TOPK}", f"{kind} vs fp32", tokens,
                                 int(per_expert * ids.unique().numel()), quant, dense, pool, args.repeats))
    return rows_out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in results["rows"]})
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for rows in sorted({r["rows"] for r in results["rows"] if r["kind"] == kind}):
            sel = [r for r in results["rows"] if r["kind"] == kind and r["rows"] == rows]
            ax.plot([r["name"] for r in sel], [r["ratio"] for r in sel], marker="o", label=f"R={rows}")
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_title(kind, fontsize=10)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        ax.set_ylabel("reference time / kernel time")
        ax.legend(fontsize=7)
    warm = "warm" if results["warm"] else "cold"
    fig.suptitle(f"gemv_cpu kernels vs dsv4's current paths, {results['threads']} thread(s), {warm} weights")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--expert-tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512],
                        help="tokens of the FP8 / FP4 vs dense fp32 expert rows (prefill chunks included)")
    parser.add_argument("--only", choices=["dense", "experts", "quant-vs-dense"], nargs="+",
                        default=["dense", "experts", "quant-vs-dense"], help="which groups of rows to run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pool-mb", type=int, default=512, help="bytes of weight copies cycled per shape")
    parser.add_argument("--warm", action="store_true", help="one copy per shape (weights stay in cache)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 and 4 rows, 1 repeat, 8 MB pools")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.expert_tokens, args.repeats, args.pool_mb = [1, 4], [1, 64], 1, 8
    args.pool = 0 if args.warm else args.pool_mb * 2**20
    torch.set_num_threads(args.threads)
    dense, quant, fused, fused_quant, *_ = build_kernels()
    rows = []
    if "dense" in args.only:
        rows += bench_dense(args, dense, quant)
    if "experts" in args.only:
        rows += bench_experts(args, fused, fused_quant)
    if "quant-vs-dense" in args.only:
        rows += bench_quant_vs_dense(args, fused, fused_quant)
    results = {"threads": args.threads, "warm": args.warm, "repeats": args.repeats, "pool_mb": args.pool_mb,
               "torch": torch.__version__, "rows": rows}
    write_report(args.out / f"bench_gemv_t{args.threads}{'_warm' if args.warm else ''}", results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
