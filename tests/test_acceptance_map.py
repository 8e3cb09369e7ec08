"""The map from a head's draft probabilities to the target's acceptance (inference.acceptance_map): the pure
functions, the config field, the drafter's scores with it, exactness, and the script that fits it."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, HeadConfigError, MedusaConfig, load_heads, save_heads
from inference import DynamicTreeSpec, EagleDrafter, Tree, generate
from inference.acceptance_map import acceptance_log_probs, draft_outcomes, fit_weights, path_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_the_map_grows_with_the_heads_probability_and_keeps_impossible_drafts_impossible():
    log_p = torch.tensor([float("-inf"), math.log(0.01), math.log(0.3), math.log(0.6), math.log(0.99), 0.0])
    mapped = acceptance_log_probs(log_p, [0.88, 1.31, -0.84])
    assert mapped[0] == float("-inf")
    assert bool((mapped[1:].diff() > 0).all()) and bool((mapped <= 0).all())
    # sigmoid(0 + 1 * log 0.5 + 0) = 0.5 / 1.5
    assert acceptance_log_probs(torch.tensor([math.log(0.5)]), [0.0, 1.0, 0.0]).exp().item() == pytest.approx(1 / 3)
    assert acceptance_log_probs(torch.tensor([float("nan")]), [0.0, 1.0, 0.0]).isnan().all()


def test_fitting_recovers_a_known_map_and_refuses_one_sided_data():
    generator = torch.Generator().manual_seed(0)
    log_p = torch.log(torch.rand(40_000, generator=generator, dtype=torch.float64).clamp(min=1e-4))
    truth = [0.9, 1.3, -0.8]
    accepted = torch.rand(40_000, generator=generator, dtype=torch.float64) < acceptance_log_probs(log_p, truth).exp()
    fitted = fit_weights(log_p, accepted)
    assert fitted == pytest.approx(truth, abs=0.15)
    grid = torch.log(torch.linspace(0.02, 0.98, 25, dtype=torch.float64))
    assert acceptance_log_probs(grid, fitted).exp() == pytest.approx(acceptance_log_probs(grid, truth).exp(), abs=0.02)
    with pytest.raises(ValueError, match="both accepted and rejected"):
        fit_weights(log_p[:10], torch.ones(10, dtype=torch.bool))


def test_draft_outcomes_follow_what_the_target_wrote():
    # root 5; children 7 (right) and 8; under 7: 9 (right) and 4; under 8: 9 (its parent was wrong)
    tokens = torch.tensor([5, 7, 8, 9, 4, 9])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    depth = torch.tensor([0, 1, 1, 2, 2, 2])
    scores = torch.tensor([0.0, -0.1, -2.0, -0.5, -3.0, -2.2])
    text = torch.tensor([1, 2, 5, 7, 9])  # the root at 2: the target wrote 7, then 9, then stopped
    tree = Tree.from_parents(tokens, parents)
    assert tree.depth.tolist() == depth.tolist()
    local, accepted = draft_outcomes(tree, scores, 3, text)
    assert accepted.tolist() == [True, True, False, True, False, False]
    assert local.tolist() == pytest.approx([0.0, -0.1, -2.0, -0.4, -2.9, -0.2])
    assert path_scores(tree, local).tolist() == pytest.approx(scores.tolist())
    _, past_the_end = draft_outcomes(tree, scores, 4, text)  # 7 is not what follows 7
    assert past_the_end.tolist() == [True, False, False, False, False, False]


def test_the_config_takes_only_a_map_that_grows_with_the_heads_probability(tmp_path):
    model = tiny_model("llama", eos=None)
    config = EagleConfig.for_target(model.config, acceptance_map=[0.9, 1.3, -0.8])
    save_heads(EagleHead(config).eval(), tmp_path / "head", model)
    assert load_heads(tmp_path / "head", model).config.acceptance_map == [0.9, 1.3, -0.8]
    for wrong in ([0.9, -1.3, -0.8], [0.9, 1.3, 0.5], [0.9, 1.3], [0.9, "1.3", -0.8]):
        with pytest.raises(HeadConfigError, match="acceptance_map"):
            EagleConfig.for_target(model.config, acceptance_map=wrong)
    with pytest.raises(HeadConfigError, match="only sequential"):
        MedusaConfig.for_target(model.config, acceptance_map=[0.9, 1.3, -0.8])
    assert MedusaConfig.for_target(model.config, sequential=True, acceptance_map=[0.9, 1.3, -0.8]).acceptance_map


def test_a_head_with_a_map_scores_paths_by_the_map_and_stays_exact():
    model = tiny_model("llama")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, acceptance_map=[0.9, 1.3, -0.8])).eval()
    drafter = EagleDrafter(head, model, DynamicTreeSpec(depth=4, top_k=3, nodes=8))
    grown = []
    drafter.on_grown = lambda texts, nodes, limits, k: grown.append(
        (
            Tree.from_parents(nodes.tokens[0, : nodes.count].clone(), nodes.parents[0, : nodes.count].clone()),
            nodes.scores[0, : nodes.count].clone(),
        )
    )
    prompt = torch.randint(4, 97, (10,), generator=torch.Generator().manual_seed(2))
    out = generate(model, drafter, prompt, max_new_tokens=24, fallback=False)
    assert out.token_ids == hf_greedy(model, prompt, 24)
    unmapped = EagleDrafter(head, model, DynamicTreeSpec(depth=4, top_k=3, nodes=8))
    unmapped.acceptance = None
    raw = []
    unmapped.on_grown = lambda texts, nodes, limits, k: raw.append(nodes.scores[0, : nodes.count].clone())
    assert generate(model, unmapped, prompt, max_new_tokens=24, fallback=False).token_ids == out.token_ids
    # the first step grew from the same state: its scores are the map of the head's own, summed along each path
    tree, scores = grown[0]
    own_local = raw[0] - torch.where(tree.parents >= 0, raw[0][tree.parents.clamp(min=0)], torch.zeros_like(raw[0]))
    mapped = torch.cat([own_local[:1], acceptance_log_probs(own_local[1:], [0.9, 1.3, -0.8])])
    assert scores == pytest.approx(path_scores(tree, mapped), abs=1e-4)


def test_the_script_fits_the_map_on_held_out_prompts_and_writes_it(tiny_chat, tmp_path, capsys):
    import fit_acceptance_map
    from inference import load_target

    model, _ = load_target(str(tiny_chat / "model"), dtype="float32", compile=False)
    torch.manual_seed(0)
    save_heads(EagleHead(EagleConfig.for_target(model.config)).eval(), tmp_path / "head", model)
    prompts = [json.loads(line) for line in (tiny_chat / "prompts.jsonl").read_text().splitlines()[:3]]
    questions = tmp_path / "heldout.jsonl"
    questions.write_text(
        "".join(json.dumps({"question_id": p["id"], "category": "x", "turns": [p["prompt"]]}) + "\n" for p in prompts)
    )
    fit_acceptance_map.main(
        [str(tmp_path / "head"), "--model", str(tiny_chat / "model"), "--questions", str(questions)]
        + ["--depth", "3", "--top-k", "4", "--nodes", "6", "--max-new-tokens", "24", "--write"]
    )
    weights = load_heads(tmp_path / "head", model).config.acceptance_map
    assert len(weights) == 3 and weights[1] > 0 >= weights[2]
    report = capsys.readouterr().out
    assert "3 prompts" in report and "with the map's" in report
