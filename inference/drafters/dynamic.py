"""EAGLE-2 dynamic trees from a drafter that keeps its own KV cache (the EAGLE head, the early exit, sequential
Medusa heads): the trees grow level by level, one head pass a level for every row."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from heads import DraftVocabulary

from ..cache import append_rows, keep_paths, keep_rows, position_cache
from ..context_vocab import ContextVocabulary
from ..packed import packed_linear
from ..padding import prefill_groups, right_padded_mask
from ..transfer import read_together, to_device
from ..tree import Tree, TreeError, additive_mask, matched_depth, subtree
from ..tree_select import CandidatePool, graft_span, select_best_nodes
from ..tree_size import (
    DynamicTreeSpec,
    PassCost,
    best_node_count,
    best_nodes,
    best_shared_tree,
    calibration_batch,
    next_depth,
)
from .base import Drafter, root_only
from .draft_nodes import DraftNodes

RELIABILITY_DECAY = 0.9  # the head's reliability is estimated over roughly the last ten steps
MAX_RELIABILITY = 2.0  # an underconfident head's probabilities are at most doubled
MAX_CANDIDATES = 1 << 14  # draft nodes scored per step; their ancestor matrix takes this squared in bytes (256 MiB)
# A long prompt's last tokens a drafter reads (its head attends over them and what follows; RoPE makes the positions
# relative). Reading all of an 8k-token prompt through the shipped EAGLE head took 1.1-1.2 s a call in float32 on a
# 2-core EPYC (0.2-0.3 s with this window) against 5-9 s of decoding 128 tokens after it; it trained on sequences of a
# few hundred tokens, and its acceptance at 8k rose with the window (tau 1.39 to 1.51).
PROMPT_WINDOW = 1024


def drafted_nodes(levels: int, k: int) -> int:
    """Nodes a tree holds after `levels` levels of EAGLE-2 growth, the root included: k children of the root, then
    k children for each of the k frontier nodes a level; the root alone before the first level."""
    return 1 if levels < 1 else 1 + k + (levels - 1) * k * k


@dataclass
class DraftRow:
    """What a dynamic-tree drafter keeps of one sequence."""

    level: int  # with a measured cost: how deep the row's next tree may grow
    length: int = 0  # committed entries in the draft cache
    # How far the drafter's probabilities hold on this sequence: decayed sums of the drafts its trees were expected
    # to get accepted (the kept nodes' probabilities) and of those the target then committed (a prior of one
    # expected and one accepted), kept on the device. `guess`: the last tree kept (the tree, its nodes the drafter
    # drafted or None for all, the drafts expected), till the target's answer.
    guess: tuple | None = None
    expected: torch.Tensor = field(default_factory=lambda: torch.tensor(1.0))
    realised: torch.Tensor = field(default_factory=lambda: torch.tensor(1.0))
    skipped: int = 0  # a long prompt's start, never read (prompt_window): cache entry i is text token skipped + i


class DynamicTreeDrafter(Drafter):
    """EAGLE-2 dynamic trees from a drafter that keeps its own KV cache: grown depth by depth with tree attention
    inside the drafter, each level expanding the `top_k` likeliest nodes by their path probability, then cut to
    the `nodes` best (or, with a measured cost, to those that pay for their verification).

    It drafts for every row at once, one head pass a level. The draft cache is ragged as the target's is
    (inference.loop): row b holds its committed entries in [0, rows[b].length), entries past that are stale and
    masked off. Draft entries are dropped after every proposal.

    A subclass reads the committed texts into its cache (`_read_committed`, through `_append`, which leaves
    `self.last` [rows, H], its output for each row's root) and expands a frontier of draft nodes (`_expand`, the
    frontier `depth` levels deep: their outputs [rows, F, H]); outputs become draft logits through `self.vocab`.
    """

    prompt_window: int | None = PROMPT_WINDOW  # None: read every prompt whole
    drafts_into_cache = True  # whether _expand writes the frontier to the cache (dropped after the step) and masks it
    draft_paths = False  # whether _expand reads the frontier's paths (DraftNodes.path_tokens)

    # called after each step's drafts are grown, with (texts, nodes, limits, k): scripts/fit_acceptance_map.py records
    # the drafts there
    on_grown = None
    # a calibration for each batch width (calibration_batch), where the plan measured them: a step's trees are priced
    # at the rows it has, not at the most the batch may hold
    costs_by_rows: dict[int, PassCost] | None = None

    def __init__(
        self,
        vocab: DraftVocabulary,
        tree: DynamicTreeSpec | None,
        what: str,
        context_vocab: bool = True,
        acceptance: list[float] | None = None,
    ):
        if tree is not None and not isinstance(tree, DynamicTreeSpec):
            raise TreeError(
                f"the {what} drafter grows dynamic trees: pass tree=DynamicTreeSpec(depth, top_k, nodes), got {tree!r}"
            )
        self.spec, self.context = tree or DynamicTreeSpec(), ContextVocabulary(vocab, context_vocab)
        if not (self.context.enabled and self.context.packed is not None):  # else its buffer's product serves
            vocab.base_projection = packed_linear(vocab.weight, vocab.bias, draft=True)  # every draft level
        self.acceptance = acceptance  # the head's map to acceptance probabilities (inference.acceptance_map)
        k = min(self.spec.top_k, vocab.weight.shape[0])
        candidates = drafted_nodes(self.spec.depth, k)  # every level's children before the best are kept
        if candidates > MAX_CANDIDATES:
            raise TreeError(
                f"DynamicTreeSpec(depth={self.spec.depth}, top_k={self.spec.top_k}) scores {candidates:,} candidate "
                f"nodes a step (more than {MAX_CANDIDATES:,}); EAGLE-2 uses top_k <= 10 and depth <= 8"
            )

    @classmethod
    def default_tree(cls, heads) -> DynamicTreeSpec:
        return DynamicTreeSpec()

    @property
    def vocab(self) -> DraftVocabulary:
        """What the rows draft from now: the head's vocabulary and the tokens they have seen (ContextVocabulary)."""
        return self.context.current

    @property
    def lengths(self) -> list[int]:
        return [row.length for row in self.rows]

    @lengths.setter
    def lengths(self, lengths: list[int]) -> None:
        for row, length in zip(self.rows, lengths, strict=True):
            row.length = length

    def new_row(self) -> DraftRow:
        """The state of a sequence that has just started."""
        return DraftRow(level=self.spec.depth)

    def reset(self, rows: int = 1) -> None:
        self.context.reset(rows)
        self.cache, self.last = position_cache(), None
        self.rows = [self.new_row() for _ in range(rows)]

    def add_rows(self, count: int) -> None:
        """`count` new sequences join after the current rows; they are observed with the others at the next
        observe_rows."""
        self.context.add_rows(count)
        if self.cache.get_seq_length():
            empty = [
                layer.keys.new_zeros(count, layer.keys.shape[1], 0, layer.keys.shape[3]) for layer in self.cache.layers
            ]
            append_rows(self.cache, empty, empty)
        if self.last is not None:
            self.last = torch.cat([self.last, self.last.new_zeros(count, self.last.shape[-1])])
        self.rows += [self.new_row() for _ in range(count)]

    def keep_rows(self, rows: list[int]) -> None:
        if self.cache.get_seq_length():
            keep_rows(self.cache, rows)
        self.last = None if self.last is None else self.last[rows]
        self.context.keep_rows(rows)
        self.rows = [self.rows[row] for row in rows]
        if self.cache.get_seq_length():
            self.cache.crop(max(self.lengths, default=0) - self.cache.get_seq_length())

    def reliability(self, row: int = 0) -> torch.Tensor:
        """Accepted over expected drafts of this row's recent trees (at most MAX_RELIABILITY), a 0-dim tensor: below
        1 an overconfident head, above 1 an underconfident one, whose probabilities would keep trees too small."""
        return (self.rows[row].realised / self.rows[row].expected).clamp(max=MAX_RELIABILITY)

    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None:
        for row, tokens in zip(self.rows, next_tokens):
            if row.guess is not None:  # tokens: what the target committed after the root
                tree, drafted, expected = row.guess
                row.expected = RELIABILITY_DECAY * row.expected + expected
                row.realised = RELIABILITY_DECAY * row.realised + matched_depth(tree, tokens, drafted)
                row.guess = None

    def _read_committed(self, texts: list[torch.Tensor], host_texts: list[np.ndarray]) -> None:
        raise NotImplementedError

    def _skip(self, row: DraftRow, count: int) -> int:
        """A row's first read of `count` entries leaves out all but the last `prompt_window` (recorded in
        row.skipped); returns how many it leaves out. Later reads leave out nothing."""
        if row.length or self.prompt_window is None or count <= self.prompt_window:
            return 0
        row.skipped = count - self.prompt_window
        return row.skipped

    def _expand(
        self,
        depth: int,
        nodes: DraftNodes,
        frontier: torch.Tensor,
        states: torch.Tensor,
        mask: torch.Tensor | None,
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
            lengths = to_device(self.lengths, device)
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
        start, lengths, index = self.cache.get_seq_length(), to_device(self.lengths, device), index[:width]
        real = index < to_device(counts, device)[:, None]  # [rows, W]
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
        newest = out[torch.arange(len(counts), device=device), to_device(counts, device).clamp(min=1) - 1]
        moved = to_device([count > 0 for count in counts], device, torch.bool)[:, None]
        self.last = torch.where(moved, newest, self.last)

    def _read_prompts(self, rows: list[int], counts: list[int], run) -> None:
        """Rows with nothing cached read their first counts[row] entries in one pass of their own (a cache of their
        own, no past to attend to), which then fill the first entries of their rows of the draft cache."""
        device = self.vocab.weight.device
        lengths = to_device([counts[row] for row in rows], device)
        width = int(lengths.max())
        own = position_cache()
        positions = torch.arange(width, device=device).expand(len(rows), -1)
        out = run(
            to_device(rows, device),
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
            self.rows[row].length = counts[row]

    def _top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest drafts after each of outputs [rows, ..., H]: log-probabilities and draft indices."""
        return self.context.top(self.vocab.logits(outputs), k)

    def propose_rows(
        self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray] | None = None
    ) -> list[Tree]:
        """texts[b] is row b's committed text, its last token the root."""
        grown = self._grow(texts, max_depths, host_texts)
        if grown is None:
            return [root_only(text) for text in texts]
        nodes, limits, k = grown
        if len(texts) == 1:
            return [self._select(nodes, 0, limits[0], max_depths[0], k)]
        return self._select_batch(nodes, limits, max_depths, k, [[] for _ in texts])[0]

    def propose_grafted(
        self,
        texts: list[torch.Tensor],
        max_depths: list[int],
        spans: list[list],
        host_texts: list[np.ndarray] | None = None,
    ) -> tuple[list[Tree], list[list[int]]]:
        """propose_rows, with copied spans weighed against the drafts: spans[b] holds row b's (tokens, log-rate)
        pairs (_select_grafted). Also returns, for each row's span, how many of its first tokens the drafts held."""
        grown = self._grow(texts, max_depths, host_texts)
        if grown is None:  # no row may draft: every span is empty too (max_depth 0)
            return [root_only(text) for text in texts], [[0] * len(row_spans) for row_spans in spans]
        nodes, limits, k = grown
        return self._select_batch(nodes, limits, max_depths, k, spans)

    def _price(self, rows: int) -> None:
        """Size this step's trees by the calibration of its width, where there is one for each."""
        cost = (self.costs_by_rows or {}).get(calibration_batch(rows))
        if cost is not None and cost is not self.spec.cost:
            self.spec = replace(self.spec, cost=cost)

    def _grow(self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray] | None):
        """Read the committed texts (host_texts: the same on the host, or None), then grow every row's tree as deep
        as the deepest row may go: (the DraftNodes, each row's depth limit, the top-k a level), or None when no row
        may draft."""
        self._price(len(texts))
        if host_texts is None:  # outside the loop: read the texts back
            host_texts = [text.cpu().numpy() for text in texts]
        self.context.read_texts(texts, host_texts)
        self._read_committed(texts, host_texts)
        limits = [min(row.level, depth) for row, depth in zip(self.rows, max_depths)]
        deepest = max(limits)
        if deepest < 1:
            return None
        rows, device = len(texts), self.last.device
        k = min(self.spec.top_k, self.vocab.weight.shape[0])  # a draft vocabulary may be tiny
        roots = torch.stack([text[-1] for text in texts])
        nodes = DraftNodes(
            roots, drafted_nodes(deepest, k), self.vocab, deepest if self.draft_paths else 0, self.acceptance
        )
        frontier = nodes.add_children(
            torch.zeros(rows, 1, dtype=torch.long, device=device), self._top(self.last[:, None], k)
        )
        states, fed = self.last[:, None].expand(-1, k, -1), []
        start, lengths = self.cache.get_seq_length(), to_device(self.lengths, device)
        mask = None  # a drafter that keeps no drafts in its cache attends to none of them
        if self.drafts_into_cache:  # each row's own committed entries
            committed = (torch.arange(start, device=device) < lengths[:, None])[:, None].expand(-1, k, -1)
        for level in range(1, deepest):
            fed.append(frontier)
            if self.drafts_into_cache:
                # a frontier node sees its row's committed entries and, among the fed draft nodes, its own ancestors
                allowed = torch.cat([committed, nodes.ancestors_among(frontier, torch.cat(fed, dim=1))], dim=2)
                mask = additive_mask(allowed, self.last.dtype)[:, None]
            positions = (lengths[:, None] + level - 1).expand(-1, k)  # depth d sits at length + d - 1
            out = self._expand(level, nodes, frontier, states, mask, positions)
            children = nodes.add_children(frontier, self._top(out, k))
            # EAGLE-2: expand the likeliest
            best = nodes.scores.gather(1, children).topk(min(k, children.shape[1]), dim=1).indices
            frontier = children.gather(1, best)
            states = out.gather(1, (best // k)[..., None].expand(-1, -1, out.shape[-1]))
        if self.drafts_into_cache:
            self.cache.crop(-sum(f.shape[1] for f in fed))
        if self.on_grown is not None:
            self.on_grown(texts, nodes, limits, k)
        return nodes, limits, k

    def _log_reliability(self, row: int) -> torch.Tensor:
        return self.reliability(row).clamp(min=1e-6).log()

    def _select(self, nodes: DraftNodes, row: int, depth_limit: int, max_depth: int, k: int) -> Tree:
        """A single row's nodes to verify: the `spec.nodes` likeliest no deeper than its limit, or with a measured
        cost those that pay for themselves."""
        if depth_limit < 1:
            return root_only(nodes.tokens[row, :1])
        count = drafted_nodes(depth_limit, k)  # nodes are added level by level: these are the first levels'
        scores, depth = nodes.scores[row, :count], nodes.depth[:count]
        tokens, parents = nodes.tokens[row, :count], nodes.parents[row, :count]
        if self.spec.cost is not None:  # keep what pays for itself: a tree built on the host
            cost, shift = self.spec.cost, self._log_reliability(row)
            draft_cost = depth_limit * cost.draft_level
            keep, tree = best_nodes(scores, depth, tokens, parents, shift, cost, draft_cost, self.spec.nodes)
        else:
            keep = select_best_nodes(scores, depth, self.spec.nodes)
            tree = subtree(tokens, parents, depth, nodes.ancestors[row], keep, read_depth=False)
        state = self.rows[row]
        state.guess = (tree, None, scores[keep[1:]].exp().sum())
        if tree.host is not None and max_depth >= state.level:  # not when the caller capped it
            state.level = next_depth(tree.max_depth, depth_limit, self.spec.depth)
        return tree

    def _select_batch(
        self, nodes: DraftNodes, limits: list[int], max_depths: list[int], k: int, spans: list[list]
    ) -> tuple[list[Tree], list[list[int]]]:
        """Every row's tree, chosen on the host after ONE read of the rows' drafts: each row's candidate pool (its
        drafts no deeper than its limit, and its copied spans grafted on, spans[b] holding (tokens, log-rate) pairs),
        of which it keeps the likeliest, every tree as wide as the batch's. With a measured cost, the depth and the
        width are priced once for all rows (best_shared_tree, best_node_count): one pass verifies every row padded
        to the widest tree, and the batch drafts as deep as its deepest row. A span costs no drafting, and it
        displaces drafts only where it is believed likelier, so a batch pays for no row's long span with a wider
        pass. Also returns how many of each span's first tokens the drafts held."""
        rows, cost, device = len(limits), self.spec.cost, nodes.tokens.device
        shifts = torch.stack([self._log_reliability(row) for row in range(rows)])  # drafts' probabilities, scaled
        scores, tokens, parents, depth, shifts = read_together(
            nodes.scores, nodes.tokens, nodes.parents, nodes.depth, shifts
        )
        depth = [int(d) for d in depth]
        believed = []  # each row's drafts (root excluded), those past its depth limit impossible
        for row, limit in enumerate(limits):
            count = drafted_nodes(limit, k)
            believed.append([s + shifts[row] if i < count else float("-inf") for i, s in enumerate(scores[row][1:], 1)])
        levels = max(limits)
        if cost is not None:
            levels, _ = best_shared_tree(believed, depth[1:], levels, cost, cost.draft_level, self.spec.nodes)
        pools, held = [], []
        for row, row_spans in enumerate(spans):
            count = drafted_nodes(min(limits[row], levels), k)
            pool = CandidatePool(
                [int(t) for t in tokens[row][:count]],
                [int(p) for p in parents[row][:count]],
                depth[:count],
                [0.0] + believed[row][: count - 1],
            )
            held.append([graft_span(pool, span, log_rate) for span, log_rate in row_spans])
            pools.append((count, pool))
        width = self.spec.nodes
        if cost is not None:
            width = best_node_count(
                [pool.scores[1:] for _, pool in pools], cost, levels * cost.draft_level, self.spec.nodes
            )
            if all(allowed >= row.level for allowed, row in zip(max_depths, self.rows)):  # not when a caller capped it
                for row in self.rows:
                    row.level = next_depth(levels, max(limits), self.spec.depth)
        trees = []
        for row, (count, pool) in enumerate(pools):
            keep = pool.best(width)
            tree = pool.tree(keep, device)
            drafted = [node < count for node in keep]  # the head's reliability is judged by its own drafts only
            expected = sum(math.exp(scores[row][node]) for node in keep[1:] if node < count)
            self.rows[row].guess = (tree, to_device(drafted, device, torch.bool), expected)
            trees.append(tree)
        return trees, held
