"""Bad input to generate() gets a clear error, raised before any work is done."""

import pytest
import torch

from conftest import tiny_model
from heads import EagleConfig, EagleHead, HeadConfigError, MedusaConfig, MedusaHeads
from inference import PromptLookupDrafter, TreeError, generate


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


PROMPT = torch.arange(4, 10)


@pytest.mark.parametrize("prompt, kwargs, error, message", [
    (torch.tensor([], dtype=torch.long), {}, ValueError, "prompt is empty"),
    ("   ", {"tokenizer": object()}, ValueError, "prompt is empty"),
    ("hello", {}, ValueError, "needs tokenizer"),
    (torch.ones(2, 3, dtype=torch.long), {}, ValueError, "one sequence at a time"),
    (torch.tensor([5, 500]), {}, ValueError, r"token ids must be in \[0, 97\)"),
    (PROMPT, {"max_new_tokens": 251}, ValueError, "exceeds the model's context of 256"),
    (PROMPT, {"max_new_tokens": 0}, ValueError, "max_new_tokens must be a positive integer"),
    (PROMPT, {"temperature": -1.0}, ValueError, "temperature must be >= 0"),
    (PROMPT, {"temperature": 1.0, "top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    (PROMPT, {"temperature": 1.0, "top_p": 1.01}, ValueError, r"top_p must be in \(0, 1\]"),
])
def test_bad_generation_input(model, prompt, kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(model, None, prompt, **kwargs)


def test_tree_needing_more_heads_than_the_checkpoint_has(model):
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2))
    with pytest.raises(TreeError, match="needs 3 Medusa heads; the checkpoint has 2"):
        generate(model, heads, PROMPT, tree=[(0,), (0, 0), (0, 0, 0)])


def test_wrong_tree_kind_for_a_drafter(model):
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2))
    with pytest.raises(TreeError, match="static tree"):  # Medusa takes a DynamicTreeSpec or a list of paths
        generate(model, heads, PROMPT, tree="5,4,15")
    eagle = EagleHead(EagleConfig.for_target(model.config))
    with pytest.raises(TreeError, match="grows dynamic trees"):
        generate(model, eagle, PROMPT, tree=[(0,), (1,)])
    with pytest.raises(TreeError, match="with its own tree"):
        generate(model, PromptLookupDrafter(), PROMPT, tree=[(0,)])


def test_heads_built_for_another_model(model):
    other = tiny_model("llama", vocab_size=50)
    heads = MedusaHeads(MedusaConfig.for_target(other.config))
    with pytest.raises(HeadConfigError, match="built for another base model"):
        generate(model, heads, PROMPT)


def test_not_a_drafter(model):
    with pytest.raises(TypeError, match="heads must be None, MedusaHeads, EagleHead"):
        generate(model, "medusa", PROMPT)


def test_sliding_window_models_are_refused_not_silently_wrong():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        generate(MistralForCausalLM(config).eval(), None, PROMPT)


def test_attention_kernels_that_ignore_a_4d_mask_are_refused(model):
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            generate(model, None, PROMPT)
    finally:
        model.config._attn_implementation = "sdpa"


def test_a_model_whose_forward_takes_no_cache_argument_is_refused(model):
    class OldModelingCode(torch.nn.Module):  # modeling code from before transformers 5.24 named it past_key_values
        config = model.config

        def forward(self, input_ids, past_key_values=None, **kwargs):  # a `cache=` would land in kwargs, unused
            kwargs.pop("cache", None)
            return model(input_ids, past_key_values=past_key_values, **kwargs)

    with pytest.raises(ValueError, match="takes no `cache` argument"):
        generate(OldModelingCode(), None, PROMPT)


def test_a_tokenizer_output_is_accepted_as_prompt(model):
    assert generate(model, None, {"input_ids": PROMPT.tolist()}, max_new_tokens=3).token_ids == \
        generate(model, None, PROMPT, max_new_tokens=3).token_ids
    with pytest.raises(ValueError, match="no 'input_ids'"):
        generate(model, None, {"ids": [1, 2]})
