"""One process against two (tensor parallel, with and without expert parallelism) on this machine.

For each size (the embedded tiny config, and tests/reference.py's ~77M small config; seeded dummy weights,
fp32, dense experts so that both split modes apply) every launch spawns its ranks with torch.multiprocessing
(gloo on a free loopback port, `--threads` intra-op threads per rank), and rank 0 times, inside the ranks:

  load      `LLM(...)`: group join, build, dummy load, finalize, engine set-up
  prefill   `forward_logprobs` of one prompt of PROMPT_LEN tokens (chunked prefill)
  decode    `generate` of BATCH prompts x NEW_TOKENS greedy tokens (ignore_eos): tokens per second

and the resident weight bytes of rank 0 (the memory each rank needs: what tensor parallelism is for).
Launches alternate 1 process, 2 processes (TP), 2 processes (TP + EP), `--repeats` times; each figure is the
median over back-to-back pairs of the ratio one process / two processes (seconds; > 1: two processes are
faster), with the pairs' spread, so a neighbour slowing the machine slows both halves of a pair. On a machine
whose cores are shared (this one: 2 cores, 4 engineers) two ranks compete for them, and each collective is a
loopback gloo round trip: the figures say what splitting costs here, not what it buys on separate devices.

Writes <out>/bench_parallel[_quick].json and .png. Needs the `bench` extra (matplotlib).
Usage: PYTHONPATH=src python benchmarks/bench_parallel.py [--sizes tiny small] [--repeats 3] [--threads 1]
                                                          [--out benchmarks/results] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the spawned ranks import this file by name from here

from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.embedded import EMBEDDED_MODELS  # noqa: E402
from report import write_report  # noqa: E402

BASE_CONFIG = EMBEDDED_MODELS["dsv4-tiny-dummy"][0] / "config.json"
# The small size: the dims of tests/reference.py's small config (the ~77M model).
SIZES = {
    "tiny": {},
    "small": {"vocab_size": 16384, "hidden_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 8,
              "num_attention_heads": 8, "head_dim": 64, "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 128,
              "n_routed_experts": 16, "sliding_window": 128, "index_n_heads": 8, "index_topk": 16,
              "layer_types": ["sliding_attention"] * 2 + ["compressed_sparse_attention",
                                                           "heavily_compressed_attention"] * 3,
              "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 5,
              "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}},
}
QUICK_SIZES = ("tiny",)
# Launches: (name, processes, expert_parallel).
LAUNCHES = (("one", 1, False), ("tp2", 2, False), ("tp2_ep", 2, True))
QUICK_LAUNCHES = LAUNCHES[::2]  # one process and TP + EP: every code path of a launch, fewer start-ups
PROMPT_LEN = 64
BATCH = 4
NEW_TOKENS = 16
QUICK_NEW_TOKENS = 4
TIMEOUT_S = 120.0
ENGINE = {"dtype": "float32", "expert_dtype": "dense", "max_num_seqs": BATCH, "max_model_len": 128,
          "load_format": "dummy"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, config_dir: str, expert_parallel: bool, threads: int, new_tokens: int,
          out_file: str) -> None:
    """One rank of a launch: build, prefill, decode; rank 0 writes the timings."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    start = time.perf_counter()
    llm = LLM(config_dir, **ENGINE, tensor_parallel_size=world, expert_parallel=expert_parallel,
              distributed_timeout_s=TIMEOUT_S)
    load_s = time.perf_counter() - start
    vocab = llm.config.vocab_size
    prompt = [(7 * i + 3) % (vocab - 2) + 2 for i in range(PROMPT_LEN)]
    llm.forward_logprobs([prompt[:8]])  # warm-up: first-call allocations and kernel choices
    start = time.perf_counter()
    llm.forward_logprobs([prompt])
    prefill_s = time.perf_counter() - start
    prompts = [prompt[i : i + 8] for i in range(BATCH)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    decode_s = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    resident = sum(p.numel() * p.element_size() for m in llm.loaded.models.values() for p in m.parameters())
    if rank == 0:
        Path(out_file).write_text(json.dumps({
            "load_s": load_s, "prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens": tokens,
            "decode_tok_s": tokens / decode_s, "resident_bytes_rank0": resident}))


def _launch(processes: int, expert_parallel: bool, config_dir: Path, threads: int, new_tokens: int,
            work: Path) -> dict:
    out_file = work / f"launch_{processes}_{expert_parallel}.json"
    mp.spawn(_rank, args=(processes, _free_port(), str(config_dir), expert_parallel, threads, new_tokens,
                          str(out_file)), nprocs=processes, join=True)
    return json.loads(out_file.read_text())


def _config_dir(size: str, work: Path) -> Path:
    raw = json.loads(BASE_CONFIG.read_text())
    raw.update(SIZES[size])
    path = work / size
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _ratio(pairs: list[tuple[float, float]]) -> dict:
    ratios = [one / two for one, two in pairs]
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "one_s": statistics.median(one for one, _ in pairs), "two_s": statistics.median(two for _, two in pairs)}


