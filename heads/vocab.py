"""A reduced draft vocabulary: heads draft from the N most frequent target tokens only.

On a small target the vocabulary projection dominates a draft step (49,152 x 576 per row for SmolLM2);
drafting from the few thousand tokens that make up most text cuts it several-fold. The target still
verifies over its full vocabulary, so a token outside the draft vocabulary is simply never proposed:
exactness is untouched, only acceptance can drop. inference.context_vocab adds tokens back for each sequence (the
tokens of its prompt and output), as rows after the base's (`with_rows`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F


class DraftVocabulary:
    """The target's output projection restricted to `draft_ids` (all of it when None), sliced once.

    A head with a projection of its own (EAGLE-3: a norm and an lm_head whose rows are the draft vocabulary's)
    passes `own_rows=True`, the target's vocabulary size and its `norm`; its weights are used as they are, so
    training updates them.
    """

    def __init__(
        self,
        lm_head: torch.nn.Module,
        draft_ids: torch.Tensor | None = None,
        *,
        own_rows: bool = False,
        target_size: int | None = None,
        norm: torch.nn.Module | None = None,
    ):
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if draft_ids is not None and not own_rows:
            weight = weight[draft_ids]
            bias = None if bias is None else bias[draft_ids]
        self.ids, self.weight, self.bias, self.norm = draft_ids, weight, bias, norm
        self.target_size = target_size if own_rows else lm_head.weight.shape[0]
        self.base_size = weight.shape[0]  # rows past it were added (with_rows)
        # a reduced vocabulary over the target's own rows can take any target token back; a head's own rows cannot
        self._target_rows = None if own_rows or draft_ids is None else (lm_head.weight, getattr(lm_head, "bias", None))
        # the base rows' product, when a drafter gives a faster one (inference.packed: their weights packed once)
        self.base_projection = None
        # the product over every row, base and added, where whoever added them keeps a faster one (a context
        # vocabulary's packed buffer: inference.context_vocab)
        self.projection = None
        # a context vocabulary's buffers, kept with it for the next (inference.context_vocab)
        self.kept_buffers = None

    @property
    def extensible(self) -> bool:
        """Whether target tokens outside the vocabulary can join it (its rows are the target's lm_head's)."""
        return self._target_rows is not None

    @property
    def target_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's lm_head weight and bias, where tokens that join an `extensible` vocabulary take their rows."""
        if not self.extensible:
            raise ValueError(
                "this draft vocabulary has rows of its own (an EAGLE-3 head's lm_head): no other token can join it"
            )
        return self._target_rows

    def with_rows(self, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor) -> DraftVocabulary:
        """This vocabulary with other rows (the first `base_size` its own, then added ones; inference.context_vocab)."""
        grown = copy.copy(self)
        grown.weight, grown.bias, grown.ids, grown.projection = weight, bias, ids, None
        return grown

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., N] over the draft vocabulary."""
        if self.norm is not None:
            features = self.norm(features)
        features = features.to(self.weight.dtype)
        if self.projection is not None:
            return self.projection(features)
        if self.base_projection is None:
            return F.linear(features, self.weight, self.bias)
        base = self.base_projection(features)
        if self.weight.shape[0] == self.base_size:
            return base
        added = slice(self.base_size, None)  # rows added by with_rows
        bias = None if self.bias is None else self.bias[added]
        return torch.cat([base, F.linear(features, self.weight[added], bias)], dim=-1)

    def to_target(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> the target's token ids."""
        return indices if self.ids is None else self.ids[indices]

    def from_target(self, token_ids: torch.Tensor, missing: int = -100) -> torch.Tensor:
        """The target's token ids -> draft-vocabulary indices, `missing` where a token is not in it."""
        if self.ids is None:
            return token_ids
        index = torch.full((self.target_size,), missing, dtype=torch.long, device=token_ids.device)
        index[self.ids] = torch.arange(self.ids.shape[0], device=token_ids.device)
        return index[token_ids]


def most_frequent_tokens(sequences: Iterable[list[int]], size: int, vocab_size: int) -> tuple[torch.Tensor, int, int]:
    """(the `size` most frequent token ids in ascending order, tokens they cover, tokens in all)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in sequences:
        counts += torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=vocab_size)
    top = counts.topk(size)
    return top.indices.sort().values, int(top.values.sum()), int(counts.sum())
