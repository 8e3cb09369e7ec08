"""Exactness does not depend on the drafter being sane: whatever a drafter or a head proposes, the output is
the target's own, or a clear error names the drafter.

The adversarial drafter draws a random tree every step: random shapes and tokens, the true continuation
hidden on one path (so that deep paths are accepted and commit many tokens at once), siblings that repeat a
token with different subtrees, and paths far deeper than max_new_tokens allows. Heads with NaN or infinite
weights score their drafts NaN.
"""

import random

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from inference import DynamicTreeSpec, PromptLookupDrafter, Tree, TreeError, generate
from inference.drafters import TokenDrafter
from test_exactness_tiny import random_prompts

PROMPTS, NEW_TOKENS = 30, 24


class AdversarialDrafter(TokenDrafter):
    """`continuation`: the true sequence, prompt included."""

    def __init__(self, continuation: torch.Tensor, vocab_size: int, seed: int):
        self.continuation, self.vocab_size, self.rng = continuation.tolist(), vocab_size, random.Random(seed)

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        rng, position = self.rng, tokens.shape[0]
        nodes = [(-1, int(tokens[-1]))]  # (parent, token), parents first

        def chain(parent: int, length: int, truthful: bool) -> None:
            for depth in range(length):
                index = position + depth
                truth = self.continuation[index] if index < len(self.continuation) else rng.randrange(self.vocab_size)
                nodes.append((parent, truth if truthful else rng.randrange(self.vocab_size)))
                parent = len(nodes) - 1

        for _ in range(rng.randint(0, 12)):  # random nodes anywhere
            nodes.append((rng.randrange(len(nodes)), rng.randrange(self.vocab_size)))
        if rng.random() < 0.7:  # the truth, sometimes far past max_depth
            chain(0, rng.randint(1, max_depth + 6), truthful=True)
        for _ in range(rng.randint(0, 3)):  # repeat a sibling's token, with another subtree below it
            original = rng.randrange(1, len(nodes)) if len(nodes) > 1 else None
            if original is not None:
                nodes.append(nodes[original])
                chain(len(nodes) - 1, rng.randint(1, 4), truthful=rng.random() < 0.5)
        parents, ids = zip(*nodes)
        return Tree.from_parents(torch.tensor(ids), torch.tensor(parents))


def broken_heads(model):
    """Heads whose weights are not finite: their scores are NaN, their drafts must count as impossible."""
    nan_bias = EagleHead(EagleConfig.for_target(model.config)).eval()
    nan_bias.fc.bias.data[0] = float("nan")
    all_inf = EagleHead(EagleConfig.for_target(model.config)).eval()
    for p in all_inf.parameters():
        p.data.fill_(float("inf"))
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3)).eval()
    medusa.heads[1][0].linear.bias.data[:] = float("nan")
    spec = DynamicTreeSpec(depth=4, top_k=3, nodes=10)
    return {
        "eagle-nan-bias": (nan_bias, spec),
        "eagle-all-inf": (all_inf, spec),
        "medusa-nan": (medusa, None),
        "eagle-nan-bias+lookup": ([nan_bias, PromptLookupDrafter()], spec),
    }


@pytest.fixture(scope="module", params=[("llama", "sdpa"), ("qwen2", "eager")], ids=["llama-sdpa", "qwen2-eager"])
def case(request):
    family, attn = request.param
    model = tiny_model(family, attn=attn)
    prompts = random_prompts(model.config.vocab_size, PROMPTS, seed=11)
    return model, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


def test_adversarial_trees_never_change_greedy_output(case):
    model, prompts, references = case
    vocab, mismatches, deep = model.config.vocab_size, [], 0
    for i, (prompt, reference) in enumerate(zip(prompts, references)):
        full = torch.cat([prompt, torch.tensor(reference, dtype=torch.long)])
        for max_new_tokens in (NEW_TOKENS, 1 + i % 5):  # short budgets: trees reach far past them
            drafter = AdversarialDrafter(full, vocab, seed=i)
            out = generate(model, drafter, prompt, max_new_tokens=max_new_tokens, fallback=False)
            if out.token_ids != reference[:max_new_tokens]:
                mismatches.append((i, max_new_tokens, out.token_ids, reference[:max_new_tokens]))
            deep += out.stats.mean_accepted > 2
        merged = generate(
            model,
            [AdversarialDrafter(full, vocab, seed=i), PromptLookupDrafter()],
            prompt,
            max_new_tokens=NEW_TOKENS,
            fallback=False,
        )
        if merged.token_ids != reference:
            mismatches.append((i, "merged with lookup", merged.token_ids, reference))
    assert not mismatches, mismatches[:3]
    assert deep >= PROMPTS // 2, "the hidden true paths should be accepted deep: the test would prove little"


