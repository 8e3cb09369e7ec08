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

from heads import (
    NO_COPY,
    DraftVocabulary,
    EagleHead,
    EarlyExitHead,
    HeadConfigError,
    MedusaHeads,
    copy_embedding,
    copy_tokens,
)
from heads.config import check_feature_layers

from .cache import append_rows, keep_paths, keep_rows, position_cache
from .compiled import compiled_head
from .context_vocab import ContextVocabulary
from .padding import prefill_groups, right_padded_mask
from .tree import (
    MAX_TOP_K,
    DynamicTreeSpec,
    PassCost,
    StaticTree,
    Tree,
    TreeError,
    additive_mask,
    best_node_count,
    best_shared_tree,
    graft_span,
    likeliest_paths,
    matched_depth,
    merge_trees,
    next_depth,
    select_best_nodes,
    static_tree,
    subtree,
    token_rates,
    verifiable_tree,
)


@runtime_checkable
class Drafter(Protocol):
    hidden_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def observe(self, hidden: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None: ...

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree: ...


def drafted_nodes(levels: int, k: int) -> int:
    """Nodes a tree holds after `levels` levels of EAGLE-2 growth, the root included: k children of the root, then
    k children for each of the k frontier nodes a level."""
    return 1 + k + (levels - 1) * k * k


def root_only(tokens: torch.Tensor) -> Tree:
    return Tree.chain(tokens[-1:])


class TokenDrafter:
    """Base for drafters that read only the committed tokens: no state to reset, nothing to observe.

    `trusted`, set by `propose`, tells a MergedDrafter that this step's span is right often enough that the
    heads beside it need only draft their depth-1 candidates."""

    hidden_layers: tuple[int, ...] = ()
    trusted: bool = False

    def reset(self, rows: int = 1) -> None:
        pass

    def observe(self, hidden, next_tokens) -> None:
        pass

    def observe_rows(self, hidden, next_tokens) -> None:
        pass

    def propose_rows(self, texts: list[torch.Tensor], max_depths: list[int]) -> list[Tree]:
        return [self.propose(text, depth) for text, depth in zip(texts, max_depths)]

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def add_rows(self, count: int) -> None:
        pass


class NoDrafter(TokenDrafter):
    """Plain decoding through the same loop: every tree is just the root."""

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return root_only(tokens)


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
            f"{what} are in {parameter.dtype} on {parameter.device} but the target is in {model.dtype} on "
            f"{model.device} (was the model moved or cast after its heads were loaded?): call "
            "heads.to(device=model.device, dtype=model.dtype)"
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
    as many of them as pay for their verification on this machine. Sequential heads grow it a level at a
    time, EAGLE-2's way; top_k = nodes there too, since narrower levels drafted no more on held-out training
    prompts (experiments.md, M11)."""
    return DynamicTreeSpec(depth=heads.config.num_heads, top_k=min(nodes, MAX_TOP_K), nodes=nodes, cost=cost)


class MedusaDrafter:
    """Head d proposes its top candidates for depth d; a tree picks which ranks to verify.

    A `DynamicTreeSpec` (the default: `medusa_tree_spec`) picks, each step, the `nodes` likeliest paths by
    the product of the heads' own probabilities for their candidates (EAGLE-2's idea on Medusa heads): deep
    where the heads are sure, wide where they hesitate. A static tree (a list of paths, Medusa's original)
    verifies the same ranks every step; an empty one (`[]`) verifies the root alone: plain decoding.
    """

    hidden_layers = (-1,)

    def __init__(self, heads: MedusaHeads, model, tree=None, context_vocab: bool = True):
        _check_head_fits(heads, model, "these Medusa heads")
        k = heads.config.num_heads
        if tree is None:
            tree = medusa_tree_spec(heads)
        self.spec = tree if isinstance(tree, DynamicTreeSpec) else None
        self.tree = (
            None if self.spec is not None or (isinstance(tree, (list, tuple)) and not tree) else _as_static_tree(tree)
        )
        if self.tree is not None and self.tree.max_depth > k:
            raise TreeError(
                f"the tree is {self.tree.max_depth} deep, which needs {self.tree.max_depth} Medusa heads; the "
                f"checkpoint has {k}"
            )
        vocab = DraftVocabulary(model.get_output_embeddings(), heads.draft_ids)
        if self.tree is not None and self.tree.max_rank >= vocab.weight.shape[0]:
            raise TreeError(
                f"the tree asks for candidate rank {self.tree.max_rank}, but the heads draft from "
                f"{vocab.weight.shape[0]} tokens; use lower ranks"
            )
        # heads with lm_heads of their own score only their own rows
        self.heads, self.context = heads, ContextVocabulary(vocab, context_vocab and heads.lm_heads is None)
        self.reset()

    def reset(self, rows: int = 1) -> None:
        self.hidden = None  # [rows, H]: each row's state that produced its root
        self.context.reset(rows)

    def observe(self, hidden, next_tokens) -> None:
        self.observe_rows([hidden], [next_tokens])

    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None:
        self.hidden = torch.stack([row[-1][-1] for row in hidden])

    def keep_rows(self, rows: list[int]) -> None:
        if self.hidden is not None:
            self.hidden = self.hidden[rows]
        self.context.keep_rows(rows)

    def add_rows(self, count: int) -> None:
        self.context.add_rows(count)  # their hidden states come with the next observe_rows, as every row's do

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return self.propose_rows([tokens], [max_depth])[0]

    def propose_rows(self, texts: list[torch.Tensor], max_depths: list[int]) -> list[Tree]:
        """One pass of the heads and one projection for every row, then each row's tree."""
        if self.spec is not None:
            depth, ranks = min(self.spec.depth, self.heads.config.num_heads, max(max_depths)), self.spec.top_k
        elif self.tree is not None:
            depth, ranks = self.tree.max_depth, self.tree.max_rank + 1
        else:
            depth = 0
        if depth < 1:
            return [root_only(text) for text in texts]
        vocab = self.context.read_texts(texts)
        logits = self.heads.draft_logits(self.heads(self.hidden)[:, :depth], vocab)  # [rows, depth, N]
        top = self.context.log_probs(logits).topk(
            min(ranks, logits.shape[-1]), dim=-1
        )  # a draft vocabulary may be tiny
        candidates, probabilities = vocab.to_target(top.indices), top.values.exp().tolist()
        trees = []
        for row, (text, max_depth) in enumerate(zip(texts, max_depths)):
            tree = self.tree
            if self.spec is not None:
                tree = self._likeliest_tree(probabilities[row][: min(depth, max_depth)]) if max_depth >= 1 else None
            trees.append(root_only(text) if tree is None else tree.fill(text[-1], candidates[row]).truncate(max_depth))
        return trees

    def _likeliest_tree(self, probability: list[list[float]]) -> StaticTree | None:
        """This step's best paths, with probability[d][r] standing where a static tree has measured accuracies."""
        paths = likeliest_paths(probability, self.spec.nodes, self.spec.cost)
        return cached_static_tree(tuple(paths)) if paths else None


cached_static_tree = functools.lru_cache(maxsize=4096)(static_tree)  # a step's shape recurs often: build each once


RELIABILITY_DECAY = 0.9  # the head's reliability is estimated over roughly the last ten steps
MAX_RELIABILITY = 2.0  # an underconfident head's probabilities are at most doubled
MAX_CANDIDATES = 1 << 14  # draft nodes scored per step; their ancestor matrix takes this squared in bytes (256 MiB)


class DynamicTreeDrafter:
    """EAGLE-2 dynamic trees from a drafter that keeps its own KV cache: grown depth by depth with tree attention
    inside the drafter, each level expanding the `top_k` likeliest nodes by their path probability, then cut to
    the `nodes` best (or, with a measured cost, to those that pay for their verification).

    It drafts for several sequences at once (generate() over a batch: `reset(rows)`, `observe_rows`,
    `propose_rows`, `keep_rows`), one head pass a level for all of them; a single sequence is one row. The
    draft cache is ragged as the target's batch cache is (inference.batch): row b holds its committed entries in
    [0, lengths[b]), entries past that are stale and masked off. Draft entries are dropped after every proposal.

    A subclass reads the committed texts into its cache (`_read_committed`, through `_append`, which leaves
    `self.last` [rows, H], its output for each row's root) and expands a frontier of draft nodes (`_expand`, the
    frontier `depth` levels deep: their outputs [rows, F, H]); outputs become draft logits through `self.vocab`.
    """

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, vocab: DraftVocabulary, tree: DynamicTreeSpec | None, what: str, context_vocab: bool = True):
        if tree is not None and not isinstance(tree, DynamicTreeSpec):
            raise TreeError(
                f"the {what} drafter grows dynamic trees: pass tree=DynamicTreeSpec(depth, top_k, nodes), got {tree!r}"
            )
        self.spec, self.context = tree or DynamicTreeSpec(), ContextVocabulary(vocab, context_vocab)
        k = min(self.spec.top_k, vocab.weight.shape[0])
        candidates = drafted_nodes(self.spec.depth, k)  # every level's children before the best are kept
        if candidates > MAX_CANDIDATES:
            raise TreeError(
                f"DynamicTreeSpec(depth={self.spec.depth}, top_k={self.spec.top_k}) scores {candidates:,} candidate "
                f"nodes a step (more than {MAX_CANDIDATES:,}); EAGLE-2 uses top_k <= 10 and depth <= 8"
            )

    @property
    def vocab(self) -> DraftVocabulary:
        """What the rows draft from now: the head's vocabulary and the tokens they have seen (ContextVocabulary)."""
        return self.context.current

    def reset(self, rows: int = 1) -> None:
        self.context.reset(rows)
        self.cache, self.last, self.spans_held = position_cache(), None, []
        for name, fresh in self._new_rows(rows).items():
            setattr(self, name, fresh)

    def _new_rows(self, count: int) -> dict[str, list]:
        """The per-row state of `count` sequences that have just started (keep_rows and add_rows keep it in row
        order)."""
        return {
            "lengths": [0] * count,  # committed entries in the draft cache
            "levels": [self.spec.depth] * count,  # with a measured cost: how deep the row's next tree may grow
            # How far the drafter's probabilities hold on each sequence: decayed sums of the drafts its trees were
            # expected to get accepted (the kept nodes' probabilities) and of those the target then committed (a prior
            # of one expected and one accepted). "guesses": the last tree kept, till the target's answer to it.
            "guesses": [None] * count,
            "expected": [1.0] * count,
            "realised": [1.0] * count,
        }

    def add_rows(self, count: int) -> None:
        """`count` new sequences join after the current rows (a batch admits prompts as others finish); they
        are observed with the others at the next observe_rows."""
        self.context.add_rows(count)
        if self.cache.get_seq_length():
            empty = [
                layer.keys.new_zeros(count, layer.keys.shape[1], 0, layer.keys.shape[3]) for layer in self.cache.layers
            ]
            append_rows(self.cache, empty, empty)
        if self.last is not None:
            self.last = torch.cat([self.last, self.last.new_zeros(count, self.last.shape[-1])])
        for name, fresh in self._new_rows(count).items():
            getattr(self, name).extend(fresh)

    def reliability(self, row: int = 0) -> float:
        """Accepted over expected drafts of this row's recent trees (at most MAX_RELIABILITY): below 1 an
        overconfident head, above 1 an underconfident one, whose probabilities would keep trees too small."""
        return min(MAX_RELIABILITY, self.realised[row] / self.expected[row])

    def observe(self, hidden, next_tokens) -> None:
        self.observe_rows([hidden], [next_tokens])

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return self.propose_rows([tokens], [max_depth])[0]

    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None:
        """`observe` for every row at once."""
        for row, tokens in enumerate(next_tokens):
            if self.guesses[row] is not None:  # tokens: what the target committed after the root
                tree_tokens, parents, expected = self.guesses[row]
                self.expected[row] = RELIABILITY_DECAY * self.expected[row] + expected
                self.realised[row] = RELIABILITY_DECAY * self.realised[row] + matched_depth(
                    tree_tokens, parents, tokens.tolist()
                )
                self.guesses[row] = None

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows go on (their order kept); the others' sequences are finished."""
        if self.cache.get_seq_length():
            keep_rows(self.cache, torch.tensor(rows, dtype=torch.long, device=self.last.device))
        self.last = None if self.last is None else self.last[rows]
        self.context.keep_rows(rows)
        for name in self._new_rows(0):
            setattr(self, name, [getattr(self, name)[row] for row in rows])
        if self.cache.get_seq_length():
            self.cache.crop(max(self.lengths, default=0) - self.cache.get_seq_length())

    def _read_committed(self, texts: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _expand(
        self,
        depth: int,
        nodes: DraftNodes,
        frontier: torch.Tensor,
        states: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError

    def _append(self, counts: list[int], run) -> None:
        """Append counts[b] committed entries to each row's cache. `run(rows, positions [R, W], mask, cache)` runs
        the head over rows `rows` (slice(None): all) of the right-padded block [rows, W], W = positions.shape[1],
        writing to `cache` (mask None: the rows aligned, causal); each row's entries then sit at its own end, and
        `self.last` becomes each row's newest output.

        A row with nothing cached yet reads its whole prompt: such rows read in their own passes, grouped by
        length as the target's prefill is, not padded to the prompt length together with rows reading a few tokens.
        """
        width = max(counts)
        if width == 0:
            return
        start, device = self.cache.get_seq_length(), self.vocab.weight.device
        index = torch.arange(width, device=device)
        if all(n == start for n in self.lengths) and all(c == width for c in counts):
            lengths = torch.tensor(self.lengths, device=device)
            out = run(
                slice(None), (lengths[:, None] + index).contiguous(), None, self.cache
            )  # a single sequence always lands here
            self.lengths, self.last = [n + width for n in self.lengths], out[:, -1]
            return
        fresh = [row for row, count in enumerate(counts) if count and not self.lengths[row]]
        for group in prefill_groups([counts[row] for row in fresh]):
            self._read_prompts([fresh[slot] for slot in group], counts, run)
        counts = [0 if row in fresh else count for row, count in enumerate(counts)]
        width = max(counts)
        if width == 0:
            return
        start, lengths, index = self.cache.get_seq_length(), torch.tensor(self.lengths, device=device), index[:width]
        real = index < torch.tensor(counts, device=device)[:, None]  # [rows, W]
        committed = torch.arange(start, device=device) < lengths[:, None]  # [rows, start]
        causal = index[:, None] >= index[None, :]
        allowed = torch.cat(
            [committed[:, None, :] & real[:, :, None], causal & real[:, None, :] & real[:, :, None]], dim=2
        )
        allowed[:, index, start + index] = True  # a padding entry sees only itself
        out = run(
            slice(None), lengths[:, None] + index, additive_mask(allowed, self.vocab.weight.dtype)[:, None], self.cache
        )
        self.lengths = keep_paths(self.cache, self.lengths, start, [index[:count] for count in counts])
        newest = out[torch.arange(len(counts), device=device), torch.tensor(counts, device=device).clamp(min=1) - 1]
        moved = torch.tensor([count > 0 for count in counts], device=device)[:, None]
        self.last = torch.where(moved, newest, self.last)

    def _read_prompts(self, rows: list[int], counts: list[int], run) -> None:
        """Rows with nothing cached read their first counts[row] entries in one pass of their own (a cache of their
        own, no past to attend to), which then fill the first entries of their rows of the draft cache."""
        device = self.vocab.weight.device
        lengths = torch.tensor([counts[row] for row in rows], device=device)
        width = int(lengths.max())
        own = position_cache()
        positions = torch.arange(width, device=device).expand(len(rows), -1)
        out = run(
            torch.tensor(rows, device=device),
            positions,
            right_padded_mask(lengths, width, self.vocab.weight.dtype),
            own,
        )
        total, missing = len(self.lengths), width - self.cache.get_seq_length()
        for layer, entries in enumerate(own.layers):
            if missing > 0:  # the cache grows to take them (every row: stale entries for the others, masked off)
                shape = (total, entries.keys.shape[1], missing, entries.keys.shape[3])
                self.cache.update(entries.keys.new_zeros(shape), entries.values.new_zeros(shape), layer)
            self.cache.layers[layer].keys[rows, :, :width] = entries.keys
            self.cache.layers[layer].values[rows, :, :width] = entries.values
        if self.last is None:
            self.last = out.new_zeros(total, out.shape[-1])
        self.last[rows] = out[torch.arange(len(rows), device=device), lengths - 1]
        for row in rows:
            self.lengths[row] = counts[row]

    def _log_probs(self, outputs: torch.Tensor) -> torch.Tensor:
        return self.context.log_probs(self.vocab.logits(outputs))

    def propose_rows(
        self, texts: list[torch.Tensor], max_depths: list[int], spans: list[list] | None = None
    ) -> list[Tree]:
        """`propose` for every row at once: texts[b] is row b's committed text, its last token the root. spans[b]:
        copied spans for row b, (tokens, log-rate) pairs, to weigh against the drafts (_select_grafted), which
        leaves in `spans_held[b]` how many of each span's first tokens the drafts held."""
        if spans is not None:
            self.spans_held = [[0] * len(row_spans) for row_spans in spans]
        self.context.read_texts(texts)
        self._read_committed(texts)
        limits = [min(levels, depth) for levels, depth in zip(self.levels, max_depths)]
        deepest = max(limits)
        if deepest < 1:
            return [root_only(text) for text in texts]
        rows, device = len(texts), self.last.device
        k = min(self.spec.top_k, self.vocab.weight.shape[0])  # a draft vocabulary may be tiny
        nodes = DraftNodes(torch.stack([text[-1] for text in texts]), drafted_nodes(deepest, k), self.vocab)
        frontier = nodes.add_children(
            torch.zeros(rows, 1, dtype=torch.long, device=device), self._log_probs(self.last)[:, None], k
        )
        states, fed = self.last[:, None].expand(-1, k, -1), []
        start, lengths = self.cache.get_seq_length(), torch.tensor(self.lengths, device=device)
        committed = (torch.arange(start, device=device) < lengths[:, None])[:, None].expand(
            -1, k, -1
        )  # each row's own entries
        for level in range(1, deepest):
            fed.append(frontier)
            # a frontier node sees its row's committed entries and, among the fed draft nodes, its own ancestors
            allowed = torch.cat([committed, nodes.ancestors_among(frontier, torch.cat(fed, dim=1))], dim=2)
            positions = (lengths[:, None] + level - 1).expand(-1, k)  # depth d sits at length + d - 1
            out = self._expand(
                level, nodes, frontier, states, additive_mask(allowed, self.last.dtype)[:, None], positions
            )
            children = nodes.add_children(frontier, self._log_probs(out), k)
            best = (
                nodes.scores.gather(1, children).topk(min(k, children.shape[1]), dim=1).indices
            )  # EAGLE-2: expand the likeliest
            frontier, states = (
                children.gather(1, best),
                out.gather(1, (best // k)[..., None].expand(-1, -1, out.shape[-1])),
            )
        self.cache.crop(-sum(f.shape[1] for f in fed))
        if spans is not None:
            return self._select_grafted(nodes, limits, max_depths, k, spans)
        if rows == 1 or self.spec.cost is None:
            return [self._select(nodes, row, limits[row], max_depths[row], k) for row in range(rows)]
        levels, width = self._shared_tree(nodes, limits, k)
        trees = [self._select(nodes, row, min(limits[row], levels), max_depths[row], k, width) for row in range(rows)]
        if all(depth >= level for depth, level in zip(max_depths, self.levels)):  # not when a caller capped this step
            self.levels = [next_depth(levels, deepest, self.spec.depth)] * rows
        return trees

    def _believed(self, nodes: DraftNodes, row: int, count: int) -> torch.Tensor:
        """Row `row`'s first `count` drafts' log-probabilities, scaled by how far they have held (reliability)."""
        return nodes.scores[row, 1:count] + math.log(max(self.reliability(row), 1e-6))

    def _shared_tree(self, nodes: DraftNodes, limits: list[int], k: int) -> tuple[int, int]:
        """(levels, drafts a row keeps) for a batch, priced once for all rows (best_shared_tree): one pass verifies
        every row padded to the widest tree, and the batch drafts as deep as its deepest row."""
        believed = torch.full((len(limits), nodes.count - 1), float("-inf"), device=nodes.scores.device)
        for row, limit in enumerate(limits):
            if limit >= 1:
                count = drafted_nodes(limit, k)
                believed[row, : count - 1] = self._believed(nodes, row, count)
        cost = self.spec.cost
        return best_shared_tree(believed, nodes.depth[1 : nodes.count], cost, cost.draft_level, self.spec.nodes)

    def _select(
        self, nodes: DraftNodes, row: int, depth_limit: int, max_depth: int, k: int, width: int | None = None
    ) -> Tree:
        """Row `row`'s nodes to verify: the `spec.nodes` likeliest no deeper than its limit, or with a measured
        cost those that pay for themselves (in a batch: `width`, the count priced for all rows)."""
        if depth_limit < 1:
            return root_only(nodes.tokens[row, :1])
        count = drafted_nodes(depth_limit, k)  # nodes are added level by level: these are the first levels'
        scores, depth = nodes.scores[row, :count], nodes.depth[:count]
        keep_count = self.spec.nodes
        if width is not None:
            keep_count = width
        elif self.spec.cost is not None:  # keep what pays for itself
            cost = self.spec.cost
            keep_count = best_node_count(
                self._believed(nodes, row, count), cost, depth_limit * cost.draft_level, self.spec.nodes
            )
        keep = select_best_nodes(scores, depth, keep_count)
        tree = subtree(nodes.tokens[row], nodes.parents[row], nodes.depth, nodes.ancestors[row], keep)
        self.guesses[row] = (
            tree.tokens.tolist(),
            tree.parents.tolist(),
            float(scores[keep[1:]].exp().sum()),
        )  # EAGLE-2's expected acceptance
        if (
            width is None and self.spec.cost is not None and max_depth >= self.levels[row]
        ):  # not when a caller capped this step's depth
            self.levels[row] = next_depth(int(depth[keep].max()), depth_limit, self.spec.depth)
        return tree

    def _select_grafted(
        self, nodes: DraftNodes, limits: list[int], max_depths: list[int], k: int, spans: list[list]
    ) -> list[Tree]:
        """Each row's drafts and copied spans in one pool, every tree as wide as the batch's: the likeliest of
        the pool, by the drafts' (scaled) probabilities and the spans' scores, as many as pay for their
        verification (without a measured cost: spec.nodes). A span costs no drafting, and it displaces drafts
        only where it is believed likelier, so a batch pays for no row's long span with a wider pass."""
        levels = max(limits)
        if self.spec.cost is not None:
            levels, _ = self._shared_tree(nodes, limits, k)
        pools = []
        for row, row_spans in enumerate(spans):
            depth_limit = min(limits[row], levels)
            count = drafted_nodes(depth_limit, k) if depth_limit >= 1 else 1
            believed = (
                torch.cat([nodes.scores[row, :1], self._believed(nodes, row, count)])
                if count > 1
                else nodes.scores[row, :1]
            )
            pool = (
                nodes.tokens[row, :count],
                nodes.parents[row, :count],
                nodes.depth[:count],
                nodes.ancestors[row, :count, :count],
                believed,
            )
            for index, (span, log_rate) in enumerate(row_spans):
                pool, self.spans_held[row][index] = graft_span(*pool, span, log_rate)
            pools.append((count, pool))
        width = self.spec.nodes
        if self.spec.cost is not None:
            believed = torch.full((len(pools), max(pool[4].shape[0] for _, pool in pools) - 1), float("-inf"))
            for row, (_, pool) in enumerate(pools):
                believed[row, : pool[4].shape[0] - 1] = pool[4][1:]
            cost = self.spec.cost
            width = int(token_rates(believed, cost, levels * cost.draft_level, self.spec.nodes).argmax())
            if all(
                depth >= level for depth, level in zip(max_depths, self.levels)
            ):  # not when a caller capped this step
                self.levels = [next_depth(levels, max(limits), self.spec.depth)] * len(pools)
        trees = []
        for row, (count, (tokens, parents, depth, ancestors, believed)) in enumerate(pools):
            keep = select_best_nodes(believed, depth, width)
            tree = subtree(tokens, parents, depth, ancestors, keep)
            drafted = keep[keep < count]  # the head's reliability is judged by its own drafts only
            guess = tree if drafted.shape[0] == keep.shape[0] else subtree(tokens, parents, depth, ancestors, drafted)
            self.guesses[row] = (
                guess.tokens.tolist(),
                guess.parents.tolist(),
                float(nodes.scores[row, drafted[1:]].exp().sum()),
            )
            trees.append(tree)
        return trees


class DraftNodes:
    """Trees being grown, one a row, in lockstep: node 0 is each root; children are appended level by level
    (the same count a level in every row, so node i has the same depth in every row) with their path scores."""

    def __init__(self, roots: torch.Tensor, capacity: int, vocab: DraftVocabulary):
        rows, device = roots.shape[0], roots.device
        self.vocab, self.count = vocab, 1
        self.tokens = torch.empty(rows, capacity, dtype=torch.long, device=device)
        self.parents = torch.empty_like(self.tokens)
        self.depth = torch.empty(capacity, dtype=torch.long, device=device)
        self.scores = torch.empty(rows, capacity, dtype=torch.float32, device=device)  # log-probability of the path
        self.ancestors = torch.zeros(rows, capacity, capacity, dtype=torch.bool, device=device)
        self.tokens[:, 0], self.parents[:, 0], self.depth[0], self.scores[:, 0], self.ancestors[:, 0, 0] = (
            roots,
            -1,
            0,
            0.0,
            True,
        )

    def add_children(self, frontier: torch.Tensor, log_probs: torch.Tensor, k: int) -> torch.Tensor:
        """Each frontier node's `k` likeliest children (frontier [rows, F], log_probs [rows, F, draft vocab]);
        returns their indices [rows, F * k]."""
        top = log_probs.topk(k, dim=-1)  # [rows, F, k]
        rows, width = frontier.shape[0], frontier.shape[1] * k
        children = torch.arange(self.count, self.count + width, device=self.tokens.device)
        parents = frontier.repeat_interleave(k, dim=1)
        self.tokens[:, children], self.parents[:, children] = self.vocab.to_target(top.indices).flatten(1), parents
        self.depth[children] = self.depth[parents[0]] + 1
        self.scores[:, children] = (self.scores.gather(1, frontier)[..., None] + top.values).flatten(1)
        self.ancestors[:, children] = self.ancestors.gather(
            1, parents[..., None].expand(-1, -1, self.ancestors.shape[2])
        )
        self.ancestors[:, children, children] = True
        self.count += width
        return children.expand(rows, -1)

    def ancestors_among(self, nodes: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
        """[rows, N, M]: whether among[b, m] is an ancestor of nodes[b, n] (or the node itself)."""
        own = self.ancestors.gather(1, nodes[..., None].expand(-1, -1, self.ancestors.shape[2]))
        return own.gather(2, among[:, None, :].expand(-1, nodes.shape[1], -1))


class SequentialMedusaDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from sequential (Hydra-style) Medusa heads: head d reads head d-1's feature and its
    node's token, so growing a level is one pass of one head over the frontier. The heads keep no cache: a row's
    state is the target's hidden state that produced its root, and `self.last`, head 0's feature from it and the
    root, gives the depth-1 candidates."""

    hidden_layers = (-1,)

    def __init__(self, heads: MedusaHeads, model, tree: DynamicTreeSpec | None = None, context_vocab: bool = True):
        _check_head_fits(heads, model, "these Medusa heads")
        tree = medusa_tree_spec(heads) if tree is None else tree
        if isinstance(tree, DynamicTreeSpec) and tree.depth > heads.config.num_heads:
            raise TreeError(
                f"the tree is {tree.depth} deep, which needs {tree.depth} sequential Medusa heads; the checkpoint has "
                f"{heads.config.num_heads}"
            )
        vocab = DraftVocabulary(model.get_output_embeddings(), heads.draft_ids)
        super().__init__(vocab, tree, "sequential Medusa", context_vocab and heads.lm_heads is None)
        self.heads, self.embed = heads, model.get_input_embeddings()
        self.reset()

    def reset(self, rows: int = 1) -> None:
        super().reset(rows)
        self.hidden = None  # [rows, H]

    def observe_rows(self, hidden, next_tokens) -> None:
        super().observe_rows(hidden, next_tokens)
        self.hidden = torch.stack([row[-1][-1] for row in hidden])

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self.hidden = None if self.hidden is None else self.hidden[rows]

    def _read_committed(self, texts: list[torch.Tensor]) -> None:
        self.last = self.heads.step(0, self.hidden, self.embed(torch.stack([text[-1] for text in texts])))

    def _expand(
        self,
        depth: int,
        nodes: DraftNodes,
        frontier: torch.Tensor,
        states: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        return self.heads.step(depth, states, self.embed(nodes.tokens.gather(1, frontier)))


class EagleDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from an EAGLE head that keeps its own KV cache.

    The head reads pairs (feature of token t, token t+1) at position t. `observe` queues the committed
    pairs; `propose` first feeds them to the head (a head with `copy_input` also reads each pair's copy
    token, which needs the committed text that `propose` is given), so its cache holds every committed pair
    and `self.last` is its output for the newest one: the predicted feature of the root, whose logits give
    the depth-1 candidates. A draft node's input is its parent's predicted feature and its own token.
    """

    def __init__(self, head: EagleHead, model, tree: DynamicTreeSpec | None = None, context_vocab: bool = True):
        _check_head_fits(head, model, "this EAGLE head")
        super().__init__(head.draft_vocabulary(model.get_output_embeddings()), tree, "EAGLE", context_vocab)
        self.head, self.embed = head, model.get_input_embeddings()
        self.run_head = compiled_head(head, model)  # compiled like the target's passes, or the head itself
        self.hidden_layers = tuple(head.config.feature_layers)
        self.reset()

    def reset(self, rows: int = 1) -> None:
        super().reset(rows)
        self.tails = None  # each row's last two committed tokens, for the copy tokens of draft nodes

    def _new_rows(self, count: int) -> dict[str, list]:
        return super()._new_rows(count) | {
            "pending": [[] for _ in range(count)],  # observed (features, next tokens) pairs not read yet
            "successors": [{} for _ in range(count)],  # committed bigram -> next token
        }

    def observe_rows(self, hidden, next_tokens) -> None:
        super().observe_rows(hidden, next_tokens)
        for pending, row_hidden, tokens in zip(self.pending, hidden, next_tokens):
            pending.append(
                (torch.cat([row_hidden[layer] for layer in self.hidden_layers], dim=-1), tokens)
            )  # fused in the head

    def _read_committed(self, texts: list[torch.Tensor]) -> None:
        """Feed the head the pairs each row observed since the last proposal; texts[b] is row b's committed text."""
        copy_input = self.head.config.copy_input
        self.tails = [text[-2:].tolist() for text in texts] if copy_input else None
        counts = [sum(tokens.shape[0] for _, tokens in pending) for pending in self.pending]
        if not any(counts):
            return
        rows, width, device = len(texts), max(counts), texts[0].device
        first = next(f for pending in self.pending for f, _ in pending)
        features = first.new_zeros(rows, width, first.shape[-1])
        next_tokens = torch.zeros(rows, width, dtype=torch.long, device=device)  # padding reads token 0, masked off
        copies = torch.full((rows, width), NO_COPY, dtype=torch.long, device=device)
        for row, (pending, count) in enumerate(zip(self.pending, counts)):
            if not count:
                continue
            features[row, :count] = torch.cat([f for f, _ in pending])
            next_tokens[row, :count] = torch.cat([t for _, t in pending])
            if copy_input:  # the bigram map holds the text before; pairs from the row's length need one token back
                length = self.lengths[row]
                offset = max(length - 1, 0)
                found = copy_tokens(
                    texts[row][offset:].tolist(), length - offset, length - offset + count, self.successors[row]
                )
                copies[row, :count] = torch.tensor(found, device=device)
        self.pending = [[] for _ in range(rows)]
        copy_embeds = copy_embedding(self.embed, copies) if copy_input else None
        self._append(
            counts,
            lambda rows, positions, mask, cache: self.run_head(
                features[rows, : positions.shape[1]],
                self.embed(next_tokens[rows, : positions.shape[1]]),
                None if copy_embeds is None else copy_embeds[rows, : positions.shape[1]],
                position_ids=positions,
                attention_mask=mask,
                cache=cache,
            ),
        )

    def _expand(
        self,
        depth: int,
        nodes: DraftNodes,
        frontier: torch.Tensor,
        states: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        copies = None
        if self.tails is not None:  # one transfer of the trees so far, then the paths are walked on the host
            node_tokens, parents = nodes.tokens[:, : nodes.count].tolist(), nodes.parents[:, : nodes.count].tolist()
            found = [
                draft_copy_tokens(tail, tokens, row_parents, row_frontier, successors)
                for tail, tokens, row_parents, row_frontier, successors in zip(
                    self.tails, node_tokens, parents, frontier.tolist(), self.successors
                )
            ]
            copies = copy_embedding(self.embed, torch.tensor(found, device=frontier.device))
        return self.run_head(
            states,
            self.embed(nodes.tokens.gather(1, frontier)),
            copies,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
        )


def draft_copy_tokens(
    tail: list[int], node_tokens: list[int], parents: list[int], frontier: list[int], successors: dict
) -> list[int]:
    """Copy tokens of draft nodes: the committed text (`tail`: its last two tokens, the root last) continued by
    each node's path, read on top of the committed bigrams (`successors`) without changing them."""
    found = []
    for node in frontier:
        path = []
        while node > 0:  # up to the root, node 0
            path.append(node_tokens[node])
            node = parents[node]
        text = tail + path[::-1]
        found.append(copy_tokens(text, len(tail) - 1, len(text) - 1, ChainMap({}, successors))[-1])
    return found


class EarlyExitDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from the target's own first layers (heads.early_exit): a draft node's input is
    its token alone, at its position, over the early layers' own cache of the committed text.

    The cache is the draft's own, not the target's: with an adapter the early layers' keys and values differ
    from the target's, and draft positions must never enter the target's cache. `propose` first runs the
    tokens committed since the last proposal (the root last) through the early layers in one pass.
    """

    def __init__(self, head: EarlyExitHead, model, tree: DynamicTreeSpec | None = None, context_vocab: bool = True):
        _check_head_fits(head, model, "this early-exit head")
        super().__init__(
            DraftVocabulary(model.get_output_embeddings(), head.draft_ids), tree, "early-exit", context_vocab
        )
        self.head = head
        self.reset()

    def _read_committed(self, texts: list[torch.Tensor]) -> None:
        # the committed text only grows: what the cache holds stays valid
        counts = [text.shape[0] - length for text, length in zip(texts, self.lengths)]
        if not any(counts):
            return
        new = torch.zeros(
            len(texts), max(counts), dtype=torch.long, device=texts[0].device
        )  # padding reads token 0, masked off
        for row, (text, length) in enumerate(zip(texts, self.lengths)):
            new[row, : text.shape[0] - length] = text[length:]
        self._append(
            counts,
            lambda rows, positions, mask, cache: self.head(
                new[rows, : positions.shape[1]], position_ids=positions, attention_mask=mask, cache=cache
            ),
        )

    def _expand(
        self,
        depth: int,
        nodes: DraftNodes,
        frontier: torch.Tensor,
        states: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        return self.head(
            nodes.tokens.gather(1, frontier), position_ids=positions, attention_mask=mask, cache=self.cache
        )


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
        self.max_ngram, self.min_ngram, self.num_tokens, self.trusted_ngram = (
            max_ngram,
            min_ngram,
            num_tokens,
            trusted_ngram,
        )

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        length = tokens.shape[0]
        self.trusted, self.matched = False, 0  # matched: the n of the n-gram the span follows
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = tokens[: length - 1].unfold(0, n, 1)  # every n-gram with at least one token after it
            starts = (windows == tokens[length - n :]).all(dim=-1).nonzero()
            if starts.shape[0]:
                begin = int(starts[-1]) + n
                span = tokens[begin : begin + min(self.num_tokens, max_depth)]
                self.trusted = n >= self.trusted_ngram and span.shape[0] > 0
                self.matched = n if span.shape[0] else 0
                return Tree.chain(torch.cat([tokens[-1:], span]))
        return root_only(tokens)


class MergedDrafter:
    """Several drafters' trees merged into ONE tree, verified in the same target pass.

    Drafters that read only tokens propose first. For one sequence, their spans are merged whole into the
    head's tree, and when one of them is `trusted` (prompt lookup matched a long enough n-gram) the drafters
    with heads draft one level only: their depth-1 candidates cost a projection, deeper levels cost head passes,
    and beside a trusted span they rarely win a token. In a batch, where every row's tree is padded to the
    widest, a head that grows dynamic trees weighs each row's spans against its drafts instead (graft_span):
    the tokens a span adds to the head's drafts are scored by how often the tokens such spans added have been
    right on this row (by the length of the n-gram matched; SPAN_PRIOR, decayed as the head's reliability is),
    and the row keeps its likeliest nodes of both.
    """

    def __init__(self, drafters: Sequence[Drafter]):
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.drafters = list(drafters)
        self.hidden_layers = tuple(sorted({layer for d in self.drafters for layer in d.hidden_layers}))
        self.token_drafters = [d for d in self.drafters if isinstance(d, TokenDrafter)]
        self.head_drafters = [d for d in self.drafters if not isinstance(d, TokenDrafter)]
        self.grafts = (
            len(self.head_drafters) == 1
            and isinstance(self.head_drafters[0], DynamicTreeDrafter)
            and all(isinstance(d, PromptLookupDrafter) for d in self.token_drafters)
        )
        self.span_rates, self.pending = [], []

    def reset(self, rows: int = 1) -> None:
        for drafter in self.drafters:
            drafter.reset(rows) if isinstance(drafter, OWN_DRAFTERS) else drafter.reset()
        # per row: {(token drafter, n-gram length): [decayed tokens that held, decayed tokens tried]}, and the
        # spans of its last step, till the target's answer
        self.span_rates, self.pending = [{} for _ in range(rows)], [[] for _ in range(rows)]

    def observe(self, hidden, next_tokens) -> None:
        self.observe_rows([hidden], [next_tokens])

    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, OWN_DRAFTERS):
                drafter.observe_rows(hidden, next_tokens)
            else:
                # a foreign drafter has the one-sequence interface (generate() gives it a batch only when it keeps no
                # state)
                for row_hidden, tokens in zip(hidden, next_tokens):
                    drafter.observe(row_hidden, tokens)
        for row, tokens in enumerate(next_tokens):
            if self.pending[row]:
                committed = tokens.tolist()
                for key, span, shared in self.pending[row]:
                    if span[:shared] != committed[:shared]:
                        continue  # the span's tokens the drafts held were wrong: nothing learnt of the tokens it added
                    held, tried = span_outcome(span[shared:], committed[shared:])
                    rate = self.span_rates[row].setdefault(key, list(SPAN_PRIOR))
                    rate[0] = RELIABILITY_DECAY * rate[0] + held
                    rate[1] = RELIABILITY_DECAY * rate[1] + tried
                self.pending[row] = []

    def keep_rows(self, rows: list[int]) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, OWN_DRAFTERS):
                drafter.keep_rows(rows)
        self.span_rates, self.pending = [self.span_rates[row] for row in rows], [self.pending[row] for row in rows]

    def add_rows(self, count: int) -> None:
        for drafter in self.drafters:
            if isinstance(drafter, OWN_DRAFTERS):
                drafter.add_rows(count)
        self.span_rates += [{} for _ in range(count)]
        self.pending += [[] for _ in range(count)]

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return self.propose_rows([tokens], [max_depth])[0]

    def propose_rows(self, texts: list[torch.Tensor], max_depths: list[int]) -> list[Tree]:
        if self.grafts and len(texts) > 1:
            return self._propose_grafted(texts, max_depths)
        spans, head_depths = [], []
        for text, max_depth in zip(texts, max_depths):  # token drafters are asked row by row: `trusted` is per row
            spans.append([self._propose(d, [text], [max_depth])[0] for d in self.token_drafters])
            head_depths.append(min(1, max_depth) if any(d.trusted for d in self.token_drafters) else max_depth)
        heads = [self._propose(d, texts, head_depths) for d in self.head_drafters]  # each head drafts all rows at once
        merged = []
        for row in range(len(texts)):
            trees = [head_trees[row] for head_trees in heads] + spans[row]
            tree = trees[0]
            for other in trees[1:]:
                tree = merge_trees(tree, other)
            merged.append(tree)
        return merged

    def _propose_grafted(self, texts: list[torch.Tensor], max_depths: list[int]) -> list[Tree]:
        """A batch: each row's spans, scored by its rates, weighed against the head's drafts in one pool."""
        spans, keys = [], []  # per row: (span, log-rate) pairs for the head, and each span's rate key
        for row, (text, max_depth) in enumerate(zip(texts, max_depths)):
            spans.append([])
            keys.append([])
            for index, drafter in enumerate(self.token_drafters):
                span = drafter.propose(text, max_depth).tokens[1:]
                if span.shape[0]:
                    keys[-1].append((index, drafter.matched))
                    held, tried = self.span_rates[row].get(keys[-1][-1], SPAN_PRIOR)
                    spans[-1].append((span, math.log(held / tried)))
        head = self.head_drafters[0]
        trees = head.propose_rows(texts, max_depths, spans)
        # till the target answers: each span, and how many of its first tokens the drafts held (the rates are of the
        # rest)
        self.pending = [
            [(key, span.tolist(), shared) for key, (span, _), shared in zip(row_keys, row_spans, held, strict=True)]
            for row_keys, row_spans, held in zip(keys, spans, head.spans_held, strict=True)
        ]
        return trees

    @staticmethod
    def _propose(drafter: Drafter, texts: list[torch.Tensor], max_depths: list[int]) -> list[Tree]:
        """The loop checks the merged tree; a foreign drafter's own tree is checked first, so an error names it."""
        if isinstance(drafter, OWN_DRAFTERS):
            return drafter.propose_rows(texts, max_depths)
        return [
            verifiable_tree(drafter.propose(text, depth), text[-1], None, depth, drafter_name(drafter))
            for text, depth in zip(texts, max_depths)
        ]


SPAN_PRIOR = (1.0, 2.0)  # (tokens held, tokens tried): a row's first copied tokens are believed right half the time


def span_outcome(span: list[int], committed: list[int]) -> tuple[int, int]:
    """(tokens that held, tokens tried) of a copied span against what the target committed: its tokens are tried
    in order until one is wrong; those past the committed tokens are not known yet and count for neither."""
    held = 0
    for copied, chosen in zip(span, committed):
        if copied != chosen:
            return held, held + 1
        held += 1
    return held, held


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


def grows_dynamic_trees(heads) -> bool:
    """Whether these loaded heads draft through a DynamicTreeDrafter, which weighs copied spans against its drafts
    in a batch (MergedDrafter)."""
    return isinstance(heads, (EagleHead, EarlyExitHead)) or (isinstance(heads, MedusaHeads) and heads.config.sequential)


OWN_DRAFTERS = (
    NoDrafter,
    MedusaDrafter,
    SequentialMedusaDrafter,
    EagleDrafter,
    EarlyExitDrafter,
    PromptLookupDrafter,
    MergedDrafter,
    OracleDrafter,
)


def drafter_name(drafter) -> str:
    if isinstance(drafter, MergedDrafter):
        return f"MergedDrafter({', '.join(drafter_name(d) for d in drafter.drafters)})"
    return type(drafter).__name__


def as_drafter(heads, model, tree=None, context_vocab: bool = True) -> Drafter:
    """What generate() accepts as `heads`: None, loaded heads, a drafter, or a list of them to merge.
    `context_vocab=False`: trained heads draft from their own draft vocabulary only (inference.context_vocab)."""
    if isinstance(heads, type):
        raise TypeError(
            f"heads is the class {heads.__name__}, not a drafter: pass an instance, e.g. {heads.__name__}()"
        )
    if heads is None:
        if tree is not None:
            raise TreeError("a tree was given but no heads or drafter to fill it")
        return NoDrafter()
    if isinstance(heads, MedusaHeads):
        drafter = SequentialMedusaDrafter if heads.config.sequential else MedusaDrafter
        return drafter(heads, model, tree, context_vocab)
    if isinstance(heads, EagleHead):
        return EagleDrafter(heads, model, tree, context_vocab)
    if isinstance(heads, EarlyExitHead):
        return EarlyExitDrafter(heads, model, tree, context_vocab)
    if isinstance(heads, (list, tuple)):
        return MergedDrafter(
            [as_drafter(h, model, tree if isinstance(h, TRAINED_HEADS) else None, context_vocab) for h in heads]
        )
    if isinstance(heads, Drafter):
        if tree is not None:
            raise TreeError(
                f"{type(heads).__name__} was built with its own tree; pass tree= to its constructor instead"
            )
        return heads
    raise TypeError(
        f"heads must be None, heads from heads.load_heads, a Drafter, or a list of them; got {type(heads).__name__}"
    )
