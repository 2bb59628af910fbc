"""Weight sync over loopback gloo and through shared memory: time against bytes for several bucket sizes and
model sizes, against a memcpy of the same bytes on this machine, and how long requests wait during an update.

A trainer process (`dsv4.rl.WeightSender`, rank 0) sends the weights of a dummy-loaded model (fp32, dense
experts) to rank 1 in this process. Per model size (`--configs`; tiny ~2 MiB, small ~295 MiB, large ~1.04 GiB):

  transport      the whole model and partial updates of its first 1/16 and 1/4 tensors (a refit may carry any
                 subset), at each bucket size, into `WeightReceiver` with a session that keeps nothing: the
                 protocol, packing, broadcast and per-bucket checksums, i.e. what weight sync itself costs
  refit          the same updates into `LLM.update_weights_from_distributed`: the same plus the engine's
                 atomic refit session (validation, conversion, staging, write, finalize, address audit).
                 The engine receives bucket i+1 while it verifies and stages bucket i (two buffers).
  serving        the whole model at the smallest bucket size, into the same engine while a thread streams
                 requests through it (pause="retract": requests in flight are preempted for the commit and
                 recompute their tokens under the new weights): what requests wait during an update
  colocated      the same updates as refit through shared memory instead of gloo (`ColocatedWeightSender`
                 in the trainer process, `LLM.update_weights_from_shared` in the engine): the trainer's
                 share (one packing copy into /dev/shm) and the engine's update (checksums, the same atomic
                 refit session) with no transport between them

Per update:
  sync_s          the trainer's `send`: agreeing on the plan, packing, broadcasting, the engine verifying
                  (checksum) and staging every bucket, its commit (write, finalize, audit), and its answer;
                  colocated: share_s (the trainer packing every bucket into shared memory) + update_call_s
  plan_s          the trainer's `plan`: one read of the tensors to checksum every bucket
  update_call_s   the engine's `update_weights_from_distributed` call: receive_wait_s (waiting for a bucket
                  to arrive) + apply_s (verify and stage) + commit_s (the atomic session's finish: the only
                  phase generation is paused for)
  memcpy_s        one `copy_` of a buffer of the same bytes, measured right after the update (paired)
  ratio           sync_s / memcpy_s of the same repetition; the summary keeps the median and spread, against
                  issue 19's target for a refit (3x a memcpy of the same bytes)
summary rows of the refit and serving modes also have, from the transport row of the same update (the floor
weight sync sets before the engine does anything): transport_sync_s, transport_ratio (its ratio to a
memcpy), over_transport_s (sync_s - transport_sync_s: what the engine adds) and ratio_over_transport
serving rows also have:
  request_wait_s  the longest time any request went without a new token while the update ran (its submit
                  counts as its first event): the pause, the recompute after a retract, and any step slowed
                  by the receive running beside it
  token_gap_s     the median time between tokens of the same stream outside updates (one decode step)
  tokens_during_update  tokens the stream produced while the update call ran (the receive does not stop
                  generation; only the commit does)

Writes <out>/bench_weight_sync[_quick][_<modes>].json and .png (the modes' names when not all run). Usage:
    python benchmarks/bench_weight_sync.py [--configs tiny small large] [--modes transport refit serving colocated]
                                           [--buckets-mib 4 16 64 256] [--repeats 2]
    python benchmarks/bench_weight_sync.py --quick      # tiny model, seconds (the test suite runs this)
Needs the `test` extra (the configs come from tests/reference.py) and `bench` (matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing
import platform
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the model configs live with the tests

from safetensors.torch import load_file, save_file  # noqa: E402

import reference as ref  # noqa: E402
from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.rl import ColocatedWeightSender, WeightSender  # noqa: E402
from dsv4.weights.transfer import WeightReceiver  # noqa: E402

# small with 80 experts instead of 16: ~1.04 GiB of fp32 weights, the ">= 1 GB".
CONFIGS = {"tiny": ref.tiny_config, "small": ref.small_config,
           "large": functools.partial(ref.small_config, n_routed_experts=80)}
FRACTIONS = (1 / 16, 1 / 4, 1.0)  # share of the model's tensors an update carries
MIB = 1 << 20
QUICK_BUCKETS = (64 << 10, 1 << 20)
TIMEOUT_S = 600.0
TARGET_RATIO = 3.0  # issue 19: a refit of every tensor within 3x a memcpy of the same bytes
# transport: the protocol, packing, broadcast and checksums, into a session that keeps nothing (what
# weight sync itself costs); refit: the same into a real engine's refit session (what an update costs);
# serving: a refit while requests stream (what requests wait); colocated: a refit through shared memory.
TRANSPORT, REFIT, SERVING, COLOCATED = "transport", "refit", "serving", "colocated"
MODES = (TRANSPORT, REFIT, SERVING, COLOCATED)
# The serving stream: requests of this many new tokens back to back, in a context long enough to outlast an
# update (the cache costs nothing until written).
STREAM_TOKENS = 256
STREAM_PROMPT = list(range(2, 18))
SERVING_PAUSE = "retract"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule(mode: str, num_tensors: int, buckets: list[int], repeats: int) -> list[tuple[int, int, int]]:
    """The updates a mode runs, in order, as (tensors carried: the first n, bucket bytes, repetition); the trainer
    and the engine walk the same list."""
    if mode == SERVING:
        return [(num_tensors, min(buckets), rep) for rep in range(repeats)]
    counts = [max(1, round(num_tensors * f)) for f in FRACTIONS]
    return [(n, bucket, rep) for n in counts for bucket in buckets for rep in range(repeats)]


class DiscardSession:
    """Stands in for a refit session in the transport-only mode: takes the verified buckets, keeps nothing."""

    active = True
    atomic = False  # as fail-stop: each bucket's checksum is verified whole before `load` (which reads nothing)

    def load(self, bucket, origin=None) -> int:
        return 0

    def check_complete(self) -> None:
        """Nothing is kept, so nothing can be missing."""

    def finish(self) -> int:
        self.active = False
        return 1

    def abort(self) -> None:
        self.active = False


def trainer(ports: dict[str, int], tensors_path: str, buckets: list[int], repeats: int, out, ready) -> None:
    """Rank 0: per mode (its own group), for every update of `schedule`: once the engine says it is ready (so
    that sync_s does not count the engine's own preparations, e.g. a stream starting), plan, then send."""
    torch.set_num_threads(1)
    try:
        tensors = load_file(tensors_path)
        names = list(tensors)
        for mode in ports:
            colocated = mode == COLOCATED
            sender = (ColocatedWeightSender() if colocated
                      else WeightSender("127.0.0.1", ports[mode], 2, group_name=mode, timeout=TIMEOUT_S))
            for count, bucket, _ in schedule(mode, len(names), buckets, repeats):
                update = {n: tensors[n] for n in names[:count]}
                ready.get(timeout=TIMEOUT_S)
                start = time.perf_counter()
                meta = sender.plan(update, bucket_bytes=bucket)
                out.put(("meta", (meta, time.perf_counter() - start)))
                if colocated:  # the engine applies it once the handle arrives, then says so
                    start = time.perf_counter()
                    handle = sender.share(update, meta)
                    out.put(("shared", (handle, time.perf_counter() - start)))
                    ready.get(timeout=TIMEOUT_S)
                else:
                    out.put(("sent", sender.send(update, meta)))
            if colocated:
                sender.release()
            else:
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


class Stream:
    """A thread that streams requests through the engine back to back, recording when each request was
    submitted and when each of its tokens arrived (the events `request_wait` reads)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.events: list[tuple[float, int, int]] = []  # (time, request number, new tokens; submit: 0)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bench-stream", daemon=True)

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=TIMEOUT_S)
        if self._error is not None:
            raise RuntimeError(f"the serving stream failed: {self._error}") from self._error

    def _run(self) -> None:
        params = SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True)
        number = 0
        try:
            while not self._stop.is_set():
                self.events.append((time.perf_counter(), number, 0))
                for out in self.llm.stream([STREAM_PROMPT], params):
                    self.events.append((time.perf_counter(), number, len(out.outputs[0].token_ids)))
                    if self._stop.is_set():
                        break
                number += 1
        except BaseException as exc:  # reported by __exit__ in the measuring thread
            self._error = exc

    def tokens(self) -> int:
        """Tokens streamed so far."""
        return sum(k for _, _, k in self.events)

    def wait_for_tokens(self, n: int) -> None:
        """Block until the stream produced n tokens (it is generating before an update starts)."""
        deadline = time.perf_counter() + TIMEOUT_S
        while self.tokens() < n:
            if self._error is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"the serving stream produced no tokens: {self._error}")
            time.sleep(0.01)


def request_wait(events: list[tuple[float, int, int]], start: float, end: float) -> dict:
    """From a stream's events and one update's window [start, end]: the longest gap between consecutive events
    of one request that overlaps the window, the median gap between tokens outside every window, and the tokens
    produced inside it."""
    by_request: dict[int, list[float]] = {}
    for t, number, _ in events:
        by_request.setdefault(number, []).append(t)
    longest, outside = 0.0, []
    for times in by_request.values():
        for a, b in itertools.pairwise(times):
            if b >= start and a <= end:
                longest = max(longest, b - a)
            else:
                outside.append(b - a)
    during = sum(k for t, _, k in events if start <= t <= end)
    return {"request_wait_s": longest, "token_gap_s": statistics.median(outside) if outside else float("nan"),
            "tokens_during_update": during}


def run_config(name: str, args) -> list[dict]:
    """Every mode's updates of one model size; a fresh trainer process and engine."""
    cfg = CONFIGS[name]()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(cfg))
        llm = LLM(model_dir, load_format="dummy", dtype="float32", expert_dtype="dense", max_num_seqs=1,
                  max_model_len=len(STREAM_PROMPT) + STREAM_TOKENS + 1)
        tensors_path = Path(tmp) / "weights.safetensors"
        save_file({n: t.contiguous().clone() for n, t in llm.iter_weights()}, str(tensors_path))
        num_tensors = sum(1 for _ in llm.iter_weights())
        ports = {mode: None if mode == COLOCATED else _free_port() for mode in args.modes}  # in MODES order
        context = multiprocessing.get_context("spawn")
        q, ready = context.Queue(), context.Queue()
        proc = context.Process(target=trainer, args=(ports, str(tensors_path), args.buckets, args.repeats, q, ready),
                               daemon=True)
        proc.start()
        rows = []
        try:
            for mode in ports:
                if mode == TRANSPORT:
                    receiver = WeightReceiver("127.0.0.1", ports[mode], 1, 2, mode, "gloo", TIMEOUT_S)
                    update = functools.partial(receiver.update, version=0, begin=DiscardSession, max_bytes=1 << 62)
                elif mode == COLOCATED:
                    update = functools.partial(llm.update_weights_from_shared, pause="abort")
                else:
                    llm.init_weight_transfer("127.0.0.1", ports[mode], group_name=mode, timeout=TIMEOUT_S)
                    pause = SERVING_PAUSE if mode == SERVING else "abort"
                    update = functools.partial(llm.update_weights_from_distributed, pause=pause)
                for _, bucket, rep in schedule(mode, num_tensors, args.buckets, args.repeats):
                    if mode == SERVING:
                        with Stream(llm) as stream:
                            stream.wait_for_tokens(2)
                            row = _measure(q, ready, update, name, mode, bucket, rep)
                            stream.wait_for_tokens(stream.tokens() + 2)  # generating again after it
                        row.update(request_wait(stream.events, row.pop("start"), row.pop("end")))
                    else:
                        row = _measure(q, ready, update, name, mode, bucket, rep)
                        del row["start"], row["end"]
                    print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}),
                          flush=True)
                    rows.append(row)
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    return rows


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    rows = [row for name in args.configs for row in run_config(name, args)]
    return {"configs": args.configs, "modes": args.modes, "threads": args.threads, "repeats": args.repeats,
            "target_ratio": TARGET_RATIO,
            "rows": rows, "summary": _summary(rows), "machine": platform.platform(), "torch": torch.__version__,
            "note": "contended 2-core VM unless re-run on a quiet machine"}


