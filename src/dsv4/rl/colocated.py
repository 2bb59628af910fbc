"""`ColocatedWeightSender`: weight sync for a trainer on the engine's host (or in its process), through
shared memory instead of a process group. It takes the same metadata as the distributed path.

    sender = ColocatedWeightSender()
    meta = sender.plan(model.state_dict(), base_version=v)     # the same JSON as WeightSender.plan
    handle = sender.share(model.state_dict(), meta)            # every bucket packed into shared memory
    llm.update_weights_from_shared(meta, handle)               # the engine (this or another process)
    sender.release()                                           # or keep it: the next share reuses it

CPU: the buckets live in one file under /dev/shm (POSIX shared memory; the temp directory elsewhere),
created by the trainer with mode 0600 and mapped by the engine read-only-in-effect (a private mapping:
the engine can never write the trainer's memory); the handle names the file, and the engine maps only
files of this module's naming inside that directory. GPU: one CUDA buffer exported as a CUDA IPC handle
(torch.multiprocessing's own reduction), encoded as JSON; the engine process opens it without a copy
(CUDA cannot open an IPC handle in the process that made it: a trainer in the engine's own process uses
the CPU path or `llm.update_weights`). The GPU path is written against torch's API but has only been
exercised on CPU machines so far.

All buckets are shared at once (memory: one copy of the update); a trainer short of memory uses the
distributed path, whose two bucket buffers bound it.
"""

from __future__ import annotations

import base64
import os
import tempfile
import uuid
from pathlib import Path

import torch

from dsv4.errors import WeightUpdateError
from dsv4.rl.plan import (
    ALIGNMENT,
    DEFAULT_BUCKET_BYTES,
    NamedTensors,
    WeightSyncPlan,
    check_tensors_match,
    pack_bucket,
    plan_buckets,
)

SHM_KIND, CUDA_IPC_KIND = "shm", "cuda_ipc"
_FILE_PREFIX = "dsv4-weights-"
_POSIX_SHM = Path("/dev/shm")


def shared_dir() -> Path:
    """Where shared bucket files live: POSIX shared memory when the OS has it, else the temp directory."""
    return _POSIX_SHM if _POSIX_SHM.is_dir() else Path(tempfile.gettempdir())


def bucket_offsets(plan: WeightSyncPlan) -> list[int]:
    """Byte offset of each bucket in the shared segment (buckets back to back, each aligned)."""
    offsets, end = [], 0
    for bucket in plan.buckets:
        start = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(start)
        end = start + bucket.nbytes
    return offsets


def segment_bytes(plan: WeightSyncPlan) -> int:
    offsets = bucket_offsets(plan)
    return offsets[-1] + plan.buckets[-1].nbytes if offsets else 0


class ColocatedWeightSender:
    """Packs updates into shared memory for an engine on the same host.

    Args:
        device: "cpu" (a shared-memory file) or a CUDA device (a CUDA IPC handle).
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._segment: torch.Tensor | None = None
        self._path: Path | None = None

    def plan(
        self, named_tensors: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES, base_version: int | None = None
    ) -> dict:
        """The update's metadata, exactly as `WeightSender.plan` makes it (see `dsv4.rl.plan`)."""
        return plan_buckets(named_tensors, bucket_bytes, base_version).to_json()

    def share(self, named_tensors: NamedTensors, metadata: dict) -> dict:
        """Pack every planned bucket into the shared segment (grown when too small, else reused).

        Returns:
            The JSON handle the engine's `update_weights_from_shared(metadata, handle)` takes.

        Raises:
            WeightUpdateError: the tensors differ from the plan.
        """
        plan = WeightSyncPlan.from_json(metadata)
        tensors = check_tensors_match(plan, named_tensors)
        segment = self._ensure_segment(segment_bytes(plan))
        for bucket, offset in zip(plan.buckets, bucket_offsets(plan)):
            pack_bucket(bucket, tensors, segment[offset : offset + bucket.nbytes])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the engine reads after this returns
            return {"kind": CUDA_IPC_KIND, "nbytes": segment.numel(), "ipc": _encode_cuda_ipc(segment)}
        return {"kind": SHM_KIND, "path": str(self._path), "nbytes": segment.numel()}

    def _ensure_segment(self, nbytes: int) -> torch.Tensor:
        if self._segment is not None and self._segment.numel() >= nbytes:
            return self._segment
        self.release()
        nbytes = max(nbytes, 1)
        if self.device.type == "cuda":
            self._segment = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return self._segment
        path = shared_dir() / f"{_FILE_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._path = path
        self._segment = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return self._segment

    def release(self) -> None:
        """Free the shared segment (the engine must have finished the update that read it)."""
        self._segment = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None

    def __enter__(self) -> ColocatedWeightSender:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


