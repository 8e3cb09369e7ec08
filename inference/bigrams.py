"""The EAGLE head's copy input at inference: committed bigrams kept on the host, draft nodes' copies on the device.

A head with `copy_input` reads, with each token, the token that followed the latest earlier occurrence of the
current bigram (heads.eagle.copy_tokens, which training runs on Python lists). The committed text is on the host
already (the decode loop reads each step's outcome back), so each row keeps its bigrams there (`RowBigrams`),
extended with each new token: its committed pairs' copy tokens come from it with no device work. The draft nodes'
copy tokens are worked out on the device, for every row of a batch at once, by binary searches in a table of the
rows' bigrams (`bigram_table`, copied to the device once a step): drafting reads nothing back, which on a GPU would
wait for the device at every draft level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from heads import NO_COPY, copy_tokens

from .transfer import to_device


class RowBigrams:
    """One row's committed bigrams on the host: the token after each bigram's latest occurrence (`successors`, as
    copy_tokens keeps them, with each bigram's key a * V + b and that token in arrays, a slot a bigram) and every
    pair's copy token (`copies[t]`: copy_tokens(text)[t]), extended as the text grows."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.ids: list[int] = []
        self.successors: dict[tuple[int, int], int] = {}
        self.copies: list[int] = []
        self.slots: dict[tuple[int, int], int] = {}
        self.keys = np.empty(64, dtype=np.int64)
        self.followers = np.empty(64, dtype=np.int64)

    def read(self, text: np.ndarray) -> None:
        """Take in the committed text (1-D, on the host; the tokens taken in before unchanged)."""
        start = len(self.copies)
        self.ids += text[len(self.ids) :].tolist()
        ids, end = self.ids, len(self.ids) - 1
        if end <= start:
            return
        self.copies += copy_tokens(ids, start, end, self.successors)
        for t in range(max(start, 1), end):  # the bigrams copy_tokens gave a successor to
            bigram = (ids[t - 1], ids[t])
            slot = self.slots.setdefault(bigram, len(self.slots))
            if slot == self.keys.shape[0]:
                self.keys = np.concatenate([self.keys, np.empty_like(self.keys)])
                self.followers = np.concatenate([self.followers, np.empty_like(self.followers)])
            self.keys[slot] = bigram[0] * self.vocab_size + bigram[1]
            self.followers[slot] = ids[t + 1]

    @property
    def tail(self) -> list[int]:
        """The last two committed tokens (-1 before a one-token text)."""
        return ([-1, -1] + self.ids[-2:])[-2:]


@dataclass(frozen=True)
class BigramTable:
    """Every row's committed bigrams on the device, sorted: keys[i] = row * V * V + first * V + second, ascending,
    after a first key of -1 (whose successor is NO_COPY: every search lands at or after it), successors[i] the
    token after that bigram's latest occurrence with a token after it. offsets [rows, 1]: row * V * V. tails
    [rows, 2]: each row's last two committed tokens (-1 before a one-token text)."""

    keys: torch.Tensor
    successors: torch.Tensor
    offsets: torch.Tensor
    tails: torch.Tensor
    vocab_size: int

    def lookup(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """The token that followed the latest committed (first, second) of each row ([rows, F] tokens), NO_COPY
        where none did."""
        keys = first * self.vocab_size + second + self.offsets
        index = torch.searchsorted(self.keys, keys, right=True) - 1
        return torch.where(self.keys[index] == keys, self.successors[index], NO_COPY)


def bigram_table(rows: list[RowBigrams], device: torch.device) -> BigramTable:
    """The rows' bigrams as one sorted table on `device` (row b's RowBigrams is rows[b])."""
    keys, successors = [np.full(1, -1)], [np.full(1, NO_COPY)]
    for row, bigrams in enumerate(rows):
        count = len(bigrams.slots)
        order = np.argsort(bigrams.keys[:count])
        keys.append(bigrams.keys[:count][order] + row * bigrams.vocab_size**2)
        successors.append(bigrams.followers[:count][order])
    vocab_size = rows[0].vocab_size
    tails = [bigrams.tail for bigrams in rows]
    return BigramTable(
        to_device(np.concatenate(keys), device),
        to_device(np.concatenate(successors), device),
        to_device([[row * vocab_size**2] for row in range(len(rows))], device),
        to_device(tails, device),
        vocab_size,
    )


def draft_copies(table: BigramTable, paths: torch.Tensor) -> torch.Tensor:
    """Copy tokens of draft nodes [rows, F]: each row's committed text continued by each node's path, read on top
    of the committed bigrams. paths [rows, F, d]: the tokens of each node's path below the root (the node's own
    last)."""
    rows, width, depth = paths.shape
    text = torch.cat([table.tails[:, None].expand(-1, width, -1), paths], dim=-1)  # [rows, F, d + 2]
    first, second = text[..., -2], text[..., -1]
    # bigrams the path itself completes: (text[j], text[j + 1]) followed by text[j + 2], the latest j wins
    inside = (text[..., :depth] == first[..., None]) & (text[..., 1 : depth + 1] == second[..., None])
    latest = (inside * torch.arange(1, depth + 1, device=paths.device)).argmax(dim=-1, keepdim=True)
    on_path = text[..., 2:].gather(-1, latest)[..., 0]
    return torch.where(inside.any(dim=-1), on_path, table.lookup(first, second))
