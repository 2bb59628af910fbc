"""DSpark's two small heads on the last drafter stage (native `mtp.{last}.markov_head.*` and
`mtp.{last}.confidence_head.*`).

Markov head: a rank-r token-transition term added to each draft position's base logits,
    logits_i = base_i + markov_w2 @ markov_w1[prev_i]        in fp32; markov_w1, markov_w2 [V, r]
where prev_i is the token before draft position i (the anchor for i = 0, then the token drafted at
i - 1). Confidence head: the estimated probability that draft position i is accepted given that the
ones before it were,
    c_i = sigmoid(proj([head hidden_i ; markov_w1[prev_i]]))  proj [1, D + r], no bias, fp32
where head hidden_i is the last stage's collapse before its final norm.
"""

import torch
from torch import nn

from dsv4.kernels.registry import KernelRegistry
from dsv4.model.linear import Linear


class MarkovHead(nn.Module):
    """markov_w1 embeds the previous token (model dtype, like the token embedding); markov_w2 maps that
    embedding to a logit bias over the vocabulary, kept in fp32 as the release computes it."""

    def __init__(self, vocab_size: int, rank: int, dtype: torch.dtype, kernels: KernelRegistry | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank, dtype=dtype)
        self.markov_w2 = Linear(rank, vocab_size, torch.float32, kernels)  # weight [V, r]: bias = W2 @ e

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        """The logit bias markov_w2 @ markov_w1[prev], in fp32.

        Args:
            embedding: [..., r] markov_w1[prev] (in the model dtype).

        Returns:
            [..., V] fp32.
        """
        return self.markov_w2(embedding.float())


class ConfidenceHead(nn.Module):
    """proj [1, D + r] (fp32, no bias) over [head hidden ; markov_w1[prev]]."""

    def __init__(self, hidden_size: int, rank: int, kernels: KernelRegistry | None = None):
        super().__init__()
        self.proj = Linear(hidden_size + rank, 1, torch.float32, kernels)

    def forward(self, head_hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """The confidence logits (before the sigmoid).

        Args:
            head_hidden: [..., D] the last stage's collapse before its norm.
            markov_embedding: [..., r] markov_w1[prev].

        Returns:
            [...] fp32.
        """
        features = torch.cat((head_hidden.float(), markov_embedding.float()), dim=-1)
        return self.proj(features).squeeze(-1)
