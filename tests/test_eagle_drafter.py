"""The EAGLE drafter's incremental state (its own KV cache, tree attention inside the head) equals a
from-scratch recomputation of the head: what it drafts is what the head would draft."""

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import NO_COPY, DraftVocabulary, EagleConfig, EagleHead, copy_embedding, copy_tokens
from inference import DynamicTreeSpec, EagleDrafter, Tree, generate
from inference.bigrams import BigramTable, RowBigrams, bigram_table, draft_copies
from inference.drafters.draft_nodes import DraftNodes
from inference.drafters.dynamic import drafted_nodes


def recompute(head, model, tokens, draft_tokens, skipped=0):
    """Head outputs along committed tokens then a draft path, without any cache: the reference. `skipped`: the first
    pairs the head never read (a long prompt's start); the rest sit at positions from 0."""
    layers = head.config.feature_layers
    with torch.no_grad():
        hidden = model(tokens[None], output_hidden_states=True).hidden_states
        features = head.fuse_features(torch.cat([hidden[layer][0, :-1] for layer in layers], dim=-1))[
            skipped:
        ]  # the target's, x_0..x_{n-2}
        inputs = tokens[1:]
        out = None
        for step in range(len(draft_tokens) + 1):
            if step:
                features = torch.cat([features, out[-1:]])  # the head feeds its own prediction back
                inputs = torch.cat([inputs, draft_tokens[step - 1 : step]])
            embeds = model.get_input_embeddings()(inputs[skipped:])
            copies = None
            if head.config.copy_input:  # as training computes them: over the whole text at once
                text = torch.cat([tokens[:1], inputs]).tolist()
                copies = copy_embedding(model.get_input_embeddings(), torch.tensor(copy_tokens(text)[skipped:]))[None]
            positions = torch.arange(len(inputs) - skipped)[None]
            out = head(features[None], embeds[None], copies, position_ids=positions)[0]
    return out[-1]


class CheckedEagleDrafter(EagleDrafter):
    """Checks, at every step, the head's state and every head output that a drafted node came from."""

    checked_nodes = 0

    def _top(self, features, k):
        self.seen.append(features.reshape(-1, features.shape[-1]).clone())
        return super()._top(features, k)

    def propose_rows(self, texts, max_depths, host_texts=None):  # what the loop calls: one row here
        (tokens,) = texts
        # what propose does first: the head reads the pairs observed since the last step
        self._read_committed([tokens], [tokens.numpy()])
        torch.testing.assert_close(
            self.last[0],
            recompute(self.head, self.model, tokens, tokens[:0], self.rows[0].skipped),
            atol=1e-5,
            rtol=1e-4,
        )
        self.seen = []
        (tree,) = super().propose_rows(texts, max_depths, host_texts)
        if tree.size == 1:  # nothing drafted at the last step
            return [tree]
        seen = torch.cat(self.seen)
        lm_head = self.model.get_output_embeddings()
        for node in range(1, tree.size):
            parent_path = tree.ancestors[tree.parents[node]].nonzero().flatten()[1:]  # root excluded
            expected = recompute(self.head, self.model, tokens, tree.tokens[parent_path], self.rows[0].skipped)
            # the head output the node was drawn from was computed exactly (same positions, same mask) ...
            assert torch.isclose(seen, expected, atol=1e-5, rtol=1e-4).all(-1).any(), (
                f"node {node}: no matching head output"
            )
            # ... and the node is one of its top-k
            assert tree.tokens[node] in lm_head(expected).topk(self.spec.top_k).indices
            self.checked_nodes += 1
        return [tree]


def test_copy_tokens_are_what_followed_the_latest_earlier_bigram():
    ids = [5, 6, 7, 5, 6, 8, 5, 6]
    # pair t reads tokens t and t+1: (5, 6) at t=3 was seen at t=0, then 7 came; at t=6 the latest is t=3, then 8
    assert copy_tokens(ids) == [NO_COPY, NO_COPY, NO_COPY, 7, NO_COPY, NO_COPY, 8]
    assert copy_tokens([4, 4, 4, 4]) == [NO_COPY, 4, 4]  # a run copies itself
    successors = {}  # read piece by piece, as the drafter does, with the same bigram map
    assert copy_tokens(ids, 0, 4, successors) + copy_tokens(ids, 4, 7, successors) == copy_tokens(ids)
    embed = torch.nn.Embedding(10, 3)
    found = copy_embedding(embed, torch.tensor([NO_COPY, 7]))
    assert torch.equal(found[0], torch.zeros(3)) and torch.equal(found[1], embed.weight[7])


