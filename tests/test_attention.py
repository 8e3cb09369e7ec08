"""heads.attention: grouped-query attention over a shared 4D mask, with the query heads folded instead of the keys
and values copied, computes what transformers' SDPA attention computes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import tiny_model
from heads.attention import GROUPED_SDPA, grouped_attention, grouped_sdpa_attention
from inference.cache import new_cache
from inference.tree import Tree, attention_mask, position_ids


def random_attention(batch: int, heads: int, kv_heads: int, queries: int, keys: int, mask_batch: int):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, queries, 8, generator=generator)
    key, value = (torch.randn(batch, kv_heads, keys, 8, generator=generator) for _ in range(2))
    allowed = torch.rand(mask_batch, 1, queries, keys, generator=generator) > 0.3
    allowed[..., 0] = True  # every query sees something
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return SimpleNamespace(num_key_value_groups=heads // kv_heads), query, key, value, mask


@pytest.mark.parametrize("queries, mask_batch", [(5, 3), (5, 1), (1, 3)])
def test_grouped_attention_matches_transformers_sdpa(queries, mask_batch):
    module, query, key, value, mask = random_attention(3, 6, 2, queries, 9, mask_batch)
    ours, _ = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == reference.shape == (3, queries, 6, 8)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_folding_the_heads_in_the_wrong_order_would_be_caught():
    """The comparison above can fail: query head h must read key/value head h // groups, not h % groups."""
    module, query, key, value, mask = random_attention(2, 6, 2, 4, 7, 2)
    regrouped = (
        query.reshape(2, 3, 2, 4, 8).transpose(1, 2).reshape(2, 6, 4, 8)
    )  # head h now sits where h % groups would read
    ours, _ = grouped_sdpa_attention(module, regrouped, key, value, mask)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask)
    assert not torch.allclose(ours, reference, atol=1e-3)


def test_grouped_attention_switches_an_sdpa_model_for_the_block_only():
    model = tiny_model("llama").float().eval()
    tree = Tree.chain(torch.tensor([5, 6, 7, 8]))
    prompt = torch.arange(10, 22)[None]

    def tree_logits():
        cache = new_cache(model)
        model(input_ids=prompt[:, :5], cache=cache, use_cache=True)
        # no mask given, several queries over a cache: the mask must be built as for "sdpa" (not left out as causal)
        model(input_ids=prompt[:, 5:], cache=cache, use_cache=True)
        return model(
            input_ids=tree.tokens[None],
            cache=cache,
            position_ids=position_ids(tree, prompt.shape[1]),
            attention_mask=attention_mask(tree, prompt.shape[1], torch.float32),
        ).logits

    with torch.inference_mode():
        reference = tree_logits()
        with grouped_attention(model):
            assert model.config._attn_implementation == GROUPED_SDPA
            grouped = tree_logits()
        assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)

    with pytest.raises(RuntimeError, match="inside"), grouped_attention(model):
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"  # restored after an error too

    eager = tiny_model("llama", attn="eager")
    with grouped_attention(eager):
        assert eager.config._attn_implementation == "eager"  # only "sdpa" is switched
