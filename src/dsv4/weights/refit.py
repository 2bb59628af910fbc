"""A weight update session (refit): begin -> load(bucket) any number of times -> finish() | abort().

A trainer streams new weights in buckets of (name, tensor) pairs: native or HF names, any supported
dtype (bf16/fp32 values are quantized on the fly into FP8/FP4 experts; native FP8/FP4 bytes arrive with
their `.scale`, possibly in a later bucket). Everything goes through the same `WeightWriter` as a
checkpoint load, so a refit can never map, pair or convert differently from a fresh load of the same
weights. Every tensor is validated (known name, shape, dtype, finite values, e8m0 bytes, routing-table
rows) before any byte of it reaches a weight that serves (an HF stacked-experts tensor: expert by expert):
atomic sessions check float values inside the copy that stages them; fail-stop sessions inside the copy
that writes them, since from the first write on (and after any failure) the models serve nothing.

Two failure policies, because a true rollback costs memory:

  atomic (default)   converted values are staged; nothing is written until `finish()`. A failed bucket,
                     an incomplete session or `abort()` leaves the previous weights serving, bit-exact,
                     READY. Costs one extra copy of the updated tensors (in resident layout), and the one
                     extra pass that writes it back at `finish()`. The staging buffers are kept for the
                     next atomic update (`LoadedModels.staging`: an RL loop updates the same tensors every
                     step, and fresh memory costs its page faults each time); `staging.clear()` gives
                     them back.
  fail-stop          each tensor is written into resident storage as soon as it is validated, with no
                     intermediate copy (memory: nothing beyond the caller's bucket). From the first write
                     on, and after any error, the models are not READY (forward raises
                     WeightsNotReadyError naming the model) until a session finishes with every tensor.

Names resolve through the models' route table (planned once per model, a dict lookup per tensor); every
value check reads its tensor once. The caller may reuse a bucket's buffers as soon as `load()` returns: the
only incoming tensors kept past it are halves that wait for their partner from a later bucket (a scale
sent before its weight, or FP8 bytes for a dense parameter), and those few are copied.

`finish()` writes (atomic), checks that no weight waits for its scale and (with `full=True`, or when the
models were not READY at `begin`) that every expected tensor arrived, finalizes every model exactly once
(target first, then drafters), verifies that no tensor changed address, and bumps the weights version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping

import torch

from dsv4.errors import ParallelError, WeightUpdateError
from dsv4.parallel.collectives import all_gather_objects
from dsv4.parallel.state import ParallelState
from dsv4.weights.collection import collection_paused
from dsv4.weights.loader import LoadedModels
from dsv4.weights.report import model_tensors
from dsv4.weights.writer import WeightWriter

Bucket = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

# How many missing names an error message lists before summarising the rest.
_SHOWN_NAMES = 10

OPEN, FINISHED, ABORTED, FAILED = "open", "finished", "aborted", "failed"


def _addresses(loaded: LoadedModels) -> dict[tuple[str, str], int]:
    """data_ptr of every parameter and derived tensor: what a captured graph has baked in."""
    return {
        (role, name): tensor.data_ptr()
        for role, model in loaded.models.items()
        for name, tensor, _ in model_tensors(model)
    }


def _names_summary(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_NAMES])
    more = len(names) - _SHOWN_NAMES
    return shown + (f" ... (+{more} more)" if more > 0 else "")


class WeightUpdateSession:
    """One update of the weights of a target and its drafters. Use as a context manager: a normal exit
    finishes the session, an exception aborts it (and propagates).

    Args:
        loaded: the models to update.
        version: the weights version in effect at begin.
        on_commit: called once after a successful finish; returns the new weights version.
        atomic: stage everything and apply at `finish()` (True), or write as buckets arrive (False).
        full: `finish()` requires every tensor of every model.
        rank_agreement: on a tensor / expert parallel rank, the ranks agree before any commits (below);
            False for a caller that agrees by its own means first (the distributed transfer does).

    Tensor parallel ranks (SPMD: every rank runs the same update on the same full tensors) can still see
    different outcomes, since each validates only its shard: a bad routed-expert tensor fails on the rank
    that holds that expert, and the others drop it unread. So each rank's session ends with one agreement
    over the group: a rank whose bucket failed joins it with its error when the bucket fails, the others at
    `finish()`; none commits unless all can, and a session that completed nothing on this rank still bumps
    the version when another rank's did. Otherwise the ranks would serve a mix of old and new shards.
    """

    def __init__(
        self,
        loaded: LoadedModels,
        version: int,
        on_commit: Callable[[], int],
        *,
        atomic: bool = True,
        full: bool = False,
        rank_agreement: bool = True,
    ):
        self.loaded = loaded
        self._agreement: ParallelState | None = loaded.parallel if rank_agreement and loaded.parallel.is_parallel \
            else None  # the group this session still has to agree with (once)
        self.atomic = atomic
        self.version = version  # the weights version in effect; the new one after a successful finish
        self._on_commit = on_commit
        self._addresses = _addresses(loaded)
        routes = loaded.routes(self._addresses)
        self._table = routes.table
        self._writer = WeightWriter(routes, loaded.layout, error_type=WeightUpdateError, staged=atomic,
                                    staging=loaded.staging, before_first_write=self._mark_not_ready,
                                    shard=loaded.shard_slicer(routes))
        # A model that is not READY may hold a half-written update: only a complete one can repair it.
        self.full = full or not all(m.ready for m in loaded.models.values())
        self.state = OPEN
        self.buckets = 0
        self._completed = 0  # resident tensors completed so far

    # ---- state ----
    @property
    def active(self) -> bool:
        return self.state == OPEN

    def _require_open(self, action: str) -> None:
        if self.state != OPEN:
            raise WeightUpdateError(f"weight update session: cannot {action}, the session is already {self.state}")

    def _fail(self, exc: Exception) -> WeightUpdateError:
        """Close the session after an error. Fail-stop mode, or any session that already wrote, leaves
        every model not READY: their tensors may now mix old and new weights."""
        self.state = FAILED
        self._writer.discard()
        if isinstance(exc, WeightUpdateError):
            message = str(exc)
        else:
            message = f"weight update failed: {type(exc).__name__}: {exc}"
        if not self.atomic or self._writer.wrote:
            self._mark_not_ready()
            message += "; the models refuse requests until a weight update with every tensor finishes"
        else:
            message += "; nothing was applied, the previous weights keep serving"
        return WeightUpdateError(message)

    def _mark_not_ready(self) -> None:
        for model in self.loaded.models.values():
            model.mark_loading()

    # ---- buckets ----
    def load(self, bucket: Bucket, origin: str | None = None) -> int:
        """Validate and convert one bucket; fail-stop mode also writes it. Returns how many resident
        tensors the bucket completed (a weight waiting for its scale counts when the scale arrives).
        Any error closes the session (see the module docstring for what the weights look like then).
        The bucket's tensors may be reused by the caller as soon as this returns."""
        self._require_open("load a bucket")
        self.buckets += 1
        origin = origin or f"update bucket {self.buckets}"
        pairs = bucket.items() if isinstance(bucket, Mapping) else bucket
        completed = 0
        try:
            with collection_paused():  # a bucket's bookkeeping: `collection.py`
                for name, tensor in pairs:
                    if not isinstance(tensor, torch.Tensor):
                        raise WeightUpdateError(
                            f"{origin}: tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}"
                        )
                    completed += self._writer.load(name, tensor, origin)
                self._writer.own_pending()
        except Exception as exc:
            failure = self._fail(exc)
            self._agree_failed(str(failure))
            raise failure from exc
        self._completed += completed
        return completed

    # ---- end ----
    def check_complete(self) -> None:
        """Raise WeightUpdateError if `finish()` would refuse the session as incomplete (a weight without its
        scale; in a full update, a missing tensor); the session stays open (abort it). For a caller that
        must agree with other ranks before any of them commits."""
        self._require_open("check completeness")
        self._check_complete()

    def finish(self) -> int:
        """Check, apply (atomic), finalize every model once (target first) and bump the version.
        Returns the weights version now in effect; an empty session changes nothing, not even that."""
        self._require_open("finish")
        try:
            try:
                self._check_complete()
            except Exception as exc:
                self._agree_failed(str(exc))
                raise
            changed = self._agree_to_commit()
            if changed:
                self._writer.commit()  # atomic: the staged values; fail-stop: already written
                self.loaded.finalize()
                self._check_addresses()
        except Exception as exc:
            raise self._fail(exc) from exc
        self.state = FINISHED
        if changed:
            self.version = self._on_commit()
        return self.version

    # ---- agreement of tensor parallel ranks (class docstring) ----
    def _agree(self, error: str | None) -> list:
        """This rank's (error, completed anything) against every rank's, once per session."""
        state, self._agreement = self._agreement, None
        return all_gather_objects((error, self._completed > 0), state)

    def _agree_failed(self, error: str) -> None:
        """Join the agreement with this rank's failure (the error raised here is the caller's already)."""
        if self._agreement is not None:
            with contextlib.suppress(ParallelError):  # a dead peer: this rank fails regardless
                self._agree(error)

    def _agree_to_commit(self) -> bool:
        """Raise unless every rank can commit. Returns whether the update changes anything: on a tensor
        parallel rank, whether any rank's session completed a tensor (the update is the group's)."""
        if self._agreement is None:
            return self._completed > 0
        rank = self._agreement.rank
        answers = self._agree(None)
        for other, (error, _) in enumerate(answers):
            if error is not None:
                raise WeightUpdateError(f"tensor parallel rank {other} failed the update: {error}; not applied "
                                        f"on rank {rank} either")
        return any(completed for _, completed in answers)

    def _check_complete(self) -> None:
        problems = self._writer.unpaired()
        if self.full:
            missing = sorted(self._table.names() - self._writer.written)
            if missing:
                problems.append(f"{len(missing)} missing tensor(s): {_names_summary(missing)}")
        if problems:
            kind = "full weight update" if self.full else "weight update"
            raise WeightUpdateError(f"{kind} incomplete at finish: " + "; ".join(problems))

    def _check_addresses(self) -> None:
        """Pointer audit: an update that moved a tensor would leave captured graphs reading the old one."""
        now = _addresses(self.loaded)
        moved = sorted(f"{role}:{name}" for (role, name), ptr in self._addresses.items()
                       if now.get((role, name)) != ptr)
        if moved:
            raise WeightUpdateError(
                f"weight update moved {len(moved)} tensor(s) to a new address: {_names_summary(moved)}"
            )

    def abort(self) -> None:
        """Drop the session. Atomic: nothing was written, the previous weights keep serving. Fail-stop:
        if anything was written the models stay not READY until a complete update finishes."""
        if self.state != OPEN:
            return
        self.state = ABORTED
        self._writer.discard()

    # ---- context manager ----
    def __enter__(self) -> WeightUpdateSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.finish()
        else:
            self.abort()
        return False
