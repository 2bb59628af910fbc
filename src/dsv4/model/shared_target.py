"""How a drafter reaches the target's embedding and head without owning them.

A drafter holds the target through a plain attribute, not as a registered submodule, so the target's
tensors have exactly one owner: they appear once in parameter listings, the slot table and the weight
report, and a refit writes them once (a second owner would make load order decide the values).
"""

from torch import nn


class SharedTarget:
    """The target model, held without registering it as a submodule of the drafter."""

    def __init__(self, target: nn.Module):
        self._target = (target,)  # a tuple: nn.Module.__setattr__ would register a bare module

    @property
    def target(self) -> nn.Module:
        return self._target[0]
