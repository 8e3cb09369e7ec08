"""When may a bfloat16 run differ from another and still be exact? Only at a near-tie of the target itself.

A bf16 pass over several tokens does not round like one-token passes, so two valid greedy decodings can
part where the target's top two logits are within a few rounding steps. `near_tie` proves (or refutes)
that for one divergence by teacher-forcing the shared prefix.
"""

from __future__ import annotations

import math

import torch

NEAR_TIE_STEPS = 3  # rounding steps of the model's dtype within which two top logits count as tied


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers around `value` (bfloat16: 8 significant bits, a step of 0.125 at 20)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(value), torch.finfo(dtype).tiny)))


@torch.inference_mode()
def near_tie(model, context: list[int], ours: int, theirs: int, steps: float = NEAR_TIE_STEPS) -> tuple[bool, float]:
    """(both tokens are the target's top two after `context`, within `steps` rounding steps; their gap in steps)."""
    logits = model(torch.tensor([context], device=model.device)).logits[0, -1]
    step = rounding_step(float(logits.float().abs().max()), logits.dtype)
    logits = logits.float()
    gap = abs(float(logits[ours] - logits[theirs])) / step
    return {ours, theirs} == set(logits.topk(2).indices.tolist()) and gap <= steps, gap
