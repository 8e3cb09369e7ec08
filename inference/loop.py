"""The decode loop: each step drafts a tree for every row, ONE target pass verifies all of them, and each row keeps
what the target itself would emit. One prompt is a batch of one row.

The target's cache holds, for row b, its committed tokens but the last in entries [0, cached[b]); entries past that
are stale (a shorter row's padding, rejected drafts) and every query is masked off them. A step appends all rows'
trees at the same cache index (padded to the largest tree; a padding node sees only itself, so nothing is ever
computed from nothing); each row's accepted path then moves to its own `cached[b]`, and the cache is cropped to the
longest row. Rows that finish leave the batch and stop costing work; while prompts wait beyond the batch size, the
next ones are prefilled and join it (their cache rows appended, padded with masked entries); the tokens prompts
share (a chat template's system prompt) are computed once and copied into each row (shared_prefix).

The loop is driven a step at a time: `start` makes the state, `add` queues a prompt (its own max_new_tokens,
sampling, generator and a callback receiving its tokens as they are committed), `step` decodes one step (admitting
waiting prompts first) and a row whose `cancelled` is set leaves the batch at the next one. `decode` runs a list of
prompts to the end that way; a server (inference.serve) adds prompts between steps as they arrive.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from heads.eagle import causal_mask

from .accept import Sampling, accept, accept_chosen, greedy_path, greedy_tokens, target_tokens
from .cache import append_rows, keep_new_entries, keep_paths, keep_rows, new_cache, reserve_rows
from .compiled import COMPILED_PREFILL_TOKENS, decoding_pass
from .drafters import Drafter, NoDrafter, drafter_name
from .fallback import Fallback
from .padding import prefill_groups, right_padded_mask
from .prefix import MIN_PREFIX, Prefix, shared_length
from .stats import GenerationStats
from .transfer import to_device
from .tree import (
    Tree,
    additive_mask,
    is_chain,
    raise_tree_problems,
    verifiable_chain,
    verifiable_host_tree,
    verifiable_trees,
)

# a row's callback: the tokens it just committed, and whether it is done
TokenCallback = Callable[[list[int], bool], None]


@dataclass(eq=False)  # a row is itself: compared by identity
class Row:
    """One prompt's sequence: its text (prompt, then new tokens) in a buffer of its final size, filled to `length`,
    on the device and, read back with each step's outcome, on the host; and how it decodes."""

    text: torch.Tensor
    host_text: np.ndarray
    length: int
    prompt_length: int
    max_new_tokens: int
    sampling: Sampling
    generator: torch.Generator | None
    on_tokens: TokenCallback | None = None  # called in the decoding thread as the row commits tokens
    stats: GenerationStats = field(default_factory=GenerationStats)
    cached: int = 0  # entries of its committed tokens (all but the last) in the target's cache
    started: float = field(default_factory=time.perf_counter)  # when it was added: its stats' clock starts there
    cancelled: bool = False  # set from any thread: the row leaves the batch (or the queue) at the next step
    finish: str | None = None  # once done: "stop" (it committed an EOS) or "length" (max_new_tokens)

    @property
    def new_tokens(self) -> list[int]:
        return self.host_text[self.prompt_length : self.length].tolist()

    @property
    def budget(self) -> int:
        """How many more tokens the row may commit."""
        return self.max_new_tokens - (self.length - self.prompt_length)


@dataclass
class Decoding:
    """What the loop carries from step to step."""

    model: torch.nn.Module
    drafter: Drafter
    fallback: Fallback
    eos: frozenset[int]
    batch_size: int
    waiting: list[Row] = field(default_factory=list)  # rows not started yet, in order
    active: list[Row] = field(default_factory=list)  # the rows decoding, in the cache's row order
    cache: object = None
    prefix: Prefix | None = None  # what the last prompts shared (inference.prefix), kept for those to come
    last_prompt: list[torch.Tensor] = field(default_factory=list)  # the prompt admitted last, if any
    to_observe: tuple[list, list] = field(
        default_factory=lambda: ([], [])
    )  # hidden states and committed tokens the drafter has not seen yet, one of each for every active row


