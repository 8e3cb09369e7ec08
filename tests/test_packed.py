"""Eager projections with packed weights (inference.packed) compute what F.linear does."""

import pytest
import torch
import torch.nn.functional as F

from heads import DraftVocabulary
from inference.packed import packed_linear, packs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_layer_computes_what_f_linear_does(dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 64, dtype=dtype), torch.randn(300, dtype=dtype)
    project = packed_linear(weight, bias)
    for x in (torch.randn(1, 64, dtype=dtype), torch.randn(3, 5, 80, dtype=dtype)[..., :64]):  # rows; a strided view
        if not packs(weight):
            assert torch.equal(project(x), F.linear(x, weight, bias))
        # the same products, summed in another order (and in bfloat16 the bias added before rounding)
        tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
        torch.testing.assert_close(project(x), F.linear(x, weight, bias), **tolerance)


def test_a_draft_vocabulary_with_a_base_projection_and_added_rows():
    torch.manual_seed(1)
    lm_head = torch.nn.Linear(32, 100, bias=False).to(torch.bfloat16)
    vocab = DraftVocabulary(lm_head, torch.arange(0, 100, 3))
    features = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    vocab.base_projection = packed_linear(vocab.weight)
    assert torch.equal(vocab.logits(features), F.linear(features, vocab.weight))
    added = torch.tensor([1, 2, 5])  # tokens a sequence has seen, after the base's rows (inference.context_vocab)
    grown = vocab.with_rows(torch.cat([vocab.weight, lm_head.weight[added]]), None, torch.cat([vocab.ids, added]))
    assert torch.equal(grown.logits(features), F.linear(features, grown.weight))
