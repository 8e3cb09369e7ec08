"""Falling back to plain decoding: the rule on its own (step times given), and exactness when the loop switches."""

import importlib

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from inference import DynamicTreeSpec, OracleDrafter, PromptLookupDrafter, SequenceDrafter, Tree, chain_paths, generate
from inference.drafters import EagleDrafter, MedusaDrafter, MergedDrafter, NoDrafter
from inference.fallback import Fallback

engine = importlib.import_module("inference.generate")


def run(fallback: Fallback, steps: int, drafted_step, plain_step) -> str:
    """Drive the rule for `steps` steps; drafted_step / plain_step give (tokens, seconds). 'D' drafted, 'p' plain."""
    taken = ""
    for _ in range(steps):
        drafting = fallback.use_drafter()
        fallback.record(drafting, *(drafted_step if drafting else plain_step))
        taken += "D" if drafting else "p"
    return taken


def test_drafting_that_loses_to_plain_decoding_is_held_off_and_probed_again():
    # drafted: 2 tokens in 3 s; plain: 1 token in 1 s
    taken = run(Fallback(judge=2, hold=4, max_hold=8), 40, (2, 3.0), (1, 1.0))
    # the first drafted step is not timed, two more are; one plain step prices plain decoding; drafting loses by a
    # third: a hold long enough that the next probe costs 5% of it, capped at max_hold (8), then a probe of two timed
    # drafted steps after an untimed one (it also feeds the drafter what the plain steps committed), 8 plain, ...
    assert taken.startswith("DDD" + "p" + "p" * 8 + "DDD" + "p" * 8 + "DDD" + "p" * 8), taken
    assert taken.count("D") <= 12


def test_drafting_that_loses_clearly_stops_after_three_steps_and_a_losing_drafter_starts_the_next_call_held():
    # drafted: 1 token in 2 s (half of plain's pace); plain decoding priced after three timed drafted steps, which
    # already lose clearly (under 0.8 of its pace): held off then, and a probe after the hold ends as early
    first = Fallback(hold=4, max_hold=100)
    taken = run(first, 100, (1, 2.0), (1, 1.0))
    # (3 + 1) steps, each taking two plain steps' time for its one token, lose 4 plain steps: 5% of an 80-step hold
    hold = first.hold_for(0.5)
    assert hold == 80 and taken.startswith("D" * 4 + "p" + "p" * hold + "D" * 4 + "p"), taken
    assert first.lost and first.ratio == 0.5
    # the next call of the same heads starts with that hold, prices plain decoding there, then probes
    second = Fallback(hold=4, max_hold=100, last_ratio=first.ratio)
    assert run(second, 85, (1, 2.0), (1, 1.0)) == "p" * hold + "D" * 4 + "p"
    assert run(Fallback(last_ratio=1.3), 3, (1, 2.0), (1, 1.0)) == "DDD"  # a drafter that was winning starts drafting


def test_a_hold_grows_with_the_tokens_a_losing_probe_step_commits():
    fallback = Fallback(max_hold=100)
    # at 0.8 of plain's pace a step committing 2 tokens takes 2.5 plain steps' time: it loses twice what a
    # one-token step does
    assert fallback.hold_for(0.8, tokens=2.0) == 2 * fallback.hold_for(0.8) == 40
    assert fallback.hold_for(0.0) == 100  # capped at max_hold


def test_a_batch_prices_plain_decoding_over_two_steps():
    """One plain step that happened to run fast must not stop drafting that pays (a batch's steps are noisy)."""

    def taken(price: int) -> str:
        fallback, plain_times, steps = Fallback(judge=4, price=price), iter([0.3] + [1.0] * 30), ""
        for _ in range(30):  # drafted: 2 tokens in 1.2 s; plain: 1 token in 1 s, the first one in 0.3 s
            drafting = fallback.use_drafter()
            fallback.record(drafting, *((2, 1.2) if drafting else (1, next(plain_times))))
            steps += "D" if drafting else "p"
        return steps

    assert taken(price=2) == "D" * 4 + "pp" + "D" * 24  # 2 tokens in 1.3 s: drafting goes on
    assert taken(price=1).startswith("D" * 4 + "p" + "p" * 8)  # priced by the lucky step alone, drafting is held off


