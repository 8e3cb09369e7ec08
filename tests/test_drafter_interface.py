"""The drafter interface as the loop uses it: every kind of drafter is a Drafter, and a drafter of one sequence
is written in a few lines through the SequenceDrafter adapter."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from inference import Drafter, SequenceDrafter, Tree, generate
from inference.drafters import (
    EagleDrafter,
    MedusaDrafter,
    MergedDrafter,
    NoDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    as_drafter,
    drafter_class,
)


class SuccessorDrafter(SequenceDrafter):
    """Remembers what followed each token it has seen committed, and drafts a chain of those successors."""

    hidden_layers = (-1,)  # it asks for the last layer's hidden states, only to check they come

    def reset(self, rows=1):
        self.successors, self.observed = {}, 0

    def observe(self, hidden, next_tokens):
        assert hidden[-1].shape[0] == next_tokens.shape[0]  # one hidden state for each committed token's position
        self.observed += next_tokens.shape[0]

    def propose(self, tokens, max_depth):
        text = tokens.tolist()
        for before, after in zip(text[:-1], text[1:]):
            self.successors[before] = after
        chain = [text[-1]]
        while len(chain) <= max_depth and chain[-1] in self.successors and len(chain) < 6:
            chain.append(self.successors[chain[-1]])
        return Tree.chain(torch.tensor(chain))


def test_a_drafter_of_one_sequence_decodes_exactly():
    model = tiny_model("llama", eos=None)
    prompt = torch.tensor([5, 6, 7, 5, 6, 9, 3])
    drafter = SuccessorDrafter()
    out = generate(model, drafter, prompt, max_new_tokens=40, fallback=False)
    assert out.token_ids == hf_greedy(model, prompt, 40)
    assert drafter.observed == prompt.shape[0] + 40 - 1 - 1  # all but the last token have a next token, less the root
    assert out.stats.target_forwards < 40  # its chains were accepted sometimes


def test_every_drafter_is_one():
    model = tiny_model("llama", eos=None)
    torch.manual_seed(0)
    eagle = EagleHead(EagleConfig.for_target(model.config)).eval()
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2)).eval()
    assert drafter_class(eagle) is EagleDrafter and drafter_class(medusa) is MedusaDrafter
    assert drafter_class(PromptLookupDrafter()) is None
    built = [as_drafter(h, model) for h in (None, eagle, medusa, [eagle, PromptLookupDrafter()])]
    built.append(OracleDrafter(torch.arange(10), [(0,)], 97))
    assert [type(d) for d in built[:4]] == [NoDrafter, EagleDrafter, MedusaDrafter, MergedDrafter]
    assert all(isinstance(d, Drafter) for d in built)


def test_something_that_only_looks_like_a_drafter_is_refused():
    class Duck:
        hidden_layers = ()

        def propose(self, tokens, max_depth):
            return Tree.chain(tokens[-1:])

    with pytest.raises(TypeError, match="subclass inference.drafters.SequenceDrafter"):
        generate(tiny_model("llama"), Duck(), [5, 6])


def test_prompt_lookup_copies_after_the_latest_occurrence_of_the_longest_match():
    lookup = PromptLookupDrafter(max_ngram=3, num_tokens=4)
    span, n = lookup.span(torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]), max_depth=3)
    assert (span, n) == ([1, 2, 6], 2)  # (6, 7) last seen before 1 2 6 7; (2, 6, 7) never
    span, n = lookup.span(torch.tensor([1, 2, 3, 4, 9, 3, 5, 2, 3]), max_depth=8)
    assert (span, n) == ([4, 9, 3, 5], 2)  # (2, 3) beats the later 3 alone
    assert lookup.span(torch.tensor([1, 2, 3]), 8)[1] == 0 and lookup.span(torch.tensor([4]), 8)[1] == 0
    assert lookup.span(torch.tensor([4, 4]), 0)[0] == []
