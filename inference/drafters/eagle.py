"""The EAGLE head as a drafter: it reads the target's features and grows EAGLE-2 dynamic trees with its own cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from heads import NO_COPY, EagleHead, copy_embedding

from ..bigrams import RowBigrams, bigram_table, draft_copies
from ..compiled_heads import compiled_head
from ..transfer import to_device
from ..tree_size import DynamicTreeSpec
from .base import check_head_fits, kept_vocabulary
from .dynamic import DraftNodes, DraftRow, DynamicTreeDrafter


@dataclass
class EagleRow(DraftRow):
    pending: list = field(default_factory=list)  # observed (features, next tokens) pairs not read yet
    bigrams: RowBigrams | None = None  # with the copy input: the committed text's bigrams (inference.bigrams)


class EagleDrafter(DynamicTreeDrafter):
    """EAGLE-2 dynamic trees from an EAGLE head that keeps its own KV cache.

    The head reads pairs (feature of token t, token t+1) at position t. `observe` queues the committed
    pairs; `propose` first feeds them to the head (a head with `copy_input` also reads each pair's copy
    token, which needs the committed text that `propose` is given), so its cache holds every committed pair
    and `self.last` is its output for the newest one: the predicted feature of the root, whose logits give
    the depth-1 candidates. A draft node's input is its parent's predicted feature and its own token.
    """

    def __init__(self, head: EagleHead, model, tree: DynamicTreeSpec | None = None, context_vocab: bool = True):
        check_head_fits(head, model, "this EAGLE head")
        lm_head = model.get_output_embeddings()
        own_rows = head.lm_head.weight if getattr(head, "lm_head", None) is not None else None  # eagle3's
        super().__init__(
            kept_vocabulary(head, lambda: head.draft_vocabulary(lm_head), lm_head.weight, head.draft_ids, own_rows),
            tree,
            "EAGLE",
            context_vocab,
            head.config.acceptance_map,
        )
        self.head, self.embed = head, model.get_input_embeddings()
        self.run_head = compiled_head(head, model)  # compiled like the target's passes, or the head itself
        self.hidden_layers = tuple(head.config.feature_layers)
        self.draft_paths = head.config.copy_input  # a draft node's copy token reads its path
        self.reset()

    def reset(self, rows: int = 1) -> None:
        super().reset(rows)
        self.bigrams = None  # with the copy input: every row's committed bigrams on the device, this step's

    def new_row(self) -> EagleRow:
        vocab_size = self.embed.weight.shape[0]
        return EagleRow(level=self.spec.depth, bigrams=RowBigrams(vocab_size) if self.head.config.copy_input else None)

    def observe_rows(self, hidden, next_tokens) -> None:
        super().observe_rows(hidden, next_tokens)
        for row, row_hidden, tokens in zip(self.rows, hidden, next_tokens):
            row.pending.append(
                (torch.cat([row_hidden[layer] for layer in self.hidden_layers], dim=-1), tokens)
            )  # fused in the head

    def _read_committed(self, texts: list[torch.Tensor], host_texts: list[np.ndarray]) -> None:
        """Feed the head the pairs each row observed since the last proposal; texts[b] is row b's committed text,
        host_texts[b] the same on the host."""
        copy_input = self.head.config.copy_input
        if copy_input:
            for row, host in zip(self.rows, host_texts):
                row.bigrams.read(host)
            self.bigrams = bigram_table([row.bigrams for row in self.rows], texts[0].device)
        counts = [sum(tokens.shape[0] for _, tokens in row.pending) for row in self.rows]
        if not any(counts):
            return
        rows, device = len(texts), texts[0].device
        first = next(f for row in self.rows for f, _ in row.pending)
        read = []  # each row's pairs to read: features, next tokens, copy tokens
        for row, (state, count) in enumerate(zip(self.rows, counts)):
            if not count:
                read.append(None)
                continue
            start = state.skipped + state.length  # pair t reads tokens t and t + 1 of the committed text
            skip = self._skip(state, count)
            features = torch.cat([f for f, _ in state.pending])[skip:]
            tokens = torch.cat([t for _, t in state.pending])[skip:]
            copies = state.bigrams.copies[start + skip : start + count] if copy_input else None
            read.append((features, tokens, copies))
            counts[row] -= skip
        width = max(counts)
        if rows == 1:  # one sequence: its pairs as they are, no padded block to fill
            features, next_tokens, copies = read[0]
            features, next_tokens = features[None], next_tokens[None]
            copies = to_device([copies], device) if copy_input else None
        else:
            features = first.new_zeros(rows, width, first.shape[-1])
            next_tokens = torch.zeros(rows, width, dtype=torch.long, device=device)  # padding reads 0, masked off
            copies = np.full((rows, width), NO_COPY, dtype=np.int64)
            for row, (count, pairs) in enumerate(zip(counts, read)):
                if pairs is not None:
                    features[row, :count], next_tokens[row, :count] = pairs[0], pairs[1]
                    if copy_input:
                        copies[row, :count] = pairs[2]
            copies = to_device(copies, device) if copy_input else None
        for state in self.rows:
            state.pending = []
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
        if self.bigrams is not None:
            copies = copy_embedding(self.embed, draft_copies(self.bigrams, nodes.path_tokens(frontier, depth)))
        return self.run_head(
            states,
            self.embed(nodes.tokens.gather(1, frontier)),
            copies,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
        )
