"""A head's draft vocabulary grows with the tokens of the sequence it drafts for (inference.context_vocab)."""

import pytest
import torch

from conftest import tiny_model
from heads import DraftVocabulary, MedusaConfig, MedusaHeads
from inference.context_vocab import ROOM, ContextVocabulary
from inference.drafters import as_drafter


def lm_head(vocab_size=20, hidden=4):
    torch.manual_seed(0)
    return torch.nn.Linear(hidden, vocab_size, bias=False)


def added(context: ContextVocabulary) -> list[int]:
    """The tokens added to the base, in the order they joined (the rows past the count are not filled yet)."""
    return context.current.ids[context.base.base_size :][: int(context.count)].tolist()


def all_log_probs(context: ContextVocabulary, logits: torch.Tensor) -> torch.Tensor:
    """Every token's log-probability, in the vocabulary's order, from its top-k over all of them."""
    values, indices = context.top(logits, logits.shape[-1])
    return torch.empty_like(values).scatter_(-1, indices, values)


def test_read_tokens_join_with_the_targets_rows_each_once():
    projection = lm_head()
    context = ContextVocabulary(DraftVocabulary(projection, torch.tensor([2, 5, 7])))
    vocab = context.read_texts([torch.tensor([7, 11, 3, 11])])  # 7 is in already; 11 twice
    assert added(context) == [11, 3] and context.base.ids.tolist() == [2, 5, 7]  # the base is left as it was
    assert torch.equal(vocab.weight[:5], projection.weight[[2, 5, 7, 11, 3]])
    assert vocab.to_target(torch.tensor([3, 4])).tolist() == [11, 3]
    features = torch.randn(2, 4)
    torch.testing.assert_close(vocab.logits(features)[:, :5], projection(features)[:, [2, 5, 7, 11, 3]])
    # the vocabulary spans its whole buffer (ROOM rows and a spare one after the base's): rows not filled are
    # impossible
    log_probs = all_log_probs(context, vocab.logits(features))
    assert vocab.weight.shape[0] == 3 + ROOM + 1 and (log_probs[:, 5:].exp() == 0).all()
    torch.testing.assert_close(log_probs[:, :5], torch.log_softmax(projection(features)[:, [2, 5, 7, 11, 3]], -1))
    context.read_texts([torch.tensor([7, 11, 3, 11, 2, 3])])  # nothing new
    assert added(context) == [11, 3]


def test_the_vocabulary_grows_past_its_room_and_keeps_its_width_till_then():
    torch.manual_seed(0)
    projection = torch.nn.Linear(4, 2000)  # with a bias, grown alike
    context = ContextVocabulary(DraftVocabulary(projection, torch.tensor([2, 5, 7])))
    text = torch.randperm(2000)[:700]
    widths = []
    for end in (1, 40, 41, 300, 700):  # read piece by piece; past ROOM
        vocab = context.read_texts([text[:end]])
        widths.append(vocab.weight.shape[0])
        expected = [token for token in text[:end].tolist() if token not in (2, 5, 7)]
        assert added(context) == expected
        filled = 3 + len(expected)
        assert torch.equal(vocab.weight[:filled], projection.weight[vocab.ids[:filled]])
        assert torch.equal(vocab.bias[:filled], projection.bias[vocab.ids[:filled]])
    # one width (one shape for the projection's kernel) till the added tokens overrun the room
    assert widths[:3] == [3 + ROOM + 1] * 3 and widths[2] < widths[3] < widths[4]
    assert widths[4] == 3 + context.room + 1 and context.room >= context.count == 697


def test_only_a_reduced_vocabulary_over_the_targets_rows_can_grow():
    projection = lm_head()
    assert not DraftVocabulary(projection).extensible  # the whole vocabulary already
    own = DraftVocabulary(torch.nn.Linear(4, 3, bias=False), torch.tensor([2, 5, 7]), own_rows=True, target_size=20)
    assert not own.extensible
    with pytest.raises(ValueError, match="rows of its own"):
        _ = own.target_rows
    assert (
        not ContextVocabulary(own).enabled
        and not ContextVocabulary(DraftVocabulary(projection, torch.tensor([1])), enabled=False).enabled
    )


