"""The decode loop: draft a tree, verify it in ONE target pass, keep what the target itself would emit."""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from heads.attention import GROUPED_SDPA, grouped_attention

from .accept import Sampling, accept, target_tokens
from .batch import decode_batch
from .cache import keep_path, new_cache
from .calibrate import calibrated_tree
from .compiled import decoding_pass, warm_up
from .drafters import (
    OWN_DRAFTERS,
    TRAINED_HEADS,
    Drafter,
    MergedDrafter,
    NoDrafter,
    PromptLookupDrafter,
    TokenDrafter,
    as_drafter,
    drafter_name,
    grows_dynamic_trees,
)
from .fallback import JUDGE, Fallback
from .tree import Tree, attention_mask, position_ids, verifiable_tree


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # the prefill included, so plain decoding has mean_accepted == 1
    seconds: float = 0.0
    target_seconds: float = 0.0  # inside the target's forward passes (host time: exact on CPU)
    draft_seconds: float = 0.0  # inside drafter.propose / drafter.observe
    tree_nodes: int = 0  # tokens verified over all decode steps (roots included, the prefill not)
    time_to_first_token: float = 0.0  # seconds from the call to the first new token (the prefill)
    plain_steps: int = 0  # decode steps the fallback took without drafting (drafting did not pay)
    drafted_to_depth: list[int] = field(default_factory=list)  # [d]: steps whose tree reached depth d + 1
    accepted_to_depth: list[int] = field(default_factory=list)  # [d]: steps that accepted d + 1 draft tokens or more

    @property
    def mean_accepted(self) -> float:
        """Spec-Bench's tau: new tokens per target forward pass."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def time_per_output_token(self) -> float:
        """Seconds per new token after the first (TPOT)."""
        return (self.seconds - self.time_to_first_token) / max(self.new_tokens - 1, 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """For each draft depth d: of the steps that drafted d tokens deep, the share that accepted d."""
        return [accepted / drafted for accepted, drafted in zip(self.accepted_to_depth, self.drafted_to_depth)]

    @property
    def engine_seconds(self) -> float:
        """The loop's own work: trees, masks, acceptance, cache compaction."""
        return self.seconds - self.target_seconds - self.draft_seconds

    def count_depths(self, drafted: int, accepted: int) -> None:
        grow = drafted - len(self.drafted_to_depth)
        if grow > 0:
            self.drafted_to_depth += [0] * grow
            self.accepted_to_depth += [0] * grow
        for d in range(drafted):
            self.drafted_to_depth[d] += 1
            self.accepted_to_depth[d] += d < accepted

    def as_dict(self) -> dict:
        keys = (
            "new_tokens",
            "target_forwards",
            "mean_accepted",
            "seconds",
            "tokens_per_second",
            "time_to_first_token",
            "time_per_output_token",
            "target_seconds",
            "draft_seconds",
            "engine_seconds",
            "tree_nodes",
            "plain_steps",
            "acceptance_by_depth",
            "drafted_to_depth",
            "accepted_to_depth",
        )
        return {key: getattr(self, key) for key in keys}


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only, EOS included when generation stopped there
    text: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class Decoding:
    """What the loop carries from step to step: the committed tokens (a buffer filled up to `length`), the
    target's KV cache, which holds every committed token but the last, and the running stats."""

    model: torch.nn.Module
    drafter: object
    tokens: torch.Tensor
    length: int
    prompt_length: int
    max_new_tokens: int
    cache: object
    stats: GenerationStats
    eos: torch.Tensor
    streamer: object = None

    @property
    def budget(self) -> int:
        """How many more tokens may be committed."""
        return self.max_new_tokens - (self.length - self.prompt_length)


