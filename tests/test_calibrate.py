"""Trees sized to the machine: the pass-cost calibration is measured once and cached, and a calibrated
EAGLE tree stays exact while shrinking toward plain decoding when drafts do not pay."""

import json

import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from inference import DynamicTreeSpec, calibrate, generate
from inference.tree_size import PassCost


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "CALIBRATION_DIR", tmp_path)
    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_target(model.config)).eval()
    spec = DynamicTreeSpec(depth=3, top_k=2, nodes=6)
    cost = calibrate.load_or_measure(model, head, spec)
    assert cost.tokens[0] == 1 and cost.relative[0] == 1.0 and len(cost.tokens) == len(calibrate.TOKEN_COUNTS)
    assert all(c > 0 for c in cost.relative) and cost.draft_level > 0 and cost.draft_step >= 0
    [saved] = tmp_path.glob("*.json")
    assert json.loads(saved.read_text())["one_token_pass_ms"] > 0
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "relative": [1.0] + [9.0] * (len(cost.tokens) - 1)}))
    assert calibrate.load_or_measure(model, head, spec).relative[1] == 9.0  # read back, not measured again
    assert calibrate.load_or_measure(model, head, spec, refresh=True).relative[1] != 9.0


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
    batched, _ = calibrate.measure(model, batch=3, repeats=2)
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
    real = calibration.head_id
    monkeypatch.setattr(calibrate, "head_id", lambda h: computed.append(1) or real(h))
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