def test_a_step_that_reads_a_joining_prompt_is_not_timed():
    """A prompt joining a batch makes the next drafted step feed the drafter the whole prompt: slow, and no sign
    that drafting stopped paying."""
    fallback = Fallback(judge=2)
    for _ in range(3):  # the untimed first step, then two that pay: 3 tokens in 1 s
        fallback.record(fallback.use_drafter(), 3, 1.0)
    assert not fallback.use_drafter()  # one plain step prices plain decoding: 1 token in 0.9 s
    fallback.record(False, 1, 0.9)
    fallback.prompt_joined()
    assert fallback.use_drafter()
    fallback.record(True, 3, 30.0)  # the step that read the prompt
    assert fallback.use_drafter() and fallback.plain_left == 0


def test_the_step_after_prompts_join_is_not_timed_even_when_it_is_plain():
    """A call that starts held (its heads lost the last call) hands the drafter its prompts in its first, plain, step:
    timed, that step once priced plain decoding at a third of its pace, and drafting that lost ran the whole call."""
    fallback, taken = Fallback(judge=4, price=2, last_ratio=0.95), ""
    fallback.prompt_joined()
    for at in range(20):  # drafted: 1.5 tokens in 2 s; plain: 1 token in 1 s, the first step 10 s
        drafting = fallback.use_drafter()
        fallback.record(drafting, *((1.5, 2.0) if drafting else (1, 10.0 if at == 0 else 1.0)))
        taken += "D" if drafting else "p"
    hold = fallback.hold_for(0.95)
    assert hold == 5 and taken.startswith("p" * hold + "D" * 4 + "p"), taken  # an untimed probe step, three losing


def test_a_few_unlucky_steps_do_not_stop_drafting_that_pays_on_average():
    fallback, taken = Fallback(judge=4), ""
    for _ in range(60):  # drafted steps take 2 s and commit 1, 1, then 6 tokens; a plain step commits 1 in 1 s
        drafting = fallback.use_drafter()
        fallback.record(drafting, *((6 if taken.count("D") % 3 == 2 else 1, 2.0) if drafting else (1, 1.0)))
        taken += "D" if drafting else "p"
    assert taken.count("p") == 1, taken  # 8 tokens in 6 s beats 1 in 1 s: plain decoding priced once, never chosen


def test_drafting_that_pays_keeps_drafting():
    taken = run(Fallback(), 40, (4, 2.0), (1, 1.0))
    assert taken == "D" * 4 + "p" + "D" * 35  # plain decoding priced once, after three timed drafted steps


def test_a_disabled_fallback_always_drafts():
    assert run(Fallback(enabled=False), 20, (1, 9.0), (1, 1.0)) == "D" * 20


class Alternating(Fallback):
    """Switches between drafting and plain decoding every other step, whatever the times."""

    def __init__(self, enabled=True, **unused):
        super().__init__(enabled)
        self.steps = 0

    def use_drafter(self):
        self.steps += 1
        return self.steps % 3 != 0