def bench_size(size: str, repeats: int, threads: int, new_tokens: int, work: Path,
               launches: tuple = LAUNCHES) -> dict:
    config_dir = _config_dir(size, work)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in launches}
    for _ in range(repeats):
        for name, processes, expert_parallel in launches:
            runs[name].append(_launch(processes, expert_parallel, config_dir, threads, new_tokens, work))
    row: dict = {"launches": runs}
    for name, _, _ in launches[1:]:
        pairs = list(zip(runs["one"], runs[name], strict=True))
        row[name] = {
            metric: _ratio([(one[metric], two[metric]) for one, two in pairs])
            for metric in ("load_s", "prefill_s", "decode_s")
        }
        row[name]["resident_bytes_ratio"] = (runs["one"][0]["resident_bytes_rank0"]
                                             / runs[name][0]["resident_bytes_rank0"])
        # Dummy values are seeded per rank's shard, so ids differ from one process's: only the ranks agree.
        row[name]["decode_tokens"] = runs[name][0]["decode_tokens"]
    return row


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("load_s", "prefill_s", "decode_s", "resident_bytes_ratio")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bars = [(size, name) for size, row in results["sizes"].items() for name, _, _ in LAUNCHES[1:] if name in row]
    width = 0.8 / len(bars)
    for i, (size, name) in enumerate(bars):
        row = results["sizes"][size][name]
        values = [row[m] if m == "resident_bytes_ratio" else row[m]["ratio"] for m in metrics]
        ax.bar([j + i * width for j in range(len(metrics))], values, width, label=f"{size} {name}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(metrics))])
    ax.set_xticklabels(["load", "prefill", "decode", "weights per rank"])
    ax.set_ylabel("one process / two processes (>1: two better)")
    ax.set_title(f"dsv4 tensor parallel on {results['machine']['cpus']} CPUs, gloo loopback "
                 f"({results['threads']} thread(s) per rank)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true",
                        help="tiny only, one pair of one process and TP + EP, few tokens (a smoke test)")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else tuple(args.sizes)
    repeats = 1 if args.quick else args.repeats
    new_tokens = QUICK_NEW_TOKENS if args.quick else NEW_TOKENS
    with tempfile.TemporaryDirectory() as tmp:
        launches = QUICK_LAUNCHES if args.quick else LAUNCHES
        rows = {size: bench_size(size, repeats, args.threads, new_tokens, Path(tmp), launches) for size in sizes}
    results = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "threads": args.threads, "repeats": repeats, "prompt_len": PROMPT_LEN, "batch": BATCH,
        "new_tokens": new_tokens, "sizes": rows,
    }
    write_report(args.out / ("bench_parallel_quick" if args.quick else "bench_parallel"), results, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
