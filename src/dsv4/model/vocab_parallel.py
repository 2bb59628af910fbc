"""The vocabulary-parallel embedding and head: each rank holds a contiguous block of vocab_size / N rows.

Embedding: ids outside the rank's block look up nothing (zeros); the all-reduce assembles each row from
the one rank that holds it (a plain lookup when one rank holds them all). Head: each rank computes its
block of the logits; the all-gather hands every rank the full, identical [T, V] logits, so every rank
samples the same tokens.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.kernels import bf16_products
from dsv4.model.linear import compute_weight, input_major
from dsv4.parallel.collectives import all_gather_last, all_reduce
from dsv4.parallel.state import ParallelState


class VocabParallelEmbedding(nn.Module):
    """embed[ids] with this rank's rows [first, first + vocab/N) of the table (`weight`, the native name)."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, parallel: ParallelState):
        super().__init__()
        self.parallel = parallel
        self.first, self.stop = parallel.split(vocab_size)
        # Zeros like every other parameter at build (the load writes them all): nn.Embedding's own random
        # init is a normal_ over V x D values, the largest single cost of building a model.
        self.weight = nn.Parameter(torch.zeros(self.stop - self.first, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return all_reduce(rows.masked_fill_(elsewhere.unsqueeze(-1), 0.0), self.parallel)


class VocabParallelHead(nn.Module):
    """x W^T over this rank's vocabulary rows of W (input-major like model/linear.py), gathered to [T, V]."""

    def __init__(self, dim: int, vocab_size: int, dtype: torch.dtype, parallel: ParallelState):
        super().__init__()
        self.parallel = parallel
        self.weight = input_major(parallel.local(vocab_size), dim, dtype)

    def forward(self, x: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """decode_rows: `Linear.forward`'s flag, taken for its signature: this shard's product runs in torch."""
        return all_gather_last(bf16_products.linear(x, compute_weight(self.weight, x.dtype)), self.parallel)
