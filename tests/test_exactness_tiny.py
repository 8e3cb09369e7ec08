"""Greedy output equals Hugging Face greedy generate() token for token, on tiny random Llama and Qwen2."""

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from inference import (
    DynamicTreeSpec,
    OracleDrafter,
    PromptLookupDrafter,
    best_static_paths,
    chain_paths,
    generate,
    medusa_tree_spec,
)
from inference.numerics import near_tie, rounding_step
from inference.tree_size import PassCost, default_accuracy

PROMPTS = 50
NEW_TOKENS = 40
# float32 rounding steps (of the top logit) within which two logits count as tied: a 2-layer pass summed in
# another order moves a logit by a few steps (6 measured at the closest pair seen); distinct logits here are
# thousands of steps apart
FP32_TIE_STEPS = 64


def random_prompts(vocab, count, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        length = int(torch.randint(1, 40, (1,), generator=g))
        prompt = torch.randint(4, vocab, (length,), generator=g)
        if i % 3 == 0 and length > 6:  # repeated spans give prompt lookup something to copy
            prompt = torch.cat([prompt, prompt[: length // 2]])
        prompts.append(prompt)
    return prompts


def random_heads(model):
    torch.manual_seed(1)
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=4))
    # sequential (Hydra-style) heads over a reduced draft vocabulary: the path's tokens feed the next head
    sequential = MedusaHeads(
        MedusaConfig.for_target(model.config, num_heads=4, num_layers=2, sequential=True, draft_vocab_size=48)
    )
    for p in [*medusa.parameters(), *sequential.parameters()]:
        torch.nn.init.normal_(p, std=0.05)  # not the zero init: candidates should vary
    sequential.draft_ids = torch.randperm(model.config.vocab_size)[:48].sort().values
    eagle = EagleHead(EagleConfig.for_target(model.config)).eval()
    # EAGLE-3 fusion with a reduced draft vocabulary: draft indices must map back to the target's ids
    eagle3 = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, 2, -1], draft_vocab_size=48)).eval()
    eagle3.draft_ids.copy_(torch.randperm(model.config.vocab_size)[:48].sort().values)
    # a copy input (what prompt lookup would copy) beside a low layer, as the shipped head
    eagle_copy = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True)).eval()
    return medusa.eval(), sequential.eval(), eagle, eagle3, eagle_copy


@pytest.fixture(
    scope="module", params=[("llama", "sdpa", 11), ("qwen2", "eager", 12)], ids=["llama-sdpa", "qwen2-eager"]
)
def case(request):
    family, attn, seed = request.param  # a fixed seed: hash(str) changes from process to process
    model = tiny_model(family, attn=attn)
    prompts = random_prompts(model.config.vocab_size, PROMPTS, seed=seed)
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return model, prompts, references


