"""`LLM`: the user-facing facade. Loads a checkpoint (or the embedded default) and generates."""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from dsv4.config import ModelConfig
from dsv4.embedded import resolve_model
from dsv4.engine.chat_template import ChatTemplate
from dsv4.engine.engine import PAUSE_ABORT, USER_HOLD, WEIGHTS_HOLD, Engine, check_pause_mode
from dsv4.engine.limits import EngineLimits
from dsv4.engine.outputs import RequestOutput
from dsv4.engine.request import OutputSink, Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.speculation import DEFAULT_SPECULATION_MAX_BATCH, Proposer, SpeculationConfig
from dsv4.engine.tokenizer import load_tokenizer
from dsv4.engine.validation import (
    check_llm_arguments,
    check_path,
    check_prompt_ids,
    check_weight_pairs,
    normalize_conversations,
    normalize_prompts,
    normalize_sampling_params,
    normalize_token_sequences,
    require_bool,
    require_str,
)
from dsv4.errors import ConfigError, RequestError, WeightUpdateError
from dsv4.kernels.registry import KernelRegistry
from dsv4.parallel.launch import join_group, require_agreement
from dsv4.parallel.state import DEFAULT_TIMEOUT_S, ParallelState
from dsv4.progress import Progress
from dsv4.weights.loader import LoadedModels, load_models
from dsv4.weights.refit import Bucket, WeightUpdateSession

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Prompt = str | Seq[int]
# How long a thread waiting for its requests sleeps between checks when it has no step to run (another
# thread is stepping, or generation is paused): it is woken as soon as anything changes, so this only
# bounds the wait after a missed wake-up.
IDLE_WAIT_S = 0.05


#: k of the MTP drafter when `LLM(draft="mtp")` leaves num_speculative_tokens unset.
DEFAULT_MTP_TOKENS = 3


def build_mtp_proposer(
    loaded: LoadedModels, limits: EngineLimits, num_speculative_tokens: int | None, seed: int, compile_decode: bool
) -> Proposer:
    """The MTP layer of the checkpoint as the drafter (engine/mtp_proposer.py); it reads only the target's
    last streams, which the compiled decode step returns too, so `compile_decode` changes nothing here."""
    from dsv4.engine.mtp_proposer import MTPProposer

    k = DEFAULT_MTP_TOKENS if num_speculative_tokens is None else num_speculative_tokens
    return MTPProposer(loaded.models["mtp"], limits, k, seed)


def build_dspark_drafting(
    loaded: LoadedModels, limits: EngineLimits, num_speculative_tokens: int | None, seed: int, compile_decode: bool
) -> Proposer:
    """The DSpark drafter (engine/dspark_proposer.py); k None verifies up to its whole block."""
    from dsv4.engine.dspark_proposer import build_dspark_proposer

    return build_dspark_proposer(loaded, limits, num_speculative_tokens, seed, compile_decode=compile_decode)


#: `LLM(draft=name)` -> how to build its proposer from the loaded models, the engine's limits, k (None: the
#: drafter's default), the seed and whether decode steps are compiled.
PROPOSER_BUILDERS = {"mtp": build_mtp_proposer, "dspark": build_dspark_drafting}


