"""The weight lifecycle against what its bytes cost: load, peak RSS and refit, baselines measured in the same run.

For each size (a DeepSeek-V4-shaped config; dummy weights written once to checkpoints in the release's native
layout, FP8 dense linears + FP4 experts, and in transformers' HF layout, bf16 with stacked experts):

  load        `load_models` (build, read, validate, convert, write, finalize) against reading the same files
              (read(2) in 64 MiB chunks into one reused buffer), page cache warm and cold (each file dropped from
              the page cache with posix_fadvise(DONTNEED) before every cold run); the warm load is also paired
              with reading the files into freshly allocated memory (`load_native_warm_vs_fresh_read`: what
              placing the bytes in new weights costs, a fault per page; reported, no target). The HF bf16 load
              quantizes every expert to FP4, so its baseline is the read plus the quantizer alone on those
              experts. The model build alone (part of every load, none of the file's bytes) is reported beside it.
  floor       the read into fresh memory of the kind weights live in (`WeightArena`, huge pages) against the
              reused-buffer read, warm and cold (`fresh_memory_floor`): what any load into new weights pays on
              this machine before doing anything else; a load target under it cannot be met here.
  peak RSS    a native load in a fresh interpreter: VmHWM growth against resident + the largest tensor.
  start-up    `LLM(...)` with its default limits (max_num_seqs, max_model_len sized from the model and the
              memory) against `load_models` of the same checkpoint: the engine set-up on top of the load.
  RSS phases  a fresh interpreter: RSS before, after `LLM(...)` and after one short request (16 prompt +
              16 new tokens), against the resident weights and the cache the limits reserve (address
              space, taken only as sequences write it).
  refit       a weight update of every tensor (fail-stop and atomic sessions) of a loaded native model:
                native   the resident-format tensors another engine hands over (`iter_weights`), vs a memcpy
                         of the same bytes
                trainer  the same values row-major and contiguous, as a trainer holds them, vs the same memcpy
                bf16     the HF bf16 tensors, experts quantized to FP4 on the fly, vs the quantizer alone on the
                         same experts
              Atomic refits stage into the buffers the untimed warm-up allocated (`LoadedModels.staging`
              keeps them from one update to the next): the steady state of an RL loop that updates every step.

Every figure is a ratio dsv4 / baseline: the median of back-to-back (baseline, dsv4) pairs, so that a neighbour
slowing the machine slows both halves of a pair (`ratio_min` / `ratio_max`: the pairs' spread). Targets (issue
19): load <= 2x the read warm and <= 1.5x cold; peak RSS growth <= (resident + largest tensor) x 1.1, and the
same bound for the RSS growth of `LLM(...)` start-up (its cache takes no memory until written); start-up <= 1.5x
`load_models`; refit <= 3x its baseline (atomic: the same plus its one extra copy, 4x). The tiny model is dominated
by per-tensor overhead (~300 tensors of a few KiB against a cache-resident memcpy) and is reported, not held to the
targets.

Writes <out>/bench_lifecycle[_quick].json and .png (`--figures` a subset: bench_lifecycle[_quick]_<groups>.*).
Usage: PYTHONPATH=src python benchmarks/bench_lifecycle.py [--sizes tiny small medium large] [--repeats 3]
                                                           [--workdir DIR] [--threads 1] [--quick]
                                                           [--figures load hf rss startup refit]
Needs the `bench` extra (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4 import LLM
from dsv4.embedded import EMBEDDED_MODELS
from dsv4.lazy_memory import WeightArena
from dsv4.quant import quantize_fp4
from dsv4.weights.checkpoint import CheckpointDir
from dsv4.weights.export import iter_weights, save_checkpoint
from dsv4.weights.loader import LoadedModels, build_models, load_models
from dsv4.weights.names import canonical_name, split_stacked, stacked_experts
from dsv4.weights.refit import WeightUpdateSession

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import write_report  # noqa: E402

BASE_CONFIG = EMBEDDED_MODELS["dsv4-tiny-dummy"][0] / "config.json"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
MIB = 2**20
READ_CHUNK_BYTES = 64 * MIB  # read(2) size of the file-read baseline
MEMCPY_CHUNK_BYTES = 256 * MIB  # the memcpy baseline copies at most this much at once (far beyond any cache)
DUMMY_SEED = 0
DTYPE = torch.float32  # resident dense dtype (the measurements); experts stay FP4

# Targets of issue 19, per figure.
TARGETS = {
    "load_native_warm": 2.0, "load_native_cold": 1.5, "load_hf_warm": 2.0, "load_hf_cold": 1.5,
    "refit_native_fail_stop": 3.0, "refit_native_atomic": 4.0, "refit_trainer_fail_stop": 3.0,
    "refit_trainer_atomic": 4.0, "refit_bf16_fail_stop": 3.0, "refit_bf16_atomic": 3.0,
    "peak_rss": 1.1, "startup": 1.5, "startup_rss": 1.1,
}
# The sizes above tiny take the long context of tests/reference.py's small config, so that the default limits
# reserve a large cache (64 slots x 65536 positions for `small`): what start-up must not pay for up front.
LONG_CONTEXT = {"max_position_embeddings": 65536,
                "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 32, "beta_slow": 1}}
SHORT_REQUEST_TOKENS = 16  # prompt tokens, and new tokens, of the one request of the RSS phases


@dataclass(frozen=True)
class Size:
    """Overrides of the embedded tiny config; `hf`: also write, load and refit the HF bf16 layout."""

    overrides: dict
    hf: bool = True


def _layers(n: int, hashed: int) -> dict:
    attention = [SLIDING] + [CSA if i % 2 else HCA for i in range(1, n)]
    mlp = [HASH_MOE] * hashed + [MOE] * (n - hashed)
    return {"num_hidden_layers": n, "layer_types": attention, "mlp_layer_types": mlp}


# Dims of `small` are tests/reference.py's small config (the ~77M model of the table); `medium` has ~1 GB of
# HF bf16 weights, `large` ~1.6 GB native (its HF bf16 form would be ~5 GB, so only the native layout runs).
_WIDE = {**LONG_CONTEXT, "vocab_size": 32768, "hidden_size": 1024, "moe_intermediate_size": 512,
         "num_attention_heads": 8, "head_dim": 64, "q_lora_rank": 512, "o_groups": 4, "o_lora_rank": 256,
         "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16, "sliding_window": 128,
         "compress_rates": {CSA: 4, HCA: 128}}
SIZES = {
    "tiny": Size({}),
    "small": Size({**LONG_CONTEXT, "vocab_size": 16384, "hidden_size": 512, "moe_intermediate_size": 256,
                   "num_attention_heads": 8, "head_dim": 64, "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 128,
                   "n_routed_experts": 16, "index_n_heads": 8, "index_topk": 16, "sliding_window": 128,
                   "compress_rates": {CSA: 4, HCA: 128}, **_layers(8, 3)}),
    "medium": Size({**_WIDE, "n_routed_experts": 32, **_layers(8, 3)}),
    "large": Size({**_WIDE, "n_routed_experts": 96, **_layers(16, 3)}, hf=False),
}
QUICK_SIZES = ("tiny",)


# ---- timing ----
def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process: every thread, user and system) of one call."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def paired(baseline: Callable[[], object], dsv4: Callable[[], object], repeats: int, target: float | None,
           prepare: Callable[[], object] = lambda: None) -> dict:
    """Alternate baseline and dsv4 `repeats` times after one untimed warm-up each; `prepare` runs untimed
    before every timed call (e.g. dropping the page cache). `target`: None for a figure only reported. The
    CPU seconds of each side (`*_cpu_s`: all threads) are reported beside the wall seconds the ratio is of:
    on a shared machine they show how much of a wall-time change is the machine's."""
    prepare()
    baseline()
    prepare()
    dsv4()
    pairs = []
    for _ in range(repeats):
        prepare()
        base = _timed(baseline)
        prepare()
        mine = _timed(dsv4)
        pairs.append((base, mine))
    ratios = [mine[0] / base[0] for base, mine in pairs]
    ratio = statistics.median(ratios)
    return {"baseline_s": statistics.median(b[0] for b, _ in pairs),
            "dsv4_s": statistics.median(m[0] for _, m in pairs),
            "baseline_cpu_s": statistics.median(b[1] for b, _ in pairs),
            "dsv4_cpu_s": statistics.median(m[1] for _, m in pairs),
            "ratio": ratio, "ratio_min": min(ratios), "ratio_max": max(ratios), "target": target,
            "meets_target": None if target is None else ratio <= target}