def forward(state: Decoding, run, input_ids: torch.Tensor, **kwargs):
    """One target pass over `input_ids` on top of the cache through `run` (the model, or its compiled passes),
    hidden states included when the drafter reads them."""
    started = time.perf_counter()
    out = run(
        input_ids=input_ids[None],
        cache=state.cache,
        use_cache=True,
        output_hidden_states=bool(state.drafter.hidden_layers),
        **kwargs,
    )
    state.stats.target_seconds += time.perf_counter() - started
    state.stats.target_forwards += 1
    return out


def prefill(state: Decoding):
    """The prompt in one pass: the cache, the first token's logits and the hidden states the drafter reads. Eager:
    every prompt's length differs, and it is one pass a prompt."""
    return forward(state, state.model, state.tokens[: state.length], **_last_logit_only(state.model))


def draft(state: Decoding, name: str) -> Tree:
    """The drafter's tree for the next step, checked and cut to what may still be committed."""
    started = time.perf_counter()
    max_depth = state.budget - 1  # the target adds its own token after the deepest accepted draft
    proposed = state.drafter.propose(state.tokens[: state.length], max_depth)
    state.stats.draft_seconds += time.perf_counter() - started
    return verifiable_tree(proposed, state.tokens[state.length - 1], state.model.config.vocab_size, max_depth, name)


def verify(state: Decoding, tree: Tree):
    """ONE target pass over the whole tree: each node sees the committed past and its own ancestors."""
    past = state.length - 1  # the root is the last committed token; the target has not seen it yet
    state.stats.tree_nodes += tree.size
    mask = attention_mask(tree, past, state.model.dtype)
    return forward(
        state, decoding_pass(state.model), tree.tokens, position_ids=position_ids(tree, past), attention_mask=mask
    )


def commit(state: Decoding, new_tokens: torch.Tensor) -> bool:
    """Append accepted tokens, stopping at EOS like model.generate(); True when generation is over."""
    stops = torch.isin(new_tokens, state.eos).nonzero()
    if stops.shape[0]:
        new_tokens = new_tokens[: int(stops[0]) + 1]
    state.tokens[state.length : state.length + new_tokens.shape[0]] = new_tokens
    state.length += new_tokens.shape[0]
    if state.streamer is not None:
        state.streamer.put(new_tokens.cpu())
    return bool(stops.shape[0]) or state.budget <= 0


def observe(state: Decoding, hidden_states, rows, next_tokens: torch.Tensor) -> None:
    """Tell the drafter what the target computed for the tokens it just committed."""
    started = time.perf_counter()
    state.drafter.observe({layer: hidden_states[layer][0, rows] for layer in state.drafter.hidden_layers}, next_tokens)
    state.stats.draft_seconds += time.perf_counter() - started


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
    _check_model(model)
    warm_up(model)  # a compiled model whose package is not ready: compiled (and said so) or loaded now
    with grouped_attention(model):  # the same attention, without copying keys and values for every query head
        if _is_batch(prompt_or_input_ids):
            return _generate_batch(
                model,
                heads,
                prompt_or_input_ids,
                tokenizer,
                max_new_tokens,
                sampling,
                tree,
                lookup,
                fallback,
                seed,
                batch_size,
            )
        return _generate_one(
            model,
            heads,
            prompt_or_input_ids,
            tokenizer,
            max_new_tokens,
            sampling,
            tree,
            lookup,
            fallback,
            seed,
            streamer,
        )


