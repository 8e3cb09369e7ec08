"""Concurrent generate() calls on one model: each gives what it gives alone (the attention switch is shared)."""

from concurrent.futures import ThreadPoolExecutor

import torch

from conftest import hf_greedy, tiny_model
from heads.attention import GROUPED_SDPA
from inference import DynamicTreeSpec, generate
from test_exactness_tiny import random_heads, random_prompts

NEW_TOKENS = 24


def test_twelve_threads_on_one_model_each_match_hf_greedy_alone():
    model = tiny_model("llama")
    medusa, _, _, _, eagle_copy = random_heads(model)
    prompts = random_prompts(model.config.vocab_size, 4, seed=11)
    references = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    kinds = {  # EAGLE, Medusa and plain decoding, four prompts each: 12 calls at once
        "eagle": (eagle_copy, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
        "medusa": (medusa, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
        "plain": (None, None),
    }
    calls = [(name, n) for name in kinds for n in range(len(prompts))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # twelve threads on two cores; torch's own pool would oversubscribe them

    def decode(call):
        name, n = call
        drafter, tree = kinds[name]
        return generate(model, drafter, prompts[n], max_new_tokens=NEW_TOKENS, tree=tree).token_ids

    try:
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            outputs = list(pool.map(decode, calls))
    finally:
        torch.set_num_threads(threads)
    for (name, n), output in zip(calls, outputs):
        assert output == references[n], (name, n)
    assert model.config._attn_implementation == "sdpa" != GROUPED_SDPA  # the last call to leave switched it back
