import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.drafters import span_outcome
from inference.tree import (
    Tree,
    TreeError,
    attention_mask,
    chain_paths,
    check_parents,
    matched_depth,
    position_ids,
    retrieve_indices,
    static_tree,
    subtree,
    verifiable_host_tree,
    verifiable_tree,
)
from inference.tree_select import CandidatePool, graft_span, merge_trees, select_best_nodes
from inference.tree_size import (
    DynamicTreeSpec,
    PassCost,
    best_node_count,
    best_nodes,
    best_shared_tree,
    best_static_paths,
    default_accuracy,
    next_depth,
    token_rates,
)


def slow_ancestors(parents):
    """Reference: walk each node up by hand."""
    out = []
    for i in range(len(parents)):
        chain, node = [], i
        while node >= 0:
            chain.append(node)
            node = parents[node]
        out.append(set(chain))
    return out


@st.composite
def random_trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 5)) for _ in range(n)]
    return torch.tensor(tokens), torch.tensor(parents)


def test_static_tree_from_paths():
    shape = static_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    s = shape.structure
    assert s.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert s.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert shape.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    candidates = torch.tensor([[10, 11], [20, 21], [30, 31]])
    tree = shape.fill(torch.tensor(99), candidates)
    assert tree.tokens.tolist() == [99, 10, 11, 20, 21, 20, 30]


def test_static_tree_rejects_missing_prefix():
    with pytest.raises(TreeError, match="no parent path"):
        static_tree([(0,), (1, 0)])
    with pytest.raises(TreeError, match="at least one path"):
        static_tree([])


def test_check_parents_rejects_bad_trees():
    with pytest.raises(TreeError, match="root"):
        check_parents(torch.tensor([0, 0]))
    with pytest.raises(TreeError, match="precede"):
        check_parents(torch.tensor([-1, 2, 0]))


