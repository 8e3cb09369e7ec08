"""A prompt prefix computed once: the target's cache entries and the drafter's hidden states for the tokens that
prompts share (a chat template's system prompt), so that each prompt's prefill computes only what follows them.
vLLM and SGLang keep every block of every prompt for that; the loop keeps one prefix, the longest its prompts share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_PREFIX = 16  # tokens: prompts sharing fewer are prefilled whole (a shorter prefix saves less than it costs)


@dataclass
class Prefix:
    tokens: torch.Tensor  # [L]
    keys: list[torch.Tensor]  # each layer's cache entries for the tokens, [1, heads, L, dim]
    values: list[torch.Tensor]
    hidden: dict[int, torch.Tensor]  # the drafter's layers' hidden states for the tokens, [L, H]

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    def starts(self, prompt: torch.Tensor) -> bool:
        """Whether `prompt` begins with the prefix and goes on past it."""
        return prompt.shape[0] > self.length and torch.equal(prompt[: self.length], self.tokens)

    def fill(self, cache, rows: int) -> None:
        """Write the prefix into an empty cache, as each of `rows` rows' first entries."""
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer)

    def mask(self, suffix_mask: torch.Tensor) -> torch.Tensor:
        """The additive mask [B, 1, S, L + S] of a pass over the rows' tokens after the prefix: each sees the whole
        prefix, then what `suffix_mask` [B, 1, S, S] allows it of the tokens after it."""
        rows, _, new, _ = suffix_mask.shape
        return torch.cat([suffix_mask.new_zeros(rows, 1, new, self.length), suffix_mask], dim=-1)


def shared_length(prompts: list[torch.Tensor]) -> int:
    """How many first tokens all `prompts` (two or more) have in common."""
    shortest = min(prompt.shape[0] for prompt in prompts)
    same = torch.stack([prompt[:shortest] for prompt in prompts]) == prompts[0][:shortest]
    differs = (~same.all(dim=0)).nonzero()
    return shortest if differs.numel() == 0 else int(differs[0, 0])
