"""Prompt lookup: copy what followed an earlier occurrence of the last few tokens (no heads, no state)."""

from __future__ import annotations

import torch

from ..tree import Tree
from .base import TokenDrafter, root_only


class PromptLookupDrafter(TokenDrafter):
    """Copy what followed the latest earlier occurrence of the last n tokens (longest n first).

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

    def span(self, tokens: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, int]:
        """(the copied tokens, at most min(num_tokens, max_depth) of them; the n of the n-gram they follow, 0 when
        nothing was copied)."""
        length = tokens.shape[0]
        sizes = range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1)
        latest = []  # for each n, the latest start of an earlier occurrence of the last n tokens (-1: none)
        for n in sizes:
            windows = tokens[: length - 1].unfold(0, n, 1)  # every n-gram with at least one token after it
            hits = (windows == tokens[length - n :]).all(dim=-1)
            latest.append(torch.where(hits, torch.arange(hits.shape[0], device=tokens.device), -1).max())
        for n, start in zip(sizes, torch.stack(latest).tolist() if latest else []):  # one host read
            if start >= 0:
                span = tokens[start + n : start + n + min(self.num_tokens, max_depth)]
                return span, n if span.shape[0] else 0
        return tokens[:0], 0

    def trusts(self, matched: int) -> bool:
        """Whether a span that followed a match of `matched` tokens is trusted (see the class)."""
        return matched >= self.trusted_ngram

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        span, _ = self.span(tokens, max_depth)
        return Tree.chain(torch.cat([tokens[-1:], span])) if span.shape[0] else root_only(tokens)
