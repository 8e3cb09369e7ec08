"""Self-distillation into a corpus that accumulates: balanced prompt order, resume without asking twice, second
turns after the target's own first answer, passages asked again under another instruction, identical bytes for
identical answers, and refusals of mixed corpora."""

import gzip
import json
import subprocess
import sys
from dataclasses import replace

import pytest

import inference.target
import training.distill as distill_module
from conftest import WORDS
from inference import load_target
from training.corpus import read_corpus
from training.data import prompt_ids
from training.distill import FOLLOW_UPS, DistillConfig, distill, reinstructed_prompts
from training.self_prompt import RequestFilter, request_text, user_turn


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
    monkeypatch.setattr(
        distill_module, "answer", lambda m, t, prompts, n: asked.extend(map(tuple, prompts)) or answer(m, t, prompts, n)
    )
    corpus = distill(settings(tiny_chat, tmp_path, answers=8, second_turn_share=0.25))
    first = read_corpus(corpus)
    # 6 first turns (no first answers existed for second turns yet), round-robin over the two sources
    assert len(asked) == 6 and [r["turn"] for r in first] == [1] * 6
    assert [r["source"] for r in first] == ["chat", "maths"] * 3 or [r["source"] for r in first] == [
        "maths",
        "chat",
    ] * 3
    corpus = distill(settings(tiny_chat, tmp_path, answers=12, second_turn_share=0.25))
    grown = read_corpus(corpus)
    assert grown[:6] == first  # the earlier shards are untouched
    assert len(asked) == 12 and len(set(asked)) == 12 and len(grown) == 12  # 3 new first turns, 3 second turns
    assert sorted(r["turn"] for r in grown).count(2) == 3
    _, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    by_key = {(r["id"], r["turn"]): r for r in grown}
    for record in (r for r in grown if r["turn"] == 2):
        assert record["follow_up"] in FOLLOW_UPS
        first_answer = by_key[(record["id"], 1)]["answer_ids"]
        # the second turn's prompt holds the first turn's prompt, then the target's own first answer
        first_prompt, answer_words = (
            by_key[(record["id"], 1)]["prompt_ids"],
            [t for t in first_answer if t != tokenizer.eos_token_id],
        )
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


def test_auto_dtype_grows_the_corpus_that_exists(tiny_chat, tmp_path, monkeypatch):
    # "auto" resolves per machine: on one where bfloat16 is faster, a float32 corpus made elsewhere still grows
    grown = distill(settings(tiny_chat, tmp_path, answers=2))
    monkeypatch.setattr(inference.target, "bfloat16_is_faster", lambda device_type="cpu": True)
    assert distill(settings(tiny_chat, tmp_path, answers=4, dtype="auto")) == grown
    assert len(read_corpus(grown)) == 4 and [p.name for p in tmp_path.iterdir()] == [grown.name]
    fresh = tmp_path / "fresh"  # with no corpus yet, auto is what this machine computes fastest
    assert distill(settings(tiny_chat, fresh, answers=2, dtype="auto")).name.endswith("-bfloat16")


def test_bad_prompt_files_are_named(tiny_chat, tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    with pytest.raises(ValueError, match="not unique"):
        distill(settings(tiny_chat, tmp_path, prompts=str(tmp_path / "prompts.jsonl"), source_field=None))
    with pytest.raises(ValueError, match="no 'source' field"):
        distill(settings(tiny_chat, tmp_path, prompts=str(tmp_path / "prompts.jsonl")))


def test_command_line_errors_are_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "training.distill", "--answerz", "3"],
        capture_output=True,
        text=True,
        cwd=tmp_path.parent,
    )
    assert proc.returncode == 2 and "unknown key(s) ['answerz']" in proc.stderr and "Traceback" not in proc.stderr


def test_reinstructed_prompts_swap_the_shared_instruction_and_keep_the_text():
    summarize, points, questions = "Summarize the text.", "List its key points.", "Write questions it answers."
    prompts = [
        f"{summarize}\n\nalpha beta",
        f"{points}\n\ngamma delta",
        f"epsilon zeta\n\n{questions}",  # an instruction after its text keeps that order
        f"{summarize}\n\neta theta",
        f"{points}\n\niota kappa",
        f"lambda mu\n\n{questions}",
        "one paragraph only",
        "no shared\n\ninstruction here",
    ]
    rewritten = reinstructed_prompts(prompts, seed=0)
    assert rewritten[6:] == [None, None]
    layouts = {summarize: True, points: True, questions: False}
    for prompt, new in zip(prompts[:6], rewritten[:6]):
        old_parts, new_parts = prompt.split("\n\n"), new.split("\n\n")
        text = next(p for p in old_parts if p not in layouts)
        instruction = next(p for p in new_parts if p in layouts)
        assert instruction not in old_parts and text in new_parts
        assert (new_parts[0] == instruction) == layouts[instruction]
    assert reinstructed_prompts(prompts, seed=0) == rewritten  # seeded: the same prompts every run
    assert reinstructed_prompts(prompts[:1] + prompts[3:4], seed=0) == [None, None]  # one instruction: no other to ask


