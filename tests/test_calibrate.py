"""Trees sized to the machine: the pass-cost calibration is measured once and cached, and a calibrated
EAGLE tree stays exact while shrinking toward plain decoding when drafts do not pay."""

import json

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from inference import DynamicTreeSpec, calibrate, generate, loop, store
from inference.accept import Sampling
from inference.drafters import as_drafter
from inference.fallback import Fallback
from inference.generate import eos_ids
from inference.tree_size import PassCost


def measured_as(monkeypatch, *measurements) -> list:
    """calibrate.measure stands in for by these Measurements, one a call: no test depends on timing luck."""
    calls = []

    def measure(*args, **kwargs):
        calls.append(1)
        return measurements[min(len(calls), len(measurements)) - 1]

    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(calibrate, "busy_elsewhere_since", lambda: lambda: 0.0)
    return calls


SOUND = calibrate.Measurement(PassCost((1, 2, 4), (1.0, 1.1, 1.3), 0.05, 0.1), 0.01, 0.02)


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    spec = DynamicTreeSpec(depth=3, top_k=2, nodes=6)
    calls = measured_as(monkeypatch, SOUND)
    assert calibrate.load_or_measure(model, head, spec) == SOUND.cost
    [saved] = (tmp_path / "calibration").glob("*.json")
    assert json.loads(saved.read_text())["one_token_pass_ms"] == 10.0
    assert calibrate.calibration_age(saved) == "0 minutes"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "relative": [1.0, 9.0, 9.0]}))
    assert calibrate.load_or_measure(model, head, spec).relative[1] == 9.0 and len(calls) == 1  # read back
    assert calibrate.load_or_measure(model, head, spec, refresh=True) == SOUND.cost and len(calls) == 2


