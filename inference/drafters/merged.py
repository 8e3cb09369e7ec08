"""Several drafters' trees merged into ONE tree a row, verified in the same target pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..tree import Tree, verifiable_tree
from ..tree_select import merge_trees
from .base import Drafter, SequenceDrafter, TokenDrafter, drafter_name
from .dynamic import RELIABILITY_DECAY, DynamicTreeDrafter
from .lookup import PromptLookupDrafter, span_tree

SPAN_PRIOR = (1.0, 2.0)  # (tokens held, tokens tried): a row's first copied tokens are believed right half the time


@dataclass
class PendingSpans:
    """A row's copied spans of one step, till the tokens its verification committed are known: (rate key, span,
    how many of its first tokens the drafts held) each; where the row's text stood; how many tokens the step
    committed (from observe_rows, then read on the host at the next proposal)."""

    spans: list[tuple[tuple[int, int], list[int], int]]
    start: int
    committed: int | None = None


class MergedDrafter(Drafter):
    """Drafters that read only tokens propose first. With a fixed tree, one sequence's spans are merged whole into
    the head's tree, and when prompt lookup's span follows a long enough match (PromptLookupDrafter.trusts) the
    drafters with heads draft one level only: their depth-1 candidates cost a projection, deeper levels cost head
    passes, and beside a trusted span they rarely win a token. In a batch, where every row's tree is padded to the
    widest, and wherever the head's trees are priced (a measured cost: the default call), a head that grows dynamic
    trees weighs each row's spans against its drafts instead (graft_span): the tokens a span adds to the head's
    drafts are scored by how often the tokens such spans added have been right on this row (by the length of the
    n-gram matched; SPAN_PRIOR, decayed as the head's reliability is), and the row keeps its likeliest nodes of
    both, as many as pay for their verification. A whole span can cost more than it brings: with compiled passes on
    a CPU, a pass past NARROW_TOKENS (inference.compiled) runs through the wider package, which costs more a token.
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
            drafter.reset(rows)
        # per row: {(token drafter, n-gram length): [decayed tokens that held, decayed tokens tried]}, and the
        # spans of its last drafting step till the target's answer is learnt from them (PendingSpans)
        self.span_rates, self.pending = [{} for _ in range(rows)], [None] * rows

    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None:
        for drafter in self.drafters:
            drafter.observe_rows(hidden, next_tokens)
        for row, tokens in enumerate(next_tokens):
            pending = self.pending[row]
            if pending is not None and pending.committed is None:  # the step that verified them: how many it made
                pending.committed = tokens.shape[0]

    def _learn_from_spans(self, host_texts: list[np.ndarray]) -> None:
        """Each row's rates, from the tokens the step that verified its last spans committed (read on the host)."""
        for row, (pending, host) in enumerate(zip(self.pending, host_texts)):
            if pending is None or pending.committed is None:
                continue
            committed = host[pending.start : pending.start + pending.committed].tolist()
            for key, span, shared in pending.spans:
                if span[:shared] != committed[:shared]:
                    continue  # the span's tokens the drafts held were wrong: nothing learnt of the tokens it added
                held, tried = span_outcome(span[shared:], committed[shared:])
                rate = self.span_rates[row].setdefault(key, list(SPAN_PRIOR))
                rate[0] = RELIABILITY_DECAY * rate[0] + held
                rate[1] = RELIABILITY_DECAY * rate[1] + tried
            self.pending[row] = None

    def keep_rows(self, rows: list[int]) -> None:
        for drafter in self.drafters:
            drafter.keep_rows(rows)
        self.span_rates, self.pending = [self.span_rates[row] for row in rows], [self.pending[row] for row in rows]

    def add_rows(self, count: int) -> None:
        for drafter in self.drafters:
            drafter.add_rows(count)
        self.span_rates += [{} for _ in range(count)]
        self.pending += [None] * count

    def propose_rows(
        self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray] | None = None
    ) -> list[Tree]:
        if host_texts is None:  # outside the loop: read the texts back
            host_texts = [text.cpu().numpy() for text in texts]
        self._learn_from_spans(host_texts)
        if self.grafts and (len(texts) > 1 or self.head_drafters[0].spec.cost is not None):
            return self._propose_grafted(texts, max_depths, host_texts)
        spans, head_depths = [], []
        for text, host, max_depth in zip(texts, host_texts, max_depths):  # token drafters are asked row by row
            row_spans, trusted = [], False  # trust is per row
            for drafter in self.token_drafters:
                if isinstance(drafter, PromptLookupDrafter):
                    span, matched = drafter.span(host, max_depth)
                    trusted |= len(span) > 0 and drafter.trusts(matched)
                    row_spans.append(span_tree(host, span, text.device))
                else:
                    row_spans.append(_checked(drafter, [text], [max_depth], [host])[0])
            spans.append(row_spans)
            head_depths.append(min(1, max_depth) if trusted else max_depth)
        heads = [_checked(d, texts, head_depths, host_texts) for d in self.head_drafters]  # all rows at once
        merged = []
        for row in range(len(texts)):
            trees = [head_trees[row] for head_trees in heads] + spans[row]
            tree = trees[0]
            for other in trees[1:]:
                tree = merge_trees(tree, other)
            merged.append(tree)
        return merged

    def _propose_grafted(
        self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray]
    ) -> list[Tree]:
        """Each row's spans, scored by its rates, weighed against the head's drafts in one pool. Beside a trusted
        span one sequence's head drafts one level only, as with whole spans; a batch's head passes serve every row,
        so there each row drafts as deep as it may."""
        spans, copied = [], []  # per row: (span, log-rate) pairs for the head; each span's rate key and tokens
        trusted = False
        for row, (host, max_depth) in enumerate(zip(host_texts, max_depths)):
            spans.append([])
            copied.append([])
            for index, drafter in enumerate(self.token_drafters):
                span, matched = drafter.span(host, max_depth)
                if span:
                    trusted |= drafter.trusts(matched)
                    held, tried = self.span_rates[row].get((index, matched), SPAN_PRIOR)
                    spans[-1].append((span, math.log(held / tried)))
                    copied[-1].append(((index, matched), span))
        head_depths = [min(1, max_depths[0])] if trusted and len(texts) == 1 else max_depths
        trees, held = self.head_drafters[0].propose_grafted(texts, head_depths, spans, host_texts)
        # till the target answers: each span, and how many of its first tokens the drafts held (the rates are of the
        # rest)
        self.pending = [
            PendingSpans(
                [(key, span, shared) for (key, span), shared in zip(row_copied, row_held, strict=True)], len(host)
            )
            if row_copied
            else None
            for row_copied, row_held, host in zip(copied, held, host_texts, strict=True)
        ]
        return trees


def _checked(
    drafter: Drafter, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray]
) -> list[Tree]:
    """The loop checks the merged tree; a tree from a drafter written outside this package is checked first, so that
    an error names that drafter."""
    trees = drafter.propose_rows(texts, max_depths, host_texts)
    if isinstance(drafter, SequenceDrafter) and not type(drafter).__module__.startswith(__package__):
        trees = [
            verifiable_tree(tree, text[-1], None, depth, drafter_name(drafter))
            for tree, text, depth in zip(trees, texts, max_depths)
        ]
    return trees


def span_outcome(span: list[int], committed: list[int]) -> tuple[int, int]:
    """(tokens that held, tokens tried) of a copied span against what the target committed: its tokens are tried
    in order until one is wrong; those past the committed tokens are not known yet and count for neither."""
    held = 0
    for copied, chosen in zip(span, committed):
        if copied != chosen:
            return held, held + 1
        held += 1
    return held, held
