"""The early-exit draft as a drafter: the target's own first layers (with a LoRA adapter) grow EAGLE-2 trees."""

from __future__ import annotations

import numpy as np
import torch

from heads import DraftVocabulary, EarlyExitHead

from ..compiled_heads import CompiledEarlyExit, compiled_head
from ..tree_size import DynamicTreeSpec
from .base import check_head_fits, kept_vocabulary
from .dynamic import DraftNodes, DynamicTreeDrafter


class EarlyExitDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from the target's own first layers (heads.early_exit): a draft node's input is
    its token alone, at its position, over the early layers' own cache of the committed text.

    The cache is the draft's own, not the target's: with an adapter the early layers' keys and values differ
    from the target's, and draft positions must never enter the target's cache. `propose` first runs the
    tokens committed since the last proposal (the root last) through the early layers in one pass.
    """

    def __init__(self, head: EarlyExitHead, model, tree: DynamicTreeSpec | None = None, context_vocab: bool = True):
        check_head_fits(head, model, "this early-exit head")
        lm_head = model.get_output_embeddings()
        super().__init__(
            kept_vocabulary(head, lambda: DraftVocabulary(lm_head, head.draft_ids), lm_head.weight, head.draft_ids),
            tree,
            "early-exit",
            context_vocab,
            head.config.acceptance_map,
        )
        self.head = head
        self.run_head = compiled_head(head, model, CompiledEarlyExit)  # compiled like the target's passes, or the head
        self.reset()

    def _read_committed(self, texts: list[torch.Tensor], host_texts: list[np.ndarray]) -> None:
        # the committed text only grows: what the cache holds stays valid
        counts = [text.shape[0] - row.skipped - row.length for text, row in zip(texts, self.rows)]
        counts = [count - self._skip(row, count) for count, row in zip(counts, self.rows)]
        if not any(counts):
            return
        new = torch.zeros(
            len(texts), max(counts), dtype=torch.long, device=texts[0].device
        )  # padding reads token 0, masked off
        for index, (text, row) in enumerate(zip(texts, self.rows)):
            new[index, : counts[index]] = text[row.skipped + row.length :]
        self._append(
            counts,
            lambda rows, positions, mask, cache: self.run_head(
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
        return self.run_head(
            nodes.tokens.gather(1, frontier), position_ids=positions, attention_mask=mask, cache=self.cache
        )
