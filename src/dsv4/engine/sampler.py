"""Token sampling for one step, plus logprob extraction.

The sampler turns a batch of next-token logits into one token per row. Each
row carries its own settings (`SamplingParams`) and seed, so that:

* greedy rows (temperature 0) are an exact, batched ``argmax``;
* seeded rows draw the randomness of a token from a generator seeded with
  (seed, index of the token in its completion) (`draw_seed`), a fixed amount
  per token (one exponential per vocab entry). A token's sample is therefore
  the same whether the row runs alone or in any batch, at any batch position,
  after a preemption, or as one of several rows of a speculative verify chunk;
* unseeded rows draw from a per-device generator owned by the `Sampler` and
  seeded from the constructor's ``default_seed`` (no global RNG is touched).

Speculative decoding (engine/speculation.py) adds two uses, each drawing from its own stream of
(seed, index) generators (`draw_seed`'s ``stream``) so that no draw is shared between them:

* a drafter samples its draft tokens with a `Sampler` of its own stream (``DRAFT_STREAM``), asking for
  the distribution each row was sampled from (``return_probs``: q; one-hot for greedy rows);
* the engine's verify rows carry a proposal (draft token, q): a random row keeps the draft with
  probability min(1, p/q) (a uniform of ``ACCEPT_STREAM``) and otherwise samples the residual
  norm(max(p - q, 0)) with the row's ordinary draws, so its token is distributed as p (Leviathan et al.,
  Chen et al.). A greedy row keeps the draft iff it is the argmax. Either way the row's token equals
  the draft exactly when the draft is accepted.

Sampling uses the exponential race ("Gumbel-max" in exponential form): with
``q_i ~ Exp(1)`` i.i.d., ``argmax_i p_i / q_i`` is distributed as ``p``. Unlike
``torch.multinomial`` it needs no per-row kernel beyond drawing ``q``, and the
division plus ``argmax`` run batched over all random rows.

The per-row settings of a step (`SamplingRows`: parameter tensors, which rows
are greedy / random / want logprobs) are built once per batch composition:
the engine keeps a `SamplingBatch`, one row per cache slot, written when a
sequence takes a slot and cleared when it leaves, and asks it for the rows of
a step; the same slots as the previous step reuse the previous step's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.engine.sampling_params import SamplingParams
from dsv4.kernels.registry import GREEDY_ARGMAX, KernelRegistry

#: Rows of prompt logits turned into logprobs at a time: a [T, V] fp32
#: log-softmax of a long prompt over a ~130k vocab would not fit in memory.
PROMPT_LOGPROBS_CHUNK_ROWS = 512

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# Per-request state and outputs
# ---------------------------------------------------------------------------


@dataclass
class SamplingState:
    """The sampling identity of one completion, for callers that sample row by row (`Sampler.sample`).

    Holds the request's params, the completion's seed and how many tokens it has drawn (the index of the
    next token's draws). Create with `SamplingState.from_params`. The engine does not use it: it keeps
    params and seeds per cache slot (`SamplingBatch`) and passes token indices itself.
    """

    params: SamplingParams
    #: Seed of this completion, or None to use the sampler's default generator.
    seed: int | None = None
    #: Tokens sampled so far; `Sampler.sample` advances it by one per call.
    drawn: int = 0

    @classmethod
    def from_params(cls, params: SamplingParams, sample_index: int = 0) -> SamplingState:
        """State for completion number ``sample_index`` (``0 <= i < params.n``).

        With ``params.n > 1`` and a seed, completion ``i`` is seeded with
        ``seed + i`` (as vLLM does) so the ``n`` completions differ but each is
        reproducible.

        Raises:
            ValueError: ``sample_index`` outside ``[0, params.n)``.
        """
        if not 0 <= sample_index < params.n:
            raise ValueError(f"sample_index must be in [0, {params.n}), got {sample_index}")
        seed = None if params.seed is None else params.seed + sample_index
        return cls(params=params, seed=seed)


_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1  # torch.Generator.manual_seed takes a signed 64-bit value


def _splitmix64(x: int) -> int:
    """The splitmix64 finalizer: a bijective 64-bit mix in which every output bit depends on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


#: Streams of draws (`draw_seed`): the target's samples, a drafter's samples, the acceptance uniforms.
SAMPLE_STREAM, DRAFT_STREAM, ACCEPT_STREAM = 0, 1, 2


def draw_seed(seed: int, index: int, stream: int = SAMPLE_STREAM) -> int:
    """The generator seed for token ``index`` of a completion seeded with ``seed``.

    Mixed so that neighbouring (seed, index) pairs give unrelated streams; the high half is folded into
    the low 32 bits because a CPU generator's Mersenne Twister only reads those.

    Args:
        seed: the completion's seed (any int).
        index: the token's index among the completion's generated tokens.
        stream: which use the draws are for (SAMPLE_STREAM, DRAFT_STREAM, ACCEPT_STREAM).

    Returns:
        A non-negative seed for `torch.Generator.manual_seed`.
    """
    base = _splitmix64(seed & _MASK64)
    if stream != SAMPLE_STREAM:
        base = _splitmix64(base ^ _splitmix64(stream))
    mixed = _splitmix64(base ^ index)
    return (mixed ^ (mixed >> 32)) & _MASK63


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
        probs: with ``return_probs``, fp32 [B, V]: the distribution each row's token was drawn from
            (the processed softmax; one-hot at the argmax for greedy rows); else None.
    """

    token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class Proposal:
    """A draft token for one row to accept or reject (speculative decoding).

    Attributes:
        token_id: the draft token.
        probs: fp32 [V] the distribution it was sampled from (q), or None when it was chosen
            deterministically (the row then keeps it iff its ordinary sample equals it).
    """

    token_id: int
    probs: torch.Tensor | None


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


def _param_values(p: SamplingParams) -> tuple[float, int, float, float]:
    """(temperature, top_k, top_p, min_p) as `process_logits` takes them.

    Greedy rows get temperature 1: they only reach processing when they ask
    for "processed" logprobs, which are then those of the unscaled,
    filtered distribution (the vLLM convention).
    """
    return (p.temperature if p.temperature > 0 else 1.0), p.top_k, p.top_p, p.min_p


def _param_tensors(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R] temperature / top_k / top_p / min_p tensors for `process_logits`."""
    temperature, top_k, top_p, min_p = zip(*(_param_values(p) for p in params))
    return (
        torch.tensor(temperature, dtype=torch.float32, device=device),
        torch.tensor(top_k, dtype=torch.int64, device=device),
        torch.tensor(top_p, dtype=torch.float32, device=device),
        torch.tensor(min_p, dtype=torch.float32, device=device),
    )


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
# The rows of a step
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SamplingRows:
    """Everything the sampler needs to know about the rows of one call, besides the logits and the
    token indices: built once per batch composition (`SamplingBatch.rows`), not per step.

    Attributes:
        params: per row, the request's settings.
        seeds: per row, the completion's seed (None: the sampler's default generator).
        greedy_rows / random_rows: the rows chosen by argmax / by a random draw.
        processed_rows: rows whose processed distribution is needed (random rows, and rows that want
            "processed" logprobs), ascending; processed_pos maps a row to its place among them.
        processed_params: [P] temperature / top_k / top_p / min_p tensors of the processed rows.
        greedy_index / random_index / processed_index: the same row lists as device tensors.
        random_pos: place of each random row among the processed rows (None when they are the same rows).
    """

    params: tuple[SamplingParams, ...]
    seeds: tuple[int | None, ...]
    greedy_rows: list[int]
    random_rows: list[int]
    processed_rows: list[int]
    processed_pos: dict[int, int]
    processed_params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    greedy_index: torch.Tensor
    random_index: torch.Tensor
    processed_index: torch.Tensor
    random_pos: torch.Tensor | None

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], seeds: Sequence[int | None], device: torch.device,
        processed_params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingRows:
        """Classify the rows and build their index and parameter tensors.

        Args:
            params: per row, the request's settings.
            seeds: per row, the completion's seed or None.
            device: the logits' device.
            processed_params: the [P] parameter tensors of the processed rows when the caller already
                holds them (`SamplingBatch`), else built here.

        Returns:
            The rows.
        """
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        wants_processed = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "processed"]
        processed_rows = sorted(set(random_rows) | set(wants_processed))
        processed_pos = {row: j for j, row in enumerate(processed_rows)}
        if processed_rows and processed_params is None:
            processed_params = _param_tensors([params[i] for i in processed_rows], device)
        same = random_rows == processed_rows
        return cls(
            params=tuple(params),
            seeds=tuple(seeds),
            greedy_rows=greedy_rows,
            random_rows=random_rows,
            processed_rows=processed_rows,
            processed_pos=processed_pos,
            processed_params=processed_params if processed_rows else None,
            greedy_index=torch.tensor(greedy_rows, dtype=torch.int64, device=device),
            random_index=torch.tensor(random_rows, dtype=torch.int64, device=device),
            processed_index=torch.tensor(processed_rows, dtype=torch.int64, device=device),
            random_pos=None if same else torch.tensor([processed_pos[i] for i in random_rows], device=device),
        )

    def __len__(self) -> int:
        return len(self.params)


