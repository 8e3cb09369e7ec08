"""Sampling is lossless: sequences drawn through the engine follow the target's exact distribution.

The exact distribution of every 3-token continuation is enumerated from a tiny model with a 6-token
vocabulary. The engine's empirical total-variation distance (TV) must stay inside the band an exact
sampler's TV falls in at the same sample count (and so shrink like it), while a deliberately lossy
acceptance rule (Medusa-style "typical acceptance") must fall outside it: the test can fail.
"""

import importlib
import itertools

import pytest
import torch

from conftest import tiny_model
from heads import MedusaConfig, MedusaHeads
from inference import Sampling, generate
from inference.accept import accepted_path, target_probabilities, target_tokens

engine = importlib.import_module("inference.generate")  # the module, not the function it exports
VOCAB, NEW, COUNTS = 6, 3, (500, 3000)
PROMPT = torch.tensor([1, 4, 2, 5, 0])
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama", vocab_size=VOCAB, init=0.25, eos=None, seed=5)
    torch.manual_seed(2)
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model, heads.eval()


def exact_distribution(model, sampling):
    sequences = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    inputs = torch.cat([PROMPT.expand(len(sequences), -1), sequences], dim=1)
    with torch.no_grad():
        logits = model(inputs).logits[:, len(PROMPT) - 1 : -1]  # the distributions of the 3 new tokens
    probs = target_probabilities(logits.reshape(-1, VOCAB), sampling).reshape(len(sequences), NEW, VOCAB)
    return probs.gather(-1, sequences[..., None]).squeeze(-1).prod(-1).double()


def index_of(tokens):
    return sum(t * VOCAB ** (NEW - 1 - i) for i, t in enumerate(tokens))


def tv(counts, exact):
    return 0.5 * (counts / counts.sum() - exact).abs().sum().item()


def exact_sampler_band(exact, n, trials=200):
    g = torch.Generator().manual_seed(0)
    tvs = torch.tensor([tv(torch.bincount(torch.multinomial(exact, n, True, generator=g), minlength=len(exact)).double(), exact) for _ in range(trials)])
    return tvs.mean().item() + 4 * tvs.std().item()


def engine_tv(model, heads, sampling, exact):
    counts = torch.zeros(len(exact), dtype=torch.float64)
    out, accepted_beyond_root = {}, 0
    for seed in range(max(COUNTS)):
        g = generate(model, heads, PROMPT, max_new_tokens=NEW, tree=TREE, seed=seed,
                     temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        counts[index_of(g.token_ids)] += 1
        accepted_beyond_root += g.stats.target_forwards < NEW
        if seed + 1 in COUNTS:
            out[seed + 1] = tv(counts, exact)
    assert accepted_beyond_root > max(COUNTS) // 4, "drafts must be accepted often for the test to mean anything"
    return out


def typical_acceptance(tree, logits, sampling, generator=None):
    """Lossy on purpose: a draft token with p >= 0.15 is accepted even when the target's draw differs."""
    chosen = target_tokens(logits, sampling, generator)
    probs = target_probabilities(logits, sampling)
    likely = probs[tree.parents.clamp(min=0), tree.tokens] >= 0.15
    likely[0] = False
    for node in likely.nonzero().flatten().flip(0):  # the first likely sibling wins
        chosen[tree.parents[node]] = tree.tokens[node]
    path = accepted_path(tree, chosen)
    return path, torch.cat([tree.tokens[path[1:]], chosen[path[-1:]]])


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=1.5, top_k=4, top_p=0.95)], ids=["t1", "t1.5-k4-p0.95"])
def test_engine_samples_the_exact_distribution_and_a_lossy_rule_does_not(setup, sampling, monkeypatch):
    model, heads = setup
    exact = exact_distribution(model, sampling)
    assert (exact > 0.01).sum() >= 10, "a near-deterministic distribution would prove nothing"
    bands = {n: exact_sampler_band(exact, n) for n in COUNTS}
    ours = engine_tv(model, heads, sampling, exact)
    for n in COUNTS:
        assert ours[n] < bands[n], f"TV {ours[n]:.4f} at {n} samples is outside an exact sampler's band {bands[n]:.4f}"
    monkeypatch.setattr(engine, "accept", typical_acceptance)
    lossy = engine_tv(model, heads, sampling, exact)
    assert lossy[max(COUNTS)] > bands[max(COUNTS)], f"the lossy rule went undetected: TV {lossy[max(COUNTS)]:.4f}"
    print(f"\n{sampling}: bands {bands}, engine {ours}, lossy {lossy}")
