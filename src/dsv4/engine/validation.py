"""Argument checks of the public API, run up front so that a bad call fails before anything loads or runs.

Every check raises a `dsv4.errors` class that is also the matching built-in: `ArgumentTypeError` (a
`TypeError`) for a value of the wrong Python type, `ConfigError` / `RequestError` (`ValueError`s) for a
value out of range. Each message names the function, the argument (with the list position or request
when there is one) and shows the value received, e.g.
``generate: prompts[1] must be a string or a list of token ids, got int 5``.

This module imports neither torch nor the model, so the command line can use its checks before torch is
imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dsv4.errors import ArgumentTypeError, ConfigError, RequestError

if TYPE_CHECKING:
    from dsv4.engine.sampling_params import SamplingParams

# Values are shown in messages, but a huge list or string must not flood the terminal or a log.
_MAX_SHOWN_CHARS = 80
# torch.Generator.manual_seed takes seeds below 2**64; completion i of a request uses seed + i, so the
# seed stays below 2**63 to leave room for every completion index.
MAX_SEED = 2**63 - 1
# Device types dsv4 can run on (the GPU path exists but is untested on real hardware).
DEVICE_TYPES = ("cpu", "cuda")
CHAT_ROLES_FIELD = "role"
CHAT_CONTENT_FIELD = "content"


def describe(value: Any) -> str:
    """A value as error messages show it: its type and a shortened repr, e.g. ``int 5``."""
    shown = repr(value)
    if len(shown) > _MAX_SHOWN_CHARS:
        shown = shown[: _MAX_SHOWN_CHARS - 3] + "..."
    return f"{type(value).__name__} {shown}"


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but True is never a meaningful count, id or seed.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sequence(value: Any) -> bool:
    """A list-like container (a string is one prompt or one stop string, never a list of characters)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


# ---- primitives -------------------------------------------------------------------------------------------
def require_int(
    where: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
    error: type[ValueError] = ConfigError,
) -> int:
    """Check that `value` is an int (not a bool) within [minimum, maximum].

    Args:
        where: the argument as messages name it, e.g. ``"LLM: seed"``.
        value: the value received.
        minimum: smallest allowed value (None: unbounded).
        maximum: largest allowed value (None: unbounded).
        error: the ValueError subclass raised for an out-of-range value.

    Returns:
        The value.

    Raises:
        ArgumentTypeError: not an int.
        ValueError: (`error`) out of range.
    """
    if not _is_int(value):
        raise ArgumentTypeError(f"{where} must be an int, got {describe(value)}")
    _check_range(where, value, minimum, maximum, error)
    return value


