"""Choosing a tree's nodes: the best drafts of a scored candidate tree (ancestor-closed), and prompt lookup's
copied spans grafted into a head's candidates or a second tree merged into the first. Pure functions over trees
(inference.tree), tested in tests/test_tree.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tree import Tree, TreeError, host_subtree


def select_best_nodes(scores: torch.Tensor, depth: torch.Tensor, count: int) -> torch.Tensor:
    """Indices (ascending) of the root plus the `count` best non-root nodes by cumulative log-probability.

    A child's score never exceeds its parent's; breaking ties toward the shallower node keeps the
    selection ancestor-closed even when a step had probability 1. Nodes scored -inf or NaN (a head with
    non-finite weights; a child of one is one too) are impossible drafts: they rank after every possible node,
    the deeper lower, so they are kept only where there are fewer possible nodes than `count` (verifying them
    costs a wider pass, never exactness), and how many are possible is never read back to the host.
    """
    return selection_key(scores, depth).topk(min(count + 1, scores.shape[0])).indices.sort().values


def selection_key(scores: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """select_best_nodes' order: the root first, then by score, the shallower first at a tie, impossible nodes last."""
    possible = scores > float("-inf")  # False for NaN as well
    possible[0] = True
    key = torch.where(possible, scores.double() - 1e-9 * depth.double(), -1e30 * (1 + depth.double()))
    key[0] = float("inf")
    return key


@dataclass
class CandidatePool:
    """One row's candidate nodes on the host, from which its tree is chosen: node 0 the root, every parent before its
    children; `scores` the paths' log-probabilities (the root's 0), a child's never above its parent's."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    scores: list[float]

    def best(self, count: int) -> list[int]:
        """select_best_nodes on the host: the root and the `count` best other nodes, ascending."""
        return sorted(host_selection_order(self.scores, self.depth)[: count + 1])

    def tree(self, keep: Sequence[int], device: torch.device | str) -> Tree:
        return host_subtree(self.tokens, self.parents, keep, device)


def host_selection_order(scores: Sequence[float], depth: Sequence[int]) -> list[int]:
    """selection_key's order on host floats: the root first, then by score, the shallower first at a tie, impossible
    nodes (-inf, NaN) last, the deeper lower."""

    def key(node: int) -> tuple:
        if node == 0:
            return (0,)
        if scores[node] > float("-inf"):  # False for NaN as well
            return (1, -scores[node], depth[node])
        return (2, depth[node])

    return sorted(range(len(scores)), key=key)


def graft_span(pool: CandidatePool, span: Sequence[int], log_rate: float) -> int:
    """Grafts a copied span onto `pool` (in place) as a path from the root; returns how many of its first tokens the
    pool held already as a path. Those keep their scores; the rest of the span is appended as a chain under the last
    of them, each token scored `log_rate` below its parent (the log-probability that a copied token the pool did not
    have is right, when what precedes it is), so the pool stays ancestor-closed under selection."""
    children = {(p, t): i for i, (p, t) in enumerate(zip(pool.parents, pool.tokens)) if p >= 0}
    node, held = 0, 0
    for token in span:
        found = children.get((node, token))
        if found is None:
            break
        node, held = found, held + 1
    for token in span[held:]:
        pool.tokens.append(token)
        pool.parents.append(node)
        pool.depth.append(pool.depth[node] + 1)
        pool.scores.append(pool.scores[node] + log_rate)
        node = len(pool.tokens) - 1
    return held


# ---- merging proposals of several drafters ---------------------------------------------------------


def merge_trees(first: Tree, second: Tree) -> Tree:
    """One tree holding every root-to-node path of both (shared prefixes once). Roots must agree.

    A loop over the second tree's nodes (a copied span: ~10), on Python ints: the trees' host lists where both have
    them (Tree.from_lists), else both trees read back in one transfer; far below a forward pass. Nothing is read
    where the second tree is its root alone, or the first is (its root is then taken to be the second's: the loop
    checks the merged tree's root against the text).
    """
    if second.size == 1:
        return first
    if second.host is not None and (first.host is not None or first.size == 1):
        second_tokens, second_parents = second.host
        tokens, parents = (list(first.host[0]), list(first.host[1])) if first.host else ([second_tokens[0]], [-1])
    else:
        both = torch.cat([first.tokens, first.parents, second.tokens, second.parents]).tolist()
        tokens, parents = both[: first.size], both[first.size : 2 * first.size]
        second_tokens, second_parents = (
            both[2 * first.size : 2 * first.size + second.size],
            both[2 * first.size + second.size :],
        )
    if tokens[0] != second_tokens[0]:
        raise TreeError("cannot merge trees with different roots")
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if p >= 0}
    mapped = [0]
    for parent, token in zip(second_parents[1:], second_tokens[1:]):
        key = (mapped[parent], token)
        if key not in child:
            child[key] = len(tokens)
            tokens.append(token)
            parents.append(key[0])
        mapped.append(child[key])
    if len(tokens) == first.size:
        return first
    return Tree.from_lists(tokens, parents, first.tokens.device)