def table_of(texts: list[torch.Tensor], vocab_size: int, pieces: int = 1) -> tuple[list[RowBigrams], BigramTable]:
    """Each text's RowBigrams (read in `pieces` pieces, as a drafter reads a growing text) and their BigramTable."""
    rows = [RowBigrams(vocab_size) for _ in texts]
    for bigrams, text in zip(rows, texts):
        for end in torch.linspace(0, text.shape[0], pieces + 1)[1:].long().tolist():
            bigrams.read(text[:end].numpy())
    return rows, bigram_table(rows, texts[0].device)


def test_draft_nodes_copy_along_their_own_paths():
    committed = [5, 6, 7, 8, 5, 6, 9, 7, 8]  # the root is the last 8
    # paths below the root: (8, 5) was followed by 6, (8, 9) never; (5, 6) latest by 9, (6, 7) by 8
    _, table = table_of([torch.tensor(committed)], 10)
    assert draft_copies(table, torch.tensor([[[5], [9]]])).tolist() == [[6, NO_COPY]]
    assert draft_copies(table, torch.tensor([[[5, 6]]])).tolist() == [[9]]
    assert draft_copies(table, torch.tensor([[[5, 6, 7]]])).tolist() == [[8]]
    # a path that repeats its own bigram copies from itself: 8 -> 5 -> 8 -> 5 reads (8, 5) last followed by 8
    assert draft_copies(table, torch.tensor([[[5, 8, 5]]])).tolist() == [[8]]
    assert [copy_tokens(committed + path)[-1] for path in ([5], [9], [5, 6], [5, 6, 7], [5, 8, 5])] == [
        6,
        NO_COPY,
        9,
        8,
        8,
    ]  # the whole-text reading that training uses


def test_the_bigram_table_gives_the_copy_tokens_training_reads():
    """On random texts of a small vocabulary (repeats everywhere), batched rows of any length, one token included,
    read whole or piece by piece: every committed pair's copy token and every draft path's equal
    heads.eagle.copy_tokens over the whole text."""
    generator = torch.Generator().manual_seed(0)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=generator))

    for _ in range(200):
        rows = draw(1, 5)
        texts = [torch.randint(0, 4, (draw(1, 20),), generator=generator) for _ in range(rows)]
        bigrams, table = table_of(texts, 6, pieces=draw(1, 4))
        assert [row.copies for row in bigrams] == [copy_tokens(text.tolist()) for text in texts]
        paths = torch.randint(0, 4, (rows, 3, draw(1, 6)), generator=generator)
        expected = [[copy_tokens(text.tolist() + path.tolist())[-1] for path in row] for text, row in zip(texts, paths)]
        assert draft_copies(table, paths).tolist() == expected


def test_eagle_drafter_state_and_trees_match_a_recomputation():
    model = tiny_model("llama", eos=None)
    for feature_layers, num_layers, copy_input, window in (
        ([-1], 1, False, None),
        ([1, 2, -1], 1, False, None),
        ([-1], 2, False, None),
        ([1, -1], 1, True, None),
        ([1, -1], 1, True, 6),  # a long prompt: the head reads its last 6 pairs (the copy tokens know all of it)
    ):
        torch.manual_seed(0)
        head = EagleHead(
            EagleConfig.for_target(
                model.config, feature_layers=feature_layers, num_layers=num_layers, copy_input=copy_input
            )
        ).eval()
        drafter = CheckedEagleDrafter(head, model, DynamicTreeSpec(depth=4, top_k=3, nodes=9))
        drafter.model, drafter.prompt_window = model, window
        segment = torch.randint(4, 97, (8,), generator=torch.Generator().manual_seed(1))
        prompt = torch.cat([segment, torch.tensor([3]), segment[:5]])  # repeated bigrams: copy tokens to find
        generate(model, drafter, prompt, max_new_tokens=12, fallback=False)
        assert drafter.checked_nodes > 30
        assert drafter.cache.get_seq_length() == drafter.lengths[0]  # draft entries never outlive a step
        assert drafter.rows[0].skipped == (0 if window is None else prompt.shape[0] - window)