def start(model, drafter: Drafter, eos: Iterable[int], fallback: Fallback, batch_size: int) -> Decoding:
    """A loop with no rows yet, decoding at most `batch_size` rows at once."""
    return Decoding(model, drafter, fallback, frozenset(int(token) for token in eos), batch_size)


def add(
    state: Decoding,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator | None = None,
    on_tokens: TokenCallback | None = None,
) -> Row:
    """Queue a prompt (1-D token ids, checked by the caller): it joins the batch at the next step with room."""
    text = torch.empty(prompt.shape[0] + max_new_tokens, dtype=torch.long, device=prompt.device)
    text[: prompt.shape[0]] = prompt
    host_text = np.empty(text.shape[0], dtype=np.int64)
    host_text[: prompt.shape[0]] = prompt.cpu().numpy()
    row = Row(text, host_text, prompt.shape[0], prompt.shape[0], max_new_tokens, sampling, generator, on_tokens)
    state.waiting.append(row)
    return row


def decode(
    model,
    drafter: Drafter,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    sampling: Sampling,
    generators: list,
    eos: torch.Tensor,
    fallback: Fallback,
    batch_size: int,
    streamer=None,
) -> list[Row]:
    """Decode every prompt (1-D token ids), at most `batch_size` at once; returns their rows, in order. A streamer
    (one prompt) receives the tokens as they are committed."""
    state = start(model, drafter, eos.tolist(), fallback, batch_size)
    on_tokens = None if streamer is None else lambda tokens, done: streamer.put(torch.tensor(tokens))
    rows = [
        add(state, prompt, max_new_tokens, sampling, generator, on_tokens)
        for prompt, generator in zip(prompts, generators, strict=True)
    ]
    while step(state):
        pass
    return rows


def step(state: Decoding) -> bool:
    """One step: cancelled rows leave, waiting prompts join while there is room, then every active row drafts, ONE
    target pass verifies them all, and each commits what it accepted. False when no row was left to decode."""
    drop_cancelled(state)
    admit(state)
    if not state.active:
        return False
    step_started = time.perf_counter()  # a step's time includes the drafter reading the last step's tokens
    observe(state)
    drafting = state.fallback.use_drafter()
    # a plain step (the fallback's, or no drafter at all) verifies each row's root alone: no trees to build
    trees, checks = draft(state) if drafting and not isinstance(state.drafter, NoDrafter) else (None, [])
    out = verify(state, trees)
    tokens_before = sum(row.length for row in state.active)
    going = accept_step(state, trees, out, drafting, checks)
    # tokens a row: a batch that shrank as rows finished is judged by its rows' pace, not by its fewer tokens
    committed = (sum(row.length for row in state.active) - tokens_before) / len(state.active)
    state.fallback.record(drafting, committed, time.perf_counter() - step_started)
    retire(state, going)
    return True


def drop_cancelled(state: Decoding) -> None:
    """Rows cancelled since the last step leave the queue, the batch, the cache and the drafter."""
    state.waiting = [row for row in state.waiting if not row.cancelled]
    going = [slot for slot, row in enumerate(state.active) if not row.cancelled]
    if len(going) < len(state.active):
        hidden, tokens = state.to_observe
        state.to_observe = ([hidden[slot] for slot in going], [tokens[slot] for slot in going])
        retire(state, going)


def first_stop(tokens: list[int], eos: frozenset[int]) -> int | None:
    """The index of the first EOS in `tokens`, or None."""
    return next((at for at, token in enumerate(tokens) if token in eos), None)


