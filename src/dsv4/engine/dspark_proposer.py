"""DSpark as the engine's drafter: the `Proposer` (speculation.py) over a loaded `DSparkDrafter`.

Each step the engine asks for drafts, the target verifies them, and the engine reports which positions
became final. This proposer keeps one DSpark context ring per engine cache slot and

  on_commit   turns the target's features at the final positions into context keys (prefill chunks; after
              a verify, the anchor and the accepted drafts). Rejected drafts are never reported, so the
              rings only ever hold committed positions and need no rewind of their own;
  propose     drafts one block per sequence in one drafter pass (the Markov loop, `dspark_draft.draft`),
              and offers the prefix the confidence head trusts (`verify_width` against a threshold), each
              draft with exactly the distribution q it was drawn from (`Draft.probs`), which rejection
              sampling needs;
  on_release  empties the slot's ring (the sequence ended or was preempted: it recommits from position 0).

Features. DSpark reads the streams of the target layers `capture_layers` (the outputs of
`dspark_target_layer_ids`; V4.1: their inputs). The proposer declares them (`Proposer.capture_layers`), so
the engine runs the target with `forward(capture_layers=...)` and hands `on_commit` those layers' streams
of the committed rows (`captured`) next to the final streams. The compiled decode step (`compile=True`)
returns no layer captures (static_decode.py), so it is refused here.

Commits are batched: `on_commit` only computes the rows' features; the next `propose` (or `flush`) turns
every pending row of the step into context keys with one pass of main_proj / main_norm / wkv.

Draws. A sampled draft uses a generator of its own, seeded from the request's seed (the engine's seed for
unseeded requests) and the sequence's length, so drafting never touches the target sampler's random
stream, and a seeded request drafts the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from dsv4.engine.dspark_draft import DraftSampling, draft, verify_width
from dsv4.engine.limits import EngineLimits
from dsv4.engine.sequence import Sequence
from dsv4.engine.speculation import Draft
from dsv4.errors import ConfigError
from dsv4.model.dspark import DSparkDrafter
from dsv4.model.dspark_cache import DSparkCache
from dsv4.weights.loader import LoadedModels

DSPARK = "dspark"
# The default verify threshold on the confidence head's running product: verify the drafts whose estimated
# probability of all surviving is at least this. A low bar: an accepted draft saves a whole target step,
# while a rejected one only adds a row to the verify chunk (on the embedded model a 6-row step costs about
# 2x a 1-row step), so only drafts the head considers unlikely to survive are left out.
DEFAULT_VERIFY_THRESHOLD = 0.1
# Mixing constants of the draft seeds (odd 64-bit multipliers: neighbouring seeds and lengths land far apart).
_SEED_MULTIPLIER = 0x9E3779B97F4A7C15
_LENGTH_MULTIPLIER = 0xBF58476D1CE4E5B9
_SEED_MASK = (1 << 63) - 1


@dataclass
class _PendingCommit:
    """Final positions [start, start + features rows) of one slot, not yet in its context ring."""

    slot: int
    start: int
    features: torch.Tensor  # [rows, D * len(target_layer_ids)]
    positions: torch.Tensor  # [rows] int64


@dataclass
class ProposerStats:
    """Counters over the proposer's life: verify chunks it drafted for, drafts offered, and drafts the
    target kept (known for chunks whose sequence went on; one that finished inside its chunk is counted in
    `verifies` and `drafted` only)."""

    verifies: int = 0  # verify chunks drafted for (one per sequence and step)
    drafted: int = 0  # drafts offered in them
    judged_verifies: int = 0  # those whose outcome on_commit reported
    judged_drafted: int = 0  # drafts offered in those
    accepted: int = 0  # drafts the target kept in those


class DSparkProposer:
    """The engine's DSpark drafter (module docstring).

    Args:
        drafter: the loaded DSpark drafter (READY; the engine's target is its `target`).
        num_slots: the engine's cache slots (`EngineLimits.max_num_seqs`).
        seed: the engine's seed, for the drafts of unseeded requests.
        num_speculative_tokens: the most drafts a sequence verifies per step, 1 to the block size (None:
            the block size, `dspark_block_size`).
        verify_threshold: in [0, 1]: verify the longest draft prefix whose running product of confidences
            stays at or above it (0: always the whole block).

    Raises:
        ConfigError: a threshold outside [0, 1], or num_speculative_tokens outside [1, block size].
    """

    def __init__(self, drafter: DSparkDrafter, num_slots: int, seed: int, num_speculative_tokens: int | None = None,
                 verify_threshold: float = DEFAULT_VERIFY_THRESHOLD):
        if isinstance(verify_threshold, bool) or not isinstance(verify_threshold, (int, float)) or not (
                0.0 <= verify_threshold <= 1.0):
            raise ConfigError(f"dspark verify_threshold: expected a number in [0, 1], got {verify_threshold!r}")
        block = drafter.spec.block_size
        if num_speculative_tokens is None:
            num_speculative_tokens = block
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) or not (
                1 <= num_speculative_tokens <= block):
            raise ConfigError(f"dspark num_speculative_tokens: expected an integer in [1, {block}] (the drafter's "
                              f"block size), got {num_speculative_tokens!r}")
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.verify_threshold = float(verify_threshold)
        self.seed = seed
        self.cache: DSparkCache = drafter.allocate_cache(num_slots, 0)
        self.capture_layers = drafter.capture_layers  # what on_commit reads (`Proposer.capture_layers`)
        self.stats = ProposerStats()
        self._device = drafter.mtp[0].main_proj.weight.device
        self._pending: list[_PendingCommit] = []
        self._offered: dict[int, int] = {}  # slot -> drafts of its verify chunk in flight

    # ---- the engine's calls ----
    def propose(self, seqs: Seq[Sequence], max_drafts: Seq[int]) -> list[Draft]:
        """One draft block per sequence, cut to the confident prefix and to `max_drafts`.

        Args:
            seqs: decoding sequences; each one's ring holds its computed positions and its last token (the
                anchor) is the one the target runs next.
            max_drafts: per sequence, the most drafts it may verify.

        Returns:
            One `Draft` per sequence: the tokens and, per token, the distribution it was drawn from.

        Raises:
            RuntimeError: a sequence whose ring does not hold exactly its computed positions.
        """
        self.flush()
        if not seqs:
            return []
        slots = [seq.slot for seq in seqs]
        for seq in seqs:
            if seq.slot is None or self.cache.lengths[seq.slot] != seq.computed or seq.pending != 1:
                held = None if seq.slot is None else self.cache.lengths[seq.slot]
                raise RuntimeError(
                    f"dspark: sequence {seq.request_id}/{seq.index} has computed {seq.computed} of {seq.num_tokens} "
                    f"tokens but its context ring holds {held} positions (every final position must be committed "
                    f"before it drafts)"
                )
        anchors = [seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1] for seq in seqs]
        sampling = DraftSampling([seq.params for seq in seqs], [self._generator(seq) for seq in seqs])
        block = draft(self.drafter, self.cache, slots, anchors, sampling)
        widths = verify_width(block.confidence, self.verify_threshold).tolist()
        drafts = []
        for i, (seq, most) in enumerate(zip(seqs, max_drafts)):
            width = min(widths[i], most, self.num_speculative_tokens)
            self._offered[seq.slot] = width
            self.stats.verifies += 1
            self.stats.drafted += width
            if width == 0:
                drafts.append(Draft())
            else:
                drafts.append(Draft(block.tokens[i, :width].tolist(), block.q[i, :width]))
        return drafts

    def on_commit(self, seq: Sequence, first_position: int, streams: torch.Tensor,
                  captured: dict[int, torch.Tensor] | None = None) -> None:
        """Positions [first_position, first_position + len(streams)) of `seq` are final: queue their features
        for its context ring.

        Args:
            seq: the sequence.
            first_position: the position of the first row.
            streams: [rows, hc, D] the target's final streams of those rows.
            captured: {layer: [rows, hc, D]} those rows' streams of every layer of `capture_layers`.

        Raises:
            ValueError: `captured` is missing or lacks a layer of `capture_layers`.
        """
        if captured is None:
            raise ValueError(f"dspark: on_commit of sequence {seq.request_id}/{seq.index} at position "
                             f"{first_position} got no captured streams; run the target with "
                             f"capture_layers={self.capture_layers}")
        rows = streams.shape[0]
        offered = self._offered.pop(seq.slot, None)
        if offered is not None:  # a verify chunk: its anchor's row, then one per kept draft
            self.stats.judged_verifies += 1
            self.stats.judged_drafted += offered
            self.stats.accepted += rows - 1
        token_ids = torch.tensor(seq.tokens(first_position, first_position + rows), dtype=torch.long,
                                 device=self._device)
        features = self.drafter.features(captured, token_ids)
        positions = torch.arange(first_position, first_position + rows, dtype=torch.long, device=self._device)
        self._pending.append(_PendingCommit(seq.slot, first_position, features, positions))

    def on_fork(self, leader: Sequence, followers: Seq[Sequence], length: int) -> None:
        """The followers share the leader's prompt prefill: their rings take its context positions
        [0, length) (the last prompt chunk's rows come with each follower's own `on_commit`)."""
        self.cache.fork(leader.slot, [f.slot for f in followers], length)

    def on_release(self, seq: Sequence) -> None:
        """`seq` left its slot: forget its pending commits and empty its ring."""
        self._pending = [p for p in self._pending if p.slot != seq.slot]
        self._offered.pop(seq.slot, None)
        self.cache.rewind(seq.slot, 0)

    def end_step(self) -> None:
        """Every commit of the step is in: write them (the engine may call this after its commits)."""
        self.flush()

    # ---- helpers ----
    @torch.no_grad()
    def flush(self) -> None:
        """Write every pending commit into the context rings (one drafter pass over all their rows)."""
        if not self._pending:
            return
        # A slot's commits (in position order: the sort is stable) become one segment, since a segment must
        # start where its slot's ring ends; several steps' commits may be pending when no sequence drafted.
        pending, self._pending = sorted(self._pending, key=lambda p: p.slot), []
        segments: list[list] = []
        for commit in pending:
            last = segments[-1] if segments and segments[-1][0] == commit.slot else None
            if last is not None and last[1] + last[2] == commit.start:
                last[2] += commit.features.shape[0]
            else:
                segments.append([commit.slot, commit.start, commit.features.shape[0]])
        self.drafter.require_ready()
        keys = self.drafter.context_keys(torch.cat([p.features for p in pending]),
                                         torch.cat([p.positions for p in pending]))
        self.cache.write([tuple(s) for s in segments], keys)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A generator for `seq`'s draws this step (None for greedy requests, which draw nothing)."""
        if seq.params.greedy:
            return None
        if seq.seed is not None:
            base = seq.seed
        else:  # unseeded: the engine's seed, told apart per sequence
            base = self.seed ^ zlib.crc32(f"{seq.request_id}/{seq.index}".encode())
        mixed = (base * _SEED_MULTIPLIER + seq.num_tokens * _LENGTH_MULTIPLIER) & _SEED_MASK
        return torch.Generator(device=self._device).manual_seed(mixed)


