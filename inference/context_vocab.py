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

from .packed import packable_rows, write_packed_rows


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A head's log-probabilities in float32, -inf where they are NaN (non-finite weights): impossible drafts."""
    return torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=float("-inf"))


ROOM = 256  # added rows a vocabulary's buffer has room for at first (it grows by a quarter and this much)


class ContextVocabulary:
    """A drafter's vocabulary for the sequences it drafts for: `base` plus each row's tokens so far (when
    `enabled` and `base` can grow: a reduced vocabulary over the target's lm_head rows).

    The added tokens' rows are copied from the target's lm_head into a buffer after the base's, in the order they
    were first read, and counted, on the device: drafting reads nothing back to the host (each read waits for a
    GPU). The host keeps an upper bound of the count (every token read since the count was last read back might
    be new), which it reads back only when the bound would overrun the buffer. `current` spans the whole buffer,
    its rows past the count masked off (`unseen`): its projection keeps one shape until the buffer grows (oneDNN
    builds a kernel for each new shape, 0.1-0.6 ms on a 2-core EPYC, against 15-20 us for the product itself).
    """

    def __init__(self, base: DraftVocabulary, enabled: bool = True):
        self.base, self.enabled = base, enabled and base.extensible
        self.reset()

    def reset(self, rows: int = 1) -> None:
        self.current, self.unseen = self.base, None
        self.shared = rows > 1  # one sequence alone has seen every token added for it
        self.read = [0] * rows  # how much of each row's text has been read
        self.seen = None
        if self.enabled:
            device = self.base.weight.device
            self.seen = torch.zeros(rows, self.base.target_size, dtype=torch.bool, device=device)
            self._empty(ROOM)

    def _empty(self, room: int) -> None:
        """No token added yet; a buffer with room for `room`."""
        device = self.base.weight.device
        self.member = torch.zeros(self.base.target_size, dtype=torch.bool, device=device)
        self.member[self.base.ids] = True
        self.count = torch.zeros((), dtype=torch.long, device=device)  # added rows, on the device
        self.bound = 0  # an upper bound of the count, on the host
        self.weight = self.bias = self.ids = None
        self._allocate(room)
        self.current = self.base

    def _allocate(self, room: int) -> None:
        """A buffer for the base's rows and `room` added ones (the added rows so far copied), and one more row that
        takes the writes of tokens already in. Where our packed kernel serves it, the room is rounded up to fill its
        groups of 64 rows, and the buffer is kept packed too (`packed`), its rows written as they are added: the
        whole vocabulary is then one product, no added rows through a kernel of their own (docs/experiments.md,
        row X16)."""
        size, old = self.base.base_size, self.weight
        rows = packable_rows(size + room + 1, self.base.weight)
        room = room if rows is None else rows - size - 1
        weight = self.base.weight.new_zeros(size + room + 1, self.base.weight.shape[1])
        ids = self.base.ids.new_zeros(size + room + 1)
        bias = None if self.base.bias is None else self.base.bias.new_zeros(size + room + 1)
        with torch.no_grad():  # the target's rows: constants to a drafter
            kept = size + self.bound if old is not None else size
            weight[:kept] = self.base.weight if old is None else old[:kept]
            ids[:kept] = self.base.ids if old is None else self.ids[:kept]
            if bias is not None:
                bias[:kept] = self.base.bias if old is None else self.bias[:kept]
        self.weight, self.bias, self.ids, self.room = weight, bias, ids, room
        self.packed = None if rows is None else torch.ops.specheads.pack_linear_weight(weight)

    def _add(self, tokens: torch.Tensor) -> None:
        """Append the rows of `tokens` not in the vocabulary yet, each once."""
        count = tokens.shape[0]
        if count == 0:
            return
        if self.bound + count > self.room:
            self.bound = int(self.count)  # one host read, when the bound would overrun the buffer
        if self.bound + count > self.room:
            self._allocate(max(self.room, self.bound + count + self.room // 4 + ROOM))
        size = self.base.base_size
        # a token's first read (a stable sort keeps repeats in reading order), not in yet
        order = tokens.argsort(stable=True)
        ranked = tokens[order]
        first = torch.empty(count, dtype=torch.bool, device=tokens.device)
        first[order] = torch.cat([ranked.new_ones(1, dtype=torch.bool), ranked[1:] != ranked[:-1]])
        new = first & ~self.member[tokens]
        rows = torch.where(new, size + self.count + new.cumsum(0) - 1, size + self.room)  # the others: the spare row
        weight, bias = self.base.target_rows
        with torch.no_grad():
            self.weight[rows] = weight[tokens]
            if self.packed is not None:
                write_packed_rows(self.packed, rows, weight[tokens])
            self.ids[rows] = tokens
            if bias is not None:
                self.bias[rows] = bias[tokens]
        self.member[tokens] = True
        self.count = self.count + new.sum()
        self.bound += count
        self.current = self.base.with_rows(self.weight, self.bias, self.ids)
        if self.packed is not None:
            packed, bias = self.packed, self.bias
            self.current.projection = lambda x: torch.ops.specheads.packed_linear(x, packed, bias)

    def _leave_inference_mode(self) -> None:
        """Copies of the state made inside generate() (inference tensors, which only inference mode may write)."""
        self.seen, self.member, self.count = self.seen.clone(), self.member.clone(), self.count.clone()
        self.weight, self.ids = self.weight.clone(), self.ids.clone()
        self.packed = None if self.packed is None else self.packed.clone()
        self.bias = None if self.bias is None else self.bias.clone()

    def _mask_unseen(self) -> None:
        """`unseen` [rows or 1, N]: the added rows not filled yet and, in a batch, those a row has not seen itself
        (another row's tokens), so that it drafts what it would alone; None when there are none."""
        size, width = self.base.base_size, self.current.weight.shape[0]
        if width == size:
            self.unseen = None
            return
        unfilled = torch.arange(width - size, device=self.count.device) >= self.count
        added = unfilled[None] | (~self.seen[:, self.current.ids[size:]] if self.shared else False)
        self.unseen = torch.zeros(added.shape[0], width, dtype=torch.bool, device=added.device)
        self.unseen[:, size:] = added

    def read_texts(self, texts: list[torch.Tensor]) -> DraftVocabulary:
        """Take in what each row committed since the last call (texts[b]: row b's whole committed text) and
        return the vocabulary to draft from now."""
        if not self.enabled:
            return self.current
        if self.seen.is_inference() and not torch.is_inference_mode_enabled():
            self._leave_inference_mode()
        fresh = [text[start:] for text, start in zip(texts, self.read)]
        for row, tokens in enumerate(fresh):
            self.seen[row, tokens] = True
        self.read = [text.shape[0] for text in texts]
        self._add(torch.cat(fresh))
        self._mask_unseen()
        return self.current

    def add_rows(self, count: int) -> None:
        """`count` new rows, that have seen nothing yet. The vocabulary is rebuilt from the rows still drafting,
        so a batch that admits prompts as others finish does not grow it with every finished row's tokens."""
        self.read += [0] * count
        self.shared = len(self.read) > 1
        if self.enabled:
            self.seen = torch.cat([self.seen, self.seen.new_zeros(count, self.seen.shape[1])])
            self._empty(self.room)
            self._add(self.seen.any(dim=0).nonzero()[:, 0])  # a host read a joining row, not a step
            self._mask_unseen()

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows go on (their order kept)."""
        self.read = [self.read[row] for row in rows]
        if self.enabled:
            self.seen = self.seen[rows]
            self._mask_unseen()

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of logits [rows, ..., N] over `current`, each row's unseen tokens impossible."""
        if self.unseen is not None:
            shape = (self.unseen.shape[0],) + (1,) * (logits.dim() - 2) + (self.unseen.shape[1],)
            logits = logits.masked_fill(self.unseen.view(shape), float("-inf"))
        return log_probabilities(logits)
