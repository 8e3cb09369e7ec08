"""A decoding pass in the form torch.export takes: the Hugging Face model (or a head) called as it is, its cache as
plain tensors whose new entries the pass writes in place, every size dynamic. inference.compiled builds packages
from these programs and runs them."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from heads.attention import grouped_attention

from . import kernels, packed
from .cache import PositionLayer, position_cache
from .graph_passes import packed_products

# sizes above 1 for every dynamic dimension (torch specializes 0 and 1), and room after the cached entries
EXAMPLE_ROWS, EXAMPLE_TOKENS, EXAMPLE_CACHED, EXAMPLE_CAPACITY, EXAMPLE_LOGITS = 2, 3, 5, 9, 2
# every input's rows, and every store's capacity, one named size each: a size of its own for each of a model's
# stores would bring symbols of one value that inductor reasons about one by one (a much slower compile). Token
# counts stay Dim.AUTO: named, export refuses a guard it cannot simplify (t * min(64, 192 t) == 64 t).
ROWS, CAPACITY = torch.export.Dim("rows"), torch.export.Dim("capacity")


class DecodingPass(torch.nn.Module):
    """One decoding pass of `model` with its cache as plain tensors, the form torch.export takes: key_stores[i] and
    value_stores[i] [rows, kv_heads, capacity, head_dim] for layer i, whose first entries are the cached ones (as
    many as the mask's keys less the new tokens), followed by room for at least the new tokens' entries, which the
    pass writes there in place (_StoreLayer). Returns the logits at `logits_positions` (the new tokens' indices: all
    of them to verify a tree, the last ones to prefill prompts) and every layer's hidden states."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        logits_positions,
        key_stores: list[torch.Tensor],
        value_stores: list[torch.Tensor],
    ):
        cache = stored_cache(key_stores, value_stores, attention_mask.shape[-1] - input_ids.shape[1])
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_positions,
        )
        return out.logits, tuple(out.hidden_states)


class _StoreLayer(DynamicLayer):
    """A cache layer over an exported pass's stores: its first `cached` entries are the cached ones, and the pass's
    new entries are written in place after them, so attention reads the stores as they are (DynamicLayer's way would
    concatenate a copy of the whole cache with the new entries in every layer of every pass)."""

    def __init__(self, key_store: torch.Tensor, value_store: torch.Tensor, cached: int):
        super().__init__()
        self.key_store, self.value_store, self.cached = key_store, value_store, cached
        self.lazy_initialization(key_store, value_store)
        self.keys, self.values = key_store[:, :, :cached], value_store[:, :, :cached]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.cached + key_states.shape[-2]
        self.key_store[:, :, self.cached : end].copy_(key_states)
        self.value_store[:, :, self.cached : end].copy_(value_states)
        self.keys, self.values = self.key_store[:, :, :end], self.value_store[:, :, :end]
        return self.keys, self.values


def stored_cache(key_stores: list[torch.Tensor], value_stores: list[torch.Tensor], cached: int) -> Cache:
    """A cache over each layer's first `cached` entries of its stores, which takes new entries in place after them
    (an exported pass's cache argument)."""
    return Cache(layers=[_StoreLayer(k, v, cached) for k, v in zip(key_stores, value_stores, strict=True)])


