"""Token sampling for one decode step, plus logprob extraction.

The sampler turns a batch of next-token logits into one token per row. Each
row carries its own settings (`SamplingParams`) and its own random state
(`SamplingState`), so that:

* greedy rows (temperature 0) are an exact, batched ``argmax``;
* seeded rows draw their randomness only from their own ``torch.Generator``,
  and consume a fixed amount of it per step (one exponential per vocab entry),
  so their samples are identical whether they run alone or in any batch, at any
  batch position;
* unseeded rows draw from a per-device generator owned by the `Sampler` and
  seeded from the constructor's ``default_seed`` (no global RNG is touched).

Sampling uses the exponential race ("Gumbel-max" in exponential form): with
``q_i ~ Exp(1)`` i.i.d., ``argmax_i p_i / q_i`` is distributed as ``p``. Unlike
``torch.multinomial`` it needs no per-row kernel beyond drawing ``q``, and the
division plus ``argmax`` run batched over all random rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dsv4.engine.sampling_params import SamplingParams

#: Rows of prompt logits turned into logprobs at a time: a [T, V] fp32
#: log-softmax of a long prompt over a ~130k vocab would not fit in memory.
PROMPT_LOGPROBS_CHUNK_ROWS = 512

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# Per-request state and outputs
# ---------------------------------------------------------------------------


@dataclass
class SamplingState:
    """Per-request sampling state the caller keeps alive across steps.

    Holds the request's params and, when the request is seeded, its private
    random generator (created lazily on the device of the first logits it
    samples from, because a ``torch.Generator`` is bound to one device).

    Create with `SamplingState.from_params`.
    """

    params: SamplingParams
    #: Seed of this sequence's generator, or None to use the sampler's default.
    seed: int | None = None
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_params(cls, params: SamplingParams, sample_index: int = 0) -> SamplingState:
        """State for completion number ``sample_index`` (``0 <= i < params.n``).

        With ``params.n > 1`` and a seed, completion ``i`` is seeded with
        ``seed + i`` (as vLLM does) so the ``n`` completions differ but each is
        reproducible.
        """
        if not 0 <= sample_index < params.n:
            raise ValueError(f"sample_index must be in [0, {params.n}), got {sample_index}")
        seed = None if params.seed is None else params.seed + sample_index
        return cls(params=params, seed=seed)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """This request's generator on ``device``, or None if it is unseeded."""
        if self.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        elif self._generator.device != torch.device(device):
            # Silently reseeding on another device would replay the sequence.
            raise ValueError(
                f"SamplingState generator lives on {self._generator.device}, got logits on {device}"
            )
        return self._generator


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob information for one position.

    Attributes:
        token_id: the sampled (or, for prompts, the actual next) token.
        logprob: its logprob in the chosen distribution.
        rank: its 1-based rank in that distribution (1 = most likely).
        top: up to k most likely ``token id -> logprob`` entries, always also
            containing ``token_id`` (so it may hold k + 1 entries).
    """

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclass
class SamplerOutput:
    """Result of one `Sampler.sample` call.

    Attributes:
        token_ids: [B] int64 sampled tokens, on the logits' device.
        logprobs: B entries; None for rows that did not request logprobs.
    """

    token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None]


# ---------------------------------------------------------------------------
# Logit processing
# ---------------------------------------------------------------------------


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p, then min-p, row-wise.

    Args:
        logits: [B, V] float logits.
        temperature: [B] float, > 0 (callers map greedy rows to 1).
        top_k: [B] int; values <= 0 disable the filter.
        top_p: [B] float in (0, 1]; 1 disables the filter.
        min_p: [B] float in [0, 1]; 0 disables the filter.

    Returns:
        [B, V] processed logits: ``logits / temperature`` with filtered-out
        entries set to ``-inf``. The top token of each row is never removed.

    Every operation is row-independent, so a row's result does not depend on
    the other rows of the batch.
    """
    _batch, vocab = logits.shape
    scaled = logits / temperature.unsqueeze(1)

    use_top_k = (top_k > 0) & (top_k < vocab)
    use_top_p = top_p < 1
    use_min_p = min_p > 0
    if not bool((use_top_k | use_top_p | use_min_p).any()):
        return scaled

    # All three filters are defined on the ranking of tokens, so work in
    # descending order. A stable sort puts equal logits in ascending id order,
    # making top-k=1 pick exactly what argmax picks (the lowest id on ties).
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)

    if bool(use_top_k.any()):
        positions = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
        keep_count = torch.where(use_top_k, top_k, vocab).unsqueeze(1)  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(positions >= keep_count, _NEG_INF)

    if bool(use_top_p.any()):
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each position. Keeping positions whose preceding
        # mass is < top_p keeps the smallest prefix with mass >= top_p; the
        # first position has preceding mass exactly 0 and is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 are excluded explicitly: rounding can push the
        # cumulative sum to 1 before the tail and would drop tiny-prob tokens.
        drop = (mass_before >= top_p.unsqueeze(1)) & use_top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)

    if bool(use_min_p.any()):
        # min-p compares each prob with the max prob; the ratio is the same
        # before or after renormalisation, so the unnormalised softmax of the
        # already-filtered logits is fine. The max sits at sorted position 0.
        probs = sorted_logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs[:, :1]
        sorted_logits = sorted_logits.masked_fill(probs < threshold, _NEG_INF)

    # Undo the sort: position j of a row holds the entry of token sorted_ids[j].
    return torch.empty_like(scaled).scatter_(1, sorted_ids, sorted_logits)


