"""What one forward step computes: a flat run of tokens from one or more sequences."""

from dataclasses import dataclass

import torch

from dsv4.model.step_plan import StepPlan


@dataclass(frozen=True)
class Segment:
    """One sequence's share of the step: tokens [begin, end) of the flat batch at positions [start, start+len)."""

    slot: int
    start: int
    begin: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ForwardBatch:
    """The step's tokens, and its plan (`step_plan.py`), built once here and read by every layer."""

    token_ids: torch.Tensor  # [T] int64, all sequences' new tokens back to back
    positions: torch.Tensor  # [T] int64 absolute positions
    segments: tuple[Segment, ...]
    plan: StepPlan

    @classmethod
    def build(cls, chunks: list[tuple[int, list[int], int]], device: torch.device | str = "cpu",
              decode_span: int = 1) -> "ForwardBatch":
        """chunks: (cache slot, new token ids, position of the first new token) per sequence; chunks of
        at most `decode_span` tokens (verify chunks) run through the decode path, one row per token
        (`StepPlan.of_segments`; at most the cache's smallest ring length)."""
        ids: list[int] = []
        positions: list[int] = []
        segments = []
        for slot, tokens, start in chunks:
            if not tokens:
                raise ValueError(f"empty chunk for cache slot {slot}")
            segments.append(Segment(slot=slot, start=start, begin=len(ids), end=len(ids) + len(tokens)))
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
        segments = tuple(segments)
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        return cls(
            token_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=position_tensor,
            segments=segments,
            plan=StepPlan.of_segments(segments, len(ids), torch.device(device), decode_span, position_tensor),
        )

    @property
    def decode_rows(self) -> bool:
        """Every row is one sequence's next token (a decode step): the few-row products take more such rows."""
        return self.plan.single_tokens

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def last_token_indices(self) -> torch.Tensor:
        """[B] index into the flat batch of each sequence's last token (whose logits predict the next)."""
        return torch.tensor([s.end - 1 for s in self.segments], dtype=torch.long, device=self.token_ids.device)
