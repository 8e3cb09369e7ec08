import argparse
import importlib
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import benchmark  # noqa: E402
import check_greedy  # noqa: E402
import common  # noqa: E402
import questions as question_files  # noqa: E402
from conftest import tiny_model  # noqa: E402
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads  # noqa: E402
from training.corpus import write_shard  # noqa: E402

TWO_QUESTIONS = [
    {"question_id": 1, "category": "chat", "turns": ["the cat runs", "the dog jumps"]},
    {"question_id": 2, "category": "copy", "turns": ["red blue green red blue green red blue"]},
]


def write_questions(path: Path, questions: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(q) for q in questions))
    return path


def test_benchmark_runs_methods_side_by_side_and_writes_reports(tiny_chat, tmp_path):
    questions = write_questions(tmp_path / "questions.jsonl", TWO_QUESTIONS)
    out = tmp_path / "report"
    benchmark.main(
        [
            "--model",
            str(tiny_chat / "model"),
            "--questions",
            str(questions),
            "--methods",
            "hf",
            "lookup",
            "hf-lookup",
            "--max-new-tokens",
            "12",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.with_suffix(".json").read_text())
    summary = report["summary"]
    assert set(summary) == {"chat", "copy", "overall"}
    assert summary["overall"]["lookup"]["identical"] == 1.0  # our drafter never changes the output
    assert summary["overall"]["hf"]["turns"] == 3 and summary["overall"]["lookup"]["tau"] >= 1.0
    assert [r["turn"] for r in report["records"]] == [0, 1, 0]
    assert "| overall (3 turns) |" in out.with_suffix(".md").read_text()


def test_batch_throughput_puts_every_method_beside_hf_batched(tiny_chat, tmp_path):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "\n".join(
            json.dumps({"question_id": i, "category": "chat", "turns": [f"the cat runs {i} times"]}) for i in range(5)
        )
    )
    out = tmp_path / "batches"
    args = ["--model", str(tiny_chat / "model"), "--questions", str(questions), "--methods", "hf", "plain", "lookup"]
    benchmark.main(
        args
        + [
            "--max-new-tokens",
            "10",
            "--batch-sizes",
            "1",
            "2",
            "--tree",
            "fixed",
            "--reference-rows",
            "5",
            "--out",
            str(out),
        ]
    )
    lines = out.with_suffix(".md").read_text().splitlines()
    assert "| batch | HF generate() batched | plain | lookup | identical |" in lines
    rows = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(row.endswith("| 5/5, 5/5 |") for row in rows)  # float32: every row is HF's own
    assert all(
        row.split("|")[3].strip().endswith("tau 1.00)") for row in rows
    )  # plain decoding: one token a target pass


def test_divergence_measures_the_targets_own_logit_gap():
    import torch

    from conftest import hf_greedy, tiny_model

    model = tiny_model("llama")
    prompt = torch.randint(4, 97, (10,), generator=torch.Generator().manual_seed(5))
    baseline = hf_greedy(model, prompt, 8)
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor(baseline[:3])])[None]).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    found = common.divergence(model, prompt, baseline[:3] + [runner_up] + baseline[4:], baseline)
    assert found["position"] == 3
    assert found["near_tie"] is False and found["steps"] > 3  # a random model's top-2 are far apart in fp32 steps
    assert common.divergence(model, prompt, baseline[:5], baseline)["near_tie"] is False  # stopped early: not a tie


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