def commit(state: Decoding, row: Row, new: torch.Tensor, host_new: list[int]) -> bool:
    """Append accepted tokens (`new` on the device, `host_new` the same read back), cut after the first EOS as
    model.generate() stops there, and at most max_new_tokens in all; True when the row is done."""
    stop = first_stop(host_new, state.eos)
    count = min(len(host_new) if stop is None else stop + 1, row.budget)
    row.text[row.length : row.length + count] = new[:count]
    row.host_text[row.length : row.length + count] = host_new[:count]
    row.length += count
    row.stats.seconds = time.perf_counter() - row.started
    if stop is not None and stop < count:
        row.finish = "stop"
    elif row.budget <= 0:
        row.finish = "length"
    if row.on_tokens is not None:
        row.on_tokens(host_new[:count], row.finish is not None)
    return row.finish is not None


def admit(state: Decoding) -> None:
    """While there is room in the batch and prompts wait: prefill the next ones, a group of similar lengths at a time
    (prefill_groups), shortest first: a long prompt does not hold back the first tokens of short ones beside it."""
    while state.waiting and len(state.active) < state.batch_size:
        room = state.batch_size - len(state.active)
        rows, state.waiting = state.waiting[:room], state.waiting[room:]
        texts = [row.text[: row.length] for row in rows]
        prefix = shared_prefix(state, texts)
        skip = 0 if prefix is None else prefix.length
        longest = max(text.shape[0] for text in texts)
        for group in reversed(prefill_groups([text.shape[0] - skip for text in texts])):
            group = sorted(group)  # in the order they came
            join(state, [rows[slot] for slot in group], [texts[slot] for slot in group], prefix)
            if state.cache is not None:  # the groups after this one, and prompts joining later, join in place
                reserve_rows(state.cache, state.batch_size, longest)


def join(state: Decoding, rows: list[Row], texts: list[torch.Tensor], prefix: Prefix | None) -> None:
    """Prefill `rows`, commit each one's first token, and add those that go on to the batch (their cache rows, and
    the drafter's)."""
    started = time.perf_counter()
    cache, last_logits, hidden = prefill(state.model, texts, state.drafter, prefix)
    spent = time.perf_counter() - started
    going = []
    for slot, row in enumerate(rows):
        row.stats.target_seconds += spent
        row.stats.target_forwards += 1
        first = target_tokens(last_logits[slot][None], row.sampling, row.generator)
        row.stats.time_to_first_token = time.perf_counter() - row.started
        if not commit(state, row, first, first.tolist()):
            going.append(slot)
    if not going:  # every one of them ended at its first token
        return
    if len(going) < len(rows):
        keep_rows(cache, going)
        cache.crop(max(rows[slot].prompt_length for slot in going) - cache.get_seq_length())
    if state.active:
        append_rows(state.cache, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])
    else:  # the batch starts afresh: a new cache, and a drafter with no rows
        state.cache = cache
        state.drafter.reset(0)
    for slot in going:
        rows[slot].cached = rows[slot].prompt_length
        state.to_observe[0].append(hidden[slot])
        state.to_observe[1].append(rows[slot].text[1 : rows[slot].length])
    state.active += [rows[slot] for slot in going]
    _timed(state, state.drafter.add_rows, len(going))
    state.fallback.prompt_joined()


def shared_prefix(state: Decoding, prompts: list[torch.Tensor]) -> Prefix | None:
    """The prefix these prompts start with (state.prefix), learnt anew, by a pass of its own, when they share
    MIN_PREFIX tokens or more with each other or the prompt admitted before them; None: prefill them whole."""
    seen, state.last_prompt = prompts + state.last_prompt, prompts[-1:]
    if any(prompt.shape[0] > COMPILED_PREFILL_TOKENS for prompt in prompts):  # long prompts: no masks (prefill)
        return None
    if state.prefix is not None and all(state.prefix.starts(prompt) for prompt in prompts):
        return state.prefix
    if len(seen) < 2:
        return None
    # each prompt computes one token at least
    shared = min(shared_length(seen), *(prompt.shape[0] - 1 for prompt in prompts))
    if shared < MIN_PREFIX:
        return None
    cache, _, hidden = prefill(state.model, [prompts[0][:shared]], state.drafter)
    keys = [layer.keys.clone() for layer in cache.layers]
    values = [layer.values.clone() for layer in cache.layers]
    state.prefix = Prefix(prompts[0][:shared].clone(), keys, values, hidden[0])
    return state.prefix


