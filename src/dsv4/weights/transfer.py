"""The engine end of weight sync: buckets from a trainer, received over a torch.distributed group (or
mapped from shared memory), verified against their checksums and fed to a refit session.

Everything a fresh load guarantees holds for these updates because they ARE refit sessions
(`dsv4.weights.refit`): names (HF or native) mapped by the same writer, every tensor validated before it
is written, atomic (staged, committed at finish) or fail-stop, target and drafters in one session,
finalize once, addresses audited, the version bumped. What this module adds:

  - the base-version check and the metadata's validation, both before a byte is received: a refused
    update is refused on every member of the group (see `dsv4.rl.sender` for the protocol);
  - a checksum per bucket, verified before any of its bytes reaches a live weight (an atomic session
    hashes each tensor as it stages it, so hashing, validating and staging read the bytes from memory once;
    `apply_bucket`): an update that reports success has provably moved the bytes the trainer planned;
  - two receive buffers, so bucket i+1 arrives while bucket i is verified and staged;
  - every engine rank staged every bucket (and holds every tensor a full update needs), or none commits:
    the engine ranks agree before committing, since a bucket may fail on one rank only, and tensor
    parallel ranks must not serve a mix of old and new shards;
  - a transport failure (dead trainer, timeout) or a failed bucket aborts the session: in atomic mode the
    previous weights keep serving, in fail-stop mode the models refuse requests until a complete update.
    After a checksum or staging failure the remaining buckets are still received (and dropped), so the
    group stays in step and the trainer hears the reason; after a transport failure the group is unusable.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from dsv4.errors import WeightUpdateError
from dsv4.rl.checksum import BucketHasher, bucket_checksum
from dsv4.rl.colocated import open_shared_buckets
from dsv4.rl.group import TransferGroup
from dsv4.rl.plan import BucketEntry, WeightSyncPlan, bucket_views
from dsv4.weights.loader import LoadedModels
from dsv4.weights.refit import WeightUpdateSession

# An update may carry at most this many times the bytes of the resident weights: fp32 values for FP4
# experts are 8x their resident size, plus scales and padding. The bound keeps a malformed plan (a
# bucket claiming terabytes) from making the engine allocate without limit.
MAX_UPDATE_TO_RESIDENT_BYTES = 16

BeginSession = Callable[[], WeightUpdateSession]


def max_update_bytes(loaded: LoadedModels) -> int:
    """The largest update these models accept: a multiple of the bytes of all their parameters."""
    resident = sum(p.numel() * p.element_size() for m in loaded.models.values() for p in m.parameters())
    return MAX_UPDATE_TO_RESIDENT_BYTES * resident


def check_plan(plan: WeightSyncPlan, version: int, max_bytes: int) -> None:
    """Refuse an update built for another weights version, or larger than the engine could hold."""
    if plan.base_version is not None and plan.base_version != version:
        raise WeightUpdateError(
            f"update {plan.update_id} is based on weights version {plan.base_version}, the engine holds "
            f"version {version}: refused before receiving it"
        )
    if plan.total_bytes > max_bytes:
        raise WeightUpdateError(
            f"update {plan.update_id} carries {plan.total_bytes} bytes, over the engine's bound of {max_bytes} "
            f"({MAX_UPDATE_TO_RESIDENT_BYTES}x its resident weights)"
        )


def apply_bucket(session: WeightUpdateSession, plan: WeightSyncPlan, index: int, buffer: torch.Tensor) -> None:
    """Verify bucket `index` (flat uint8, exactly its bytes) against its checksum and stage it.

    A fail-stop session writes live weights as it loads, so its bucket is verified whole first (a read of
    its own). An atomic session stages into buffers nothing reads before `finish()`: each tensor's bytes
    (with the padding before them) are hashed right before the session stages them, so the staging copy,
    which also validates them, finds them in cache, and the bucket is refused at its end when the checksum
    differs (the caller then aborts the session: nothing was applied). Either way no live byte is written
    from a bucket whose checksum was not verified.
    """
    bucket = plan.buckets[index]
    origin = f"update {plan.update_id} bucket {index}"
    if not session.atomic:
        _verify(plan, index, bucket_checksum(buffer))
        session.load(bucket_views(bucket, buffer), origin=origin)
        return
    hasher = BucketHasher()
    try:
        session.load(_hashed_views(bucket, buffer, hasher), origin=origin)
    except WeightUpdateError as exc:
        # Bytes that are not the planned ones can fail validation first: the checksum says what went wrong.
        _verify(plan, index, bucket_checksum(buffer), cause=exc)
        raise
    _verify(plan, index, hasher.hexdigest())


def _hashed_views(
    bucket: BucketEntry, buffer: torch.Tensor, hasher: BucketHasher
) -> Iterator[tuple[str, torch.Tensor]]:
    """`bucket_views`, hashing each tensor's bytes (and the padding before them) as it is handed out."""
    hashed = 0
    for entry, (name, view) in zip(bucket.tensors, bucket_views(bucket, buffer), strict=True):
        hasher.update(buffer[hashed : entry.end])
        hashed = entry.end
        yield name, view
    hasher.update(buffer[hashed:])


