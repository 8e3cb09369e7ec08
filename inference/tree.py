"""Token trees and the tensors that let ONE target forward pass verify them.

A tree is `tokens[N]` and `parents[N]` in topological order: node 0 is the root (the last committed token,
which the target has not processed yet) with parent -1, and every other node's parent has a smaller index.
Everything else (depths, the ancestor matrix, the attention mask, positions, root-to-leaf paths) is
derived here by pure tensor functions, tested on their own in tests/test_tree.py.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class TreeError(ValueError):
    """A tree or tree setting that cannot be verified."""


def depths_and_ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """depth[N], ancestors[N, N] (ancestors[i, j]: j is i or an ancestor of i) and the maximum depth.

    Walks all nodes up one level per iteration, so the Python loop runs max-depth times, not N times.
    """
    n = parents.shape[0]
    nodes = torch.arange(n, device=parents.device)
    ancestors = torch.eye(n, dtype=torch.bool, device=parents.device)
    depth = torch.zeros(n, dtype=torch.long, device=parents.device)
    current = parents
    max_depth = 0
    while True:
        alive = current >= 0
        if not bool(alive.any()):
            return depth, ancestors, max_depth
        ancestors[nodes[alive], current[alive]] = True
        depth += alive
        max_depth += 1
        current = torch.where(alive, parents[current.clamp(min=0)], current)


def check_parents(parents: torch.Tensor) -> None:
    """Raise TreeError unless node 0 is the only root and every parent precedes its child."""
    n = parents.shape[0]
    if parents.dim() != 1 or n == 0:
        raise TreeError(f"parents must be a non-empty 1-D tensor, got shape {tuple(parents.shape)}")
    if int(parents[0]) != -1:
        raise TreeError(f"node 0 must be the root (parent -1), got parent {int(parents[0])}")
    bad = (parents[1:] < 0) | (parents[1:] >= torch.arange(1, n, device=parents.device))
    if bool(bad.any()):
        node = int(bad.nonzero()[0]) + 1
        raise TreeError(f"node {node} has parent {int(parents[node])}: parents must precede their children")


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, parents[0] == -1
    depth: torch.Tensor  # [N] long, root 0
    ancestors: torch.Tensor  # [N, N] bool, includes self
    max_depth: int

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, *, check: bool = True) -> Tree:
        if check:
            check_parents(parents)
            if tokens.shape != parents.shape:
                raise TreeError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} differ in shape")
        depth, ancestors, max_depth = depths_and_ancestors(parents)
        return cls(tokens, parents, depth, ancestors, max_depth)

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> Tree:
        """tokens[0] is the root, each next token the child of the one before."""
        n = tokens.shape[0]
        parents = torch.arange(-1, n - 1, device=tokens.device)
        ancestors = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        return cls(tokens, parents, torch.arange(n, device=tokens.device), ancestors, n - 1)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def with_tokens(self, tokens: torch.Tensor) -> Tree:
        """The same shape with other tokens: static trees reuse their structure every step."""
        return Tree(tokens, self.parents, self.depth, self.ancestors, self.max_depth)

    def truncate(self, max_depth: int) -> Tree:
        """Keep the nodes at depth <= max_depth (an ancestor-closed subset, so still a tree)."""
        if max_depth >= self.max_depth:
            return self
        return subtree(
            self.tokens, self.parents, self.depth, self.ancestors, (self.depth <= max_depth).nonzero().squeeze(-1)
        )


def verifiable_tree(
    tree, root: torch.Tensor, vocab_size: int | None, max_depth: int, drafter: str = "the drafter"
) -> Tree:
    """The tree a drafter proposed, made safe to verify: exactness must not depend on the drafter being sane.

    Raises TreeError (naming `drafter`) unless `tree` is a well-formed Tree rooted at `root` (the last
    committed token) with token ids in [0, vocab_size) (>= 0 when vocab_size is None) and depths and
    ancestors that agree with its parents. Repairs what is merely wasteful: nodes deeper than `max_depth`
    are cut, and a node that repeats an earlier sibling's token is dropped with its subtree (under sampling,
    two chances at one token would bias the output). All checks are vectorised and read back in ONE host
    transfer.
    """
    if not isinstance(tree, Tree) or not all(
        isinstance(t, torch.Tensor) for t in (tree.tokens, tree.parents, tree.depth, tree.ancestors)
    ):
        raise TreeError(f"{drafter} proposed {type(tree).__name__}, not an inference.Tree")
    tokens, parents, depth, ancestors = tree.tokens, tree.parents, tree.depth, tree.ancestors
    n = tokens.shape[0] if tokens.dim() == 1 else 0
    if (
        n == 0
        or parents.shape != (n,)
        or depth.shape != (n,)
        or ancestors.shape != (n, n)
        or (tokens.dtype, parents.dtype, depth.dtype, ancestors.dtype)
        != (torch.long, torch.long, torch.long, torch.bool)
        or len({t.device for t in (tokens, parents, depth, ancestors, root)}) != 1
    ):
        raise TreeError(
            f"{drafter} proposed a malformed tree: tokens {tuple(tokens.shape)} {tokens.dtype}, parents "
            f"{tuple(parents.shape)} {parents.dtype}, depth {tuple(depth.shape)}, ancestors {tuple(ancestors.shape)} "
            f"{ancestors.dtype} (devices must agree)"
        )
    nodes = torch.arange(n, device=tokens.device)
    parent = parents.clamp(0, n - 1)  # an invalid parent is reported below; clamped, it can still be gathered
    own = torch.eye(n, dtype=torch.bool, device=tokens.device)
    duplicate = (
        ((parents[:, None] == parents[None]) & (tokens[:, None] == tokens[None])).tril(-1).any(dim=-1)
    )  # an earlier sibling has its token
    problems = torch.stack(
        [
            tokens[0] != root,
            (parents[0] != -1) | ((parents[1:] < 0) | (parents[1:] >= nodes[1:])).any(),
            ((tokens < 0) | (tokens >= vocab_size if vocab_size is not None else tokens < 0)).any(),
            (depth[0] != 0)
            | (depth[1:] != depth[parent[1:]] + 1).any()
            | (depth.max() != tree.max_depth)
            | (ancestors[0] != own[0]).any()
            | (ancestors[1:] != (ancestors[parent[1:]] | own[1:])).any(),
            duplicate.any(),
        ]
    ).tolist()
    wrong_root, bad_parents, bad_tokens, inconsistent, repeated = problems
    if wrong_root:
        raise TreeError(
            f"{drafter} proposed a tree rooted at token {int(tokens[0])}, but the last committed token is {int(root)}: "
            "node 0 must be tokens[-1] of what propose() was given"
        )
    if bad_parents:
        raise TreeError(
            f"{drafter} proposed a tree whose parents {parents.tolist()[:32]} are not a tree: node 0 must be the root "
            "(parent -1) and every other node's parent must come before it"
        )
    if bad_tokens:
        raise TreeError(
            f"{drafter} proposed token ids outside the vocabulary [0, {vocab_size}): {tokens.tolist()[:32]}"
        )
    if inconsistent:
        raise TreeError(
            f"{drafter} proposed a tree whose depth, ancestors or max_depth disagree with its parents; build it with "
            "Tree.from_parents(tokens, parents) or Tree.chain(tokens)"
        )
    if repeated:
        tree = subtree(tokens, parents, depth, ancestors, (~(ancestors & duplicate).any(dim=-1)).nonzero().squeeze(-1))
    return tree.truncate(max_depth)


def subtree(tokens, parents, depth, ancestors, keep: torch.Tensor) -> Tree:
    """The tree on nodes `keep` (ascending, ancestor-closed), with parents renumbered."""
    new_index = torch.full_like(parents, -1)
    new_index[keep] = torch.arange(keep.shape[0], device=keep.device)
    kept_parents = parents[keep]
    kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp(min=0)], kept_parents)
    kept_depth = depth[keep]
    return Tree(tokens[keep], kept_parents, kept_depth, ancestors[keep][:, keep], int(kept_depth.max()))


def matched_depth(tokens: list[int], parents: list[int], committed: list[int]) -> int:
    """How many of the `committed` tokens (what the target chose after the root, in order) a tree (its nodes'
    tokens and parents, the root first) holds as a path from its root: the drafts it got accepted."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens)) if parent >= 0}
    node, depth = 0, 0
    for token in committed:
        node = children.get((node, token))
        if node is None:
            break
        depth += 1
    return depth


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, the dtype's minimum elsewhere.

    Additive float rather than bool: a bool 4D mask is silently wrong under the eager attention kernel.
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def attention_mask(tree: Tree, past_length: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, N, past + N]: every node sees the whole past, itself and its ancestors."""
    past = torch.ones(tree.size, past_length, dtype=torch.bool, device=tree.ancestors.device)
    return additive_mask(torch.cat([past, tree.ancestors], dim=1), dtype)[None, None]


def position_ids(tree: Tree, past_length: int) -> torch.Tensor:
    """[1, N]: a node sits at the position it would have in the sequence, past + depth."""
    return (tree.depth + past_length).unsqueeze(0)


def chain_inputs(tokens: torch.Tensor, past_length: int, rows: int, dtype: torch.dtype) -> dict:
    """A verification pass's inputs for `rows` rows each verifying the chain `tokens` [k] after `past_length` cached
    entries: input_ids, position_ids and the additive mask, each [rows, ...] and contiguous (as a batch's are)."""
    chain = Tree.chain(tokens)
    return {
        "input_ids": chain.tokens[None].expand(rows, -1).contiguous(),
        "position_ids": position_ids(chain, past_length).expand(rows, -1).contiguous(),
        "attention_mask": attention_mask(chain, past_length, dtype).expand(rows, -1, -1, -1).contiguous(),
    }


def retrieve_indices(tree: Tree) -> torch.Tensor:
    """[leaves, max_depth + 1]: node indices on each root-to-leaf path, padded with -1 (Medusa's layout)."""
    n = tree.size
    is_leaf = torch.ones(n, dtype=torch.bool, device=tree.parents.device)
    is_leaf[tree.parents[1:]] = False
    leaf_rows = tree.ancestors[is_leaf]  # [L, N]
    out = torch.full((leaf_rows.shape[0], tree.max_depth + 1), -1, dtype=torch.long, device=tree.parents.device)
    leaf, node = leaf_rows.nonzero(as_tuple=True)
    out[leaf, tree.depth[node]] = node
    return out


# ---- static trees: Medusa-style "choices" -------------------------------------------------------------


@dataclass(frozen=True)
class StaticTree:
    """The shape of a static tree: node i is candidate `rank[i]` of the draft at depth `depth[i]`."""

    paths: tuple[tuple[int, ...], ...]
    rank: torch.Tensor  # [N] long, 0 for the root
    structure: Tree  # tokens are placeholders

    @property
    def size(self) -> int:
        return self.structure.size

    @property
    def max_depth(self) -> int:
        return self.structure.max_depth

    @property
    def max_rank(self) -> int:
        return int(self.rank.max())

    def fill(self, root: torch.Tensor, candidates: torch.Tensor) -> Tree:
        """candidates[d, r]: the r-th best token for depth d + 1. Returns the tree with real tokens."""
        s = self.structure
        tokens = candidates[(s.depth - 1).clamp(min=0), self.rank]
        tokens[0] = root
        return s.with_tokens(tokens)


def static_tree(paths: Sequence[Sequence[int]]) -> StaticTree:
    """A tree from Medusa-style paths: (0,) is the best depth-1 candidate, (0, 1) the second-best
    depth-2 candidate below it, and so on. Every prefix of a path must be a path too."""
    unique = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if not unique:
        raise TreeError("a static tree needs at least one path, e.g. [(0,), (0, 0)]")
    index = {(): 0}
    parents, ranks = [-1], [0]
    for path in unique:
        if not path or min(path) < 0:
            raise TreeError(f"tree path {path} must be a non-empty tuple of ranks >= 0")
        if path[:-1] not in index:
            raise TreeError(f"tree path {path} has no parent path {path[:-1]}: every prefix must be listed")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
    parents_t = torch.tensor(parents)
    structure = Tree.from_parents(torch.zeros_like(parents_t), parents_t)
    return StaticTree(tuple(unique), torch.tensor(ranks), structure)


def chain_paths(length: int) -> list[tuple[int, ...]]:
    return [(0,) * d for d in range(1, length + 1)]


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


# ---- dynamic trees: EAGLE-2 -----------------------------------------------------------------------


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


def best_node_count(scores: torch.Tensor, cost: PassCost, draft_cost: float, limit: int) -> int:
    """How many drafts (0..limit) maximise expected tokens per unit of time.

    `scores` are the drafts' cumulative log-probabilities: EAGLE-2's estimate that each one is accepted.
    Keeping the n likeliest yields 1 + their summed probability tokens for `cost.draft_step + draft_cost +
    cost(n + 1)`.

    scores [rows, N] is a batch verified in one pass: every row's tree is padded to the widest, so a width of
    n costs the same whatever each row keeps, and every row keeps its n likeliest; the tokens are the rows' sum.
    """
    return int(token_rates(scores, cost, draft_cost, limit).argmax())


def token_rates(scores: torch.Tensor, cost: PassCost, draft_cost: float, limit: int) -> torch.Tensor:
    """[limit + 1]: expected tokens per unit of time for keeping 0..limit drafts (best_node_count)."""
    probs = scores.float().exp().reshape(-1, scores.shape[-1]).sort(dim=-1, descending=True).values[:, :limit].cpu()
    expected = torch.cat([torch.ones(probs.shape[0], 1), 1 + probs.cumsum(dim=-1)], dim=-1).sum(dim=0)
    seconds = torch.tensor([cost.draft_step + draft_cost + cost(n + 1) for n in range(expected.shape[0])])
    return expected / seconds


def best_shared_tree(
    scores: torch.Tensor, depth: torch.Tensor, cost: PassCost, draft_level: float, limit: int
) -> tuple[int, int]:
    """(levels to draft, drafts each row keeps) for a batch: scores [rows, N] of drafts at `depth` [N].

    One pass verifies every row, padded to the widest tree, and the batch drafts as deep as its deepest row, so
    both are priced once for all rows: the depth and width that maximise the rows' summed expected tokens per
    unit of time, each level drafted costing `draft_level`."""
    best, choice = float("-inf"), (1, 0)
    for levels in range(1, int(depth.max()) + 1):
        rates = token_rates(scores.masked_fill(depth > levels, float("-inf")), cost, levels * draft_level, limit)
        if float(rates.max()) > best:
            best, choice = float(rates.max()), (levels, int(rates.argmax()))
    return choice


def sized_static_paths(
    accuracy: Sequence[Sequence[float]], cost: PassCost, max_nodes: int = 15
) -> list[tuple[int, ...]]:
    """Medusa's sparse tree sized to the machine: of the `max_nodes` likeliest paths, the first n that
    maximise expected tokens per unit of time, (1 + their summed probability) / cost(n + 1). n may be 0:
    where no draft pays for its verification, plain decoding is fastest."""
    paths = best_static_paths(max_nodes, accuracy)
    probability = torch.tensor([math.prod(accuracy[d][r] for d, r in enumerate(path)) for path in paths])
    return paths[: best_node_count(probability.log(), cost, 0.0, len(paths))]


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


def select_best_nodes(scores: torch.Tensor, depth: torch.Tensor, count: int) -> torch.Tensor:
    """Indices (ascending) of the root plus the `count` best non-root nodes by cumulative log-probability.

    A child's score never exceeds its parent's; breaking ties toward the shallower node keeps the
    selection ancestor-closed even when a step had probability 1. Nodes scored -inf or NaN (a head with
    non-finite weights) are impossible drafts and never kept; a child of one is one too.
    """
    possible = scores > float("-inf")  # False for NaN as well
    possible[0] = True
    key = torch.where(possible, scores.double() - 1e-9 * depth.double(), float("-inf"))
    key[0] = float("inf")
    count = min(count + 1, int(possible.sum()))
    return key.topk(count).indices.sort().values


def graft_span(tokens, parents, depth, ancestors, scores, span, log_rate: float):
    """A candidate pool of one row (tokens, parents, depth [N], ancestors [N, N], path log-scores [N]; node 0 the
    root) with a copied span grafted on as a path from the root. The span's first tokens that the pool already
    holds as a path keep their scores; the rest of the span is appended as a chain under the last of them, each
    token scored `log_rate` below its parent (the log-probability that a copied token the pool did not have is
    right, when what precedes it is). Returns the five, grown, and how many span tokens the pool held.

    Every node's score stays at most its parent's, so select_best_nodes keeps the grown pool ancestor-closed.
    """
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents.tolist(), tokens.tolist())) if p >= 0}
    node, held = 0, 0
    for token in span.tolist():
        found = children.get((node, token))
        if found is None:
            break
        node, held = found, held + 1
    rest, count = span[held:], tokens.shape[0]
    if rest.shape[0] == 0:
        return (tokens, parents, depth, ancestors, scores), held
    added, device = rest.shape[0], tokens.device
    grown = torch.zeros(count + added, count + added, dtype=torch.bool, device=device)
    grown[:count, :count] = ancestors
    grown[count:, :count] = ancestors[node]
    grown[count:, count:] = torch.ones(added, added, dtype=torch.bool, device=device).tril()
    chain = torch.arange(count - 1, count + added - 1, device=device)
    chain[0] = node
    steps = torch.arange(1, added + 1, device=device)
    return (
        torch.cat([tokens, rest]),
        torch.cat([parents, chain]),
        torch.cat([depth, depth[node] + steps]),
        grown,
        torch.cat([scores, scores[node] + log_rate * steps.to(scores.dtype)]),
    ), held


# ---- merging proposals of several drafters ---------------------------------------------------------


def merge_trees(first: Tree, second: Tree) -> Tree:
    """One tree holding every root-to-node path of both (shared prefixes once). Roots must agree.

    A loop over the second tree's nodes (a copied span: ~10), on Python ints; far below a forward pass.
    """
    if int(first.tokens[0]) != int(second.tokens[0]):
        raise TreeError("cannot merge trees with different roots")
    tokens, parents = first.tokens.tolist(), first.parents.tolist()
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if p >= 0}
    mapped = [0]
    for parent, token in zip(second.parents.tolist()[1:], second.tokens.tolist()[1:]):
        key = (mapped[parent], token)
        if key not in child:
            child[key] = len(tokens)
            tokens.append(token)
            parents.append(key[0])
        mapped.append(child[key])
    if len(tokens) == first.size:
        return first
    device = first.tokens.device
    return Tree.from_parents(torch.tensor(tokens, device=device), torch.tensor(parents, device=device), check=False)