def _measure(q, ready, update, config: str, mode: str, bucket: int, rep: int) -> dict:
    ready.put(True)
    meta, plan_s = _next(q, "meta")
    extra = {}
    if mode == COLOCATED:
        handle, extra["share_s"] = _next(q, "shared")
        start = time.perf_counter()
        got = update(meta, handle)
        end = time.perf_counter()
        ready.put(True)  # the trainer may reuse its shared segment now
        sync_s = extra["share_s"] + end - start
    else:
        start = time.perf_counter()
        got = update(meta)
        end = time.perf_counter()
        sync_s = _next(q, "sent")["seconds"]
    memcpy = _memcpy_s(got["bytes"])
    return {"config": config, "mode": mode, "bytes": got["bytes"], "tensors": got["tensors"], "bucket_bytes": bucket,
            "buckets": got["buckets"], "repeat": rep, "plan_s": plan_s, "sync_s": sync_s,
            "update_call_s": end - start, "receive_wait_s": got["receive_wait_s"], "apply_s": got["apply_s"],
            "commit_s": got["commit_s"], "memcpy_s": memcpy, "ratio": sync_s / memcpy, **extra,
            "start": start, "end": end}


def _summary(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["config"], r["mode"], r["bytes"], r["bucket_bytes"]) for r in rows}):
        group = [r for r in rows if (r["config"], r["mode"], r["bytes"], r["bucket_bytes"]) == key]
        ratios = [r["ratio"] for r in group]
        entry = {"config": key[0], "mode": key[1], "bytes": key[2], "bucket_bytes": key[3]}
        for field in ("sync_s", "update_call_s", "receive_wait_s", "apply_s", "commit_s", "memcpy_s"):
            entry[field] = statistics.median(r[field] for r in group)
        entry.update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        entry["meets_target"] = entry["ratio"] <= TARGET_RATIO
        if key[1] == SERVING:
            for field in ("request_wait_s", "token_gap_s", "tokens_during_update"):
                entry[field] = statistics.median(r[field] for r in group)
        if key[1] == COLOCATED:
            entry["share_s"] = statistics.median(r["share_s"] for r in group)
        out.append(entry)
    return _with_transport_floor(out)