def test_switching_between_drafting_and_plain_steps_stays_exact(monkeypatch):
    monkeypatch.setattr(engine, "Fallback", Alternating)
    model = tiny_model("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True)).eval()
    g = torch.Generator().manual_seed(4)
    for _ in range(10):
        prompt = torch.randint(4, 97, (14,), generator=g)
        prompt = torch.cat([prompt, prompt[:6]])
        reference = hf_greedy(model, prompt, 30)
        full = torch.cat([prompt, torch.tensor(reference)])
        for heads in (head, OracleDrafter(full, chain_paths(4), 97), [head, PromptLookupDrafter()]):
            out = generate(model, heads, prompt, max_new_tokens=30)
            assert out.token_ids == reference
            assert out.stats.plain_steps > 0 or out.stats.target_forwards < 4


def test_the_default_call_is_exact_and_reports_its_latency():
    """generate(model, head, prompt): a tree sized to this machine, prompt lookup merged, the fallback on."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        prompt = torch.randint(4, 97, (12,), generator=g)
        out = generate(model, head, prompt, max_new_tokens=24)
        assert out.token_ids == hf_greedy(model, prompt, 24)
        s = out.stats
        assert 0 < s.time_to_first_token < s.seconds and s.time_per_output_token > 0
        assert len(s.acceptance_by_depth) == len(s.drafted_to_depth) and all(0 <= a <= 1 for a in s.acceptance_by_depth)
        assert s.drafted_to_depth == sorted(
            s.drafted_to_depth, reverse=True
        )  # a step that drafted d deep drafted d - 1


def test_acceptance_by_depth_counts_what_the_oracle_got_accepted():
    model = tiny_model("llama", eos=None)
    prompt = torch.arange(4, 12)
    full = torch.cat([prompt, torch.tensor(hf_greedy(model, prompt, 40))])
    out = generate(model, OracleDrafter(full, chain_paths(3), 97), prompt, max_new_tokens=17, fallback=False)
    # 16 tokens after the prefill's: four steps of 3 drafts + 1, nothing rejected
    assert out.stats.drafted_to_depth == [4, 4, 4] and out.stats.acceptance_by_depth == [1.0, 1.0, 1.0]
    assert out.stats.plain_steps == 0


def test_a_call_starts_from_the_last_verdict_of_calls_decoding_as_many_rows():
    """A head that lost at eight rows at once starts the next eight-row call held, but not a one-row call, where it
    may well pay (and the other way round)."""
    model = tiny_model("llama")
    eagle = EagleHead(EagleConfig.for_target(model.config)).eval()
    tree = DynamicTreeSpec(depth=2, top_k=2, nodes=3)
    batch = engine.plan(model, eagle, tree, None, True, batch=(8, 8))
    batch.fallback.ratio = 0.5  # as a call that ended losing leaves it
    batch.remember()
    assert engine.plan(model, eagle, tree, None, True, batch=(8, 8)).fallback.plain_left > 0
    assert engine.plan(model, eagle, tree, None, True).fallback.plain_left == 0  # one row: no verdict yet
    assert engine.plan(model, eagle, tree, None, True, batch=(16, 4)).fallback.plain_left == 0


def test_one_plan_for_one_prompt_and_for_a_batch():
    """generate()'s heads, tree, lookup and fallback become a drafter and a fallback in one place (plan)."""
    model = tiny_model("llama")
    eagle = EagleHead(EagleConfig.for_target(model.config)).eval()
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2)).eval()
    tree = DynamicTreeSpec(depth=3, top_k=2, nodes=6)
    plan = engine.plan
    one = plan(model, eagle, tree, None, True)  # one prompt: lookup merged into the head's tree, the fallback on
    assert isinstance(one.drafter, MergedDrafter) and one.fallback.enabled and one.fallback.judge == 8
    assert {type(d) for d in one.drafter.drafters} == {EagleDrafter, PromptLookupDrafter}
    assert isinstance(plan(model, eagle, tree, False, True).drafter, EagleDrafter)
    assert not plan(model, None, None, None, True).fallback.enabled  # nothing to fall back from
    assert isinstance(plan(model, None, None, None, True).drafter, NoDrafter)
    batch = plan(model, eagle, tree, None, True, batch=(6, 4))  # a head growing dynamic trees: lookup weighed in
    assert isinstance(batch.drafter, MergedDrafter) and (batch.fallback.judge, batch.fallback.price) == (4, 2)
    medusa_batch = plan(model, medusa, [(0,), (0, 0)], None, False, batch=(6, 4))  # static trees: no lookup
    assert isinstance(medusa_batch.drafter, MedusaDrafter) and not medusa_batch.fallback.enabled
    single_row = plan(model, medusa, [(0,), (0, 0)], None, True, batch=(1, 1))  # one prompt in a list: lookup too
    assert isinstance(single_row.drafter, MergedDrafter)
    assert isinstance(plan(model, one.drafter.drafters[0], None, None, True, batch=(2, 2)).drafter, EagleDrafter)

    class OneSequence(SequenceDrafter):  # a drafter of one sequence, with state of its own
        def propose(self, tokens, max_depth):
            return Tree.chain(tokens[-1:])

    with pytest.raises(ValueError, match="OneSequence drafts for one sequence at a time"):
        plan(model, OneSequence(), None, None, True, batch=(2, 2))
    assert isinstance(plan(model, OneSequence(), None, None, True).drafter, OneSequence)
