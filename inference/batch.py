"""Many prompts at once: each row drafts its own tree, ONE target pass verifies all of them, each row keeps its own
accepted entries in a shared, ragged KV cache, and each row's output is what it would be alone.

The cache holds, for row b, its committed tokens but the last in entries [0, cached[b]); entries past that are
stale (a shorter row's padding, rejected drafts) and every query is masked off them. A step appends all rows'
trees at the same cache index (padded to the largest tree; a padding node sees only itself, so nothing is ever
computed from nothing); each row's accepted path then moves to its own `cached[b]`, and the cache is cropped to
the longest row. Rows that finish leave the batch and stop costing work; while prompts wait beyond the batch
size, the next ones are prefilled and join it (their cache rows appended, padded with masked entries).
"""

from __future__ import annotations

import inspect
import time

import torch

from .accept import Sampling, accept, accept_chosen, greedy_tokens, target_tokens
from .cache import append_rows, keep_paths, keep_rows, new_cache
from .compiled import decoding_pass
from .drafters import drafter_name
from .fallback import Fallback
from .padding import prefill_groups, right_padded_mask
from .tree import Tree, additive_mask, verifiable_tree


def prefill_inputs(prompts: list[torch.Tensor], pad_token: int, dtype: torch.dtype):
    """Right-padded prompts: input_ids [B, P], position_ids [B, P] and an additive mask [B, 1, P, P] (causal
    within each prompt; a padding position sees only itself)."""
    lengths = torch.tensor([p.shape[0] for p in prompts], device=prompts[0].device)
    width = int(lengths.max())
    ids = torch.full((len(prompts), width), pad_token, dtype=torch.long, device=lengths.device)
    for row, prompt in enumerate(prompts):
        ids[row, : prompt.shape[0]] = prompt
    positions = torch.arange(width, device=lengths.device).expand(len(prompts), -1)
    return ids, positions, right_padded_mask(lengths, width, dtype)


def prefill(model, prompts: list[torch.Tensor], pad_token: int, hidden_layers: tuple[int, ...]):
    """Every prompt through the target, in groups of similar lengths (prefill_groups): returns the batch's cache
    (row b's prompt in entries [0, len_b)), each prompt's last logits [B, V], and each row's hidden states at
    `hidden_layers` ({layer: [len_b, H]})."""
    lengths = [p.shape[0] for p in prompts]
    width, rows = max(lengths), len(prompts)
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    keys, values, last_logits, hidden = None, None, [None] * rows, [None] * rows
    for group in prefill_groups(lengths):
        ids, positions, mask = prefill_inputs([prompts[row] for row in group], pad_token, model.dtype)
        ends = torch.tensor([lengths[row] - 1 for row in group], device=ids.device)
        last = ends.unique()  # sorted: only the prompts' last logits are computed
        group_cache = new_cache(model)
        out = model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=group_cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            **({"logits_to_keep": last} if takes_keep else {}),
        )
        columns = torch.searchsorted(last, ends) if takes_keep else ends
        if keys is None:  # the batch's cache, filled group by group
            keys = [
                layer.keys.new_zeros(rows, layer.keys.shape[1], width, layer.keys.shape[3])
                for layer in group_cache.layers
            ]
            values = [
                layer.values.new_zeros(rows, layer.values.shape[1], width, layer.values.shape[3])
                for layer in group_cache.layers
            ]
        index = torch.tensor(group, device=ids.device)
        for layer, (k, v) in enumerate(zip(keys, values)):
            k[index, :, : ids.shape[1]] = group_cache.layers[layer].keys
            v[index, :, : ids.shape[1]] = group_cache.layers[layer].values
        for slot, row in enumerate(group):
            last_logits[row] = out.logits[slot, columns[slot]]
            hidden[row] = {layer: out.hidden_states[layer][slot, : lengths[row]] for layer in hidden_layers}
    cache = new_cache(model)
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache, torch.stack(last_logits), hidden


def tree_inputs(trees: list[Tree], cached: list[int], cache_length: int, pad_token: int, dtype: torch.dtype):
    """One verification pass for every row's tree, appended after `cache_length` cache entries.

    Returns input_ids [B, N], position_ids [B, N] and an additive mask [B, 1, N, cache_length + N]: row b's node
    sees the row's own committed entries ([0, cached[b])), itself and its ancestors; padding nodes see only
    themselves."""
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


