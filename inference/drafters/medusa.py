"""Medusa heads: head d drafts depth d from the target's last hidden state, in one pass (MedusaDrafter), or each
head reads the one before it and grows the tree a level at a time (SequentialMedusaDrafter, Hydra's heads)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from heads import DraftVocabulary, MedusaHeads

from ..compiled_heads import CompiledMedusa, compiled_head
from ..context_vocab import ContextVocabulary
from ..transfer import read_together
from ..tree import StaticTree, Tree, TreeError, static_tree
from ..tree_size import MAX_TOP_K, DynamicTreeSpec, PassCost, likeliest_paths
from .base import Drafter, as_static_tree, check_head_fits, kept_vocabulary, root_only
from .dynamic import DraftNodes, DraftRow, DynamicTreeDrafter


def medusa_tree_spec(heads: MedusaHeads, nodes: int = 15, cost: PassCost | None = None) -> DynamicTreeSpec:
    """Medusa heads' default tree: each step the `nodes` likeliest paths by the heads' own probabilities, as
    deep or as wide as they are sure (any rank may be kept, so top_k = nodes); with a measured `cost`, only
    as many of them as pay for their verification on this machine. Sequential heads grow it a level at a
    time, EAGLE-2's way; top_k = nodes there too, since narrower levels drafted no more on held-out training
    prompts (experiments.md, M11)."""
    return DynamicTreeSpec(depth=heads.config.num_heads, top_k=min(nodes, MAX_TOP_K), nodes=nodes, cost=cost)


class MedusaDrafter(Drafter):
    """Head d proposes its top candidates for depth d; a tree picks which ranks to verify.

    A `DynamicTreeSpec` (the default: `medusa_tree_spec`) picks, each step, the `nodes` likeliest paths by
    the product of the heads' own probabilities for their candidates (EAGLE-2's idea on Medusa heads): deep
    where the heads are sure, wide where they hesitate. A static tree (a list of paths, Medusa's original)
    verifies the same ranks every step; an empty one (`[]`) verifies the root alone: plain decoding.
    """

    hidden_layers = (-1,)

    @classmethod
    def default_tree(cls, heads: MedusaHeads) -> DynamicTreeSpec:
        return medusa_tree_spec(heads)

    def __init__(self, heads: MedusaHeads, model, tree=None, context_vocab: bool = True):
        check_head_fits(heads, model, "these Medusa heads")
        k = heads.config.num_heads
        if tree is None:
            tree = medusa_tree_spec(heads)
        self.spec = tree if isinstance(tree, DynamicTreeSpec) else None
        self.tree = (
            None if self.spec is not None or (isinstance(tree, (list, tuple)) and not tree) else as_static_tree(tree)
        )
        if self.tree is not None and self.tree.max_depth > k:
            raise TreeError(
                f"the tree is {self.tree.max_depth} deep, which needs {self.tree.max_depth} Medusa heads; the "
                f"checkpoint has {k}"
            )
        lm_head = model.get_output_embeddings()
        vocab = kept_vocabulary(
            heads, lambda: DraftVocabulary(lm_head, heads.draft_ids), lm_head.weight, heads.draft_ids
        )
        if self.tree is not None and self.tree.max_rank >= vocab.weight.shape[0]:
            raise TreeError(
                f"the tree asks for candidate rank {self.tree.max_rank}, but the heads draft from "
                f"{vocab.weight.shape[0]} tokens; use lower ranks"
            )
        # heads with lm_heads of their own score only their own rows
        self.heads, self.context = heads, ContextVocabulary(vocab, context_vocab and heads.lm_heads is None)
        self.run_head = compiled_head(heads, model, CompiledMedusa)  # compiled like the target's passes, or the heads
        self.reset()

    def reset(self, rows: int = 1) -> None:
        self.hidden = None  # [rows, H]: each row's state that produced its root
        self.context.reset(rows)

    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None:
        self.hidden = torch.stack([row[-1][-1] for row in hidden])

    def keep_rows(self, rows: list[int]) -> None:
        if self.hidden is not None:
            self.hidden = self.hidden[rows]
        self.context.keep_rows(rows)

    def add_rows(self, count: int) -> None:
        self.context.add_rows(count)  # their hidden states come with the next observe_rows, as every row's do

    def propose_rows(
        self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray] | None = None
    ) -> list[Tree]:
        """One pass of the heads and one projection for every row, then each row's tree."""
        if self.spec is not None:
            depth, ranks = min(self.spec.depth, self.heads.config.num_heads, max(max_depths)), self.spec.top_k
        elif self.tree is not None:
            depth, ranks = self.tree.max_depth, self.tree.max_rank + 1
        else:
            depth = 0
        if depth < 1:
            return [root_only(text) for text in texts]
        vocab = self.context.read_texts(texts, host_texts)
        logits = self.heads.draft_logits(self.run_head(self.hidden)[:, :depth], vocab)  # [rows, depth, N]
        values, indices = self.context.top(logits, min(ranks, logits.shape[-1]))  # a draft vocabulary may be tiny
        roots = torch.stack([text[-1] for text in texts])
        # ONE read: the trees are chosen and built on the host (Tree.from_lists), and checked there by the loop
        candidates, probabilities, roots = read_together(vocab.to_target(indices), values.exp(), roots)
        trees = []
        for row, (text, max_depth) in enumerate(zip(texts, max_depths)):
            tree = self.tree
            if self.spec is not None:
                tree = self._likeliest_tree(probabilities[row][: min(depth, max_depth)]) if max_depth >= 1 else None
            if tree is None:
                trees.append(root_only(text))
            else:
                trees.append(tree.host_tree(int(roots[row]), candidates[row], max_depth, text.device))
        return trees

    def _likeliest_tree(self, probability: list[list[float]]) -> StaticTree | None:
        """This step's best paths, with probability[d][r] standing where a static tree has measured accuracies."""
        paths = likeliest_paths(probability, self.spec.nodes, self.spec.cost)
        return cached_static_tree(tuple(paths)) if paths else None


cached_static_tree = functools.lru_cache(maxsize=4096)(static_tree)  # a step's shape recurs often: build each once


@dataclass
class PrefixRow(DraftRow):
    pending: list = field(default_factory=list)  # the target's last hidden states observed, not read yet


class SequentialMedusaDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from sequential (Hydra-style) Medusa heads: head d reads head d-1's feature and its
    node's token, so growing a level is one pass of one head over the frontier. A row's state `self.hidden` is the
    target's hidden state that produced its root, and `self.last`, head 0's feature from it and the root, gives the
    depth-1 candidates.

    Heads with a prefix layer (Hydra++) keep a cache: the layer's over the target's last hidden states of the
    committed text, which it reads as they are observed; a row's state is then the layer's output for the newest.
    The levels run the heads alone, so nothing is drafted into that cache."""

    hidden_layers = (-1,)
    drafts_into_cache = False

    @classmethod
    def default_tree(cls, heads: MedusaHeads) -> DynamicTreeSpec:
        return medusa_tree_spec(heads)

    def __init__(self, heads: MedusaHeads, model, tree: DynamicTreeSpec | None = None, context_vocab: bool = True):
        check_head_fits(heads, model, "these Medusa heads")
        tree = medusa_tree_spec(heads) if tree is None else tree
        if isinstance(tree, DynamicTreeSpec) and tree.depth > heads.config.num_heads:
            raise TreeError(
                f"the tree is {tree.depth} deep, which needs {tree.depth} sequential Medusa heads; the checkpoint has "
                f"{heads.config.num_heads}"
            )
        lm_head = model.get_output_embeddings()
        vocab = kept_vocabulary(
            heads, lambda: DraftVocabulary(lm_head, heads.draft_ids), lm_head.weight, heads.draft_ids
        )
        super().__init__(
            vocab,
            tree,
            "sequential Medusa",
            context_vocab and heads.lm_heads is None,
            heads.config.acceptance_map,
        )
        self.heads, self.embed = heads, model.get_input_embeddings()
        self.reset()

    def new_row(self) -> PrefixRow:
        return PrefixRow(level=self.spec.depth)

    def reset(self, rows: int = 1) -> None:
        super().reset(rows)
        self.hidden = None  # [rows, H]

    def add_rows(self, count: int) -> None:
        super().add_rows(count)
        if self.heads.prefix is not None and self.hidden is not None:  # the new rows' come when they read their prompt
            self.hidden = torch.cat([self.hidden, self.hidden.new_zeros(count, self.hidden.shape[-1])])

    def observe_rows(self, hidden, next_tokens) -> None:
        super().observe_rows(hidden, next_tokens)
        if self.heads.prefix is None:
            self.hidden = torch.stack([row[-1][-1] for row in hidden])
            return
        for row, row_hidden in zip(self.rows, hidden):
            row.pending.append(row_hidden[-1])

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self.hidden = None if self.hidden is None else self.hidden[rows]

    def _read_committed(self, texts: list[torch.Tensor], host_texts: list[np.ndarray]) -> None:
        if self.heads.prefix is not None:
            self._read_prefix()
        self.last = self.heads.step(0, self.hidden, self.embed(torch.stack([text[-1] for text in texts])))

    def _read_prefix(self) -> None:
        """The prefix layer reads the states each row observed since the last proposal; self.hidden becomes its
        output for each row's newest (rows that read nothing keep theirs)."""
        counts, states = [], []
        for row in self.rows:
            count = sum(state.shape[0] for state in row.pending)
            skip = self._skip(row, count) if count else 0
            states.append(torch.cat(row.pending)[skip:] if count else None)
            counts.append(count - skip)
            row.pending = []
        if not any(counts):
            return
        if len(self.rows) == 1:  # one sequence: its states as they are, no padded block to fill
            block = states[0][None]
        else:
            first = next(state for state in states if state is not None)
            block = first.new_zeros(len(self.rows), max(counts), first.shape[-1])  # padding is masked off
            for index, state in enumerate(states):
                if state is not None:
                    block[index, : state.shape[0]] = state
        self.last = self.hidden  # _append keeps self.last for the rows that read nothing
        self._append(
            counts,
            lambda rows, positions, mask, cache: self.heads.prefix(
                block[rows, : positions.shape[1]], positions, mask, cache
            ),
        )
        self.hidden = self.last

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
