"""generate(): the call users make. It checks its arguments, turns heads, tree, lookup and fallback into a plan
(`plan`), and runs the decode loop (inference.loop) over one prompt or a list of them."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from heads.attention import GROUPED_SDPA, grouped_attention

from .accept import Sampling
from .calibrate import calibrated_tree, calibrated_widths
from .compiled_heads import warm_up
from .drafters import (
    Drafter,
    DynamicTreeDrafter,
    NoDrafter,
    PromptLookupDrafter,
    SequenceDrafter,
    as_drafter,
    grows_dynamic_trees,
    is_trained,
    trained_head,
)
from .fallback import JUDGE, Fallback
from .loop import decode
from .stats import Generation, GenerationStats
from .transfer import to_device

__all__ = ["Generation", "GenerationStats", "Plan", "generate", "plan"]


@torch.inference_mode()
def generate(
    model,
    heads,
    prompt_or_input_ids,
    *,
    tokenizer=None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    tree=None,
    lookup: bool | None = None,
    fallback: bool = True,
    seed: int | None = None,
    streamer=None,
    batch_size: int | None = None,
) -> Generation | list[Generation]:
    """Generate exactly what `model` alone generates (greedy: token for token; sampling: in distribution). Returns a
    Generation for one prompt, and a list of them (in the prompts' order) for a list of prompts.

    prompt_or_input_ids: text (needs `tokenizer`), token ids (list, 1-D or [1, n] tensor), or a tokenizer's
    output holding `input_ids`. heads: None (plain decoding), MedusaHeads / EagleHead from `heads.load_heads`,
    a Drafter, or a list of them whose trees are merged. tree: None sizes a head's tree to this machine
    (inference.calibrate, measured once and cached); a DynamicTreeSpec (or Medusa paths) fixes it. lookup: merge
    prompt lookup into a head's tree (None: as `plan` decides; True: always; False: never). fallback: decode plainly
    while drafting does not pay on this sequence (inference.fallback). `plan` turns these four into what decodes,
    for one prompt and for a batch alike. streamer: a Hugging Face
    streamer; like `model.generate`, it first receives the prompt, then the tokens as they are accepted.
    batch_size: for a list of prompts, how many decode at once (None: all of them); as one finishes, the next
    prompt starts in its place.
    """
    sampling = Sampling(temperature, top_k, top_p)
    check_model(model)
    warm_up(model, heads)  # a compiled model's packages not ready yet: built (and said so) or loaded now
    batch = _is_batch(prompt_or_input_ids)
    if batch and streamer is not None:
        raise ValueError("a streamer follows one prompt; stream each prompt of a batch in its own call")
    prompts = prompt_or_input_ids if batch else [prompt_or_input_ids]
    for index, item in enumerate(prompts if batch else []):  # one prompt is checked by _prompt_ids
        if isinstance(item, Mapping) and "input_ids" in item:
            item = item["input_ids"]
        if (isinstance(item, str) and not item.strip()) or (not isinstance(item, str) and len(item) == 0):
            raise ValueError(f"prompt {index} of the batch is empty: give at least one token of text for every prompt")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer (or None: every prompt at once), got {batch_size!r}")
    ids = [_prompt_ids(item, tokenizer, model, max_new_tokens) for item in prompts]
    rows = len(ids) if batch_size is None else min(batch_size, len(ids))
    chosen = plan(model, heads, tree, lookup, fallback, batch=(len(ids), rows) if batch else None)
    generators = [torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None for _ in ids]
    eos = to_device(eos_ids(model), model.device)
    if streamer is not None:
        streamer.put(ids[0][None].cpu())
    with grouped_attention(model):  # the same attention, without copying keys and values for every query head
        decoded = decode(
            model, chosen.drafter, ids, max_new_tokens, sampling, generators, eos, chosen.fallback, rows, streamer
        )
    chosen.remember()
    if streamer is not None:
        streamer.end()
    results = []
    for row in decoded:
        row.stats.new_tokens = row.length - row.prompt_length
        tokens = row.new_tokens
        text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
        results.append(Generation(tokens, text, row.stats))
    return results if batch else results[0]


def _is_batch(prompts) -> bool:
    """A list of prompts (texts, token-id lists or tensors), not one prompt's list of token ids."""
    return (
        isinstance(prompts, (list, tuple))
        and len(prompts) > 0
        and isinstance(prompts[0], (str, list, tuple, torch.Tensor, Mapping))
    )


@dataclass
class Plan:
    """What a generate() call decodes with, made from its arguments in one place (`plan`)."""

    drafter: Drafter  # proposes each step's tree (inference.drafters); NoDrafter: plain decoding
    fallback: Fallback  # when to decode plainly instead (inference.fallback)
    head: object = None  # the trained heads drafting, whose fallback's verdict the next call starts from
    rows: int = 1  # sequences decoding at once: a verdict holds for calls decoding as many

    def remember(self) -> None:
        """Keep how drafting fared against plain decoding when this call ended: a next call with these heads, as many
        rows at once, starts with a hold when it was losing (inference.fallback). A head that wins one sequence at a
        time may lose at eight rows, where a pass over more tokens costs more."""
        if self.head is not None and self.fallback.enabled and self.fallback.ratio is not None:
            LAST_RATIO.setdefault(self.head, {})[self.rows] = self.fallback.ratio


LAST_RATIO: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # trained heads -> {rows at once: Fallback.ratio of their last call}


def plan(model, heads, tree, lookup: bool | None, fallback: bool, batch: tuple[int, int] | None = None) -> Plan:
    """generate()'s `heads`, `tree`, `lookup` and `fallback` -> its Plan. `batch`: (prompts, rows decoding at once) for
    a list of prompts, None for one prompt.

    - tree None: a trained head's tree is sized to this machine's measured pass costs (inference.calibrate), per
      batch size; in a batch, a head growing dynamic trees prices each step at the rows it has then (every width up
      to `rows` is calibrated);
    - lookup None: prompt lookup is merged into a trained head's tree for one prompt, and in a batch for a head
      that grows dynamic trees (it keeps only the copied tokens it believes likelier than its own drafts), so that
      no row's long span widens every row's verification;
    - fallback: decode plainly while drafting does not pay; a batch is judged after fewer steps (a step tells as much
      as `rows` steps of one sequence), but never fewer than four, against plain decoding priced over two steps
      (one step's time varies with the rows that just joined)."""
    prompts, rows = batch or (1, 1)
    listed = heads if isinstance(heads, (list, tuple)) else [heads]
    single = [d for d in listed if isinstance(d, SequenceDrafter) and not d.serves_batches]
    if single and prompts > 1:
        raise ValueError(
            f"{type(single[0]).__name__} drafts for one sequence at a time and cannot serve a batch; pass the loaded "
            "heads (heads.load_heads) instead, and one drafter is built for the whole batch"
        )
    # measured once a machine (a line on stderr says so); python -m inference.calibrate measures ahead of time
    spec = tree if tree is not None else calibrated_tree(model, heads, batch=rows, verbose=True)
    head = trained_head(heads)
    last_ratio = LAST_RATIO.get(head, {}).get(rows) if head is not None else None
    if batch is None:
        drafter = as_drafter(with_defaults(heads, lookup is not False), model, spec)
        enabled = fallback and not isinstance(drafter, NoDrafter)
        return Plan(drafter, Fallback(enabled=enabled, last_ratio=last_ratio), head)
    lookup = bool(lookup) if lookup is not None else prompts == 1 or grows_dynamic_trees(heads)
    drafter = as_drafter(with_defaults(heads, lookup), model, spec)
    if tree is None and rows > 1:  # each step priced at its rows: a batch empties, a server may hold one request
        price_by_width(drafter, calibrated_widths(model, heads, batch=rows, verbose=True))
    enabled = fallback and not isinstance(drafter, NoDrafter)
    rule = Fallback(enabled=enabled, judge=max(4, JUDGE // rows), price=2, last_ratio=last_ratio)
    return Plan(drafter, rule, head, rows)


def price_by_width(drafter: Drafter, costs) -> None:
    """Give the drafter that grows dynamic trees (alone, or merged with others) a calibration for each batch width."""
    if costs is None:
        return
    for inner in getattr(drafter, "drafters", [drafter]):
        if isinstance(inner, DynamicTreeDrafter):
            inner.costs_by_rows = costs


def with_defaults(heads, lookup: bool):
    """A trained head alone gets prompt lookup merged into its tree when `lookup` is true."""
    if lookup and is_trained(heads):
        return [heads, PromptLookupDrafter()]
    return heads


# the kernels that honour an arbitrary additive 4D mask; GROUPED_SDPA: "sdpa" switched by another thread's call
TREE_ATTENTION = ("sdpa", "eager", GROUPED_SDPA)


def check_model(model) -> None:
    """Refuse a model the loop cannot drive exactly: a kernel that ignores 4D masks, or no `cache` argument."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in TREE_ATTENTION:
        raise ValueError(
            f"tree verification needs a custom 4D attention mask, which attn_implementation={implementation!r} "
            f"does not take; load the model with attn_implementation='sdpa' (or 'eager')"
        )
    # a forward that swallowed `cache` into **kwargs would decode every pass without its past: wrong, silently
    if "cache" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{type(model).__name__}.forward takes no `cache` argument, which is how transformers >= 5.24 passes "
            f"the KV cache (older modeling code, e.g. a trust_remote_code model, calls it past_key_values); "
            f"use the model's class from transformers itself"
        )


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def _prompt_ids(prompt_or_input_ids, tokenizer, model, max_new_tokens: int) -> torch.Tensor:
    """A 1-D LongTensor on the model's device, with the checks generate() must make first."""
    if isinstance(prompt_or_input_ids, Mapping):  # a tokenizer's output, e.g. apply_chat_template's
        if "input_ids" not in prompt_or_input_ids:
            raise ValueError(f"the prompt mapping has no 'input_ids' (keys: {sorted(prompt_or_input_ids)})")
        prompt_or_input_ids = prompt_or_input_ids["input_ids"]
    if isinstance(prompt_or_input_ids, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs tokenizer=...; or pass token ids instead")
        if not prompt_or_input_ids.strip():
            raise ValueError("the prompt is empty: give at least one token of text")
        ids = torch.tensor(tokenizer(prompt_or_input_ids)["input_ids"], dtype=torch.long)
    else:
        try:
            ids = torch.as_tensor(prompt_or_input_ids)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"input_ids must be token ids (a list of ints or an integer tensor); could not read them: {error}"
            ) from None
        if ids.numel() and (
            ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
        ):  # 5.9 must not become token 5
            raise ValueError(f"token ids must be integers, got {ids.dtype} values such as {ids.flatten()[:3].tolist()}")
        ids = ids.long()
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"generate() decodes one sequence at a time; got a batch of {ids.shape[0]} (input_ids "
                    f"{tuple(ids.shape)})"
                )
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D or [1, length], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    vocab = model.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"token ids must be in [0, {vocab}), got values from {int(ids.min())} to {int(ids.max())}")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ids.numel() + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{limit} positions; shorten the prompt or lower max_new_tokens"
        )
    return ids.to(model.device)
