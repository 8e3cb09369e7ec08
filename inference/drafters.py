"""Drafters: where candidate trees come from, behind one small interface.

The decode loop only ever calls three methods (transformers' candidate generators have the same shape):
- `reset()`                      a new sequence starts;
- `observe(hidden, next_tokens)` the target has processed k more tokens: `hidden[layer]` is their [k, H]
                                 hidden states for each layer in `hidden_layers`, `next_tokens[k]` the
                                 committed tokens that follow each of them (the last is the new root);
- `propose(tokens, max_depth)`   a Tree rooted at tokens[-1], no deeper than max_depth.
"""

from __future__ import annotations

import functools
import math
from collections import ChainMap
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache

from heads import DraftVocabulary, EagleHead, EarlyExitHead, HeadConfigError, MedusaHeads, copy_embedding, copy_tokens
from heads.config import check_feature_layers

from .tree import (
    MAX_TOP_K,
    DynamicTreeSpec,
    PassCost,
    StaticTree,
    Tree,
    TreeError,
    additive_mask,
    best_node_count,
    likeliest_paths,
    merge_trees,
    select_best_nodes,
    static_tree,
    subtree,
    verifiable_tree,
)


@runtime_checkable
class Drafter(Protocol):
    hidden_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def observe(self, hidden: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None: ...

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree: ...


def root_only(tokens: torch.Tensor) -> Tree:
    return Tree.chain(tokens[-1:])


class TokenDrafter:
    """Base for drafters that read only the committed tokens: no state to reset, nothing to observe.

    `trusted`, set by `propose`, tells a MergedDrafter that this step's span is right often enough that the
    heads beside it need only draft their depth-1 candidates."""

    hidden_layers: tuple[int, ...] = ()
    trusted: bool = False

    def reset(self) -> None:
        pass

    def observe(self, hidden, next_tokens) -> None:
        pass


class NoDrafter(TokenDrafter):
    """Plain decoding through the same loop: every tree is just the root."""

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return root_only(tokens)


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A head's log-probabilities in float32, -inf where they are NaN (non-finite weights): impossible drafts."""
    return torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=float("-inf"))


def _check_head_fits(heads, model, what: str) -> None:
    config, target = heads.config, model.config
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise HeadConfigError(
            f"{what} expects hidden size {config.hidden_size} and vocab {config.vocab_size}, but the target "
            f"{getattr(target, '_name_or_path', '') or target.model_type!r} has {target.hidden_size} and "
            f"{target.vocab_size}: these heads were built for another base model"
        )
    check_feature_layers(config, target, what)
    if isinstance(heads, EarlyExitHead) and not heads.runs_on(model):
        raise HeadConfigError(
            f"{what} runs the layers of another model instance, or of this one before it was moved or cast: load it "
            f"again for this model (heads.load_heads(path, model)) after any .to(...)"
        )
    parameter = next(heads.parameters(), None)  # an untrained early exit has none
    if parameter is not None and (parameter.dtype, parameter.device) != (model.dtype, model.device):
        raise HeadConfigError(
            f"{what} are in {parameter.dtype} on {parameter.device} but the target is in {model.dtype} on {model.device} "
            f"(was the model moved or cast after its heads were loaded?): call heads.to(device=model.device, dtype=model.dtype)"
        )


def _as_static_tree(tree) -> StaticTree:
    if isinstance(tree, StaticTree):
        return tree
    if isinstance(tree, (list, tuple)):
        return static_tree(tree)
    raise TreeError(f"expected a static tree (a list of paths such as [(0,), (0, 0), (1,)]), got {tree!r}")


def medusa_tree_spec(heads: MedusaHeads, nodes: int = 15, cost: PassCost | None = None) -> DynamicTreeSpec:
    """Medusa heads' default tree: each step the `nodes` likeliest paths by the heads' own probabilities, as
    deep or as wide as they are sure (any rank may be kept, so top_k = nodes); with a measured `cost`, only
    as many of them as pay for their verification on this machine."""
    return DynamicTreeSpec(depth=heads.config.num_heads, top_k=min(nodes, MAX_TOP_K), nodes=nodes, cost=cost)


