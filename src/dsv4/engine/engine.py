"""The engine loop: requests in, one forward per step, tokens out.

A step flows through four parts, each in its own file:

  schedule   `Scheduler` (scheduler.py): admit waiting sequences into free cache slots (FIFO), then
             plan the step's chunks within the token budget: one token per decoding sequence (plus
             room for draft tokens when speculating), then chunked prefill.
  forward    `ModelRunner` (model_runner.py): one `ForwardBatch` for all chunks (the step's metadata,
             built once), the compiled decode step or the eager forward, logits of the rows that sample.
  sample     `Sampler` (sampler.py) over the rows' settings, which `SamplingBatch` keeps per cache slot
             and rebuilds only when the batch's composition changes.
  commit     here: append the sampled tokens (stop ids, stop strings, max_tokens, max_model_len),
             advance each sequence's `computed`, finish and free slots, build the outputs.

Shared prompt prefill (`share_prompt_prefill`, on by default): sequences admitted with one prompt prefill
it once; the step that completes the leader's prompt forks its slot state into its followers' slots
(`ModelRunner.fork`, and `Proposer.on_fork` for the drafter's state), and each follower samples its first
token from the leader's last prompt row with its own settings (scheduler.py). A weight update preempts
every running sequence (`weights_updated`), leaders and followers alike, so a fork never copies state
computed under older weights.

Speculation (speculation.py) plugs in between schedule and forward (the `Proposer` drafts tokens for the
room the scheduler left) and in commit (only the accepted prefix plus one token is kept; `computed` and
the cache slot are rewound past the rejected drafts). Preemption (`preempt`, and `pause("retract")`)
takes a running sequence's slot; it keeps its tokens and is recomputed by chunked prefill when admitted
again.

Threads: every public method takes the engine's lock, so any thread may add, abort, step or pause. A
step runs whole under the lock, so weights change only between steps: a weight update holds the lock
while it writes (`exclusive`), after `pause` dealt with the requests in flight:

  abort    every request in flight (running or queued) ends now, finish_reason "abort";
  wait     admission stops (new requests queue) and the running sequences run to their end;
  retract  the running sequences are preempted; after the update they recompute their prompt and
           generated tokens under the new weights and go on.

Every generated token is tagged with the weights version that chose it (`CompletionOutput.weights_versions`).
When several threads may run steps (`pause("wait")` runs them too), give each request a `sink`: outputs
reach it whichever thread made them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from dsv4.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from dsv4.engine.limits import EngineLimits
from dsv4.engine.model_runner import Chunk, ModelRunner, StepResult
from dsv4.engine.outputs import RequestOutput, SpeculationMetrics
from dsv4.engine.request import OutputSink, Request
from dsv4.engine.sampler import Proposal, Sampler, SamplingBatch, prompt_logprobs
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import ScheduledChunk, Scheduler, scores_prompt
from dsv4.engine.sequence import ABORT, LENGTH, STOP, Sequence, SequenceStatus
from dsv4.engine.speculation import Draft, Proposer, accepted_length, capture_layers, end_step
from dsv4.errors import ConfigError, RequestError, WeightsNotReadyError
from dsv4.model.deepseek_v4 import DeepseekV4

PAUSE_ABORT, PAUSE_WAIT, PAUSE_RETRACT = "abort", "wait", "retract"
PAUSE_MODES = (PAUSE_ABORT, PAUSE_WAIT, PAUSE_RETRACT)
# Who holds generation paused: the user (`LLM.pause_generation`) and/or a weight update in progress.
# Admission resumes when nobody does.
USER_HOLD, WEIGHTS_HOLD = "user", "weights"


def check_pause_mode(mode: object) -> str:
    """Returns `mode` if it is one of PAUSE_MODES.

    Raises:
        ConfigError: any other value.
    """
    if mode not in PAUSE_MODES:
        raise ConfigError(f"pause: expected one of {'|'.join(PAUSE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for monitoring: sequences running / waiting, free cache slots, the weights version, and
    whether generation is paused."""

    running: int
    waiting: int
    free_slots: int
    weights_version: int
    paused: bool


@dataclass(slots=True)
class _Work:
    """One scheduled chunk on its way through the step."""

    seq: Sequence
    chunk: Chunk
    draft: Draft
    known: int  # the sequence's own tokens in the chunk (the drafts follow them)
    begin: int  # flat row of the chunk's first token
    samples: bool  # the chunk ends with the sequence's last known token (+ drafts): its rows sample


NO_DRAFT = Draft()


