"""The engine driver: how the HTTP server reaches the engine and the weights.

The engine does the hard part itself (`dsv4.engine.engine`): any thread may add, abort, step or pause it;
weights change only between steps, once the requests in flight were dealt with per the pause mode
(abort / wait / retract), and every generated token is tagged with the weights version that chose it. The
driver adds only what serving over HTTP needs:

  engine thread   runs the engine's steps in a loop. The routes hand it new requests, and the aborts of
                  clients that went away, through a queue: the event loop never waits for the engine's
                  lock, which a step holds from start to end.
  sinks           every engine request has one (`_Sink`). Whichever thread ran the step (the engine
                  thread, or an admin operation whose "wait" pause runs steps itself), the outputs go to
                  an outbox that the event loop empties into the requests' `OutputStream`s: one wake-up
                  of the loop per burst of outputs, however many streams. Metrics are observed there.
  admin thread    runs the admin operations (pause, resume, weight update sessions, reload, updates from
                  a trainer's transfer group) one at a time, in the order they arrived, so a resume never
                  overtakes the pause sent before it. What they wait for (requests to finish, a trainer's
                  broadcast) blocks that thread only: the event loop keeps answering and the engine
                  thread keeps stepping, except while the update's pause mode holds generation.
  disconnects     `OutputStream.close()` aborts whatever the client left running; the engine thread
                  frees its slots before it runs its next step.

Weights are written only by admin operations, hence only on the admin thread: the weight report, also
taken there, never sees a half-written update.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch

from dsv4.engine.llm import LLM
from dsv4.engine.outputs import RequestOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.sequence import ABORT as FINISH_ABORT
from dsv4.errors import Dsv4Error, WeightsNotReadyError, WeightTransferError
from dsv4.server.errors import ApiError
from dsv4.server.metrics import ServerMetrics
from dsv4.weights.checkpoint import CheckpointDir
from dsv4.weights.refit import WeightUpdateSession

log = logging.getLogger("dsv4.server")

# How long stop() waits for the engine thread to finish its current step and exit.
STOP_JOIN_TIMEOUT_S = 30.0
# The longest the idle engine thread sleeps before it looks at the engine again. New requests and aborts
# wake it at once (they come through its queue), and so does the end of every admin operation; this
# only bounds how late it notices work made runnable by another thread in the middle of one (a weight
# update's "abort" pause ended queued requests, whose final outputs a step must report).
IDLE_POLL_S = 0.05
UPDATE_FAILED_HINT = "send a complete weight update (POST /admin/weights/begin with full=true)"


@dataclass(frozen=True)
class EngineInput:
    """One prompt to generate for: its token ids, sampling params and (when given as text) its text."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass(frozen=True)
class Failed:
    """An engine request that ended in an error instead of outputs."""

    request_id: str
    error: ApiError


class OutputStream:
    """What one HTTP request's engine requests produce, readable on the event loop.

    `next()` returns (index of the engine request, its RequestOutput delta) in arrival order; the last
    output of each engine request has `finished=True`. `close()` must be called when the HTTP request
    ends (normally or not): it aborts whatever is still running, which frees its cache slots.
    """

    def __init__(self, driver: EngineDriver, request_ids: list[str]):
        self._driver = driver
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue[RequestOutput | Failed] = asyncio.Queue()
        self._pending = set(request_ids)
        self._closed = False

    @property
    def done(self) -> bool:
        return not self._pending

    def _put(self, item: RequestOutput | Failed) -> None:
        if not self._closed:  # outputs after close (the final "abort" delta) have no reader
            self._queue.put_nowait(item)

    async def next(self) -> tuple[int, RequestOutput]:
        """The next output of any of this stream's requests.

        Returns:
            (index of the engine request in this stream, its output).

        Raises:
            ApiError: one of the requests failed (the others are aborted by `close()`).
        """
        item = await self._queue.get()
        if isinstance(item, Failed):
            self._pending.discard(item.request_id)
            raise item.error
        if item.finished:
            self._pending.discard(item.request_id)
        return self._index[item.request_id], item

    def close(self) -> None:
        """Abort the requests that have not finished; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._driver._release(self, sorted(self._pending))
        self._pending.clear()


class _Outbox:
    """Outputs on their way from the engine's threads to the event loop. Any thread may `put`; the first
    item of a burst schedules one `_flush` on the loop, which delivers the whole burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[OutputStream, RequestOutput | Failed]] = []

    def put(self, stream: OutputStream, item: RequestOutput | Failed) -> None:
        with self._lock:
            self._items.append((stream, item))
            if len(self._items) > 1:
                return  # a flush is scheduled and has not run yet: it takes this item too
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the event loop is closed (the server is gone): nobody reads any more
            pass

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for stream, item in items:
            stream._put(item)