def test_reinstructed_answers_grow_the_corpus_and_keep_held_out_passages_out(tiny_chat, tmp_path):
    from training.config import DataConfig
    from training.data import build_datasets

    instructions = ["the quick fox", "a lazy dog", "the old car"]  # the tiny tokenizer's words
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(12):
            source = "documents" if i % 2 else "chat"
            prompt = (
                f"{instructions[i % 3]}\n\n{WORDS[i + 3]} sun sea" if source == "documents" else f"hello number {i}"
            )
            f.write(json.dumps({"id": i, "source": source, "prompt": prompt}) + "\n")
    config = settings(tiny_chat, tmp_path, prompts=str(tmp_path / "prompts.jsonl"), answers=12, second_turn_share=0)
    corpus = distill(replace(config, reinstruct_source="documents", reinstructed=4))
    records = read_corpus(corpus)
    again = [r for r in records if "prompt_of" in r]
    assert len(records) == 16 and len(again) == 4
    model, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    for record in again:
        assert record["id"] == f"{record['prompt_of']}/reinstructed" and record["source"] == "documents/reinstructed"
        text = tokenizer.decode(record["prompt_ids"])
        assert f"{WORDS[record['prompt_of'] + 3]} sun sea" in text and sum(i in text for i in instructions) == 1
        original = next(r for r in records if r["id"] == record["prompt_of"])
        assert record["prompt_ids"] != original["prompt_ids"]
    distill(replace(config, reinstruct_source="documents", reinstructed=4))  # nothing left to ask
    assert read_corpus(corpus) == records
    # a held-out prompt's passage stays out of training under its other instruction too
    data = DataConfig(
        path=str(tmp_path / "prompts.jsonl"),
        corpus=str(corpus),
        eval_prompts=12,
        dataset_responses=0,
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ValueError, match="no training sequences"):
        build_datasets(data, tokenizer, model, "tiny", seed=0)
    train_set, _ = build_datasets(replace(data, eval_prompts=11), tokenizer, model, "tiny", seed=0)
    held_out = {r["id"] for r in records[:11]}
    kept = [r for r in records if r.get("prompt_of", r["id"]) not in held_out]
    assert len(kept) in (1, 2)  # the last prompt, and its passage asked again if it was a document that was
    assert sorted(map(tuple, train_set["input_ids"])) == sorted(tuple(r["prompt_ids"] + r["answer_ids"]) for r in kept)
    with pytest.raises(ValueError, match="need reinstruct_source"):
        replace(config, reinstructed=3)
    with pytest.raises(ValueError, match="nothing to ask again"):
        distill(replace(config, reinstruct_source="chat", reinstructed=2))
    with pytest.raises(ValueError, match="'news' is not a source of .*'chat', 'documents'"):
        distill(replace(config, reinstruct_source="news", reinstructed=2))


def test_request_filter_refuses_unfinished_short_and_repeated_requests():
    seen = RequestFilter()
    assert seen.reason(None) == "unfinished" and seen.reason("Hi there") == "too short"
    request = "How do I plan a week of healthy dinners for a family of four on a small budget?"
    assert seen.reason(request) is None
    seen.add(request)
    assert seen.reason("how do I plan a week of healthy dinners, for a family of four on a small budget") == "repeat"
    assert (
        seen.reason("How do I plan a week of healthy dinners for a family of five on a small budget?") == "near repeat"
    )
    assert seen.reason("How do I plan a week of healthy lunches for a team of ten?") is None
    # a trigram held by many requests does not find candidates, a rare one still does
    crowd = RequestFilter(common=3)
    for n in range(5):
        crowd.add(f"how do i {WORDS[n]} {WORDS[n + 5]} {WORDS[n + 10]}")
    assert crowd.reason(f"how do i {WORDS[0]} {WORDS[5]} {WORDS[10]} please") == "near repeat"