def _param_tensors(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R] temperature / top_k / top_p / min_p tensors for `process_logits`.

    Greedy rows get temperature 1: they only reach processing when they ask
    for "processed" logprobs, which are then those of the unscaled,
    filtered distribution (the vLLM convention).
    """
    temperature = torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params],
        dtype=torch.float32,
        device=device,
    )
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p, min_p


# ---------------------------------------------------------------------------
# Logprob extraction
# ---------------------------------------------------------------------------


def _token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, ks: Sequence[int]
) -> list[TokenLogprobs]:
    """Extract per-row logprob info.

    Args:
        logprobs: [R, V] log-probabilities.
        token_ids: [R] int64 chosen tokens.
        ks: R requested top-k counts.
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [R]
    max_k = max(ks, default=0)
    if max_k > 0:
        top_values, top_ids = logprobs.topk(max_k, dim=-1)  # [R, max_k]
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    else:
        top_values_list = top_ids_list = [[] for _ in ks]

    # One host transfer per tensor rather than per element.
    chosen_list = chosen.squeeze(1).tolist()
    ranks_list = ranks.tolist()
    token_list = token_ids.tolist()
    out = []
    for row, k in enumerate(ks):
        top = dict(zip(top_ids_list[row][:k], top_values_list[row][:k]))
        top[token_list[row]] = chosen_list[row]
        out.append(
            TokenLogprobs(
                token_id=token_list[row],
                logprob=chosen_list[row],
                rank=ranks_list[row],
                top=top,
            )
        )
    return out


def prompt_logprobs(
    logits: torch.Tensor,
    next_ids: torch.Tensor,
    k: int,
    mode: str = "raw",
    params: SamplingParams | None = None,
) -> list[TokenLogprobs | None]:
    """Logprobs of the prompt tokens.

    Args:
        logits: [T, V] logits at prompt positions 0..T-1 (row t predicts token t+1).
        next_ids: [T] the prompt tokens 1..T (``prompt_ids[1:]``).
        k: number of top alternatives per position (0 = only the actual token).
        mode: "raw" or "processed" (see `SamplingParams.logprobs_mode`).
        params: required for mode "processed" (its temperature and filters).

    Returns:
        T + 1 entries, one per prompt token; the first is None because the
        first prompt token has no preceding context to predict it (as in vLLM).
    """
    if logits.dim() != 2 or next_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and next_ids [T], got {tuple(logits.shape)} and {tuple(next_ids.shape)}"
        )
    if mode == "processed" and params is None:
        raise ValueError("prompt_logprobs mode 'processed' needs the request's params")
    if mode not in ("raw", "processed"):
        raise ValueError(f"unknown logprobs mode {mode!r}")

    out: list[TokenLogprobs | None] = [None]
    next_ids = next_ids.to(device=logits.device, dtype=torch.int64)
    for start in range(0, logits.shape[0], PROMPT_LOGPROBS_CHUNK_ROWS):
        chunk = logits[start : start + PROMPT_LOGPROBS_CHUNK_ROWS].float()
        if mode == "processed":
            chunk = process_logits(chunk, *_param_tensors([params] * chunk.shape[0], chunk.device))
        ids = next_ids[start : start + PROMPT_LOGPROBS_CHUNK_ROWS]
        out.extend(_token_logprobs(chunk.log_softmax(dim=-1), ids, [k] * chunk.shape[0]))
    return out


# ---------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------