def _observed_drafters(model, head, prompt, trusted_ngram, spec=None):
    """An EAGLE drafter and prompt lookup merged, having observed `prompt` as generate() would after its prefill."""
    from inference import MergedDrafter, PromptLookupDrafter

    eagle = EagleDrafter(head, model, spec or DynamicTreeSpec(depth=4, top_k=2, nodes=8))
    lookup = PromptLookupDrafter(trusted_ngram=trusted_ngram)
    merged = MergedDrafter([eagle, lookup])
    merged.reset()
    with torch.no_grad():
        hidden = model(prompt[None], output_hidden_states=True).hidden_states
    merged.observe({-1: hidden[-1][0]}, torch.cat([prompt[1:], prompt[:1]]))
    return merged, lookup


def test_a_trusted_lookup_span_keeps_the_head_at_depth_one():
    model = tiny_model("llama", eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    tokens = torch.tensor(
        [5, 6, 7, 8, 9, 5, 6, 7]
    )  # "5 6 7" occurred before: lookup copies "8 9 5 6 7" (a 3-gram match)
    for trusted_ngram, head_limited in ((3, True), (4, False)):
        merged, lookup = _observed_drafters(model, head, tokens[:-1], trusted_ngram)
        with torch.no_grad():
            tree = merged.propose(tokens, max_depth=8)
        span, matched = lookup.span(tokens, 8)
        assert span and lookup.trusts(matched) == head_limited
        chain = torch.tensor([7, 8, 9, 5, 6, 7])
        on_chain = torch.zeros(tree.size, dtype=torch.bool)
        for node in range(tree.size):  # a node is on the copied span when its path spells the span's prefix
            path = tree.tokens[tree.ancestors[node].nonzero().flatten()]
            on_chain[node] = bool(torch.equal(path, chain[: path.shape[0]]))
        assert int(on_chain.sum()) == chain.shape[0]  # the whole span is in the merged tree
        head_depth = int(tree.depth[~on_chain].max())
        assert (head_depth == 1) if head_limited else (head_depth > 1)


def test_a_priced_tree_keeps_of_a_span_what_pays_for_its_pass():
    """With measured pass costs (the default call's trees) one sequence's copied span is weighed against the head's
    drafts as a batch's is, not merged whole: here a pass past four tokens costs ten one-token passes, so the tree
    keeps the span's first three tokens (believed right half the time, each far likelier than a random head's
    guesses) and nothing past them. Beside a trusted span (a 3-gram match) the head drafts one level only."""
    from inference.tree_size import PassCost

    model = tiny_model("llama", eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    tokens = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])  # lookup copies "8 9 5 6 7" after a 3-gram match
    cost = PassCost(tokens=(1, 4, 5), relative=(1.0, 1.0, 10.0))
    for trusted_ngram, head_limited in ((3, True), (4, False)):
        spec = DynamicTreeSpec(depth=4, top_k=2, nodes=8, cost=cost)
        merged, _ = _observed_drafters(model, head, tokens[:-1], trusted_ngram, spec)
        eagle, expanded = merged.head_drafters[0], []
        expand = eagle._expand
        eagle._expand = lambda depth, *args, log=expanded, run=expand: log.append(depth) or run(depth, *args)
        with torch.no_grad():
            tree = merged.propose(tokens, max_depth=8)
        assert tree.size == 4  # the root and three drafts: a fifth token would cost nine more passes
        assert tree.tokens.tolist() == [7, 8, 9, 5] and tree.parents.tolist() == [-1, 0, 1, 2]
        assert expanded == ([] if head_limited else [1, 2, 3])  # head passes past the first level


