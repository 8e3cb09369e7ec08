"""How large a tree pays on this machine: the likeliest paths given per-depth accuracies, what a pass costs
(PassCost, measured by inference.calibrate), how many drafts maximise tokens per unit of time, and the spec of an
EAGLE-2 dynamic tree. Pure functions over numbers and tensors, tested in tests/test_tree.py."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tree import Tree, TreeError, host_subtree
from .tree_select import selection_key


def best_static_paths(num_nodes: int, accuracy: Sequence[Sequence[float]]) -> list[tuple[int, ...]]:
    """The `num_nodes` paths with the highest probability of being accepted, given accuracy[d][r]: the
    chance that candidate r at depth d + 1 is the right token (Medusa's sparse-tree construction). A child
    is never likelier than its parent, so best-first expansion keeps the set prefix-closed."""
    frontier = [
        (-a, (r,)) for r, a in enumerate(accuracy[0]) if a > 0
    ]  # a path that cannot be accepted (or NaN) is never drafted
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(accuracy):
            for r, a in enumerate(accuracy[len(path)]):
                if a > 0:
                    heapq.heappush(frontier, (neg_p * a, path + (r,)))
    return chosen


def default_accuracy(depth: int, ranks: int, top1: float = 0.6, decay: float = 0.8) -> list[list[float]]:
    """A plausible accuracy[d][r] for an untrained-shape prior: top-1 falling with depth, a long tail."""
    out = []
    for d in range(depth):
        first = top1 * decay**d
        rest = [(1 - first) * 0.3 * 0.5**r for r in range(ranks - 1)]
        out.append([first, *rest])
    return out


@dataclass(frozen=True)
class PassCost:
    """What one step costs on this machine, relative to a one-token target pass (inference.calibrate).

    `relative[i]` is a target pass over `tokens[i]` tokens (tokens[0] == 1, so relative[0] == 1); beyond the
    last measurement the cost grows along the last measured slope. `draft_level` is one level of drafting;
    `draft_step` what a drafting step costs whatever its depth and width (the head reading the tokens the last
    step committed, the loop accepting and moving cache entries), which every step pays, so it weighs for larger
    trees: they spread it over more tokens.
    """

    tokens: tuple[int, ...]
    relative: tuple[float, ...]
    draft_level: float = 0.0
    draft_step: float = 0.0

    def __post_init__(self):
        if (
            not self.tokens
            or self.tokens[0] != 1
            or len(self.tokens) != len(self.relative)
            or list(self.tokens) != sorted(set(self.tokens))
        ):
            raise TreeError(
                f"PassCost needs ascending token counts starting at 1, one cost each; got {self.tokens}, "
                f"{self.relative}"
            )

    def __call__(self, k: int) -> float:
        t, c = self.tokens, self.relative
        if len(t) == 1:
            return c[0] * k
        i = min(max(bisect.bisect_left(t, k), 1), len(t) - 1)  # interpolate between t[i - 1] and t[i]
        return c[i - 1] + (c[i] - c[i - 1]) * (k - t[i - 1]) / (t[i] - t[i - 1])


def best_node_count(scores: Sequence[Sequence[float]], cost: PassCost, draft_cost: float, limit: int) -> int:
    """How many drafts (0..limit) maximise expected tokens per unit of time, on host floats.

    scores[row] are a row's drafts' cumulative log-probabilities: EAGLE-2's estimate that each one is accepted.
    Keeping the n likeliest yields 1 + their summed probability tokens for `cost.draft_step + draft_cost +
    cost(n + 1)`. Several rows are a batch verified in one pass: every row's tree is padded to the widest, so a
    width of n costs the same whatever each row keeps, and every row keeps its n likeliest; the tokens are the
    rows' sum. The first best (the fewest drafts) wins a tie.
    """
    rates = token_rates(scores, cost, draft_cost, limit)
    return rates.index(max(rates))


def token_rates(scores: Sequence[Sequence[float]], cost: PassCost, draft_cost: float, limit: int) -> list[float]:
    """rates[n]: expected tokens per unit of time when every row keeps its n likeliest drafts (best_node_count), for
    n = 0..min(limit, the most possible drafts a row has); impossible drafts (-inf, NaN) are never kept."""
    probabilities = [sorted((math.exp(s) for s in row if s > float("-inf")), reverse=True)[:limit] for row in scores]
    width = max((len(row) for row in probabilities), default=0)
    expected = [float(len(scores))] * (width + 1)  # each row's root
    for row in probabilities:
        kept = list(itertools.accumulate(row, initial=0.0))
        for n in range(1, width + 1):  # a row with fewer drafts keeps them all
            expected[n] += kept[min(n, len(row))]
    return [made / (cost.draft_step + draft_cost + cost(n + 1)) for n, made in enumerate(expected)]


def best_nodes(
    scores: torch.Tensor,
    depth: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    shift: torch.Tensor,
    cost: PassCost,
    draft_cost: float,
    limit: int,
) -> tuple[torch.Tensor, Tree]:
    """One tree's nodes that pay for themselves, in ONE host read: (the root and the best_node_count likeliest
    drafts, ascending, as select_best_nodes keeps them; the tree they make, built from its host lists
    (Tree.from_lists), so that nothing about it is read again).

    scores [N]: the root's and the drafts' path log-probabilities; depth, tokens, parents [N]; `shift`: added to the
    drafts' scores for their believed probabilities (the log of the drafter's reliability)."""
    order = selection_key(scores, depth).argsort(descending=True)[: limit + 1]  # the root first
    believed = (scores[order[1:]] + shift).float().exp()
    candidates = torch.stack([order, tokens[order], parents[order]]).double().flatten()
    read = torch.cat([believed.double(), candidates]).tolist()
    drafts, nodes = believed.shape[0], order.shape[0]
    expected = itertools.accumulate(read[:drafts], initial=1.0)  # token_rates' arithmetic
    rates = [made / (cost.draft_step + draft_cost + cost(n + 1)) for n, made in enumerate(expected)]
    count = rates.index(max(rates))  # the first best, as argmax
    node, token, parent = (
        [int(value) for value in read[drafts + nodes * i : drafts + nodes * i + count + 1]] for i in range(3)
    )
    tree = host_subtree(dict(zip(node, token)), dict(zip(node, parent)), sorted(node), tokens.device)
    return order[: count + 1].sort().values, tree


def best_shared_tree(
    scores: Sequence[Sequence[float]],
    depth: Sequence[int],
    deepest: int,
    cost: PassCost,
    draft_level: float,
    limit: int,
) -> tuple[int, int]:
    """(levels to draft, drafts each row keeps) for a batch, on host floats: scores[row][i] of draft i at depth[i],
    `deepest` levels of them.

    One pass verifies every row, padded to the widest tree, and the batch drafts as deep as its deepest row, so
    both are priced once for all rows: the depth and width that maximise the rows' summed expected tokens per
    unit of time, each level drafted costing `draft_level`. The shallowest of equals, and the fewest drafts."""
    best, choice = float("-inf"), (1, 0)
    for level in range(1, deepest + 1):
        shallow = [[s for s, d in zip(row, depth) if d <= level] for row in scores]
        rates = token_rates(shallow, cost, level * draft_level, limit)
        if max(rates) > best:
            best, choice = max(rates), (level, rates.index(max(rates)))
    return choice


def sized_static_paths(
    accuracy: Sequence[Sequence[float]], cost: PassCost, max_nodes: int = 15
) -> list[tuple[int, ...]]:
    """Medusa's sparse tree sized to the machine: of the `max_nodes` likeliest paths, the first n that
    maximise expected tokens per unit of time, (1 + their summed probability) / cost(n + 1). n may be 0:
    where no draft pays for its verification, plain decoding is fastest."""
    paths = best_static_paths(max_nodes, accuracy)
    scores = [sum(math.log(accuracy[d][r]) for d, r in enumerate(path)) for path in paths]
    return paths[: best_node_count([scores], cost, 0.0, len(paths))]


def likeliest_paths(
    probability: Sequence[Sequence[float]], nodes: int, cost: PassCost | None = None
) -> list[tuple[int, ...]]:
    """The `nodes` likeliest paths given probability[d][r] (a head's measured accuracies, or this step's own
    probabilities); with a measured `cost`, only as many of them as pay for their verification."""
    return sized_static_paths(probability, cost, nodes) if cost is not None else best_static_paths(nodes, probability)


def next_depth(kept: int, drafted: int, limit: int) -> int:
    """How many levels the next step drafts, after one that drafted `drafted` levels and kept drafts `kept` deep:
    one level more when the deepest level drafted paid for itself (was kept), else as deep as what was kept (at
    least one level, at most `limit`). Drafting one level past what was kept at every step cost a level that
    was thrown away at most steps (5% of a batch-8 step's time on MT-Bench prompts)."""
    return min(limit, kept + 1 if kept >= drafted else max(kept, 1))


def calibration_batch(rows: int) -> int:
    """The batch size whose calibration serves `rows` rows: the power of two at or below it (at most 64), so a few
    measurements serve every batch."""
    return min(1 << (max(rows, 1).bit_length() - 1), 64)


MAX_TOP_K, MAX_NODES = 64, 1024  # a verification pass over more tokens than this costs more than it can save


@dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2: expand the `top_k` best frontier nodes for `depth` steps, keep the best `nodes` drafts.

    With a measured `cost`, each step keeps only as many drafts as pay for their verification, and drafts
    no deeper than it kept last time, one level deeper when its deepest level paid (next_depth): when
    acceptance collapses, the tree shrinks toward plain decoding instead of costing more than it saves.
    """

    depth: int = 5
    top_k: int = 4
    nodes: int = 15  # draft nodes, root excluded: a verification pass covers nodes + 1 tokens
    cost: PassCost | None = None

    def __post_init__(self):
        for name in ("depth", "top_k", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TreeError(f"DynamicTreeSpec.{name} must be a whole number >= 1, got {value!r}")
        if self.top_k > MAX_TOP_K or self.nodes > MAX_NODES:
            raise TreeError(
                f"DynamicTreeSpec(top_k={self.top_k}, nodes={self.nodes}) is too large: top_k <= {MAX_TOP_K} and nodes "
                f"<= {MAX_NODES} (EAGLE-2 uses top_k 10 and 60 nodes)"
            )
        if self.cost is not None and not isinstance(self.cost, PassCost):
            raise TreeError(
                "DynamicTreeSpec.cost must be a PassCost (inference.calibrate.load_or_measure) or None, got "
                f"{type(self.cost).__name__}"
            )
