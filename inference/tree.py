"""Token trees and the tensors that let ONE target forward pass verify them.

A tree is `tokens[N]` and `parents[N]` in topological order: node 0 is the root (the last committed token,
which the target has not processed yet) with parent -1, and every other node's parent has a smaller index.
Everything else (depths, the ancestor matrix, the attention mask, positions, root-to-leaf paths) is
derived here by pure tensor functions, tested on their own in tests/test_tree.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .transfer import to_device


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
    max_depth: int | None  # None: not read back yet (verifiable_tree reads it with the tree's checks)
    # (tokens, parents) on the host, set by from_lists only: such a tree is checked there (verifiable_host_tree)
    host: tuple[tuple[int, ...], tuple[int, ...]] | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor, *, check: bool = True) -> Tree:
        if check:
            check_parents(parents)
            if tokens.shape != parents.shape:
                raise TreeError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} differ in shape")
        depth, ancestors, max_depth = depths_and_ancestors(parents)
        return cls(tokens, parents, depth, ancestors, max_depth)

    @classmethod
    def from_lists(cls, tokens: Sequence[int], parents: Sequence[int], device: torch.device | str = "cpu") -> Tree:
        """A tree whose tokens and parents are on the host already: its depths and ancestors are worked out there
        too and copied to `device` (to_device), so nothing is read back from the device. It keeps the two lists
        (`host`)."""
        tokens, parents = tuple(int(t) for t in tokens), tuple(int(p) for p in parents)
        if not parents or len(tokens) != len(parents):
            raise TreeError(f"a tree needs as many tokens as parents, at least one: {len(tokens)} and {len(parents)}")
        if parents[0] != -1 or any(not 0 <= parent < node for node, parent in enumerate(parents[1:], start=1)):
            raise TreeError(
                f"parents {list(parents[:32])} are not a tree: node 0 must be the root (parent -1) and every other "
                "node's parent must come before it"
            )
        depth, ancestors = [0], [[True] + [False] * (len(parents) - 1)]
        for node, parent in enumerate(parents[1:], start=1):
            depth.append(depth[parent] + 1)
            ancestors.append(ancestors[parent].copy())  # its parent's ancestors, and itself
            ancestors[node][node] = True
        matrix = torch.tensor(ancestors, dtype=torch.bool)  # one call: a row at a time cost a few µs a node
        uploaded = functools.partial(to_device, device=device)
        tree = cls(uploaded(tokens), uploaded(parents), uploaded(depth), uploaded(matrix, dtype=torch.bool), max(depth))
        object.__setattr__(tree, "host", (tokens, parents))  # frozen: set once, here
        return tree

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
    return verifiable_trees([tree], [root], vocab_size, [max_depth], drafter)[0]


def verifiable_trees(
    trees: list, roots: list[torch.Tensor], vocab_size: int | None, max_depths: list[int], drafter: str = "the drafter"
) -> list[Tree]:
    """verifiable_tree for several trees (a batch's rows), their checks read back in ONE host transfer."""
    checked = [tree_problems(tree, root, vocab_size, drafter) for tree, root in zip(trees, roots)]
    values = torch.cat(
        [torch.cat([problems.long(), tree.depth.max()[None]]) for (problems, _), tree in zip(checked, trees)]
    ).tolist()
    safe = []
    for index, (tree, root, max_depth, (_, duplicate)) in enumerate(zip(trees, roots, max_depths, checked)):
        flags, deepest = values[6 * index : 6 * index + 5], values[6 * index + 5]
        raise_tree_problems(flags, tree, root, vocab_size, drafter)
        if tree.max_depth is None:
            tree = replace(tree, max_depth=deepest)
        if flags[-1]:  # a repeated token
            tokens, parents, depth, ancestors = tree.tokens, tree.parents, tree.depth, tree.ancestors
            kept = (~(ancestors & duplicate).any(dim=-1)).nonzero().squeeze(-1)
            tree = subtree(tokens, parents, depth, ancestors, kept)
        safe.append(tree.truncate(max_depth))
    return safe


def verifiable_host_tree(
    tree: Tree, root: int, device: torch.device, vocab_size: int, max_depth: int, drafter: str = "the drafter"
) -> Tree:
    """verifiable_tree for a tree built by Tree.from_lists, which checked its parents and worked out its depths and
    ancestors itself: its root, token ids and device are checked, and its repeated siblings and nodes deeper than
    `max_depth` cut, on its host lists, with no read of the device."""
    tokens, parents = tree.host
    if tree.tokens.device != device:
        raise TreeError(f"{drafter} proposed a tree on {tree.tokens.device}, but the target runs on {device}")
    wrong_root = tokens[0] != root
    bad_tokens = any(not 0 <= token < vocab_size for token in tokens)
    if wrong_root or bad_tokens:
        raise_tree_problems([wrong_root, False, bad_tokens, False, False], tree, root, vocab_size, drafter)
    depth, seen, kept = [0], set(), {0}
    for node, (token, parent) in enumerate(zip(tokens[1:], parents[1:]), start=1):
        depth.append(depth[parent] + 1)
        if parent in kept and depth[node] <= max_depth and (parent, token) not in seen:
            seen.add((parent, token))
            kept.add(node)
    if len(kept) == len(tokens):
        return tree
    return host_subtree(tokens, parents, sorted(kept), device)


def verifiable_chain(
    tree, root: torch.Tensor, vocab_size: int, max_depth: int, drafter: str = "the drafter"
) -> tuple[Tree, torch.Tensor]:
    """(chain, problems) for a proposed tree that says it is a chain (max_depth = size - 1), without a host read:
    a chain has no siblings to repeat a token, so nothing needs repairing before the target's pass, and its checks
    (`problems`, for raise_tree_problems) are read back with the step's outcome, before anything is committed. The
    chain verified is rebuilt from the proposed tokens (clamped into the vocabulary, cut to `max_depth`), so that
    even a malformed proposal only makes a pass whose outcome is then refused."""
    problems, _ = tree_problems(tree, root, vocab_size, drafter)
    return Tree.chain(tree.tokens[: max_depth + 1].clamp(0, vocab_size - 1)), problems


def is_chain(tree) -> bool:
    """Whether a proposed tree says it is a chain (verifiable_chain checks that it is)."""
    return isinstance(tree, Tree) and isinstance(tree.tokens, torch.Tensor) and tree.max_depth == tree.size - 1


def tree_problems(tree, root: torch.Tensor, vocab_size: int | None, drafter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(problems [5] bool: wrong root, bad parents, bad tokens, inconsistent, repeated; duplicate [N] bool: the nodes
    repeating an earlier sibling's token), on the device. What is wrong with the tree's types or shapes raises at
    once."""
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
            | ((depth.max() != tree.max_depth) if tree.max_depth is not None else False)
            | (ancestors[0] != own[0]).any()
            | (ancestors[1:] != (ancestors[parent[1:]] | own[1:])).any(),
            duplicate.any(),
        ]
    )
    return problems, duplicate


def raise_tree_problems(problems: list[bool], tree: Tree, root: torch.Tensor, vocab_size: int | None, drafter: str):
    """TreeError for the first of tree_problems' flags (read back) that is set, but for a repeated token."""
    wrong_root, bad_parents, bad_tokens, inconsistent, _ = problems
    tokens, parents = tree.tokens, tree.parents
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


def subtree(tokens, parents, depth, ancestors, keep: torch.Tensor, *, read_depth: bool = True) -> Tree:
    """The tree on nodes `keep` (ascending, ancestor-closed), with parents renumbered. `read_depth=False` leaves its
    max_depth None, for the loop to read back with the tree's checks (verifiable_tree): one host read fewer."""
    new_index = torch.full_like(parents, -1)
    new_index[keep] = torch.arange(keep.shape[0], device=keep.device)
    kept_parents = parents[keep]
    kept_parents = torch.where(kept_parents >= 0, new_index[kept_parents.clamp(min=0)], kept_parents)
    kept_depth = depth[keep]
    max_depth = int(kept_depth.max()) if read_depth else None
    return Tree(tokens[keep], kept_parents, kept_depth, ancestors[keep][:, keep], max_depth)


def on_committed_path(tree: Tree, committed: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """[N] bool: whether each node's path from the root spells the first `committed` tokens (what the target chose
    after the root, in order), through nodes `counted` [N] bool only (None: all). The root always does."""
    if committed.shape[0] == 0:
        return tree.depth == 0
    wanted = committed[(tree.depth - 1).clamp(0, committed.shape[0] - 1)]  # the committed token at each node's depth
    holds = (tree.depth == 0) | ((tree.depth <= committed.shape[0]) & (tree.tokens == wanted))
    if counted is not None:
        holds = holds & counted
    return ~(tree.ancestors & ~holds).any(dim=-1)  # the node and all its ancestors hold


def matched_depth(tree: Tree, committed: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """How many of the `committed` tokens the tree holds as a path from its root, through nodes `counted` only
    (on_committed_path): the drafts it got accepted. A 0-dim tensor, worked out on the device."""
    return (tree.depth * on_committed_path(tree, committed, counted)).max()


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

    def host_tree(self, root: int, candidates: Sequence[Sequence[int]], max_depth: int, device) -> Tree:
        """fill on the host: candidates[d][r] read back already, the tree built by Tree.from_lists and cut to
        `max_depth` (its paths are prefix-closed, so the cut is a tree)."""
        index, tokens, parents = {(): 0}, [root], [-1]
        for path in self.paths:
            if len(path) <= max_depth:
                index[path] = len(tokens)
                tokens.append(candidates[len(path) - 1][path[-1]])
                parents.append(index[path[:-1]])
        return Tree.from_lists(tokens, parents, device)

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


def host_subtree(tokens, parents, keep: Sequence[int], device) -> Tree:
    """subtree on the host: the tree on nodes `keep` (ascending, ancestor-closed), built by Tree.from_lists; tokens[n]
    and parents[n] of every kept node n (lists, or dicts by node)."""
    index = {node: place for place, node in enumerate(keep)}
    return Tree.from_lists([tokens[n] for n in keep], [index.get(parents[n], -1) for n in keep], device)