class _Sink:
    """Where one engine request's outputs go (`Engine.add_request(sink=...)`). Called by whichever thread
    ran the step, under the engine's lock: it only records metrics and posts to the outbox."""

    __slots__ = ("_metrics", "_outbox", "arrival", "failed", "last_token_at", "request_id", "stream", "streamed")

    def __init__(self, request_id: str, stream: OutputStream, streamed: bool, outbox: _Outbox,
                 metrics: ServerMetrics):
        self.request_id = request_id
        self.stream = stream
        self.streamed = streamed  # the engine reports every step's delta (else only the final output)
        self.arrival = time.perf_counter()
        self.last_token_at: float | None = None
        self.failed = False
        self._outbox = outbox
        self._metrics = metrics

    def __call__(self, out: RequestOutput) -> None:
        self._observe(out, time.perf_counter())
        if out.error is not None:  # ended unserved: a failed weight update left the models not READY
            self.fail(ApiError(f"{out.error}; {UPDATE_FAILED_HINT}", status=HTTPStatus.SERVICE_UNAVAILABLE))
        elif not self.failed:
            self._outbox.put(self.stream, out)

    def fail(self, error: ApiError) -> None:
        """Answer the client with `error` instead of outputs (once; later outputs are dropped)."""
        if not self.failed:
            self.failed = True
            self._outbox.put(self.stream, Failed(self.request_id, error))

    def _observe(self, out: RequestOutput, now: float) -> None:
        m = self._metrics
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if self.streamed:
                if self.last_token_at is None:
                    m.time_to_first_token.observe(now - self.arrival)
                else:
                    m.inter_token_latency.observe(now - self.last_token_at)
                self.last_token_at = now
        if out.finished:
            m.e2e_latency.observe(now - self.arrival)
            for c in out.outputs:
                m.finished(c.finish_reason or FINISH_ABORT)


_SUBMIT, _ABORT, _WAKE, _STOP = "submit", "abort", "wake", "stop"