class Engine:
    """Continuous batching over preallocated cache slots (module docstring).

    Args:
        model: the target model.
        limits: slots, step budget, sequence length.
        seed: seed of unseeded sampling.
        eos_token_ids: tokens that end a sequence (unless `ignore_eos`).
        tokenizer: a `tokenizers.Tokenizer` for text and stop strings, or None.
        compile_decode: run pure-decode steps through `StaticDecode` compiled with torch.compile.
        proposer: a drafter for speculative decoding, or None.
        speculation_max_batch: with a proposer, the most decoding sequences a step speculates for
            (None: always speculate); steps with more decode without drafts.
        share_prompt_prefill: sequences admitted with the same prompt (a request's n completions, repeated
            prompts) prefill it once and fork the slot state (scheduler.py, shared prompt prefill); with a
            proposer, only if it can fork its own state (`Proposer.on_fork`).

    Raises:
        ValueError: compile_decode for a model the static step cannot run (e.g. FP8/FP4 routed experts).
    """

    def __init__(
        self, model: DeepseekV4, limits: EngineLimits, seed: int, eos_token_ids: tuple[int, ...], tokenizer=None,
        compile_decode: bool = False, proposer: Proposer | None = None, speculation_max_batch: int | None = None,
        share_prompt_prefill: bool = True,
    ):
        self.limits = limits
        self.runner = ModelRunner(model, limits, compile_decode)  # reserves every cache slot (pages taken as written)
        self.scheduler = Scheduler(limits)
        self.sampling = SamplingBatch(limits.max_num_seqs, self.runner.device)  # a row per cache slot
        self.sampler = Sampler(default_seed=seed, kernels=self.runner.model.kernels)
        self.proposer = proposer
        self.speculation_max_batch = speculation_max_batch
        self.speculation = SpeculationMetrics()  # totals over every verify chunk this engine judged
        self.steps_without_speculation = 0  # steps that decoded without drafts past speculation_max_batch
        self.share_prompt_prefill = share_prompt_prefill
        self.shared_prefills = 0  # sequences whose prompt state was forked from a leader instead of computed
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.requests: dict[str, Request] = {}  # every request not yet reported finished
        self.weights_version = 0
        self._aborted: list[Request] = []  # their final outputs go out with the next step
        self._holds: set[str] = set()  # who paused generation (USER_HOLD, WEIGHTS_HOLD)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified after a step and when work arrives

    # ---- requests ----
    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
        stream: bool = True, sink: OutputSink | None = None,
    ) -> Request:
        """Queue a request (its n sequences).

        Args:
            request_id: unique among the requests in flight.
            prompt_ids: the prompt's token ids.
            params: sampling settings.
            prompt: the prompt text, echoed in outputs.
            stream: report a delta every step it progresses (True) or only its final output (False).
            sink: called with each of its outputs by whichever thread runs the step (see `Request`).

        Returns:
            The queued request.

        Raises:
            RequestError: this request cannot be served (id in use, empty or too long prompt, stop strings
                without a tokenizer); nothing is queued.
            WeightsNotReadyError: a failed weight update left the model unusable.
        """
        with self._lock:
            if request_id in self.requests:
                raise RequestError(f"request {request_id}: id already in use")
            if not prompt_ids:
                raise RequestError(f"request {request_id}: empty prompt")
            if len(prompt_ids) + 1 > self.limits.max_model_len:
                raise RequestError(
                    f"request {request_id}: prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                    f"max_model_len={self.limits.max_model_len}"
                )
            if params.stop and self.tokenizer is None:
                raise RequestError(f"request {request_id}: stop strings need a tokenizer, and this model has none")
            if not self._holds:  # during a weight update the request waits for it instead
                self.runner.require_ready()
            prompt_ids = list(prompt_ids)  # one copy, shared by the n sequences
            seqs = [self._sequence(request_id, i, prompt_ids, params) for i in range(params.n)]
            request = Request(request_id, prompt, prompt_ids, params, seqs, self.weights_version, stream, sink)
            self.requests[request_id] = request
            for seq in seqs:
                self.scheduler.add(seq)
            self._changed.notify_all()
            return request

    def _sequence(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(request_id, index, prompt_ids, params)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            seq.stop_checker = StopStringChecker(params.stop)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its slots; its final delta (finish_reason "abort") comes out of
        the next `step()`.

        Args:
            request_id: the request.

        Returns:
            False if the request is unknown or already finished.
        """
        with self._lock:
            request = self.requests.pop(request_id, None)
            if request is None:
                return False
            for seq in request.seqs:
                if not seq.finished:
                    seq.finish(ABORT)
                self._release(seq)
            self._aborted.append(request)
            self._changed.notify_all()
            return True

    def preempt(self, request_id: str) -> bool:
        """Preempt the request's running sequences: they free their slots, keep their tokens, and go
        back to the front of the waiting queue, to recompute them when admitted again.

        Args:
            request_id: the request.

        Returns:
            False if none of its sequences was running.
        """
        with self._lock:
            request = self.requests.get(request_id)
            running = [] if request is None else [s for s in request.seqs if s.status is SequenceStatus.RUNNING]
            for seq in reversed(running):  # each goes to the front: keep their order
                self._preempt(seq)
            return bool(running)

    def has_work(self) -> bool:
        """Whether any request is in flight (waiting, running, or with a final output still to report)."""
        with self._lock:
            return bool(self.scheduler.waiting or self.scheduler.running or self._aborted)

    def has_runnable_work(self) -> bool:
        """Whether `step()` would do anything now (not so for requests queued while paused)."""
        with self._lock:
            return bool(self._aborted or self.scheduler.running or self.scheduler.can_admit()
                        or (self.requests and self._unservable()))

    def stats(self) -> EngineStats:
        """A consistent snapshot of the engine's occupancy, for monitoring."""
        with self._lock:
            return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                               len(self.scheduler.free_slots), self.weights_version, bool(self._holds))

    # ---- one step ----
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample and commit (module docstring).

        Returns:
            For every streamed request that progressed, its delta; for every request that finished, its
            last delta (`finished=True`). Each also goes to its request's sink.
        """
        with self._lock:
            reported = {r.request_id: r for r in self._aborted}
            self._aborted.clear()
            if self.requests and self._unservable():
                self._fail_all(reported)
            plan = self.scheduler.schedule(self.proposer.num_speculative_tokens if self.proposer else 0,
                                           self.speculation_max_batch, self._shares_prompts())
            self.steps_without_speculation += plan.speculation_off
            for seq in plan.admitted:
                self.sampling.add(seq.slot, seq.params, seq.seed)
            if plan.chunks:
                work = self._prepare(plan.chunks)
                verify = [i for i, w in enumerate(work) if w.draft.token_ids]
                chunks, captured = [w.chunk for w in work], capture_layers(self.proposer)
                # Every sampling row greedy: the step may hand the sampler their argmax (StepResult.argmax).
                greedy = all(w.seq.params.greedy for w in work if w.samples)
                with self.runner.step_threads(chunks, captured, greedy):  # the sampling on the forward's threads
                    result = self.runner.execute(chunks, self._logit_rows(work), verify, captured, greedy)
                    forks = dict(plan.forks)
                    self._score_prompts(work, result, forks)
                    self._commit(work, result, reported, forks)
                if self.proposer is not None:
                    end_step(self.proposer)
            outputs = []
            for request in reported.values():
                outputs.append(request.output(delta=True))
                if request.finished:
                    self.requests.pop(request.request_id, None)
                if request.sink is not None:  # under the lock: deltas reach a sink in step order
                    request.sink(outputs[-1])
            self._changed.notify_all()
            return outputs

    def step_or_wait(self, timeout: float) -> list[RequestOutput]:
        """`step()` if it has anything to do, else wait for a change (a step by another thread, a new
        request, an abort, a resume): the loop of a thread that drives the engine.

        Args:
            timeout: the longest wait in seconds.

        Returns:
            The step's outputs, or none after a wait.
        """
        with self._lock:
            if not self.has_runnable_work():
                self._changed.wait(timeout)
                return []
        return self.step()

    def _prepare(self, chunks: tuple[ScheduledChunk, ...]) -> list[_Work]:
        """Each chunk's tokens, with the proposer's drafts appended to verify chunks."""
        verifying = [c for c in chunks if c.max_drafts > 0]
        proposed = []
        if verifying:
            proposed = self.proposer.propose([c.seq for c in verifying], [c.max_drafts for c in verifying])
        if len(proposed) != len(verifying):
            raise ValueError(f"{type(self.proposer).__name__}.propose returned {len(proposed)} drafts for "
                             f"{len(verifying)} sequences")
        proposed = iter(proposed)
        work, row = [], 0
        for c in chunks:
            seq, start, known = c.seq, c.seq.computed, c.num_tokens
            tokens = seq.tokens(start, start + known)
            draft = NO_DRAFT
            if c.max_drafts > 0:
                draft = next(proposed)
                if len(draft.token_ids) > c.max_drafts:
                    probs = None if draft.probs is None else draft.probs[: c.max_drafts]
                    draft = Draft(list(draft.token_ids[: c.max_drafts]), probs)
                tokens = tokens + list(draft.token_ids)
            samples = start + known == len(seq.prompt_ids) + len(seq.output_ids)  # reaches the last token
            work.append(_Work(seq, Chunk(seq.slot, tokens, start), draft, known, row, samples))
            row += len(tokens)
        return work

    @staticmethod
    def _logit_rows(work: list[_Work]) -> list[int]:
        """The rows that sample: the last known token of each sampling chunk, then its drafts' rows."""
        rows = []
        for w in work:
            if w.samples:
                last = w.begin + w.known - 1
                if w.draft.token_ids:
                    rows.extend(range(last, last + 1 + len(w.draft.token_ids)))
                else:
                    rows.append(last)
        return rows

    def _score_prompts(self, work: list[_Work], result: StepResult,
                       forks: dict[Sequence, tuple[Sequence, ...]]) -> None:
        """Prompt logprobs of the prompt chunks of requests that asked for them (first completion only:
        the n sequences share the prompt), for the chunk's sequence and for the followers of its shared
        prompt prefill (the same streams; each with its own request's settings)."""
        for w in work:
            if w.chunk.start >= len(w.seq.prompt_ids):
                continue
            streams = result.streams[w.begin : w.begin + w.known]
            for seq in (w.seq, *self.scheduler.followers(w.seq), *forks.get(w.seq, ())):
                request = self.requests[seq.request_id]
                if scores_prompt(seq) and request.prompt_logprobs is None:
                    self._score_prompt_chunk(request, seq, w.chunk.start, streams)

    def _score_prompt_chunk(self, request: Request, seq: Sequence, start: int, streams: torch.Tensor) -> None:
        """Prompt logprobs for the chunk starting at `start`: row t predicts prompt token t+1."""
        n_prompt = len(seq.prompt_ids)
        rows = min(streams.shape[0], n_prompt - 1 - start)  # the last prompt row predicts an output token
        params = seq.params
        parts = []
        if rows > 0:
            logits = self.runner.logits(streams[:rows])
            next_ids = torch.tensor(seq.prompt_ids[start + 1 : start + 1 + rows], device=logits.device)
            parts = prompt_logprobs(logits, next_ids, params.prompt_logprobs, params.logprobs_mode, params)
            parts = parts if start == 0 else parts[1:]  # the leading None belongs to prompt token 0 only
        elif start == 0:
            parts = [None]
        request.prompt_logprobs_parts.extend(parts)
        if start + streams.shape[0] >= n_prompt:
            request.prompt_logprobs = request.prompt_logprobs_parts

    def _commit(self, work: list[_Work], result: StepResult, reported: dict[str, Request],
                forks: dict[Sequence, tuple[Sequence, ...]]) -> None:
        """Sample the sampling rows, keep each verify chunk's accepted prefix plus one token, advance
        `computed` (rewinding slots past rejected drafts), fork completed shared prompts into their
        followers' slots, and note the requests to report."""
        sampling = [w for w in work if w.samples]
        tokens: list[int] = []
        logprobs: list = []
        if sampling:
            slots, indices = [], []  # per row: the sequence's slot, the index of the token it samples
            proposals: list[Proposal | None] = []  # per row: the draft it judges (rows of drafts with q)
            for w in sampling:
                generated = len(w.seq.output_ids)
                drafts = w.draft.token_ids
                rows = 1 + len(drafts)
                slots.extend([w.seq.slot] * rows)
                indices.extend(range(generated, generated + rows))
                if w.draft.probs is not None:
                    proposals.extend(Proposal(t, q) for t, q in zip(drafts, w.draft.probs))
                    proposals.append(None)  # the last row: the bonus token
                else:
                    proposals.extend([None] * rows)
                # A follower's first token, from the leader's last prompt row (no lookup in a step without forks)
                for follower in forks.get(w.seq, ()) if forks else ():
                    slots.append(follower.slot)
                    indices.append(0)
                    proposals.append(None)
            logits, argmax = result.logits, result.argmax
            if forks:
                logits = logits.index_select(0, torch.tensor(self._fork_rows(sampling, forks), device=logits.device))
                argmax = None  # of the step's rows, not of the followers' repeats
            out = self.sampler.sample_rows(logits, self.sampling.rows(slots), indices,
                                           proposals if any(p is not None for p in proposals) else None,
                                           argmax=argmax)
            tokens, logprobs = out.token_ids.tolist(), out.logprobs
        rewinds: dict[int, int] = {}  # slot -> positions kept, for slots past rejected drafts
        row = 0
        for w in work:
            seq, start = w.seq, w.chunk.start
            if not w.samples:
                seq.computed += w.known
                if self.proposer is not None:
                    self._report_commit(seq, start, result, w.begin, w.begin + w.known)
                continue
            followers = forks.get(seq, ()) if forks else ()
            if followers:  # before the leader's token: a leader that stops at it frees its slot
                self._fork(seq, followers, start)
            drafts = w.draft.token_ids
            sampled = tokens[row : row + 1 + len(drafts)]
            kept = accepted_length(sampled, drafts) if drafts else 0
            if drafts:
                seq.speculation = (seq.speculation or SpeculationMetrics()).add(len(drafts), kept)
                self.speculation = self.speculation.add(len(drafts), kept)
            seq.computed = start + w.known + kept
            for i in range(kept + 1):
                self._append(seq, sampled[i], logprobs[row + i])
                if seq.finished:
                    break
            row += 1 + len(drafts)
            if not seq.finished:
                if kept < len(drafts):
                    rewinds[seq.slot] = seq.computed
                if self.proposer is not None:
                    self._report_commit(seq, start, result, w.begin, w.begin + w.known + kept)
            self._note_progress(seq, reported)
            for follower in followers:  # as if it had computed the leader's chunks itself
                follower.computed = start + w.known
                self._append(follower, tokens[row], logprobs[row])
                row += 1
                if not follower.finished and self.proposer is not None:
                    self._report_commit(follower, start, result, w.begin, w.begin + w.known)
                self._note_progress(follower, reported)
        if rewinds:
            self.runner.rewind(rewinds)

    @staticmethod
    def _fork_rows(sampling: list[_Work], forks: dict[Sequence, tuple[Sequence, ...]]) -> list[int]:
        """Per sampled row (`_commit`'s order), its row of the step's logits: a chunk's own rows, then one
        row per follower of a completed shared prompt, which repeats its leader's last row."""
        rows, logit_row = [], 0
        for w in sampling:
            own = 1 + len(w.draft.token_ids)
            rows.extend(range(logit_row, logit_row + own))
            rows.extend([logit_row] * len(forks.get(w.seq, ())))  # a leader's chunk has no drafts
            logit_row += own
        return rows

    def _fork(self, leader: Sequence, followers: tuple[Sequence, ...], start: int) -> None:
        """The leader's prompt is in its slot: copy that state into each follower's slot, and the
        proposer's state of the positions before the leader's last chunk (that chunk's commit follows
        for each follower, `_commit`)."""
        self.runner.fork(leader.slot, [f.slot for f in followers], len(leader.prompt_ids))
        if self.proposer is not None:
            self.proposer.on_fork(leader, followers, start)
        self.shared_prefills += len(followers)

    def _note_progress(self, seq: Sequence, reported: dict[str, Request]) -> None:
        """`seq` chose tokens this step: tag its request with the weights version, report it if due."""
        request = self.requests[seq.request_id]
        request.weights_version = self.weights_version  # it chose tokens: versions only grow
        if request.stream or request.finished:
            reported[request.request_id] = request

    def _report_commit(self, seq: Sequence, start: int, result: StepResult, begin: int, end: int) -> None:
        """Tell the proposer that rows [begin, end) of the step, `seq`'s positions from `start`, are final,
        with their captured layers' streams when it asked for any (`Proposer.capture_layers`)."""
        streams = result.streams[begin:end]
        if not result.captured:
            self.proposer.on_commit(seq, start, streams)
            return
        captured = {layer: layer_streams[begin:end] for layer, layer_streams in result.captured.items()}
        self.proposer.on_commit(seq, start, streams, captured=captured)

    def _append(self, seq: Sequence, token: int, logprobs) -> None:
        """Record a sampled token and apply the stop conditions."""
        seq.append(token, logprobs, self.weights_version)
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self._finish(seq, STOP, token)
            return
        stop = seq.add_text(token)
        if stop is not None:
            self._finish(seq, STOP, stop)
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            self._finish(seq, LENGTH)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish(reason, stop_reason)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Free what an ended sequence held: its slot (emptied), its sampling row, the proposer's state."""
        if seq.slot is not None:
            self._vacate(seq)
        self._rescore_followers(seq)
        self.scheduler.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._vacate(seq)
        self._rescore_followers(seq)
        self.scheduler.preempt(seq)
        request = self.requests[seq.request_id]
        if seq.index == 0 and request.prompt_logprobs is None:
            request.prompt_logprobs_parts.clear()  # scored again, whole, when it is recomputed

    def _rescore_followers(self, seq: Sequence) -> None:
        """`seq` leaves before its shared prompt forked: its heir prefills the prompt from position 0, so the
        prompt logprobs its chunks scored for the followers are scored again (scheduler.py)."""
        for follower in self.scheduler.followers(seq):
            request = self.requests.get(follower.request_id)
            if scores_prompt(follower) and request is not None and request.prompt_logprobs is None:
                request.prompt_logprobs_parts.clear()

    def _vacate(self, seq: Sequence) -> None:
        """`seq` leaves its slot: the slot holds no position any more (its next sequence starts at 0)."""
        self.runner.rewind({seq.slot: 0})
        self.sampling.remove(seq.slot)
        if self.proposer is not None:
            self.proposer.on_release(seq)

    def _shares_prompts(self) -> bool:
        """Whether newly admitted sequences may follow a leader's prefill: on, and any proposer can fork."""
        return self.share_prompt_prefill and (self.proposer is None or hasattr(self.proposer, "on_fork"))

    def _unservable(self) -> bool:
        """The weights are not READY and no weight update is under way to fix them."""
        return not self.runner.ready and WEIGHTS_HOLD not in self._holds

    def _fail_all(self, reported: dict[str, Request]) -> None:
        """End every request with an error: a failed weight update left the model unusable."""
        try:
            self.runner.require_ready()
            return
        except WeightsNotReadyError as exc:  # it names the model
            message = str(exc)
        for request in list(self.requests.values()):
            request.error = message
            for seq in request.seqs:
                if not seq.finished:
                    seq.finish(ABORT)
                self._release(seq)
            reported[request.request_id] = request

    # ---- pausing, for weight updates ----
    @property
    def paused(self) -> bool:
        return bool(self._holds)

    def pause(self, mode: str, hold: str = USER_HOLD) -> None:
        """Stop admitting sequences and deal with those in flight per `mode` (module docstring); returns
        once none is running. "wait" runs steps itself until then (other threads may too). If generation
        is already paused, the first pause decided what became of the requests in flight (retracted ones
        wait to resume): this one joins it and only waits for any sequence still running.

        Args:
            mode: "abort" | "wait" | "retract".
            hold: who pauses (generation resumes when every holder called `resume`).

        Raises:
            ConfigError: an unknown mode.
        """
        check_pause_mode(mode)
        with self._lock:
            joining = bool(self._holds)
            self._holds.add(hold)
            self.scheduler.admitting = False
            if not joining and mode == PAUSE_ABORT:
                for request_id in list(self.requests):
                    self.abort(request_id)
            elif not joining and mode == PAUSE_RETRACT:
                for seq in reversed(list(self.scheduler.running)):
                    self._preempt(seq)
            self._changed.notify_all()
        while True:
            with self._lock:
                if not self.scheduler.running:
                    return
            self.step()

    def resume(self, hold: str = USER_HOLD) -> None:
        """End `hold`'s pause; admission restarts when no one else holds one.

        Args:
            hold: who paused (USER_HOLD, WEIGHTS_HOLD).
        """
        with self._lock:
            self._holds.discard(hold)
            self.scheduler.admitting = not self._holds
            self._changed.notify_all()

    def exclusive(self) -> threading.RLock:
        """The engine's lock, as a context manager: no step runs while it is held (weight writes)."""
        return self._lock

    def weights_updated(self) -> int:
        """Called once new weights are in place (under `exclusive`). A sequence still running would
        continue a cache computed with the old weights: it is preempted, to recompute under the new ones.

        Returns:
            The new weights version.
        """
        with self._lock:
            self.weights_version += 1
            for seq in reversed(list(self.scheduler.running)):
                self._preempt(seq)
            return self.weights_version

    # ---- scoring ----
    @torch.inference_mode()
    def forward_logprobs(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, fp32 [len, vocab] next-token log-distributions, computed between steps in a
        scratch cache (`ModelRunner.forward_logprobs`).

        Args:
            token_ids: the sequences.

        Returns:
            One [len, V] tensor per sequence.

        Raises:
            WeightsNotReadyError: the weights are not READY.
        """
        with self._lock:
            return self.runner.forward_logprobs(token_ids, self.limits.max_num_batched_tokens)
