"""The heads' draft passes compiled like the target's (inference.compiled): an EAGLE head's (`HeadPass`) and the
early-exit draft's (`ExitPass`), over the committed tokens and each draft level. A drafter calls `compiled_head`,
which gives the compiled passes when the target's are compiled, else the head itself."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from heads import EagleHead, EarlyExitHead
from heads.eagle import causal_mask

from .compiled import (
    EXAMPLE_CACHED,
    EXAMPLE_ROWS,
    EXAMPLE_TOKENS,
    PASSES,
    ROWS,
    CompiledPasses,
    _cache_shapes,
    _export,
    _stored_cache,
    is_compiled,
    package_key,
    warm_up_passes,
)
from .packed import packed_linear
from .target import cache_root


class HeadPass(torch.nn.Module):
    """An EAGLE head's pass with its cache as plain tensors (as DecodingPass, which writes the new entries into the
    stores): (feature [rows, T, H], the next tokens' embeddings, positions, the additive mask, key/value stores[,
    copy embeddings]) -> (its outputs [rows, T, H],)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(
        self, feature, token_embedding, position_ids, attention_mask, key_stores, value_stores, copy_embedding=None
    ):
        cache = _stored_cache(key_stores, value_stores, attention_mask.shape[-1] - feature.shape[1])
        out = self.head(
            feature,
            token_embedding,
            copy_embedding,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
        )
        return (out,)


class CompiledHead(CompiledPasses):
    """Calls an EAGLE head like the head itself, through a compiled package: its passes over the committed tokens
    and over each draft level (a 2 ms eager pass of one decoder layer, mostly overhead between small kernels)."""

    what, takes = "the EAGLE head's pass", "about 15 s"
    narrow_passes = False  # one layer's weights: the CPU's caches hold them
    split_passes = False
    fuse = None  # the head's feature fusion, its weight packed (inference.packed) at its first use

    def __call__(self, feature, token_embedding, copy_embedding=None, *, position_ids, attention_mask=None, cache=None):
        head = self.module
        if feature.shape[-1] != head.config.hidden_size:  # the package takes the fused feature
            if self.fuse is None and head.fuse is not None:
                self.fuse = packed_linear(head.fuse.weight, head.fuse.bias)
            feature = head.fuse_features(feature, self.fuse)
        past = cache.get_seq_length() if cache is not None else 0
        if past == 0 or not self.ready():  # a prompt's first read (one a sequence) runs eagerly
            return head(
                feature,
                token_embedding,
                copy_embedding,
                position_ids=position_ids,
                attention_mask=attention_mask,
                cache=cache,
            )
        rows, new = feature.shape[:2]
        if attention_mask is None:  # the rows aligned: causal
            attention_mask = causal_mask(new, past, feature.dtype, feature.device).expand(rows, -1, -1, -1)
        extra = [copy_embedding] if copy_embedding is not None else []
        return self._run_with_cache(cache, [feature, token_embedding, position_ids, attention_mask], extra)[0]

    def package_path(self) -> Path:
        head = self.module
        config = json.dumps(dataclasses.asdict(head.config), sort_keys=True)
        dtype = str(next(head.parameters()).dtype).removeprefix("torch.")
        return cache_root() / "compiled" / f"eagle-head-{dtype}-{package_key(head, config)}.pt2"

    def export(self):
        head = self.module
        weight = next(head.parameters())
        dtype, device, hidden = weight.dtype, weight.device, head.config.hidden_size
        one = torch.zeros(1, 1, hidden, dtype=dtype, device=device)  # a one-token pass shows the cache's shapes
        position = torch.zeros(1, 1, dtype=torch.long, device=device)
        copy = one if head.config.copy_input else None
        shapes = _cache_shapes(lambda cache: head(one, one, copy, position_ids=position, cache=cache))
        rows, tokens, cached = EXAMPLE_ROWS, EXAMPLE_TOKENS, EXAMPLE_CACHED
        inputs = torch.zeros(rows, tokens, hidden, dtype=dtype, device=device)
        example = (
            inputs,
            inputs.clone(),
            (torch.arange(tokens, device=device) + cached).expand(rows, -1).contiguous(),
            torch.zeros(rows, 1, tokens, cached + tokens, dtype=dtype, device=device),
        )
        auto = torch.export.Dim.AUTO
        dynamic = ({0: ROWS, 1: auto}, {0: ROWS, 1: auto}, {0: ROWS, 1: auto}, {0: ROWS, 2: auto, 3: auto})
        extra = ((inputs.clone(),), ({0: ROWS, 1: auto},)) if head.config.copy_input else ((), ())
        return _export(HeadPass(head), example, dynamic, shapes, dtype, device, *extra)