class EngineDriver:
    """Runs the engine loop in its own thread and admin operations in another (module docstring).

    Args:
        llm: the loaded model and its engine.
        metrics: where the loop reports queue sizes, slot use, token counts and latencies.
        max_queued_requests: engine requests that may be queued or running at once; beyond it
            `submit` refuses with 503 (bounds the memory a burst of clients can take).
        weights_root: the directory under which `reload` may read checkpoints (None: reload is off).
    """

    def __init__(self, llm: LLM, metrics: ServerMetrics, max_queued_requests: int,
                 weights_root: Path | None = None):
        self.llm = llm
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.weights_root = weights_root.resolve() if weights_root is not None else None
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._outbox: _Outbox | None = None
        self._thread: threading.Thread | None = None
        # One worker: admin operations run one at a time, in submission order (the executor's queue is FIFO).
        self._admin: concurrent.futures.ThreadPoolExecutor | None = None
        self._live = 0  # engine requests submitted and not yet closed (event-loop side)
        self._session: WeightUpdateSession | None = None  # the session POST /admin/weights/begin opened
        self._transfer_group: dict | None = None  # the trainer's group init_transfer joined (its description)
        self._stopping = False
        self.metrics.cache_slots_total.set(llm.limits.max_num_seqs)
        self._publish_gauges()

    # ---------------------------------------------------------------- event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine and admin threads; outputs are delivered on `loop`."""
        self._outbox = _Outbox(loop)
        self._admin = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-admin")
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the current step, fail what is still queued, and end the engine thread. Admin operations
        not started are cancelled; one under way (a transfer waiting for its trainer) ends by its timeout."""
        if self._thread is None:
            return
        self._admin.shutdown(wait=False, cancel_futures=True)
        self._commands.put((_STOP, None))
        self._thread.join(STOP_JOIN_TIMEOUT_S)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, inputs: list[EngineInput], request_id: str, stream: bool) -> OutputStream:
        """Queue one engine request per input (ids `request_id-<i>`); call from the event loop.

        Args:
            inputs: the prompts.
            request_id: the HTTP request's id.
            stream: report every step's delta (else only the final outputs).

        Returns:
            The stream of their outputs.

        Raises:
            ApiError: 503 when the server is stopping or at its limit of queued requests.
        """
        if not self.alive:
            raise ApiError("the engine is not running", status=HTTPStatus.SERVICE_UNAVAILABLE)
        if self._live + len(inputs) > self.max_queued_requests:
            raise ApiError(
                f"server busy: {self._live} requests queued or running, the limit is {self.max_queued_requests}",
                status=HTTPStatus.SERVICE_UNAVAILABLE,
            )
        ids = [f"{request_id}-{i}" for i in range(len(inputs))]
        out = OutputStream(self, ids)
        self._live += len(ids)
        sinks = [_Sink(rid, out, stream, self._outbox, self.metrics) for rid in ids]
        self._commands.put((_SUBMIT, list(zip(sinks, inputs))))
        return out

    def _release(self, stream: OutputStream, unfinished: list[str]) -> None:
        self._live -= len(stream.request_ids)
        if unfinished:
            self._commands.put((_ABORT, unfinished))

    async def _run_admin(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the admin thread after every admin operation submitted before it."""
        if not self.alive:
            raise ApiError("the engine is not running", status=HTTPStatus.SERVICE_UNAVAILABLE)
        future = self._admin.submit(fn)
        # Whatever it did (resumed, aborted, updated), the engine thread looks again at once.
        future.add_done_callback(lambda _: self._commands.put((_WAKE, None)))
        return await asyncio.wrap_future(future)

    # ---- the operations the admin routes use ----
    async def pause(self, mode: str) -> dict:
        """Pause generation (`LLM.pause_generation(mode)`) until `resume`.

        Args:
            mode: "abort" | "wait" | "retract" (what becomes of the requests in flight).

        Returns:
            The state once paused (`state()`): no sequence running.

        Raises:
            ConfigError: an unknown mode.
        """

        def run():
            self.llm.pause_generation(mode)
            return self._state()

        return await self._run_admin(run)

    async def resume(self) -> dict:
        """End a `pause` (after every admin operation sent before it); returns the state."""

        def run():
            self.llm.resume_generation()
            return self._state()

        return await self._run_admin(run)

    async def begin_weight_update(self, atomic: bool, full: bool, mode: str) -> dict:
        """Open a weight update session (`LLM.begin_weight_update`). A fail-stop (non-atomic) one writes as
        buckets arrive, so generation pauses (per `mode`) from begin until it ends; an atomic one pauses
        only at finish.

        Returns:
            {"version": the version in effect, "atomic", "full"}.

        Raises:
            ApiError: a session is already open (409).
        """

        def run():
            self._require_no_session()
            self._session = self.llm.begin_weight_update(atomic=atomic, full=full, pause=mode)
            return {"version": self.llm.weights_version, "atomic": atomic, "full": full}

        return await self._run_admin(run)

    async def load_weight_bucket(self, tensors: Mapping[str, torch.Tensor]) -> dict:
        """Validate and stage (atomic) or write (fail-stop) one bucket of the open session.

        Returns:
            {"bucket": its number, "tensors": how many it held, "completed": resident tensors it completed}.

        Raises:
            ApiError: no session is open (409).
            WeightUpdateError: a bad tensor; the session is closed (see `dsv4.weights.refit`).
        """

        def run():
            session = self._require_session()
            completed = session.load(tensors, origin=f"bucket {session.buckets + 1}")
            return {"bucket": session.buckets, "tensors": len(tensors), "completed": completed}

        return await self._run_admin(run)

    async def finish_weight_update(self) -> dict:
        """Apply the session: pause per its mode, write (atomic), finalize, bump the version, resume.

        Returns:
            {"version": the version now in effect}.

        Raises:
            ApiError: no session is open (409).
            WeightUpdateError: an incomplete session; it is closed.
        """

        def run():
            session = self._require_session()
            try:
                return {"version": session.finish()}
            finally:
                self._session = None

        return await self._run_admin(run)

    async def abort_weight_update(self) -> dict:
        """Drop the open session; returns the version in effect and whether the weights serve.

        Raises:
            ApiError: no session is open (409).
        """

        def run():
            self._require_session().abort()
            self._session = None
            return {"version": self.llm.weights_version, "ready": self.weights_ready()}

        return await self._run_admin(run)

    async def reload_weights(self, path: Path, mode: str) -> dict:
        """Replace every weight with those of checkpoint directory `path` (already resolved under the
        weights root), in one full atomic session: a bad checkpoint changes nothing. Generation goes on
        while the checkpoint is read; it pauses per `mode` for the write.

        Returns:
            {"version": the version now in effect}.

        Raises:
            ApiError: a session is open (409), or a checkpoint file resolves outside the weights root.
            CheckpointError, WeightUpdateError: an unreadable or incomplete checkpoint.
        """

        def run():
            self._require_no_session()
            checkpoint = CheckpointDir(path)
            outside = [f for f in checkpoint.files if not _is_within(f.resolve(), self.weights_root)]
            if outside:
                raise ApiError(f"reload: {outside[0]} resolves outside the weights root", param="path")
            with self.llm.begin_weight_update(atomic=True, full=True, pause=mode) as session:
                session.load(((name, tensor) for name, tensor, _ in checkpoint.iter_tensors()), origin=str(path))
            return {"version": session.version}

        return await self._run_admin(run)

    async def init_weight_transfer(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                   group_name: str, backend: str, timeout: float | None) -> dict:
        """Join a trainer's transfer group (`LLM.init_weight_transfer`); returns once every member joined
        (the trainer's `WeightSender` blocks likewise), so the trainer may start in either order.

        Returns:
            {"group", "rank", "world_size", "backend", "usable"}.

        Raises:
            ConfigError: a bad argument. WeightTransferError: the trainer unreachable or disagreeing.
        """

        def run():
            self._transfer_group = None  # a failed join leaves no group behind
            self._transfer_group = self.llm.init_weight_transfer(
                master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
            return self._transfer_group

        return await self._run_admin(run)

    async def update_weights_from_distributed(self, metadata: dict, atomic: bool, full: bool, mode: str) -> dict:
        """Receive the update `metadata` plans while the trainer sends it (`LLM.update_weights_from_distributed`).
        Generation goes on while buckets arrive (atomic mode); it pauses per `mode` for the write.

        Returns:
            {"version", "update_id", "buckets", "tensors", "bytes", "seconds", ...}.

        Raises:
            ApiError: no transfer group was joined (409).
            WeightUpdateError: refused (base version, metadata, a session open) or failed; the trainer gets
                the same reason. WeightTransferError: the trainer died or timed out.
        """

        def run():
            if self._transfer_group is None:
                raise ApiError("no weight transfer group: POST /admin/weights/init_transfer first",
                               status=HTTPStatus.CONFLICT)
            try:
                return self.llm.update_weights_from_distributed(metadata, atomic=atomic, full=full, pause=mode)
            except WeightTransferError:  # the group is unusable now: a new init_transfer is needed
                self._transfer_group = {**self._transfer_group, "usable": False}
                raise

        return await self._run_admin(run)

    async def update_weights_from_shared(self, metadata: dict, handle: dict, atomic: bool, full: bool,
                                         mode: str) -> dict:
        """Apply the update a colocated trainer shared (`LLM.update_weights_from_shared`).

        Returns:
            {"version", "update_id", "buckets", "tensors", "bytes", "seconds"}.

        Raises:
            WeightUpdateError: refused (base version, metadata, a handle outside shared memory) or failed.
        """
        return await self._run_admin(lambda: self.llm.update_weights_from_shared(
            metadata, handle, atomic=atomic, full=full, pause=mode))

    async def weight_report(self) -> dict:
        """`LLM.weight_report()`, on the admin thread: never during a weight write."""
        return await self._run_admin(self.llm.weight_report)

    async def state(self) -> dict:
        """paused, weights_version, weights_ready, weight_update_open, running and waiting sequences, the
        transfer group joined. Answered even while an admin operation runs (it waits only for the engine's lock)."""
        return await asyncio.to_thread(self._state)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.llm.engine
        while not self._stopping:
            try:
                self._take_commands(block=not engine.has_runnable_work())
                if engine.has_runnable_work():
                    self._step()
                self._publish_gauges()
            except Exception as exc:  # a bug here must not leave every client waiting on a dead thread
                log.exception("engine driver failed; ending the requests in flight")
                self._fail_engine_requests(ApiError(f"internal error: {type(exc).__name__}: {exc}",
                                                    status=HTTPStatus.INTERNAL_SERVER_ERROR))
        self._shutdown()

    def _take_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == _SUBMIT:
            for sink, x in payload:
                self._add(sink, x)
        elif kind == _ABORT:
            for request_id in payload:
                self.llm.engine.abort(request_id)  # frees its slots now; its final output has no reader
        elif kind == _STOP:
            self._stopping = True

    def _add(self, sink: _Sink, x: EngineInput) -> None:
        try:
            self.llm.engine.add_request(sink.request_id, x.prompt_ids, x.params, x.prompt, stream=sink.streamed,
                                        sink=sink)
        except WeightsNotReadyError as exc:
            sink.fail(ApiError(f"{exc}; {UPDATE_FAILED_HINT}", status=HTTPStatus.SERVICE_UNAVAILABLE))
        except Dsv4Error as exc:  # this request alone cannot be served (RequestError and the like)
            sink.fail(ApiError(str(exc)))
        else:
            self.metrics.prompt_tokens.inc(len(x.prompt_ids))

    def _step(self) -> None:
        try:
            self.llm.engine.step()  # outputs reach their sinks
        except Exception as exc:  # the engine state is unknown: end every request in it, keep serving
            log.exception("engine step failed")
            status = HTTPStatus.SERVICE_UNAVAILABLE if isinstance(exc, Dsv4Error) else HTTPStatus.INTERNAL_SERVER_ERROR
            self._fail_engine_requests(ApiError(f"engine step failed: {type(exc).__name__}: {exc}", status=status))

    def _fail_engine_requests(self, error: ApiError) -> None:
        """Abort every request in the engine (freeing its slots) and answer its client with `error`."""
        engine = self.llm.engine
        with engine.exclusive():
            for request in list(engine.requests.values()):
                engine.abort(request.request_id)
                if isinstance(request.sink, _Sink):
                    request.sink.fail(error)

    def _publish_gauges(self) -> None:
        stats, m = self.llm.engine.stats(), self.metrics
        m.requests_running.set(stats.running)
        m.requests_waiting.set(stats.waiting)
        m.cache_slots_used.set(self.llm.limits.max_num_seqs - stats.free_slots)
        m.weights_version.set(stats.weights_version)
        m.paused.set(int(stats.paused))
        if self.llm.speculation is not None:
            m.observe_speculation(self.llm.engine.speculation)

    def _shutdown(self) -> None:
        error = ApiError("the server is shutting down", status=HTTPStatus.SERVICE_UNAVAILABLE)
        self._fail_engine_requests(error)
        while True:  # requests that arrived after stop
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == _SUBMIT:
                for sink, _ in payload:
                    sink.fail(error)

    # ---- helpers ----
    def _state(self) -> dict:
        stats = self.llm.engine.stats()
        session = self._session
        return {
            "paused": stats.paused,
            "weights_version": stats.weights_version,
            "weights_ready": self.weights_ready(),
            "weight_update_open": session is not None and session.active,
            "running": stats.running,
            "waiting": stats.waiting,
            "transfer_group": self._transfer_group,
        }

    def weights_ready(self) -> bool:
        """Whether every model is READY (a flag read; safe from any thread)."""
        return all(model.ready for model in self.llm.loaded.models.values())

    def _require_session(self) -> WeightUpdateSession:
        if self._session is None or not self._session.active:
            self._session = None
            raise ApiError("no weight update session is open: POST /admin/weights/begin first",
                           status=HTTPStatus.CONFLICT)
        return self._session

    def _require_no_session(self) -> None:
        if self._session is not None and self._session.active:
            raise ApiError(
                f"a weight update session is already open ({self._session.buckets} bucket(s) loaded): "
                f"finish or abort it first", status=HTTPStatus.CONFLICT,
            )


def _is_within(path: Path, root: Path | None) -> bool:
    return root is not None and (path == root or root in path.parents)


def resolve_under(root: Path | None, requested: str) -> Path:
    """The checkpoint directory `requested` (relative to `root`, or absolute) with every symlink
    resolved, if it lies within `root`.

    Raises:
        ApiError: reload is off (no root), or the path is outside the root or not a directory.
    """
    if root is None:
        raise ApiError("reload is off: start the server with --weights-root DIR", param="path")
    root = root.resolve()
    try:
        path = (root / requested).resolve(strict=True)
    except (OSError, RuntimeError, ValueError) as exc:  # missing, a symlink loop, a NUL byte
        raise ApiError(f"path {requested!r}: not found under the weights root ({exc.__class__.__name__})",
                       param="path") from None
    if not _is_within(path, root):
        raise ApiError(f"path {requested!r} resolves outside the weights root", param="path")
    if not path.is_dir():
        raise ApiError(f"path {requested!r} is not a checkpoint directory", param="path")
    # A file of the checkpoint may itself be a symlink that leads out of the root.
    escaping = sorted(entry.name for entry in path.iterdir() if not _is_within(entry.resolve(), root))
    if escaping:
        raise ApiError(f"path {requested!r}: {escaping[0]} resolves outside the weights root", param="path")
    return path
