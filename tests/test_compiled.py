"""Compiled passes (inference.compiled) decode exactly what the eager model does, without compiling every step.

Tiny models compile in seconds a graph; each test model is its own instance, so the other test modules keep
decoding eagerly.
"""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead
from inference import DynamicTreeSpec, OracleDrafter, PromptLookupDrafter, best_static_paths, compile_target, generate, warm_up
from inference.compiled import decoding_pass, is_compiled
from inference.tree import default_accuracy
from test_exactness_tiny import random_prompts

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def compiled_llama():
    model = compile_target(tiny_model("llama"))
    warm_up(model, verbose=False)
    return model


def test_compiled_decoding_matches_hf_greedy_over_trees_of_every_width(compiled_llama):
    """An EAGLE head's dynamic trees, an oracle's 30-node tree, prompt lookup and plain steps: every width from 1
    up, the cache growing and cropped, all through the compiled graphs; identical to HF greedy of the eager model."""
    model = compiled_llama
    torch.manual_seed(1)
    eagle = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True)).eval()
    tree30 = best_static_paths(30, default_accuracy(depth=6, ranks=4))
    passes, compiled_calls = decoding_pass(model), []
    compiled_forward = passes.forward
    passes.forward = lambda **kwargs: compiled_calls.append(kwargs["input_ids"].shape[1]) or compiled_forward(**kwargs)
    counters.clear()
    for prompt in random_prompts(model.config.vocab_size, 6, seed=3):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        full = torch.cat([prompt, torch.tensor(reference, dtype=torch.long)])
        drafters = {
            "eagle": (eagle, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
            "oracle-tree-30": (OracleDrafter(full, tree30, model.config.vocab_size), None),
            "lookup": (PromptLookupDrafter(max_ngram=2), None),
            "plain": (None, None),
        }
        for name, (heads, tree) in drafters.items():
            out = generate(model, heads, prompt, max_new_tokens=NEW_TOKENS, tree=tree, lookup=False, fallback=False)
            assert out.token_ids == reference, (name, prompt.tolist())
    passes.forward = compiled_forward
    assert is_compiled(model)
    assert 1 in compiled_calls and max(compiled_calls) > 10, "plain steps and wide trees both ran through the compiled graphs"
    # the warm-up compiled the one-token and the tree pass; nothing is compiled again, whatever the drafter, the
    # widths and the lengths
    assert counters["stats"].get("unique_graphs", 0) == 0, dict(counters["stats"])


def test_compiled_batches_match_each_row_alone():
    model = compile_target(tiny_model("llama", seed=4))
    prompts = random_prompts(model.config.vocab_size, 5, seed=9)
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    outs = generate(model, PromptLookupDrafter(max_ngram=2), [p.tolist() for p in prompts], max_new_tokens=NEW_TOKENS, batch_size=3, fallback=False)
    assert [o.token_ids for o in outs] == references


def test_a_model_that_does_not_compile_decodes_eagerly_after_one_warning(monkeypatch):
    model = compile_target(tiny_model("llama", seed=2))
    passes = decoding_pass(model)

    def fails(**kwargs):
        raise torch._dynamo.exc.Unsupported("a graph break that cannot be traced")

    monkeypatch.setattr(passes, "forward", fails)
    prompt = random_prompts(model.config.vocab_size, 1, seed=5)[0]
    with pytest.warns(UserWarning, match="torch.compile failed on LlamaForCausalLM .*Unsupported.*eager model"):
        out = generate(model, PromptLookupDrafter(), prompt, max_new_tokens=NEW_TOKENS)
    assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    assert not is_compiled(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next call decodes eagerly in silence
        generate(model, None, prompt, max_new_tokens=4)


def test_the_models_own_forward_stays_eager(compiled_llama):
    assert decoding_pass(compiled_llama) is not compiled_llama
    assert not hasattr(compiled_llama.forward, "_torchdynamo_orig_callable")
    assert decoding_pass(tiny_model("llama")).__class__.__name__ == "LlamaForCausalLM"
