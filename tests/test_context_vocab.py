"""A head's draft vocabulary grows with the tokens of the sequence it drafts for (inference.context_vocab)."""

import pytest
import torch

from conftest import tiny_model
from heads import DraftVocabulary, MedusaConfig, MedusaHeads
from inference.context_vocab import ContextVocabulary
from inference.drafters import as_drafter


def lm_head(vocab_size=20, hidden=4):
    torch.manual_seed(0)
    return torch.nn.Linear(hidden, vocab_size, bias=False)


def test_extended_appends_the_new_tokens_rows_from_the_target():
    projection = lm_head()
    base = DraftVocabulary(projection, torch.tensor([2, 5, 7]))
    grown = base.extended(torch.tensor([7, 11, 3, 11]))  # 7 is in already; 11 twice
    assert grown.ids.tolist() == [2, 5, 7, 3, 11] and base.ids.tolist() == [2, 5, 7]  # the base is left as it was
    assert torch.equal(grown.weight, projection.weight[[2, 5, 7, 3, 11]])
    assert grown.base_size == 3 and grown.member[[2, 3, 5, 7, 11]].all() and int(grown.member.sum()) == 5
    assert grown.to_target(torch.tensor([3, 4])).tolist() == [3, 11] and grown.from_target(
        torch.tensor([11, 4])
    ).tolist() == [4, -100]
    features = torch.randn(2, 4)
    torch.testing.assert_close(grown.logits(features), projection(features)[:, [2, 5, 7, 3, 11]])
    assert grown.extended(torch.tensor([2, 3])) is grown  # nothing new: no copy


def test_vocabularies_grown_from_one_another_keep_their_own_rows():
    """Rows are appended in place after the newest vocabulary's; growing an older one again must not overwrite
    what a newer one holds (nor the base's)."""
    torch.manual_seed(0)
    projection = torch.nn.Linear(4, 20)  # with a bias, grown alike
    base = DraftVocabulary(projection, torch.tensor([2, 5, 7]))
    first = base.extended(torch.tensor([3]))
    second = first.extended(torch.tensor([11]))  # the newest: its row is written in place after first's
    other = first.extended(torch.tensor([13, 1]))  # first grown again: must not land where 11's row is
    again = base.extended(torch.tensor([9]))
    for vocab, ids in [
        (base, [2, 5, 7]),
        (first, [2, 5, 7, 3]),
        (second, [2, 5, 7, 3, 11]),
        (other, [2, 5, 7, 3, 1, 13]),
        (again, [2, 5, 7, 9]),
    ]:
        assert vocab.ids.tolist() == ids
        assert torch.equal(vocab.weight, projection.weight[ids]), ids
        assert torch.equal(vocab.bias, projection.bias[ids]), ids


def test_only_a_reduced_vocabulary_over_the_targets_rows_can_grow():
    projection = lm_head()
    assert not DraftVocabulary(projection).extensible  # the whole vocabulary already
    own = DraftVocabulary(torch.nn.Linear(4, 3, bias=False), torch.tensor([2, 5, 7]), own_rows=True, target_size=20)
    assert not own.extensible
    with pytest.raises(ValueError, match="rows of its own"):
        own.extended(torch.tensor([3]))
    assert (
        not ContextVocabulary(own).enabled
        and not ContextVocabulary(DraftVocabulary(projection, torch.tensor([1])), enabled=False).enabled
    )


def test_each_row_drafts_only_the_tokens_it_has_seen():
    context = ContextVocabulary(DraftVocabulary(lm_head(), torch.tensor([2, 5])))
    context.reset(rows=2)
    vocab = context.read_texts([torch.tensor([9, 2]), torch.tensor([4, 9, 5])])
    assert vocab.ids.tolist() == [2, 5, 4, 9]
    assert context.unseen.tolist() == [[False, False, True, False], [False, False, False, False]]  # row 0 never saw 4
    log_probs = context.log_probs(torch.zeros(2, 3, 4))  # [rows, frontier, N]
    probabilities = log_probs.exp()
    assert (probabilities[0, :, 2] == 0).all()
    torch.testing.assert_close(
        probabilities[0, :, [0, 1, 3]], torch.full((3, 3), 1 / 3)
    )  # as if the row drafted from 3 tokens
    torch.testing.assert_close(probabilities[1], torch.full((3, 4), 1 / 4))
    vocab = context.read_texts([torch.tensor([9, 2, 13]), torch.tensor([4, 9, 5, 5])])  # only what is new is read
    assert vocab.ids.tolist() == [2, 5, 4, 9, 13] and context.unseen[1].tolist() == [False, False, False, False, True]
    context.keep_rows([1])  # row 0 finished: row 1 still may not draft 13
    assert context.unseen.tolist() == [[False, False, False, False, True]]
    context.add_rows(1)  # a new row joins: the vocabulary is rebuilt from the live rows' tokens, without 13
    assert context.current.ids.tolist() == [2, 5, 4, 9]
    vocab = context.read_texts([torch.tensor([4, 9, 5, 5]), torch.tensor([7, 2])])
    assert vocab.ids.tolist() == [2, 5, 4, 9, 7]
    assert context.unseen.tolist() == [[False, False, False, False, True], [False, False, True, True, False]]
    context.reset()
    assert context.current.ids.tolist() == [2, 5] and context.unseen is None


def test_heads_with_lm_heads_of_their_own_do_not_grow():
    model = tiny_model("llama", eos=None)
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2, own_lm_heads=True)).eval()
    assert not as_drafter(heads, model).context.enabled
