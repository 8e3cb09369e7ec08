"""Prompt lookup: copy what followed an earlier occurrence of the last few tokens (no heads, no state)."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from ..tree import Tree
from .base import TokenDrafter


class PromptLookupDrafter(TokenDrafter):
    """Copy what followed the latest earlier occurrence of the last n tokens (longest n first).

    The search runs on the host, on the loop's host copy of the text, so a GPU never waits for it.
    A span that follows a match of at least `trusted_ngram` tokens is right often enough that a head merged beside
    it need not draft deep (MergedDrafter asks `span` and judges by the n it returns).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 10, trusted_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1 or trusted_ngram < 1:
            raise ValueError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, num_tokens >= 1 and trusted_ngram >= 1, "
                f"got {min_ngram}, {max_ngram}, {num_tokens}, {trusted_ngram}"
            )
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens
        self.trusted_ngram = trusted_ngram

    def span(self, tokens, max_depth: int) -> tuple[list[int], int]:
        """(the copied tokens, at most min(num_tokens, max_depth) of them; the n of the n-gram they follow, 0 when
        nothing was copied). `tokens`: the text on the host (a NumPy array, a list or a CPU tensor)."""
        tokens = np.asarray(tokens)
        length = tokens.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(tokens[: length - 1], n)  # every n-gram with at least one token after it
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1])
                span = tokens[start + n : start + n + min(self.num_tokens, max_depth)].tolist()
                return span, n if span else 0
        return [], 0

    def trusts(self, matched: int) -> bool:
        """Whether a span that followed a match of `matched` tokens is trusted (see the class)."""
        return matched >= self.trusted_ngram

    def propose_rows(
        self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray] | None = None
    ) -> list[Tree]:
        if host_texts is None:  # outside the loop: read the texts back
            host_texts = [text.cpu().numpy() for text in texts]
        return [
            span_tree(host, self.span(host, depth)[0], text.device)
            for text, host, depth in zip(texts, host_texts, max_depths)
        ]

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return self.propose_rows([tokens], [max_depth])[0]


def span_tree(text, span: list[int], device: torch.device) -> Tree:
    """The chain of a copied span under the text's last token, built on the host (Tree.from_lists)."""
    return Tree.from_lists([int(text[-1]), *span], list(range(-1, len(span))), device)