def decode_batch(
    model,
    drafter,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    sampling: Sampling,
    generators: list,
    eos: torch.Tensor,
    plain: Fallback,
    batch_size: int,
):
    """The loop: returns each row's new tokens, its target passes, the nodes its trees verified, the seconds spent
    drafting (for all rows at once: `drafter` drafts the whole batch, one head pass a level), and the steps taken
    without drafting (`plain` judges the batch as it would one sequence, by its tokens per row per second).

    At most `batch_size` rows decode at once: as rows finish, the next prompts are prefilled and join the batch
    (continuous batching), so a batch does not idle on its slowest row while prompts wait."""
    count, pad = len(prompts), int(prompts[0][0])  # any real token pads: padding is masked off everywhere
    step_pass = decoding_pass(model)  # the prefill stays eager (inference.compiled)
    dtype = model.dtype
    out_tokens = [[] for _ in range(count)]
    passes, nodes, draft_seconds = [0] * count, [0] * count, 0.0
    # each row's text (prompt + new tokens) in a buffer of its final size, as generate() keeps one sequence's
    texts = [torch.empty(p.shape[0] + max_new_tokens, dtype=torch.long, device=p.device) for p in prompts]
    ends = [p.shape[0] for p in prompts]
    for text, prompt in zip(texts, prompts):
        text[: prompt.shape[0]] = prompt

    def append(row: int, new: torch.Tensor) -> None:
        texts[row][ends[row] : ends[row] + new.shape[0]] = new
        ends[row] += new.shape[0]
        out_tokens[row] += new.tolist()

    def admit(rows: list[int]):
        """Prefill these prompts and take each one's first token; returns the cache of the rows that go on
        decoding, those rows, their cached lengths (the prompt, not the first token) and what the drafter is to
        observe of them: their hidden states and tokens."""
        cache, last_logits, hidden = prefill(model, [prompts[row] for row in rows], pad, drafter.hidden_layers)
        going = []
        for slot, row in enumerate(rows):
            first = target_tokens(last_logits[slot][None], sampling, generators[row])
            passes[row] += 1
            append(row, first)
            if not bool(torch.isin(first, eos).any()) and max_new_tokens > 1:
                going.append(row)
        going, lengths = _shrink(cache, rows, going, [prompts[row].shape[0] for row in rows])
        return (
            cache,
            going,
            lengths,
            [hidden[rows.index(row)] for row in going],
            [texts[row][1 : ends[row]] for row in going],
        )

    waiting = list(range(count))  # prompts not started yet, in order
    active, cached, cache = [], [], None  # the rows decoding, and (by slot) how many entries of theirs the cache holds
    observed, committed = [], []  # what the drafter is to observe for each active row
    drafter.reset(0)
    plain_steps = 0
    while True:
        while waiting and len(active) < batch_size:
            joining, waiting = waiting[: batch_size - len(active)], waiting[batch_size - len(active) :]
            joined_cache, joined, joined_cached, joined_observed, joined_committed = admit(joining)
            if not joined:  # every one of them ended at its first token
                continue
            if active:
                append_rows(
                    cache,
                    [layer.keys for layer in joined_cache.layers],
                    [layer.values for layer in joined_cache.layers],
                )
            else:
                cache = joined_cache
            active, cached = active + joined, cached + joined_cached
            observed, committed = observed + joined_observed, committed + joined_committed
            started = time.perf_counter()
            drafter.add_rows(len(joined))
            draft_seconds += time.perf_counter() - started
            plain.prompt_joined()
        if not active:
            break
        started = time.perf_counter()
        if observed:
            drafter.observe_rows(observed, committed)
            observed, committed = [], []
        step_started = time.perf_counter()
        draft_seconds += step_started - started
        started = step_started
        drafting = plain.use_drafter()
        if drafting:
            budgets = [max_new_tokens - len(out_tokens[row]) for row in active]
            proposed = drafter.propose_rows(
                [texts[row][: ends[row]] for row in active], [budget - 1 for budget in budgets]
            )
            trees = [
                verifiable_tree(
                    tree, texts[row][ends[row] - 1], model.config.vocab_size, budget - 1, drafter_name(drafter)
                )
                for tree, row, budget in zip(proposed, active, budgets)
            ]
        else:
            trees = [Tree.chain(texts[row][ends[row] - 1 : ends[row]]) for row in active]
            plain_steps += 1
        draft_seconds += time.perf_counter() - started
        step_tokens = sum(ends[row] for row in active)
        length = cache.get_seq_length()
        ids, positions, mask = tree_inputs(trees, cached, length, pad, dtype)
        out = step_pass(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(drafter.hidden_layers),
        )
        paths, still, slots = [], [], []
        greedy = greedy_tokens(out.logits) if sampling.greedy else None  # [B, N]: one argmax for all rows
        for slot, row in enumerate(active):
            tree = trees[slot]
            if greedy is not None:
                path, new = accept_chosen(tree, greedy[slot, : tree.size])
            else:
                path, new = accept(tree, out.logits[slot, : tree.size], sampling, generators[row])
            passes[row] += 1
            nodes[row] += tree.size
            stops = torch.isin(new, eos).nonzero()
            done = bool(stops.shape[0])
            if done:
                new = new[: int(stops[0]) + 1]
            new = new[: max_new_tokens - len(out_tokens[row])]
            append(row, new)
            paths.append(path)
            if not done and len(out_tokens[row]) < max_new_tokens:
                still.append(row)
                slots.append(slot)
                observed.append({layer: out.hidden_states[layer][slot, path] for layer in drafter.hidden_layers})
                committed.append(new)
        cached = keep_paths(cache, cached, length, paths)
        if len(slots) < len(active):  # keeping every row would copy the draft cache for nothing
            started = time.perf_counter()
            drafter.keep_rows(slots)
            draft_seconds += time.perf_counter() - started
        # tokens a row: a batch that shrank as rows finished is judged by its rows' pace, not by its fewer tokens
        plain.record(
            drafting, (sum(ends[row] for row in active) - step_tokens) / len(active), time.perf_counter() - step_started
        )
        active, cached = _shrink(cache, active, still, cached)
    return out_tokens, passes, nodes, draft_seconds, plain_steps


def _shrink(cache, active: list[int], still: list[int], cached: list[int]) -> tuple[list[int], list[int]]:
    """Keep only the rows in `still` (a subsequence of `active`) in the cache; returns them and their cached lengths."""
    if len(still) == len(active):
        return active, list(cached)
    slots = [active.index(row) for row in still]
    cached = [cached[slot] for slot in slots]
    if slots:
        keep_rows(cache, torch.tensor(slots, device=cache.layers[0].keys.device))
        cache.crop(max(cached) - cache.get_seq_length())
    return still, cached