class SamplingBatch:
    """The sampling settings of the sequences that hold cache slots, one row per slot, kept across steps.

    `add` writes a slot's row when a sequence takes it (admission), `remove` clears it when the
    sequence leaves (finish, abort, preemption). `rows(slots)` returns the `SamplingRows` of a step
    whose rows belong to those slots, in that order; while no slot joined or left and the step's slots
    are the same as the previous step's, it returns the previous rows without building anything.

    Args:
        num_slots: cache slots.
        device: the device the logits live on.
    """

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._params: list[SamplingParams | None] = [None] * num_slots
        self._seeds: list[int | None] = [None] * num_slots
        # Per-slot parameter tensors, written in place on join; a step gathers its processed rows' entries.
        self._temperature = torch.ones(num_slots, dtype=torch.float32, device=self.device)
        self._top_k = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self._top_p = torch.ones(num_slots, dtype=torch.float32, device=self.device)
        self._min_p = torch.zeros(num_slots, dtype=torch.float32, device=self.device)
        self._last: tuple[tuple[int, ...], SamplingRows] | None = None
        self.builds = 0  # how many times `rows` built new rows (for tests: reuse is observable)

    def add(self, slot: int, params: SamplingParams, seed: int | None) -> None:
        """A sequence took `slot`: its settings become that slot's row."""
        self._params[slot], self._seeds[slot] = params, seed
        temperature, top_k, top_p, min_p = _param_values(params)
        self._temperature[slot] = temperature
        self._top_k[slot] = top_k
        self._top_p[slot] = top_p
        self._min_p[slot] = min_p
        self._last = None

    def remove(self, slot: int) -> None:
        """The sequence holding `slot` left it."""
        self._params[slot] = self._seeds[slot] = None
        self._last = None

    def rows(self, slots: Sequence[int]) -> SamplingRows:
        """The rows of a step whose row i samples for the sequence in `slots[i]` (a slot may repeat:
        a verify chunk samples several rows of one sequence).

        Raises:
            ValueError: a slot that holds no sequence.
        """
        key = tuple(slots)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        params = []
        for slot in key:
            p = self._params[slot]
            if p is None:
                raise ValueError(f"sampling row requested for cache slot {slot}, which holds no sequence")
            params.append(p)
        processed = [i for i, p in enumerate(params)
                     if not p.greedy or (p.logprobs is not None and p.logprobs_mode == "processed")]
        tensors = None
        if processed:
            index = torch.tensor([key[i] for i in processed], dtype=torch.int64, device=self.device)
            per_slot = (self._temperature, self._top_k, self._top_p, self._min_p)
            tensors = tuple(t.index_select(0, index) for t in per_slot)
        rows = SamplingRows.build(params, [self._seeds[s] for s in key], self.device, tensors)
        self._last = (key, rows)
        self.builds += 1
        return rows