def resolve_dtype(dtype: str, cfg: ModelConfig) -> torch.dtype:
    """"auto": the checkpoint's float dtype when it is fp32 or bf16, otherwise bf16."""
    if dtype == "auto":
        return torch.float32 if cfg.torch_dtype in ("float32", "fp32") else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of auto|{'|'.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_activation_dtype(activation_dtype: str | None, dtype: torch.dtype) -> torch.dtype:
    """None: `dtype` (the resolved weight dtype); otherwise one of DTYPES at least as wide as `dtype` (narrower
    activations than the weights would round every product's input)."""
    if activation_dtype is None:
        return dtype
    if activation_dtype not in DTYPES:
        raise ConfigError(f"activation_dtype: expected None or one of {'|'.join(DTYPES)}, got {activation_dtype!r}")
    resolved = DTYPES[activation_dtype]
    if resolved.itemsize < dtype.itemsize:
        raise ConfigError(f"activation_dtype: {activation_dtype!r} is narrower than dtype "
                          f"{str(dtype).removeprefix('torch.')!r}; activations may only be as wide or wider")
    return resolved


class LLM:
    """Offline inference over one DeepSeek-V4 checkpoint.

    Args:
        model: a checkpoint directory, or the name of an embedded model (None: the default one).
        load_format: "auto" (safetensors, native or HF layout, detected from names) or "dummy".
        dtype: "auto" | "float32" | "bfloat16" (activations, dense weights; experts keep their format).
        activation_dtype: None (the default: `dtype`) | "float32" | "bfloat16": the dtype of the activations
            and the KV / compressor / indexer caches, when it should differ from the weights'.
            `dtype="bfloat16", activation_dtype="float32"` keeps the weights bf16 at rest (the bf16 engine's
            memory, load, refit, export and weight-report formats and bits) and computes in fp32: each product
            widens its bf16 weight per call (the few-row C kernels read the bf16 weight directly), so a
            trainer in fp32 sees only the weight rounding (docs/rl.md). Not with `compile=True`.
        device: torch device string.
        seed: seeds dummy weights and unseeded sampling.
        draft: None, "mtp" or "dspark": also load that drafter from the same checkpoint; one with a
            proposer (`PROPOSER_BUILDERS`) then drafts for speculative decoding.
        expert_dtype: override of the routed experts' resident format ("fp4" | "fp8" | "dense").
        max_num_seqs: cache slots, i.e. sequences decoded together (None: as many as memory allows,
            at most `limits.DEFAULT_MAX_NUM_SEQS`).
        max_num_batched_tokens: tokens per forward step; prompt chunks fill what decodes leave.
        max_model_len: prompt + output tokens per sequence (None: the model's maximum, reduced
            until one sequence's cache fits the memory budget).
        compile: run pure-decode steps as one `torch.compile`d graph (`engine/static_decode.py`): several
            times fewer framework calls per step; steps with prompt chunks run eager. Needs a C++ compiler;
            routed experts in any format (FP8 / FP4 experts stay quantized and run the fused kernels as
            eager does). The first steps at new shapes compile (minutes on a small CPU, cached on disk by
            torch across processes). Refits stay in place: the compiled graph reads the weights by address
            and sees the new values without recompiling.
        num_speculative_tokens: draft tokens per sequence and step (k, 1 to
            `speculation.MAX_SPECULATIVE_TOKENS`; None: the drafter's default, `DEFAULT_MTP_TOKENS` for MTP,
            DSpark's whole block).
        speculation_max_batch: speculate only in steps with at most this many decoding sequences (the
            break-even batch; None: `speculation.DEFAULT_SPECULATION_MAX_BATCH`).
        share_prompt_prefill: sequences with the same prompt (a request's n completions, e.g. GRPO groups,
            and requests repeating a prompt) prefill it once: the slot state after the prompt is copied into
            the others' slots and each samples on from there with its own settings (engine/scheduler.py).
            Outputs are the same either way; False prefills every sequence on its own.
        kernels: the kernel registry of the models' fast paths (None: the process-wide
            `kernels.default_registry()`, which honours DSV4_KERNELS=reference).
        tensor_parallel_size: ranks the model is split over (docs/parallel.md). Above 1, every rank of a
            torchrun launch (or of a torch.distributed group the caller formed) builds this same `LLM`: each
            loads only its shard, all run the same scheduler and sampler on identical gathered logits, and
            all return the same results.
        expert_parallel: split routed experts by expert (each rank holds n_routed_experts / N whole
            experts) instead of splitting every expert's width.
        distributed_timeout_s: how long forming the group, or any collective, may wait for a peer before
            it fails with ParallelError (None: `parallel.state.DEFAULT_TIMEOUT_S`).
        outputs_on_all_ranks: every rank returns the results (True) or only rank 0 (the others get []).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        load_format: str = "auto",
        dtype: str = "auto",
        activation_dtype: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        draft: str | None = None,
        expert_dtype: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        compile: bool = False,
        num_speculative_tokens: int | None = None,
        speculation_max_batch: int | None = None,
        share_prompt_prefill: bool = True,
        kernels: KernelRegistry | None = None,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
        distributed_timeout_s: float | None = None,
        outputs_on_all_ranks: bool = True,
    ):
        check_llm_arguments(
            model=model, load_format=load_format, dtype=dtype, activation_dtype=activation_dtype, device=device,
            seed=seed, draft=draft,
            expert_dtype=expert_dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, compile=compile, num_speculative_tokens=num_speculative_tokens,
            speculation_max_batch=speculation_max_batch, tensor_parallel_size=tensor_parallel_size,
            expert_parallel=expert_parallel, distributed_timeout_s=distributed_timeout_s,
            outputs_on_all_ranks=outputs_on_all_ranks, share_prompt_prefill=share_prompt_prefill,
        )
        if num_speculative_tokens is not None and draft not in PROPOSER_BUILDERS:
            raise ConfigError(f"LLM: num_speculative_tokens: draft={draft!r} has no proposer; speculative decoding "
                              f"drafts with one of {sorted(PROPOSER_BUILDERS)}")
        path, load_format = resolve_model(model, load_format)
        cfg = ModelConfig.from_file(path)
        self.parallel: ParallelState = join_group(
            tensor_parallel_size, expert_parallel, device,
            DEFAULT_TIMEOUT_S if distributed_timeout_s is None else distributed_timeout_s)
        self.outputs_on_all_ranks = outputs_on_all_ranks
        device = rank_device(device, self.parallel)
        self.dtype = resolve_dtype(dtype, cfg)
        self.activation_dtype = resolve_activation_dtype(activation_dtype, self.dtype)
        self.path = Path(path)
        # Tokenizer and template first: a broken file fails before minutes of weight loading.
        self.tokenizer = load_tokenizer(self.path)
        self.chat_template = ChatTemplate.from_checkpoint(self.path)
        self.loaded: LoadedModels = load_models(
            path, load_format=load_format, dtype=self.dtype, device=device, draft=draft,
            expert_dtype=expert_dtype, seed=seed, kernels=kernels, parallel=self.parallel,
            activation_dtype=self.activation_dtype,
        )
        self.config = self.loaded.config
        self.limits = EngineLimits.derive(
            cfg, self.activation_dtype, device, max_num_seqs, max_num_batched_tokens, max_model_len
        )
        if self.parallel.is_parallel:
            self.limits = agree_across_ranks(self.parallel, self.limits, {
                "config": cfg, "dtype": str(self.dtype), "activation_dtype": str(self.activation_dtype),
                "seed": seed, "draft": draft,
                "expert_format": self.loaded.expert_format, "load_format": load_format,
                "expert_parallel": expert_parallel, "num_speculative_tokens": num_speculative_tokens,
                "speculation_max_batch": speculation_max_batch})
        self.speculation: SpeculationConfig | None = None
        if draft in PROPOSER_BUILDERS:
            self.speculation = SpeculationConfig(
                draft, num_speculative_tokens,
                DEFAULT_SPECULATION_MAX_BATCH if speculation_max_batch is None else speculation_max_batch)
        try:
            self.engine = Engine(self.loaded.target, self.limits, seed, cfg.eos_token_ids, self.tokenizer,
                                 compile_decode=compile, share_prompt_prefill=share_prompt_prefill)
        except ValueError as exc:
            raise ConfigError(f"{path}: compile=True: {exc}") from exc
        if self.speculation is not None:
            self._start_speculation(seed, compile)
        self._request_counter = itertools.count()
        self._weight_update: WeightUpdateSession | None = None  # the session begun last (one open at a time)
        self._weight_update_lock = threading.Lock()  # makes "is a session open? if not, open one" atomic

    def _start_speculation(self, seed: int, compile_decode: bool) -> None:
        """Build the proposer and hand it to the engine, once its verify chunk is known to fit the rings."""
        spec = self.speculation
        proposer = PROPOSER_BUILDERS[spec.method](self.loaded, self.limits, spec.num_speculative_tokens, seed,
                                                  compile_decode)
        limit = self.engine.runner.cache.rollback_limit()
        if proposer.num_speculative_tokens + 1 > limit:
            raise ConfigError(
                f"LLM: num_speculative_tokens={proposer.num_speculative_tokens}: a verify chunk of k + 1 tokens "
                f"must fit {self.path}'s smallest cache ring ({limit} rows), so k <= {limit - 1}")
        self.engine.proposer = proposer
        self.engine.speculation_max_batch = spec.max_batch

    @property
    def weights_version(self) -> int:
        """The version of the weights now serving: 0 at load, +1 per finished weight update."""
        return self.engine.weights_version

    # ---- generation ----
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids). Safe to call from several threads, and while
        another thread updates the weights (see `begin_weight_update`).

        Args:
            prompts: one prompt or a list; a prompt is a string or a list of token ids.
            sampling_params: one for all prompts, or one per prompt (None: defaults).
            use_tqdm: show a progress bar (only when stderr is a terminal).

        Returns:
            One RequestOutput per prompt, in order. A prompt that cannot be served (too long, bad ids)
            gets an output with `.error` set and no completions; the others still run.

        Raises:
            RequestError: as many sampling params as prompts were not given.
            WeightsNotReadyError: a failed weight update left the model unusable.
        """
        prompts = normalize_prompts(prompts, "generate")
        params = normalize_sampling_params(sampling_params, len(prompts), "generate")
        require_bool("generate: use_tqdm", use_tqdm)
        requests: list[Request | RequestOutput] = self._add_all(prompts, params, stream=False)
        live = [r for r in requests if isinstance(r, Request)]
        done = 0
        with Progress(len(live), "generate", "req", enabled=use_tqdm) as progress:
            while done < len(live):
                self.engine.step_or_wait(IDLE_WAIT_S)
                finished = sum(r.finished for r in live)
                for _ in range(finished - done):
                    progress.update()
                done = finished
        if not self.outputs_on_all_ranks and self.parallel.rank != 0:
            return []
        return [r.output(delta=False) if isinstance(r, Request) else r for r in requests]

    def stream(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield, step by step, each request's new tokens and text.

        `abort(request_id)` from the consuming loop stops a request: its final delta has finish_reason
        "abort". Closing the iterator early aborts its requests that are still running.

        Args:
            prompts: as for `generate`.
            sampling_params: as for `generate`.

        Yields:
            `RequestOutput` deltas; the last one of a request has `finished=True`. Rejected prompts come
            first, with `.error`.
        """
        prompts = normalize_prompts(prompts, "stream")
        params = normalize_sampling_params(sampling_params, len(prompts), "stream")
        deltas: deque[RequestOutput] = deque()  # filled by whichever thread runs the step
        pending = set()
        for r in self._add_all(prompts, params, stream=True, sink=deltas.append):
            if isinstance(r, Request):
                pending.add(r.request_id)
            else:
                yield r
        try:
            while pending:
                self.engine.step_or_wait(IDLE_WAIT_S)
                while deltas:
                    out = deltas.popleft()
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
        finally:
            for request_id in pending:  # the consumer stopped listening: free the slots
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a running or waiting request and free its cache slots.

        Returns:
            False if the request is unknown or done.
        """
        require_str("abort: request_id", request_id)
        return self.engine.abort(request_id)

    def pause_generation(self, mode: str = PAUSE_ABORT) -> None:
        """Pause generation until `resume_generation()`; new requests queue meanwhile, and weight
        updates may run (they leave the requests in flight to this pause).

        Args:
            mode: "abort": requests in flight end now; "wait": they run to their end (this call returns
                then); "retract": they are preempted and recompute their tokens after the pause.

        Raises:
            ConfigError: an unknown mode.
        """
        self.engine.pause(check_pause_mode(mode), hold=USER_HOLD)

    def resume_generation(self) -> None:
        """End a `pause_generation`; queued and retracted requests run (under the weights now in place)."""
        self.engine.resume(USER_HOLD)

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """`generate` on conversations rendered with the checkpoint's chat template."""
        conversations = normalize_conversations(messages, "chat")
        require_bool("chat: add_generation_prompt", add_generation_prompt)
        if self.chat_template is None or self.tokenizer is None:
            raise RequestError(f"{self.path}: no chat_template in tokenizer_config.json (or no tokenizer.json)")
        texts = [self.chat_template.render(list(c), add_generation_prompt) for c in conversations]
        # The template writes any BOS itself, so encode without adding special tokens again.
        ids = [self.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        return self.generate(ids, sampling_params, use_tqdm)

    def _add_all(
        self, prompts: list[Prompt], params_list: list[SamplingParams], stream: bool, sink: OutputSink | None = None,
    ) -> list[Request | RequestOutput]:
        """Queue every prompt; a prompt rejected on its own becomes an error RequestOutput. `stream`: report
        every step's delta (True) or only the finished output (False); `sink` receives them."""
        added: list[Request | RequestOutput] = []
        for prompt, params in zip(prompts, params_list):
            rid = str(next(self._request_counter))
            text = prompt if isinstance(prompt, str) else None
            try:
                ids = self._encode(prompt, rid)
                added.append(self.engine.add_request(rid, ids, params, text, stream=stream, sink=sink))
            except RequestError as exc:
                ids = [] if isinstance(prompt, str) else list(prompt)
                added.append(RequestOutput(rid, text, ids, [], True, self.weights_version, error=str(exc)))
        return added

    def _encode(self, prompt: str | Seq[int], request_id: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    f"request {request_id}: {self.path} has no tokenizer.json, so prompts must be lists of token ids"
                )
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids = list(prompt)
        # Checked for text too: a tokenizer may know more tokens than the model's embedding has rows.
        check_prompt_ids(ids, self.config.vocab_size, f"request {request_id}")
        return ids

    # ---- scoring ----
    def forward_logprobs(self, token_ids: Seq[Seq[int]]) -> list[torch.Tensor]:
        """Next-token distributions from the engine's own (chunked) prefill path, in a scratch cache.

        Args:
            token_ids: token id sequences.

        Returns:
            Per sequence, fp32 [len, vocab] log-softmax.

        Raises:
            RequestError: ids outside the vocabulary.
        """
        token_ids = normalize_token_sequences(
            token_ids, self.config.vocab_size, self.limits.max_model_len, "forward_logprobs"
        )
        return self.engine.forward_logprobs(token_ids)

    # ---- weights ----
    # Thin wrappers over dsv4.weights.{refit,export,report}.
    def begin_weight_update(self, atomic: bool = True, full: bool = False, pause: str = PAUSE_ABORT):
        """Open a weight update session (see `dsv4.weights.refit`): `load(bucket)` any number of times,
        then `finish()` (or use it as a context manager). Target and drafters update together.

        Generation and the update are serialized: the weights change only between engine steps, after
        the requests in flight were dealt with per `pause`. An atomic session pauses generation at
        `finish()` (buckets are only staged until then); a fail-stop one writes as buckets arrive, so it
        pauses when it begins. Generation resumes when the session ends, however it ends.

        Args:
            atomic: stage every bucket and apply them at `finish()` (True), or write as they arrive.
            full: `finish()` requires every tensor.
            pause: what becomes of the requests in flight: "abort": they end with finish_reason "abort";
                "wait": they run to their end first (new requests queue); "retract": they are preempted
                and, after the update, recompute their tokens under the new weights and go on. Ignored
                while `pause_generation` holds generation paused (that pause decided).

        Returns:
            The session (`PausingWeightUpdate`).

        Raises:
            WeightUpdateError: another session is open.
            ConfigError: an unknown pause mode.
        """
        require_bool("begin_weight_update: atomic", atomic)
        require_bool("begin_weight_update: full", full)
        check_pause_mode(pause)
        return self._open_weight_update(atomic, full, pause, rank_agreement=True)

    def _open_weight_update(self, atomic: bool, full: bool, pause: str, *, rank_agreement: bool):
        with self._weight_update_lock:
            if self._weight_update is not None and self._weight_update.active:
                raise WeightUpdateError(
                    f"a weight update session is already open ({self._weight_update.buckets} bucket(s) loaded); "
                    f"finish() or abort() it first"
                )
            self._weight_update = PausingWeightUpdate(self.loaded, self.engine, pause, atomic=atomic, full=full,
                                                      rank_agreement=rank_agreement)
            return self._weight_update

    def release_weight_staging(self) -> int:
        """Give back the staging memory atomic updates keep between updates (one copy of the tensors they
        carried: an RL loop that refits every step reuses it instead of faulting in fresh memory each time).
        The next atomic update allocates again.

        Returns:
            The bytes released.

        Raises:
            WeightUpdateError: a weight update session is open (it may be staging into them).
        """
        with self._weight_update_lock:
            if self._weight_update is not None and self._weight_update.active:
                raise WeightUpdateError("release_weight_staging: a weight update session is open; finish() or "
                                        "abort() it first")
            released = self.loaded.staging.nbytes
            self.loaded.staging.clear()
            return released

    def update_weights(self, weights: Bucket, full: bool = False, pause: str = PAUSE_ABORT) -> int:
        """Atomically replace weights with (name, tensor) pairs (one bucket).

        Args:
            weights: (name, tensor) pairs or a mapping; native or HF names.
            full: require every tensor.
            pause: what becomes of the requests in flight (see `begin_weight_update`).

        Returns:
            The new weights version.

        Raises:
            WeightUpdateError: a rejected tensor or an incomplete update; the old weights keep serving.
        """
        check_weight_pairs(weights, "update_weights")
        with self.begin_weight_update(atomic=True, full=full, pause=pause) as session:
            session.load(weights)
        return session.version

    # ---- weights from a trainer process (dsv4.weights.transfer; the trainer side is dsv4.rl) ----
    _weight_receiver = None  # this engine's membership of a transfer group, once init_weight_transfer ran

    def init_weight_transfer(
        self, master_address: str, master_port: int, rank_offset: int = 1, world_size: int = 2,
        group_name: str = "dsv4", backend: str = "gloo", timeout: float | None = None,
    ) -> dict:
        """Join a trainer's transfer group (the trainer, `dsv4.rl.WeightSender`, is rank 0 and hosts it).
        Blocks until every member has joined.

        Args:
            master_address: the trainer's address. master_port: the group's port there.
            rank_offset: this engine's rank in the group. world_size: trainer + engine ranks.
            group_name: as the trainer names it. backend: "gloo" (CPU) or "nccl" (GPU).
            timeout: seconds any single wait may take (None: `dsv4.rl.group.DEFAULT_TIMEOUT_S`).

        Returns:
            {"group", "rank", "world_size", "backend", "usable"}.

        Raises:
            ConfigError: a bad argument. WeightTransferError: the trainer unreachable within the timeout,
                or a member that disagrees (world size, backend, rank taken).
        """
        from dsv4.rl.group import DEFAULT_TIMEOUT_S
        from dsv4.weights.transfer import WeightReceiver

        self._weight_receiver = None  # a failed join leaves no group behind
        self._weight_receiver = WeightReceiver(
            master_address, master_port, rank_offset, world_size, group_name, backend,
            DEFAULT_TIMEOUT_S if timeout is None else timeout,
        )
        return self._weight_receiver.describe()

    def update_weights_from_distributed(
        self, metadata: dict, atomic: bool = True, full: bool = False, pause: str = PAUSE_ABORT
    ) -> dict:
        """Receive the update `metadata` describes while the trainer runs `WeightSender.send`, as one refit
        session (`begin_weight_update(atomic, full, pause)`): in atomic mode generation goes on while the
        buckets arrive, and pauses per `pause` only to apply them.

        Args:
            metadata: the trainer's `WeightSender.plan(...)` (JSON).
            atomic, full, pause: as for `begin_weight_update`.

        Returns:
            {"version", "update_id", "buckets", "tensors", "bytes", "seconds", "receive_wait_s", "apply_s",
            "commit_s"}.

        Raises:
            WeightUpdateError: refused before a byte moved (base version, metadata) or failed (a checksum, a
                rejected tensor); atomic mode keeps the previous weights serving.
            WeightTransferError: no group, or the trainer died or timed out (the group is unusable then).
            ConfigError, ArgumentTypeError: a bad pause mode, atomic or full (before any exchange).
        """
        from dsv4.errors import WeightTransferError

        if self._weight_receiver is None:
            raise WeightTransferError("no weight transfer group: call init_weight_transfer(...) first")
        # The transfer agrees across the engine's ranks over its group's store before any commits.
        begin = self._session_opener("update_weights_from_distributed", atomic, full, pause, rank_agreement=False)
        return self._weight_receiver.update(metadata, self.weights_version, begin, self._max_update_bytes())

    def update_weights_from_shared(
        self, metadata: dict, handle: dict, atomic: bool = True, full: bool = False, pause: str = PAUSE_ABORT
    ) -> dict:
        """The same update from a colocated trainer's shared memory (`dsv4.rl.ColocatedWeightSender`).

        Args:
            metadata: `sender.plan(...)`. handle: `sender.share(...)`. atomic, full, pause: as for
                `begin_weight_update`.

        Returns:
            {"version", "update_id", "buckets", "tensors", "bytes", "seconds", "receive_wait_s", "apply_s",
            "commit_s"}.

        Raises:
            WeightUpdateError: refused (base version, metadata, a handle outside shared memory) or failed.
            ConfigError, ArgumentTypeError: a bad pause mode, atomic or full.
        """
        from dsv4.weights.transfer import update_from_shared

        begin = self._session_opener("update_weights_from_shared", atomic, full, pause)
        return update_from_shared(metadata, handle, self.weights_version, begin, self._max_update_bytes())

    def _session_opener(self, caller: str, atomic: bool, full: bool, pause: str, *, rank_agreement: bool = True):
        """`begin_weight_update(atomic, full, pause)` for a transfer to call once it accepted the plan. The
        arguments are checked now, before any exchange with the trainer: a bad one found only when the
        session opens would leave the trainer waiting for this engine's answer until its timeout.
        `rank_agreement=False` for a transfer that agrees across tensor parallel ranks by its own means."""
        require_bool(f"{caller}: atomic", atomic)
        require_bool(f"{caller}: full", full)
        check_pause_mode(pause)
        return lambda: self._open_weight_update(atomic, full, pause, rank_agreement=rank_agreement)

    def _max_update_bytes(self) -> int:
        """The largest update accepted; a tensor parallel rank receives full tensors, N times its shard."""
        from dsv4.weights.transfer import max_update_bytes

        return max_update_bytes(self.loaded) * self.parallel.world_size

    def _require_whole_model(self, caller: str) -> None:
        if self.parallel.is_parallel:
            raise ConfigError(f"{caller}: this rank holds 1/{self.parallel.world_size} of the model "
                              f"(tensor_parallel_size={self.parallel.world_size}); export from one process")

    def iter_weights(self):
        """Every loadable tensor as (native name, resident-format view); feeds another engine's update."""
        from dsv4.weights.export import iter_weights

        self._require_whole_model("iter_weights")

        return iter_weights(self.loaded)

    def weight_report(self) -> dict:
        """Version, READY flag and per-tensor shape/dtype/address/checksum (see `dsv4.weights.report`); under
        tensor parallelism, this rank's shard (plus "rank" and "world_size")."""
        from dsv4.weights.report import weight_report

        report = weight_report(self.loaded, self.weights_version)
        if self.parallel.is_parallel:
            report.update(rank=self.parallel.rank, world_size=self.parallel.world_size)
        return report

    def merged_weight_report(self) -> dict:
        """Every rank's report merged (`dsv4.weights.merged_report`): full shapes, per-rank checksums, and
        the replicated tensors whose ranks disagree. A collective: every rank must call it."""
        from dsv4.weights.merged_report import merged_weight_report

        return merged_weight_report(self.loaded, self.weights_version)

    def save_checkpoint(
        self, out_dir: str | Path, layout: str = "native", dense: str = "model", experts: str = "resident"
    ) -> Path:
        """Write the current weights as a checkpoint directory (tokenizer files copied along)."""
        check_path("save_checkpoint: out_dir", out_dir)
        self._require_whole_model("save_checkpoint")
        for name, value in (("layout", layout), ("dense", dense), ("experts", experts)):
            require_str(f"save_checkpoint: {name}", value)
        from dsv4.weights.export import save_checkpoint

        return save_checkpoint(self.loaded, out_dir, layout, dense, experts, copy_from=self.path)


def rank_device(device: str, parallel: ParallelState) -> str:
    """A rank's own GPU under tensor parallelism ("cuda" -> "cuda:LOCAL_RANK"); any other device as given."""
    if parallel.is_parallel and device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', parallel.rank))}"
    return device


def agree_across_ranks(parallel: ParallelState, limits: EngineLimits, options: dict) -> EngineLimits:
    """Check that every rank built the same model with the same options, and give every rank the same
    engine limits (the smallest each derived from its own memory): ranks with different limits would
    schedule different steps and wait on different collectives."""
    from dataclasses import asdict

    from dsv4.parallel.collectives import all_gather_objects

    require_agreement(options, parallel)
    everyone = all_gather_objects(asdict(limits), parallel)
    return EngineLimits(**{key: min(rank[key] for rank in everyone) for key in asdict(limits)})


class PausingWeightUpdate(WeightUpdateSession):
    """A weight update session of an engine that may be generating (`LLM.begin_weight_update`).

    It pauses generation (`Engine.pause(mode)`) before the first resident byte is written: at `finish()`
    in atomic mode, when it begins in fail-stop mode. The write, finalize and version bump then run
    under the engine's lock, so no step sees a half-written model; `Engine.weights_updated` bumps the
    version. Generation resumes when the session ends, however it ends.
    """

    def __init__(self, loaded: LoadedModels, engine: Engine, pause: str, *, atomic: bool, full: bool,
                 rank_agreement: bool = True):
        super().__init__(loaded, engine.weights_version, engine.weights_updated, atomic=atomic, full=full,
                         rank_agreement=rank_agreement)
        self._engine = engine
        self._pause = pause
        self._holding = False
        if not atomic:
            self._hold()

    def _hold(self) -> None:
        if not self._holding:
            self._engine.pause(self._pause, hold=WEIGHTS_HOLD)
            self._holding = True

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._engine.resume(WEIGHTS_HOLD)

    def load(self, bucket: Bucket, origin: str | None = None) -> int:
        try:
            return super().load(bucket, origin)
        finally:
            if not self.active:  # the bucket failed and closed the session
                self._release()

    def finish(self) -> int:
        if self.active:
            self._hold()
        try:
            with self._engine.exclusive():
                return super().finish()
        finally:
            self._release()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._release()
