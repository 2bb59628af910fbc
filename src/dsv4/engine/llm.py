"""`LLM`: the user-facing facade. Loads a checkpoint (or the embedded default) and generates."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Sequence as Seq

import torch

from dsv4.config import ModelConfig
from dsv4.engine.engine import Engine, EngineLimits
from dsv4.engine.request import CompletionOutput, RequestOutput, Sequence
from dsv4.engine.sampler import SamplingState
from dsv4.engine.sampling_params import SamplingParams
from dsv4.errors import ConfigError, RequestError
from dsv4.model.batch import ForwardBatch
from dsv4.models import resolve_model
from dsv4.weights.loader import LoadedModels, load_models

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEFAULT_MAX_NUM_SEQS = 16
_DEFAULT_MAX_BATCHED_TOKENS = 2048
_DEFAULT_MAX_MODEL_LEN = 4096


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
        max_num_seqs: int = _DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = _DEFAULT_MAX_BATCHED_TOKENS,
        max_model_len: int | None = None,
    ):
        path, load_format = resolve_model(model, load_format)
        cfg = ModelConfig.from_file(path)
        self.dtype = resolve_dtype(dtype, cfg)
        self.loaded: LoadedModels = load_models(
            path, load_format=load_format, dtype=self.dtype, device=device, draft=draft,
            expert_dtype=expert_dtype, seed=seed,
        )
        self.config = self.loaded.config
        self.path = Path(path)
        self.tokenizer = _load_tokenizer(self.path)
        self.weights_version = 0
        limit = min(max_model_len or _DEFAULT_MAX_MODEL_LEN, cfg.max_position_embeddings)
        self.limits = EngineLimits(max_num_seqs, max_num_batched_tokens, limit)
        self.engine = Engine(self.loaded.target, self.limits, seed, cfg.eos_token_ids)
        self._request_counter = itertools.count()

    # ---- generation ----
    def generate(
        self, prompts: str | Seq[int] | Seq[str | Seq[int]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        requests = []
        for prompt in prompts:
            ids = self._encode(prompt)
            rid = str(next(self._request_counter))
            seqs = [
                Sequence(rid, i, ids, params, SamplingState.from_params(params, i)) for i in range(params.n)
            ]
            for seq in seqs:
                self.engine.add(seq)
            requests.append((prompt, ids, seqs))
        while self.engine.has_work():
            self.engine.step()
        return [self._output(rid_prompt, ids, seqs) for rid_prompt, ids, seqs in requests]

    def _encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.path}: no tokenizer.json, so prompts must be lists of token ids")
            return self.tokenizer.encode(prompt).ids
        ids = list(prompt)
        vocab = self.config.vocab_size
        if not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def _output(self, prompt, ids: list[int], seqs: list[Sequence]) -> RequestOutput:
        outputs = []
        for seq in seqs:
            text = self.tokenizer.decode(seq.output_ids) if self.tokenizer is not None else None
            logprobs = [lp.top for lp in seq.logprobs] if seq.params.logprobs is not None else None
            outputs.append(CompletionOutput(seq.index, list(seq.output_ids), text, seq.finish_reason, logprobs))
        return RequestOutput(
            request_id=seqs[0].request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            outputs=outputs,
            finished=True,
            weights_version=self.weights_version,
        )

    # ---- scoring ----
    @torch.inference_mode()
    def forward_logprobs(self, token_ids: Seq[Seq[int]]) -> list[torch.Tensor]:
        """Per sequence, fp32 [len, vocab] log-softmax next-token distributions from the engine's own
        (chunked) prefill path, in a scratch cache slot."""
        model = self.loaded.target
        scratch = model.allocate_cache(1, max(len(ids) for ids in token_ids) + 1)
        results = []
        chunk = self.limits.max_num_batched_tokens
        for seq_ids in token_ids:
            ids = self._encode(list(seq_ids))
            parts = []
            for start in range(0, len(ids), chunk):
                batch = ForwardBatch.build([(0, ids[start : start + chunk], start)])
                streams, _ = model(batch, scratch)
                parts.append(model.logits(streams).log_softmax(dim=-1))
            results.append(torch.cat(parts))
        return results


def _load_tokenizer(path: Path):
    file = path / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
