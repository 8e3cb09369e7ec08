"""Linear layers run eagerly beside the compiled passes, their weights packed once for the CPU's matrix kernels.

The drafters' few eager projections (a head's draft vocabulary, an EAGLE head's feature fusion) run every draft
level. Through `F.linear` a weight is handed to the kernels as it is, every call; packed once into oneDNN's blocked
layout (what inductor does to a compiled graph's frozen weights), the same products take a fraction of the time,
bfloat16 identical without a bias, float32 equal up to the order of the sums (docs/experiments.md, row X2). Where the
compiled passes take our packed kernel (inference.kernels: bfloat16, AVX512-BF16, no AMX), these take it too: it
reads a few rows' weights faster still (row X14).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels


def packs(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed for the CPU's oneDNN kernels here (bfloat16 only where the CPU computes it)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


# Drafts' weights (a head's layers, its draft vocabulary, the early-exit draft's layers; never the target's passes) as
# int8 with a scale an output, where our packed kernel serves them: a draft level reads its weights back from memory
# after every target pass, and int8 halves what it reads (docs/experiments.md, row X21). Drafts only propose: the
# target verifies every token, so the output does not change.
DRAFT_WEIGHTS_INT8 = True


@dataclass
class PackedWeight:
    """A weight packed by `specheads::pack_linear_weight`: bfloat16, or int8 with each output's scale (float32)."""

    packed: torch.Tensor
    scales: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.specheads.packed_linear(x, self.packed, bias, self.scales)

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Set rows `rows` of the weight to values [n, K], in place: row r is column r % 16 of block r % 64 // 16 of
        group r // 64, its inputs in pairs."""
        if self.scales is not None:
            values, self.scales[rows] = torch.ops.specheads.quantize_int8(values)
        self.packed[rows // 64, :, rows % 64 // 16, rows % 16] = values.view(values.shape[0], -1, 2)

    def clone(self) -> PackedWeight:
        return PackedWeight(self.packed.clone(), None if self.scales is None else self.scales.clone())


def quantizes_drafts(weight: torch.Tensor) -> bool:
    """Whether a draft's weight like `weight` is packed in int8 (DRAFT_WEIGHTS_INT8, where our kernel packs it)."""
    return DRAFT_WEIGHTS_INT8 and kernels.packs_products(weight.device, weight.dtype)


def pack_weight(weight: torch.Tensor, int8: bool = False) -> PackedWeight:
    """`weight` [N, K] packed by our kernel (kernels.fits_packed, kernels.load), in int8 where `int8`."""
    if not int8:
        return PackedWeight(torch.ops.specheads.pack_linear_weight(weight))
    values, scales = torch.ops.specheads.quantize_int8(weight)  # [N, K] int8, each output's scale
    return PackedWeight(torch.ops.specheads.pack_linear_weight(values), scales)


def packed_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, draft: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`x -> F.linear(x, weight, bias)` over the weight as it is now, packed where the CPU allows (else F.linear); a
    `draft`'s weight in int8 where quantizes_drafts says so."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if not packs(weight):
        return lambda x: F.linear(x, weight, bias)
    fits = kernels.fits_packed(*weight.shape)
    if fits and kernels.packs_products(weight.device, weight.dtype) and kernels.load():  # says so if it builds
        ours = pack_weight(weight, draft and quantizes_drafts(weight))
        return lambda x: ours(x, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packable_rows(count: int, like: torch.Tensor) -> int | None:
    """For a weight of `count` rows shaped and typed as `like` [N, K]: the row count our packed kernel takes it in
    (its outputs come in groups of 64), or None where the kernel does not serve such a weight."""
    rows = -(-count // 64) * 64
    if like.device.type != "cpu" or not kernels.packs_products(like.device, like.dtype):
        return None
    return rows if kernels.fits_packed(rows, like.shape[1]) and kernels.load() else None
