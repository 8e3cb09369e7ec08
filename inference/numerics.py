"""When may a bfloat16 run differ from another and still be exact? Only at a near-tie of the target itself.

A bf16 pass over several tokens does not round like one-token passes, so two valid greedy decodings can
part where the target's top logits are within a few rounding steps of each other. `near_tie` proves (or refutes)
that for one divergence by teacher-forcing the shared prefix.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

NEAR_TIE_STEPS = 3  # rounding steps of the model's dtype within which two top logits count as tied


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers around `value` (bfloat16: 8 significant bits, a step of 0.125 at 20)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(value), torch.finfo(dtype).tiny)))


@torch.inference_mode()
def near_tie(
    model,
    context: list[int],
    ours: int,
    theirs: int,
    steps: float = NEAR_TIE_STEPS,
    prompt_length: int | None = None,
) -> tuple[bool, float]:
    """(both tokens are within `steps` rounding steps of the target's top logit after `context`; the larger
    of their two distances from it, in steps).

    Within a few rounding steps of the top, either token is a valid greedy choice of a bf16 model: a pass
    that rounds differently may put either first. Measured against the top rather than against each other,
    so that a three-way tie (common in bf16) is a tie too.

    First in one pass over the whole context (teacher-forced). That pass rounds unlike the prefill and one-token
    steps that `generate()` took, by several steps at times: two tokens exactly tied in generate()'s own logits
    were 4 steps apart in it (SmolLM2-135M, bf16, 150 tokens). So when it finds no tie and `prompt_length` is
    given, the logits are computed again as generate() computes them, the first `prompt_length` tokens in one
    pass and the rest one at a time, and those decide.
    """
    ids = torch.tensor([context], device=model.device)
    tie, gap = _gap(model(ids).logits[0, -1], ours, theirs, steps)
    if tie or prompt_length is None or prompt_length >= len(context):
        return tie, gap
    cache = DynamicCache(config=model.config)
    logits = model(ids[:, :prompt_length], cache=cache, use_cache=True).logits
    for at in range(prompt_length, len(context)):
        logits = model(ids[:, at : at + 1], cache=cache, use_cache=True).logits
    return _gap(logits[0, -1], ours, theirs, steps)


def _gap(logits: torch.Tensor, ours: int, theirs: int, steps: float) -> tuple[bool, float]:
    step = rounding_step(float(logits.float().abs().max()), logits.dtype)
    logits = logits.float()
    top = float(logits.max())
    gap = max(top - float(logits[ours]), top - float(logits[theirs])) / step
    return gap <= steps, gap
