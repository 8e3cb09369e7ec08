"""The decode loop: draft a tree, verify it in ONE target pass, keep what the target itself would emit."""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .accept import Sampling, accept, target_tokens
from .cache import keep_path, new_cache
from .drafters import as_drafter, drafter_name
from .tree import attention_mask, position_ids, verifiable_tree


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # the prefill included, so plain decoding has mean_accepted == 1
    seconds: float = 0.0
    target_seconds: float = 0.0  # inside the target's forward passes (host time: exact on CPU)
    draft_seconds: float = 0.0  # inside drafter.propose / drafter.observe
    tree_nodes: int = 0  # tokens verified over all decode steps (roots included, the prefill not)

    @property
    def mean_accepted(self) -> float:
        """Spec-Bench's tau: new tokens per target forward pass."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def engine_seconds(self) -> float:
        """The loop's own work: trees, masks, acceptance, cache compaction."""
        return self.seconds - self.target_seconds - self.draft_seconds

    def as_dict(self) -> dict:
        keys = ("new_tokens", "target_forwards", "mean_accepted", "seconds", "tokens_per_second", "target_seconds", "draft_seconds", "engine_seconds", "tree_nodes")
        return {key: getattr(self, key) for key in keys}


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only, EOS included when generation stopped there
    text: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)


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
    seed: int | None = None,
    streamer=None,
) -> Generation:
    """Generate exactly what `model` alone generates (greedy: token for token; sampling: in distribution).

    prompt_or_input_ids: text (needs `tokenizer`), token ids (list, 1-D or [1, n] tensor), or a tokenizer's
    output holding `input_ids`. heads: None (plain decoding), MedusaHeads / EagleHead from `heads.load_heads`, a Drafter, or a list
    of them whose trees are merged. tree: a static tree (list of paths) for Medusa, a DynamicTreeSpec for
    EAGLE; None takes the drafter's default. streamer: a Hugging Face streamer; like `model.generate`, it
    first receives the prompt, then the tokens as they are accepted.
    """
    sampling = Sampling(temperature, top_k, top_p)
    _check_model(model)
    prompt = _prompt_ids(prompt_or_input_ids, tokenizer, model, max_new_tokens)
    drafter = as_drafter(heads, model, tree)
    drafter.reset()
    name, vocab_size = drafter_name(drafter), model.config.vocab_size
    eos = torch.tensor(_eos_ids(model), dtype=torch.long, device=prompt.device)
    generator = torch.Generator(device=prompt.device).manual_seed(seed) if seed is not None else None
    layers, stats, clock = drafter.hidden_layers, GenerationStats(), time.perf_counter
    if streamer is not None:
        streamer.put(prompt[None].cpu())

    def forward(input_ids, **kwargs):
        started = clock()
        out = model(input_ids=input_ids[None], cache=cache, use_cache=True, output_hidden_states=bool(layers), **kwargs)
        stats.target_seconds += clock() - started
        stats.target_forwards += 1
        return out

    def commit(new_tokens) -> bool:
        """Append accepted tokens, stopping at EOS like model.generate(); True when generation is over."""
        nonlocal length
        stops = torch.isin(new_tokens, eos).nonzero()
        if stops.shape[0]:
            new_tokens = new_tokens[: int(stops[0]) + 1]
        tokens[length : length + new_tokens.shape[0]] = new_tokens
        length += new_tokens.shape[0]
        if streamer is not None:
            streamer.put(new_tokens.cpu())
        return bool(stops.shape[0]) or length - prompt.shape[0] >= max_new_tokens

    def observe(hidden_states, rows, next_tokens):
        started = clock()
        drafter.observe({layer: hidden_states[layer][0, rows] for layer in layers}, next_tokens)
        stats.draft_seconds += clock() - started

    start = clock()
    cache = new_cache(model)
    tokens = torch.empty(prompt.shape[0] + max_new_tokens, dtype=torch.long, device=prompt.device)
    tokens[: prompt.shape[0]] = prompt
    length = prompt.shape[0]

    out = forward(prompt, **_last_logit_only(model))
    chosen = target_tokens(out.logits[0, -1:], sampling, generator)
    done = commit(chosen)
    if not done:
        observe(out.hidden_states, slice(None), tokens[1:length])
    while not done:
        started = clock()
        max_depth = max_new_tokens - (length - prompt.shape[0]) - 1
        proposed = drafter.propose(tokens[:length], max_depth)
        stats.draft_seconds += clock() - started
        tree = verifiable_tree(proposed, tokens[length - 1], vocab_size, max_depth, name)
        stats.tree_nodes += tree.size
        past = length - 1  # the root is the last committed token; the target has not seen it yet
        out = forward(tree.tokens, position_ids=position_ids(tree, past), attention_mask=attention_mask(tree, past, model.dtype))
        path, new_tokens = accept(tree, out.logits[0], sampling, generator)
        keep_path(cache, past, path, tree.size)
        done = commit(new_tokens)
        if not done:
            observe(out.hidden_states, path, new_tokens)

    stats.seconds = clock() - start
    stats.new_tokens = length - prompt.shape[0]
    if streamer is not None:
        streamer.end()
    new = tokens[prompt.shape[0] : length].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None
    return Generation(new, text, stats)


def _last_logit_only(model) -> dict:
    """The prefill needs only the last position's logits (generate() does the same when it can)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


TREE_ATTENTION = ("sdpa", "eager")  # the kernels that honour an arbitrary additive 4D mask


def _check_model(model) -> None:
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


def _eos_ids(model) -> list[int]:
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
            raise ValueError(f"input_ids must be token ids (a list of ints or an integer tensor); could not read them: {error}") from None
        if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):  # 5.9 must not become token 5
            raise ValueError(f"token ids must be integers, got {ids.dtype} values such as {ids.flatten()[:3].tolist()}")
        ids = ids.long()
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"generate() decodes one sequence at a time; got a batch of {ids.shape[0]} (input_ids {tuple(ids.shape)})")
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