def build_dspark_proposer(
    loaded: LoadedModels, limits: EngineLimits, num_speculative_tokens: int | None = None, seed: int = 0, *,
    compile_decode: bool = False, verify_threshold: float = DEFAULT_VERIFY_THRESHOLD,
) -> DSparkProposer:
    """The DSpark proposer of loaded models (`LLM(model, draft="dspark")`).

    Args:
        loaded: the target and its DSpark drafter (`load_models(..., draft="dspark")`).
        limits: the engine's limits (one context ring per cache slot).
        num_speculative_tokens: the most drafts verified per step (None: the drafter's block size).
        seed: the engine's seed.
        compile_decode: whether the engine compiles its decode step (refused: see the module docstring).
        verify_threshold: see `DSparkProposer`.

    Returns:
        The proposer, for `Engine(..., proposer=...)`.

    Raises:
        ConfigError: no DSpark drafter loaded, compile_decode, a bad threshold or draft count.
    """
    drafter = loaded.models.get(DSPARK)
    if not isinstance(drafter, DSparkDrafter):
        raise ConfigError("draft='dspark': the models were loaded without their DSpark drafter")
    if compile_decode:
        raise ConfigError(
            "draft='dspark' with compile=True: the compiled decode step does not expose the target layers "
            f"{drafter.capture_layers} that DSpark reads; use compile=False"
        )
    return DSparkProposer(drafter, limits.max_num_seqs, seed, num_speculative_tokens, verify_threshold)