def _generate_one(
    model, heads, prompt_or_input_ids, tokenizer, max_new_tokens, sampling, tree, lookup, fallback, seed, streamer
) -> Generation:
    """generate() for one prompt."""
    prompt = _prompt_ids(prompt_or_input_ids, tokenizer, model, max_new_tokens)
    chosen = plan(model, heads, tree, lookup, fallback)
    drafter, plain, clock = chosen.drafter, chosen.fallback, time.perf_counter
    drafter.reset()
    generator = torch.Generator(device=prompt.device).manual_seed(seed) if seed is not None else None
    name = drafter_name(drafter)
    if streamer is not None:
        streamer.put(prompt[None].cpu())

    start = clock()
    tokens = torch.empty(prompt.shape[0] + max_new_tokens, dtype=torch.long, device=prompt.device)
    tokens[: prompt.shape[0]] = prompt
    state = Decoding(
        model,
        drafter,
        tokens,
        prompt.shape[0],
        prompt.shape[0],
        max_new_tokens,
        new_cache(model),
        GenerationStats(),
        torch.tensor(_eos_ids(model), dtype=torch.long, device=prompt.device),
        streamer,
    )
    out = prefill(state)
    done = commit(state, target_tokens(out.logits[0, -1:], sampling, generator))
    state.stats.time_to_first_token = clock() - start
    if not done:
        observe(state, out.hidden_states, slice(None), state.tokens[1 : state.length])
    while not done:
        started = clock()
        drafting = plain.use_drafter()
        step = draft(state, name) if drafting else Tree.chain(state.tokens[state.length - 1 : state.length])
        out = verify(state, step)
        path, new_tokens = accept(step, out.logits[0], sampling, generator)
        keep_path(state.cache, state.length - 1, path, step.size)
        done = commit(state, new_tokens)
        if not done:
            observe(state, out.hidden_states, path, new_tokens)
        plain.record(drafting, new_tokens.shape[0], clock() - started)
        state.stats.plain_steps += not drafting
        state.stats.count_depths(step.max_depth, path.shape[0] - 1)
    chosen.remember()

    stats = state.stats
    stats.seconds = clock() - start
    stats.new_tokens = state.length - prompt.shape[0]
    if streamer is not None:
        streamer.end()
    new = state.tokens[prompt.shape[0] : state.length].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None
    return Generation(new, text, stats)


def _is_batch(prompts) -> bool:
    """A list of prompts (texts, token-id lists or tensors), not one prompt's list of token ids."""
    return (
        isinstance(prompts, (list, tuple))
        and len(prompts) > 0
        and isinstance(prompts[0], (str, list, tuple, torch.Tensor, Mapping))
    )


def _generate_batch(
    model, heads, prompts, tokenizer, max_new_tokens, sampling, tree, lookup, fallback, seed, batch_size
) -> list[Generation]:
    """generate() for a list of prompts (inference.batch): one result per prompt, in order. One drafter built from
    the shared heads drafts all rows at once; the fallback judges the whole batch, by its pace per row. A row's stats
    count its own tokens, passes and nodes; their `seconds`, `draft_seconds` and `plain_steps` are the whole call's."""
    for index, item in enumerate(prompts):
        if isinstance(item, Mapping) and "input_ids" in item:
            item = item["input_ids"]
        if (isinstance(item, str) and not item.strip()) or (not isinstance(item, str) and len(item) == 0):
            raise ValueError(f"prompt {index} of the batch is empty: give at least one token of text for every prompt")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer (or None: every prompt at once), got {batch_size!r}")
    ids = [_prompt_ids(item, tokenizer, model, max_new_tokens) for item in prompts]
    rows = len(ids) if batch_size is None else min(batch_size, len(ids))
    chosen = plan(model, heads, tree, lookup, fallback, batch=(len(ids), rows))
    drafter, plain = chosen.drafter, chosen.fallback
    generators = [torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None for _ in ids]
    started = time.perf_counter()
    eos = torch.tensor(_eos_ids(model), dtype=torch.long, device=model.device)
    new_tokens, passes, nodes, draft_seconds, plain_steps = decode_batch(
        model, drafter, ids, max_new_tokens, sampling, generators, eos, plain, rows
    )
    chosen.remember()
    seconds = time.perf_counter() - started
    results = []
    for row, tokens in enumerate(new_tokens):
        stats = GenerationStats(
            new_tokens=len(tokens),
            target_forwards=passes[row],
            seconds=seconds,
            tree_nodes=nodes[row],
            draft_seconds=draft_seconds,
            plain_steps=plain_steps,
        )
        text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
        results.append(Generation(tokens, text, stats))
    return results