class MedusaDrafter:
    """Head d proposes its top candidates for depth d; a tree picks which ranks to verify.

    A `DynamicTreeSpec` (the default: `medusa_tree_spec`) picks, each step, the `nodes` likeliest paths by
    the product of the heads' own probabilities for their candidates (EAGLE-2's idea on Medusa heads): deep
    where the heads are sure, wide where they hesitate. A static tree (a list of paths, Medusa's original)
    verifies the same ranks every step; an empty one (`[]`) verifies the root alone: plain decoding.
    """

    hidden_layers = (-1,)

    def __init__(self, heads: MedusaHeads, model, tree=None):
        _check_head_fits(heads, model, "these Medusa heads")
        k = heads.config.num_heads
        if tree is None:
            tree = medusa_tree_spec(heads)
        self.spec = tree if isinstance(tree, DynamicTreeSpec) else None
        self.tree = None if self.spec is not None or (isinstance(tree, (list, tuple)) and not tree) else _as_static_tree(tree)
        if self.tree is not None and self.tree.max_depth > k:
            raise TreeError(f"the tree is {self.tree.max_depth} deep, which needs {self.tree.max_depth} Medusa heads; the checkpoint has {k}")
        self.heads, self.vocab = heads, DraftVocabulary(model.get_output_embeddings(), heads.draft_ids)
        if self.tree is not None and self.tree.max_rank >= self.vocab.weight.shape[0]:
            raise TreeError(
                f"the tree asks for candidate rank {self.tree.max_rank}, but the heads draft from {self.vocab.weight.shape[0]} tokens; use lower ranks"
            )
        self.hidden = None

    def reset(self) -> None:
        self.hidden = None

    def observe(self, hidden, next_tokens) -> None:
        self.hidden = hidden[-1][-1]  # the state that produced the root

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        if self.spec is not None:
            depth, ranks = min(self.spec.depth, self.heads.config.num_heads, max_depth), self.spec.top_k
        elif self.tree is not None:
            depth, ranks = self.tree.max_depth, self.tree.max_rank + 1
        else:
            depth = 0
        if depth < 1:
            return root_only(tokens)
        logits = self.heads.draft_logits(self.heads(self.hidden)[:depth], self.vocab)  # [depth, N], one projection for all heads
        top = log_probabilities(logits).topk(min(ranks, logits.shape[-1]), dim=-1)  # a draft vocabulary may be tiny
        tree = self.tree if self.spec is None else self._likeliest_tree(top.values.exp().tolist())
        if tree is None:
            return root_only(tokens)
        return tree.fill(tokens[-1], self.vocab.to_target(top.indices)).truncate(max_depth)

    def _likeliest_tree(self, probability: list[list[float]]) -> StaticTree | None:
        """This step's best paths, with probability[d][r] standing where a static tree has measured accuracies."""
        paths = likeliest_paths(probability, self.spec.nodes, self.spec.cost)
        return cached_static_tree(tuple(paths)) if paths else None


cached_static_tree = functools.lru_cache(maxsize=4096)(static_tree)  # a step's shape recurs often: build each once


RELIABILITY_DECAY = 0.9  # the head's reliability is estimated over roughly the last ten steps
MAX_CANDIDATES = 1 << 14  # draft nodes scored per step; their ancestor matrix takes this squared in bytes (256 MiB)