# ---- checkpoints ----
def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in _files(path))


def make_checkpoints(name: str, size: Size, workdir: Path, hf: bool = True) -> dict[str, Path]:
    """Native and (if the size has it and `hf`) HF bf16 checkpoints of seeded dummy weights; reused when present."""
    root = workdir / name
    config_dir = root / "config"
    out = {"native": root / "native"}
    hf = hf and size.hf
    if hf:
        out["hf"] = root / "hf_bf16"
    if all((p / "config.json").exists() for p in out.values()):
        return out
    config_dir.mkdir(parents=True, exist_ok=True)
    raw = json.loads(BASE_CONFIG.read_text())
    raw.update(size.overrides)
    (config_dir / "config.json").write_text(json.dumps(raw))
    source = load_models(config_dir, load_format="dummy", dtype=DTYPE, seed=DUMMY_SEED)
    if not (out["native"] / "config.json").exists():
        save_checkpoint(source, out["native"], layout="native", dense="fp8", experts="fp4")
    del source
    if hf and not (out["hf"] / "config.json").exists():
        bf16 = load_models(out["native"], dtype=torch.bfloat16)
        save_checkpoint(bf16, out["hf"], layout="hf")
    return out


def read_files(path: Path, buffer: memoryview) -> int:
    """The file-read baseline: every safetensors file of a checkpoint through read(2), chunk by chunk."""
    total = 0
    for file in _files(path):
        with file.open("rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def read_into_fresh_memory(path: Path) -> int:
    """Reading the files into newly allocated memory, as any load must place them: the read plus the first
    touch of every page (page faults cost ~2 us each on the development VM, and fresh memory ~0.5-2 s per GiB
    under load there), the floor a loader into new weights can reach."""
    total = 0
    for file in _files(path):
        target = torch.empty(file.stat().st_size, dtype=torch.uint8)
        with file.open("rb", buffering=0) as f:
            total += f.readinto(memoryview(target.numpy()))
    return total


def read_into_weight_arena(path: Path) -> int:
    """Reading the files into fresh memory of the kind the loader's weights live in (`WeightArena`: anonymous
    mappings marked for transparent huge pages, one fault per 2 MiB): the cheapest placement of the bytes in
    new memory, so the floor of a load into new weights on this machine (`fresh_memory_floor`)."""
    total = 0
    for file in _files(path):
        target = WeightArena().zeros((file.stat().st_size,), torch.uint8)
        with file.open("rb", buffering=0) as f:
            total += f.readinto(memoryview(target.numpy()))
    return total


def drop_page_cache(path: Path) -> None:
    """Evict a checkpoint's files from the page cache (unprivileged: works on files nothing else maps)."""
    for file in _files(path):
        with file.open("rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# ---- baselines ----
def memcpy_of(nbytes: int) -> Callable[[], None]:
    """A copy of `nbytes` between two flat buffers (in chunks of at most MEMCPY_CHUNK_BYTES)."""
    chunk = max(1, min(nbytes, MEMCPY_CHUNK_BYTES))
    src = torch.ones(chunk, dtype=torch.uint8)
    dst = torch.zeros(chunk, dtype=torch.uint8)
    full, rest = divmod(nbytes, chunk)

    def copy() -> None:
        for _ in range(full):
            dst.copy_(src)
        if rest:
            dst[:rest].copy_(src[:rest])

    return copy


def hf_experts(tensors: list[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """Every expert matrix of the HF stacked tensors, as the writer splits them."""
    for name, tensor in tensors:
        stacked = stacked_experts(canonical_name(name))
        if stacked is not None:
            for part in split_stacked(name, tensor, stacked[1]):
                yield from part.unbind(0)


def quantizer_alone(experts: list[torch.Tensor], group: int) -> Callable[[], None]:
    def run() -> None:
        for values in experts:
            quantize_fp4(values, group)

    return run


# ---- dsv4 ----
def refit(loaded: LoadedModels, tensors: list[tuple[str, torch.Tensor]], atomic: bool) -> None:
    session = WeightUpdateSession(loaded, 0, lambda: 1, atomic=atomic)
    session.load(tensors)
    session.finish()


def refit_pairs(kind: str, loaded: LoadedModels, tensors: list[tuple[str, torch.Tensor]],
                baseline: Callable[[], None], repeats: int) -> dict:
    """Fail-stop and atomic refits of every tensor, each paired with the baseline."""
    out = {}
    for atomic in (False, True):
        key = f"refit_{kind}_{'atomic' if atomic else 'fail_stop'}"
        out[key] = paired(baseline, lambda a=atomic: refit(loaded, tensors, a), repeats, TARGETS[key])
    return out


def _tensor_bytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


RSS_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    import tqdm.auto
    from dsv4.weights.loader import load_models

    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out

    torch.set_num_threads(1)
    before = status()
    loaded = load_models(sys.argv[1], dtype=torch.float32)
    after = status()
    params = [p for m in loaded.models.values() for p in m.parameters()]
    print(json.dumps({"growth": after["VmHWM"] - before["VmRSS"],
                      "resident": sum(p.numel() * p.element_size() for p in params),
                      "largest": max(p.numel() * p.element_size() for p in params)}))
    """
)


STARTUP_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    import tqdm.auto
    from dsv4 import LLM, SamplingParams
    from dsv4.engine.limits import cache_bytes_per_sequence

    def status():
        out = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
        return out

    torch.set_num_threads(1)
    tokens = int(sys.argv[2])
    before = status()
    llm = LLM(sys.argv[1], dtype="float32")
    started = status()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([list(range(2, 2 + tokens))], params, use_tqdm=False)
    served = status()
    params = [p for m in llm.loaded.models.values() for p in m.parameters()]
    limits = llm.limits
    per_sequence = cache_bytes_per_sequence(llm.config, limits.max_model_len, llm.dtype)
    per_slot_fixed = cache_bytes_per_sequence(llm.config, 0, llm.dtype)
    print(json.dumps({"before": before, "started": started, "served": served,
                      "resident": sum(p.numel() * p.element_size() for p in params),
                      "largest": max(p.numel() * p.element_size() for p in params),
                      "max_num_seqs": limits.max_num_seqs, "max_model_len": limits.max_model_len,
                      "cache_bytes_per_sequence": per_sequence, "cache_bytes_per_slot_fixed": per_slot_fixed,
                      "cache_bytes_per_token": (per_sequence - per_slot_fixed) / limits.max_model_len,
                      "cache_reserved_bytes": per_sequence * limits.max_num_seqs}))
    """
)


def _probe(script: str, *argv: str) -> dict:
    """Run a probe in a fresh interpreter (nothing else of this process in its memory) and return its JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, check=True,
                            env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def peak_rss(path: Path) -> dict:
    stats = _probe(RSS_PROBE, str(path))
    ratio = stats["growth"] / (stats["resident"] + stats["largest"])
    return {**stats, "ratio": ratio, "target": TARGETS["peak_rss"], "meets_target": ratio <= TARGETS["peak_rss"]}


def startup_rss(path: Path) -> dict:
    """RSS phases of `LLM(...)` and one short request; the ratio is start-up's peak RSS growth against the load's
    bound (resident + largest tensor): the reserved cache must not count."""
    stats = _probe(STARTUP_PROBE, str(path), str(SHORT_REQUEST_TOKENS))
    before, started, served = stats["before"]["VmRSS"], stats["started"], stats["served"]
    stats["startup_growth"] = started["VmHWM"] - before
    # Anonymous pages only (the data: weights, cache, activations): VmRSS also counts library code that the
    # first request pages in.
    stats["startup_anon_growth"] = started["RssAnon"] - stats["before"]["RssAnon"]
    stats["request_anon_growth"] = served["RssAnon"] - started["RssAnon"]
    ratio = stats["startup_growth"] / (stats["resident"] + stats["largest"])
    return {**stats, "ratio": ratio, "target": TARGETS["startup_rss"], "meets_target": ratio <= TARGETS["startup_rss"]}


def fresh_memory_floor(path: Path, buffer: memoryview, repeats: int) -> dict:
    """What placing a checkpoint's bytes in new memory costs on this machine, against the load baselines: the
    read into fresh weight-arena memory (huge pages, as the loader's) paired with the read into a reused
    buffer, warm and cold. A load into new weights cannot beat that read, so where `ratio` exceeds a load
    target the target is below this machine's floor (its page faults alone cost more than the allowance)."""
    def named(pair: dict) -> dict:
        keys = {"baseline_s": "reused_read_s", "dsv4_s": "fresh_arena_read_s",
                "baseline_cpu_s": "reused_read_cpu_s", "dsv4_cpu_s": "fresh_arena_read_cpu_s"}
        return {keys.get(k, k): v for k, v in pair.items() if k not in ("target", "meets_target")}

    warm = named(paired(lambda: read_files(path, buffer), lambda: read_into_weight_arena(path), repeats, None))
    cold = named(paired(lambda: read_files(path, buffer), lambda: read_into_weight_arena(path), repeats, None,
                        prepare=lambda: drop_page_cache(path)))
    return {"what": "read(2) of the files into fresh WeightArena memory / into one reused buffer (paired)",
            "warm": warm, "cold": cold,
            "warm_target": TARGETS["load_native_warm"], "cold_target": TARGETS["load_native_cold"],
            "warm_target_below_floor": warm["ratio"] > TARGETS["load_native_warm"],
            "cold_target_below_floor": cold["ratio"] > TARGETS["load_native_cold"]}


# ---- one size ----
# Groups of figures `--figures` selects (all by default).
FIGURES = ("load", "hf", "rss", "startup", "refit")


def measure(name: str, size: Size, workdir: Path, repeats: int, figures: tuple[str, ...] = FIGURES) -> dict:
    paths = make_checkpoints(name, size, workdir, hf="hf" in figures or "refit" in figures)
    buffer = memoryview(bytearray(READ_CHUNK_BYTES))
    out: dict = {"checkpoint_bytes": {layout: _checkpoint_bytes(p) for layout, p in paths.items()}}
    native = paths["native"]

    def cold(path: Path) -> Callable[[], None]:
        return lambda: drop_page_cache(path)

    def load_native() -> LoadedModels:
        return load_models(native, dtype=DTYPE)

    loaded = load_native()
    cfg, fmt = loaded.config, loaded.expert_format
    # The model build (module construction, parameter allocation) is part of every load and of none of the
    # file's bytes: reported apart, and each load ratio also without it.
    out["build_s"] = statistics.median(_timed(lambda: build_models(cfg, fmt, DTYPE, "cpu", None))[0]
                                       for _ in range(max(1, repeats)))
    if "load" in figures:
        out["load_native_warm"] = paired(lambda: read_files(native, buffer), load_native, repeats,
                                         TARGETS["load_native_warm"])
        out["load_native_cold"] = paired(lambda: read_files(native, buffer), load_native, repeats,
                                         TARGETS["load_native_cold"], prepare=cold(native))
        # Against reading into fresh memory (what placing the bytes in new weights costs), paired the same way.
        fresh = paired(lambda: read_into_fresh_memory(native), load_native, repeats, None)
        out["load_native_warm_vs_fresh_read"] = fresh
        out["read_into_fresh_memory_s"] = fresh["baseline_s"]
        out["load_native_warm"]["ratio_vs_read_into_fresh_memory"] = fresh["ratio"]
        out["fresh_memory_floor"] = fresh_memory_floor(native, buffer, repeats)
    if "rss" in figures:
        out["peak_rss"] = peak_rss(native)
    if "startup" in figures:
        out["startup"] = paired(load_native, lambda: LLM(native, dtype="float32"), repeats, TARGETS["startup"])
        out["startup_rss"] = startup_rss(native)

    if "refit" in figures:
        resident = [(n, t.clone()) for n, t in iter_weights(loaded)]
        nbytes = _tensor_bytes(resident)
        out["refit_bytes"] = nbytes
        out["refit_tensors"] = len(resident)
        memcpy = memcpy_of(nbytes)
        out.update(refit_pairs("native", loaded, resident, memcpy, repeats))
        resident.clear()  # one set of incoming tensors at a time
        trainer = [(n, t.contiguous()) for n, t in iter_weights(loaded)]
        out.update(refit_pairs("trainer", loaded, trainer, memcpy, repeats))
        trainer.clear()

    if "hf" in paths:
        hf = paths["hf"]
        bf16 = [(n, t.clone()) for n, t, _ in CheckpointDir(hf).iter_tensors()]
        experts = list(hf_experts(bf16))
        kernel = quantizer_alone(experts, loaded.layout.fp4_group)

        def load_hf() -> LoadedModels:
            return load_models(hf, dtype=DTYPE, expert_dtype="fp4")

        if "hf" in figures:
            out["load_hf_warm"] = paired(lambda: (read_files(hf, buffer), kernel()), load_hf, repeats,
                                         TARGETS["load_hf_warm"])
            out["load_hf_cold"] = paired(lambda: (read_files(hf, buffer), kernel()), load_hf, repeats,
                                         TARGETS["load_hf_cold"], prepare=cold(hf))
        if "refit" in figures:
            out.update(refit_pairs("bf16", loaded, bf16, kernel, repeats))
    for key in ("load_native_warm", "load_native_cold", "load_hf_warm", "load_hf_cold"):
        if key in out:
            figure = out[key]
            figure["ratio_excluding_build"] = (figure["dsv4_s"] - out["build_s"]) / figure["baseline_s"]
    out["resident_bytes"] = sum(p.numel() * p.element_size() for m in loaded.models.values() for p in m.parameters())
    return out


# ---- output ----
def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in TARGETS if any(m in r for r in results["sizes"].values())]
    sizes = list(results["sizes"])
    fig, ax = plt.subplots(figsize=(min(18, max(8, 1.1 * len(metrics) * len(sizes) / 2)), 5))
    width = 0.8 / max(1, len(sizes))
    for i, size in enumerate(sizes):
        row = results["sizes"][size]
        values = [row[m]["ratio"] if m in row else float("nan") for m in metrics]
        xs = [j + (i - (len(sizes) - 1) / 2) * width for j in range(len(metrics))]
        ax.bar(xs, values, width, label=f"{size} ({row['checkpoint_bytes']['native'] / MIB:.0f} MiB native)")
        without_build = [row[m].get("ratio_excluding_build", float("nan")) if m in row else float("nan")
                         for m in metrics]
        ax.plot(xs, without_build, "k_", markersize=10, label="load without the model build" if i == 0 else None)
    for j, m in enumerate(metrics):
        ax.hlines(TARGETS[m], j - 0.45, j + 0.45, colors="red", linewidth=1.5)
    ax.set_yscale("log")
    ax.set_xticks(range(len(metrics)), [m.replace("_", "\n", 1) for m in metrics], fontsize=7)
    ax.set_ylabel("dsv4 / baseline (median pair; red: target)")
    ax.set_title(f"weight lifecycle vs its bytes, {results['threads']} thread(s), {results['machine']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "threads": args.threads,
               "repeats": args.repeats, "figures": list(args.figures), "torch": torch.__version__,
               "load_average": os.getloadavg(), "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="bench_lifecycle_") as tmp:
        workdir = args.workdir or Path(tmp)
        for name in args.sizes:
            print(f"[bench_lifecycle] {name} ...", flush=True)
            results["sizes"][name] = measure(name, SIZES[name], workdir, args.repeats, tuple(args.figures))
            row = results["sizes"][name]
            print("  " + ", ".join(f"{m} x{row[m]['ratio']:.2f}" for m in TARGETS if m in row), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="back-to-back (baseline, dsv4) pairs per figure")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (baselines and dsv4 alike)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the generated checkpoints here and reuse them (default: a temporary directory)")
    parser.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES),
                        help="which groups of figures to measure (a subset is written as bench_lifecycle[_quick]_"
                             "<groups>.json, beside the full run's)")
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, one pair per figure (smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = list(QUICK_SIZES), 1
    results = run(args)
    stem = "bench_lifecycle_quick" if args.quick else "bench_lifecycle"
    if list(args.figures) != list(FIGURES):
        stem += "_" + "_".join(f for f in FIGURES if f in args.figures)
    write_report(args.out / stem, results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