def test_an_overconfident_head_is_discounted():
    """The drafter measures how often its best depth-1 draft holds against what it predicted."""
    model = tiny_model("llama", eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    with torch.no_grad():
        head.fc.weight.mul_(50.0)  # sharp, confident and (untrained) wrong distributions
    drafter = EagleDrafter(head, model, DynamicTreeSpec(depth=3, top_k=2, nodes=6))
    prompt = torch.randint(4, 97, (12,), generator=torch.Generator().manual_seed(3))
    generate(model, drafter, prompt, max_new_tokens=24, fallback=False)
    assert float(drafter.reliability()) < 0.5
    drafter.reset()
    assert float(drafter.reliability()) == 1.0


def test_an_underconfident_head_is_trusted_more():
    """Trees that get more drafts accepted than their probabilities promised scale those probabilities up (to at
    most MAX_RELIABILITY), so the drafter keeps the larger trees they pay for."""
    from inference.drafters import MAX_RELIABILITY

    model = tiny_model("llama", eos=None)
    drafter = EagleDrafter(
        EagleHead(EagleConfig.for_target(model.config)).eval(), model, DynamicTreeSpec(depth=2, top_k=2, nodes=3)
    )
    hidden = {layer: torch.zeros(3, model.config.hidden_size) for layer in drafter.hidden_layers}
    tree = Tree.from_parents(torch.tensor([7, 3, 4, 5]), torch.tensor([-1, 0, 0, 1]))
    drafter.rows[0].guess = (tree, None, torch.tensor(1.0))  # a tree expected to get one draft accepted
    drafter.observe(hidden, torch.tensor([3, 5, 9]))  # it got two: 3, then 5 below it (9 the target's own)
    # decayed sums over a prior of one and one
    assert float(drafter.reliability()) == pytest.approx((0.9 + 2) / (0.9 + 1.0))
    for _ in range(5):
        drafter.rows[0].guess = (tree, None, torch.tensor(0.1))
        drafter.observe(hidden, torch.tensor([3, 5, 9]))
    assert float(drafter.reliability()) == MAX_RELIABILITY


def three_token_head():
    """(tiny target, an EAGLE head drafting from the target tokens 5, 9 and 40 only, a prompt, a tree wider than
    that)"""
    model = tiny_model("llama", eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, draft_vocab_size=3)).eval()
    head.draft_ids.copy_(torch.tensor([5, 9, 40]))
    prompt = torch.randint(4, 97, (10,), generator=torch.Generator().manual_seed(2))
    return model, head, prompt, DynamicTreeSpec(depth=3, top_k=8, nodes=9)


def first_tree(drafter, model, prompt):
    """The drafter's tree right after the prefill of `prompt`."""
    drafter.reset()
    with torch.no_grad():
        hidden = model(prompt[None], output_hidden_states=True).hidden_states
        drafter.observe({-1: hidden[-1][0]}, torch.cat([prompt[1:], prompt[:1]]))
        return drafter.propose(prompt, max_depth=3)


def test_a_draft_vocabulary_smaller_than_top_k_drafts_from_all_of_it():
    model, head, prompt, spec = three_token_head()
    out = generate(model, head, prompt, max_new_tokens=12, tree=spec)
    assert out.token_ids == hf_greedy(model, prompt, 12)
    tree = first_tree(
        EagleDrafter(head, model, spec, context_vocab=False), model, prompt
    )  # the head's own vocabulary only
    assert set(tree.tokens[1:].tolist()) <= {5, 9, 40}
    assert int((tree.depth == 1).sum()) == 3  # every draft token at depth 1, not top_k of them


def test_an_eagle_head_drafts_prompt_tokens_outside_its_vocabulary():
    """inference.context_vocab: the prompt's tokens join the head's three."""
    model, head, prompt, spec = three_token_head()
    tree = first_tree(EagleDrafter(head, model, spec), model, prompt)
    drafted = set(tree.tokens[1:].tolist())
    assert drafted <= {5, 9, 40} | set(prompt.tolist()) and drafted - {5, 9, 40}
    assert int((tree.depth == 1).sum()) > 3  # more than the head's own three tokens to choose from


def _batch_drafters(model, head, texts, spec):
    """An EAGLE drafter and prompt lookup merged for a batch, having observed each row's text but its last token."""
    from inference import MergedDrafter, PromptLookupDrafter

    eagle = EagleDrafter(head, model, spec)
    merged = MergedDrafter([eagle, PromptLookupDrafter()])
    merged.reset(len(texts))
    with torch.no_grad():
        hidden = [{-1: model(text[None, :-1], output_hidden_states=True).hidden_states[-1][0]} for text in texts]
    merged.observe_rows(hidden, [text[1:] for text in texts])
    return merged, eagle