def prefill_inputs(prompts: list[torch.Tensor], pad_token: int, dtype: torch.dtype):
    """Right-padded prompts: input_ids [B, P], position_ids [B, P] and an additive mask [B, 1, P, P] (causal
    within each prompt; a padding position sees only itself), or None when no prompt is padded (the model's own
    causal mask: a long prompt's mask would take P * P numbers)."""
    sizes, device = [p.shape[0] for p in prompts], prompts[0].device
    width = max(sizes)
    ids = torch.full((len(prompts), width), pad_token, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : prompt.shape[0]] = prompt
    positions = torch.arange(width, device=device).expand(len(prompts), -1)
    if all(size == width for size in sizes):
        return ids, positions, None
    return ids, positions, right_padded_mask(to_device(sizes, device), width, dtype)


def prefill(model, prompts: list[torch.Tensor], drafter: Drafter, prefix: Prefix | None = None):
    """Every prompt through the target, in groups of similar lengths (prefill_groups): returns the batch's cache
    (row b's prompt in entries [0, len_b)), each prompt's last logits [B, V], and each row's hidden states at the
    drafter's layers ({layer: [len_b, H]}). Through the compiled package when the model has one (prompts up to
    inference.compiled.COMPILED_PREFILL_TOKENS long), computing the logits of each prompt's last token only. With a
    `prefix` every prompt starts with, its entries are copied in and only the tokens after it computed."""
    layers = drafter.hidden_layers
    skip = 0 if prefix is None else prefix.length
    lengths = [p.shape[0] for p in prompts]
    width, count = max(lengths), len(prompts)
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    keys, values, last_logits, hidden = None, None, [None] * count, [None] * count
    for group in prefill_groups([length - skip for length in lengths]):
        # token 0 pads: any token would do, padding is masked off
        ids, positions, mask = prefill_inputs([prompts[row][skip:] for row in group], 0, model.dtype)
        ends = to_device([lengths[row] - skip - 1 for row in group], ids.device)
        last = to_device(sorted({lengths[row] - skip - 1 for row in group}), ids.device)  # only these logits
        group_cache = new_cache(model)
        if prefix is not None:
            prefix.fill(group_cache, len(group))
            positions = positions + skip
            if mask is None:  # no padding: causal over the prefix and the tokens after it
                mask = causal_mask(ids.shape[1], skip, model.dtype, ids.device).expand(len(group), -1, -1, -1)
            else:
                mask = prefix.mask(mask)
        out = decoding_pass(model)(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=group_cache,
            use_cache=True,
            output_hidden_states=bool(layers),
            **({"logits_to_keep": last} if takes_keep else {}),
        )
        columns = torch.searchsorted(last, ends) if takes_keep else ends
        if keys is None:  # the batch's cache, filled group by group
            keys = [
                layer.keys.new_zeros(count, layer.keys.shape[1], width, layer.keys.shape[3])
                for layer in group_cache.layers
            ]
            values = [
                layer.values.new_zeros(count, layer.values.shape[1], width, layer.values.shape[3])
                for layer in group_cache.layers
            ]
        index = to_device(group, ids.device)
        for layer, (k, v) in enumerate(zip(keys, values)):
            k[index, :, : skip + ids.shape[1]] = group_cache.layers[layer].keys
            v[index, :, : skip + ids.shape[1]] = group_cache.layers[layer].values
        for slot, row in enumerate(group):
            last_logits[row] = out.logits[slot, columns[slot]]
            hidden[row] = {layer: out.hidden_states[layer][slot, : lengths[row] - skip] for layer in layers}
            if prefix is not None:
                hidden[row] = {layer: torch.cat([prefix.hidden[layer], hidden[row][layer]]) for layer in layers}
    cache = new_cache(model)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache, torch.stack(last_logits), hidden


