"""Rollout-vs-trainer agreement: the numbers an RL run watches every step to see that the rollout engine
samples from the policy the trainer is training.

For every response token t selected by the mask (prompt and padding tokens excluded), with lr_t the
rollout engine's logprob of the sampled token and lt_t the trainer's logprob of the same token under the
same weights, p_roll = exp(lr_t) and p_train = exp(lt_t):

    rollout_probs_diff_max   = max_t  |p_roll - p_train|
    rollout_probs_diff_mean  = mean_t |p_roll - p_train|
    rollout_probs_diff_std   = std_t  |p_roll - p_train|       (sample std, N - 1 in the denominator)
    rollout_actor_probs_pearson_corr = Pearson correlation of the vectors p_roll and p_train
    k3_kl                    = mean_t [exp(d_t) - d_t - 1],    d_t = lt_t - lr_t
                               (Schulman's k3 estimator of KL(rollout || trainer): >= 0 per token, unbiased)

These are verl's definitions (`training/rollout_probs_diff_*` and `training/rollout_actor_probs_pearson_corr`
from its debug metrics, `rollout_corr/k3_kl` from its rollout-correction metrics): on probabilities, not
logprobs, over masked tokens. Two deliberate differences: the metrics are computed in float64 (so the
value does not depend on the inputs' dtype), and an empty mask is an error where verl divides by
`count + 1e-8`. The std of a single token and the correlation of a constant vector are NaN (undefined).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsv4.errors import AgreementError

ROLLOUT, TRAINER, MASK = "rollout_logprobs", "trainer_logprobs", "mask"
LogProbs = torch.Tensor | Sequence[float] | Sequence[Sequence[float]]


@dataclass(frozen=True)
class Agreement:
    """The metrics of one batch (see the module docstring for the formulas)."""

    tokens: int
    rollout_probs_diff_max: float
    rollout_probs_diff_mean: float
    rollout_probs_diff_std: float
    rollout_actor_probs_pearson_corr: float
    k3_kl: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def agreement(rollout_logprobs: LogProbs, trainer_logprobs: LogProbs, mask: LogProbs | None = None) -> Agreement:
    """Compare the rollout engine's and the trainer's logprobs of the same sampled tokens.

    Args:
        rollout_logprobs: per token, the engine's logprob of the sampled token: a tensor of any shape (e.g.
            [batch, response_len]), or a list of per-sequence lists or tensors (ragged lengths allowed).
        trainer_logprobs: the trainer's logprobs of the same tokens, same shape.
        mask: which tokens count (nonzero / True: a response token), same shape; None: every token.

    Returns:
        The metrics, computed in float64.

    Raises:
        AgreementError: shapes that differ, no token selected, a selected logprob that is not finite.
    """
    rollout = _flat(rollout_logprobs, ROLLOUT)
    trainer = _flat(trainer_logprobs, TRAINER)
    if rollout.shape != trainer.shape:
        raise AgreementError(f"{ROLLOUT} has {rollout.numel()} values but {TRAINER} has {trainer.numel()}")
    selected = torch.ones_like(rollout, dtype=torch.bool) if mask is None else _flat(mask, MASK) != 0
    if selected.shape != rollout.shape:
        raise AgreementError(f"{MASK} has {selected.numel()} values but the logprobs have {rollout.numel()}")
    lr, lt = rollout[selected], trainer[selected]
    if lr.numel() == 0:
        raise AgreementError(f"{MASK} selects no token")
    for name, values in ((ROLLOUT, lr), (TRAINER, lt)):
        bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
        if bad:
            raise AgreementError(f"{name}: selected token {bad[0]} has a non-finite logprob ({values[bad[0]].item()})")
    p_roll, p_train = lr.exp(), lt.exp()
    diff = (p_roll - p_train).abs()
    d = lt - lr
    return Agreement(
        tokens=lr.numel(),
        rollout_probs_diff_max=diff.max().item(),
        rollout_probs_diff_mean=diff.mean().item(),
        rollout_probs_diff_std=diff.std().item() if diff.numel() > 1 else math.nan,
        rollout_actor_probs_pearson_corr=_pearson(p_roll, p_train),
        k3_kl=(d.exp() - d - 1).mean().item(),
    )


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() < 2:
        return math.nan
    return torch.corrcoef(torch.stack([x, y]))[0, 1].item()


def _flat(values: LogProbs, name: str) -> torch.Tensor:
    """A flat float64 tensor of the values (a tensor of any shape, a list, or a list of lists)."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).reshape(-1)
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise AgreementError(f"{name}: expected a tensor or a list of numbers, got {type(values).__name__}")
    try:
        if values and isinstance(values[0], torch.Tensor):  # per-sequence tensors of ragged lengths
            return torch.cat([row.detach().to("cpu", torch.float64).reshape(-1) for row in values])
        if values and isinstance(values[0], Sequence):
            return torch.cat([torch.tensor(list(row), dtype=torch.float64) for row in values])
        return torch.tensor(list(values), dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise AgreementError(f"{name}: not a list of numbers (or of lists of numbers): {exc}") from None


# ---- `dsv4 agreement FILE` ----
def load_file(path: str | Path) -> Agreement:
    """The metrics of a file holding `rollout_logprobs`, `trainer_logprobs` and optionally `mask`: a JSON
    object (lists, or lists of per-sequence lists) or a safetensors file (tensors of one shape).

    Raises:
        AgreementError: the file missing, unreadable, or lacking a field (named).
    """
    path = Path(path)
    if not path.is_file():
        raise AgreementError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file as load_tensors

        try:
            data = load_tensors(str(path))
        except (SafetensorError, OSError) as exc:
            raise AgreementError(f"{path}: not a readable safetensors file: {exc}") from None
    else:
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AgreementError(f"{path}: not a readable JSON file: {exc}") from None
        if not isinstance(data, dict):
            raise AgreementError(f"{path}: expected a JSON object with {ROLLOUT!r} and {TRAINER!r}")
    for key in (ROLLOUT, TRAINER):
        if key not in data:
            raise AgreementError(f"{path}: missing {key!r} (found: {sorted(data)})")
    try:
        return agreement(data[ROLLOUT], data[TRAINER], data.get(MASK))
    except AgreementError as exc:
        raise AgreementError(f"{path}: {exc}") from None
