"""The engine driver: the only code of the server that touches the engine and the weights.

The engine and the weights are not thread-safe, and a weight update must never meet a forward. So one
thread, the engine thread, makes every engine and weight call, in a loop:

    take commands -> advance the control queue -> admit held requests -> one engine step -> publish

Everything else crosses into it through a thread-safe command queue, and results come back through
futures (control operations) or per-request output streams (generation), delivered onto the asyncio
event loop once per step. Because weights change only on this thread, between steps, no forward ever
runs on half-updated weights.

Control operations (pause, resume, weight-session steps, reload) run strictly in the order they arrive.
One that needs the engine to itself names a pause mode and is "quiescing": from the moment it reaches
the head of the queue no new request is admitted, and

    abort    requests in flight are aborted (their streams end with finish_reason "abort");
    wait     requests in flight run to completion;
    retract  (needs engine preemption, not in this engine yet) requests in flight would be preempted and,
             after the operation, recomputed under the new weights.

and the operation runs once the engine is empty. Requests that arrive meanwhile are held in the driver
and admitted when nothing holds generation any more (no explicit pause, no fail-stop weight session,
no quiescing operation queued). As the weights only ever change while the engine is empty, every
request runs on one weights version from its first token to its last.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch

from dsv4.engine.llm import LLM
from dsv4.engine.request import ABORT as FINISH_ABORT
from dsv4.engine.request import RequestOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.errors import Dsv4Error, WeightsNotReadyError
from dsv4.server.errors import ApiError
from dsv4.server.metrics import ServerMetrics
from dsv4.weights.checkpoint import CheckpointDir
from dsv4.weights.refit import WeightUpdateSession

log = logging.getLogger("dsv4.server")

ABORT, WAIT, RETRACT = "abort", "wait", "retract"
PAUSE_MODES = (ABORT, WAIT, RETRACT)
# How long stop() waits for the engine thread to finish its current step and exit.
STOP_JOIN_TIMEOUT_S = 30.0


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
        self._queue.put_nowait(item)

    async def next(self) -> tuple[int, RequestOutput]:
        """The next output of any of this stream's requests.

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


@dataclass(eq=False)
class _Tracked:
    """An engine request as the engine thread follows it."""

    request_id: str
    input: EngineInput
    stream: OutputStream
    streamed: bool  # the engine reports every step's delta (else only the final output)
    arrival: float
    last_token_at: float | None = None


@dataclass(eq=False)
class _Control:
    run: Callable[[], Any]
    quiesce: str | None  # the pause mode it needs, or None when it does not need the engine to itself
    future: concurrent.futures.Future
    started: bool = False


@dataclass
class _Commands:
    """What crosses into the engine thread (a thread-safe FIFO)."""

    queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def put(self, kind: str, payload: Any = None) -> None:
        self.queue.put((kind, payload))


_SUBMIT, _ABORT, _CONTROL, _CALL, _STOP = "submit", "abort", "control", "call", "stop"


