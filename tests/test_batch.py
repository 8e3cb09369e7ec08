"""generate() over a list of prompts (inference.loop): every row is what that prompt gives alone."""

from __future__ import annotations

import pytest
import torch

from conftest import EOS, hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, EarlyExitConfig, EarlyExitHead, LayerShape, MedusaConfig, MedusaHeads
from inference import DynamicTreeSpec, PromptLookupDrafter, SequenceDrafter, Tree, generate
from inference.loop import prefill_inputs, root_inputs, tree_inputs
from inference.numerics import near_tie
from test_exactness_tiny import FP32_TIE_STEPS, first_divergence, random_prompts

NEW_TOKENS = 30


def test_tree_inputs_keep_rows_apart():
    """Row 0 (2 cached entries, a 3-node chain) and row 1 (4 cached, a root and two children) after a cache of 4."""
    chain = Tree.chain(torch.tensor([5, 6, 7]))
    fork = Tree.from_parents(torch.tensor([8, 9, 10]), torch.tensor([-1, 0, 0]))
    root = Tree.chain(torch.tensor([11]))
    ids, positions, mask = tree_inputs([chain, fork, root], [2, 4, 3], 4, pad_token=0, dtype=torch.float32)
    allowed = mask[:, 0] == 0
    assert ids.tolist() == [[5, 6, 7], [8, 9, 10], [11, 0, 0]]
    assert positions.tolist() == [[2, 3, 4], [4, 5, 5], [3, 3, 3]]
    # row 0: its own two committed entries (not the stale two after them), then its chain
    assert allowed[0].tolist() == [[1, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 1]]
    # row 1: siblings do not see each other
    assert allowed[1].tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]]
    # row 2: padding nodes see only themselves, so they never compute from nothing and never leak
    assert allowed[2].tolist() == [[1, 1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 1]]


def test_a_plain_steps_inputs_are_those_of_one_node_trees():
    """root_inputs builds at once for all rows what tree_inputs builds from each row's one-node tree."""
    roots, cached = torch.tensor([11, 12, 13]), [2, 5, 0]
    expected = tree_inputs([Tree.chain(root[None]) for root in roots], cached, 5, 0, torch.bfloat16)
    for got, want in zip(root_inputs(roots, cached, 5, torch.bfloat16), expected, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)


def test_prefill_inputs_pad_on_the_right():
    ids, positions, mask = prefill_inputs(
        [torch.tensor([4, 5, 6]), torch.tensor([7])], pad_token=4, dtype=torch.float32
    )
    allowed = mask[:, 0] == 0
    assert ids.tolist() == [[4, 5, 6], [7, 4, 4]] and positions.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert allowed[0].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert allowed[1].tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


def test_keep_paths_moves_each_rows_path_to_its_own_end():
    from transformers import DynamicCache

    from inference.cache import keep_paths

    cache = DynamicCache()
    entries = torch.arange(2 * 7, dtype=torch.float32).view(2, 1, 7, 1)  # 2 rows, 4 cached entries + a 3-node block
    cache.update(entries.clone(), -entries.clone(), 0)
    kept = keep_paths(cache, [2, 4], 4, [torch.tensor([0, 2]), torch.tensor([0, 1, 2])])
    assert kept == [4, 7] and cache.get_seq_length() == 7
    keys = cache.layers[0].keys[:, 0, :, 0]
    assert keys[0, :4].tolist() == [0, 1, 4, 6]  # row 0: its 2 entries, then nodes 0 and 2 of its block
    assert keys[1].tolist() == list(range(7, 14))  # row 1: the whole chain accepted, already in place
    assert torch.equal(cache.layers[0].values, -cache.layers[0].keys)


def heads_for(model):
    torch.manual_seed(1)
    # reduced draft vocabularies: rows draft their own prompt's and output's tokens too (inference.context_vocab)
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3, draft_vocab_size=48))
    sequential = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3, num_layers=2, sequential=True))
    # Hydra++'s prefix layer keeps a cache of the committed text: ragged rows, rows joining and leaving
    prefix = MedusaHeads(
        MedusaConfig.for_target(
            model.config, num_heads=3, sequential=True, prefix_layer=LayerShape.for_target(model.config)
        )
    )
    for p in [*medusa.parameters(), *sequential.parameters(), *prefix.parameters()]:
        torch.nn.init.normal_(p, std=0.05)  # not the zero init: drafts should vary
    eagle = EagleHead(
        EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True, draft_vocab_size=48)
    ).eval()
    eagle3 = EagleHead(
        EagleConfig.for_target(model.config, architecture="eagle3", feature_layers=[0, 1], draft_vocab_size=48)
    ).eval()
    exit_head = EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=1, lora_rank=None), model).eval()
    tree = DynamicTreeSpec(depth=4, top_k=3, nodes=10)
    return {
        "plain": (None, None),
        "lookup": (PromptLookupDrafter(max_ngram=2), None),
        "medusa": (medusa.eval(), DynamicTreeSpec(depth=3, top_k=3, nodes=8)),
        "medusa-sequential": (sequential.eval(), DynamicTreeSpec(depth=3, top_k=3, nodes=8)),
        "medusa-prefix": (prefix.eval(), DynamicTreeSpec(depth=3, top_k=3, nodes=8)),
        "eagle-copy": (eagle, tree),
        "eagle3-layout": (eagle3, tree),
        "early-exit": (exit_head, tree),
        "eagle+lookup": ([eagle, PromptLookupDrafter()], DynamicTreeSpec(depth=3, top_k=2, nodes=6)),
    }