def require_number(
    where: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
    error: type[ValueError] = ConfigError,
) -> float:
    """Check that `value` is a finite real number (int or float, not a bool) within [minimum, maximum].

    Args:
        where: the argument as messages name it.
        value: the value received.
        minimum: smallest allowed value (None: unbounded).
        maximum: largest allowed value (None: unbounded).
        error: the ValueError subclass raised for a non-finite or out-of-range value.

    Returns:
        The value.

    Raises:
        ArgumentTypeError: not a number.
        ValueError: (`error`) NaN, infinite or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{where} must be a number, got {describe(value)}")
    if not math.isfinite(value):
        raise error(f"{where} must be a finite number, got {value}")
    _check_range(where, value, minimum, maximum, error)
    return value


def _check_range(where: str, value: float, minimum: float | None, maximum: float | None,
                 error: type[ValueError]) -> None:
    if minimum is not None and value < minimum:
        raise error(f"{where} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{where} must be <= {maximum}, got {value}")


def require_bool(where: str, value: Any) -> bool:
    """Check that `value` is True or False (a truthy string like "no" must not silently mean yes).

    Raises:
        ArgumentTypeError: not a bool.
    """
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{where} must be True or False, got {describe(value)}")
    return value


def require_str(where: str, value: Any, *, optional: bool = False) -> str | None:
    """Check that `value` is a string (or None when `optional`).

    Raises:
        ArgumentTypeError: anything else.
    """
    if value is None and optional:
        return None
    if not isinstance(value, str):
        expected = "a string or None" if optional else "a string"
        raise ArgumentTypeError(f"{where} must be {expected}, got {describe(value)}")
    return value


# ---- LLM(...) ---------------------------------------------------------------------------------------------
def check_llm_arguments(
    *, model: Any, load_format: Any, dtype: Any, device: Any, seed: Any, draft: Any, expert_dtype: Any,
    activation_dtype: Any = None,
    max_num_seqs: Any, max_num_batched_tokens: Any, max_model_len: Any, compile: Any,
    num_speculative_tokens: Any = None, speculation_max_batch: Any = None, tensor_parallel_size: Any = 1,
    expert_parallel: Any = False, distributed_timeout_s: Any = None, outputs_on_all_ranks: Any = True,
    share_prompt_prefill: Any = True,
) -> None:
    """The type and range checks of `LLM(...)`'s arguments that need no checkpoint. The choices of
    `load_format`, `dtype`, `activation_dtype`, `draft` and `expert_dtype` are checked by the code that owns
    each table, still before any weight is read.

    Raises:
        ArgumentTypeError: an argument of the wrong type.
        ConfigError: an out-of-range value, or a device this machine does not have.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"LLM: model must be a checkpoint directory (str or Path), an embedded model's name, or None, "
            f"got {describe(model)}"
        )
    for name, value in (("load_format", load_format), ("dtype", dtype)):
        require_str(f"LLM: {name}", value)
    for name, value in (("draft", draft), ("expert_dtype", expert_dtype), ("activation_dtype", activation_dtype)):
        require_str(f"LLM: {name}", value, optional=True)
    require_int("LLM: seed", seed, minimum=0, maximum=MAX_SEED)
    for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
        if value is not None:
            require_int(f"LLM: {name}", value, minimum=1)
    require_bool("LLM: compile", compile)
    if num_speculative_tokens is not None:
        from dsv4.engine.speculation import MAX_SPECULATIVE_TOKENS

        require_int("LLM: num_speculative_tokens", num_speculative_tokens, minimum=1, maximum=MAX_SPECULATIVE_TOKENS)
        if draft is None:
            raise ConfigError("LLM: num_speculative_tokens needs a drafter (draft='mtp')")
    if speculation_max_batch is not None:
        require_int("LLM: speculation_max_batch", speculation_max_batch, minimum=0)
    require_int("LLM: tensor_parallel_size", tensor_parallel_size, minimum=1)
    require_bool("LLM: expert_parallel", expert_parallel)
    require_bool("LLM: outputs_on_all_ranks", outputs_on_all_ranks)
    require_bool("LLM: share_prompt_prefill", share_prompt_prefill)
    if distributed_timeout_s is not None and require_number("LLM: distributed_timeout_s", distributed_timeout_s) <= 0:
        raise ConfigError(f"LLM: distributed_timeout_s must be a positive number of seconds, "
                          f"got {distributed_timeout_s}")
    if tensor_parallel_size > 1 and compile:
        raise ConfigError("LLM: compile=True runs in one process only; the compiled decode step has no "
                          "collectives (tensor_parallel_size must be 1)")
    check_device(device)