def test_merge_puts_a_runs_shards_together_into_the_whole_runs_figures(tiny_chat, tmp_path, capsys):
    from heads import EagleConfig, EagleHead, save_heads
    from inference import load_target

    model, _ = load_target(str(tiny_chat / "model"), compile=False)
    questions = tmp_path / "questions.jsonl"
    texts = ["the cat runs", "a dog sleeps here", "one two three", "birds fly south"]
    questions.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "chat" if i % 2 else "code", "turns": [t]}) + "\n"
            for i, t in enumerate(texts)
        )
    )
    torch.manual_seed(0)
    head = save_heads(EagleHead(EagleConfig.for_target(model.config)), tmp_path / "head", model)
    options = [
        "--model",
        str(tiny_chat / "model"),
        "--questions",
        str(questions),
        "--methods",
        "eagle",
        "--eagle",
        str(head),
        "--tree",
        "fixed",
    ]
    options += ["--max-new-tokens", "8"]
    for name, shard in (
        ("whole", []),
        ("part0", ["--shard", "0/3"]),
        ("part1", ["--shard", "1/3"]),
        ("part2", ["--shard", "2/3"]),
    ):
        benchmark.main(options + shard + ["--out", str(tmp_path / name)])
    parts = [tmp_path / f"part{k}.json" for k in range(3)]
    assert sorted(len(json.loads(p.read_text())["records"]) for p in parts) == [1, 1, 2]  # questions 0 and 3, 1, 2
    benchmark.main(["--merge", *map(str, parts), "--out", str(tmp_path / "merged")])  # one result file from the shards
    merged_run, whole_run = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("merged", "whole"))
    assert {r["question_id"] for r in merged_run["records"]} == {0, 1, 2, 3}
    for category in ("chat", "code", "overall"):
        assert merged_run["summary"][category]["eagle"]["tau"] == pytest.approx(
            whole_run["summary"][category]["eagle"]["tau"]
        )
    assert (tmp_path / "merged.md").read_text().count("Command: `python scripts/benchmark.py") == 3
    with pytest.raises(SystemExit, match=r"every shard of one run once \(0/3 .. 2/3\), got 0/3, 1/3"):
        benchmark.main(["--merge", *map(str, parts[:2]), "--out", str(tmp_path / "refused")])
    other = json.loads(parts[2].read_text())
    other["args"]["max_new_tokens"] = 9
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="other settings .*max_new_tokens"):
        benchmark.main(
            ["--merge", *map(str, parts[:2]), str(tmp_path / "other.json"), "--out", str(tmp_path / "refused")]
        )
    with pytest.raises(SystemExit):
        benchmark.main(options + ["--shard", "3/3"])
    assert "--shard K/N needs 0 <= K < N, got '3/3'" in capsys.readouterr().err


def test_check_greedy_accepts_a_recorded_run_and_catches_a_changed_token(tiny_chat, tmp_path):
    questions = write_questions(tmp_path / "questions.jsonl", TWO_QUESTIONS)
    out = tmp_path / "report"
    model = ["--model", str(tiny_chat / "model"), "--questions", str(questions)]
    benchmark.main(model + "--methods plain lookup --max-new-tokens 12 --no-fallback --out".split() + [str(out)])
    record = out.with_suffix(".json")
    report = check_greedy.main([str(record)])
    assert all(entry["turns"] == 3 and not entry["wrong_turns"] for entry in report.values())

    run = json.loads(record.read_text())
    tokens = run["records"][1]["tokens"]["lookup"]  # a second turn: its prompt holds the first method's first answer
    vocab = json.loads((tiny_chat / "model" / "config.json").read_text())["vocab_size"]
    tokens[0] = (tokens[0] + 1) % vocab
    record.write_text(json.dumps(run))
    with pytest.raises(SystemExit) as failed:
        check_greedy.main([str(record)])
    assert failed.value.code == 1


def test_check_greedy_catches_an_answer_that_stops_early(tiny_chat):
    from inference import load_target

    model, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    prompt = torch.tensor([1, 5, 7, 9])
    greedy = model.generate(
        prompt[None], attention_mask=torch.ones(1, 4, dtype=torch.long), do_sample=False, max_new_tokens=8
    )[0, 4:].tolist()
    eos = {model.generation_config.eos_token_id}
    assert check_greedy.check_answer(model, prompt, greedy, eos, 8)["stops_right"] == (
        len(greedy) == 8 or greedy[-1] in eos
    )
    shortened = check_greedy.check_answer(model, prompt, greedy[:5], eos, 8)
    assert not shortened["mismatches"] and not shortened["stops_right"]