def observe(state: Decoding) -> None:
    """Tell the drafter what the target computed for the tokens each row committed since it last drafted."""
    hidden, tokens = state.to_observe
    if tokens:
        _timed(state, state.drafter.observe_rows, hidden, tokens)
        state.to_observe = ([], [])


@dataclass
class DeferredCheck:
    """A proposed chain's checks (tree_problems), read back with the step's outcome and raised before any commit."""

    problems: torch.Tensor
    proposed: Tree
    root: torch.Tensor
    drafter: str


def draft(state: Decoding) -> tuple[list[Tree], list[DeferredCheck]]:
    """Each row's tree for this step, checked and cut to what the row may still commit (the target adds its own
    token after the deepest accepted draft), and the checks still to read back: a tree built on the host
    (Tree.from_lists) is checked there, a chain's checks are read with the step's outcome (one host read a step), a
    branching tree's before its pass (a repeated sibling is dropped first)."""
    rows = state.active
    depths = [row.budget - 1 for row in rows]
    texts, host_texts = [row.text[: row.length] for row in rows], [row.host_text[: row.length] for row in rows]
    proposed = _timed(state, state.drafter.propose_rows, texts, depths, host_texts)
    name, vocab = drafter_name(state.drafter), state.model.config.vocab_size
    trees, checks, branching = [], [], []
    for slot, (tree, row, depth) in enumerate(zip(proposed, rows, depths)):
        root = row.text[row.length - 1]
        if isinstance(tree, Tree) and tree.host is not None:
            host_root = int(row.host_text[row.length - 1])
            trees.append(verifiable_host_tree(tree, host_root, root.device, vocab, depth, name))
        elif is_chain(tree):
            checked, problems = verifiable_chain(tree, root, vocab, depth, name)
            checks.append(DeferredCheck(problems, tree, root, name))
            trees.append(checked)
        else:
            branching.append((slot, root))
            trees.append(tree)
    if branching:  # every row's branching tree checked in one read
        slots, roots = zip(*branching)
        checked = verifiable_trees([trees[s] for s in slots], roots, vocab, [depths[s] for s in slots], name)
        for slot, tree in zip(slots, checked):
            trees[slot] = tree
    return trees, checks


def verify(state: Decoding, trees: list[Tree] | None):
    """ONE target pass over every row's tree (None: each row's root alone): each node sees its row's committed past
    and its own ancestors."""
    rows = state.active
    cached, cache_length = [row.cached for row in rows], state.cache.get_seq_length()
    if trees is None:
        roots = to_device([row.host_text[row.length - 1] for row in rows], rows[0].text.device)  # one transfer
        ids, positions, mask = root_inputs(roots, cached, cache_length, state.model.dtype)
    else:
        ids, positions, mask = tree_inputs(trees, cached, cache_length, 0, state.model.dtype)
    started = time.perf_counter()
    out = decoding_pass(state.model)(
        input_ids=ids,
        position_ids=positions,
        attention_mask=mask,
        cache=state.cache,
        use_cache=True,
        output_hidden_states=bool(state.drafter.hidden_layers),
    )
    spent = time.perf_counter() - started
    for slot, row in enumerate(rows):
        row.stats.target_seconds += spent
        row.stats.target_forwards += 1
        row.stats.tree_nodes += 1 if trees is None else trees[slot].size
    return out


def root_inputs(roots: torch.Tensor, cached: list[int], cache_length: int, dtype: torch.dtype):
    """tree_inputs for one node a row, its root (roots [B]), built at once for all rows: input_ids [B, 1],
    position_ids [B, 1] and the additive mask [B, 1, 1, cache_length + 1]."""
    past = to_device(cached, roots.device)
    columns = torch.arange(cache_length + 1, device=roots.device)
    allowed = (columns < past[:, None]) | (columns == cache_length)
    return roots[:, None], past[:, None], additive_mask(allowed[:, None], dtype)[:, None]