def check_device(device: Any) -> None:
    """Check that `device` names a device this process can use.

    Raises:
        ArgumentTypeError: not a string or torch.device.
        ConfigError: unparsable, an unsupported type, or not present (e.g. "cuda" on a CPU-only torch).
    """
    import torch  # the caller is about to load weights; the CLI never calls this before a command runs

    if not isinstance(device, (str, torch.device)):
        raise ArgumentTypeError(f"LLM: device must be a string such as 'cpu' or 'cuda:0', got {describe(device)}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"LLM: device {device!r} is not a device name (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if parsed.type not in DEVICE_TYPES:
        raise ConfigError(f"LLM: device {device!r}: dsv4 runs on {' or '.join(DEVICE_TYPES)}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"LLM: device {device!r}, but CUDA is not available to this torch ({torch.__version__}); "
                f"use device='cpu'"
            )
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(f"LLM: device {device!r}, but this machine has {count} CUDA device(s)")


# ---- generate / stream / chat -----------------------------------------------------------------------------
def normalize_prompts(prompts: Any, where: str) -> list[str | list[int]]:
    """One prompt or a list of prompts -> a list of prompts, each a string or a list of token ids.

    A string or a flat list of ints is one prompt; a list whose items are strings or lists of ints is
    several. Token ids are checked for type here and against the vocabulary per request (`check_prompt_ids`).

    Args:
        prompts: what the caller passed.
        where: the calling function, for messages (e.g. ``"generate"``).

    Returns:
        The prompts as a new list.

    Raises:
        ArgumentTypeError: anything that is not a prompt or a list of prompts.
    """
    expected = "a string, a list of token ids, or a list of those"
    if isinstance(prompts, str):
        return [prompts]
    if not _is_sequence(prompts):
        raise ArgumentTypeError(f"{where}: prompts must be {expected}, got {describe(prompts)}")
    if prompts and all(_is_int(t) for t in prompts):
        return [list(prompts)]
    out: list[str | list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
            continue
        if not _is_sequence(prompt):
            raise ArgumentTypeError(
                f"{where}: prompts[{i}] must be a string or a list of token ids, got {describe(prompt)}"
            )
        for j, token in enumerate(prompt):
            if not _is_int(token):
                raise ArgumentTypeError(f"{where}: prompts[{i}][{j}] must be an int token id, got {describe(token)}")
        out.append(list(prompt))
    return out


def normalize_sampling_params(sampling_params: Any, count: int, where: str) -> list[SamplingParams]:
    """None, one SamplingParams, or one per prompt -> one per prompt.

    Raises:
        ArgumentTypeError: not a SamplingParams (a dict gets a hint to build one).
        RequestError: a list whose length differs from the number of prompts.
    """
    # Imported here: sampling_params.py uses this module's primitives.
    from dsv4.engine.sampling_params import SamplingParams

    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if isinstance(sampling_params, Mapping):
        raise ArgumentTypeError(
            f"{where}: sampling_params must be a SamplingParams, got {describe(sampling_params)}; "
            f"build one with SamplingParams(**params)"
        )
    if not _is_sequence(sampling_params):
        raise ArgumentTypeError(
            f"{where}: sampling_params must be a SamplingParams or a list of them (one per prompt), "
            f"got {describe(sampling_params)}"
        )
    params = list(sampling_params)
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ArgumentTypeError(f"{where}: sampling_params[{i}] must be a SamplingParams, got {describe(p)}")
    if len(params) != count:
        raise RequestError(f"{where}: {count} prompt(s) but {len(params)} sampling params; pass one or one per prompt")
    return params


def check_prompt_ids(ids: Sequence[int], vocab_size: int, request: str) -> None:
    """Every token id of one prompt inside the vocabulary.

    Args:
        ids: the prompt's token ids (already known to be ints).
        vocab_size: the model's vocabulary size.
        request: how messages name the prompt, e.g. ``"request 3"`` or ``"token_ids[0]"``.

    Raises:
        RequestError: naming the first bad id and its position.
    """
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise RequestError(
                f"{request}: token id {token} at position {position} is outside the vocabulary [0, {vocab_size})"
            )


def check_message(message: Any, where: str) -> None:
    """One chat message: a dict with a string 'role' and a string 'content'.

    Raises:
        ArgumentTypeError: naming the message and what is wrong with it.
    """
    if not isinstance(message, Mapping):
        raise ArgumentTypeError(f"{where} must be a dict with 'role' and 'content', got {describe(message)}")
    for key in (CHAT_ROLES_FIELD, CHAT_CONTENT_FIELD):
        if not isinstance(message.get(key), str):
            raise ArgumentTypeError(f"{where}[{key!r}] must be a string, got {describe(message.get(key))}")


def normalize_conversations(messages: Any, where: str) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of conversations -> a list of conversations.

    Raises:
        ArgumentTypeError: not a list of message dicts (or of such lists), or a malformed message.
        RequestError: an empty conversation.
    """
    expected = "a list of {'role': ..., 'content': ...} dicts, or a list of such lists"
    if not _is_sequence(messages):
        raise ArgumentTypeError(f"{where}: messages must be {expected}, got {describe(messages)}")
    if not messages:
        raise RequestError(f"{where}: messages is empty")
    single = isinstance(messages[0], Mapping)
    conversations = [messages] if single else list(messages)
    for c, conversation in enumerate(conversations):
        name = "messages" if single else f"messages[{c}]"
        if not _is_sequence(conversation):
            raise ArgumentTypeError(f"{where}: {name} must be a list of message dicts, got {describe(conversation)}")
        if not conversation:
            raise RequestError(f"{where}: {name} is an empty conversation")
        for m, message in enumerate(conversation):
            check_message(message, f"{where}: {name}[{m}]")
    return [list(c) for c in conversations]


# ---- forward_logprobs -------------------------------------------------------------------------------------
def normalize_token_sequences(token_ids: Any, vocab_size: int, max_model_len: int, where: str) -> list[list[int]]:
    """A list of token-id sequences to score, each non-empty, in the vocabulary and within max_model_len.

    Raises:
        ArgumentTypeError: not a list of lists of ints.
        RequestError: no sequence, an empty one, an id outside the vocabulary, or one longer than max_model_len.
    """
    if not _is_sequence(token_ids) or (token_ids and _is_int(token_ids[0])):
        raise ArgumentTypeError(
            f"{where}: token_ids must be a list of token-id lists (e.g. [[1, 2, 3]]), got {describe(token_ids)}"
        )
    if not token_ids:
        raise RequestError(f"{where}: token_ids holds no sequence")
    out = []
    for i, ids in enumerate(token_ids):
        if not _is_sequence(ids):
            raise ArgumentTypeError(f"{where}: token_ids[{i}] must be a list of token ids, got {describe(ids)}")
        for j, token in enumerate(ids):
            if not _is_int(token):
                raise ArgumentTypeError(f"{where}: token_ids[{i}][{j}] must be an int token id, got {describe(token)}")
        if not ids:
            raise RequestError(f"{where}: token_ids[{i}] is empty")
        if len(ids) > max_model_len:
            raise RequestError(
                f"{where}: token_ids[{i}] has {len(ids)} tokens, more than max_model_len={max_model_len}"
            )
        check_prompt_ids(ids, vocab_size, f"{where}: token_ids[{i}]")
        out.append(list(ids))
    return out


# ---- weights ----------------------------------------------------------------------------------------------
def check_weight_pairs(weights: Any, where: str) -> None:
    """A bucket of weights: a mapping of name -> tensor, or an iterable of (name, tensor) pairs. The items
    themselves are checked by the weight update session as they stream.

    Raises:
        ArgumentTypeError: a string, a tensor, or anything that is not iterable.
    """
    if isinstance(weights, Mapping):
        return
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable) or hasattr(weights, "dim"):
        raise ArgumentTypeError(
            f"{where}: weights must be a dict of name -> tensor or an iterable of (name, tensor) pairs, "
            f"got {describe(weights)}"
        )


def check_path(where: str, value: Any) -> None:
    """A filesystem path argument.

    Raises:
        ArgumentTypeError: not a str or os.PathLike.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{where} must be a path (str or Path), got {describe(value)}")
