"""A shared prompt prefix computed once (inference.prefix): what prompts share, the mask of a pass after it, and
a batch whose prompts share a system prompt decoding exactly HF's greedy tokens while prefilling it once."""

from __future__ import annotations

import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead
from inference import DynamicTreeSpec, Sampling, loop
from inference.drafters import NoDrafter
from inference.fallback import Fallback
from inference.generate import plan
from inference.prefix import MIN_PREFIX, Prefix, shared_length


def test_shared_length_is_the_common_start():
    a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 9])
    assert shared_length([a, b]) == 2
    assert shared_length([a, a[:3]]) == 3  # one prompt is the other's start
    assert shared_length([a, torch.tensor([1, 6, 7, 8])]) == 0


def test_a_pass_after_the_prefix_sees_all_of_it_then_its_own_mask():
    prefix = Prefix(torch.arange(3), [], [], {})
    suffix = torch.tensor([[0.0, -1.0], [0.0, 0.0]])[None, None].expand(2, -1, -1, -1)
    mask = prefix.mask(suffix)
    assert mask.shape == (2, 1, 2, 5)
    assert torch.equal(mask[..., :3], torch.zeros(2, 1, 2, 3)) and torch.equal(mask[..., 3:], suffix)


def test_prompts_sharing_a_system_prompt_prefill_it_once_and_decode_as_hf_greedy():
    model = tiny_model("llama", eos=None)
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(4, model.config.vocab_size, (MIN_PREFIX + 4,), generator=generator)
    prompts = [
        torch.cat([system, torch.randint(4, model.config.vocab_size, (length,), generator=generator)])
        for length in (3, 9, 1, 14, 6)
    ]
    references = [hf_greedy(model, prompt, 10) for prompt in prompts]
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True)).eval()
    chosen = plan(model, head, DynamicTreeSpec(depth=3, top_k=2, nodes=6), False, False, batch=(2, 2))
    for drafter in (NoDrafter(), chosen.drafter):
        computed = []  # the tokens each target pass computed

        def counting(*args, computed=computed, forward=model.forward, **kwargs):
            computed.append(kwargs["input_ids"].shape[1])
            return forward(*args, **kwargs)

        model.forward = counting
        try:
            state = loop.start(model, drafter, [], Fallback(enabled=False), batch_size=2)
            rows = [loop.add(state, prompt, 10, Sampling()) for prompt in prompts]
            with torch.inference_mode():
                while loop.step(state):
                    pass
        finally:
            del model.forward
        assert [row.new_tokens for row in rows] == references
        assert state.prefix is not None and torch.equal(state.prefix.tokens, system)
        # the system prompt once, by itself; no other pass as long (the tokens after it: 14 at most; trees: 7)
        assert computed[0] == len(system) and computed.count(len(system)) == 1 and max(computed) == len(system)


def test_a_prefill_after_the_prefix_gives_what_a_whole_prefill_gives():
    """The batch's cache, last logits and the drafter's hidden states, as prefilling the whole prompts computes."""
    model = tiny_model("llama", eos=None)
    generator = torch.Generator().manual_seed(2)
    system = torch.randint(4, model.config.vocab_size, (MIN_PREFIX,), generator=generator)
    prompts = [torch.cat([system, torch.randint(4, 97, (length,), generator=generator)]) for length in (2, 7, 5)]

    class Reads:  # a drafter reading the first layer's and the last hidden states
        hidden_layers = (1, -1)

    with torch.inference_mode():
        state = loop.start(model, Reads(), [], Fallback(enabled=False), batch_size=3)
        prefix = loop.shared_prefix(state, prompts)
        assert prefix is not None and prefix.length == MIN_PREFIX
        cache, logits, hidden = loop.prefill(model, prompts, Reads(), prefix)
        whole_cache, whole_logits, whole_hidden = loop.prefill(model, prompts, Reads())
    torch.testing.assert_close(logits, whole_logits)
    for row, prompt in enumerate(prompts):
        for layer in Reads.hidden_layers:
            torch.testing.assert_close(hidden[row][layer], whole_hidden[row][layer])
        for ours, whole in zip(cache.layers, whole_cache.layers):
            torch.testing.assert_close(ours.keys[row, :, : len(prompt)], whole.keys[row, :, : len(prompt)])
            torch.testing.assert_close(ours.values[row, :, : len(prompt)], whole.values[row, :, : len(prompt)])


def test_a_short_prompt_gets_its_first_token_before_a_long_one_that_came_with_it_is_prefilled():
    model = tiny_model("llama", eos=None)
    generator = torch.Generator().manual_seed(3)
    long, short = (torch.randint(4, model.config.vocab_size, (n,), generator=generator) for n in (240, 20))
    events = []  # ("first token", prompt length) and ("prefill", tokens) in the order they happen

    def counting(*args, forward=model.forward, **kwargs):
        if kwargs.get("past_key_values") is None or kwargs["past_key_values"].get_seq_length() == 0:
            events.append(("prefill", kwargs["input_ids"].shape[1]))
        return forward(*args, **kwargs)

    model.forward = counting
    try:
        state = loop.start(model, NoDrafter(), [], Fallback(enabled=False), batch_size=2)
        rows = [
            loop.add(state, p, 4, Sampling(), on_tokens=lambda t, d, n=p.shape[0]: events.append(("token", n)))
            for p in (long, short)
        ]
        with torch.inference_mode():
            while loop.step(state):
                pass
    finally:
        del model.forward
    assert events[:4] == [("prefill", 20), ("token", 20), ("prefill", 240), ("token", 240)]
    assert [row.new_tokens for row in rows] == [hf_greedy(model, long, 4), hf_greedy(model, short, 4)]