def test_heldout_questions_are_the_prompts_training_kept_out(tmp_path):
    prompts = [{"id": i, "source": "maths" if i % 2 else "chat", "prompt": f"question {i}"} for i in range(6)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    corpus = tmp_path / "corpus"
    corpus.mkdir()

    def record(i, turn, follow_up=None):
        return {
            "id": i,
            "source": prompts[i]["source"],
            "turn": turn,
            "follow_up": follow_up,
            "prompt_ids": [1],
            "answer_ids": [2],
        }

    # corpus order, not id order; a second turn is part of its conversation, not a conversation of its own
    write_shard(
        corpus / "shard-00000.jsonl.gz",
        [record(3, 1, "and then?"), record(3, 2, "and then?"), record(0, 1), record(5, 1)],
    )
    questions = question_files.heldout_questions(tmp_path / "prompts.jsonl", corpus, 2)
    assert questions == [
        {"question_id": 3, "category": "maths", "turns": ["question 3", "and then?"]},
        {"question_id": 0, "category": "chat", "turns": ["question 0"]},
    ]
    # a source left out of training: its first conversations, a self-prompted request with its own text
    write_shard(
        corpus / "shard-00001.jsonl.gz",
        [record(1, 1), {**record(1, 1), "id": "self-0", "source": "self-prompted", "prompt": "write me a plan"}],
    )
    assert question_files.heldout_questions(tmp_path / "prompts.jsonl", corpus, 5, source="maths") == [
        {"question_id": 3, "category": "maths", "turns": ["question 3", "and then?"]},
        {"question_id": 5, "category": "maths", "turns": ["question 5"]},
        {"question_id": 1, "category": "maths", "turns": ["question 1"]},
    ]
    assert question_files.heldout_questions(tmp_path / "prompts.jsonl", corpus, 5, source="self-prompted") == [
        {"question_id": "self-0", "category": "self-prompted", "turns": ["write me a plan"]}
    ]
    (tmp_path / "other.jsonl").write_text(json.dumps(prompts[0]) + "\n")
    with pytest.raises(SystemExit, match="distilled from another prompt file"):
        question_files.heldout_questions(tmp_path / "other.jsonl", corpus, 2)


def test_unseen_questions_are_seeded_and_put_each_text_under_one_request():
    questions = question_files.unseen_questions(3)
    assert questions == question_files.unseen_questions(3)  # the same file every run
    assert [q["category"] for q in questions] == [c for c in question_files.CATEGORIES for _ in range(3)]
    modules = [q["question_id"].rsplit("-", 1)[1] for q in questions]
    assert len(set(modules)) == len(modules)  # another text for every question
    for question, module in zip(questions, modules):
        request = question_files.CATEGORIES[question["category"]]
        assert question["turns"][0].startswith(request.split("{")[0]) and len(question["turns"]) == 1
        assert "{" not in request.replace("{text}", "").replace("{module}", "")  # every field is filled
        assert "{module}" not in request or f" {module} " in question["turns"][0]
    typos = [q for q in questions if q["category"] == "fix-typos"]
    module = importlib.import_module(typos[0]["question_id"].rsplit("-", 1)[1])
    words = set(re.findall(r"[A-Za-z]{5,}", module.__doc__))
    assert any(word not in words for word in re.findall(r"[A-Za-z]{5,}", typos[0]["turns"][0].split("\n\n", 1)[1]))
    with pytest.raises(SystemExit, match="docstrings are long enough"):
        question_files.unseen_questions(1000)


def test_fixed_medusa_trees_take_the_heads_shape_unless_told():
    heads = {"medusa": MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=50, num_heads=3, sequential=True))}

    def tree(**given):
        settings = dict(
            tree="fixed", depth=None, top_k=None, nodes=15, no_fallback=True, no_context_vocab=False, methods=["medusa"]
        )
        args = argparse.Namespace(**{**settings, **given})
        return benchmark.our_settings(args, heads)["medusa"]["tree"]

    own = tree()
    assert (own.depth, own.top_k, own.nodes) == (3, 15, 15)
    assert (tree(top_k=4).depth, tree(top_k=4).top_k) == (3, 4)
    assert tree(depth=2).depth == 2
    with pytest.raises(SystemExit, match="at most 3 tokens ahead"):
        tree(depth=4)


def test_no_context_vocab_drafts_from_the_heads_own_vocabulary():
    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_target(model.config, draft_vocab_size=8)).eval()
    settings = dict(tree="fixed", depth=3, top_k=2, nodes=4, no_fallback=True, methods=["eagle", "eagle+lookup"])
    for off in (False, True):
        runs = benchmark.our_settings(argparse.Namespace(**settings, no_context_vocab=off), {"eagle": head}, model)
        if not off:  # generate() builds the drafter, with the context vocabulary
            assert runs["eagle"]["heads"] is head and runs["eagle+lookup"]["lookup"]
            continue
        alone, merged = runs["eagle"]["heads"], runs["eagle+lookup"]["heads"]
        assert not alone.context.enabled and alone.spec.depth == 3 and runs["eagle"]["tree"] is None
        assert (
            not merged.drafters[0].context.enabled
            and runs["eagle+lookup"]["lookup"] is False
            and len(merged.drafters) == 2
        )
    with pytest.raises(SystemExit):  # the drafters are built with a fixed tree
        benchmark.main(["--methods", "eagle", "--eagle", "unused", "--no-context-vocab"])
