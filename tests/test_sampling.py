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
from inference import Sampling, Tree, compile_target, generate, warm_up
from inference.accept import accept_chosen, target_probabilities, target_tokens
from inference.drafters import TokenDrafter

engine = importlib.import_module("inference.loop")  # the decode loop, whose acceptance rule is patched
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
    tvs = torch.tensor(
        [
            tv(torch.bincount(torch.multinomial(exact, n, True, generator=g), minlength=len(exact)).double(), exact)
            for _ in range(trials)
        ]
    )
    return tvs.mean().item() + 4 * tvs.std().item()


def engine_tv(model, heads, sampling, exact, tree=TREE, max_new_tokens=NEW):
    """TV of the first NEW tokens; a longer max_new_tokens lets the first tree reach deeper."""
    counts = torch.zeros(len(exact), dtype=torch.float64)
    out, accepted_beyond_root = {}, 0
    for seed in range(max(COUNTS)):
        g = generate(
            model,
            heads,
            PROMPT,
            max_new_tokens=max_new_tokens,
            tree=tree,
            seed=seed,
            lookup=False,
            fallback=False,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )
        counts[index_of(g.token_ids[:NEW])] += 1
        accepted_beyond_root += g.stats.target_forwards < max_new_tokens
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
    return accept_chosen(tree, chosen)


class RepeatedSiblings(TokenDrafter):
    """Every token a twice at depth 1 of the first tree: the first copy's child is the target's least likely
    token after a, the second copy's its likeliest z. Verified as proposed, z would get a second chance:
    p(z) (2 - p(least) - p(z)) instead of p(z)."""

    def __init__(self, model):
        contexts = torch.cat(
            [PROMPT.expand(VOCAB * VOCAB, -1), torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))], dim=1
        )
        with torch.no_grad():
            order = model(contexts).logits[:, -1].argsort(dim=-1)  # [first token * VOCAB + a, tokens by likelihood]
        self.children = order[:, [0, -1]].reshape(VOCAB, VOCAB, 2)

    def propose(self, tokens, max_depth):
        if tokens.shape[0] != PROMPT.shape[0] + 1:
            return Tree.chain(tokens[-1:])
        a = torch.arange(VOCAB)
        children = self.children[tokens[-1]]  # [a, (least likely, likeliest)]
        ids = torch.cat([tokens[-1:], a, a, children[:, 0], children[:, 1]])
        parents = torch.cat(
            [torch.tensor([-1]), torch.zeros(2 * VOCAB, dtype=torch.long), torch.arange(1, 2 * VOCAB + 1)]
        )
        return Tree.from_parents(ids, parents).truncate(max_depth)


@pytest.mark.slow
def test_siblings_that_repeat_a_token_are_sampled_exactly(setup, monkeypatch):
    """The engine drops the later of two siblings with one token; the same trees verified as proposed are the
    negative control. Four new tokens, so the first tree may be two deep: the prefill's token, then a sibling
    pair and their children, all within the three tokens scored."""
    model, _ = setup
    sampling = Sampling(temperature=1.0)
    exact = exact_distribution(model, sampling)
    band = exact_sampler_band(exact, max(COUNTS))
    ours = engine_tv(model, RepeatedSiblings(model), sampling, exact, tree=None, max_new_tokens=NEW + 1)[max(COUNTS)]
    assert ours < band, f"TV {ours:.4f} is outside an exact sampler's band {band:.4f}"

    def as_proposed_trees(trees, roots, vocab, depths, name):  # only cut to the depth, repeated siblings kept
        return [tree.truncate(depth) for tree, depth in zip(trees, depths)]

    monkeypatch.setattr(engine, "verifiable_trees", as_proposed_trees)
    as_proposed = engine_tv(model, RepeatedSiblings(model), sampling, exact, tree=None, max_new_tokens=NEW + 1)[
        max(COUNTS)
    ]
    assert as_proposed > band, f"repeated siblings went undetected: TV {as_proposed:.4f}"
    print(f"\nrepeated siblings: band {band:.4f}, engine {ours:.4f}, verified as proposed {as_proposed:.4f}")


def check_lossless_and_lossy_detected(model, heads, sampling, monkeypatch, what: str = "") -> None:
    """The engine's TV stays inside an exact sampler's band at every sample count; a lossy rule's falls outside."""
    exact = exact_distribution(model, sampling)
    assert (exact > 0.01).sum() >= 10, "a near-deterministic distribution would prove nothing"
    bands = {n: exact_sampler_band(exact, n) for n in COUNTS}
    ours = engine_tv(model, heads, sampling, exact)
    for n in COUNTS:
        assert ours[n] < bands[n], (
            f"{what}TV {ours[n]:.4f} at {n} samples is outside an exact sampler's band {bands[n]:.4f}"
        )
    monkeypatch.setattr(engine, "accept", typical_acceptance)
    lossy = engine_tv(model, heads, sampling, exact)
    assert lossy[max(COUNTS)] > bands[max(COUNTS)], f"{what}the lossy rule went undetected: TV {lossy[max(COUNTS)]:.4f}"
    print(f"\n{what}{sampling}: bands {bands}, engine {ours}, lossy {lossy}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling", [Sampling(temperature=1.0), Sampling(temperature=1.5, top_k=4, top_p=0.95)], ids=["t1", "t1.5-k4-p0.95"]
)
def test_engine_samples_the_exact_distribution_and_a_lossy_rule_does_not(setup, sampling, monkeypatch):
    model, heads = setup
    check_lossless_and_lossy_detected(model, heads, sampling, monkeypatch)


@pytest.mark.slow
def test_compiled_passes_sample_the_exact_distribution_and_a_lossy_rule_does_not(setup, monkeypatch):
    """The same check through compiled target passes (inference.compiled), on a model of the same weights: its own
    instance, so the other tests here decode eagerly."""
    _, heads = setup
    model = compile_target(tiny_model("llama", vocab_size=VOCAB, init=0.25, eos=None, seed=5))
    warm_up(model, verbose=False)  # both packages, the narrow one serving the plain steps
    check_lossless_and_lossy_detected(model, heads, Sampling(temperature=1.0), monkeypatch, what="compiled: ")
