"""Acceptance: which tree nodes the target agrees with. Pure functions over tensors.

The target picks its own token at EVERY tree node (argmax, or a sample from its processed distribution);
a draft node is accepted when its token is what the target picked at its parent and all its ancestors
are accepted. The deepest accepted node's own pick is the bonus token.

Sampling is lossless: our drafters propose deterministic candidates (top-k of a head, a copied span), and
for such drafts the rule "accept child x with probability p(x), else set p(x) = 0, renormalise, try the
next sibling, finally sample from the residual" returns a token distributed exactly as p. It is the same
as drawing y ~ p once and descending into the child whose token is y: that is what we do, drawing one
y per node in a single `multinomial` call (a node's draw is used only if the walk reaches it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .tree import Tree


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be a whole number (0 = no top-k filter), got {self.top_k!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no top-k filter), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warpers(self) -> LogitsProcessorList:
        """Hugging Face's own warpers, in generate()'s order, so 'the target's distribution' means the same."""
        warpers = LogitsProcessorList()
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


def target_probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[N, V] logits -> [N, V] probabilities of the target's processed distribution (temperature > 0)."""
    return torch.softmax(sampling.warpers()(None, logits.float()), dim=-1)


GREEDY_CHUNK = 1024  # greedy_tokens: the vocabulary's stretch whose maximum is found first


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: the first maximum (or the first NaN), as argmax (and so generate()) picks it.

    On a CPU, `max` with indices reads bfloat16 logits far slower than `amax` (and `argmax` slower still), so each
    stretch of GREEDY_CHUNK logits has its maximum found with `amax`, and `max` with indices runs over the first
    stretch holding the largest alone (docs/experiments.md, row X28)."""
    vocab = logits.shape[-1]
    whole = vocab // GREEDY_CHUNK
    if whole < 2:
        return logits.max(dim=-1).indices
    stretch_max = logits[..., : whole * GREEDY_CHUNK].unflatten(-1, (whole, GREEDY_CHUNK)).amax(dim=-1)
    if whole * GREEDY_CHUNK < vocab:  # the shorter last stretch
        stretch_max = torch.cat([stretch_max, logits[..., whole * GREEDY_CHUNK :].amax(dim=-1, keepdim=True)], dim=-1)
    holds = (stretch_max == stretch_max.amax(dim=-1, keepdim=True)) | stretch_max.isnan()
    first = holds.byte().argmax(dim=-1)  # the first stretch holding the maximum (or a NaN)
    # the last stretch may be shorter: its indices past the end repeat the last logit, after its first occurrence
    columns = (first[..., None] * GREEDY_CHUNK + torch.arange(GREEDY_CHUNK, device=logits.device)).clamp_(max=vocab - 1)
    return first * GREEDY_CHUNK + logits.gather(-1, columns).max(dim=-1).indices


def target_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The target's own choice at every node: [N, V] -> [N]."""
    if sampling.greedy:
        return greedy_tokens(logits)
    probs = target_probabilities(logits, sampling)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept(tree: Tree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None):
    """(order, deepest, new tokens) of accepted_order and accepted_tokens, the target picking its own token at every
    node; on the device."""
    return accept_chosen(tree, target_tokens(logits, sampling, generator))


def accept_chosen(tree: Tree, chosen: torch.Tensor):
    """accept() once the target's token at every node is picked ([N]; a batch's greedy picks are one argmax)."""
    order, deepest = accepted_order(tree, chosen)
    return order, deepest, accepted_tokens(tree, chosen, order, deepest)


def accepted_order(tree: Tree, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [N], deepest): every node index with the accepted path's nodes first (root first), and the deepest
    node whose whole path the target agrees with. On the device, with no host read: a step reads all its rows'
    outcomes back at once.

    chosen[i] is the target's token at node i; node i is right when tokens[i] == chosen[parent[i]].
    """
    right = tree.tokens == chosen[tree.parents.clamp(min=0)]
    right[0] = True
    accepted = ~(tree.ancestors & ~right).any(dim=-1)
    deepest = torch.where(accepted, tree.depth, -1).argmax()
    nodes = torch.arange(tree.size, device=tree.tokens.device)
    # a path's nodes in index order are root first (topological order); the other nodes after them
    order = torch.where(tree.ancestors[deepest], nodes, nodes + tree.size).argsort()
    return order, deepest


def accepted_tokens(tree: Tree, chosen: torch.Tensor, order: torch.Tensor, deepest: torch.Tensor) -> torch.Tensor:
    """[N]: the accepted path's draft tokens, then the target's own token after the deepest (at index
    depth[deepest]); what follows is padding."""
    following = tree.tokens[order.roll(-1)]
    at = torch.arange(tree.size, device=tree.tokens.device)
    return torch.where(at == tree.depth[deepest], chosen[deepest], following)


def greedy_path(tokens: tuple[int, ...], parents: tuple[int, ...], chosen: list[int]) -> list[int]:
    """accepted_path on the host, for a tree whose siblings all differ (verifiable_host_tree makes them so): node
    indices from the root to the deepest node whose whole path the target agrees with, chosen[i] being the target's
    token at node i. A node's children come after it, so one pass in index order follows the path down; a few
    integers cost less here than a dozen small device operations a row."""
    path = [0]
    for node in range(1, len(tokens)):
        if parents[node] == path[-1] and tokens[node] == chosen[path[-1]]:
            path.append(node)
    return path


def accepted_path(tree: Tree, chosen: torch.Tensor) -> torch.Tensor:
    """Node indices from the root to the deepest node whose whole path the target agrees with."""
    order, deepest = accepted_order(tree, chosen)
    return order[: int(tree.depth[deepest]) + 1]
