import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import benchmark  # noqa: E402


def test_benchmark_runs_methods_side_by_side_and_writes_reports(tiny_chat, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "chat", "turns": ["the cat runs", "the dog jumps"]},
        {"question_id": 2, "category": "copy", "turns": ["red blue green red blue green red blue"]},
    ]))
    out = tmp_path / "report"
    benchmark.main(["--model", str(tiny_chat / "model"), "--questions", str(questions), "--methods", "hf", "lookup", "hf-lookup",
                    "--max-new-tokens", "12", "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    summary = report["summary"]
    assert set(summary) == {"chat", "copy", "overall"}
    assert summary["overall"]["lookup"]["identical"] == 1.0  # our drafter never changes the output
    assert summary["overall"]["hf"]["turns"] == 3 and summary["overall"]["lookup"]["tau"] >= 1.0
    assert [r["turn"] for r in report["records"]] == [0, 1, 0]
    assert out.with_suffix(".png").stat().st_size > 1000 and "| overall (3 turns) |" in out.with_suffix(".md").read_text()


def test_divergence_measures_the_targets_own_logit_gap():
    import torch

    from conftest import hf_greedy, tiny_model

    model = tiny_model("llama")
    prompt = torch.randint(4, 97, (10,), generator=torch.Generator().manual_seed(5))
    baseline = hf_greedy(model, prompt, 8)
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor(baseline[:3])])[None]).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    found = benchmark.divergence(model, prompt, baseline[:3] + [runner_up] + baseline[4:], baseline)
    assert found["position"] == 3
    assert found["near_tie"] is False and found["steps"] > 3  # a random model's top-2 are far apart in fp32 steps
    assert benchmark.divergence(model, prompt, baseline[:5], baseline)["near_tie"] is False  # stopped early: not a tie


def test_rounding_step_and_near_tie_proof():
    import torch

    from conftest import tiny_model
    from inference.numerics import near_tie, rounding_step

    assert rounding_step(20.0, torch.bfloat16) == 0.125 and rounding_step(-1.5, torch.bfloat16) == 2**-7
    model = tiny_model("llama").to(torch.bfloat16)
    context = [5, 9, 11, 40]
    with torch.no_grad():
        logits = model(torch.tensor([context])).logits[0, -1].float()
    ranked, step = logits.topk(3), rounding_step(float(logits.abs().max()), torch.bfloat16)
    for runner_up in (1, 2):  # measured from the top: the third token's distance, not its gap to the first
        tie, steps = near_tie(model, context, int(ranked.indices[0]), int(ranked.indices[runner_up]))
        assert steps == pytest.approx(float(ranked.values[0] - ranked.values[runner_up]) / step) and tie == (steps <= 3)
