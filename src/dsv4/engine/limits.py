"""Engine limits: how many sequences, tokens per step and tokens per sequence the engine serves.

Unset limits are derived from the model (its maximum positions) and from memory: the per-sequence
caches are reserved at start-up for the worst case (every slot holding max_model_len positions), so their
size decides how many sequences fit; on CPU their memory is taken only as sequences write it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsv4.config import ModelConfig
from dsv4.errors import ConfigError
from dsv4.model.cache import allocate_layer_cache, cache_tensors

# Defaults when the user leaves a limit unset; each is then capped by the model and by memory.
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Share of the memory available at start-up that the per-sequence caches may take by default
# (weights are already resident; activations and the allocator need headroom too).
CACHE_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class EngineLimits:
    """The engine's fixed sizes (see `derive`)."""

    max_num_seqs: int  # cache slots
    max_num_batched_tokens: int  # tokens per forward step
    max_model_len: int  # prompt + output tokens per sequence

    @classmethod
    def derive(
        cls, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
        max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
        memory_bytes: int | None = None,
    ) -> EngineLimits:
        """Fill the unset limits from the model and from memory.

        max_model_len defaults to the model's maximum positions, halved until one sequence's cache fits
        the budget (available bytes * CACHE_MEMORY_FRACTION); max_num_seqs defaults to as many such
        sequences as fit, at most DEFAULT_MAX_NUM_SEQS and at most max_num_batched_tokens (every
        running sequence needs one token of a step to decode). Explicit values are honoured, except
        that max_model_len is capped by the model.

        Args:
            cfg: the model config.
            dtype: the cache dtype.
            device: where the caches live (its free memory is the budget's base).
            max_num_seqs: cache slots, or None.
            max_num_batched_tokens: tokens per forward step, or None (DEFAULT_MAX_NUM_BATCHED_TOKENS).
            max_model_len: prompt + output tokens per sequence, or None.
            memory_bytes: the memory to size against instead of the device's available memory.

        Returns:
            The limits.

        Raises:
            ConfigError: a limit that is not a positive int, or max_num_seqs > max_num_batched_tokens.
        """
        budget = int((memory_bytes if memory_bytes is not None else available_memory(device)) * CACHE_MEMORY_FRACTION)
        model_len = cfg.max_position_embeddings
        if max_model_len is not None:
            model_len = min(max_model_len, model_len)
        if max_model_len is None:
            while model_len > 1 and cache_bytes_per_sequence(cfg, model_len, dtype) > budget:
                model_len //= 2
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", model_len)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if max_num_seqs is None:
            fit = budget // max(1, cache_bytes_per_sequence(cfg, model_len, dtype))
            # Every running sequence needs one token of the step budget to decode.
            max_num_seqs = int(max(1, min(DEFAULT_MAX_NUM_SEQS, fit, max_num_batched_tokens)))
        elif max_num_seqs > max_num_batched_tokens:
            raise ConfigError(
                f"max_num_seqs={max_num_seqs} > max_num_batched_tokens={max_num_batched_tokens}: "
                f"some running sequences could not decode in a step"
            )
        return cls(max_num_seqs, max_num_batched_tokens, model_len)


def cache_bytes_per_sequence(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of one cache slot for sequences up to max_len (shapes from a meta-device allocation)."""
    layers = [allocate_layer_cache(cfg, t, 1, max_len, dtype, "meta") for t in cfg.layer_types]
    return sum(t.numel() * t.element_size() for t in cache_tensors(layers))


def available_memory(device: str | torch.device) -> int:
    """Free bytes on `device` now: CUDA's free memory, or the host's MemAvailable (Linux) / total RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