def drafters_for(model, prompt, reference):
    medusa, sequential, eagle, eagle3, eagle_copy = random_heads(model)
    full = torch.cat([prompt, torch.tensor(reference, dtype=torch.long)])
    vocab = model.config.vocab_size
    tree30 = best_static_paths(30, default_accuracy(depth=6, ranks=4))
    return {
        "medusa-static": (medusa, [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]),
        "medusa-no-draft-pays": (medusa, []),
        "medusa-dynamic": (medusa, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
        # sized_static_paths' answer on a machine where nothing pays
        "medusa-dynamic-sized": (
            medusa,
            medusa_tree_spec(medusa, nodes=10, cost=PassCost((1, 4, 64), (1.0, 1.1, 8.0))),
        ),
        "medusa-sequential": (sequential, medusa_tree_spec(sequential, nodes=10)),
        "medusa-sequential-sized": (
            sequential,
            medusa_tree_spec(sequential, nodes=10, cost=PassCost((1, 4, 64), (1.0, 1.1, 8.0), 0.05)),
        ),
        "eagle-dynamic": (eagle, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
        "eagle3-chain": (eagle3, DynamicTreeSpec(depth=3, top_k=1, nodes=3)),
        "eagle-copy-dynamic": (eagle_copy, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
        "prompt-lookup": (PromptLookupDrafter(max_ngram=2), None),
        "lookup+eagle-merged": ([eagle, PromptLookupDrafter()], DynamicTreeSpec(depth=3, top_k=2, nodes=6)),
        "oracle-chain-5": (OracleDrafter(full, chain_paths(5), vocab), None),
        "oracle-tree-30": (OracleDrafter(full, tree30, vocab), None),
        "oracle+lookup-merged": ([OracleDrafter(full, tree30, vocab), PromptLookupDrafter()], None),
    }


def first_divergence(ours: list[int], reference: list[int]) -> int:
    return next((d for d, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))


def test_every_drafter_matches_hf_greedy(case):
    """Identical, except where float32 itself cannot decide: a pass over several tokens sums in another order
    than HF's one-token passes, so logits within a few float32 rounding steps of each other may swap. Such
    a divergence must be proven a near-tie of the target (teacher-forced), and be rare."""
    model, prompts, references = case
    mismatches, near_ties, stopped_at_eos, deep_accepts = [], [], 0, 0
    for i, (prompt, reference) in enumerate(zip(prompts, references)):
        stopped_at_eos += len(reference) < NEW_TOKENS
        for name, (heads, tree) in drafters_for(model, prompt, reference).items():
            out = generate(model, heads, prompt, max_new_tokens=NEW_TOKENS, tree=tree, lookup=False, fallback=False)
            if out.token_ids != reference:
                d = first_divergence(out.token_ids, reference)
                tie = (
                    d < min(len(out.token_ids), len(reference))
                    and near_tie(
                        model, prompt.tolist() + reference[:d], out.token_ids[d], reference[d], steps=FP32_TIE_STEPS
                    )[0]
                )
                (near_ties if tie else mismatches).append((i, name, d, out.token_ids, reference))
            if name == "oracle-tree-30":
                deep_accepts += out.stats.mean_accepted > 3
    assert not mismatches, mismatches[:3]
    assert len(near_ties) <= 2, f"float32 near-ties should be rare with logits this spread: {near_ties[:3]}"
    assert stopped_at_eos >= 5, "the prompts should exercise stopping at EOS"
    assert deep_accepts >= PROMPTS // 2, "the oracle should get whole tree paths accepted"


def test_gpt2_family_matches_hf_greedy():
    model = tiny_model("gpt2")
    vocab = model.config.vocab_size
    for prompt in random_prompts(vocab, 20, seed=7):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        full = torch.cat([prompt, torch.tensor(reference, dtype=torch.long)])
        oracle = OracleDrafter(full, best_static_paths(15, default_accuracy(depth=5, ranks=3)), vocab)
        for heads in (oracle, [oracle, PromptLookupDrafter()]):
            assert generate(model, heads, prompt, max_new_tokens=NEW_TOKENS).token_ids == reference


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_is_exact_even_when_the_tree_reaches_further(max_new_tokens):
    model = tiny_model("llama", eos=None)
    prompt = torch.arange(4, 20)
    reference = hf_greedy(model, prompt, max_new_tokens)
    full = torch.cat([prompt, torch.tensor(hf_greedy(model, prompt, 30))])
    out = generate(model, OracleDrafter(full, chain_paths(8), 97), prompt, max_new_tokens=max_new_tokens)
    assert out.token_ids == reference and len(out.token_ids) == max_new_tokens


def test_no_token_past_eos_when_the_tree_runs_beyond_it():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        prompt = torch.randint(4, 97, (10,), generator=g)
        reference = hf_greedy(model, prompt, 40)
        if len(reference) < 40 and len(reference) > 2:
            break
    else:
        pytest.fail("no prompt stopped at EOS")
    assert reference[-1] == 3
    full = torch.cat([prompt, torch.tensor(reference + [5, 6, 7, 8, 9, 10, 11, 12])])  # the oracle drafts past EOS
    out = generate(model, OracleDrafter(full, chain_paths(8), 97), prompt, max_new_tokens=40)
    assert out.token_ids == reference


def test_stats_and_streamer():
    model = tiny_model("llama", eos=None)
    prompt = torch.arange(4, 12)
    reference = hf_greedy(model, prompt, 20)
    full = torch.cat([prompt, torch.tensor(reference)])
    received = []

    class Streamer:
        def put(self, value):
            received.append(value.flatten().tolist())

        def end(self):
            received.append("end")

    out = generate(
        model, OracleDrafter(full, chain_paths(4), 97), prompt, max_new_tokens=20, streamer=Streamer(), fallback=False
    )
    assert received[0] == prompt.tolist() and received[-1] == "end"
    assert sum(received[1:-1], []) == reference
    assert len(received) - 2 == out.stats.target_forwards < 20  # several tokens per step
    s = out.stats
    assert s.new_tokens == 20 and s.mean_accepted == pytest.approx(20 / s.target_forwards)
    assert s.seconds >= s.target_seconds + s.draft_seconds > 0
    assert plain_mean_accepted(model, prompt) == 1.0


def plain_mean_accepted(model, prompt):
    return generate(model, None, prompt, max_new_tokens=10).stats.mean_accepted


def test_a_near_tie_refuted_by_one_pass_is_checked_again_on_generates_own_logits():
    """A teacher-forced pass rounds unlike generate()'s prefill and one-token steps (in bf16 by several steps);
    given the prompt's length, near_tie measures the gap in the very logits generate() computed."""
    model = tiny_model("llama").to(torch.bfloat16)
    prompt = torch.arange(4, 20)
    out = model.generate(
        prompt[None], do_sample=False, max_new_tokens=30, output_logits=True, return_dict_in_generate=True
    )
    context = out.sequences[0, :-1].tolist()  # the prompt and 29 new tokens: the 30th step's logits decide
    logits = out.logits[-1][0].float()
    with torch.inference_mode():
        forced = model(torch.tensor([context])).logits[0, -1].float()
    top = int(logits.argmax())
    assert top == int(forced.argmax())
    step = rounding_step(float(logits.abs().max()), torch.bfloat16)
    apart = (logits[top] - logits) / step  # each token's distance from the top in generate()'s logits, in steps
    rounded_apart = ((forced[top] - forced) / step - apart).abs()
    token = int(torch.where(apart > 10, rounded_apart, 0).argmax())  # far from a tie, and rounded otherwise there
    assert rounded_apart[token] > 0, "the teacher-forced pass rounds unlike generate() somewhere"
    assert near_tie(model, context, token, top, prompt_length=len(prompt)) == (False, float(apart[token]))
    assert near_tie(model, context, token, top)[1] != float(apart[token])