def _verify(plan: WeightSyncPlan, index: int, got: str, cause: Exception | None = None) -> None:
    """Raise unless `got` is bucket `index`'s planned checksum."""
    bucket = plan.buckets[index]
    if got != bucket.checksum:
        raise WeightUpdateError(
            f"update {plan.update_id} bucket {index}: checksum {got} != planned {bucket.checksum} "
            f"({bucket.nbytes} bytes, first tensor {bucket.tensors[0].name!r}): the bytes received are not "
            f"the bytes planned (changed after plan(), or corrupted in transit)"
        ) from cause


class WeightReceiver:
    """An engine rank of a transfer group (rank = rank_offset). Construction joins the group, blocking
    until every member has joined (within `timeout`).

    Args:
        master_address: the trainer's store address.
        master_port: its port.
        rank_offset: this engine's rank in the group (the trainer is rank 0).
        world_size: members in all (trainer + engine ranks).
        group_name: the group's name (the trainer's `WeightSender` passes the same).
        backend: "gloo" (CPU) or "nccl" (GPU).
        timeout: seconds any single wait may take.

    Raises:
        ConfigError: a bad argument. WeightTransferError: the trainer unreachable, or a member disagreeing.
    """

    def __init__(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str, timeout: float,
    ):
        self.group = TransferGroup(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout, role="engine"
        )
        self._buffers: list[torch.Tensor] = []

    def describe(self) -> dict[str, Any]:
        g = self.group
        return {"group": g.where, "rank": g.rank, "world_size": g.world_size, "backend": g.backend,
                "usable": g.broken is None}

    def update(self, metadata: object, version: int, begin: BeginSession, max_bytes: int) -> dict[str, Any]:
        """Run one update: agree on the plan, receive and apply every bucket, finish the session.

        Args:
            metadata: the trainer's plan (`WeightSender.plan`), as JSON.
            version: the engine's weights version now.
            begin: opens the refit session (called once, only if the plan is acceptable).
            max_bytes: the largest update this engine accepts.

        Returns:
            {"version", "update_id", "buckets", "tensors", "bytes", "seconds", "receive_wait_s",
             "apply_s", "commit_s"}.

        Raises:
            WeightUpdateError: refused (base version, metadata, a session already open; nothing received) or
                failed (checksum, a rejected tensor; nothing applied in atomic mode).
            WeightTransferError: the trainer died or timed out; the group is unusable afterwards.
        """
        start = time.perf_counter()
        self.group.check_usable()
        update_id = metadata.get("update_id") if isinstance(metadata, Mapping) else None
        if not isinstance(update_id, str):
            raise WeightUpdateError(f"weight update metadata: no 'update_id' string in {metadata!r:.120}")
        plan, session, refusal = None, None, None
        try:
            plan = WeightSyncPlan.from_json(metadata)
            check_plan(plan, version, max_bytes)
            session = begin()
        except WeightUpdateError as exc:
            refusal = str(exc)
        try:
            problem = self.group.agree(update_id, plan.digest() if plan else "unreadable", refusal)
            if problem:
                raise WeightUpdateError(f"update {update_id} refused before any byte was received: {problem}")
            stats = self._receive(plan, session)
            failure = stats.pop("failure")
            if failure is None:
                try:
                    session.check_complete()
                except WeightUpdateError as exc:
                    failure = exc
            # A bucket, or completeness, can fail on one engine rank only (an expert tensor of the ranks that
            # hold it, under expert parallelism): then no engine rank commits, or tensor parallel ranks
            # would serve a mix of old and new shards.
            elsewhere = self.group.staged(update_id, None if failure is None else str(failure))
            if failure is None and elsewhere is not None:
                failure = WeightUpdateError(f"update {update_id}: {elsewhere}; not applied on engine rank "
                                            f"{self.group.rank} either")
            commit_start = time.perf_counter()
            if failure is None:
                try:
                    new_version = session.finish()
                except WeightUpdateError as exc:
                    failure = exc
            if failure is not None:
                self.group.report(update_id, {"ok": False, "error": str(failure)})
                raise WeightUpdateError(str(failure)) from failure
        finally:  # refused, failed, or the transport broke: no session stays open behind the caller's back
            if session is not None and session.active:
                session.abort()
        self.group.report(update_id, {"ok": True, "version": new_version})
        return {"version": new_version, "update_id": update_id, "buckets": len(plan.buckets),
                "tensors": plan.num_tensors, "bytes": plan.total_bytes, **stats,
                "commit_s": time.perf_counter() - commit_start, "seconds": time.perf_counter() - start}

    def _receive(self, plan: WeightSyncPlan, session: WeightUpdateSession) -> dict[str, Any]:
        """Bucket i+1 is received into one buffer while bucket i, in the other, is verified and staged.
        The first failing bucket is kept as "failure"; later buckets are still received, not applied."""
        self._ensure_buffers(plan.buffer_bytes)

        def buffer(i: int) -> torch.Tensor:
            return self._buffers[i % 2][: plan.buckets[i].nbytes]

        waited = applied = 0.0
        failure: Exception | None = None
        pending = self.group.broadcast(buffer(0)) if plan.buckets else None
        for i in range(len(plan.buckets)):
            t0 = time.perf_counter()
            self.group.wait_for(pending, f"receiving bucket {i} of update {plan.update_id}")
            t1 = time.perf_counter()
            if i + 1 < len(plan.buckets):
                pending = self.group.broadcast(buffer(i + 1))
            if failure is None:
                try:
                    apply_bucket(session, plan, i, buffer(i))
                except Exception as exc:  # a checksum, a rejected tensor: report it once every bucket is in
                    failure = exc
            waited += t1 - t0
            applied += time.perf_counter() - t1
        return {"failure": failure, "receive_wait_s": waited, "apply_s": applied}

    def _ensure_buffers(self, nbytes: int) -> None:
        if not self._buffers or self._buffers[0].numel() < nbytes:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.group.device) for _ in range(2)]


