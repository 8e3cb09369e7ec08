"""Grouped-query attention over a 4D mask without copying the keys and values.

With a custom mask, transformers' SDPA attention repeats each key/value head for every query head it serves
(`repeat_kv`) before calling the kernel; only a single query token is spared the copy. A tree verification
pass has many query tokens and always a mask, so it copied the whole cache on every layer of every pass.
Here the query heads sharing a key/value head are folded into the query axis instead ([B, H, q, d] ->
[B, H_kv, groups * q, d], the mask tiled to match): the same products, without the copy (faster
attention wherever query heads share key/value heads).

Where inference.kernels has built its kernels (`use_decode_kernel`: bfloat16 on a CPU with AVX512-BF16),
the folded attention runs through that kernel, which reads a long cache several times faster than ATen's.

It is registered with transformers' `AttentionInterface` under GROUPED_SDPA (with "sdpa"'s mask function), the
library's extension point for attention kernels; `grouped_attention(model)` switches an "sdpa" model to it while
any call is inside the block (the first switches, the last restores: calls from several threads overlap), and the
EAGLE head's decoder uses it always. The switch is the model's: another thread calling the model directly meanwhile
runs through it too, which computes the same attention.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

GROUPED_SDPA = "specheads_grouped_sdpa"
_decode_kernel = None  # (folded query, key, value, mask, scale) -> folded output; use_decode_kernel sets it


def use_decode_kernel(kernel) -> None:
    """Run the folded attention through `kernel` from now on: inference.kernels' attention op, which takes the
    query [B, H_kv, groups * q, d], the keys and values [B, H_kv, L, d], the unrepeated mask [B, 1, q, L] and the
    scale, and returns the folded output."""
    global _decode_kernel
    _decode_kernel = kernel


def grouped_sdpa_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' sdpa_attention_forward, with the query heads of a group folded into the query axis when
    several query tokens share a mask across heads; anything else goes to transformers' own function."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, length, dim = query.shape
    shared_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    special = (
        kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    )  # transformers' function handles these
    plain = not shared_mask or dropout or special
    # the kernel computes no gradients: training (a head's decoder layer) goes through SDPA
    differentiating = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    # bfloat16 only, as the kernel computes it: a float32 pass traced through the op would need it loaded to run
    takes_kernel = query.device.type == "cpu" and query.dtype == torch.bfloat16 and not differentiating
    if _decode_kernel is not None and not plain and takes_kernel:
        folded = query.reshape(batch, heads // groups, groups * length, dim)
        out = _decode_kernel(folded, key, value, attention_mask, dim**-0.5 if scaling is None else scaling)
        return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None
    if groups == 1 or length == 1 or plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # query head h reads key/value head h // groups (repeat_kv's order), so the heads of one group are adjacent
    folded = query.reshape(batch, heads // groups, groups * length, dim)
    mask = attention_mask.repeat(1, 1, groups, 1)  # row g * length + i of the folded query is token i
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
# masks are built as for "sdpa" (an implementation without a mask function gets none: causal only without a cache)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


_SWITCH_LOCK = threading.Lock()
_CALLS_INSIDE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> calls inside grouped_attention


@contextmanager
def grouped_attention(model):
    """Run `model` with grouped_sdpa_attention inside the block when it uses "sdpa" (restored when the last call
    inside leaves, also on an error); any other attention implementation is left as it is."""
    with _SWITCH_LOCK:
        switched = model in _CALLS_INSIDE or getattr(model.config, "_attn_implementation", None) == "sdpa"
        if switched:
            if model not in _CALLS_INSIDE:
                model.set_attn_implementation(GROUPED_SDPA)
            _CALLS_INSIDE[model] = _CALLS_INSIDE.get(model, 0) + 1
    try:
        yield model
    finally:
        if switched:
            with _SWITCH_LOCK:
                _CALLS_INSIDE[model] -= 1
                if not _CALLS_INSIDE[model]:
                    del _CALLS_INSIDE[model]
                    model.set_attn_implementation("sdpa")