class Sampler:
    """Samples one token per row from a step's logits.

    Args:
        default_seed: seed of the generator used by rows whose request has no
            seed (one generator per device, created on first use).
    """

    def __init__(self, default_seed: int = 0) -> None:
        self.default_seed = default_seed
        self._default_generators: dict[torch.device, torch.Generator] = {}

    def _default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._default_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.default_seed)
            self._default_generators[device] = generator
        return generator

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Pick one token per row.

        Args:
            logits: [B, V] next-token logits (fp32; other float dtypes are upcast).
            states: B per-request states, in row order. Seeded states' generators
                advance by exactly one step's worth of randomness per call.

        Returns:
            `SamplerOutput` with [B] token ids and B optional logprob records.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"expected logits [B, V] with B = len(states) = {len(states)}, got {tuple(logits.shape)}"
            )
        logits = logits.float()
        device = logits.device
        batch = logits.shape[0]
        params = [s.params for s in states]

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        wants_processed = [
            i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "processed"
        ]
        # Rows whose processed distribution is needed, and where each sits in it.
        processed_rows = sorted(set(random_rows) | set(wants_processed))
        processed_pos = {row: j for j, row in enumerate(processed_rows)}

        token_ids = torch.empty(batch, dtype=torch.int64, device=device)

        if len(greedy_rows) == batch:  # all greedy (the common offline case): one argmax, no row gathers
            token_ids = logits.max(dim=-1).indices  # first max on ties, like argmax; ~2x faster on CPU
        elif greedy_rows:
            # Greedy uses the raw logits: temperature 0 is the limit of sharpening,
            # and top-k/top-p/min-p always keep the top token, so they cannot
            # change the argmax. torch.argmax returns the first (lowest) id on ties.
            greedy_index = torch.tensor(greedy_rows, device=device)
            token_ids[greedy_index] = logits.index_select(0, greedy_index).argmax(dim=-1)

        processed = None
        if processed_rows:
            rows_index = torch.tensor(processed_rows, device=device)
            subset = logits if len(processed_rows) == batch else logits.index_select(0, rows_index)
            processed = process_logits(
                subset, *_param_tensors([params[i] for i in processed_rows], device)
            )

        if random_rows:
            if len(random_rows) == len(processed_rows):
                random_logits = processed  # same rows, same order: no copy needed
            else:
                random_pos = torch.tensor([processed_pos[i] for i in random_rows], device=device)
                random_logits = processed.index_select(0, random_pos)
            probs = random_logits.softmax(dim=-1)  # [R, V]
            token_ids[torch.tensor(random_rows, device=device)] = self._race(
                probs, [states[i] for i in random_rows]
            )

        return SamplerOutput(
            token_ids=token_ids,
            logprobs=self._logprobs(logits, processed, processed_pos, token_ids, params),
        )

    __call__ = sample

    def _race(self, probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per row.

        Args:
            probs: [R, V] probabilities (zeros for filtered tokens).
            states: the R rows' states, supplying each row's generator.

        Returns:
            [R] int64 sampled token ids.
        """
        q = torch.empty_like(probs)
        for row, state in enumerate(states):
            # Each row draws exactly V numbers from its own generator, which is
            # what makes seeded rows independent of the batch around them.
            generator = state.generator(probs.device)
            if generator is None:
                generator = self._default_generator(probs.device)
            q[row].exponential_(generator=generator)
        # exponential_ may return exactly 0; 0/0 would be NaN, which argmax
        # treats as the maximum and could pick a filtered-out token.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        processed: torch.Tensor | None,
        processed_pos: dict[int, int],
        token_ids: torch.Tensor,
        params: Sequence[SamplingParams],
    ) -> list[TokenLogprobs | None]:
        """Per-row logprob records for the rows that asked for them."""
        out: list[TokenLogprobs | None] = [None] * len(params)
        device = logits.device
        raw_rows = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "raw"]
        proc_rows = [
            i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "processed"
        ]
        for rows, source, source_rows in (
            (raw_rows, logits, raw_rows),
            (proc_rows, processed, [processed_pos[i] for i in proc_rows]),
        ):
            if not rows:
                continue
            selected = source.index_select(0, torch.tensor(source_rows, device=device))
            chosen = token_ids.index_select(0, torch.tensor(rows, device=device))
            records = _token_logprobs(
                selected.log_softmax(dim=-1), chosen, [params[i].logprobs for i in rows]
            )
            for row, record in zip(rows, records):
                out[row] = record
        return out