def tree_inputs(trees: list[Tree], cached: list[int], cache_length: int, pad_token: int, dtype: torch.dtype):
    """One verification pass for every row's tree, appended after `cache_length` cache entries.

    Returns input_ids [B, N], position_ids [B, N] and an additive mask [B, 1, N, cache_length + N]: row b's node
    sees the row's own committed entries ([0, cached[b])), itself and its ancestors; padding nodes see only
    themselves (any real token pads: padding is masked off everywhere)."""
    device = trees[0].tokens.device
    width = max(tree.size for tree in trees)
    ids = torch.full((len(trees), width), pad_token, dtype=torch.long, device=device)
    positions = torch.zeros((len(trees), width), dtype=torch.long, device=device)
    allowed = torch.zeros((len(trees), width, cache_length + width), dtype=torch.bool, device=device)
    nodes = torch.arange(width, device=device)
    allowed[:, nodes, cache_length + nodes] = True
    for row, (tree, past) in enumerate(zip(trees, cached)):
        n = tree.size
        ids[row, :n] = tree.tokens
        positions[row, :n] = tree.depth + past
        positions[row, n:] = past
        allowed[row, :n, :past] = True
        allowed[row, :n, cache_length : cache_length + n] = tree.ancestors
    return ids, positions, additive_mask(allowed, dtype)[:, None]


def accept_step(
    state: Decoding, trees: list[Tree] | None, out, drafting: bool, checks: list[DeferredCheck]
) -> list[int]:
    """Each row's accepted path and new tokens (trees None: each row verified its root alone): committed, their
    cache entries moved into place, and their hidden states kept for the drafter. Returns the slots of the rows that
    go on.

    The step's one host read: every row's accepted depth and new tokens (and the deferred checks of proposed chains),
    read back together; on a GPU each read waits for the device."""
    rows = state.active
    # [B, N]: one argmax for all rows, when any row decodes greedily
    greedy = greedy_tokens(out.logits) if any(row.sampling.greedy for row in rows) else None
    if (trees is None or all(tree.size == 1 for tree in trees)) and all(row.sampling.greedy for row in rows):
        return accept_roots_greedy(state, greedy[:, 0], out, drafting, checks)
    if trees is None:  # each row's root alone, some rows sampling
        trees = [Tree.chain(row.text[row.length - 1 : row.length]) for row in rows]
    # a greedy row's tree built on the host is accepted there (greedy_path), from the target's token at every node
    on_host = [row.sampling.greedy and tree.host is not None for row, tree in zip(rows, trees)]
    outcomes, reads = [], []
    for slot, (row, tree) in enumerate(zip(rows, trees)):
        if on_host[slot]:
            outcomes.append(None)
            reads.append(greedy[slot, : tree.size])
            continue
        if row.sampling.greedy:
            order, deepest, new = accept_chosen(tree, greedy[slot, : tree.size])
        else:
            order, deepest, new = accept(tree, out.logits[slot, : tree.size], row.sampling, row.generator)
        outcomes.append((order, new))
        # its accepted depth and deepest node, and the new tokens (the accepted path's, then the target's own)
        reads += [torch.stack([tree.depth[deepest], deepest]), new[: tree.max_depth + 1]]
    values = torch.cat(reads + [check.problems.long() for check in checks]).tolist()
    at, depths, deepest, news = 0, [], [], []
    for slot, tree in enumerate(trees):
        if on_host[slot]:
            chosen = values[at : at + tree.size]
            path = greedy_path(*tree.host, chosen)
            depths.append(len(path) - 1)
            deepest.append(path[-1])
            news.append([chosen[node] for node in path])  # each accepted draft is the target's token at its parent
            both = to_device(path + news[-1], tree.tokens.device)  # the path's nodes and the new tokens
            outcomes[slot] = (both[: len(path)], both[len(path) :])
            at += tree.size
            continue
        depths.append(values[at])
        deepest.append(values[at + 1])
        news.append(values[at + 2 : at + tree.max_depth + 3])
        at += tree.max_depth + 3
    raise_deferred(state, checks, values[at:])
    paths, going = [], []
    for slot, (row, tree, (order, new), depth, host_new) in enumerate(zip(rows, trees, outcomes, depths, news)):
        path = order[: depth + 1]
        paths.append(path)
        row.stats.plain_steps += not drafting
        row.stats.count_depths(tree.max_depth, depth)
        if not commit(state, row, new, host_new[: depth + 1]):
            going.append(slot)
            state.to_observe[0].append(
                {layer: out.hidden_states[layer][slot, path] for layer in state.drafter.hidden_layers}
            )
            state.to_observe[1].append(new[: depth + 1])
    cache_length = state.cache.get_seq_length() - max(tree.size for tree in trees)  # before this step's trees
    cached = keep_paths(state.cache, [row.cached for row in rows], cache_length, paths, deepest)
    for row, length in zip(rows, cached):
        row.cached = length
    return going


