import pytest
import torch

from inference.accept import (
    GREEDY_CHUNK,
    Sampling,
    accepted_path,
    greedy_path,
    greedy_tokens,
    target_probabilities,
    target_tokens,
)
from inference.tree import Tree


def tree_abc():
    # 0(root) -> 1(tok 5) -> 3(tok 7) ; 0 -> 2(tok 6) -> 4(tok 8)
    return Tree.from_parents(torch.tensor([9, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 1, 2]))


def test_deepest_agreeing_path_wins():
    tree = tree_abc()
    # target picks 6 at root, 8 after node 2, 1 after node 4 (the bonus)
    chosen = torch.tensor([6, 0, 8, 0, 1])
    assert accepted_path(tree, chosen).tolist() == [0, 2, 4]


def test_a_wrong_ancestor_rejects_its_subtree():
    tree = tree_abc()
    chosen = torch.tensor([4, 7, 8, 0, 0])  # node 3's token 7 matches, but its parent 1 (tok 5) is wrong
    assert accepted_path(tree, chosen).tolist() == [0]


def test_chain_accepts_a_prefix():
    tree = Tree.chain(torch.tensor([1, 2, 3, 4]))
    assert accepted_path(tree, torch.tensor([2, 3, 9, 9])).tolist() == [0, 1, 2]
    assert accepted_path(tree, torch.tensor([2, 3, 4, 5])).tolist() == [0, 1, 2, 3]


def test_the_host_path_is_the_device_path_on_trees_with_distinct_siblings():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        size = int(torch.randint(1, 16, (1,), generator=generator))
        parents, tokens, seen = [-1], [9], set()
        for _ in range(1, size):  # tokens from a small vocabulary, so that paths often agree; siblings distinct
            parent = int(torch.randint(0, len(tokens), (1,), generator=generator))
            token = int(torch.randint(0, 4, (1,), generator=generator))
            if (parent, token) not in seen:
                seen.add((parent, token))
                parents.append(parent)
                tokens.append(token)
        chosen = torch.randint(0, 4, (len(tokens),), generator=generator)
        tree = Tree.from_lists(tokens, parents)
        assert greedy_path(tree.host[0], tree.host[1], chosen.tolist()) == accepted_path(tree, chosen).tolist(), trial
    tree = tree_abc()
    assert greedy_path(tree.tokens.tolist(), tree.parents.tolist(), [6, 0, 8, 0, 1]) == [0, 2, 4]
    assert greedy_path(tree.tokens.tolist(), tree.parents.tolist(), [4, 7, 8, 0, 0]) == [0]


def test_greedy_picks_argmax_and_sampling_is_seeded():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    assert target_tokens(logits, Sampling()).tolist() == [1, 0]
    s = Sampling(temperature=1.0)
    draws = [target_tokens(logits, s, torch.Generator().manual_seed(7)).tolist() for _ in range(2)]
    assert draws[0] == draws[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_go_to_the_first_maximum_as_in_argmax(dtype):
    """generate() takes argmax, the first of tied maxima; bfloat16 logits tie often."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 5, 3000), generator=generator).to(dtype)  # every row has many tied maxima
    assert torch.equal(target_tokens(logits, Sampling()), logits.float().argmax(dim=-1))
    assert target_tokens(torch.tensor([1.0, 5.0, 2.0, 5.0, 5.0], dtype=dtype), Sampling()).item() == 1


@pytest.mark.parametrize("vocab", [3 * GREEDY_CHUNK, 3 * GREEDY_CHUNK + 5, GREEDY_CHUNK + 7])
def test_greedy_finds_the_first_maximum_wherever_it_lies(vocab):
    """greedy_tokens looks for the maximum stretch by stretch: a maximum at a stretch's edge, in the shorter last
    stretch, tied across stretches, or a NaN, is found where argmax finds it."""
    columns = sorted({0, GREEDY_CHUNK - 1, GREEDY_CHUNK, min(2 * GREEDY_CHUNK + 1, vocab - 3), vocab - 1})
    logits = torch.zeros(len(columns) + 3, vocab, dtype=torch.bfloat16)
    for row, column in enumerate(columns):
        logits[row, column] = 1.0
    logits[-3, [vocab - 1, GREEDY_CHUNK + 3]] = 2.0  # tied in two stretches: the earlier one's
    logits[-2, [vocab - 2, 5]] = float("nan")  # NaN first, as argmax
    logits[-1] = -1.0  # every logit the maximum
    expected = logits.float().argmax(dim=-1)
    assert expected.tolist()[: len(columns)] == columns
    assert torch.equal(greedy_tokens(logits), expected)
    assert torch.equal(greedy_tokens(logits[None, :, :]), expected[None])  # any leading dimensions


def test_warpers_match_hugging_face_semantics():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    probs = target_probabilities(logits, Sampling(temperature=0.5, top_k=3, top_p=0.9))
    assert probs[0, 3] == 0  # removed by top-k
    assert probs[0, 0] > 0.85 and torch.isclose(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)