class EngineDriver:
    """Runs the engine loop in its own thread; the server's only way to the engine and the weights.

    Args:
        llm: the loaded model and its engine (used from the engine thread only, once started).
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
        self._commands = _Commands()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live = 0  # engine requests submitted and not yet closed (event-loop side)
        # ---- engine-thread state ----
        self._tracked: dict[str, _Tracked] = {}
        self._held: deque[_Tracked] = deque()  # submitted, not yet added to the engine
        self._controls: deque[_Control] = deque()
        self._paused = False  # by an explicit /admin/pause
        self._session: WeightUpdateSession | None = None
        # The pause mode of the weight session begun last (set on the event loop once begin succeeded):
        # how its finish takes the engine.
        self._update_mode = WAIT
        self._stopping = False
        self.metrics.cache_slots_total.set(llm.limits.max_num_seqs)
        self.metrics.weights_version.set(llm.weights_version)

    # ---------------------------------------------------------------- event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on `loop`."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the current step, fail what is still queued, and end the engine thread."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(STOP_JOIN_TIMEOUT_S)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, inputs: list[EngineInput], request_id: str, stream: bool) -> OutputStream:
        """Queue one engine request per input (ids `request_id-<i>`); call from the event loop.

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
        now = time.perf_counter()
        self._live += len(ids)
        self._commands.put(_SUBMIT, [_Tracked(rid, x, out, stream, now) for rid, x in zip(ids, inputs)])
        return out

    def _release(self, stream: OutputStream, unfinished: list[str]) -> None:
        self._live -= len(stream.request_ids)
        if unfinished:
            self._commands.put(_ABORT, unfinished)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between two steps (not ordered with control operations)."""
        return await self._await(_CALL, fn)

    async def control(self, fn: Callable[[], Any], quiesce: str | None = None) -> Any:
        """Run `fn` on the engine thread in control-queue order; with `quiesce` (a pause mode), only
        once in-flight requests are aborted / finished and while no request runs."""
        if quiesce is not None:
            check_pause_mode(quiesce)
        return await self._await(_CONTROL, _Control(fn, quiesce, concurrent.futures.Future()))

    async def _await(self, kind: str, payload: Any) -> Any:
        if not self.alive:
            raise ApiError("the engine is not running", status=HTTPStatus.SERVICE_UNAVAILABLE)
        future = payload.future if isinstance(payload, _Control) else concurrent.futures.Future()
        self._commands.put(kind, payload if isinstance(payload, _Control) else (payload, future))
        return await asyncio.wrap_future(future)

    # ---- the operations the routes use ----
    async def pause(self, mode: str) -> dict:
        """Stop generation once in-flight requests are handled per `mode`; held until `resume`.

        Returns:
            The driver state once paused (`state()`).

        Raises:
            ApiError: an unknown or unsupported mode.
        """

        def run():
            self._paused = True
            return self._state()

        return await self.control(run, quiesce=mode)

    async def resume(self) -> dict:
        """End an explicit pause (after every control operation queued before it); returns the state."""

        def run():
            self._paused = False
            return self._state()

        return await self.control(run)

    async def begin_weight_update(self, atomic: bool, full: bool, mode: str) -> dict:
        """Open a weight update session. A fail-stop (non-atomic) one writes as buckets arrive, so it
        pauses generation (per `mode`) from begin until it ends; an atomic one only at finish.

        Returns:
            {"version": the version in effect, "atomic", "full"}.

        Raises:
            ApiError: a session is already open (409), or a bad mode.
        """
        check_pause_mode(mode)

        def run():
            self._require_no_session()
            self._session = self.llm.begin_weight_update(atomic=atomic, full=full)
            return {"version": self.llm.weights_version, "atomic": atomic, "full": full}

        began = await self.control(run, quiesce=None if atomic else mode)
        self._update_mode = mode
        return began

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

        return await self.control(run)

    async def finish_weight_update(self) -> dict:
        """Apply the session (atomic) and finalize, once the engine is empty (the session's pause mode).

        Returns:
            {"version": the version now in effect}.

        Raises:
            ApiError: no session is open (409).
            WeightUpdateError: an incomplete session; it is closed.
        """

        def run():
            session = self._require_session()
            try:
                version = session.finish()
            finally:
                self._session = None
            self.metrics.weights_version.set(version)
            return {"version": version}

        return await self.control(run, quiesce=self._update_mode)

    async def abort_weight_update(self) -> dict:
        """Drop the open session; returns the version in effect and whether the weights serve.

        Raises:
            ApiError: no session is open (409).
        """

        def run():
            session = self._require_session()
            session.abort()
            self._session = None
            return {"version": self.llm.weights_version, "ready": self.weights_ready()}

        return await self.control(run)

    async def reload_weights(self, path: Path, mode: str) -> dict:
        """Replace every weight with those of checkpoint directory `path` (already resolved under the
        weights root), in one full atomic session: a bad checkpoint changes nothing.

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
            with self.llm.begin_weight_update(atomic=True, full=True) as session:
                session.load(((name, tensor) for name, tensor, _ in checkpoint.iter_tensors()), origin=str(path))
            self.metrics.weights_version.set(session.version)
            return {"version": session.version}

        return await self.control(run, quiesce=mode)

    async def weight_report(self) -> dict:
        """`LLM.weight_report()`, taken between two engine steps."""
        return await self.call(self.llm.weight_report)

    async def state(self) -> dict:
        """paused, weights_version, weights_ready, weight_update_open, running and held request counts."""
        return await self.call(self._state)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        engine = self.llm.engine
        while not self._stopping:
            try:
                # Block only when nothing can progress without a new command: no engine work, and no
                # control operation (one waiting for the engine to empty can run as soon as it is empty).
                self._take_commands(block=not engine.has_work() and not self._controls)
                self._advance_controls()
                self._admit()
                if engine.has_work():
                    self._step()
                self._publish_gauges()
            except Exception as exc:  # a bug here must not leave every client waiting on a dead thread
                log.exception("engine driver failed; ending the requests in flight")
                self._fail_engine_requests(ApiError(f"internal error: {type(exc).__name__}: {exc}",
                                                    status=HTTPStatus.INTERNAL_SERVER_ERROR))
                self._fail_all(list(self._held), ApiError("internal error", status=HTTPStatus.INTERNAL_SERVER_ERROR))
        self._shutdown()

    def _take_commands(self, block: bool) -> None:
        try:
            item = self._commands.queue.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._commands.queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == _SUBMIT:
            for tracked in payload:
                self._tracked[tracked.request_id] = tracked
                self._held.append(tracked)
        elif kind == _ABORT:
            for rid in payload:
                self._abort(rid)
        elif kind == _CONTROL:
            self._controls.append(payload)
        elif kind == _CALL:
            fn, future = payload
            _resolve(future, fn)
        elif kind == _STOP:
            self._stopping = True

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        if tracked in self._held:
            self._held.remove(tracked)
        else:
            self.llm.engine.abort(request_id)  # frees its slots now; its final output is dropped
        self.metrics.finished(FINISH_ABORT)

    def _generation_held(self) -> bool:
        fail_stop_session = self._session is not None and self._session.active and not self._session.atomic
        return self._paused or fail_stop_session or any(c.quiesce is not None for c in self._controls)

    def _admit(self) -> None:
        if not self._held or self._generation_held():
            return
        if not self.weights_ready():
            error = ApiError(
                str(WeightsNotReadyError("weights are not ready: a weight update failed after writing; "
                                         "send a complete update (weights/begin with full=true)")),
                status=HTTPStatus.SERVICE_UNAVAILABLE,
            )
            self._fail_all(list(self._held), error)
            return
        engine, version = self.llm.engine, self.llm.weights_version
        while self._held:
            tracked = self._held.popleft()
            x = tracked.input
            try:
                engine.add_request(tracked.request_id, x.prompt_ids, x.params, x.prompt, version,
                                   stream=tracked.streamed)
            except Dsv4Error as exc:  # this request alone cannot be served (RequestError and the like)
                self._fail_all([tracked], ApiError(str(exc)))
                continue
            self.metrics.prompt_tokens.inc(len(x.prompt_ids))

    def _advance_controls(self) -> None:
        engine = self.llm.engine
        while self._controls:
            op = self._controls[0]
            if not op.started:
                op.started = True
                if op.quiesce == ABORT:
                    for rid in list(engine.requests):  # their final outputs (finish_reason "abort") go out
                        engine.abort(rid)
            if op.quiesce is not None and engine.has_work():
                return  # wait: requests still run (or aborted ones still have to report)
            self._controls.popleft()
            _resolve(op.future, op.run)
            self.metrics.paused.set(int(self._paused))

    def _step(self) -> None:
        try:
            outputs = self.llm.engine.step()
        except Exception as exc:  # the engine state is unknown: end every request in it, keep serving
            log.exception("engine step failed")
            status = HTTPStatus.SERVICE_UNAVAILABLE if isinstance(exc, Dsv4Error) else HTTPStatus.INTERNAL_SERVER_ERROR
            self._fail_engine_requests(ApiError(f"engine step failed: {type(exc).__name__}: {exc}", status=status))
            return
        self._dispatch(outputs)

    def _fail_engine_requests(self, error: ApiError) -> None:
        """Abort every request in the engine (freeing its slots) and answer its client with `error`."""
        engine = self.llm.engine
        in_engine = [t for rid, t in self._tracked.items() if rid in engine.requests]
        for rid in list(engine.requests):
            engine.abort(rid)
        self._fail_all(in_engine, error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        batch: list[tuple[OutputStream, RequestOutput | Failed]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted by its client
            self._observe(tracked, out, now)
            batch.append((tracked.stream, out))
            if out.finished:
                del self._tracked[out.request_id]
        self._deliver(batch)

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        m = self.metrics
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if tracked.streamed:
                if tracked.last_token_at is None:
                    m.time_to_first_token.observe(now - tracked.arrival)
                else:
                    m.inter_token_latency.observe(now - tracked.last_token_at)
                tracked.last_token_at = now
        if out.finished:
            m.e2e_latency.observe(now - tracked.arrival)
            for c in out.outputs:
                m.finished(c.finish_reason or FINISH_ABORT)

    def _fail_all(self, tracked: list[_Tracked], error: ApiError) -> None:
        for t in tracked:
            self._tracked.pop(t.request_id, None)
            if t in self._held:
                self._held.remove(t)
        self._deliver([(t.stream, Failed(t.request_id, error)) for t in tracked])

    def _deliver(self, batch: list[tuple[OutputStream, RequestOutput | Failed]]) -> None:
        """One hop onto the event loop per step, whatever the number of outputs."""
        if batch and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _publish_gauges(self) -> None:
        engine, m = self.llm.engine, self.metrics
        m.requests_running.set(len({seq.request_id for seq in engine.running}))
        m.requests_waiting.set(len({seq.request_id for seq in engine.waiting}) + len(self._held))
        m.cache_slots_used.set(self.llm.limits.max_num_seqs - len(engine.free_slots))

    def _shutdown(self) -> None:
        error = ApiError("the server is shutting down", status=HTTPStatus.SERVICE_UNAVAILABLE)
        for rid in list(self.llm.engine.requests):
            self.llm.engine.abort(rid)
        self._fail_all(list(self._tracked.values()), error)
        while self._controls:
            self._controls.popleft().future.set_exception(error)
        while True:  # commands that arrived after stop
            try:
                kind, payload = self._commands.queue.get_nowait()
            except queue.Empty:
                break
            if kind == _CONTROL:
                payload.future.set_exception(error)
            elif kind == _CALL:
                payload[1].set_exception(error)
            elif kind == _SUBMIT:
                self._fail_all(payload, error)

    # ---- helpers (engine thread) ----
    def _state(self) -> dict:
        session = self._session
        return {
            "paused": self._paused,
            "weights_version": self.llm.weights_version,
            "weights_ready": self.weights_ready(),
            "weight_update_open": session is not None and session.active,
            "running": len(self.llm.engine.requests),
            "held": len(self._held),
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


def check_pause_mode(mode: str) -> None:
    """Raises ApiError for a mode this engine cannot honour."""
    if mode not in PAUSE_MODES:
        raise ApiError(f"mode must be one of {PAUSE_MODES}, got {mode!r}", param="mode")
    if mode == RETRACT:
        raise ApiError(
            "mode 'retract' needs engine preemption (recompute after the update), which this engine does not "
            "have yet; use 'wait' (in-flight requests finish first) or 'abort'", param="mode",
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


def _resolve(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except Exception as exc:  # delivered to the awaiting route, which answers with it
        if not isinstance(exc, Dsv4Error):
            log.exception("engine-thread operation failed")
        future.set_exception(exc)


def _put_all(batch: list[tuple[OutputStream, RequestOutput | Failed]]) -> None:
    for stream, item in batch:
        stream._put(item)