def test_sampling_with_adversarial_trees_stays_the_targets_choice(case):
    """top_k=1 makes the sampled target deterministic: the sampling path must then give greedy's tokens."""
    model, prompts, references = case
    for i, (prompt, reference) in enumerate(zip(prompts[:10], references)):
        full = torch.cat([prompt, torch.tensor(reference, dtype=torch.long)])
        out = generate(
            model,
            AdversarialDrafter(full, model.config.vocab_size, seed=i),
            prompt,
            max_new_tokens=NEW_TOKENS,
            temperature=0.7,
            top_k=1,
            seed=i,
        )
        assert out.token_ids == reference, i


def test_heads_with_non_finite_weights_draft_nothing_wrong(case):
    model, prompts, references = case
    for name, (heads, tree) in broken_heads(model).items():
        for i, (prompt, reference) in enumerate(zip(prompts[:10], references)):
            out = generate(model, heads, prompt, max_new_tokens=NEW_TOKENS, tree=tree)
            assert out.token_ids == reference, (name, i, out.token_ids, reference)
            sampled = generate(
                model, heads, prompt, max_new_tokens=NEW_TOKENS, tree=tree, temperature=1.0, top_k=1, seed=0
            )
            assert sampled.token_ids == reference, (name, i)


class OneBadStep(TokenDrafter):
    """Proposes a sane chain, except on its third step, where it proposes `bad(tokens)`."""

    def __init__(self, bad):
        self.bad, self.steps = bad, 0

    def propose(self, tokens, max_depth):
        self.steps += 1
        return self.bad(tokens) if self.steps == 3 else Tree.chain(tokens[-1:])


def wrong_root(tokens):
    return Tree.chain(torch.cat([(tokens[-1:] + 1) % 97, tokens[-1:]]))


def parents_after_children(tokens):
    tree = Tree.chain(torch.cat([tokens[-1:], tokens[:2]]))
    return Tree(tree.tokens, torch.tensor([-1, 2, 0]), tree.depth, tree.ancestors, tree.max_depth)


def lying_depth(tokens):
    tree = Tree.chain(torch.cat([tokens[-1:], tokens[:3]]))
    return Tree(
        tree.tokens, tree.parents, tree.depth, tree.ancestors, 1
    )  # says 1 deep, is 3: would commit past the tree's end


def lying_ancestors(tokens):
    tree = Tree.chain(torch.cat([tokens[-1:], tokens[:2]]))
    return Tree(tree.tokens, tree.parents, tree.depth, torch.eye(3, dtype=torch.bool), tree.max_depth)


def token_out_of_vocabulary(tokens):
    return Tree.chain(torch.cat([tokens[-1:], torch.tensor([97])]))


def float_tokens(tokens):
    tree = Tree.chain(tokens[-2:])
    return Tree(tree.tokens.float(), tree.parents, tree.depth, tree.ancestors, tree.max_depth)


@pytest.mark.parametrize(
    "bad, message",
    [
        (wrong_root, "rooted at token .* but the last committed token is"),
        (parents_after_children, "are not a tree"),
        (lying_depth, "disagree with its parents"),
        (lying_ancestors, "disagree with its parents"),
        (token_out_of_vocabulary, r"outside the vocabulary \[0, 97\)"),
        (float_tokens, "malformed tree"),
        (lambda tokens: [int(tokens[-1])], "proposed list, not an inference.Tree"),
    ],
)
def test_malformed_trees_are_errors_that_name_the_drafter(bad, message):
    model = tiny_model("llama", eos=None)
    prompt = torch.arange(4, 12)
    for heads in (OneBadStep(bad), [OneBadStep(bad), PromptLookupDrafter()]):
        with pytest.raises(TreeError, match=f"OneBadStep.*{message}|OneBadStep proposed {message}"):
            generate(model, heads, prompt, max_new_tokens=10)