# ---------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------


def greedy_tokens(logits: torch.Tensor, kernels: KernelRegistry | None = None) -> torch.Tensor:
    """[B, V] logits -> [B] int64: each row's argmax, the first (lowest) id on ties; what every greedy row
    samples. `kernels`' GREEDY_ARGMAX where it runs the call (fp32 CPU rows: `gemv_cpu.RowArgmax`, ~9x
    faster), else `max(...).indices` (torch.argmax's choice at ~2x its speed on CPU), which it equals."""
    kernel = None if kernels is None else kernels.kernel(GREEDY_ARGMAX, logits)
    return kernel(logits) if kernel is not None else logits.max(dim=-1).indices


class Sampler:
    """Samples one token per row from a step's logits.

    Args:
        default_seed: seed of the generator used by rows whose request has no
            seed (one generator per device, created on first use).
        stream: which stream of draws (the target's, or a drafter's).
        kernels: the model's kernel registry, whose greedy argmax greedy rows use (None: torch's).
    """

    def __init__(self, default_seed: int = 0, stream: int = SAMPLE_STREAM,
                 kernels: KernelRegistry | None = None) -> None:
        self.default_seed = default_seed
        self.stream = stream
        self.kernels = kernels  # the model's registry: its greedy argmax (`greedy_tokens`); None: torch's
        self._default_generators: dict[torch.device, torch.Generator] = {}
        # One generator per device for seeded rows, re-seeded for every token it draws.
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def _default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._default_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            # Stream 0 keeps the plain seed; a drafter's stream gets unrelated draws from the same seed.
            seed = self.default_seed if self.stream == SAMPLE_STREAM else draw_seed(self.default_seed, 0, self.stream)
            generator.manual_seed(seed)
            self._default_generators[device] = generator
        return generator

    def _seeded_generator(self, device: torch.device, seed: int, index: int, stream: int) -> torch.Generator:
        generator = self._seeded_generators.get(device)
        if generator is None:
            generator = self._seeded_generators[device] = torch.Generator(device=device)
        return generator.manual_seed(draw_seed(seed, index, stream))

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Pick one token per row, each row's settings and token index from its state.

        Args:
            logits: [B, V] next-token logits (fp32; other float dtypes are upcast).
            states: B per-completion states, in row order; each one's `drawn` advances by one.

        Returns:
            `SamplerOutput` with [B] token ids and B optional logprob records.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"expected logits [B, V] with B = len(states) = {len(states)}, got {tuple(logits.shape)}"
            )
        rows = SamplingRows.build([s.params for s in states], [s.seed for s in states], logits.device)
        out = self.sample_rows(logits, rows, [s.drawn for s in states])
        for state in states:
            state.drawn += 1
        return out

    __call__ = sample

    def sample_rows(
        self, logits: torch.Tensor, rows: SamplingRows, token_indices: Sequence[int],
        proposals: Sequence[Proposal | None] | None = None, return_probs: bool = False,
        argmax: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Pick one token per row.

        Args:
            logits: [B, V] next-token logits (fp32; other float dtypes are upcast).
            rows: the B rows' settings (`SamplingRows.build` or `SamplingBatch.rows`).
            token_indices: per row, the index of the token it samples among its completion's generated
                tokens (seeded rows draw from (seed, index)).
            proposals: per row, a draft to accept or reject (module docstring), or None.
            return_probs: also return the distribution each row was drawn from (`SamplerOutput.probs`).
            argmax: [B] int64 each row's argmax (the first largest id) where the caller has it already (a
                replayed decode step computes it with the logits): an all-greedy call takes it as its tokens.

        Returns:
            `SamplerOutput` with [B] token ids and B optional logprob records.

        Raises:
            ValueError: logits or token_indices that do not have one entry per row; a proposal whose
                token has probability 0 under its own q.
        """
        if (logits.dim() != 2 or logits.shape[0] != len(rows) or len(token_indices) != len(rows)
                or (argmax is not None and tuple(argmax.shape) != (len(rows),))):
            raise ValueError(
                f"expected logits [B, V], B token indices and an argmax of B rows (or none) with B = {len(rows)} "
                f"rows, got logits {tuple(logits.shape)}, {len(token_indices)} indices and argmax "
                f"{None if argmax is None else tuple(argmax.shape)}"
            )
        if logits.dtype != torch.float32:  # no op for fp32 (torch ops after a decode step: engine/decode_replay.py)
            logits = logits.float()
        batch = logits.shape[0]

        if len(rows.greedy_rows) == batch:  # all greedy (the common offline case): one argmax, no row gathers
            token_ids = argmax if argmax is not None else greedy_tokens(logits, self.kernels)
        else:
            token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
            if rows.greedy_rows:
                # Greedy uses the raw logits: temperature 0 is the limit of sharpening,
                # and top-k/top-p/min-p always keep the top token, so they cannot
                # change the argmax. torch.argmax returns the first (lowest) id on ties.
                token_ids[rows.greedy_index] = greedy_tokens(logits.index_select(0, rows.greedy_index), self.kernels)

        processed = None
        if rows.processed_rows:
            subset = logits if len(rows.processed_rows) == batch else logits.index_select(0, rows.processed_index)
            processed = process_logits(subset, *rows.processed_params)

        probs = None  # [R, V] of the random rows
        if rows.random_rows:
            # Same rows in the same order: no copy needed.
            random_logits = processed if rows.random_pos is None else processed.index_select(0, rows.random_pos)
            probs = random_logits.softmax(dim=-1)  # [R, V]
            draws = [(rows.seeds[i], token_indices[i]) for i in rows.random_rows]
            judged = []  # places among the random rows of rows with a draft and its q
            if proposals is not None:
                judged = [j for j, i in enumerate(rows.random_rows)
                          if proposals[i] is not None and proposals[i].probs is not None]
            if judged:
                judged_proposals = [proposals[rows.random_rows[j]] for j in judged]
                token_ids[rows.random_index] = self._judge(probs, draws, judged, judged_proposals)
            else:
                token_ids[rows.random_index] = self._race(probs, draws)

        out = SamplerOutput(token_ids=token_ids, logprobs=self._logprobs(logits, processed, rows, token_ids))
        if return_probs:
            out.probs = torch.zeros_like(logits)
            if rows.greedy_rows:
                out.probs[rows.greedy_index, token_ids[rows.greedy_index]] = 1.0
            if probs is not None:
                out.probs[rows.random_index] = probs
        return out

    def _judge(
        self, probs: torch.Tensor, draws: Sequence[tuple[int | None, int]], judged: Sequence[int],
        proposals: Sequence[Proposal],
    ) -> torch.Tensor:
        """Rejection sampling of the random rows `judged` (indices into probs' rows) against their
        proposals; the other rows sample as `_race` does.

        Row j keeps its draft x with probability min(1, p(x) / q(x)), drawn as u < p(x) / q(x) with
        u ~ U[0, 1) from the row's ACCEPT_STREAM generator; otherwise its token is drawn from
        norm(max(p - q, 0)) with the row's ordinary draws. The token is then distributed as p.

        Returns:
            [R] int64 token ids.
        """
        device = probs.device
        index = torch.tensor(judged, dtype=torch.int64, device=device)
        p = probs.index_select(0, index)  # [J, V]
        q = torch.stack([proposal.probs for proposal in proposals]).to(device=device, dtype=p.dtype)
        drafted = torch.tensor([proposal.token_id for proposal in proposals], dtype=torch.int64, device=device)
        p_x = p.gather(1, drafted.unsqueeze(1)).squeeze(1)
        q_x = q.gather(1, drafted.unsqueeze(1)).squeeze(1)
        if bool((q_x <= 0).any()):
            raise ValueError("a draft token has probability 0 under the distribution it was said to be sampled "
                             "from (Draft.probs must be exactly the drafter's q)")
        uniforms = torch.empty(len(judged), dtype=p.dtype, device=device)
        for j, row in enumerate(judged):
            seed, token_index = draws[row]
            generator = (self._default_generator(device) if seed is None
                         else self._seeded_generator(device, seed, token_index, ACCEPT_STREAM))
            uniforms[j : j + 1].uniform_(generator=generator)
        accepted = uniforms * q_x < p_x  # u < p/q without dividing by a tiny q
        residual = (p - q).clamp_(min=0)
        mass = residual.sum(dim=-1, keepdim=True)
        # Rejection needs p(x) < q(x), so some other token has p > q; a zero mass (p == q) is never rejected.
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(p.dtype).tiny), p)
        mixed = probs.clone()
        mixed[index] = residual
        tokens = self._race(mixed, draws)
        tokens[index] = torch.where(accepted, drafted, tokens.index_select(0, index))
        return tokens

    def _race(self, probs: torch.Tensor, draws: Sequence[tuple[int | None, int]]) -> torch.Tensor:
        """Exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per row.

        Args:
            probs: [R, V] probabilities (zeros for filtered tokens).
            draws: per row, (seed, token index): a seeded row's draws come from a generator seeded for
                exactly this token, so they do not depend on the rows around it; an unseeded row (seed
                None) draws from the sampler's default generator.

        Returns:
            [R] int64 sampled token ids.
        """
        q = torch.empty_like(probs)
        for row, (seed, index) in enumerate(draws):
            if seed is None:
                generator = self._default_generator(probs.device)
            else:
                generator = self._seeded_generator(probs.device, seed, index, self.stream)
            q[row].exponential_(generator=generator)  # exactly V numbers per row
        # exponential_ may return exactly 0; 0/0 would be NaN, which argmax
        # treats as the maximum and could pick a filtered-out token.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, processed: torch.Tensor | None, rows: SamplingRows, token_ids: torch.Tensor,
    ) -> list[TokenLogprobs | None]:
        """Per-row logprob records for the rows that asked for them."""
        params = rows.params
        out: list[TokenLogprobs | None] = [None] * len(params)
        device = logits.device
        raw_rows = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "raw"]
        proc_rows = [i for i, p in enumerate(params) if p.logprobs is not None and p.logprobs_mode == "processed"]
        for wanted, source, source_rows in (
            (raw_rows, logits, raw_rows),
            (proc_rows, processed, [rows.processed_pos[i] for i in proc_rows]),
        ):
            if not wanted:
                continue
            selected = source.index_select(0, torch.tensor(source_rows, device=device))
            chosen = token_ids.index_select(0, torch.tensor(wanted, device=device))
            records = _token_logprobs(selected.log_softmax(dim=-1), chosen, [params[i].logprobs for i in wanted])
            for row, record in zip(wanted, records):
                out[row] = record
        return out
