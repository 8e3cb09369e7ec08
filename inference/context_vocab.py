"""Draft the tokens a sequence has already seen, beyond a head's draft vocabulary.

A head with a reduced draft vocabulary (heads.vocab: the N most frequent tokens of its training answers) never
proposes a token outside it, and open-ended answers are full of such tokens: names, terms, figures, most of them
taken from the prompt. SmolLM2-135M's greedy answers to the dev set, against the shipped 8,192-token vocabulary:
14% of the summaries' tokens are outside it (11% in the prompt), 13% in stem, 2% in code. Each of those ends the
accepted path. Their rows of the target's lm_head cost almost nothing to add, so each sequence drafts from the
head's vocabulary plus every token of its prompt and of its output so far. The target still verifies over its full
vocabulary: exactness is untouched, only what is proposed changes.

In a batch the rows share one projection over the union of their tokens; a token only other rows have seen is
masked out of a row's probabilities, so each row drafts what it would alone.
"""

from __future__ import annotations

import torch

from heads import DraftVocabulary


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A head's log-probabilities in float32, -inf where they are NaN (non-finite weights): impossible drafts."""
    return torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=float("-inf"))


class ContextVocabulary:
    """A drafter's vocabulary for the sequences it drafts for: `base` plus each row's tokens so far (when
    `enabled` and `base` can grow: a reduced vocabulary over the target's lm_head rows)."""

    def __init__(self, base: DraftVocabulary, enabled: bool = True):
        self.base, self.enabled = base, enabled and base.extensible
        self.reset()

    def reset(self, rows: int = 1) -> None:
        self.current, self.unseen = self.base, None
        self.shared = rows > 1  # one sequence alone has seen every token added for it: nothing to mask
        self.read = [0] * rows  # how much of each row's text has been read
        self.seen = (
            torch.zeros(rows, self.base.target_size, dtype=torch.bool, device=self.base.weight.device)
            if self.enabled
            else None
        )

    def read_texts(self, texts: list[torch.Tensor]) -> DraftVocabulary:
        """Take in what each row committed since the last call (texts[b]: row b's whole committed text) and
        return the vocabulary to draft from now."""
        if not self.enabled:
            return self.current
        fresh = [text[start:] for text, start in zip(texts, self.read)]
        for row, tokens in enumerate(fresh):
            self.seen[row, tokens] = True
        self.read = [text.shape[0] for text in texts]
        self.current = self.current.extended(torch.cat(fresh))
        if self.shared:
            self.unseen = self.current.unseen(self.seen)
        return self.current

    def add_rows(self, count: int) -> None:
        """`count` new rows, that have seen nothing yet. The vocabulary is rebuilt from the rows still drafting,
        so a batch that admits prompts as others finish does not grow it with every finished row's tokens."""
        self.read += [0] * count
        self.shared = len(self.read) > 1
        if self.enabled:
            self.seen = torch.cat([self.seen, self.seen.new_zeros(count, self.seen.shape[1])])
            self.current = self.base.extended(self.seen.any(dim=0).nonzero()[:, 0])
            self.unseen = self.current.unseen(self.seen) if self.shared else None

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows go on (their order kept)."""
        self.read = [self.read[row] for row in rows]
        if self.enabled:
            self.seen = self.seen[rows]
            self.unseen = self.current.unseen(self.seen)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of logits [rows, ..., N] over `current`, each row's unseen tokens impossible."""
        if self.unseen is not None:
            shape = (self.unseen.shape[0],) + (1,) * (logits.dim() - 2) + (self.unseen.shape[1],)
            logits = logits.masked_fill(self.unseen.view(shape), float("-inf"))
        return log_probabilities(logits)
