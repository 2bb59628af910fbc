"""The transfer group: a torch.distributed process group of its own between a trainer (rank 0) and the
engine ranks that receive its weights, plus the small key-value exchange the update protocol needs.

It never touches the default process group (a trainer usually owns that one for FSDP, an engine for
tensor parallelism): a `TCPStore` hosted by the trainer at master_address:master_port, a prefix for the
group's keys, and a gloo (CPU) or NCCL (GPU) backend built directly on it, as SGLang's and vLLM's
stateless groups do. Every wait is bounded by the group's timeout, and every failure becomes one
`WeightTransferError` naming the group, the address and the peer:

  - the store unreachable (no trainer listening), or a rank that never joins: timeout;
  - members that disagree on world size, backend or protocol, or two members claiming one rank: refused at
    join, before any process group exists (a mismatched world size would otherwise hang in gloo's
    rendezvous until the timeout with no hint of the cause);
  - a peer that dies mid-transfer: gloo reports the closed connection at once, NCCL within the timeout.

Besides collectives, members `publish` small JSON records under a key and `gather` every member's record
for that key: the update protocol uses them to agree on a plan before any byte moves, for the engine ranks
to agree that every one of them staged the update before any commits it, and to report each engine's
outcome (with its error text) back to the trainer.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import socket
from typing import Any

import torch
import torch.distributed as dist

from dsv4.errors import ConfigError, WeightTransferError
from dsv4.rl.plan import PROTOCOL

BACKENDS = ("gloo", "nccl")
TRAINER_RANK = 0
# Long enough for a large bucket over a slow link or a trainer finishing its step before it sends, short
# enough that a dead peer does not hold an engine for long; every call can pass its own.
DEFAULT_TIMEOUT_S = 120.0
_KEY_PREFIX = "dsv4-weight-sync"
_MAX_PORT = 65535


class TransferGroup:
    """One member of a transfer group. Construction blocks until every member has joined.

    Args:
        master_address: host of the trainer's store (rank 0 listens there).
        master_port: its port.
        rank: this member's rank (0: the trainer, which hosts the store).
        world_size: members in all: the trainer plus every engine rank.
        group_name: isolates the keys of groups that share a store.
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        timeout: seconds any single wait may take (join, collective, record exchange).
        role: how this member names itself in errors ("trainer", "engine").

    Raises:
        ConfigError: a bad argument (named, with its value).
        WeightTransferError: the store unreachable, a member missing or disagreeing, a backend that fails.
    """

    def __init__(
        self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
        backend: str, timeout: float, role: str,
    ):
        _check_args(master_address, master_port, rank, world_size, group_name, backend, timeout)
        self.rank, self.world_size, self.backend, self.role = rank, world_size, backend, role
        self.timeout = float(timeout)
        self.where = f"weight transfer group {group_name!r} at {master_address}:{master_port}"
        self.broken: str | None = None  # set once a transfer failed: the group cannot be trusted any more
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        delta = datetime.timedelta(seconds=self.timeout)
        try:
            store = dist.TCPStore(
                master_address, master_port, world_size, rank == TRAINER_RANK, timeout=delta, wait_for_workers=False
            )
        except Exception as exc:  # DistNetworkError, DistStoreError, OSError (address in use)
            action = "could not listen" if rank == TRAINER_RANK else "could not reach the trainer's store"
            raise WeightTransferError(f"{self.where}: {role} rank {rank} {action} within {timeout:g} s: {exc}") from exc
        self._store = dist.PrefixStore(f"{_KEY_PREFIX}/{group_name}/", store)
        self._join()
        try:
            # The backend's own rendezvous keys live under a prefix of their own, apart from the protocol's.
            backend_store = dist.PrefixStore("backend/", self._store)
            self._pg = _new_backend(backend_store, rank, world_size, backend, delta, master_address)
        except Exception as exc:
            raise WeightTransferError(f"{self.where}: {role} rank {rank}: {backend} group failed: {exc}") from exc

    # ---- join ----
    def _join(self) -> None:
        """Claim this rank, then compare every member's view of the group with our own."""
        try:
            claims = self._store.add(f"claim/{self.rank}", 1)
        except Exception as exc:
            raise self.fail(f"claiming rank {self.rank}: {exc}") from exc
        if claims != 1:
            raise WeightTransferError(f"{self.where}: {self.role} rank {self.rank} is already taken by another member")
        mine = {"world_size": self.world_size, "backend": self.backend, "protocol": PROTOCOL, "role": self.role}
        read: dict[int, dict[str, Any]] = {}
        if self.rank != TRAINER_RANK:
            # The trainer's record before publishing ours: a trainer that sees a member disagree stops, and its
            # store with it, so a member that published first could lose the trainer's record (the reason) with
            # the connection.
            read[TRAINER_RANK] = self._read(f"member/{TRAINER_RANK}", f"rank {TRAINER_RANK} to join")
        self.publish("member", mine)
        # Rank 0 first: a member that disagrees with the trainer learns it without waiting for ranks that
        # the trainer's world size does not have.
        for rank in sorted(range(self.world_size), key=lambda r: r != TRAINER_RANK):
            theirs = read[rank] if rank in read else self._read(f"member/{rank}", f"rank {rank} to join")
            for key in ("world_size", "backend", "protocol"):
                if theirs.get(key) != mine[key]:
                    raise WeightTransferError(
                        f"{self.where}: {theirs.get('role', 'member')} rank {rank} has {key}={theirs.get(key)!r}, "
                        f"{self.role} rank {self.rank} has {key}={mine[key]!r}"
                    )

    # ---- records ----
    def publish(self, key: str, record: dict[str, Any]) -> None:
        """Make this member's record for `key` visible to every member."""
        try:
            self._store.set(f"{key}/{self.rank}", json.dumps(record))
        except Exception as exc:  # the store's host (the trainer) is gone
            raise self.fail(f"publishing {key}: {exc}") from exc

    def gather(self, key: str, what: str) -> list[dict[str, Any]]:
        """Every member's record for `key`, by rank (waits for each within the timeout)."""
        return [self._read(f"{key}/{rank}", f"rank {rank}'s {what}") for rank in range(self.world_size)]

    def _read(self, key: str, what: str) -> dict[str, Any]:
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.timeout))
            return json.loads(self._store.get(key))
        except Exception as exc:
            raise self.fail(f"waiting {self.timeout:g} s for {what}: {exc}") from exc

    # ---- the update protocol's two exchanges ----
    def agree(self, update_id: str, digest: str, refusal: str | None) -> str | None:
        """Publish whether this member accepts update `update_id` (None: it does) and the digest of the plan
        it holds; read every member's. Returns why the update cannot start (the first refusal, or a member
        holding a different plan), the same answer on every member, or None."""
        self.publish(f"ready/{update_id}", {"ok": refusal is None, "error": refusal, "digest": digest})
        for rank, record in enumerate(self.gather(f"ready/{update_id}", "acceptance of the plan")):
            role = "trainer" if rank == TRAINER_RANK else "engine"
            if not record.get("ok"):
                return f"{role} rank {rank} refused it: {record.get('error')}"
            if record.get("digest") != digest:
                return f"{role} rank {rank} holds different metadata for it ({record.get('digest')} != {digest})"
        return None

    def staged(self, update_id: str, error: str | None) -> str | None:
        """Publish whether this engine rank staged every bucket of update `update_id` (None: it did), then read
        every engine rank's answer. Returns the first failing engine rank's reason, the same on every engine
        rank, or None: an update commits on every engine rank or on none."""
        self.publish(f"staged/{update_id}", {"ok": error is None, "error": error})
        for rank in range(self.world_size):
            if rank == TRAINER_RANK:
                continue
            record = self._read(f"staged/{update_id}/{rank}", f"engine rank {rank}'s staging of the update")
            if not record.get("ok"):
                return f"engine rank {rank} failed to stage it: {record.get('error')}"
        return None

    def report(self, update_id: str, outcome: dict[str, Any]) -> None:
        """Publish this member's outcome of update `update_id` ({"ok", "version"} or {"ok": False, "error"})."""
        self.publish(f"done/{update_id}", outcome)

    def outcomes(self, update_id: str, outcome: dict[str, Any]) -> list[dict[str, Any]]:
        """Report this member's outcome, then wait for every member's (the trainer's last step)."""
        self.report(update_id, outcome)
        return self.gather(f"done/{update_id}", "outcome of the update")

    # ---- collectives ----
    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start a broadcast of `tensor` from the trainer (returns the pending work; `wait_for` it)."""
        self.check_usable()
        try:
            return self._pg.broadcast([tensor], dist.BroadcastOptions())
        except Exception as exc:
            raise self.fail(f"broadcast: {exc}") from exc

    def wait_for(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:
            raise self.fail(f"{what}: {exc}") from exc

    def fail(self, reason: str) -> WeightTransferError:
        """Mark the group broken (a later use refuses at once) and return the error to raise."""
        self.broken = reason
        return WeightTransferError(f"{self.where}: {self.role} rank {self.rank}: {reason}")

    def close(self) -> None:
        """Leave the group: drop the backend and the store connection; any later use refuses."""
        self.broken = self.broken or "closed by this member"
        self._pg = self._store = None

    def check_usable(self) -> None:
        if self.broken is not None:
            raise WeightTransferError(
                f"{self.where}: unusable after an earlier failure ({self.broken}); init a new transfer group"
            )


def _new_backend(store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta, address: str):
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Loopback groups must not depend on how the host name resolves; others use gloo's default device
        # (the interface the host name resolves to, or GLOO_SOCKET_IFNAME).
        if ipaddress.ip_address(_resolve(address)).is_loopback:
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _resolve(address: str) -> str:
    try:
        return socket.gethostbyname(address)
    except OSError:
        return address


def _check_args(
    master_address: object, master_port: object, rank: object, world_size: object, group_name: object,
    backend: object, timeout: object,
) -> None:
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(master_address, str) or not master_address:
        raise ConfigError(f"master_address must be a host name or address, got {master_address!r}")
    if not is_int(master_port) or not 0 < master_port <= _MAX_PORT:
        raise ConfigError(f"master_port must be an int in [1, {_MAX_PORT}], got {master_port!r}")
    if not is_int(world_size) or world_size < 2:
        raise ConfigError(f"world_size must be an int >= 2 (the trainer and an engine rank), got {world_size!r}")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    if not isinstance(group_name, str) or not group_name or "/" in group_name:
        raise ConfigError(f"group_name must be a non-empty string without '/', got {group_name!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ConfigError("backend 'nccl' needs CUDA and a torch build with NCCL; use 'gloo' on CPU")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
