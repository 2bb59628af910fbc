"""The MTP proposer: DeepSeek-V4's multi-token-prediction layer as the engine's drafter.

The MTP layer (model/drafters.py) at position t reads the target's pre-head stream S_t and the token
x_{t+1} and predicts x_{t+2}; it runs in its own cache (one slot per engine slot, positions from 0 like
the target's).

Keeping its cache aligned (`on_commit`, `end_step`): every step, the target's newly final positions
[a, b) of a sequence (prefill chunks, and the kept rows of a verify chunk) are fed to the MTP layer with
their tokens x_{a+1..b}, all sequences in one forward at the end of the step. The row of the last
final position b - 1 reads the last known token x_b (just sampled), so its logits are the first draft's
distribution; it is kept with that row's output stream R for the next step.

Drafting (`propose`), batched across the sequences: draft 1 is sampled from those logits; draft i + 1
comes from the MTP layer applied again at position b - 1 + i to the previous step's stream R and draft i
(autoregressive depth reuse: the checkpoint has one MTP layer, used at every depth). Each draft is sampled
with its request's own processed distribution (temperature, top-k / top-p / min-p) and seeded generator
(its own stream of draws, `sampler.DRAFT_STREAM`), and `Draft.probs` holds exactly that distribution (q;
one-hot for greedy requests in a batch with random ones), which the engine's rejection sampling needs.
When every sequence is greedy, the drafts are the logits' argmax and carry no q (`Draft.probs` None: the
engine keeps a greedy row's draft iff it is the target's argmax either way), so a step builds no
distributions over the vocabulary. The draft rows write past the committed positions of the MTP cache:
its rings are snapshotted first and restored after, so the next commit continues from exactly the
committed state.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from dsv4.engine.limits import EngineLimits
from dsv4.engine.model_runner import Chunk
from dsv4.engine.sampler import DRAFT_STREAM, Sampler, SamplingBatch, greedy_tokens
from dsv4.engine.sequence import Sequence
from dsv4.engine.speculation import Draft
from dsv4.errors import ConfigError
from dsv4.model.batch import ForwardBatch
from dsv4.model.drafters import MTPDrafter


class MTPProposer:
    """Drafts `num_speculative_tokens` tokens per sequence with the MTP layer (module docstring).

    Args:
        drafter: the READY MTP drafter (it aliases the target's embedding and head).
        limits: the engine's slots and sequence length (the drafter's cache gets the same).
        num_speculative_tokens: k >= 1.
        seed: seed of the draws of unseeded requests' drafts.

    Raises:
        ConfigError: a checkpoint with more than one MTP layer (layers past the first would read cache
            positions that only the first one's commits fill).
    """

    def __init__(self, drafter: MTPDrafter, limits: EngineLimits, num_speculative_tokens: int, seed: int = 0):
        if len(drafter.mtp) != 1:
            raise ConfigError(f"{drafter.cfg.source}: field 'num_nextn_predict_layers': {len(drafter.mtp)}; MTP "
                              f"speculation drafts with one MTP layer (reused at every depth)")
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.device = drafter.mtp[0].e_proj.weight.device
        self.cache = drafter.allocate_cache(limits.max_num_seqs, limits.max_model_len)
        self.decode_span = self.cache.rollback_limit()  # chunks that fit its rings run as decode rows
        self.sampling = SamplingBatch(limits.max_num_seqs, self.device)
        self.sampler = Sampler(default_seed=seed, stream=DRAFT_STREAM, kernels=drafter.mtp[0].kernels)
        self._commits: list[tuple[Sequence, int, torch.Tensor]] = []  # this step's, run at `end_step`
        # slot -> (R [hc, D], logits [V]) of the last final position, whose token is the last known one.
        self._heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- the engine's hooks ----
    def on_commit(self, seq: Sequence, first_position: int, streams: torch.Tensor) -> None:
        """Queue the MTP rows of newly final positions (run batched at `end_step`)."""
        if first_position == 0:
            self.sampling.add(seq.slot, seq.params, seq.seed)
        self._commits.append((seq, first_position, streams))

    def end_step(self) -> None:
        """One MTP forward over every final position of the step (module docstring)."""
        commits, self._commits = self._commits, []
        if not commits:
            return
        chunks, last_rows, heads = [], [], []
        row = 0
        for seq, first, streams in commits:
            n = streams.shape[0]
            chunks.append(Chunk(seq.slot, seq.tokens(first + 1, first + 1 + n), first))
            row += n
            if first + n + 1 == seq.num_tokens:  # its last row reads the last known token: it drafts next
                last_rows.append(row - 1)
                heads.append(seq.slot)
        batch = ForwardBatch.build(chunks, device=self.device, decode_span=self.decode_span)
        target_streams = torch.cat([streams for _, _, streams in commits])
        picked = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
        out, logits = self.drafter(batch, target_streams, self.cache, depth=0, logit_rows=picked)
        for i, (slot, r) in enumerate(zip(heads, last_rows)):
            self._heads[slot] = (out[r].clone(), logits[i])  # out is the layer's scratch: keep a copy

    def on_fork(self, leader: Sequence, followers: Seq[Sequence], length: int) -> None:
        """The followers share the leader's prompt prefill: their slots take its MTP positions [0, length)
        (the rows of the last prompt chunk come with each follower's own `on_commit`: the last one reads
        that follower's first token)."""
        self.cache.fork(leader.slot, [f.slot for f in followers], length)
        for follower in followers:
            self.sampling.add(follower.slot, follower.params, follower.seed)

    def on_release(self, seq: Sequence) -> None:
        """Forget the sequence: its slot's MTP positions and pending work."""
        self._commits = [c for c in self._commits if c[0] is not seq]
        if seq.slot is not None:
            self._heads.pop(seq.slot, None)
            self.sampling.remove(seq.slot)
            self.cache.rewind({seq.slot: 0})

    def propose(self, seqs: Seq[Sequence], max_drafts: Seq[int]) -> list[Draft]:
        """Up to max_drafts[i] draft tokens per sequence, with the distributions they were drawn from."""
        slots = [seq.slot for seq in seqs]
        missing = [s for s in slots if s not in self._heads]
        if missing:
            raise ValueError(f"MTP proposer: cache slots {missing} verify drafts but their final positions were "
                             f"never committed (on_commit / end_step)")
        generated = [len(seq.output_ids) for seq in seqs]
        streams = torch.stack([self._heads[s][0] for s in slots])
        logits = torch.stack([self._heads[s][1] for s in slots])
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        # Draft rows go at positions [computed, computed + drafts - 1) of the MTP cache: undone below.
        snapshot = self.cache.snapshot([(slots[j], seqs[j].computed, max_drafts[j] - 1)
                                        for j in active if max_drafts[j] > 1])
        greedy = all(seq.params.greedy for seq in seqs)  # argmax drafts, no q (module docstring)
        depth = 0
        while True:
            if greedy:
                drafted = greedy_tokens(logits, self.sampler.kernels).tolist()
            else:
                out = self.sampler.sample_rows(logits, self.sampling.rows([slots[j] for j in active]),
                                               [generated[j] + depth for j in active], return_probs=True)
                drafted = out.token_ids.tolist()
                for i, j in enumerate(active):
                    probs[j].append(out.probs[i])
            for i, j in enumerate(active):
                tokens[j].append(drafted[i])
            depth += 1
            keep = [i for i, j in enumerate(active) if max_drafts[j] > depth]
            if not keep:
                break
            active = [active[i] for i in keep]
            picked = torch.tensor(keep, dtype=torch.int64, device=self.device)
            batch = ForwardBatch.build(
                [Chunk(slots[j], [tokens[j][-1]], seqs[j].computed - 1 + depth) for j in active], device=self.device)
            streams, logits = self.drafter(batch, streams.index_select(0, picked), self.cache, depth=depth)
        self.cache.rewind({slots[j]: seqs[j].computed for j in range(len(seqs)) if max_drafts[j] > 1}, snapshot)
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]
