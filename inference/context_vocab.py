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

import math
import weakref

import numpy as np
import torch

from heads import DraftVocabulary

from .packed import pack_weight, packable_rows, quantizes_drafts
from .transfer import to_device

ROOM = 256  # added rows a vocabulary's buffer has room for at first (it grows by a quarter and this much)


class ContextVocabulary:
    """A drafter's vocabulary for the sequences it drafts for: `base` plus each row's tokens so far (when
    `enabled` and `base` can grow: a reduced vocabulary over the target's lm_head rows).

    Which tokens are new is worked out on the host, from the committed texts the decode loop already holds there
    (nothing is read back from the device: each read waits for a GPU), and most steps add nothing, so they cost no
    device work at all. The added tokens' rows are copied from the target's lm_head into a buffer after the base's,
    in the order they were first read. `current` spans the whole buffer, its rows past the count masked off
    (`unseen`): its projection keeps one shape until the buffer grows (oneDNN builds a kernel for each new shape,
    0.1-0.6 ms on a 2-core EPYC, against 15-20 us for the product itself).
    """

    def __init__(self, base: DraftVocabulary, enabled: bool = True):
        self.base, self.enabled = base, enabled and base.extensible
        if self.enabled:
            self.base_member = np.zeros(base.target_size, dtype=bool)  # on the host: the base's tokens
            self.base_member[base.ids.cpu().numpy()] = True
        self.reset()

    def reset(self, rows: int = 1) -> None:
        self.current, self.unseen = self.base, None
        self.read = [0] * rows  # how much of each row's text has been read
        self.shared = rows > 1  # one sequence alone has seen every token added for it
        self.seen = None
        if self.enabled:
            self.seen = np.zeros((rows, self.base.target_size), dtype=bool)  # on the host: the tokens each row read
            self._empty(ROOM)

    def _empty(self, room: int) -> None:
        """No token added yet; a buffer with room for `room`: the one kept with the base where it has that room and
        no other live vocabulary drafts from it (packing a buffer takes milliseconds, as much as a few steps'
        drafting). What earlier sequences wrote there needs no clearing: rows past the count are masked off. Where
        the buffer is packed, the vocabulary spans it from the start: no product of the base's rows alone."""
        self.member = self.base_member.copy()  # on the host: the tokens in the vocabulary
        self.added = np.zeros(0, dtype=np.int64)  # on the host: the added tokens, in the order they joined
        kept = self.base.kept_buffers  # [the rooms they serve, the buffers, their user]
        if kept is None or room not in kept[0]:
            self.weight = None
            self._allocate(room)
            kept = self.base.kept_buffers = [
                {room, self.room},
                (self.weight, self.bias, self.ids, self.packed, self.room),
            ]
            kept.append(None)
        self.weight, self.bias, self.ids, self.packed, self.room = kept[1]
        user = None if kept[2] is None else kept[2]()
        if user is not None and user is not self:  # another sequence drafts from them now: copies of its own
            self._copy_buffers()
        else:
            kept[2] = weakref.ref(self)
        self.current = self.base if self.packed is None else self._spanning()

    def _spanning(self) -> DraftVocabulary:
        """The vocabulary over the whole buffer, through its packed product where there is one."""
        current = self.base.with_rows(self.weight, self.bias, self.ids)
        if self.packed is not None:
            packed, bias = self.packed, self.bias
            current.projection = lambda x: packed(x, bias)
        return current

    @property
    def count(self) -> int:
        """How many tokens were added."""
        return self.added.shape[0]

    def _allocate(self, room: int) -> None:
        """A buffer for the base's rows, `room` added ones (the added rows so far copied) and a spare one. Where our
        packed kernel serves it, the room is rounded up to fill its groups of 64 rows, and the buffer is kept packed
        too (`packed`), its rows written as they are added: the whole vocabulary is then one product, no added rows
        through a kernel of their own (docs/experiments.md, row X16)."""
        size, old = self.base.base_size, self.weight
        rows = packable_rows(size + room + 1, self.base.weight)
        room = room if rows is None else rows - size - 1
        weight = self.base.weight.new_zeros(size + room + 1, self.base.weight.shape[1])
        ids = self.base.ids.new_zeros(size + room + 1)
        bias = None if self.base.bias is None else self.base.bias.new_zeros(size + room + 1)
        with torch.no_grad():  # the target's rows: constants to a drafter
            kept = size + self.count if old is not None else size
            weight[:kept] = self.base.weight if old is None else old[:kept]
            ids[:kept] = self.base.ids if old is None else self.ids[:kept]
            if bias is not None:
                bias[:kept] = self.base.bias if old is None else self.bias[:kept]
        self.weight, self.bias, self.ids, self.room = weight, bias, ids, room
        self.packed = None if rows is None else pack_weight(weight, quantizes_drafts(weight))

    def _add(self, tokens: np.ndarray) -> None:
        """Append the rows of `tokens` (distinct, in the order they were read) not in the vocabulary yet."""
        tokens = tokens[~self.member[tokens]]
        count = tokens.shape[0]
        if count == 0:
            return
        if self.count + count > self.room:
            self._allocate(max(self.room, self.count + count + self.room // 4 + ROOM))
        device = self.weight.device
        rows = to_device(np.arange(self.count, self.count + count) + self.base.base_size, device)
        new = to_device(tokens, device)
        weight, bias = self.base.target_rows
        with torch.no_grad():
            self.weight[rows] = weight[new]
            if self.packed is not None:
                self.packed.write_rows(rows, weight[new])
            self.ids[rows] = new
            if bias is not None:
                self.bias[rows] = bias[new]
        self.member[tokens] = True
        self.added = np.concatenate([self.added, tokens])
        self.current = self._spanning()

    def _copy_buffers(self) -> None:
        """Buffers of its own, copied from the ones it has."""
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
        unseen = np.zeros((self.seen.shape[0] if self.shared else 1, width), dtype=bool)
        unseen[:, size + self.count :] = True
        if self.shared:
            unseen[:, size : size + self.count] = ~self.seen[:, self.added]
        self.unseen = to_device(unseen, self.weight.device, torch.bool)
        # added to the logits in float32 (top)
        self.unseen_logits = torch.zeros(unseen.shape, device=self.weight.device).masked_fill_(self.unseen, -math.inf)

    def read_texts(self, texts: list[torch.Tensor], host_texts: list[np.ndarray] | None = None) -> DraftVocabulary:
        """Take in what each row committed since the last call (texts[b]: row b's whole committed text, host_texts[b]
        the same on the host, read back here when not given) and return the vocabulary to draft from now."""
        if not self.enabled:
            return self.current
        if self.weight.is_inference() and not torch.is_inference_mode_enabled():
            # buffers made inside generate() are inference tensors, which only inference mode may write
            self.base.kept_buffers = None
            self._copy_buffers()
        if host_texts is None:  # outside the loop: read the texts back
            host_texts = [text.cpu().numpy() for text in texts]
        fresh = [host[start:] for host, start in zip(host_texts, self.read)]
        self.read = [host.shape[0] for host in host_texts]
        for row, tokens in enumerate(fresh):
            self.seen[row, tokens] = True
        tokens = np.concatenate(fresh)
        distinct, first = np.unique(tokens, return_index=True)
        before, width = self.count, self.current.weight.shape[0]
        self._add(distinct[np.argsort(first)])  # in the order they were first read
        if self.shared or self.count != before or self.current.weight.shape[0] != width or self.unseen is None:
            self._mask_unseen()
        return self.current

    def add_rows(self, count: int) -> None:
        """`count` new rows, that have seen nothing yet. The vocabulary is rebuilt from the rows still drafting,
        so a batch that admits prompts as others finish does not grow it with every finished row's tokens."""
        self.read += [0] * count
        self.shared = len(self.read) > 1
        if self.enabled:
            self.seen = np.concatenate([self.seen, np.zeros((count, self.seen.shape[1]), dtype=bool)])
            self._empty(self.room)
            self._add(np.flatnonzero(self.seen.any(axis=0)))
            self._mask_unseen()

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows go on (their order kept)."""
        self.read = [self.read[row] for row in rows]
        if self.enabled:
            self.seen = self.seen[rows]
            self._mask_unseen()

    def top(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest tokens of logits [rows, ..., N] over `current`, each row's unseen tokens impossible: their
        log-probabilities in float32 (-inf for a NaN one: non-finite weights) and their indices."""
        if self.unseen is None:
            logits = logits.float()
        else:  # added in float32: the mask and the cast in one operation
            shape = (self.unseen.shape[0],) + (1,) * (logits.dim() - 2) + (self.unseen.shape[1],)
            logits = logits + self.unseen_logits.view(shape)
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        return top.values.nan_to_num_(nan=-math.inf), top.indices
