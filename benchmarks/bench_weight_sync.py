"""Weight sync over loopback gloo: time against bytes for several bucket sizes, against a memcpy of the
same bytes on this machine, and how long the engine is unavailable during an update.

A trainer process (`dsv4.rl.WeightSender`, rank 0) sends the weights of a dummy-loaded model (fp32, dense
experts) to rank 1 in this process: the whole model, and partial updates of its first 1/16 and 1/4 tensors
(a refit may carry any subset), at each bucket size, in two modes:
  transport      into `WeightReceiver` with a session that keeps nothing: the protocol, packing,
                 broadcast and per-bucket checksums, i.e. what weight sync itself costs
  refit          into `LLM.update_weights_from_distributed`: the same plus the engine's refit session
                 (validation, conversion, atomic staging, write, finalize, address audit)

Per update:
  sync_s         the trainer's `send`: agreeing on the plan, packing, broadcasting, the engine verifying
                 (checksum) and staging every bucket, its commit (write, finalize, audit), and its answer
  plan_s         the trainer's `plan`: one read of the tensors to checksum every bucket
  unavailable_s  the engine's `update_weights_from_distributed` call: the engine loop runs no step
                 meanwhile (receive_wait_s + apply_s + commit_s, as the engine reports them)
  memcpy_s       one `copy_` of a buffer of the same bytes, measured right after the update (paired)
  ratio          sync_s / memcpy_s of the same repetition; the JSON keeps the median and spread
                 (goal: within 2x)

Writes <out>/bench_weight_sync[_quick].json and .png. Usage:
    python benchmarks/bench_weight_sync.py [--config small] [--buckets-mib 4 16 64 256] [--repeats 3]
    python benchmarks/bench_weight_sync.py --quick      # tiny model, seconds (the test suite runs this)
Needs the `test` extra (the configs come from tests/reference.py) and `bench` (matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import platform
import queue
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the model configs live with the tests

from safetensors.torch import load_file, save_file  # noqa: E402

import reference as ref  # noqa: E402
from dsv4 import LLM  # noqa: E402
from dsv4.rl import WeightSender  # noqa: E402
from dsv4.weights.transfer import WeightReceiver  # noqa: E402

CONFIGS = {"tiny": ref.tiny_config, "small": ref.small_config}
FRACTIONS = (1 / 16, 1 / 4, 1.0)  # share of the model's tensors an update carries
MIB = 1 << 20
QUICK_BUCKETS = (64 << 10, 1 << 20)
TIMEOUT_S = 300.0
# transport: the protocol, packing, broadcast and checksums, into a session that keeps nothing (what
# weight sync itself costs); refit: the same into a real engine's refit session (what an update costs).
TRANSPORT, REFIT = "transport", "refit"
MODES = (TRANSPORT, REFIT)


def _config(name: str) -> dict:
    """A model config of the test harness (imported here only: the trainer process needs no transformers)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import reference

    return {"tiny": reference.tiny_config, "small": reference.small_config}[name]()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subsets(names: list[str]) -> list[list[str]]:
    return [names[: max(1, round(len(names) * f))] for f in FRACTIONS]


class DiscardSession:
    """Stands in for a refit session in the transport-only mode: takes the verified buckets, keeps nothing."""

    active = True

    def load(self, bucket, origin=None) -> int:
        return 0

    def finish(self) -> int:
        self.active = False
        return 1

    def abort(self) -> None:
        self.active = False


def trainer(ports: dict[str, int], tensors_path: str, buckets: list[int], repeats: int, out) -> None:
    """Rank 0: per mode (its own group), for every (subset, bucket size, repetition): plan, then send."""
    torch.set_num_threads(1)
    try:
        tensors = load_file(tensors_path)
        for mode in MODES:
            sender = WeightSender("127.0.0.1", ports[mode], 2, group_name=mode, timeout=TIMEOUT_S)
            for names in _subsets(list(tensors)):
                update = {n: tensors[n] for n in names}
                for bucket in buckets:
                    for _ in range(repeats):
                        start = time.perf_counter()
                        meta = sender.plan(update, bucket_bytes=bucket)
                        out.put(("meta", (meta, time.perf_counter() - start)))
                        out.put(("sent", sender.send(update, meta)))
            sender.close()
    except Exception as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def _next(q, kind: str):
    try:
        got, payload = q.get(timeout=TIMEOUT_S)
    except queue.Empty:
        raise TimeoutError(f"the trainer sent nothing for {TIMEOUT_S} s") from None
    if got != kind:
        raise RuntimeError(f"trainer: {payload}")
    return payload


