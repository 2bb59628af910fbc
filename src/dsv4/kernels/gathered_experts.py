"""Routed experts for small batches: gather each (token, pick)'s expert weights and run one batched
matmul chain, instead of the reference's Python loop over experts.

The reference (`RoutedExperts.forward_reference`) costs ~8 ops per expert in use plus a host read of
the expert counts; a batch-1 decode step pays that for every layer. Gathering copies T*k expert
matrices per call, so it only pays off while that copy is small: `worth_it` caps the gathered
elements. Dense (unquantized) experts only: FP8/FP4 experts are dequantised per expert by the reference.
"""

from __future__ import annotations

import torch

# Copying one expert's three matrices costs about as much as the ~8 ops the loop spends per expert
# while they hold up to ~64k elements (256 KiB fp32): larger experts are looped, never copied.
MAX_ELEMENTS_PER_PICK = 1 << 16
# And the whole gathered copy stays within 1 MiB (fp32) per call (measured: beyond it, e.g. 128 picks of
# the tiny config, the copy costs more than the loop), so large batches use the loop.
MAX_GATHERED_ELEMENTS = 1 << 18


class GatheredExperts:
    def supports(self, x: torch.Tensor, picks: int, w1: torch.Tensor) -> bool:
        _, inter, hidden = w1.shape
        per_pick = 3 * inter * hidden
        return x.dtype == w1.dtype and per_pick <= MAX_ELEMENTS_PER_PICK and picks * per_pick <= MAX_GATHERED_ELEMENTS

    @staticmethod
    def __call__(
        x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float, swiglu,
    ) -> torch.Tensor:
        """x [T, D], ids/weights [T, k], dense w1/w3 [E, I, D], w2 [E, D, I] -> sum_e w_e expert_e(x) [T, D].
        Each token's k contributions are added in increasing expert order, as the reference does."""
        T, k = ids.shape
        ids, order = ids.sort(dim=-1, stable=True)
        weights = weights.gather(1, order)
        flat = ids.flatten()  # [T*k]
        xs = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [T*k, 1, D]
        hidden = swiglu(torch.bmm(xs, w1[flat].transpose(1, 2)), torch.bmm(xs, w3[flat].transpose(1, 2)), limit)
        ys = torch.bmm(hidden, w2[flat].transpose(1, 2)).view(T, k, -1)  # [T, k, D]
        contrib = (ys.float() * weights.unsqueeze(-1)).to(x.dtype)
        out = torch.zeros_like(x)
        for j in range(k):  # k is 2..8: accumulate like the reference's index_add, pick by pick
            out = out + contrib[:, j]
        return out