class ExitPass(torch.nn.Module):
    """The early-exit draft's pass (the target's first layers with their adapter) with its cache as plain tensors (as
    DecodingPass, which writes the new entries into the stores): (token ids, positions, the additive mask, key/value
    stores) -> (the exit's normed hidden states [rows, T, H],)."""

    def __init__(self, head):
        super().__init__()
        self.draft = head.draft  # registered here: the head keeps it outside its own module tree

    def forward(self, input_ids, position_ids, attention_mask, key_stores, value_stores):
        cache = _stored_cache(key_stores, value_stores, attention_mask.shape[-1] - input_ids.shape[1])
        out = self.draft.base_model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        )
        return (out.last_hidden_state,)


class CompiledEarlyExit(CompiledPasses):
    """Calls an early-exit head like the head itself, through a compiled package: its passes over the committed
    tokens and over each draft level. Eager, its layers would cost what the target's eager layers do, while the
    target's own pass runs compiled in about two thirds of that."""

    what, takes = "the early-exit draft's pass", "under a minute"
    narrow_passes = False
    split_passes = False  # a few layers: compiled beside the target's

    def __call__(self, input_ids, *, position_ids, attention_mask=None, cache=None):
        head = self.module
        past = cache.get_seq_length() if cache is not None else 0
        if past == 0 or not self.ready():  # a prompt's first read (one a sequence) runs eagerly
            return head(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache)
        rows, new = input_ids.shape
        dtype = head.draft.dtype
        if attention_mask is None:  # the rows aligned: causal
            attention_mask = causal_mask(new, past, dtype, input_ids.device).expand(rows, -1, -1, -1)
        return self._run_with_cache(cache, [input_ids, position_ids, attention_mask])[0]

    def package_path(self) -> Path:
        head = self.module
        config = json.dumps(dataclasses.asdict(head.config), sort_keys=True) + head.draft.config.to_json_string()
        dtype = str(head.draft.dtype).removeprefix("torch.")
        return cache_root() / "compiled" / f"early-exit-{dtype}-{package_key(head.draft, config)}.pt2"

    def export(self):
        head = self.module
        dtype, device = head.draft.dtype, head.draft.device
        one = torch.zeros(1, 1, dtype=torch.long, device=device)  # a one-token pass shows the cache's shapes
        shapes = _cache_shapes(lambda cache: head(one, position_ids=one, cache=cache))
        rows, tokens, cached = EXAMPLE_ROWS, EXAMPLE_TOKENS, EXAMPLE_CACHED
        example = (
            torch.zeros(rows, tokens, dtype=torch.long, device=device),
            (torch.arange(tokens, device=device) + cached).expand(rows, -1).contiguous(),
            torch.zeros(rows, 1, tokens, cached + tokens, dtype=dtype, device=device),
        )
        auto = torch.export.Dim.AUTO
        dynamic = ({0: ROWS, 1: auto}, {0: ROWS, 1: auto}, {0: ROWS, 2: auto, 3: auto})
        return _export(ExitPass(head), example, dynamic, shapes, dtype, device)


def compiled_head(head, model, passes: type[CompiledPasses] = CompiledHead):
    """What a drafter calls to run `head` (an EAGLE head; an early-exit head with passes=CompiledEarlyExit): its
    compiled passes when `model`'s are compiled, else the head."""
    if not is_compiled(model):
        return head
    if not hasattr(head, PASSES):
        setattr(head, PASSES, passes(head))
    return getattr(head, PASSES)


def head_passes(heads, model) -> list[CompiledPasses]:
    """The compiled passes of the heads among `heads` (as generate() takes them: a head, a drafter, or a list) that
    draft through passes of their own: EAGLE heads and early exits. Empty unless `model`'s passes are compiled."""
    if not is_compiled(model):
        return []
    found = []
    for head in heads if isinstance(heads, (list, tuple)) else [heads]:
        if isinstance(head, EagleHead):
            found.append(compiled_head(head, model))
        elif isinstance(head, EarlyExitHead):
            found.append(compiled_head(head, model, CompiledEarlyExit))
        elif isinstance(getattr(head, "run_head", None), CompiledPasses):  # a drafter built on one
            found.append(head.run_head)
    return found


def warm_up(model, heads=None, *, verbose: bool = True, wait: bool = False) -> float:
    """Compile `model`'s decoding pass and the passes of `heads` (as generate() takes them) now, or load them from
    disk, with a progress line on stderr when they compile; returns the seconds spent. generate() calls it first,
    so that no call spends minutes compiling without saying so, nor stops to compile after its first token. On a
    CPU the package for passes of a few tokens may still be compiling in the background when it returns (the calls
    after it lands take it up); `wait=True` waits for it, as a benchmark must. A model not registered by
    compile_target is left alone."""
    return warm_up_passes(model, head_passes(heads, model), verbose=verbose, wait=wait)