def test_mask_and_positions_for_a_small_tree():
    # root -> a -> c ; root -> b
    tree = Tree.from_parents(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1]))
    mask = attention_mask(tree, past_length=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    allowed = mask[0, 0] == 0
    assert allowed[:, :3].all()  # everyone sees the past
    assert allowed[:, 3:].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert (mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all()
    assert position_ids(tree, 3).tolist() == [[3, 4, 4, 5]]
    assert retrieve_indices(tree).tolist() == [[0, 2, -1], [0, 1, 3]]


@settings(max_examples=200, deadline=None)
@given(random_trees())
def test_ancestors_depth_and_paths_match_a_reference(tree_data):
    tokens, parents = tree_data
    tree = Tree.from_parents(tokens, parents)
    reference = slow_ancestors(parents.tolist())
    for i, expected in enumerate(reference):
        assert set(tree.ancestors[i].nonzero().flatten().tolist()) == expected
        assert tree.depth[i] == len(expected) - 1
    assert tree.max_depth == int(tree.depth.max())
    paths = retrieve_indices(tree)
    leaves = set(range(len(parents))) - set(parents.tolist()[1:])
    assert sorted(p[p >= 0][-1].item() for p in paths) == sorted(leaves)
    for path in paths:
        nodes = path[path >= 0].tolist()
        assert nodes[0] == 0
        assert all(parents[b] == a for a, b in zip(nodes, nodes[1:]))


@settings(max_examples=100, deadline=None)
@given(random_trees(), st.integers(0, 6))
def test_truncate_keeps_an_ancestor_closed_tree(tree_data, max_depth):
    tokens, parents = tree_data
    tree = Tree.from_parents(tokens, parents)
    cut = tree.truncate(max_depth)
    check_parents(cut.parents)
    rebuilt = Tree.from_parents(cut.tokens, cut.parents)
    assert torch.equal(rebuilt.ancestors, cut.ancestors)
    assert torch.equal(rebuilt.depth, cut.depth)
    assert cut.size == int((tree.depth <= max_depth).sum())


def root_to_node_paths(tree):
    toks = tree.tokens.tolist()
    return {tuple(toks[j] for j in tree.ancestors[i].nonzero().flatten().tolist()) for i in range(tree.size)}


@settings(max_examples=100, deadline=None)
@given(random_trees(20), random_trees(12))
def test_merge_holds_every_path_of_both_once(a, b):
    ta = Tree.from_parents(a[0], a[1])
    tb = Tree.from_parents(torch.cat([a[0][:1], b[0][1:]]), b[1])
    merged = merge_trees(ta, tb)
    check_parents(merged.parents)
    assert torch.equal(Tree.from_parents(merged.tokens, merged.parents).ancestors, merged.ancestors)
    assert root_to_node_paths(merged) == root_to_node_paths(ta) | root_to_node_paths(tb)
    # only nodes of the second tree that duplicate nothing are added
    assert merged.size <= ta.size + tb.size - 1
    assert torch.equal(Tree.from_parents(merged.tokens, merged.parents).depth, merged.depth)
    assert merged.max_depth == int(merged.depth.max())


@settings(max_examples=50, deadline=None)
@given(random_trees(20))
def test_a_tree_from_host_lists_is_the_tree_from_its_parents(a):
    from_lists, from_parents = Tree.from_lists(a[0].tolist(), a[1].tolist()), Tree.from_parents(a[0], a[1])
    for field in ("tokens", "parents", "depth", "ancestors"):
        assert torch.equal(getattr(from_lists, field), getattr(from_parents, field)), field
    assert from_lists.max_depth == from_parents.max_depth


def test_matched_depth_follows_the_committed_tokens_down_the_tree():
    # root 7; children 3 (node 1) and 4 (node 2); 3 -> 5 (node 3); 4 -> 5 (node 4)
    tree = Tree.from_parents(torch.tensor([7, 3, 4, 5, 5]), torch.tensor([-1, 0, 0, 1, 2]))
    assert int(matched_depth(tree, torch.tensor([4, 5, 9]))) == 2  # both drafts on the 4 branch, then the bonus token
    assert int(matched_depth(tree, torch.tensor([3, 6]))) == 1
    assert int(matched_depth(tree, torch.tensor([5]))) == 0  # a token deeper in the tree, but not a child of the root
    assert int(matched_depth(tree, torch.tensor([4]))) == 1  # committed tokens run out before the tree does
    assert int(matched_depth(tree, torch.tensor([], dtype=torch.long))) == 0
    assert int(matched_depth(Tree.from_parents(torch.tensor([7]), torch.tensor([-1])), torch.tensor([3, 4]))) == 0
    # only counted nodes hold: node 4 was grafted in, not drafted
    assert int(matched_depth(tree, torch.tensor([4, 5]), torch.tensor([True, True, True, True, False]))) == 1


def test_the_next_step_drafts_one_level_deeper_only_when_the_deepest_paid():
    assert next_depth(kept=3, drafted=3, limit=5) == 4  # the deepest level was kept: look one deeper
    assert next_depth(kept=3, drafted=4, limit=5) == 3  # the fourth level did not pay: do not draft it again
    assert next_depth(kept=5, drafted=5, limit=5) == 5
    assert next_depth(kept=0, drafted=2, limit=5) == 1  # nothing kept: still draft one level, or never again


def test_merge_refuses_different_roots():
    with pytest.raises(TreeError):
        merge_trees(Tree.chain(torch.tensor([1, 2])), Tree.chain(torch.tensor([3, 2])))


def test_best_static_paths_is_prefix_closed_and_greedy():
    paths = best_static_paths(20, default_accuracy(depth=4, ranks=3))
    assert len(paths) == 20 and len(set(paths)) == 20
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)
    assert paths[:2] == [(0,), (0, 0)]
    assert chain_paths(3) == [(0,), (0, 0), (0, 0, 0)]


def test_select_best_nodes_is_ancestor_closed_even_with_ties():
    # root, two children; the first child's child has probability 1 (a tie with its parent)
    scores = torch.tensor([0.0, -1.0, -2.0, -1.0])
    depth = torch.tensor([0, 1, 1, 2])
    assert select_best_nodes(scores, depth, 1).tolist() == [0, 1]
    assert select_best_nodes(scores, depth, 2).tolist() == [0, 1, 3]
    assert select_best_nodes(scores, depth, 10).tolist() == [0, 1, 2, 3]


def test_impossible_nodes_rank_after_every_possible_one_and_stay_ancestor_closed():
    # root; 1 (possible) -> 3 (NaN); 2 (-inf) -> 4 (-inf): the possible ones first, then the shallower impossible one
    scores = torch.tensor([0.0, -1.0, float("-inf"), float("nan"), float("-inf")])
    depth = torch.tensor([0, 1, 1, 2, 2])
    assert select_best_nodes(scores, depth, 1).tolist() == [0, 1]
    assert select_best_nodes(scores, depth, 2).tolist() == [0, 1, 2]  # the shallower impossible node first
    assert select_best_nodes(scores, depth, 3).tolist()[:3] == [0, 1, 2]  # then either of depth 2: both closed
    assert select_best_nodes(scores, depth, 10).tolist() == [0, 1, 2, 3, 4]


def test_dynamic_tree_spec_validates():
    with pytest.raises(TreeError):
        DynamicTreeSpec(depth=0)


def test_pass_cost_interpolates_and_extrapolates():
    cost = PassCost(tokens=(1, 4, 16), relative=(1.0, 1.3, 2.5))
    assert cost(1) == 1.0 and cost(4) == pytest.approx(1.3) and cost(16) == pytest.approx(2.5)
    assert cost(2) == pytest.approx(1.1) and cost(10) == pytest.approx(1.9)
    assert cost(28) == pytest.approx(3.7)  # along the last slope
    with pytest.raises(TreeError, match="ascending"):
        PassCost(tokens=(2, 4), relative=(1.0, 1.2))


def log(*probabilities: float) -> list[float]:
    return [math.log(p) for p in probabilities]


def test_best_node_count_keeps_what_pays_for_itself():
    confident = [log(0.9, 0.8, 0.7, 0.6, 0.5)]
    hopeless = [log(0.02, 0.01, 0.01)]
    flat = PassCost(tokens=(1, 64), relative=(1.0, 1.0))  # verifying more tokens is free: keep everything
    steep = PassCost(tokens=(1, 2), relative=(1.0, 2.0))  # each token costs a full pass: keep nothing
    assert best_node_count(confident, flat, 0.0, limit=4) == 4
    assert best_node_count(confident, steep, 0.0, limit=5) == 0
    gentle = PassCost(tokens=(1, 8), relative=(1.0, 1.35))  # 0.05 a token: only likely drafts pay
    assert best_node_count(confident, gentle, 0.1, limit=5) == 5
    assert best_node_count(hopeless, gentle, 0.1, limit=3) == 0
    assert best_node_count([[float("-inf"), float("nan")] + log(0.9)], flat, 0.0, limit=3) == 1  # never impossible


def test_best_nodes_keeps_what_best_node_count_and_select_best_nodes_keep_in_one_read():
    generator = torch.Generator().manual_seed(0)
    costs = [
        PassCost(tokens=(1, 8), relative=(1.0, 1.35)),
        PassCost(tokens=(1, 64), relative=(1.0, 1.0)),
        PassCost(tokens=(1, 2), relative=(1.0, 2.0), draft_step=0.5),
    ]
    for trial in range(60):
        count = int(torch.randint(2, 30, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, count)]
        tree = Tree.from_lists(torch.randint(0, 50, (count,), generator=generator).tolist(), parents)
        steps = torch.rand(count, generator=generator).log()
        scores = torch.zeros(count)
        for node in range(1, count):  # a child is never likelier than its parent
            scores[node] = scores[parents[node]] + steps[node]
        if trial % 3 == 0:
            scores[count // 2 :] = float("-inf")  # impossible drafts (their children are too)
        shift, cost, limit = torch.tensor(0.3 * (trial % 4) - 0.4), costs[trial % 3], 1 + trial % 12
        keep, kept_tree = best_nodes(scores, tree.depth, tree.tokens, tree.parents, shift, cost, 0.05, limit)
        kept = best_node_count([(scores[1:] + shift).tolist()], cost, 0.05, limit)
        assert keep.tolist() == select_best_nodes(scores, tree.depth, kept).tolist()
        expected = subtree(tree.tokens, tree.parents, tree.depth, tree.ancestors, keep)
        for name in ("tokens", "parents", "depth", "ancestors", "max_depth"):
            assert torch.equal(torch.as_tensor(getattr(kept_tree, name)), torch.as_tensor(getattr(expected, name)))
        assert kept_tree.host == (tuple(expected.tokens.tolist()), tuple(expected.parents.tolist()))


def test_what_every_step_pays_weighs_for_larger_trees():
    """A draft that does not pay for its verification alone pays once the step costs more whatever it verifies
    (the head reading what the last step committed): it spreads that cost over more tokens."""
    doubtful = [log(0.3)]
    assert best_node_count(doubtful, PassCost(tokens=(1, 2), relative=(1.0, 1.35)), 0.0, limit=1) == 0  # 1.3 / 1.35 < 1
    assert (
        best_node_count(doubtful, PassCost(tokens=(1, 2), relative=(1.0, 1.35), draft_step=1.0), 0.0, limit=1) == 1
    )  # 1.3 / 2.35 > 1 / 2


def test_a_batch_prices_one_width_for_all_its_rows():
    """Every row is padded to the widest tree, so one row's likely drafts pay for the width and every row fills it."""
    confident, hopeless = log(0.9, 0.8, 0.7, 0.6), log(0.02, 0.01, 0.01, 0.01)
    pricey = PassCost(tokens=(1, 8), relative=(1.0, 2.4))  # 0.2 a token
    assert best_node_count([hopeless], pricey, 0.0, limit=4) == 0
    assert best_node_count([confident, hopeless], pricey, 0.0, limit=4) == 4
    assert best_node_count([hopeless, hopeless], pricey, 0.0, limit=4) == 0


def test_a_batch_drafts_as_deep_as_pays_for_all_its_rows():
    # depth-1 drafts are likely, depth-3 ones are not: drafting three levels costs more than they bring
    depth = [1, 1, 2, 2, 3, 3]
    scores = [
        [math.log(p) for p in row] for row in ([0.9, 0.03, 0.7, 0.02, 0.02, 0.01], [0.8, 0.03, 0.6, 0.02, 0.01, 0.01])
    ]
    gentle = PassCost(tokens=(1, 8), relative=(1.0, 1.35))
    assert best_shared_tree(scores, depth, 3, gentle, 0.3, limit=6) == (2, 2)  # two levels: each row's likely chain
    assert best_shared_tree(scores, depth, 3, gentle, 3.0, limit=6)[0] == 1  # levels cost more than passes: one
    likely = [[math.log(p) for p in [0.95, 0.1, 0.9, 0.05, 0.85, 0.01]]] * 2
    assert best_shared_tree(likely, depth, 3, gentle, 0.05, limit=6) == (3, 3)


def test_token_rates_are_expected_tokens_over_a_steps_cost_for_every_width():
    generator = torch.Generator().manual_seed(5)
    cost = PassCost(tokens=(1, 8, 32), relative=(1.0, 1.3, 2.1), draft_step=0.1)
    for trial in range(30):
        rows, drafts, limit = 1 + trial % 4, 1 + trial % 7, 1 + trial % 9
        scores = (torch.rand(rows, drafts, generator=generator, dtype=torch.float64).log() * (1 + trial % 3)).tolist()
        if trial % 3 == 0:
            scores[0][::2] = [float("-inf")] * len(scores[0][::2])  # impossible drafts: never kept
        rates = token_rates(scores, cost, 0.3, limit)
        possible = [sorted((math.exp(s) for s in row if s > float("-inf")), reverse=True) for row in scores]
        assert len(rates) == 1 + min(limit, max(len(row) for row in possible))
        for n, rate in enumerate(rates):  # each row keeps its n likeliest (all it has, if fewer)
            made = sum(1 + sum(row[:n]) for row in possible)
            assert rate == pytest.approx(made / (0.1 + 0.3 + cost(n + 1)))


def test_a_batchs_depth_is_the_best_of_pricing_each_depth_alone():
    generator = torch.Generator().manual_seed(7)
    cost = PassCost(tokens=(1, 8, 32), relative=(1.0, 1.3, 2.1), draft_step=0.1)
    for trial in range(30):
        levels, rows, limit = 1 + trial % 5, 1 + trial % 4, 2 + trial % 9
        depth = [level for level in range(1, levels + 1) for _ in range(3)]
        scores = (torch.rand(rows, len(depth), generator=generator).log() * (1 + trial % 3)).tolist()
        best, expected = float("-inf"), (1, 0)
        for level in range(1, levels + 1):
            rates = token_rates(
                [[s for s, d in zip(row, depth) if d <= level] for row in scores], cost, level * 0.04, limit
            )
            if max(rates) > best:
                best, expected = max(rates), (level, rates.index(max(rates)))
        assert best_shared_tree(scores, depth, levels, cost, 0.04, limit) == expected


def test_sized_static_paths_keep_only_what_pays():
    from inference.tree_size import PassCost, sized_static_paths

    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
    best = best_static_paths(12, accuracy)
    free = PassCost((1, 64), (1.0, 1.0))
    assert sized_static_paths(accuracy, free, 12) == best  # verification is free: every path pays
    steep = PassCost((1, 2, 64), (1.0, 2.0, 64.0))
    assert sized_static_paths(accuracy, steep, 12) == []  # a second token doubles the pass: plain decoding is faster
    assert (
        sized_static_paths(accuracy, PassCost((1, 2, 64), (1.0, 1.5, 64.0)), 12) == best[:1]
    )  # 1.6 tokens for 1.5 passes
    moderate = PassCost((1, 64), (1.0, 1.0 + 63 * 0.1))  # every verified token adds a tenth of a pass
    sized = sized_static_paths(accuracy, moderate, 12)
    assert sized == best[: len(sized)] and 1 < len(sized) < 12
    static_tree(sized)  # prefix-closed, so a valid tree


def test_likeliest_paths_go_deep_when_sure_and_wide_when_hesitant():
    from inference.tree_size import likeliest_paths

    sure = [[0.95, 0.02, 0.02, 0.01]] * 4
    hesitant = [[0.3, 0.3, 0.2, 0.2]] * 4
    assert likeliest_paths(sure, 5)[:4] == chain_paths(4)
    assert likeliest_paths(hesitant, 6) == [(0,), (1,), (2,), (3,), (0, 0), (0, 1)]
    steep = PassCost((1, 2, 64), (1.0, 2.0, 64.0))
    assert likeliest_paths(sure, 5, steep) == [] and likeliest_paths(sure, 5) == best_static_paths(5, sure)


@settings(max_examples=100, deadline=None)
@given(random_trees(20), st.lists(st.integers(0, 5), min_size=1, max_size=6), st.floats(0.01, 1.0), st.data())
def test_a_grafted_span_adds_its_path_and_keeps_the_pool_ancestor_closed(pool, span, rate, data):
    tree = merge_trees(
        Tree.chain(pool[0][:1]), Tree.from_parents(pool[0], pool[1])
    )  # siblings' tokens distinct, as a head's are
    steps = data.draw(st.lists(st.floats(0.01, 1.0), min_size=tree.size, max_size=tree.size))
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    scores = [0.0]
    for node in range(1, tree.size):
        scores.append(scores[parents[node]] + math.log(steps[node]))
    pool = CandidatePool(list(tokens), list(parents), tree.depth.tolist(), list(scores))
    held = graft_span(pool, span, math.log(rate))
    rebuilt = Tree.from_lists(pool.tokens, pool.parents)
    assert pool.depth == rebuilt.depth.tolist()
    span_paths = [tuple([tokens[0]] + span[:j]) for j in range(1, len(span) + 1)]
    assert root_to_node_paths(rebuilt) == root_to_node_paths(tree) | set(span_paths)
    assert len(pool.tokens) == len(root_to_node_paths(tree) | set(span_paths))  # no path twice
    assert held == sum(path in root_to_node_paths(tree) for path in span_paths)
    assert pool.scores[: tree.size] == scores  # the pool's own nodes keep their scores
    for node in range(tree.size, len(pool.tokens)):  # each added token: log_rate below its parent
        assert pool.scores[node] == pytest.approx(pool.scores[pool.parents[node]] + math.log(rate))
    for count in range(len(pool.tokens)):
        keep = pool.best(count)
        on_device = select_best_nodes(torch.tensor(pool.scores, dtype=torch.float64), rebuilt.depth, count).tolist()
        ranked = [sorted((pool.scores[n], pool.depth[n]) for n in nodes) for nodes in (keep, on_device)]
        assert ranked[0] == ranked[1]  # the same nodes, up to ties (equal scores at equal depths)
        assert all(pool.parents[node] in keep for node in keep if node)
        kept = pool.tree(keep, "cpu")
        assert _same_tree(
            kept, subtree(rebuilt.tokens, rebuilt.parents, rebuilt.depth, rebuilt.ancestors, torch.tensor(keep))
        )


def test_a_copied_span_counts_the_tokens_tried_until_one_is_wrong():
    assert span_outcome([4, 5, 6], [4, 5, 9, 1]) == (2, 3)  # two held, the third failed
    assert span_outcome([4, 5, 6], [7]) == (0, 1)
    assert span_outcome([4, 5, 6], [4, 5]) == (2, 2)  # the third is not known yet
    assert span_outcome([4, 5], [4, 5, 6]) == (2, 2)


def _same_tree(a: Tree, b: Tree) -> bool:
    return all(
        torch.equal(torch.as_tensor(getattr(a, name)), torch.as_tensor(getattr(b, name)))
        for name in ("tokens", "parents", "depth", "ancestors", "max_depth")
    )


def test_a_tree_built_on_the_host_is_checked_there_as_verifiable_tree_checks_it_on_the_device():
    """Random trees with repeated siblings, cut at every depth: the host's checks keep what the device's keep."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(80):
        count = int(torch.randint(1, 25, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, count)]
        tokens = torch.randint(0, 4, (count,), generator=generator).tolist()  # few tokens: siblings repeat them
        tree = Tree.from_lists(tokens, parents)
        for max_depth in range(0, tree.max_depth + 2):
            on_host = verifiable_host_tree(tree, tokens[0], torch.device("cpu"), 4, max_depth)
            assert _same_tree(on_host, verifiable_tree(tree, torch.tensor(tokens[0]), 4, max_depth))
            assert on_host.host == (tuple(on_host.tokens.tolist()), tuple(on_host.parents.tolist()))


def test_a_tree_built_on_the_host_with_a_wrong_root_or_token_or_parent_is_refused():
    tree = Tree.from_lists([5, 6, 7], [-1, 0, 0])
    with pytest.raises(TreeError, match="rooted at token 5, but the last committed token is 4"):
        verifiable_host_tree(tree, 4, torch.device("cpu"), 10, 8, "the drafter")
    with pytest.raises(TreeError, match=r"outside the vocabulary \[0, 7\)"):
        verifiable_host_tree(tree, 5, torch.device("cpu"), 7, 8, "the drafter")
    with pytest.raises(TreeError, match="not a tree"):
        Tree.from_lists([5, 6, 7], [-1, 2, 0])
    with pytest.raises(TreeError, match="as many tokens as parents"):
        Tree.from_lists([5, 6], [-1, 0, 0])


def test_merging_trees_built_on_the_host_reads_nothing_and_makes_the_same_tree():
    generator = torch.Generator().manual_seed(4)
    for _ in range(40):
        trees = []
        for _ in range(2):
            count = int(torch.randint(1, 12, (1,), generator=generator))
            parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, count)]
            tokens = [9] + torch.randint(0, 4, (count - 1,), generator=generator).tolist()
            trees.append(Tree.from_lists(tokens, parents))
        on_device = [Tree(t.tokens, t.parents, t.depth, t.ancestors, t.max_depth) for t in trees]  # no host lists
        assert _same_tree(merge_trees(*trees), merge_trees(*on_device))