def test_a_calibration_serves_only_the_engine_code_that_measured_it(tmp_path, monkeypatch):
    """A step's drafting costs what the engine's code makes it cost: after an upgrade the old prices are not used."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = tiny_model("llama")
    calls = measured_as(monkeypatch, SOUND, SOUND)
    assert calibrate.load_or_measure(model) == SOUND.cost and len(calls) == 1
    assert calibrate.load_or_measure(model) == SOUND.cost and len(calls) == 1  # the same code: read back
    monkeypatch.setattr(store, "code_digest", lambda: "another version of the engine")
    assert calibrate.load_or_measure(model) == SOUND.cost and len(calls) == 2  # measured again
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2


def test_the_source_digest_follows_every_source_file(tmp_path):
    package = tmp_path / "engine"
    (package / "kernels").mkdir(parents=True)
    (package / "loop.py").write_text("STEP = 1\n")
    (package / "kernels" / "linear.cpp").write_text("int x;\n")
    first = store.source_digest([package])
    (package / "kernels" / "linear.cpp").write_text("int y;\n")
    second = store.source_digest([package])
    (package / "notes.txt").write_text("not a source")
    assert len({first, second}) == 2 and store.source_digest([package]) == second


def test_a_doubtful_calibration_is_measured_again_then_serves_this_process_only(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = tiny_model("llama")
    noisy = calibrate.Measurement(PassCost((1, 2), (1.0, 3.98)), 0.01, 0.4)
    calls = measured_as(monkeypatch, noisy, noisy)
    with pytest.warns(UserWarning, match=r"doubtful \(its rounds disagreed by 40%\).*--refresh"):
        assert calibrate.load_or_measure(model) == noisy.cost
    assert len(calls) == 2 and not (tmp_path / "calibration").exists(), "measured again, then not kept"
    assert calibrate.load_or_measure(model) == noisy.cost and len(calls) == 2, "not measured again in this process"
    # measured again and sound the second time: kept
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    calls = measured_as(monkeypatch, noisy, SOUND)
    assert calibrate.load_or_measure(model, head, DynamicTreeSpec(depth=2, top_k=2, nodes=3)) == SOUND.cost
    assert len(calls) == 2 and len(list((tmp_path / "calibration").glob("*.json"))) == 1


def test_costs_that_cannot_be_right_or_a_busy_machine_make_a_measurement_doubtful():
    def doubt(level=0.05, step=0.1, disagreement=0.02, busy=0.0, drafts=True, one_pass=0.01):
        measured = calibrate.Measurement(PassCost((1, 2), (1.0, 1.1), level, step), one_pass, disagreement)
        return calibrate.doubt_about(measured, drafts, busy)

    assert doubt() is None and doubt(level=0.0, drafts=False) is None
    assert "free" in doubt(level=0.0)
    assert "3.0 one-token passes" in doubt(step=3.02)
    assert doubt(step=3.7, one_pass=0.0004) is None, "a tiny model's step: 1.5 ms of the loop's own work is real"
    assert "disagreed" in doubt(disagreement=0.5)
    assert "busy" in doubt(busy=0.9)


@pytest.mark.idle  # `make test` runs it after the parallel workers are done
def test_other_processes_keeping_a_core_busy_are_noticed():
    import subprocess
    import sys
    import time

    quiet = calibrate.busy_elsewhere_since()
    time.sleep(0.5)
    before = quiet()
    if before > 0.3:  # a spinner is told apart only from an idle machine (CI's)
        pytest.skip(f"other processes kept {before:.2f} of a core busy: this check needs an idle machine")
    busy = calibrate.busy_elsewhere_since()
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"]
    )
    spinner.wait()
    assert busy() > 0.5, "a process spinning on a core for 1.5 s"
    assert before < busy()


def test_calibrated_tree_is_exact_and_shrinks_when_drafts_do_not_pay():
    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_target(model.config)).eval()  # untrained: its drafts rarely hold
    prompt = torch.randint(4, 97, (12,), generator=torch.Generator().manual_seed(3))
    reference = hf_greedy(model, prompt, 24)
    free = DynamicTreeSpec(depth=3, top_k=2, nodes=6, cost=PassCost((1, 64), (1.0, 1.0)))
    costly = DynamicTreeSpec(depth=3, top_k=2, nodes=6, cost=PassCost((1, 2), (1.0, 3.0), draft_level=0.5))
    head_alone = dict(max_new_tokens=24, lookup=False, fallback=False)
    wide, narrow = (
        generate(model, head, prompt, tree=free, **head_alone),
        generate(model, head, prompt, tree=costly, **head_alone),
    )
    assert wide.token_ids == reference and narrow.token_ids == reference
    steps = narrow.stats.target_forwards - 1  # the prefill is not a decode step
    assert narrow.stats.tree_nodes == steps  # nothing but the root was ever verified
    assert wide.stats.tree_nodes > 6 * (wide.stats.target_forwards - 1)  # free verification: (nearly) every draft kept


def test_a_batch_step_is_priced_at_the_rows_it_has():
    """Drafting that does not pay at two rows may pay at one: once the short prompt is done, the long one drafts."""
    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    prompts = [torch.randint(4, 97, (12,), generator=torch.Generator().manual_seed(seed)) for seed in (3, 4)]
    costly = DynamicTreeSpec(depth=3, top_k=2, nodes=6, cost=PassCost((1, 2), (1.0, 3.0), draft_level=0.5))
    drafter = as_drafter(head, model, costly, context_vocab=False)
    drafter.costs_by_rows = {1: PassCost((1, 64), (1.0, 1.0)), 2: costly.cost}  # verifying alone is free
    state = loop.start(model, drafter, eos_ids(model), Fallback(enabled=False), batch_size=2)
    short, long = (loop.add(state, prompt, budget, Sampling()) for prompt, budget in zip(prompts, (6, 24)))
    while loop.step(state):
        pass
    assert short.new_tokens == hf_greedy(model, prompts[0], 6) and long.new_tokens == hf_greedy(model, prompts[1], 24)
    assert short.stats.tree_nodes == short.stats.target_forwards - 1  # two rows: nothing but the roots
    assert long.stats.tree_nodes > 2 * (long.stats.target_forwards - 1)  # then alone, where drafts pay


def test_sequential_medusa_heads_are_calibrated_with_their_draft_level():
    """They grow trees a level (a head pass) at a time, as EAGLE does: the default call prices a level."""
    model = tiny_model("llama")
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3, sequential=True)).eval()
    spec = calibrate.calibrated_tree(model, heads)
    assert spec.depth == 3 and spec.cost.draft_level > 0
    prompt = torch.randint(4, 97, (12,), generator=torch.Generator().manual_seed(4))
    assert generate(model, heads, prompt, max_new_tokens=24).token_ids == hf_greedy(model, prompt, 24)


def test_pass_costs_are_measured_in_rounds_and_never_fall_with_more_tokens():
    order = []
    medians = calibrate.interleaved_medians([lambda: order.append("a"), lambda: order.append("b")], repeats=3)
    assert order == ["a", "b"] * 4 and len(medians) == 2  # a warm-up each, then one of each a round
    model = tiny_model("llama")
    batched = calibrate.measure(model, batch=3, repeats=2).cost
    assert batched.tokens == calibrate.BATCH_TOKEN_COUNTS and batched.relative[0] == 1.0
    assert list(batched.relative) == sorted(batched.relative)


def test_a_batch_is_calibrated_by_its_power_of_two():
    assert [calibrate.calibration_batch(rows) for rows in (1, 2, 3, 7, 8, 100)] == [1, 2, 2, 4, 8, 64]


def test_loop_steps_are_timed_at_the_depth_asked(monkeypatch):
    """Every timed step drafts as deep as its spec: a step capped by the row's remaining tokens would price a level
    at less than it costs."""
    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    asked, as_drafter = [], calibrate.as_drafter

    def recording_drafter(*args, **kwargs):
        drafter = as_drafter(*args, **kwargs)
        propose_rows = drafter.propose_rows
        drafter.propose_rows = lambda texts, max_depths, host_texts=None: (
            asked[-1].append(min(max_depths)) or propose_rows(texts, max_depths, host_texts)
        )
        asked.append([])
        return drafter

    monkeypatch.setattr(calibrate, "as_drafter", recording_drafter)
    prompts = torch.randint(4, 97, (3, 10), generator=torch.Generator().manual_seed(5))
    specs = [DynamicTreeSpec(depth=1, top_k=2, nodes=1), DynamicTreeSpec(depth=4, top_k=2, nodes=1)]
    seconds = calibrate.loop_step_seconds(model, head, specs, prompts, rounds=1)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert len(asked) == 2  # one run a spec
    for spec, depths in zip(specs, asked):
        assert min(depths[: 2 + calibrate.LOOP_STEPS]) >= spec.depth


def test_calibration_key_follows_weight_changes_without_rereading_unchanged_weights(monkeypatch):
    """The key's fingerprints are worked out once per module while its weights stay as they are (every generate()
    call asks for the key), and again as soon as a weight changes in place or moves to another dtype."""
    import inference.calibrate as calibration

    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_target(model.config))
    computed = []
    real = store._digest
    monkeypatch.setattr(store, "_digest", lambda module: (module is head and computed.append(1)) or real(module))
    first = calibration.cache_path(model, head, None)
    assert calibration.cache_path(model, head, None) == first and len(computed) == 1
    with torch.no_grad():
        next(head.parameters()).add_(1.0)
    changed = calibration.cache_path(model, head, None)
    assert changed != first and len(computed) == 2
    head.to(torch.bfloat16)
    assert calibration.cache_path(model, head, None) != changed and len(computed) == 3
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)
    assert calibration.cache_path(model, head, None) != changed  # the target's fingerprint follows its weights too
