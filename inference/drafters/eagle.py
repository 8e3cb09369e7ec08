"""The EAGLE head as a drafter: it reads the target's features and grows EAGLE-2 dynamic trees with its own cache."""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, field

import torch

from heads import NO_COPY, EagleHead, copy_embedding, copy_tokens

from ..compiled_heads import compiled_head
from ..tree_size import DynamicTreeSpec
from .base import check_head_fits
from .dynamic import DraftNodes, DraftRow, DynamicTreeDrafter


@dataclass
class EagleRow(DraftRow):
    pending: list = field(default_factory=list)  # observed (features, next tokens) pairs not read yet
    successors: dict = field(default_factory=dict)  # committed bigram -> next token (the copy input)


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
        super().__init__(head.draft_vocabulary(model.get_output_embeddings()), tree, "EAGLE", context_vocab)
        self.head, self.embed = head, model.get_input_embeddings()
        self.run_head = compiled_head(head, model)  # compiled like the target's passes, or the head itself
        self.hidden_layers = tuple(head.config.feature_layers)
        self.reset()

    def reset(self, rows: int = 1) -> None:
        super().reset(rows)
        self.tails = None  # each row's last two committed tokens, for the copy tokens of draft nodes

    def new_row(self) -> EagleRow:
        return EagleRow(level=self.spec.depth)

    def observe_rows(self, hidden, next_tokens) -> None:
        super().observe_rows(hidden, next_tokens)
        for row, row_hidden, tokens in zip(self.rows, hidden, next_tokens):
            row.pending.append(
                (torch.cat([row_hidden[layer] for layer in self.hidden_layers], dim=-1), tokens)
            )  # fused in the head

    def _read_committed(self, texts: list[torch.Tensor]) -> None:
        """Feed the head the pairs each row observed since the last proposal; texts[b] is row b's committed text."""
        copy_input = self.head.config.copy_input
        self.tails = [text[-2:].tolist() for text in texts] if copy_input else None
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
            copies = None
            if copy_input:  # the bigram map holds the text before; pairs from the row's end need one token back
                start = state.skipped + state.length
                offset = max(start - 1, 0)
                found = copy_tokens(
                    texts[row][offset:].tolist(), start - offset, start - offset + count, state.successors
                )
                copies = torch.tensor(found, device=device)
            skip = self._skip(state, count)  # after the copy tokens: the bigrams of a whole prompt are cheap to keep
            features = torch.cat([f for f, _ in state.pending])[skip:]
            tokens = torch.cat([t for _, t in state.pending])[skip:]
            read.append((features, tokens, None if copies is None else copies[skip:]))
            counts[row] -= skip
        width = max(counts)
        features = first.new_zeros(rows, width, first.shape[-1])
        next_tokens = torch.zeros(rows, width, dtype=torch.long, device=device)  # padding reads token 0, masked off
        copies = torch.full((rows, width), NO_COPY, dtype=torch.long, device=device)
        for row, (count, pairs) in enumerate(zip(counts, read)):
            if pairs is not None:
                features[row, :count], next_tokens[row, :count] = pairs[0], pairs[1]
                if copy_input:
                    copies[row, :count] = pairs[2]
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
        if self.tails is not None:  # one transfer of the trees so far, then the paths are walked on the host
            node_tokens, parents = nodes.tokens[:, : nodes.count].tolist(), nodes.parents[:, : nodes.count].tolist()
            found = [
                draft_copy_tokens(tail, tokens, row_parents, row_frontier, successors)
                for tail, tokens, row_parents, row_frontier, successors in zip(
                    self.tails, node_tokens, parents, frontier.tolist(), [row.successors for row in self.rows]
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