class DynamicTreeDrafter:
    """EAGLE-2 dynamic trees from a drafter that keeps its own KV cache: grown depth by depth with tree attention
    inside the drafter, each level expanding the `top_k` likeliest nodes by their path probability, then cut to
    the `nodes` best (or, with a measured cost, to those that pay for their verification).

    A subclass reads the committed text into its cache (`_read_committed`, which leaves `self.last`, its output
    [H] for the root, and `self.length`, the entries its cache holds) and expands a frontier of draft nodes
    (`_expand`: their outputs [F, H]); outputs become draft logits through `self.vocab`. Draft entries are
    dropped from the cache again after every proposal.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, vocab: DraftVocabulary, tree: DynamicTreeSpec | None, what: str):
        if tree is not None and not isinstance(tree, DynamicTreeSpec):
            raise TreeError(f"the {what} drafter grows dynamic trees: pass tree=DynamicTreeSpec(depth, top_k, nodes), got {tree!r}")
        self.spec, self.vocab = tree or DynamicTreeSpec(), vocab
        k = min(self.spec.top_k, vocab.weight.shape[0])
        candidates = 1 + k + (self.spec.depth - 1) * k * k  # every level's children before the best are kept
        if candidates > MAX_CANDIDATES:
            raise TreeError(
                f"DynamicTreeSpec(depth={self.spec.depth}, top_k={self.spec.top_k}) scores {candidates:,} candidate nodes a step "
                f"(more than {MAX_CANDIDATES:,}); EAGLE-2 uses top_k <= 10 and depth <= 8"
            )

    def reset(self) -> None:
        self.cache, self.length, self.last = DynamicCache(), 0, None
        self.levels = self.spec.depth  # with a measured cost: how deep the next tree may grow
        # How far the drafter's probabilities hold on this sequence: decayed sums of its top depth-1 draft's
        # probability and of how often the target then chose that token (a prior of one right guess).
        self.guess, self.expected, self.realised = None, 1.0, 1.0

    @property
    def reliability(self) -> float:
        """Observed over predicted acceptance of the drafter's best depth-1 draft, at most 1."""
        return min(1.0, self.realised / self.expected)

    def observe(self, hidden, next_tokens) -> None:
        if self.guess is not None:  # next_tokens[0] is what the target chose at the root
            token, probability = self.guess
            self.expected = RELIABILITY_DECAY * self.expected + probability
            self.realised = RELIABILITY_DECAY * self.realised + float(int(next_tokens[0]) == token)
            self.guess = None

    def _read_committed(self, tokens: torch.Tensor) -> None:
        raise NotImplementedError

    def _expand(self, nodes: DraftNodes, frontier: torch.Tensor, states: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _log_probs(self, outputs: torch.Tensor) -> torch.Tensor:
        return log_probabilities(self.vocab.logits(outputs))

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        self._read_committed(tokens)
        depth_limit = min(self.levels, max_depth)
        if depth_limit < 1:
            return root_only(tokens)
        k = min(self.spec.top_k, self.vocab.weight.shape[0])  # a draft vocabulary may be tiny
        nodes = DraftNodes(tokens[-1], 1 + k + (depth_limit - 1) * k * k, self.vocab)
        frontier = nodes.add_children(torch.zeros(1, dtype=torch.long, device=tokens.device), self._log_probs(self.last)[None], k)
        states, fed = self.last.expand(k, -1), []
        for level in range(1, depth_limit):
            fed.append(frontier)
            fed_nodes = torch.cat(fed)
            # a frontier node sees every committed entry and, among the fed draft nodes, its own ancestors
            committed = torch.ones(frontier.shape[0], self.length, dtype=torch.bool, device=tokens.device)
            allowed = torch.cat([committed, nodes.ancestors[frontier][:, fed_nodes]], dim=1)
            positions = torch.full((1, frontier.shape[0]), self.length + level - 1, device=tokens.device)  # depth d: length + d - 1
            out = self._expand(nodes, frontier, states, additive_mask(allowed, self.last.dtype)[None, None], positions)
            children = nodes.add_children(frontier, self._log_probs(out), k)
            best = nodes.scores[children].topk(min(k, children.shape[0])).indices  # EAGLE-2: expand the likeliest
            frontier, states = children[best], out[best // k]
        self.cache.crop(-sum(f.shape[0] for f in fed))
        return self._select(nodes, depth_limit, max_depth)

    def _select(self, nodes: DraftNodes, depth_limit: int, max_depth: int) -> Tree:
        """The nodes to verify: the `spec.nodes` likeliest, or with a measured cost those that pay for themselves."""
        count, scores, depth = nodes.count, nodes.scores, nodes.depth
        self.guess = (int(nodes.tokens[1]), float(scores[1].exp()))  # the best depth-1 draft (topk is sorted)
        keep_count = self.spec.nodes
        if self.spec.cost is not None:  # keep what pays for itself; next time draft one level past it
            cost = self.spec.cost
            believed = scores[1:count] + math.log(max(self.reliability, 1e-6))  # an overconfident drafter is discounted
            keep_count = best_node_count(believed, cost, depth_limit * cost.draft_level, self.spec.nodes)
        keep = select_best_nodes(scores[:count], depth[:count], keep_count)
        if self.spec.cost is not None and max_depth >= self.levels:  # not when a caller capped this step's depth
            self.levels = min(self.spec.depth, int(depth[keep].max()) + 1)
        return subtree(nodes.tokens, nodes.parents, depth, nodes.ancestors, keep)


class DraftNodes:
    """A tree being grown: node 0 is the root; children are appended level by level with their path scores."""

    def __init__(self, root: torch.Tensor, capacity: int, vocab: DraftVocabulary):
        device = root.device
        self.vocab, self.count = vocab, 1
        self.tokens = torch.empty(capacity, dtype=torch.long, device=device)
        self.parents = torch.empty_like(self.tokens)
        self.depth = torch.empty_like(self.tokens)
        self.scores = torch.empty(capacity, dtype=torch.float32, device=device)  # log-probability of the path
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)
        self.tokens[0], self.parents[0], self.depth[0], self.scores[0], self.ancestors[0, 0] = root, -1, 0, 0.0, True

    def add_children(self, frontier: torch.Tensor, log_probs: torch.Tensor, k: int) -> torch.Tensor:
        """Each frontier node's `k` likeliest children (log_probs [F, draft vocab]); returns their indices."""
        top = log_probs.topk(k, dim=-1)  # [F, k]
        children = torch.arange(self.count, self.count + top.indices.numel(), device=self.tokens.device)
        parents = frontier.repeat_interleave(k)
        self.tokens[children], self.parents[children] = self.vocab.to_target(top.indices).flatten(), parents
        self.depth[children] = self.depth[parents] + 1
        self.scores[children] = (self.scores[frontier, None] + top.values).flatten()
        self.ancestors[children] = self.ancestors[parents]
        self.ancestors[children, children] = True
        self.count += children.shape[0]
        return children


class EagleDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from an EAGLE head that keeps its own KV cache.

    The head reads pairs (feature of token t, token t+1) at position t. `observe` queues the committed
    pairs; `propose` first feeds them to the head (a head with `copy_input` also reads each pair's copy
    token, which needs the committed text that `propose` is given), so its cache holds every committed pair
    and `self.last` is its output for the newest one: the predicted feature of the root, whose logits give
    the depth-1 candidates. A draft node's input is its parent's predicted feature and its own token.
    """

    def __init__(self, head: EagleHead, model, tree: DynamicTreeSpec | None = None):
        _check_head_fits(head, model, "this EAGLE head")
        super().__init__(head.draft_vocabulary(model.get_output_embeddings()), tree, "EAGLE")
        self.head, self.embed = head, model.get_input_embeddings()
        self.hidden_layers = tuple(head.config.feature_layers)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # observed pairs the head has not read yet
        self.successors: dict[tuple[int, int], int] = {}  # committed bigram -> the token after it (copy_tokens)
        self.tail = None  # the committed text's last two tokens, for the copy tokens of draft nodes

    def observe(self, hidden, next_tokens) -> None:
        super().observe(hidden, next_tokens)
        self.pending.append((torch.cat([hidden[layer] for layer in self.hidden_layers], dim=-1), next_tokens))  # fused inside the head

    def _read_committed(self, tokens: torch.Tensor) -> None:
        """Feed the head the pairs observed since the last proposal; `tokens` is the committed text."""
        self.tail = tokens[-2:].tolist() if self.head.config.copy_input else None
        if not self.pending:
            return
        feature = torch.cat([f for f, _ in self.pending])
        next_tokens = torch.cat([t for _, t in self.pending])
        self.pending = []
        k = next_tokens.shape[0]
        copies = None
        if self.head.config.copy_input:  # the bigram map holds the text before; pairs from self.length need one token back
            offset = max(self.length - 1, 0)
            found = copy_tokens(tokens[offset:].tolist(), self.length - offset, self.length - offset + k, self.successors)
            copies = copy_embedding(self.embed, torch.tensor(found, device=tokens.device))[None]
        positions = torch.arange(self.length, self.length + k, device=next_tokens.device)
        out = self.head(feature[None], self.embed(next_tokens)[None], copies, position_ids=positions[None], cache=self.cache)
        self.last, self.length = out[0, -1], self.length + k

    def _expand(self, nodes: DraftNodes, frontier: torch.Tensor, states: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        copies = None
        if self.tail is not None:  # one transfer of the tree so far, then the paths are walked on the host
            copies = self._draft_copies(self.tail, nodes.tokens[: nodes.count].tolist(), nodes.parents[: nodes.count].tolist(), frontier.tolist())[None]
        return self.head(states[None], self.embed(nodes.tokens[frontier])[None], copies, position_ids=positions, attention_mask=mask, cache=self.cache)[0]

    def _draft_copies(self, tail: list[int], node_tokens: list[int], parents: list[int], frontier: list[int]) -> torch.Tensor:
        """Copy tokens of draft nodes: the committed text (`tail`: its last two tokens, the root last) continued
        by each node's path, read on top of the committed bigrams without changing them."""
        found = []
        for node in frontier:
            path = []
            while node > 0:  # up to the root, node 0
                path.append(node_tokens[node])
                node = parents[node]
            text = tail + path[::-1]
            found.append(copy_tokens(text, len(tail) - 1, len(text) - 1, ChainMap({}, self.successors))[-1])
        return copy_embedding(self.embed, torch.tensor(found, device=self.last.device))


class EarlyExitDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from the target's own first layers (heads.early_exit): a draft node's input is
    its token alone, at its position, over the early layers' own cache of the committed text.

    The cache is the draft's own, not the target's: with an adapter the early layers' keys and values differ
    from the target's, and draft positions must never enter the target's cache. `propose` first runs the
    tokens committed since the last proposal (the root last) through the early layers in one pass.
    """

    def __init__(self, head: EarlyExitHead, model, tree: DynamicTreeSpec | None = None):
        _check_head_fits(head, model, "this early-exit head")
        super().__init__(DraftVocabulary(model.get_output_embeddings(), head.draft_ids), tree, "early-exit")
        self.head = head
        self.reset()

    def _read_committed(self, tokens: torch.Tensor) -> None:
        new = tokens[self.length :]  # the committed text only grows: what the cache holds stays valid
        if new.shape[0] == 0:
            return
        positions = torch.arange(self.length, tokens.shape[0], device=tokens.device)
        out = self.head(new[None], position_ids=positions[None], cache=self.cache)
        self.last, self.length = out[0, -1], tokens.shape[0]

    def _expand(self, nodes: DraftNodes, frontier: torch.Tensor, states: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(nodes.tokens[frontier][None], position_ids=positions, attention_mask=mask, cache=self.cache)[0]


class PromptLookupDrafter(TokenDrafter):
    """Copy what followed the latest earlier occurrence of the last n tokens (longest n first).

    After `propose`, `trusted` says whether the span came from a match of at least `trusted_ngram` tokens:
    such spans are right often enough that a merged head need not draft deep beside them (MergedDrafter).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10, trusted_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1 or trusted_ngram < 1:
            raise ValueError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, num_tokens >= 1 and trusted_ngram >= 1, "
                f"got {min_ngram}, {max_ngram}, {num_tokens}, {trusted_ngram}"
            )
        self.max_ngram, self.min_ngram, self.num_tokens, self.trusted_ngram = max_ngram, min_ngram, num_tokens, trusted_ngram

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        length = tokens.shape[0]
        self.trusted = False
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = tokens[: length - 1].unfold(0, n, 1)  # every n-gram with at least one token after it
            starts = (windows == tokens[length - n :]).all(dim=-1).nonzero()
            if starts.shape[0]:
                begin = int(starts[-1]) + n
                span = tokens[begin : begin + min(self.num_tokens, max_depth)]
                self.trusted = n >= self.trusted_ngram and span.shape[0] > 0
                return Tree.chain(torch.cat([tokens[-1:], span]))
        return root_only(tokens)


