"""The programs the spawned ranks of tests/test_parallel.py run (SPMD, as under torchrun).

Kept apart from the test file so that a spawned rank imports only torch and dsv4, not the reference
model's transformers: a rank's start-up is then a few seconds on a shared core.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch

from dsv4 import LLM, SamplingParams
from dsv4.errors import Dsv4Error

WORLD = 2
MAX_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 90))]  # the second crosses CSA/HCA window boundaries
SAMPLING_SEED = 7
ENGINE = {"dtype": "float32", "max_num_seqs": 2, "max_model_len": 80}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def results(llm: LLM) -> dict:
    """Greedy ids and per-prompt logprobs (compared across ranks and with one process), and seeded sampled
    ids (compared across ranks: each samples on its own from the same gathered logits)."""
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=SAMPLING_SEED),
                           use_tqdm=False)
    return {"ids": [list(o.outputs[0].token_ids) for o in outputs], "logprobs": llm.forward_logprobs(PROMPTS),
            "sampled": [list(o.outputs[0].token_ids) for o in sampled]}


def _join_env(rank: int, port: int, world: int = WORLD) -> None:
    """What torchrun sets for a rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)


def _attempt(out_dir: str, action) -> None:
    """Run `action`, then write how long it took and the dsv4 error it raised (or "no error")."""
    start = time.monotonic()
    try:
        action()
        message = "no error"
    except Dsv4Error as exc:
        message = f"{type(exc).__name__}: {exc}"
    (Path(out_dir) / "rank0.txt").write_text(f"{time.monotonic() - start}\n{message}")


def scenario_rank(rank: int, port: int, out_dir: str, scenarios: dict, timeout_s: float, dying: str,
                  dying_timeout_s: float) -> None:
    """Every scenario's LLM in turn; then the `dying` checkpoint's LLM, after which rank 1 dies and rank 0
    tries to generate."""
    _join_env(rank, port)
    found = {}
    for key, (path, options) in scenarios.items():
        llm = LLM(path, **ENGINE, tensor_parallel_size=WORLD, distributed_timeout_s=timeout_s, **options)
        found[key] = results(llm)
        if key == "native_ep":
            found["merged_report"] = llm.merged_weight_report()
    torch.save(found, Path(out_dir) / f"rank{rank}.pt")
    llm = LLM(dying, **ENGINE, tensor_parallel_size=WORLD, distributed_timeout_s=dying_timeout_s)
    if rank == 1:
        os._exit(0)  # dies without a word, as a killed rank does
    _attempt(out_dir, lambda: llm.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False))
    os._exit(0)  # the group lost a member: nothing to tear down cleanly


def lonely_rank(rank: int, port: int, out_dir: str, path: str, timeout_s: float) -> None:
    """Rank 0 of a launch of WORLD ranks whose other ranks never start."""
    _join_env(rank, port)
    _attempt(out_dir, lambda: LLM(path, **ENGINE, tensor_parallel_size=WORLD, distributed_timeout_s=timeout_s))


def weight_sync_rank(rank: int, port: int, out_dir: str, path: str, options: dict, timeout_s: float,
                     inboxes: list, outbox) -> None:
    """An engine rank of weight syncs from trainer processes: load `path`, tell the test it is ready
    (`outbox`), then do what the test hands over (`inboxes[rank]`), in order: ("join", port): join that
    trainer's transfer group as rank 1 + `rank` of 1 + WORLD; ("update", (metadata, options)): run
    `update_weights_from_distributed(metadata, **options)` and
    record its outcome (new version, or the dsv4 error), the weight report's checksums and addresses, and
    what the engine generates then; ("end", None): write the records. Every wait is bounded by `timeout_s`."""
    _join_env(rank, port)
    llm = LLM(path, **ENGINE, tensor_parallel_size=WORLD, distributed_timeout_s=timeout_s, **options)

    def snapshot() -> dict:
        report = llm.weight_report()
        return {"version": llm.weights_version, "ready": report["ready"],
                "checksums": {n: t["checksum"] for n, t in report["tensors"].items()},
                "pointers": {n: t["data_ptr"] for n, t in report["tensors"].items()}}

    found = {"before": snapshot(), "updates": []}
    outbox.put(("ready", rank))
    while True:
        kind, payload = inboxes[rank].get(timeout=timeout_s)
        if kind == "end":
            break
        if kind == "join":
            llm.init_weight_transfer("127.0.0.1", payload, rank_offset=1 + rank, world_size=1 + WORLD,
                                     timeout=timeout_s)
            continue
        start = time.monotonic()
        try:
            metadata, update_options = payload
            outcome = llm.update_weights_from_distributed(metadata, **update_options)["version"]
        except Dsv4Error as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        found["updates"].append({"outcome": outcome, "seconds": time.monotonic() - start, **snapshot(),
                                 "results": results(llm)})
    torch.save(found, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)  # a transfer group may have lost its trainer: nothing to tear down cleanly


def in_process_update_rank(rank: int, port: int, out_dir: str, path: str, new: dict, bad_name: str,
                           timeout_s: float) -> None:
    """In-process updates on an expert parallel engine, every rank handed the same full tensors (SPMD):
    a malformed tensor of an expert only rank 0 holds (refused), the update without it, then the tensors of
    that one expert alone (only rank 0 completes anything). Records each outcome and the weights after it."""
    _join_env(rank, port)
    llm = LLM(path, **ENGINE, tensor_parallel_size=WORLD, expert_parallel=True, distributed_timeout_s=timeout_s)

    def outcome(tensors: dict) -> dict:
        try:
            error = None
            llm.update_weights(list(tensors.items()))
        except Dsv4Error as exc:
            error = f"{type(exc).__name__}: {exc}"
        report = llm.weight_report()
        return {"error": error, "version": llm.weights_version,
                "checksums": {n: t["checksum"] for n, t in report["tensors"].items()}}

    bad = dict(new)
    bad[bad_name] = bad[bad_name][:-1]
    expert = bad_name.rsplit(".", 2)[0] + "."
    found = {"before": outcome({}), "bad": outcome(bad), "good": outcome(new),
             "one_expert": outcome({n: t for n, t in new.items() if n.startswith(expert)})}
    torch.save(found, Path(out_dir) / f"rank{rank}.pt")


def exit_rank(rank: int, port: int, path: str, stagger_s: float) -> None:
    """Build a two-rank engine, run one step, and leave: rank 0 at once, rank 1 `stagger_s` later (the
    process ends with the interpreter's own exit, as a torchrun program does)."""
    _join_env(rank, port)
    llm = LLM(path, **ENGINE, tensor_parallel_size=WORLD, distributed_timeout_s=30.0)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    if rank == 1:
        time.sleep(stagger_s)

