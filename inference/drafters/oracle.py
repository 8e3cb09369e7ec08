"""A drafter that knows the answer: for measuring the engine's own overhead, and for tests."""

from __future__ import annotations

import torch

from ..tree import Tree
from .base import TokenDrafter, as_static_tree, root_only


class OracleDrafter(TokenDrafter):
    """Proposes the true continuation on rank 0 of a static tree, wrong tokens elsewhere.

    Every step accepts the deepest path, so cache compaction runs at every depth. `continuation` is the whole
    expected sequence, prompt included.
    """

    def __init__(self, continuation: torch.Tensor, tree, vocab_size: int):
        self.continuation, self.tree, self.vocab_size = continuation, as_static_tree(tree), vocab_size

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        position = tokens.shape[0]
        truth = self.continuation[position : position + min(self.tree.max_depth, max_depth)]
        if truth.shape[0] == 0:
            return root_only(tokens)
        depth = truth.shape[0]
        truth = torch.cat([truth, truth[-1:].expand(self.tree.max_depth - depth)])  # rows past the end: cut below
        ranks = torch.arange(self.tree.max_rank + 1, device=truth.device)
        candidates = (truth[:, None] + ranks) % self.vocab_size  # rank 0 right, the others wrong
        return self.tree.fill(tokens[-1], candidates).truncate(depth)
