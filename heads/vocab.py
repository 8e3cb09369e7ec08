"""A reduced draft vocabulary: heads draft from the N most frequent target tokens only.

On a small target the vocabulary projection dominates a draft step (49,152 x 576 per row for SmolLM2);
drafting from the few thousand tokens that make up most text cuts it several-fold. The target still
verifies over its full vocabulary, so a token outside the draft vocabulary is simply never proposed:
exactness is untouched, only acceptance can drop. `DraftVocabulary.extended` adds tokens back for one
sequence (inference.context_vocab: the tokens of its prompt and output).
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
        self.base_size = weight.shape[0]  # rows past it were added by `extended`
        # a reduced vocabulary over the target's own rows can take any target token back; a head's own rows cannot
        self._target_rows = None if own_rows or draft_ids is None else (lm_head.weight, getattr(lm_head, "bias", None))
        self.member, self._rows = None, None
        if self._target_rows is not None:
            self.member = torch.zeros(self.target_size, dtype=torch.bool, device=draft_ids.device)
            self.member[draft_ids] = True

    @property
    def extensible(self) -> bool:
        """Whether target tokens outside the vocabulary can join it (its rows are the target's lm_head's)."""
        return self._target_rows is not None

    def extended(self, token_ids: torch.Tensor) -> DraftVocabulary:
        """This vocabulary plus the target tokens `token_ids` that are not in it yet (appended, their rows taken
        from the target's lm_head); itself when there are none. Only an `extensible` vocabulary can grow."""
        if not self.extensible:
            raise ValueError(
                "this draft vocabulary has rows of its own (an EAGLE-3 head's lm_head): no other token can join it"
            )
        new = token_ids.unique()
        new = new[~self.member[new]]
        if new.numel() == 0:
            return self
        weight, bias = self._target_rows
        size, grown_size = self.weight.shape[0], self.weight.shape[0] + new.numel()
        rows = self._rows
        # Rows are appended in place, after this vocabulary's, when it is the newest one grown in its buffer and
        # the buffer has room; otherwise (the base vocabulary, or an older one grown again) into a new buffer
        # with room to spare. A sequence grows its vocabulary by a few tokens most steps: copying every row each
        # time cost more than the projection itself.
        # (An inference tensor cannot be written outside inference mode: a vocabulary grown inside generate() and
        # again outside it takes a new buffer.)
        stale = rows is not None and rows.weight.is_inference() and not torch.is_inference_mode_enabled()
        with torch.no_grad():  # the target's rows: constants to a drafter
            if rows is None or stale or rows.used != size or rows.weight.shape[0] < grown_size:
                rows = _Rows(self.weight, self.bias, grown_size + max(256, grown_size // 8))
            rows.weight[size:grown_size] = weight[new]
            if bias is not None:
                rows.bias[size:grown_size] = bias[new]
        rows.used = grown_size
        grown = copy.copy(self)
        grown._rows, grown.ids = rows, torch.cat([self.ids, new])
        grown.weight = rows.weight[:grown_size]
        grown.bias = None if bias is None else rows.bias[:grown_size]
        grown.member = self.member.clone()
        grown.member[new] = True
        return grown

    def unseen(self, seen: torch.Tensor) -> torch.Tensor | None:
        """[rows, N]: where an added token is not among a row's `seen` tokens ([rows, target vocab] bool), so that
        row must not draft it; None when every row may draft every token."""
        if self.weight.shape[0] == self.base_size:
            return None
        unseen = torch.zeros(seen.shape[0], self.weight.shape[0], dtype=torch.bool, device=seen.device)
        unseen[:, self.base_size :] = ~seen[:, self.ids[self.base_size :]]
        return unseen if bool(unseen.any()) else None

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., N] over the draft vocabulary."""
        if self.norm is not None:
            features = self.norm(features)
        return F.linear(features.to(self.weight.dtype), self.weight, self.bias)

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


class _Rows:
    """A buffer of projection rows with room to grow: the first `used` rows are taken, the first ones copied
    from `weight` (and `bias`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, capacity: int):
        self.used = weight.shape[0]
        self.weight = weight.new_empty(capacity, weight.shape[1])
        self.weight[: self.used] = weight
        self.bias = None
        if bias is not None:
            self.bias = bias.new_empty(capacity)
            self.bias[: self.used] = bias


def most_frequent_tokens(sequences: Iterable[list[int]], size: int, vocab_size: int) -> tuple[torch.Tensor, int, int]:
    """(the `size` most frequent token ids in ascending order, tokens they cover, tokens in all)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in sequences:
        counts += torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=vocab_size)
    top = counts.topk(size)
    return top.indices.sort().values, int(top.values.sum()), int(counts.sum())