class MergedDrafter:
    """Several drafters' trees merged into ONE tree, verified in the same target pass.

    Drafters that read only tokens propose first. When one of them is `trusted` (prompt lookup matched a
    long enough n-gram), the drafters with heads draft one level only: their depth-1 candidates cost a
    projection, deeper levels cost head passes, and beside a trusted span they rarely win a token.
    """

    def __init__(self, drafters: Sequence[Drafter]):
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.drafters = list(drafters)
        self.hidden_layers = tuple(sorted({layer for d in self.drafters for layer in d.hidden_layers}))
        self.token_drafters = [d for d in self.drafters if isinstance(d, TokenDrafter)]
        self.head_drafters = [d for d in self.drafters if not isinstance(d, TokenDrafter)]

    def reset(self) -> None:
        for drafter in self.drafters:
            drafter.reset()

    def observe(self, hidden, next_tokens) -> None:
        for drafter in self.drafters:
            drafter.observe(hidden, next_tokens)

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        spans = [self._propose(d, tokens, max_depth) for d in self.token_drafters]
        head_depth = min(1, max_depth) if any(d.trusted for d in self.token_drafters) else max_depth
        trees = [self._propose(d, tokens, head_depth) for d in self.head_drafters] + spans
        tree = trees[0]
        for other in trees[1:]:
            tree = merge_trees(tree, other)
        return tree

    @staticmethod
    def _propose(drafter: Drafter, tokens: torch.Tensor, max_depth: int) -> Tree:
        """The loop checks the merged tree; a foreign drafter's own tree is checked first, so an error names it."""
        tree = drafter.propose(tokens, max_depth)
        return tree if isinstance(drafter, OWN_DRAFTERS) else verifiable_tree(tree, tokens[-1], None, max_depth, drafter_name(drafter))