def _with_transport_floor(summary: list[dict]) -> list[dict]:
    """Beside each refit and serving figure, the transport-only figure of the same update (same model, bytes
    and buckets): the floor weight sync itself sets, so that what the engine adds above it is visible.
    `transport_sync_s` / `transport_ratio`: that floor's seconds and its ratio to a memcpy;
    `over_transport_s`: the engine's share (validation, conversion, staging, commit, finalize, audit);
    `ratio_over_transport`: sync_s against the floor."""
    floors = {(s["config"], s["bytes"], s["bucket_bytes"]): s for s in summary if s["mode"] == TRANSPORT}
    for entry in summary:
        floor = floors.get((entry["config"], entry["bytes"], entry["bucket_bytes"]))
        if entry["mode"] in (TRANSPORT, COLOCATED) or floor is None:  # colocated: no transport to stand on
            continue
        entry.update(transport_sync_s=floor["sync_s"], transport_ratio=floor["ratio"],
                     over_transport_s=entry["sync_s"] - floor["sync_s"],
                     ratio_over_transport=entry["sync_s"] / floor["sync_s"])
    return summary


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, (ax_t, ax_r, ax_w) = plt.subplots(1, 3, figsize=(17, 5))
    buckets = sorted({s["bucket_bytes"] for s in summary if s["mode"] != SERVING})
    for mode, style in ((REFIT, "-"), (TRANSPORT, "--"), (COLOCATED, ":")):
        for bucket in buckets:
            pts = sorted((s for s in summary if s["bucket_bytes"] == bucket and s["mode"] == mode),
                         key=lambda s: s["bytes"])
            mb = [s["bytes"] / MIB for s in pts]
            label = f"{mode}, {bucket / MIB:g} MiB buckets"
            ax_t.loglog(mb, [s["sync_s"] for s in pts], style, marker="o", label=f"sync: {label}")
            ax_r.loglog(mb, [s["ratio"] for s in pts], style, marker="o", label=label)
    at_largest = sorted((s["bytes"], s["memcpy_s"]) for s in summary
                        if s["mode"] == REFIT and s["bucket_bytes"] == max(buckets))
    ax_t.loglog([b / MIB for b, _ in at_largest], [t for _, t in at_largest], "k--", label="memcpy, same bytes")
    ax_t.set_xlabel("update size (MiB)")
    ax_t.set_ylabel("seconds")
    ax_t.legend(fontsize=6, loc="upper left")
    ax_r.axhline(TARGET_RATIO, color="r", linestyle="--", label=f"target: {TARGET_RATIO:g}x memcpy")
    ax_r.set_xlabel("update size (MiB)")
    ax_r.set_ylabel("sync / memcpy (paired median)")
    ax_r.legend(fontsize=6, loc="upper right")
    serving = sorted((s for s in summary if s["mode"] == SERVING), key=lambda s: s["bytes"])
    mb = [s["bytes"] / MIB for s in serving]
    for field, style in (("update_call_s", "k-"), ("request_wait_s", "r-"), ("commit_s", "b--"),
                         ("token_gap_s", "g:")):
        ax_w.loglog(mb, [s[field] for s in serving], style, marker="o", label=field)
    ax_w.set_xlabel("update size (MiB), whole model")
    ax_w.set_ylabel("seconds (median)")
    ax_w.set_title(f"while serving (pause={SERVING_PAUSE!r})", fontsize=8)
    ax_w.legend(fontsize=6, loc="upper left")
    fig.suptitle(f"weight sync over loopback gloo and shared memory, {'/'.join(results['configs'])} models "
                 f"(fp32, dense experts); "
                 f"{results['note']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", choices=CONFIGS, nargs="+", default=list(CONFIGS))
    p.add_argument("--modes", choices=MODES, nargs="+", default=list(MODES))
    p.add_argument("--buckets-mib", type=float, nargs="+", default=[4, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, two small bucket sizes, one repetition")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.buckets = [int(b * MIB) for b in args.buckets_mib]
    args.modes = [m for m in MODES if m in args.modes]
    if args.quick:
        args.configs, args.buckets, args.repeats = ["tiny"], list(QUICK_BUCKETS), 1
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "bench_weight_sync" + ("_quick" if args.quick else "")
    if args.modes != list(MODES):  # a subset of the modes does not overwrite the full run's record
        name += "_" + "_".join(args.modes)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.no_plot:
        plot(results, args.out / f"{name}.png")
    return results


if __name__ == "__main__":
    main()
