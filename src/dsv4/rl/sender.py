"""`WeightSender`: the trainer end of weight sync over torch.distributed (gloo on CPU, NCCL on GPU).

    sender = WeightSender("127.0.0.1", 29500, world_size=2)     # trainer = rank 0; the engine joins
                                                                 # with llm.init_weight_transfer(...)
    meta = sender.plan(model.state_dict(), base_version=v)      # JSON metadata, checksums included
    # hand `meta` to the engine (directly, or through the server's admin route), which runs
    # llm.update_weights_from_distributed(meta) while the trainer runs:
    result = sender.send(model.state_dict(), meta)              # {"versions": {1: v + 1}, ...}

The update protocol, on top of the transfer group (`dsv4.rl.group`):

  1. ready: every member publishes whether it accepts the plan (the engine checks its base version, the
     metadata and that no other update is open; the trainer checks its tensors against the plan) with the
     plan's digest; all read all. Any refusal or digest mismatch ends the update on every member before
     a byte moves, with the refusing member's reason in every error.
  2. buckets: the trainer packs bucket i+1 into one of two buffers while bucket i is on the wire, and the
     engine verifies and stages bucket i while receiving bucket i+1.
  3. staged: every engine rank publishes whether it staged every bucket (and, in a full update, has every
     tensor); none commits unless all did.
  4. done: every engine rank publishes its outcome (new weights version, or the error: a checksum
     mismatch, a rejected tensor); `send` returns the versions or raises with the engine's reason.
"""

from __future__ import annotations

import time

import torch

from dsv4.errors import WeightUpdateError
from dsv4.rl.group import DEFAULT_TIMEOUT_S, TRAINER_RANK, TransferGroup
from dsv4.rl.plan import (
    GLOO_BUCKET_BYTES,
    NCCL_BUCKET_BYTES,
    NamedTensors,
    WeightSyncPlan,
    check_tensors_match,
    pack_bucket,
    plan_buckets,
)


class WeightSender:
    """The trainer (rank 0) of a transfer group. Construction hosts the group's store at
    master_address:master_port and blocks until every engine rank has joined (within `timeout`).

    Args:
        master_address: address this trainer listens on and the engines connect to.
        master_port: port of the group's store.
        world_size: 1 (this trainer) + the number of engine ranks.
        group_name: the group's name (engines pass the same one).
        backend: "gloo" (CPU) or "nccl" (GPU).
        timeout: seconds any single wait may take.

    Raises:
        ConfigError: a bad argument.
        WeightTransferError: an engine rank that never joins, or one that disagrees on the group.
    """

    def __init__(
        self, master_address: str, master_port: int, world_size: int, group_name: str = "dsv4",
        backend: str = "gloo", timeout: float = DEFAULT_TIMEOUT_S,
    ):
        self.group = TransferGroup(
            master_address, master_port, TRAINER_RANK, world_size, group_name, backend, timeout, role="trainer"
        )
        self._buffers: list[torch.Tensor] = []

    def plan(
        self, named_tensors: NamedTensors, bucket_bytes: int | None = None, base_version: int | None = None
    ) -> dict:
        """The JSON-serialisable metadata of an update of these tensors (see `dsv4.rl.plan`).

        Args:
            named_tensors: (name, tensor) pairs or a mapping; HF or native names, any dtype of `plan.DTYPES`.
            bucket_bytes: largest packed bucket (a larger tensor travels alone); None: the backend's default
                (`plan.GLOO_BUCKET_BYTES` or `plan.NCCL_BUCKET_BYTES`).
            base_version: the engine weights version the update applies to; the engine refuses any other.

        Returns:
            The metadata: hand it to the engine's `update_weights_from_distributed`.
        """
        if bucket_bytes is None:
            bucket_bytes = NCCL_BUCKET_BYTES if self.group.backend == "nccl" else GLOO_BUCKET_BYTES
        return plan_buckets(named_tensors, bucket_bytes, base_version).to_json()

    def send(self, named_tensors: NamedTensors, metadata: dict) -> dict:
        """Broadcast the planned tensors while the engine runs `update_weights_from_distributed(metadata)`.
        The tensors must hold the values they held at `plan` (the engine verifies the checksums).

        Returns:
            {"update_id", "versions": {engine rank: new weights version}, "bytes", "buckets", "seconds"}.

        Raises:
            WeightUpdateError: the plan refused (by an engine: wrong base version, bad metadata; or here: the
                tensors differ from the plan), or an engine rank that failed to apply it (its reason quoted).
            WeightTransferError: a peer that died or timed out; the group is unusable afterwards.
        """
        start = time.perf_counter()
        plan = WeightSyncPlan.from_json(metadata)
        self.group.check_usable()
        tensors, refusal = None, None
        try:
            tensors = check_tensors_match(plan, named_tensors)
        except WeightUpdateError as exc:
            refusal = str(exc)
        problem = self.group.agree(plan.update_id, plan.digest(), refusal)
        if problem:
            raise WeightUpdateError(f"update {plan.update_id} not started: {problem}")
        self._stream(plan, tensors)
        results = self.group.outcomes(plan.update_id, {"ok": True})
        failed = [f"engine rank {r}: {rec.get('error')}" for r, rec in enumerate(results) if not rec.get("ok")]
        if failed:
            raise WeightUpdateError(f"update {plan.update_id} failed: " + "; ".join(failed))
        return {
            "update_id": plan.update_id,
            "versions": {r: rec["version"] for r, rec in enumerate(results) if r != TRAINER_RANK},
            "bytes": plan.total_bytes,
            "buckets": len(plan.buckets),
            "seconds": time.perf_counter() - start,
        }

    def _stream(self, plan: WeightSyncPlan, tensors: dict[str, torch.Tensor]) -> None:
        """Pack bucket i into buffer i % 2 once that buffer's previous broadcast (bucket i - 2) is done."""
        self._ensure_buffers(plan.buffer_bytes)
        pending: list = [None, None]
        for i, bucket in enumerate(plan.buckets):
            slot = i % 2
            if pending[slot] is not None:
                self.group.wait_for(pending[slot], f"broadcast of bucket {i - 2}")
            packed = pack_bucket(bucket, tensors, self._buffers[slot])
            pending[slot] = self.group.broadcast(packed)
        for i, work in enumerate(pending):
            if work is not None:
                self.group.wait_for(work, f"broadcast of the last buckets ({i})")

    def _ensure_buffers(self, nbytes: int) -> None:
        if not self._buffers or self._buffers[0].numel() < nbytes:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.group.device) for _ in range(2)]

    def close(self) -> None:
        """Drop the group and the packing buffers."""
        self._buffers = []
        self.group.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
