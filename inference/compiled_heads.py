"""The heads' draft passes compiled like the target's (inference.compiled): an EAGLE head's (`HeadPass`) and the
early-exit draft's (`ExitPass`, both in inference.passes), over the committed tokens (a prompt's first read too) and
each draft level; Medusa-1 heads' one pass (`MedusaPass`). A drafter calls `compiled_head`, which gives the compiled
passes when the target's are compiled, else the head itself."""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from heads import EagleHead, EarlyExitHead, MedusaHeads
from heads.eagle import causal_mask

from . import packed
from .compiled import COMPILED_PREFILL_TOKENS, PASSES, CompiledPasses, is_compiled, template_serves_every_pass
from .packed import packed_linear
from .passes import (
    exit_cache_shapes,
    export_exit_pass,
    export_fuse_pass,
    export_head_pass,
    export_medusa_pass,
    head_cache_shapes,
)
from .store import weights_digest


def draft_weights() -> str:
    """Part of a head's package key: whether its weights were packed in int8 (inference.packed.DRAFT_WEIGHTS_INT8)."""
    return "int8 draft weights" if packed.DRAFT_WEIGHTS_INT8 else "draft weights as they are"


class HeadPasses(CompiledPasses):
    """A head's passes (a subclass says its `dtype`): through inductor's GEMM template only where that serves every
    pass (bfloat16 with AMX, where it also makes a draft level cheaper), else oneDNN's products alone: one package."""

    @property
    def gemm_template(self) -> bool:
        return template_serves_every_pass(self.dtype)

    def compiles(self, new: int, cache) -> bool:
        """Whether a pass of `new` tokens over `cache` runs through the package: every pass with a cache, a prompt's
        first read (its cache empty) of at most COMPILED_PREFILL_TOKENS (its mask would hold its length squared), as
        the target's prefill."""
        if cache is None or (new > COMPILED_PREFILL_TOKENS and cache.get_seq_length() == 0):
            return False
        return self.ready()


class OwnWeightsPasses(HeadPasses):
    """Packages made from heads with weights of their own (an EAGLE head, Medusa heads): keyed by their config and
    weights."""

    def key_parts(self) -> list:
        head = self.module
        return [json.dumps(dataclasses.asdict(head.config), sort_keys=True), weights_digest(head), draft_weights()]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype


class CompiledHead(OwnWeightsPasses):
    """Calls an EAGLE head like the head itself, through a compiled package: its passes over the committed tokens
    and over each draft level (eager, one decoder layer's pass is mostly overhead between small kernels); an
    EAGLE-3 head's feature fusion through a package of its own (`CompiledFusion`)."""

    what = "the EAGLE head's pass"

    def __init__(self, module):
        super().__init__(module)
        self.fusion = CompiledFusion(module) if module.fuse is not None else None

    def ready(self, verbose: bool = True, recheck: bool = False) -> bool:
        ready = super().ready(verbose, recheck)
        if ready and self.fusion is not None:
            self.fusion.ready(verbose, recheck)  # where it does not compile, the fusion runs eagerly
        return ready

    def __call__(self, feature, token_embedding, copy_embedding=None, *, position_ids, attention_mask=None, cache=None):
        head = self.module
        if self.fusion is not None and feature.shape[-1] != head.config.hidden_size:  # the package takes it fused
            feature = self.fusion(feature)
        if not self.compiles(feature.shape[1], cache):
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
            past = cache.get_seq_length()
            attention_mask = causal_mask(new, past, feature.dtype, feature.device).expand(rows, -1, -1, -1)
        extra = [copy_embedding] if copy_embedding is not None else []
        return self._run_with_cache(cache, [feature, token_embedding, position_ids, attention_mask], extra)[0]

    def name(self) -> str:
        return f"eagle-head-{str(self.dtype).removeprefix('torch.')}"

    def layer_shapes(self) -> list[tuple[int, int]]:
        return head_cache_shapes(self.module)

    def export(self):
        return export_head_pass(self.module)


class CompiledFusion(OwnWeightsPasses):
    """An EAGLE-3 head's feature fusion through a package: the target's hidden states at its feature layers
    [rows, T, n * H] -> the head's input feature [rows, T, H]; eagerly (its weight packed: inference.packed) where
    the package is not had. Its norms, concatenation and product cost 0.4 ms a step eagerly after a target pass has
    streamed the weights out of the caches (docs/experiments.md, row X23)."""

    what = "the EAGLE head's feature fusion"

    def __init__(self, module):
        super().__init__(module)
        self.eager = None  # the fusion with its weight packed, at its first eager use

    def __call__(self, features):
        if self.ready():
            return self.runner(features.contiguous(), [], [])[0]
        if self.eager is None:
            fuse = self.module.fuse
            self.eager = packed_linear(fuse.weight, fuse.bias, draft=True)
        return self.module.fuse_features(features, self.eager)

    def name(self) -> str:
        return f"eagle-fusion-{str(self.dtype).removeprefix('torch.')}"

    def export(self):
        return export_fuse_pass(self.module)


