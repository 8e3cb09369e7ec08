"""The candidate nodes of dynamic trees being grown (inference.drafters.dynamic): tokens, parents, path scores and
ancestors of every row's tree as tensors, one level added at a time."""

from __future__ import annotations

import torch

from heads import DraftVocabulary

from ..acceptance_map import acceptance_log_probs


class DraftNodes:
    """Trees being grown, one a row, in lockstep: node 0 is each root; children are appended level by level
    (the same count a level in every row, so node i has the same depth in every row) with their path scores."""

    def __init__(
        self,
        roots: torch.Tensor,
        capacity: int,
        vocab: DraftVocabulary,
        path_depth: int = 0,
        acceptance: list[float] | None = None,
    ):
        rows, device = roots.shape[0], roots.device
        self.vocab, self.count, self.level, self.acceptance = vocab, 1, 0, acceptance
        # with path_depth: each node's tokens below the root, its own at [depth - 1] (the EAGLE head's copy input)
        self.paths = torch.zeros(rows, capacity, path_depth, dtype=torch.long, device=device) if path_depth else None
        self.tokens = torch.empty(rows, capacity, dtype=torch.long, device=device)
        self.parents = torch.empty_like(self.tokens)
        self.depth = torch.empty(capacity, dtype=torch.long, device=device)
        # the path's log-probability: the sum of its drafts' (mapped by `acceptance`: inference.acceptance_map)
        self.scores = torch.empty(rows, capacity, dtype=torch.float32, device=device)
        # each node its own ancestor from the start: a child's row is then its parent's row or'ed in (add_children)
        self.ancestors = torch.zeros(rows, capacity, capacity, dtype=torch.bool, device=device)
        self.ancestors.diagonal(dim1=1, dim2=2).fill_(True)
        self.index = torch.arange(capacity, device=device)
        self.tokens[:, 0], self.parents[:, 0], self.depth[0], self.scores[:, 0] = roots, -1, 0, 0.0

    def add_children(self, frontier: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each frontier node's k likeliest children (frontier [rows, F]; top: their log-probabilities and draft
        indices [rows, F, k]); returns their indices [rows, F * k]. They are the next F * k nodes, written as one
        block of every tensor (slices, not scattered indices: a level's bookkeeping is a few dozen small operations,
        each costing about what its Python call does)."""
        values, indices = top
        rows, k = frontier.shape[0], indices.shape[-1]
        width = frontier.shape[1] * k
        new = slice(self.count, self.count + width)
        parents = frontier.repeat_interleave(k, dim=1)
        self.tokens[:, new] = self.vocab.to_target(indices).view(rows, width)
        self.parents[:, new] = parents
        self.depth[new] = self.level + 1  # a level at a time: children are one deeper
        local = values if self.acceptance is None else acceptance_log_probs(values, self.acceptance)
        self.scores[:, new] = (self.scores.gather(1, frontier)[..., None] + local).view(rows, width)
        self.ancestors[:, new] |= self.ancestors.gather(1, parents[..., None].expand(-1, -1, self.ancestors.shape[2]))
        self.count, self.level = self.count + width, self.level + 1
        if self.paths is not None:
            self.paths[:, new] = self.paths.gather(1, parents[..., None].expand(-1, -1, self.paths.shape[2]))
            self.paths[:, new, self.level - 1] = self.tokens[:, new]
        return self.index[None, new].expand(rows, -1)

    def ancestors_among(self, nodes: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
        """[rows, N, M]: whether among[b, m] is an ancestor of nodes[b, n] (or the node itself)."""
        own = self.ancestors.gather(1, nodes[..., None].expand(-1, -1, self.ancestors.shape[2]))
        return own.gather(2, among[:, None, :].expand(-1, nodes.shape[1], -1))

    def path_tokens(self, nodes: torch.Tensor, depth: int) -> torch.Tensor:
        """[rows, N, depth]: the tokens below the root on the paths to nodes[b, n], all `depth` deep."""
        return self.paths.gather(1, nodes[..., None].expand(-1, -1, self.paths.shape[2]))[..., :depth]