def test_self_prompting_needs_a_chat_template_and_a_closed_turn(tiny_chat):
    _, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    opening, close = user_turn(tokenizer, [])
    assert opening == "<|im_start|> user " and close == tokenizer.convert_tokens_to_ids("<|im_end|>")
    words = tokenizer("the cat runs", add_special_tokens=False)["input_ids"]
    assert request_text(tokenizer, words + [close, 5], close) == "the cat runs"
    assert request_text(tokenizer, words, close) is None  # never closed: it ran past request_tokens
    assert (
        request_text(tokenizer, words[:1] + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + words + [close], close)
        is None
    )
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="self-prompting needs a chat model"):
        user_turn(tokenizer, [])


def test_the_target_writes_requests_answers_them_and_writes_second_turns(tiny_chat, tmp_path, monkeypatch):
    config = settings(
        tiny_chat, tmp_path, answers=0, self_prompts=8, second_turn_share=0.25, request_tokens=30, batch_size=4
    )
    corpus = distill(config)
    firsts = read_corpus(corpus)
    model, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    assert (
        1 <= len(firsts) <= 6
        and {r["source"] for r in firsts} == {"self-prompted"}
        and {r["turn"] for r in firsts} == {1}
    )
    assert [r["id"] for r in firsts] == sorted(r["id"] for r in firsts) and all(
        r["id"].startswith("self-") for r in firsts
    )
    unique = RequestFilter()
    for record in firsts:
        assert unique.reason(record["prompt"]) is None  # long enough, and no repeat of another request
        unique.add(record["prompt"])
        assert record["prompt_ids"] == prompt_ids(tokenizer, [{"role": "user", "content": record["prompt"]}])
        assert record["answer_ids"] == distill_module.answer(model, tokenizer, [record["prompt_ids"]], 6)[0]
    grown = read_corpus(distill(config))
    assert grown[: len(firsts)] == firsts
    seconds = [r for r in grown if r["turn"] == 2]
    assert 1 <= len(seconds) <= 2 and len(grown) <= 8
    for record in seconds:
        first = next(r for r in firsts if r["id"] == record["id"])
        assert record["follow_up"] and tokenizer.decode(record["prompt_ids"]).endswith(
            f"{record['follow_up']} <|im_end|> <|im_start|> assistant"
        )
        assert " ".join(map(str, first["prompt_ids"][:-2])) in " ".join(map(str, record["prompt_ids"]))
    manifest = json.loads((corpus / "corpus.json").read_text())
    assert manifest["self_prompting"] == {"temperature": 1.0, "top_p": 0.95, "request_tokens": 30}
    with pytest.raises(ValueError, match="request_tokens=30, this run would use 31|self_prompting"):
        distill(replace(config, request_tokens=31))


def test_float32_products_round_like_a_native_bfloat16_kernel():
    """On a CPU without bfloat16 instructions the distillation runs a bf16 target's linear layers as float32 products
    rounded back to bf16: each output is the exact product rounded once, the rest of the model is untouched."""
    import torch
    import torch.nn.functional as F

    from conftest import tiny_model
    from training.distill import Float32Products

    torch.manual_seed(0)
    x, weight, bias = (torch.randn(*shape).to(torch.bfloat16) for shape in ((5, 64), (32, 64), (32,)))
    exact = (x.double() @ weight.double().T + bias.double()).to(torch.bfloat16)
    with Float32Products() as mode:
        out = F.linear(x, weight, bias)
        assert out.dtype == torch.bfloat16
        # float32 accumulation of 64 products: at most one rounding step from the exact product, nearly always zero
        steps = ((out.float() - exact.float()).abs() / exact.float().abs().clamp_min(1e-3) * 128).max()
        assert steps <= 1.0 and (out == exact).float().mean() > 0.95
        assert torch.equal(F.linear(x.float(), weight.float()), x.float() @ weight.float().T)  # float32 untouched
        model = tiny_model().to(torch.bfloat16)
        prompt = torch.tensor([[5, 17, 42, 8]])
        logits = model(prompt).logits
    # one float32 copy of each weight matrix a layer used (the embedding is a lookup; the float32 call made none)
    assert len(mode.weights) == 1 + sum(p.dim() == 2 for n, p in model.named_parameters() if "embed" not in n)
    assert logits.dtype == torch.bfloat16
    reference = model.float()(prompt).logits  # the same weights, every activation in float32
    assert (logits.float() - reference).abs().max() < 0.05 * reference.abs().max()
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