def stores_with_room(layer, like: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's entries in the layout a package takes (contiguous, the cached entries first) with room for `new`
    entries after them: a PositionLayer's buffer rows, which the pass then writes into, else a copy. `like`: entries
    [rows, heads, any count, dim] of the cache's dtype (its own where it has some)."""
    if isinstance(layer, PositionLayer):
        return layer.reserve(like, new)
    used = layer.get_seq_length() if layer.is_initialized else 0
    room = like.new_empty(*like.shape[:-2], new, like.shape[-1])
    entries = (layer.keys, layer.values) if used else (like, like)
    return tuple(torch.cat([part, room], dim=-2) for part in entries)


def take_entries(layer, key_store: torch.Tensor, value_store: torch.Tensor, cached: int, new: int) -> None:
    """The cache takes in the `new` entries a pass wrote into its stores after the `cached` ones."""
    if isinstance(layer, PositionLayer):
        layer.extend(key_store.shape[0], new)
    else:
        layer.update(key_store[:, :, cached : cached + new], value_store[:, :, cached : cached + new])


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
        cache = stored_cache(key_stores, value_stores, attention_mask.shape[-1] - feature.shape[1])
        out = self.head(
            feature,
            token_embedding,
            copy_embedding,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
        )
        return (out,)


class FusePass(torch.nn.Module):
    """An EAGLE-3 head's feature fusion (no cache: its stores are empty lists): (the target's hidden states at the
    head's feature layers, concatenated [rows, T, n * H], [], []) -> (the fused feature [rows, T, H],). Eagerly its
    norms, concatenation and product cost 0.4 ms a step after a target pass (docs/experiments.md, row X23)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, features, key_stores, value_stores):
        return (self.head.fuse_features(features),)


class MedusaPass(torch.nn.Module):
    """Medusa-1 heads (no cache: its stores are empty lists): (the target's last hidden states [rows, H], [], []) ->
    (each head's feature [rows, K, H],). Eagerly their residual blocks cost 1.5 ms a step after a target pass
    (docs/experiments.md, row X24)."""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, hidden, key_stores, value_stores):
        return (self.heads(hidden),)


class ExitPass(torch.nn.Module):
    """The early-exit draft's pass (the target's first layers with their adapter) with its cache as plain tensors (as
    DecodingPass, which writes the new entries into the stores): (token ids, positions, the additive mask, key/value
    stores) -> (the exit's normed hidden states [rows, T, H],)."""

    def __init__(self, head):
        super().__init__()
        # registered here (the head keeps its draft outside its own module tree), the adapter merged: the package
        # freezes the weights into itself either way, and one product a map drafts faster than three
        # (docs/experiments.md, X13)
        self.draft = head.merged_draft()

    def forward(self, input_ids, position_ids, attention_mask, key_stores, value_stores):
        cache = stored_cache(key_stores, value_stores, attention_mask.shape[-1] - input_ids.shape[1])
        out = self.draft.base_model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True
        )
        return (out.last_hidden_state,)


def export_decoding_pass(model):
    """`model`'s DecodingPass as torch.export's program, every size dynamic."""
    shapes = cache_shapes(model)
    rows, tokens, cached = EXAMPLE_ROWS, EXAMPLE_TOKENS, EXAMPLE_CACHED
    example = (
        torch.zeros(rows, tokens, dtype=torch.long, device=model.device),
        (torch.arange(tokens, device=model.device) + cached).expand(rows, -1).contiguous(),
        torch.zeros(rows, 1, tokens, cached + tokens, dtype=model.dtype, device=model.device),
        torch.arange(EXAMPLE_LOGITS, device=model.device),  # fewer than the tokens: no size shared by chance
    )
    auto = torch.export.Dim.AUTO
    dynamic = ({0: ROWS, 1: auto}, {0: ROWS, 1: auto}, {0: ROWS, 2: auto, 3: auto}, {0: auto})
    with grouped_attention(model):  # the attention generate() decodes with
        return export_pass(DecodingPass(model), example, dynamic, shapes, model.dtype, model.device)


def export_head_pass(head):
    """An EAGLE head's HeadPass as torch.export's program, every size dynamic."""
    weight = next(head.parameters())
    dtype, device, hidden = weight.dtype, weight.device, head.config.hidden_size
    shapes = head_cache_shapes(head)
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
    return export_pass(HeadPass(head), example, dynamic, shapes, dtype, device, *extra, draft=True)


def export_fuse_pass(head):
    """An EAGLE-3 head's FusePass as torch.export's program, every size dynamic."""
    weight = next(head.parameters())
    width = len(head.config.feature_layers) * head.config.hidden_size
    example = (torch.zeros(EXAMPLE_ROWS, EXAMPLE_TOKENS, width, dtype=weight.dtype, device=weight.device),)
    dynamic = ({0: ROWS, 1: torch.export.Dim.AUTO},)
    return export_pass(FusePass(head), example, dynamic, [], weight.dtype, weight.device, draft=True)


def export_medusa_pass(heads):
    """Medusa-1 heads' MedusaPass as torch.export's program, every size dynamic."""
    weight = next(heads.parameters())
    example = (torch.zeros(EXAMPLE_ROWS, heads.config.hidden_size, dtype=weight.dtype, device=weight.device),)
    return export_pass(MedusaPass(heads), example, ({0: ROWS},), [], weight.dtype, weight.device, draft=True)


def export_exit_pass(head):
    """The early-exit draft's ExitPass as torch.export's program, every size dynamic."""
    dtype, device = head.draft.dtype, head.draft.device
    shapes = exit_cache_shapes(head)
    rows, tokens, cached = EXAMPLE_ROWS, EXAMPLE_TOKENS, EXAMPLE_CACHED
    example = (
        torch.zeros(rows, tokens, dtype=torch.long, device=device),
        (torch.arange(tokens, device=device) + cached).expand(rows, -1).contiguous(),
        torch.zeros(rows, 1, tokens, cached + tokens, dtype=dtype, device=device),
    )
    auto = torch.export.Dim.AUTO
    dynamic = ({0: ROWS, 1: auto}, {0: ROWS, 1: auto}, {0: ROWS, 2: auto, 3: auto})
    return export_pass(ExitPass(head), example, dynamic, shapes, dtype, device, draft=True)


def cache_shapes(model) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer of `model`'s cache."""
    one = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    return _cache_shapes(lambda cache: model(input_ids=one, cache=cache, use_cache=True))


def head_cache_shapes(head) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer of an EAGLE head's cache."""
    weight = next(head.parameters())
    one = torch.zeros(1, 1, head.config.hidden_size, dtype=weight.dtype, device=weight.device)
    position = torch.zeros(1, 1, dtype=torch.long, device=weight.device)
    copy = one if head.config.copy_input else None
    return _cache_shapes(lambda cache: head(one, one, copy, position_ids=position, cache=cache))


def exit_cache_shapes(head) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer of an early-exit draft's cache."""
    one = torch.zeros(1, 1, dtype=torch.long, device=head.draft.device)
    return _cache_shapes(lambda cache: head(one, position_ids=one, cache=cache))


def _cache_shapes(one_token_pass) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer's cache, read from a one-token pass."""
    cache = position_cache()
    with torch.inference_mode():
        one_token_pass(cache)
    return [(layer.keys.shape[1], layer.keys.shape[-1]) for layer in cache.layers]


def export_pass(
    module,
    example: tuple,
    dynamic: tuple,
    shapes: list[tuple[int, int]],
    dtype,
    device,
    extra=(),
    extra_dynamic=(),
    draft: bool = False,
):
    """torch.export of `module(*example, key_stores, value_stores, *extra)`: stores shaped like a cache of `shapes`; its
    linear layers through our packed kernel where the CPU takes it (graph_passes.packed_products), a `draft`'s in
    int8 where inference.packed.DRAFT_WEIGHTS_INT8 says so."""
    stores = [
        torch.zeros(EXAMPLE_ROWS, kv_heads, EXAMPLE_CAPACITY, head_dim, dtype=dtype, device=device)
        for kv_heads, head_dim in shapes
    ]
    cache_dynamic = [{0: ROWS, 2: CAPACITY}] * len(shapes)
    with torch.no_grad():  # not inference mode: the program writes into its stores, which must not be inference tensors
        program = torch.export.export(
            module.eval(),
            (*example, stores, [s.clone() for s in stores], *extra),
            dynamic_shapes=(*dynamic, cache_dynamic, cache_dynamic, *extra_dynamic),
            strict=False,
        )
    if kernels.packs_products(device, dtype):
        packed_products(program, int8=draft and packed.DRAFT_WEIGHTS_INT8)
    return program


def logits_positions(logits_to_keep, new: int, device) -> torch.Tensor:
    """The indices of the new tokens whose logits a pass computes, from a model's `logits_to_keep` (None or 0:
    all of them; an int k: the last k; a 1-D tensor: these)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep
    return torch.arange(new - (logits_to_keep or new), new, device=device)