class CompiledMedusa(OwnWeightsPasses):
    """Calls Medusa-1 heads like the heads themselves, through a compiled package: the target's last hidden states
    [rows, H] -> each head's feature [rows, K, H] (their first blocks, which all read those states, one product)."""

    what = "the Medusa heads' pass"

    def __call__(self, hidden):
        if not self.ready():
            return self.module(hidden)
        return self.runner(hidden.contiguous(), [], [])[0]

    def name(self) -> str:
        return f"medusa-heads-{str(self.dtype).removeprefix('torch.')}"

    def export(self):
        return export_medusa_pass(self.module)


class CompiledEarlyExit(HeadPasses):
    """Calls an early-exit head like the head itself, through a compiled package: its passes over the committed
    tokens and over each draft level. Eager, its layers would cost what the target's eager layers do, while the
    target's own pass runs compiled in about two thirds of that."""

    what = "the early-exit draft's pass"

    def __call__(self, input_ids, *, position_ids, attention_mask=None, cache=None):
        head = self.module
        if not self.compiles(input_ids.shape[1], cache):
            return head(input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache)
        rows, new = input_ids.shape
        if attention_mask is None:  # the rows aligned: causal
            past = cache.get_seq_length()
            attention_mask = causal_mask(new, past, self.dtype, input_ids.device).expand(rows, -1, -1, -1)
        return self._run_with_cache(cache, [input_ids, position_ids, attention_mask])[0]

    def key_parts(self) -> list:
        head = self.module
        config = json.dumps(dataclasses.asdict(head.config), sort_keys=True) + head.draft.config.to_json_string()
        # packages before the merge held the adapter unmerged
        return [config, weights_digest(head.draft), "adapter merged", draft_weights()]

    def name(self) -> str:
        return f"early-exit-{str(self.dtype).removeprefix('torch.')}"

    def layer_shapes(self) -> list[tuple[int, int]]:
        return exit_cache_shapes(self.module)

    @property
    def dtype(self) -> torch.dtype:
        return self.module.draft.dtype

    def export(self):
        return export_exit_pass(self.module)


def compiled_head(head, model, passes: type[CompiledPasses] = CompiledHead):
    """What a drafter calls to run `head` (an EAGLE head; an early-exit head with passes=CompiledEarlyExit, Medusa-1
    heads with CompiledMedusa): its compiled passes when `model`'s are compiled, else the head."""
    if not is_compiled(model):
        return head
    if not hasattr(head, PASSES):
        setattr(head, PASSES, passes(head))
    return getattr(head, PASSES)


def head_passes(heads, model) -> list[CompiledPasses]:
    """The compiled passes of the heads among `heads` (as generate() takes them: a head, a drafter, or a list) that
    draft through passes of their own: EAGLE heads (and their feature fusions), early exits and Medusa-1 heads. Empty
    unless `model`'s passes are compiled."""
    if not is_compiled(model):
        return []
    found = []
    for head in heads if isinstance(heads, (list, tuple)) else [heads]:
        if isinstance(head, EagleHead):
            found.append(compiled_head(head, model))
        elif isinstance(head, EarlyExitHead):
            found.append(compiled_head(head, model, CompiledEarlyExit))
        elif isinstance(head, MedusaHeads) and head.readers is None:
            found.append(compiled_head(head, model, CompiledMedusa))
        elif isinstance(getattr(head, "run_head", None), CompiledPasses):  # a drafter built on one
            found.append(head.run_head)
        else:
            continue
        if getattr(found[-1], "fusion", None) is not None:
            found.append(found[-1].fusion)
    return found


def warm_up(model, heads=None, *, verbose: bool = True) -> float:
    """Load or build the packages of `model`'s decoding pass and of the passes of `heads` (as generate() takes
    them) now, with a progress line on stderr while they compile; returns the seconds spent. generate() calls it
    first, so that no call stops to compile after its first token. A model not registered by compile_target is left
    alone."""
    passes = getattr(model, PASSES, None)
    if passes is None:
        return 0.0
    started = time.perf_counter()
    if passes.ready(verbose, recheck=True):
        for head in head_passes(heads, model):
            head.ready(verbose, recheck=True)
    return time.perf_counter() - started