@dataclass
class Plan:
    """What a generate() call decodes with, made from its arguments in one place (`plan`)."""

    drafter: object  # proposes each step's tree (inference.drafters); NoDrafter: plain decoding
    fallback: Fallback  # when to decode plainly instead (inference.fallback)
    head: object = None  # the trained heads drafting, whose fallback's verdict the next call starts from

    def remember(self) -> None:
        """Keep how drafting fared against plain decoding when this call ended: a next call with these heads starts
        with a hold when it was losing (inference.fallback)."""
        if self.head is not None and self.fallback.enabled and self.fallback.ratio is not None:
            LAST_RATIO[self.head] = self.fallback.ratio


LAST_RATIO: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # trained heads -> Fallback.ratio of their last call


def plan(model, heads, tree, lookup: bool | None, fallback: bool, batch: tuple[int, int] | None = None) -> Plan:
    """generate()'s `heads`, `tree`, `lookup` and `fallback` -> its Plan. `batch`: (prompts, rows decoding at once) for
    a list of prompts, None for one prompt.

    - tree None: a trained head's tree is sized to this machine's measured pass costs (inference.calibrate), per
      batch size;
    - lookup None: prompt lookup is merged into a trained head's tree for one prompt, and in a batch for a head
      that grows dynamic trees (it keeps only the copied tokens it believes likelier than its own drafts), so that
      no row's long span widens every row's verification;
    - fallback: decode plainly while drafting does not pay; a batch is judged after fewer steps (a step tells as much
      as `rows` steps of one sequence), but never fewer than four, against plain decoding priced over two steps
      (a batch-8 step took 84 ms, the next 160)."""
    prompts, rows = batch or (1, 1)
    stateful = [
        d
        for d in (heads if isinstance(heads, (list, tuple)) else [heads])
        if isinstance(d, Drafter) and not isinstance(d, TokenDrafter)
    ]
    if stateful and prompts > 1:
        raise ValueError(
            f"{type(stateful[0]).__name__} keeps the state of one sequence and cannot serve a batch; pass the loaded "
            "heads (heads.load_heads) instead, and one drafter is built for the whole batch"
        )
    # measured once a machine (a line on stderr says so); python -m inference.calibrate measures ahead of time
    spec = tree if tree is not None else calibrated_tree(model, heads, batch=rows, verbose=True)
    head = next(
        (h for h in (heads if isinstance(heads, (list, tuple)) else [heads]) if isinstance(h, TRAINED_HEADS)), None
    )
    last_ratio = LAST_RATIO.get(head) if head is not None else None
    if batch is None:
        drafter = as_drafter(with_defaults(heads, lookup is not False), model, spec)
        enabled = fallback and not isinstance(drafter, NoDrafter)
        return Plan(drafter, Fallback(enabled=enabled, last_ratio=last_ratio), head)
    lookup = bool(lookup) if lookup is not None else prompts == 1 or grows_dynamic_trees(heads)
    drafter = as_drafter(with_defaults(heads, lookup), model, spec)
    if not isinstance(drafter, OWN_DRAFTERS):  # a foreign drafter is asked row by row, through a merge of one
        drafter = MergedDrafter([drafter])
    enabled = fallback and not isinstance(drafter, NoDrafter)
    return Plan(drafter, Fallback(enabled=enabled, judge=max(4, JUDGE // rows), price=2, last_ratio=last_ratio), head)


def with_defaults(heads, lookup: bool):
    """A trained head alone gets prompt lookup merged into its tree when `lookup` is true."""
    if lookup and isinstance(heads, TRAINED_HEADS):
        return [heads, PromptLookupDrafter()]
    return heads


def _last_logit_only(model) -> dict:
    """The prefill needs only the last position's logits (generate() does the same when it can)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


# the kernels that honour an arbitrary additive 4D mask; GROUPED_SDPA: "sdpa" switched by another thread's call
TREE_ATTENTION = ("sdpa", "eager", GROUPED_SDPA)


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