def update_from_shared(
    metadata: object, handle: object, version: int, begin: BeginSession, max_bytes: int
) -> dict[str, Any]:
    """One update from buckets a colocated trainer packed into shared memory (`ColocatedWeightSender`).

    Returns:
        {"version", "update_id", "buckets", "tensors", "bytes", "seconds", "receive_wait_s", "apply_s",
        "commit_s"}: the phases as `WeightReceiver.update` reports them (the buckets are in memory already,
        so nothing is waited for).

    Raises:
        WeightUpdateError: refused (base version, metadata, handle) or failed (checksum, a rejected tensor).
    """
    start = time.perf_counter()
    plan = WeightSyncPlan.from_json(metadata)
    check_plan(plan, version, max_bytes)
    buffers = open_shared_buckets(handle, plan)
    session = begin()
    try:
        apply_start = time.perf_counter()
        for i, buffer in enumerate(buffers):
            apply_bucket(session, plan, i, buffer)
        commit_start = time.perf_counter()
        new_version = session.finish()
    except BaseException:
        session.abort()
        raise
    end = time.perf_counter()
    return {"version": new_version, "update_id": plan.update_id, "buckets": len(plan.buckets),
            "tensors": plan.num_tensors, "bytes": plan.total_bytes, "seconds": end - start, "receive_wait_s": 0.0,
            "apply_s": commit_start - apply_start, "commit_s": end - commit_start}
