"""DSpark as the engine's drafter: the `Proposer` (speculation.py) over a loaded `DSparkDrafter`.

Each step the engine asks for drafts, the target verifies them, and the engine reports which positions
became final. This proposer keeps one DSpark context ring per engine cache slot and

  on_commit   turns the target's features at the final positions into context keys (prefill chunks; after
              a verify, the anchor and the accepted drafts). Rejected drafts are never reported, so the
              rings only ever hold committed positions and need no rewind of their own;
  propose     drafts one block per sequence in one drafter pass (the Markov loop, `DSparkDrafter.draft`),
              and offers the prefix the confidence head trusts (`verify_width` against a threshold), each
              draft with exactly the distribution q it was drawn from (`Draft.probs`), which rejection
              sampling needs;
  on_release  empties the slot's ring (the sequence ended or was preempted: it recommits from position 0).

Features. DSpark reads the streams of the target layers `capture_layers` (the outputs of
`dspark_target_layer_ids`; V4.1: their inputs), while the engine hands `on_commit` only the target's final
streams (the last layer's output). `TargetLayerCapture` copies the other layers' streams during each
target forward with module hooks on the target's blocks (the stream entering block i + 1 is block i's
output), together with the step's `ForwardBatch`, so `on_commit` finds a sequence's rows by its slot and
first position. The engine could pass them instead: `ModelRunner.execute` running the target with
`capture_layers=proposer.capture_layers` and `on_commit` receiving those rows would make the hooks
unnecessary. The compiled decode step (`compile=True`) bypasses the blocks' modules, so it is refused here.

Commits are batched: `on_commit` only computes the rows' features; the next `propose` (or `flush`) turns
every pending row of the step into context keys with one pass of main_proj / main_norm / wkv.

Draws. A sampled draft uses a generator of its own, seeded from the request's seed (the engine's seed for
unseeded requests) and the sequence's length, so drafting never touches the target sampler's random
stream, and a seeded request drafts the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from dsv4.engine.limits import EngineLimits
from dsv4.engine.sequence import Sequence
from dsv4.engine.speculation import Draft
from dsv4.errors import ConfigError
from dsv4.model.batch import ForwardBatch
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.dspark import DSparkDrafter
from dsv4.model.dspark_cache import DSparkCache
from dsv4.model.dspark_draft import DraftSampling, verify_width
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


class TargetLayerCapture:
    """Copies of target layers' output streams from each forward of the target, with that forward's batch.

    The output of block i is the input of block i + 1, read by a forward pre-hook on block i + 1 (block 0
    is run through `forward_broadcast`, not as a module call, so its own hooks would not fire). The last
    block's output is the forward's result, which the engine hands `on_commit` itself, so it is not hooked.

    Args:
        target: the target model.
        layers: the target layers to capture (ascending).
    """

    def __init__(self, target: DeepseekV4, layers: Seq[int]):
        last = len(target.layers) - 1
        self.last_layer = last
        self.layers = tuple(layers)
        self.batch: ForwardBatch | None = None
        self.streams: dict[int, torch.Tensor] = {}
        handles = []
        this = weakref.ref(self)  # the hooks must not keep a dropped proposer's capture alive
        for layer in self.layers:
            if layer < last:
                handles.append(target.layers[layer + 1].register_forward_pre_hook(_capture_hook(this, layer)))
        # the hooks leave the target when the capture is closed or collected, whichever comes first
        self._remove_hooks = weakref.finalize(self, _remove_hooks, handles)

    def record(self, layer: int, streams: torch.Tensor, batch: ForwardBatch) -> None:
        """Keep `streams` (the output of `layer` for `batch`); a new batch starts a new forward's capture."""
        if batch is not self.batch:
            self.batch, self.streams = batch, {}
        # A copy: the next block may overwrite its input in place.
        self.streams[layer] = streams.clone()

    def rows(self, slot: int, start: int, final_streams: torch.Tensor) -> dict[int, torch.Tensor]:
        """The captured streams of one sequence's rows in the latest forward.

        Args:
            slot: the sequence's cache slot.
            start: the position of its first row.
            final_streams: [rows, hc, D] the target's final streams of those rows (the last layer's output).

        Returns:
            {layer: [rows, hc, D]} for every captured layer.

        Raises:
            RuntimeError: the latest forward captured no chunk of that slot at that position.
        """
        count = final_streams.shape[0]
        out = {self.last_layer: final_streams} if self.last_layer in self.layers else {}
        hooked = [layer for layer in self.layers if layer != self.last_layer]
        if not hooked:
            return out
        segment = None
        if self.batch is not None:
            segment = next((s for s in self.batch.segments if s.slot == slot and s.start == start), None)
        if segment is None or segment.length < count or set(self.streams) != set(hooked):
            raise RuntimeError(
                f"dspark: the target's last forward captured no streams of layers {hooked} for cache slot {slot} "
                f"at position {start} (was the target run without its blocks' modules, e.g. compiled?)"
            )
        for layer in hooked:
            out[layer] = self.streams[layer][segment.begin : segment.begin + count]
        return out

    def close(self) -> None:
        """Remove the hooks from the target."""
        self._remove_hooks()


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _capture_hook(capture: weakref.ref, layer: int):
    def hook(module, args):
        owner = capture()
        if owner is not None:
            owner.record(layer, args[0], args[1])  # block.forward(streams, batch, cache, ...)

    return hook


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
        drafter: the loaded DSpark drafter (READY; the engine's target is its `shared.target`).
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
        self.capture = TargetLayerCapture(drafter.shared.target, drafter.capture_layers)
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
        block = self.drafter.draft(self.cache, slots, anchors, sampling)
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

    def on_commit(self, seq: Sequence, first_position: int, streams: torch.Tensor) -> None:
        """Positions [first_position, first_position + len(streams)) of `seq` are final: queue their features
        for its context ring.

        Args:
            seq: the sequence.
            first_position: the position of the first row.
            streams: [rows, hc, D] the target's final streams of those rows.
        """
        rows = streams.shape[0]
        offered = self._offered.pop(seq.slot, None)
        if offered is not None:  # a verify chunk: its anchor's row, then one per kept draft
            self.stats.judged_verifies += 1
            self.stats.judged_drafted += offered
            self.stats.accepted += rows - 1
        captured = self.capture.rows(seq.slot, first_position, streams)
        token_ids = torch.tensor(seq.tokens(first_position, first_position + rows), dtype=torch.long,
                                 device=self._device)
        features = self.drafter.features(captured, token_ids)
        positions = torch.arange(first_position, first_position + rows, dtype=torch.long, device=self._device)
        self._pending.append(_PendingCommit(seq.slot, first_position, features, positions))

    def on_release(self, seq: Sequence) -> None:
        """`seq` left its slot: forget its pending commits and empty its ring."""
        self._pending = [p for p in self._pending if p.slot != seq.slot]
        self._offered.pop(seq.slot, None)
        self.cache.reset(seq.slot)

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

    def close(self) -> None:
        """Remove the capture hooks from the target (the proposer is not used afterwards)."""
        self.capture.close()


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
