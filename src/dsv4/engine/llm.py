"""`LLM`: the user-facing facade. Loads a checkpoint (or the embedded default) and generates."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from dsv4.config import ModelConfig
from dsv4.embedded import resolve_model
from dsv4.engine.chat_template import ChatTemplate
from dsv4.engine.engine import Engine, EngineLimits
from dsv4.engine.request import Request, RequestOutput
from dsv4.engine.sampling_params import SamplingParams
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
from dsv4.errors import ConfigError, RequestError
from dsv4.model.batch import ForwardBatch
from dsv4.progress import Progress
from dsv4.weights.loader import LoadedModels, load_models

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Prompt = str | Seq[int]


def resolve_dtype(dtype: str, cfg: ModelConfig) -> torch.dtype:
    """"auto": the checkpoint's float dtype when it is fp32 or bf16, otherwise bf16."""
    if dtype == "auto":
        return torch.float32 if cfg.torch_dtype in ("float32", "fp32") else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of auto|{'|'.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class LLM:
    """Offline inference over one DeepSeek-V4 checkpoint.

    Args:
        model: a checkpoint directory, or the name of an embedded model (None: the default one).
        load_format: "auto" (safetensors, native or HF layout, detected from names) or "dummy".
        dtype: "auto" | "float32" | "bfloat16" (activations, dense weights; experts keep their format).
        device: torch device string.
        seed: seeds dummy weights and unseeded sampling.
        draft: None, "mtp" or "dspark": also load that drafter from the same checkpoint.
        expert_dtype: override of the routed experts' resident format ("fp4" | "fp8" | "dense").
        max_num_seqs: cache slots, i.e. sequences decoded together (None: as many as memory allows,
            at most `engine.DEFAULT_MAX_NUM_SEQS`).
        max_num_batched_tokens: tokens per forward step; prompt chunks fill what decodes leave.
        max_model_len: prompt + output tokens per sequence (None: the model's maximum, reduced
            until one sequence's cache fits the memory budget).
        compile: run decode steps as one `torch.compile`d graph (`model/static_decode.py`): several
            times fewer framework calls per step. Needs a C++ compiler and dense routed experts (bf16 /
            fp32, e.g. `expert_dtype="dense"`); the first steps at new shapes compile (about a minute
            on a small CPU, cached on disk by torch across processes). Refits stay in place: the compiled
            graph reads the weights by address and sees the new values without recompiling.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        load_format: str = "auto",
        dtype: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        draft: str | None = None,
        expert_dtype: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        compile: bool = False,
    ):
        check_llm_arguments(
            model=model, load_format=load_format, dtype=dtype, device=device, seed=seed, draft=draft,
            expert_dtype=expert_dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, compile=compile,
        )
        path, load_format = resolve_model(model, load_format)
        cfg = ModelConfig.from_file(path)
        self.dtype = resolve_dtype(dtype, cfg)
        self.path = Path(path)
        # Tokenizer and template first: a broken file fails before minutes of weight loading.
        self.tokenizer = load_tokenizer(self.path)
        self.chat_template = ChatTemplate.from_checkpoint(self.path)
        self.loaded: LoadedModels = load_models(
            path, load_format=load_format, dtype=self.dtype, device=device, draft=draft,
            expert_dtype=expert_dtype, seed=seed,
        )
        self.config = self.loaded.config
        self.weights_version = 0
        self.limits = EngineLimits.derive(
            cfg, self.dtype, device, max_num_seqs, max_num_batched_tokens, max_model_len
        )
        try:
            self.engine = Engine(self.loaded.target, self.limits, seed, cfg.eos_token_ids, self.tokenizer,
                                 compile_decode=compile)
        except ValueError as exc:
            raise ConfigError(f"{path}: compile=True: {exc}") from exc
        self._request_counter = itertools.count()

    # ---- generation ----
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); one RequestOutput per prompt, in order.
        A prompt that cannot be served (too long, bad ids) gets an output with `.error` set and no
        completions; the others still run. With `use_tqdm`, progress shows as a bar when stderr is a
        terminal and as periodic log lines otherwise (`dsv4.progress`)."""
        prompts = normalize_prompts(prompts, "generate")
        params = normalize_sampling_params(sampling_params, len(prompts), "generate")
        require_bool("generate: use_tqdm", use_tqdm)
        requests: list[Request | RequestOutput] = self._add_all(prompts, params, stream=False)
        pending = {r.request_id for r in requests if isinstance(r, Request)}
        with Progress(len(pending), "generate", "req", enabled=use_tqdm) as progress:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        progress.update()
        return [r.output(delta=False) if isinstance(r, Request) else r for r in requests]

    def stream(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield, step by step, each request's new tokens/text (`RequestOutput` deltas; the last one of a
        request has `finished=True`). `abort(request_id)` from the consuming loop stops a request: its
        final delta has finish_reason "abort". Rejected prompts are yielded first, with `.error`."""
        prompts = normalize_prompts(prompts, "stream")
        params = normalize_sampling_params(sampling_params, len(prompts), "stream")
        pending = set()
        for r in self._add_all(prompts, params, stream=True):
            if isinstance(r, Request):
                pending.add(r.request_id)
            else:
                yield r
        while pending:
            for out in self.engine.step():
                if out.request_id in pending:
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out

    def abort(self, request_id: str) -> bool:
        """Stop a running or waiting request and free its cache slots; False if it is unknown or done."""
        require_str("abort: request_id", request_id)
        return self.engine.abort(request_id)

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
        self, prompts: list[Prompt], params_list: list[SamplingParams], stream: bool,
    ) -> list[Request | RequestOutput]:
        """Queue every prompt; a prompt rejected on its own becomes an error RequestOutput. `stream`: report
        every step's delta (True) or only the finished output (False)."""
        added: list[Request | RequestOutput] = []
        for prompt, params in zip(prompts, params_list):
            rid = str(next(self._request_counter))
            text = prompt if isinstance(prompt, str) else None
            try:
                ids = self._encode(prompt, rid)
                added.append(self.engine.add_request(rid, ids, params, text, self.weights_version, stream=stream))
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
    @torch.inference_mode()
    def forward_logprobs(self, token_ids: Seq[Seq[int]]) -> list[torch.Tensor]:
        """Per sequence, fp32 [len, vocab] log-softmax next-token distributions from the engine's own
        (chunked) prefill path, in a scratch cache slot."""
        token_ids = normalize_token_sequences(
            token_ids, self.config.vocab_size, self.limits.max_model_len, "forward_logprobs"
        )
        model = self.loaded.target
        scratch = model.allocate_cache(1, max(len(ids) for ids in token_ids) + 1)
        results = []
        chunk = self.limits.max_num_batched_tokens
        for ids in token_ids:
            parts = []
            for start in range(0, len(ids), chunk):
                batch = ForwardBatch.build([(0, ids[start : start + chunk], start)])
                streams, _ = model(batch, scratch)
                parts.append(model.logits(streams).log_softmax(dim=-1))
            results.append(torch.cat(parts))
        return results

    # ---- weights ----
    # Thin wrappers over dsv4.weights.{refit,export,report}; imported here so this block stays self-contained.
    _weight_update = None  # the session begun last (at most one is open at a time)

    def begin_weight_update(self, atomic: bool = True, full: bool = False):
        """Open a weight update session (see `dsv4.weights.refit`): `load(bucket)` any number of times,
        then `finish()` (or use it as a context manager). Target and drafters update together."""
        require_bool("begin_weight_update: atomic", atomic)
        require_bool("begin_weight_update: full", full)
        from dsv4.errors import WeightUpdateError
        from dsv4.weights.refit import WeightUpdateSession

        if self._weight_update is not None and self._weight_update.active:
            raise WeightUpdateError(
                f"a weight update session is already open ({self._weight_update.buckets} bucket(s) loaded); "
                f"finish() or abort() it first"
            )
        self._weight_update = WeightUpdateSession(
            self.loaded, self.weights_version, self._commit_weights, atomic=atomic, full=full
        )
        return self._weight_update

    def _commit_weights(self) -> int:
        # Requests in flight hold cache state computed with the old weights; rather than continue on a
        # mix of old and new they end with finish_reason "abort" (their outputs name the old version).
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self.weights_version += 1
        return self.weights_version

    def update_weights(self, weights, full: bool = False) -> int:
        """Atomically replace weights with (name, tensor) pairs (one bucket); returns the new version."""
        check_weight_pairs(weights, "update_weights")
        with self.begin_weight_update(atomic=True, full=full) as session:
            session.load(weights)
        return session.version

    def iter_weights(self):
        """Every loadable tensor as (native name, resident-format view); feeds another engine's update."""
        from dsv4.weights.export import iter_weights

        return iter_weights(self.loaded)

    def weight_report(self) -> dict:
        """Version, READY flag and per-tensor shape/dtype/address/checksum (see `dsv4.weights.report`)."""
        from dsv4.weights.report import weight_report

        return weight_report(self.loaded, self.weights_version)

    def save_checkpoint(
        self, out_dir: str | Path, layout: str = "native", dense: str = "model", experts: str = "resident"
    ) -> Path:
        """Write the current weights as a checkpoint directory (tokenizer files copied along)."""
        check_path("save_checkpoint: out_dir", out_dir)
        for name, value in (("layout", layout), ("dense", dense), ("experts", experts)):
            require_str(f"save_checkpoint: {name}", value)
        from dsv4.weights.export import save_checkpoint

        return save_checkpoint(self.loaded, out_dir, layout, dense, experts, copy_from=self.path)