def accept_roots_greedy(state: Decoding, tokens: torch.Tensor, out, drafting: bool, checks: list[DeferredCheck]):
    """accept_step for a step of one node a row (a plain step, or a drafter that drafted nothing) whose rows all
    decode greedily: each row commits the target's token (`tokens` [B]), all read back at once with the proposed
    chains' checks, without a tree's acceptance per row."""
    rows, going = state.active, []
    values = torch.cat([tokens] + [check.problems.long() for check in checks]).tolist()
    raise_deferred(state, checks, values[len(rows) :])
    for slot, (row, token) in enumerate(zip(rows, values)):
        row.stats.plain_steps += not drafting
        row.stats.count_depths(0, 0)
        new = tokens[slot : slot + 1]
        if not commit(state, row, new, [token]):
            going.append(slot)
            hidden = {layer: out.hidden_states[layer][slot, :1] for layer in state.drafter.hidden_layers}
            state.to_observe[0].append(hidden)
            state.to_observe[1].append(new)
    cache_length = state.cache.get_seq_length() - 1  # before this step's one node a row
    for row, length in zip(rows, keep_new_entries(state.cache, [row.cached for row in rows], cache_length)):
        row.cached = length
    return going


def raise_deferred(state: Decoding, checks: list[DeferredCheck], flags: list[int]) -> None:
    """Raise what the proposed chains' checks found: `flags`, their problems as read back, five a check."""
    for at, check in enumerate(checks):
        problems = flags[5 * at : 5 * at + 5]
        raise_tree_problems(problems, check.proposed, check.root, state.model.config.vocab_size, check.drafter)


def retire(state: Decoding, going: list[int]) -> None:
    """Only the rows in `going` (slots of the active rows; state.to_observe holds one entry for each, in that order)
    stay in the batch, the cache and the drafter. A finished row's slot takes the last row, so that one row's cache
    entries move instead of every row after it (docs/experiments.md, row X28)."""
    if len(going) == len(state.active):
        return
    order = last_rows_forward(going)
    at = {slot: position for position, slot in enumerate(going)}
    hidden, tokens = state.to_observe
    state.to_observe = ([hidden[at[slot]] for slot in order], [tokens[at[slot]] for slot in order])
    state.active = [state.active[slot] for slot in order]
    if order:
        keep_rows(state.cache, order)
        state.cache.crop(max(row.cached for row in state.active) - state.cache.get_seq_length())
        _timed(state, state.drafter.keep_rows, order)
    else:  # every row finished: the prompts still to come start afresh (admit), with a new cache and drafter state
        state.cache = None


def last_rows_forward(going: list[int]) -> list[int]:
    """The slots in `going` (ascending) in the order that moves fewest rows: each slot that stays keeps its place,
    and the places of those that leave take the last rows."""
    count, staying = len(going), set(going)
    incoming = iter(slot for slot in going if slot >= count)  # as many as the places left below `count`
    return [slot if slot in staying else next(incoming) for slot in range(count)]


def _timed(state: Decoding, work, *args):
    """Run drafter work, its time counted for every active row."""
    started = time.perf_counter()
    result = work(*args)
    spent = time.perf_counter() - started
    for row in state.active:
        row.stats.draft_seconds += spent
    return result