def test_a_batch_weighs_copied_spans_against_the_drafts():
    """In a batch a row's copied span takes the place of the head's drafts where it is believed likelier, and
    every row keeps as many nodes as the batch's tree is wide: no row's span widens the others' trees."""
    model = tiny_model("llama", eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    spec = DynamicTreeSpec(depth=3, top_k=2, nodes=5)
    copying = torch.tensor([5, 6, 7, 8, 9, 10, 5, 6, 7])  # "5 6 7" occurred before: lookup copies "8 9 10 5 6 7"
    fresh = torch.randperm(90, generator=torch.Generator().manual_seed(2))[:9] + 4  # no token twice: nothing to copy
    texts = [copying, fresh]
    _, eagle = _batch_drafters(model, head, texts, spec)
    with torch.no_grad():
        drafted = eagle.propose_rows(texts, [8, 8])  # the head alone
        _, eagle = _batch_drafters(model, head, texts, spec)
        unlikely, _ = eagle.propose_grafted(texts, [8, 8], [[(copying[3:], -50.0)], []])  # believed surely wrong
        merged, _ = _batch_drafters(model, head, texts, spec)
        trees = merged.propose_rows(texts, [8, 8])  # a fresh row's spans are believed right half the time
    for tree, alone in zip(unlikely, drafted):
        assert torch.equal(tree.tokens, alone.tokens) and torch.equal(tree.parents, alone.parents)
    assert torch.equal(trees[1].tokens, drafted[1].tokens)  # the row without a span drafts as alone
    assert trees[0].size == trees[1].size == spec.nodes + 1
    span = [7, 8, 9, 10, 5, 6]
    on_span = [
        tuple(trees[0].tokens[trees[0].ancestors[node]].tolist()) == tuple(span[: int(trees[0].depth[node]) + 1])
        for node in range(trees[0].size)
    ]
    assert (
        int(trees[0].depth[torch.tensor(on_span)].max()) >= 3
    )  # the head's random guesses are far less likely than 1/2 a token


def test_a_batch_learns_how_often_the_tokens_a_span_adds_are_right():
    from inference.drafters import RELIABILITY_DECAY, SPAN_PRIOR, span_outcome

    model = tiny_model("llama", eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    copying = torch.tensor([5, 6, 7, 8, 9, 10, 5, 6, 7])
    fresh = torch.randperm(90, generator=torch.Generator().manual_seed(2))[:9] + 4
    merged, _ = _batch_drafters(model, head, [copying, fresh], DynamicTreeSpec(depth=3, top_k=2, nodes=5))
    with torch.no_grad():
        merged.propose_rows([copying, fresh], [8, 8])
    ((key, span, shared),) = merged.pending[0].spans
    assert key == (0, 3) and span == [8, 9, 10, 5, 6, 7] and merged.pending[1] is None
    committed = [8, 9, 44]  # the first two copied tokens right, the third wrong
    states = [
        {layer: torch.zeros(count, model.config.hidden_size) for layer in merged.hidden_layers} for count in (3, 1)
    ]
    merged.observe_rows(states, [torch.tensor(committed), torch.tensor([50])])
    assert merged.span_rates[0] == {}  # learnt from the committed text on the host, at the next proposal
    with torch.no_grad():
        merged.propose_rows(
            [torch.cat([copying, torch.tensor(committed)]), torch.cat([fresh, torch.tensor([50])])], [8, 8]
        )
    held, tried = span_outcome(span[shared:], committed[shared:])
    assert tried > 0 and merged.span_rates[0][key] == [
        RELIABILITY_DECAY * SPAN_PRIOR[0] + held,
        RELIABILITY_DECAY * SPAN_PRIOR[1] + tried,
    ]
    assert merged.span_rates[1] == {}


def test_draft_nodes_keep_the_depths_and_ancestors_their_parents_make():
    """DraftNodes.add_children's bookkeeping, two rows grown three levels (k = 2, two frontier nodes a level):
    each row's depths and ancestor matrix are those Tree.from_parents works out from its parents."""
    vocab = DraftVocabulary(torch.nn.Linear(8, 50, bias=False))
    nodes = DraftNodes(torch.tensor([3, 4]), drafted_nodes(3, 2), vocab)
    generator = torch.Generator().manual_seed(0)
    frontier = torch.zeros(2, 1, dtype=torch.long)
    for _ in range(3):
        shape = (2, frontier.shape[1], 2)
        top = torch.rand(shape, generator=generator).log(), torch.randint(50, shape, generator=generator)
        children = nodes.add_children(frontier, top)
        frontier = children[:, [0, -1]]  # a first and a last child grow on
    assert nodes.count == drafted_nodes(3, 2)
    for row in range(2):
        tree = Tree.from_parents(nodes.tokens[row], nodes.parents[row])
        assert torch.equal(nodes.ancestors[row], tree.ancestors) and torch.equal(nodes.depth, tree.depth)