def test_each_row_drafts_only_the_tokens_it_has_seen():
    context = ContextVocabulary(DraftVocabulary(lm_head(), torch.tensor([2, 5])))
    context.reset(rows=2)
    context.read_texts([torch.tensor([9, 2]), torch.tensor([4, 9, 5])])
    assert added(context) == [9, 4]
    seen = ~context.unseen[:, :4]
    assert seen.tolist() == [[True, True, True, False], [True, True, True, True]]  # row 0 never saw 4
    assert context.unseen[:, 4:].all()  # rows not filled
    log_probs = all_log_probs(context, torch.zeros(2, 3, context.current.weight.shape[0]))  # [rows, frontier, N]
    probabilities = log_probs.exp()
    assert (probabilities[0, :, 3:] == 0).all() and (probabilities[1, :, 4:] == 0).all()
    torch.testing.assert_close(probabilities[0, :, :3], torch.full((3, 3), 1 / 3))  # as if it drafted from 3 tokens
    torch.testing.assert_close(probabilities[1, :, :4], torch.full((3, 4), 1 / 4))
    context.read_texts([torch.tensor([9, 2, 13]), torch.tensor([4, 9, 5, 5])])  # only what is new is read
    assert added(context) == [9, 4, 13] and (~context.unseen[1, :5]).tolist() == [True, True, True, True, False]
    context.keep_rows([1])  # row 0 finished: row 1 still may not draft 13
    assert (~context.unseen[0, :5]).tolist() == [True, True, True, True, False]
    context.add_rows(1)  # a new row joins: the vocabulary is rebuilt from the live rows' tokens, without 13
    assert sorted(added(context)) == [4, 9]
    context.read_texts([torch.tensor([4, 9, 5, 5]), torch.tensor([7, 2])])
    assert added(context)[2:] == [7]
    where = {token: index for index, token in enumerate(context.current.ids[:5].tolist())}
    assert not context.unseen[0, where[4]] and not context.unseen[0, where[9]] and context.unseen[0, where[7]]
    assert context.unseen[1, where[4]] and context.unseen[1, where[9]] and not context.unseen[1, where[7]]
    context.reset()
    assert context.current.ids.tolist() == [2, 5] and context.unseen is None


def test_a_vocabulary_grown_inside_inference_mode_grows_on_outside_it():
    context = ContextVocabulary(DraftVocabulary(lm_head(), torch.tensor([2, 5])))
    with torch.inference_mode():
        context.reset()
        context.read_texts([torch.tensor([9, 2])])
    context.read_texts([torch.tensor([9, 2, 11])])
    assert added(context) == [9, 11]


def test_heads_with_lm_heads_of_their_own_do_not_grow():
    model = tiny_model("llama", eos=None)
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2, own_lm_heads=True)).eval()
    assert not as_drafter(heads, model).context.enabled


def test_the_next_vocabulary_over_a_base_takes_its_buffers_and_a_live_one_keeps_its_own():
    base = DraftVocabulary(lm_head(), torch.tensor([2, 5]))
    first = ContextVocabulary(base)
    buffer = first.weight
    second = ContextVocabulary(base)  # the first still drafts: a copy of its own
    assert second.weight is not buffer
    first.read_texts([torch.tensor([9, 2, 11])])
    second.read_texts([torch.tensor([4])])
    assert added(first) == [9, 11] and added(second) == [4] and first.weight is buffer
    first.reset()
    assert first.weight is buffer and first.count == 0 and first.current is base
    del first, second
    third = ContextVocabulary(base)  # the buffer kept with the base, the first's rows still in it
    assert third.weight is buffer and (buffer[2:4] != 0).any()
    vocab = third.read_texts([torch.tensor([7, 2])])
    assert added(third) == [7]
    probabilities = all_log_probs(third, vocab.logits(torch.randn(3, 4))).exp()
    assert (probabilities[:, 3:] == 0).all() and torch.allclose(probabilities.sum(-1), torch.ones(3))


def test_a_drafter_keeps_its_heads_vocabulary_till_the_targets_rows_change():
    model = tiny_model("llama", eos=None)
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2)).eval()
    heads.draft_ids = torch.tensor([1, 4, 7])
    vocab = as_drafter(heads, model).context.base
    assert as_drafter(heads, model).context.base is vocab  # made once: slicing and packing take milliseconds
    with torch.no_grad():
        model.get_output_embeddings().weight[4] += 1.0  # in place: the rows it sliced are stale
    fresh = as_drafter(heads, model).context.base
    assert fresh is not vocab and torch.equal(fresh.weight[1], model.get_output_embeddings().weight[4])