class OracleDrafter(TokenDrafter):
    """Knows the answer: proposes the true continuation on rank 0 of a static tree, wrong tokens elsewhere.

    For measuring the engine's own overhead (every step accepts the deepest path, so cache compaction runs
    at every depth) and for tests. `continuation` is the whole expected sequence, prompt included.
    """

    def __init__(self, continuation: torch.Tensor, tree, vocab_size: int):
        self.continuation, self.tree, self.vocab_size = continuation, _as_static_tree(tree), vocab_size

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


TRAINED_HEADS = (MedusaHeads, EagleHead, EarlyExitHead)  # what heads.load_heads returns
OWN_DRAFTERS = (NoDrafter, MedusaDrafter, EagleDrafter, EarlyExitDrafter, PromptLookupDrafter, MergedDrafter, OracleDrafter)


def drafter_name(drafter) -> str:
    if isinstance(drafter, MergedDrafter):
        return f"MergedDrafter({', '.join(drafter_name(d) for d in drafter.drafters)})"
    return type(drafter).__name__


def as_drafter(heads, model, tree=None) -> Drafter:
    """What generate() accepts as `heads`: None, loaded heads, a drafter, or a list of them to merge."""
    if isinstance(heads, type):
        raise TypeError(f"heads is the class {heads.__name__}, not a drafter: pass an instance, e.g. {heads.__name__}()")
    if heads is None:
        if tree is not None:
            raise TreeError("a tree was given but no heads or drafter to fill it")
        return NoDrafter()
    if isinstance(heads, MedusaHeads):
        return MedusaDrafter(heads, model, tree)
    if isinstance(heads, EagleHead):
        return EagleDrafter(heads, model, tree)
    if isinstance(heads, EarlyExitHead):
        return EarlyExitDrafter(heads, model, tree)
    if isinstance(heads, (list, tuple)):
        return MergedDrafter([as_drafter(h, model, tree if isinstance(h, TRAINED_HEADS) else None) for h in heads])
    if isinstance(heads, Drafter):
        if tree is not None:
            raise TreeError(f"{type(heads).__name__} was built with its own tree; pass tree= to its constructor instead")
        return heads
    raise TypeError(f"heads must be None, heads from heads.load_heads, a Drafter, or a list of them; got {type(heads).__name__}")