@pytest.fixture(
    scope="module", params=[("llama", "sdpa", 21), ("qwen2", "eager", 22)], ids=["llama-sdpa", "qwen2-eager"]
)
def case(request):
    family, attn, seed = request.param
    model = tiny_model(family, attn=attn)
    prompts = random_prompts(model.config.vocab_size, 50, seed=seed)
    return model, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_every_row_matches_hf_greedy_alone(case):
    """50 prompts of mixed lengths, every drafter: half in batches of 1 to 8, the rest in one call that decodes 4 at
    a time (a prompt joins as another finishes) and one that decodes them one at a time (every row finishes before
    the next prompt starts). A float32 divergence passes only where it is proven a near-tie of the target (a batched
    pass sums in another order), and rarely."""
    model, prompts, references = case
    mismatches, near_ties, finished_early = [], [], 0
    calls = [(1, None), (8, None), (3, None), (5, None), (2, None), (6, None), (21, 4), (4, 1)]  # (prompts, batch_size)
    for name, (heads, tree) in heads_for(model).items():
        start = 0
        for size, batch_size in calls:
            batch = slice(start, start + size)
            outs = generate(
                model,
                heads,
                [p.tolist() for p in prompts[batch]],
                max_new_tokens=NEW_TOKENS,
                tree=tree,
                lookup=False,
                fallback=False,
                batch_size=batch_size,
            )
            assert len(outs) == size
            for offset, (out, reference) in enumerate(zip(outs, references[batch])):
                finished_early += len(reference) < NEW_TOKENS
                if out.token_ids == reference:
                    continue
                prompt, d = prompts[start + offset], first_divergence(out.token_ids, reference)
                tie = (
                    d < min(len(out.token_ids), len(reference))
                    and near_tie(
                        model, prompt.tolist() + reference[:d], out.token_ids[d], reference[d], FP32_TIE_STEPS
                    )[0]
                )
                (near_ties if tie else mismatches).append((name, start + offset, d))
            start += size
    assert not mismatches, mismatches[:5]
    assert len(near_ties) <= 2, near_ties
    assert finished_early > 0  # some rows stop at EOS while the others go on


def test_rows_stop_on_their_own():
    """One token each (the prefill's), and rows that stop at EOS beside rows that run to max_new_tokens."""
    model = tiny_model("llama")
    prompts = random_prompts(model.config.vocab_size, 12, seed=5)
    references = [hf_greedy(model, p, 1) for p in prompts]
    assert [
        o.token_ids
        for o in generate(model, PromptLookupDrafter(), [p.tolist() for p in prompts], max_new_tokens=1, lookup=False)
    ] == references
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert any(ref[-1] == EOS and len(ref) < NEW_TOKENS for ref in references) and any(
        len(ref) == NEW_TOKENS for ref in references
    )
    outs = generate(
        model, PromptLookupDrafter(), [p.tolist() for p in prompts], max_new_tokens=NEW_TOKENS, lookup=False
    )
    assert [o.token_ids for o in outs] == references


def test_sampling_rows_are_seeded_as_alone():
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 5, 6], [8, 9], [10, 11, 12, 13]]
    alone = [
        generate(
            model, PromptLookupDrafter(), p, max_new_tokens=20, temperature=1.0, seed=7, lookup=False, fallback=False
        ).token_ids
        for p in prompts
    ]
    # the draws a step makes depend on its tree, so both sides draft at every step (the fallback's choice is timed)
    together = generate(
        model, PromptLookupDrafter(), prompts, max_new_tokens=20, temperature=1.0, seed=7, lookup=False, fallback=False
    )
    assert [o.token_ids for o in together] == alone
    in_turn = generate(
        model,
        PromptLookupDrafter(),
        prompts,
        max_new_tokens=20,
        temperature=1.0,
        seed=7,
        lookup=False,
        fallback=False,
        batch_size=2,
    )
    assert [o.token_ids for o in in_turn] == alone