def _memcpy_s(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # both touched first: page faults are not memcpy
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = _config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(cfg))
        llm = LLM(model_dir, load_format="dummy", dtype="float32", expert_dtype="dense", max_num_seqs=1,
                  max_model_len=64)
        tensors_path = Path(tmp) / "weights.safetensors"
        save_file({n: t.contiguous().clone() for n, t in llm.iter_weights()}, str(tensors_path))
        ports = {mode: _free_port() for mode in MODES}
        context = multiprocessing.get_context("spawn")
        q = context.Queue()
        proc = context.Process(target=trainer, args=(ports, str(tensors_path), args.buckets, args.repeats, q),
                               daemon=True)
        proc.start()
        rows = []
        try:
            for mode in MODES:
                if mode == TRANSPORT:
                    receiver = WeightReceiver("127.0.0.1", ports[mode], 1, 2, mode, "gloo", TIMEOUT_S)
                    update = functools.partial(receiver.update, version=0, begin=DiscardSession, max_bytes=1 << 62)
                else:
                    llm.init_weight_transfer("127.0.0.1", ports[mode], group_name=mode, timeout=TIMEOUT_S)
                    update = llm.update_weights_from_distributed
                for _ in FRACTIONS:
                    for bucket in args.buckets:
                        for rep in range(args.repeats):
                            rows.append(_measure(q, update, mode, bucket, rep))
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    return {"config": args.config, "threads": args.threads, "repeats": args.repeats, "rows": rows,
            "summary": _summary(rows), "machine": platform.platform(), "torch": torch.__version__,
            "note": "contended 2-core VM unless re-run on a quiet machine"}


def _measure(q, update, mode: str, bucket: int, rep: int) -> dict:
    meta, plan_s = _next(q, "meta")
    start = time.perf_counter()
    got = update(meta)
    unavailable = time.perf_counter() - start
    sent = _next(q, "sent")
    memcpy = _memcpy_s(got["bytes"])
    row = {"mode": mode, "bytes": got["bytes"], "tensors": got["tensors"], "bucket_bytes": bucket,
           "buckets": got["buckets"], "repeat": rep, "plan_s": plan_s, "sync_s": sent["seconds"],
           "unavailable_s": unavailable, "receive_wait_s": got["receive_wait_s"], "apply_s": got["apply_s"],
           "commit_s": got["commit_s"], "memcpy_s": memcpy, "ratio": sent["seconds"] / memcpy}
    print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def _summary(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["mode"], r["bytes"], r["bucket_bytes"]) for r in rows}):
        group = [r for r in rows if (r["mode"], r["bytes"], r["bucket_bytes"]) == key]
        ratios = [r["ratio"] for r in group]
        out.append({"mode": key[0], "bytes": key[1], "bucket_bytes": key[2],
                    "sync_s": statistics.median(r["sync_s"] for r in group),
                    "unavailable_s": statistics.median(r["unavailable_s"] for r in group),
                    "commit_s": statistics.median(r["commit_s"] for r in group),
                    "memcpy_s": statistics.median(r["memcpy_s"] for r in group),
                    "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 5))
    for mode, style in ((REFIT, "-"), (TRANSPORT, "--")):
        for bucket in sorted({s["bucket_bytes"] for s in summary}):
            pts = [s for s in summary if s["bucket_bytes"] == bucket and s["mode"] == mode]
            mb = [s["bytes"] / MIB for s in pts]
            label = f"{mode}, {bucket / MIB:g} MiB buckets"
            ax_t.loglog(mb, [s["sync_s"] for s in pts], style, marker="o", label=f"sync: {label}")
            ax_r.semilogx(mb, [s["ratio"] for s in pts], style, marker="o", label=label)
    largest = max(x["bucket_bytes"] for x in summary)
    at_largest = [s for s in summary if s["mode"] == REFIT and s["bucket_bytes"] == largest]
    memcpy = sorted((s["bytes"], s["memcpy_s"]) for s in at_largest)
    ax_t.loglog([b / MIB for b, _ in memcpy], [t for _, t in memcpy], "k--", label="memcpy, same bytes")
    unavailable = sorted((s["bytes"], s["unavailable_s"]) for s in at_largest)
    ax_t.loglog([b / MIB for b, _ in unavailable], [t for _, t in unavailable], "r:",
                label="engine unavailable (largest buckets)")
    ax_t.set_xlabel("update size (MiB)")
    ax_t.set_ylabel("seconds")
    ax_t.legend(fontsize=6, loc="upper left")
    ax_r.axhline(2.0, color="k", linestyle="--", label="goal: 2x memcpy")
    ax_r.set_xlabel("update size (MiB)")
    ax_r.set_ylabel("sync / memcpy (paired median)")
    ax_r.legend(fontsize=6, loc="upper right")
    fig.suptitle(f"weight sync over loopback gloo, {results['config']} model (fp32, dense experts); "
                 f"{results['note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=CONFIGS, default="small")
    p.add_argument("--buckets-mib", type=float, nargs="+", default=[4, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, two small bucket sizes, one repetition")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.buckets = [int(b * MIB) for b in args.buckets_mib]
    if args.quick:
        args.config, args.buckets, args.repeats = "tiny", list(QUICK_BUCKETS), 1
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "bench_weight_sync" + ("_quick" if args.quick else "")
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_plot:
        plot(results, args.out / f"{name}.png")
    return results


if __name__ == "__main__":
    main()