# ---- engine side ----
def open_shared_buckets(handle: object, plan: WeightSyncPlan) -> list[torch.Tensor]:
    """The plan's buckets as flat uint8 tensors in the shared segment `handle` names (no copy).

    Raises:
        WeightUpdateError: a malformed handle, a path outside the shared directory or not made by
            `ColocatedWeightSender`, or a segment smaller than the plan.
    """
    if not isinstance(handle, dict) or handle.get("kind") not in (SHM_KIND, CUDA_IPC_KIND):
        raise WeightUpdateError(f"shared weights handle: expected kind 'shm' or 'cuda_ipc', got {handle!r:.120}")
    needed = segment_bytes(plan)
    if handle["kind"] == SHM_KIND:
        segment = _map_shm(handle.get("path"), needed)
    else:
        segment = _decode_cuda_ipc(handle.get("ipc"))
        if segment.numel() < needed:
            raise WeightUpdateError(f"shared weights handle: {segment.numel()} bytes, the plan needs {needed}")
    return [segment[o : o + b.nbytes] for b, o in zip(plan.buckets, bucket_offsets(plan))]


def _map_shm(path: object, needed: int) -> torch.Tensor:
    if not isinstance(path, str):
        raise WeightUpdateError(f"shared weights handle: 'path' must be a string, got {path!r:.120}")
    resolved = Path(path).resolve()
    if resolved.parent != shared_dir().resolve() or not resolved.name.startswith(_FILE_PREFIX):
        raise WeightUpdateError(
            f"shared weights handle: {path!r} is not a {_FILE_PREFIX}* file in {shared_dir()} (refusing to map it)"
        )
    if not resolved.is_file():
        raise WeightUpdateError(f"shared weights handle: {path} does not exist (released by the trainer?)")
    size = resolved.stat().st_size
    if size < needed:
        raise WeightUpdateError(f"shared weights handle: {path} holds {size} bytes, the plan needs {needed}")
    if needed == 0:
        return torch.empty(0, dtype=torch.uint8)
    # shared=False: a private (copy-on-write) mapping, so the engine can never write the trainer's memory.
    return torch.from_file(str(resolved), shared=False, size=needed, dtype=torch.uint8)


# CUDA IPC handles are torch.multiprocessing's reduction of a uint8 CUDA tensor; its fields go into JSON
# with bytes as base64 (never pickle: the handle may arrive over an HTTP admin route).
_IPC_FIELDS = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle",
               "ref_counter_offset", "event_handle", "event_sync_required")
_IPC_BYTES_FIELDS = ("handle", "ref_counter_handle", "event_handle")


def _encode_cuda_ipc(segment: torch.Tensor) -> dict:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(segment)
    shared = dict(zip(_IPC_FIELDS, args[6:14]))
    encoded = {k: base64.b64encode(v).decode() if k in _IPC_BYTES_FIELDS else v for k, v in shared.items()}
    return {**encoded, "numel": segment.numel(), "tensor_offset": args[3]}


def _decode_cuda_ipc(ipc: object) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(ipc, dict) or not all(k in ipc for k in (*_IPC_FIELDS, "numel", "tensor_offset")):
        raise WeightUpdateError("shared weights handle: 'ipc' must hold every CUDA IPC field")
    try:
        fields = {k: base64.b64decode(ipc[k]) if k in _IPC_BYTES_FIELDS else ipc[k] for k in _IPC_FIELDS}
        numel = int(ipc["numel"])
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size([numel]), (1,), int(ipc["tensor_offset"]), torch.storage.TypedStorage,
            torch.uint8, fields["device"], fields["handle"], fields["storage_size_bytes"],
            fields["storage_offset_bytes"], False, fields["ref_counter_handle"], fields["ref_counter_offset"],
            fields["event_handle"], fields["event_sync_required"],
        )
    except Exception as exc:
        raise WeightUpdateError(f"shared weights handle: cannot open the CUDA IPC handle: {exc}") from exc
