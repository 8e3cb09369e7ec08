"""The EAGLE head's copy input at inference, on the device.

A head with `copy_input` reads, with each token, the token that followed the latest earlier occurrence of the
current bigram (heads.eagle.copy_tokens, which training runs on Python lists). At inference the same tokens are
worked out here for every row of a batch at once with tensor operations (one sort of the committed bigrams a
step, then binary searches), so that drafting reads nothing back to the host: on a GPU every such read waits
for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heads import NO_COPY

from .transfer import to_device


@dataclass(frozen=True)
class BigramTable:
    """Every row's committed bigrams, sorted, with what followed each.

    keys[i]: a bigram's key (row * V + first) * V + second, ascending; one entry an occurrence, in text order.
    successors[i]: the token that followed keys[i]'s bigram there, or, for a row's last bigram (nothing after it
    yet), at its occurrence before (NO_COPY if none). A lookup reads a key's last entry: its latest occurrence.
    copies[b][t]: row b's copy token of pair t, copy_tokens(texts[b])[t].
    """

    keys: torch.Tensor
    successors: torch.Tensor
    copies: list[torch.Tensor]
    vocab_size: int

    def lookup(self, rows: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """The token that followed the latest committed (first, second) of each row, NO_COPY where none did."""
        keys = (rows * self.vocab_size + first) * self.vocab_size + second
        if self.keys.shape[0] == 0:
            return torch.full_like(keys, NO_COPY)
        index = torch.searchsorted(self.keys, keys.contiguous(), right=True) - 1  # each key's latest occurrence
        clamped = index.clamp(min=0)
        found = (index >= 0) & (self.keys[clamped] == keys)
        return torch.where(found, self.successors[clamped], NO_COPY)


def bigram_table(texts: list[torch.Tensor], vocab_size: int) -> BigramTable:
    """The BigramTable of committed texts (texts[b]: row b's token ids, 1-D, on one device)."""
    device, lengths = texts[0].device, [text.shape[0] for text in texts]
    ids = torch.cat(texts)
    total = ids.shape[0]
    if total < 2:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return BigramTable(empty, empty, [empty for _ in texts], vocab_size)
    row = torch.repeat_interleave(
        torch.arange(len(texts), device=device), to_device(lengths, device), output_size=total
    )
    within = row[:-1] == row[1:]  # position s starts a bigram of one row
    start = torch.arange(total - 1, device=device)
    # a pair of positions across two rows gets a negative key of its own: it never matches anything
    keys = torch.where(within, (row[:-1] * vocab_size + ids[:-1]) * vocab_size + ids[1:], -1 - start)
    order = keys.argsort(stable=True)  # equal keys stay in text order
    ordered = keys[order]
    previous = torch.full_like(start, -1)  # the latest earlier occurrence of each position's bigram
    previous[order[1:]] = torch.where(ordered[1:] == ordered[:-1], order[:-1], -1)

    def token_after(position: torch.Tensor) -> torch.Tensor:
        """ids[position + 2] where that is still the bigram's row, NO_COPY elsewhere (and for position -1)."""
        after = (position + 2).clamp(max=total - 1)
        has = (position >= 0) & (position + 2 < total) & (row[after] == row[position.clamp(min=0)])
        return torch.where(has, ids[after], NO_COPY)

    copies = token_after(previous)
    # a row's last bigram has no token after it yet: there, the one before it counts
    latest = token_after(order)
    successors = torch.where(latest != NO_COPY, latest, token_after(previous[order]))
    offsets = [sum(lengths[:b]) for b in range(len(texts))]
    return BigramTable(
        ordered,
        successors,
        [copies[offset : offset + max(length - 1, 0)] for offset, length in zip(offsets, lengths)],
        vocab_size,
    )


def draft_copies(table: BigramTable, tails: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """Copy tokens of draft nodes [rows, F]: each row's committed text continued by each node's path, read on top
    of the committed bigrams.

    tails [rows, 2]: each row's last two committed tokens (the root last; -1 before a one-token text);
    paths [rows, F, d]: the tokens of each node's path below the root (the node's own last).
    """
    rows, width, depth = paths.shape
    text = torch.cat([tails[:, None].expand(-1, width, -1), paths], dim=-1)  # [rows, F, d + 2]
    first, second = text[..., -2], text[..., -1]
    # bigrams the path itself completes: (text[j], text[j + 1]) followed by text[j + 2], the latest j wins
    inside = (text[..., :depth] == first[..., None]) & (text[..., 1 : depth + 1] == second[..., None])
    latest = (inside * torch.arange(1, depth + 1, device=paths.device)).argmax(dim=-1, keepdim=True)
    on_path = text[..., 2:].gather(-1, latest)[..., 0]
    row_ids = torch.arange(rows, device=paths.device)[:, None].expand(-1, width)
    return torch.where(inside.any(dim=-1), on_path, table.lookup(row_ids, first, second))