def test_bad_batches_are_refused_clearly():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, None, [])
    with pytest.raises(ValueError, match="prompt 1 of the batch is empty"):
        generate(model, None, [[5, 6], []])
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            generate(model, None, [[5, 6], [7]], batch_size=bad)

    class Counting(SequenceDrafter):  # a drafter of one sequence, with state
        def reset(self, rows=1):
            self.steps = 0

        def propose(self, tokens, max_depth):
            self.steps += 1
            return Tree.chain(tokens[-1:])

    with pytest.raises(ValueError, match="Counting drafts for one sequence at a time and cannot serve a batch"):
        generate(model, Counting(), [[5, 6], [7]])
    assert len(generate(model, Counting(), [5, 6], max_new_tokens=3).token_ids) == 3  # one sequence: fine


def test_prefill_groups_keep_padding_small():
    from inference.padding import prefill_groups

    assert prefill_groups([50, 52, 400, 48]) == [[2], [1, 0, 3]]  # the long prompt alone, the short ones together
    assert prefill_groups([10, 10, 10]) == [[0, 1, 2]]
    assert sorted(row for group in prefill_groups([7, 300, 9, 120, 118, 5]) for row in group) == list(range(6))


@pytest.mark.parametrize("kind", ["eagle-copy", "early-exit", "medusa", "medusa-sequential"])
def test_a_batch_drafts_what_each_row_drafts_alone(kind):
    """The batched drafter (one ragged draft cache, one head pass a level for all rows) against one drafter per
    row: the same head state for every row and the same trees, after rows of different lengths observed different
    numbers of tokens, one row left the batch and another joined it."""
    from inference.drafters import as_drafter

    model = tiny_model("llama", eos=None)
    heads, tree = heads_for(model)[kind]
    prompts = random_prompts(model.config.vocab_size, 3, seed=9)
    prompts.append(torch.randint(4, 90, (70,), generator=torch.Generator().manual_seed(3)))  # longer than the others
    prompts.append(torch.randint(4, 90, (3,), generator=torch.Generator().manual_seed(4)))  # shorter than any
    texts = [p.clone() for p in prompts]
    batch = as_drafter(heads, model, tree)
    alone = [as_drafter(heads, model, tree) for _ in prompts]
    batch.reset(3)

    def observe(rows, counts, first=()):
        """Each row commits counts[row] tokens; the drafters see the target's states that produced them (for the
        rows in `first`, just prefilled: the whole prompt's)."""
        hidden, tokens = [], []
        for row, count in zip(rows, counts):
            old = texts[row].shape[0]
            texts[row] = torch.cat(
                [texts[row], torch.randint(4, 90, (count,), generator=torch.Generator().manual_seed(row + 10 * count))]
            )
            with torch.no_grad():
                states = model(texts[row][None], output_hidden_states=True).hidden_states
            start, end = 0 if row in first else old - 1, old - 1 + count
            hidden.append({layer: states[layer][0, start:end] for layer in batch.hidden_layers})
            tokens.append(texts[row][start + 1 : end + 1])
        batch.observe_rows(hidden, tokens)
        for row, row_hidden, row_tokens in zip(rows, hidden, tokens):
            alone[row].observe(row_hidden, row_tokens)

    def compare(rows):
        with torch.no_grad():
            trees = batch.propose_rows([texts[row] for row in rows], [4] * len(rows))
            for slot, row in enumerate(rows):
                own = alone[row].propose(texts[row], 4)
                assert torch.equal(trees[slot].tokens, own.tokens) and torch.equal(trees[slot].parents, own.parents), (
                    kind,
                    row,
                )
                if kind != "medusa":
                    torch.testing.assert_close(batch.last[slot], alone[row].last[0], atol=1e-5, rtol=1e-4)

    observe([0, 1, 2], [1, 1, 1], first=(0, 1, 2))  # the prefill
    compare([0, 1, 2])
    observe([0, 1, 2], [1, 4, 2])  # each row accepted a different number of tokens
    compare([0, 1, 2])
    batch.keep_rows([0, 2])  # row 1 finished
    observe([0, 2], [3, 1])
    compare([0, 2])
    batch.keep_rows([0, 1])  # both go on (slots, not prompts)
    batch.add_rows(2)  # prompts 3 and 4 join: one longer than what the others' caches hold, one shorter
    observe([0, 2, 3, 4], [2, 1, 1, 1], first=(3, 4))
    compare([0, 2, 3, 4])
    observe([0, 2, 3, 4], [1, 3, 2, 2])
    compare([0, 2, 3, 4])
