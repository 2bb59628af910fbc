"""A trainer process for the weight-transfer tests: rank 0 of a transfer group, driven step by step.

`Trainer` starts it with multiprocessing's spawn context; it loads its tensors from a safetensors file,
picks a free loopback port and reports it through `out`, hosts the group there as `dsv4.rl.WeightSender`,
and for every step plans an update, hands the metadata to the test through `out`, then sends it
(optionally after changing a tensor, or dying mid-transfer). Every outcome, success or error (type and
message), goes back through `out`. It imports no test module, so it starts fast.

The port is chosen by the process that listens on it, just before it listens, and the engine joins only
once the port is known: a port picked by the test and bound by the trainer seconds later (its start-up
imports torch) could be taken in between by any connection on the machine, and an engine joining at
once would spend the trainer's start-up, unbounded on a loaded machine, out of the group's timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import load_file

import dsv4.rl.sender as sender_module
from dsv4.rl import WeightSender
from dsv4.rl.plan import pack_bucket

DIE_EXIT_CODE = 17
UNKNOWN_TENSOR = "layers.99.ffn.bogus.weight"
QUEUE_WAIT_S = 120.0  # the trainer process's messages (its start imports torch)
GROUP_TIMEOUT_S = 30.0  # any single wait inside the group; a dead peer is seen at once, a hang by this


def free_port() -> int:
    """A TCP port free on loopback now (the kernel picks it; a race with another process is harmless here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, deadline_s: float) -> None:
    """Wait until something accepts connections on loopback `port` (the trainer's store is up)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {deadline_s} s") from None
            time.sleep(0.1)


def run_trainer(world_size: int, tensors_path: str, steps: list[dict], out, timeout: float) -> None:
    """Each step: {"base_version": int | None, "bucket_bytes": int, "change_after_plan": bool (a tensor
    changes between plan and send), "unknown_tensor": bool or a name (the update also carries 4 values no
    tensor of the model has room for, named UNKNOWN_TENSOR or the name given, in place of that tensor),
    "omit_prefix": str (the tensors whose names start with it are left out of the update),
    "die_at_bucket": int | None (the process exits while packing that bucket), "skip_send": bool (the
    metadata goes out, the bytes never do)}."""
    torch.set_num_threads(1)
    try:
        tensors = load_file(tensors_path)
        port = free_port()
        out.put(("port", port))
        sender = WeightSender("127.0.0.1", port, world_size, timeout=timeout)
        out.put(("joined", None))
        for step in steps:
            unknown = step.get("unknown_tensor")
            name = unknown if isinstance(unknown, str) else UNKNOWN_TENSOR
            sent = {**tensors, name: torch.zeros(4)} if unknown else tensors
            if step.get("omit_prefix"):
                sent = {n: t for n, t in sent.items() if not n.startswith(step["omit_prefix"])}
            meta = sender.plan(sent, bucket_bytes=step["bucket_bytes"], base_version=step["base_version"])
            out.put(("meta", meta))
            if step.get("change_after_plan"):
                sent = dict(tensors)
                name = next(n for n, t in tensors.items() if t.dtype == torch.float32)
                sent[name] = tensors[name] + 1.0
            if step.get("die_at_bucket") is not None:
                _die_at(step["die_at_bucket"])
            if step.get("skip_send"):
                continue
            try:
                out.put(("sent", sender.send(sent, meta)))
            except Exception as exc:
                out.put(("error", (type(exc).__name__, str(exc))))
    except Exception as exc:
        out.put(("error", (type(exc).__name__, f"{exc}\n{traceback.format_exc()}")))


def _die_at(bucket_index: int) -> None:
    """Make the sender exit the process abruptly when it packs bucket `bucket_index` (a crashed trainer)."""
    count = iter(range(1 << 30))

    def dying_pack(bucket, tensors, out):
        if next(count) == bucket_index:
            os._exit(DIE_EXIT_CODE)
        return pack_bucket(bucket, tensors, out)

    sender_module.pack_bucket = dying_pack


class Trainer:
    """The trainer process (rank 0): started on enter (which returns once it reported its port), killed on
    exit whatever happened.

    Args:
        tensors: a safetensors file of the weights it sends.
        steps: what it does, step by step (`run_trainer`).
        world_size: the group's size as the trainer declares it.
        timeout: its group's timeout.
    """

    def __init__(self, tensors: Path, steps: list[dict], world_size: int = 2, timeout: float = GROUP_TIMEOUT_S):
        self.timeout = timeout
        self.port: int | None = None
        context = multiprocessing.get_context("spawn")
        self.out = context.Queue()
        self.process = context.Process(
            target=run_trainer, args=(world_size, str(tensors), steps, self.out, timeout), daemon=True,
        )

    def __enter__(self) -> Trainer:
        self.process.start()
        try:
            self.port = self.next("port")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)

    def next(self, kind: str):
        """The trainer's next message, which must be of `kind`; returns its payload."""
        try:
            got, payload = self.out.get(timeout=QUEUE_WAIT_S)
        except queue.Empty:
            raise AssertionError(f"the trainer sent nothing within {QUEUE_WAIT_S} s (waiting for {kind})") from None
        assert got == kind, (got, payload)
        return payload
