"""Self-distillation into a corpus that accumulates: balanced prompt order, resume without asking twice, second
turns after the target's own first answer, identical bytes for identical answers, and refusals of mixed corpora."""

import gzip
import json
import subprocess
import sys

import pytest

import training.distill as distill_module
from inference import load_target
from training.corpus import read_corpus
from training.distill import FOLLOW_UPS, DistillConfig, distill


def settings(tiny_chat, root, **extra):
    values = dict(
        model=str(tiny_chat / "model"),
        dtype="float32",
        prompts=str(tiny_chat / "prompts.jsonl"),
        corpus_root=str(root),
        max_new_tokens=6,
        batch_size=3,
        shard_answers=4,
        workers=1,
    )
    return DistillConfig(**{**values, **extra})


def test_the_corpus_grows_without_asking_twice(tiny_chat, tmp_path, monkeypatch):
    asked = []
    answer = distill_module.answer
    monkeypatch.setattr(distill_module, "answer", lambda m, t, prompts, n: asked.extend(map(tuple, prompts)) or answer(m, t, prompts, n))
    corpus = distill(settings(tiny_chat, tmp_path, answers=8, second_turn_share=0.25))
    first = read_corpus(corpus)
    # 6 first turns (no first answers existed for second turns yet), round-robin over the two sources
    assert len(asked) == 6 and [r["turn"] for r in first] == [1] * 6
    assert [r["source"] for r in first] == ["chat", "maths"] * 3 or [r["source"] for r in first] == ["maths", "chat"] * 3
    corpus = distill(settings(tiny_chat, tmp_path, answers=12, second_turn_share=0.25))
    grown = read_corpus(corpus)
    assert grown[:6] == first  # the earlier shards are untouched
    assert len(asked) == 12 and len(set(asked)) == 12 and len(grown) == 12  # 3 new first turns, 3 second turns
    assert sorted(r["turn"] for r in grown).count(2) == 3
    _, tokenizer = load_target(str(tiny_chat / "model"))
    by_key = {(r["id"], r["turn"]): r for r in grown}
    for record in (r for r in grown if r["turn"] == 2):
        assert record["follow_up"] in FOLLOW_UPS
        first_answer = by_key[(record["id"], 1)]["answer_ids"]
        # the second turn's prompt holds the first turn's prompt, then the target's own first answer
        first_prompt, answer_words = by_key[(record["id"], 1)]["prompt_ids"], [t for t in first_answer if t != tokenizer.eos_token_id]
        assert record["prompt_ids"][: len(first_prompt) - 2] == first_prompt[:-2]  # up to the generation prompt
        assert " ".join(map(str, answer_words)) in " ".join(map(str, record["prompt_ids"][len(first_prompt) - 2 :]))
    # nothing left to do: no model call
    distill(settings(tiny_chat, tmp_path, answers=12, second_turn_share=0.25))
    assert len(asked) == 12


def test_same_answers_same_bytes_and_greedy_answers(tiny_chat, tmp_path):
    one = distill(settings(tiny_chat, tmp_path / "one", answers=5, second_turn_share=0))
    two = distill(settings(tiny_chat, tmp_path / "two", answers=5, second_turn_share=0, batch_size=1))
    shards = sorted(p.name for p in one.glob("shard-*"))
    assert shards == ["shard-00000.jsonl.gz", "shard-00001.jsonl.gz"]
    for name in shards:  # batched with left padding or one at a time: the same greedy answers, the same bytes
        assert (one / name).read_bytes() == (two / name).read_bytes()
    record = json.loads(gzip.open(one / shards[0], "rt").readline())
    assert set(record) == {"id", "source", "turn", "follow_up", "prompt_ids", "answer_ids"}
    manifest = json.loads((one / "corpus.json").read_text())
    assert manifest["dtype"] == "float32" and manifest["max_new_tokens"] == 6 and manifest["target"]["weights_sample"]


def test_answers_made_another_way_do_not_mix(tiny_chat, tmp_path):
    distill(settings(tiny_chat, tmp_path, answers=2))
    with pytest.raises(ValueError, match="max_new_tokens=6, this run would use 7"):
        distill(settings(tiny_chat, tmp_path, answers=4, max_new_tokens=7))
    with pytest.raises(ValueError, match="second_turn_share"):
        settings(tiny_chat, tmp_path, second_turn_share=1.5)


def test_bad_prompt_files_are_named(tiny_chat, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(ValueError, match="not unique"):
        distill(settings(tiny_chat, tmp_path, prompts=str(tmp_path / "prompts.jsonl"), source_field=None))
    with pytest.raises(ValueError, match="no 'source' field"):
        distill(settings(tiny_chat, tmp_path, prompts=str(tmp_path / "prompts.jsonl")))


def test_command_line_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "training.distill", "--answerz", "3"], capture_output=True, text=True, cwd=tmp_path.parent)
    assert proc.returncode == 2 and "unknown key(s) ['answerz']" in proc.stderr and "Traceback" not in proc.stderr
