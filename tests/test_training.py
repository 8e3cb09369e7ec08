"""Training on a tiny chat model: the loss falls, the head drafts better, two processes agree, a killed run
resumes to the same weights, and recipe mistakes are clear errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from heads import EagleConfig, EagleHead, EarlyExitConfig, EarlyExitHead, MedusaHeads, load_heads
from inference import DynamicTreeSpec, generate, load_target
from training.train_heads import main as train

ROOT = Path(__file__).resolve().parents[1]


def recipe(root, out, **extra):
    args = {
        "model": root / "model",
        "data.path": root / "prompts.jsonl",
        "data.eval_prompts": 16,
        "data.corpus": root / "distill" / "model-float32",
        "data.cache_dir": root / "cache",
        "output_dir": out,
        "batch_size": 8,
        "learning_rate": 5e-3,
        "warmup_steps": 10,
        "max_steps": 150,
        "eval_every": 50,
        "save_every": 50,
    }
    args.update(extra)
    return [str(x) for k, v in args.items() for x in (f"--{k}", v)]


def mean_tau(model, tokenizer, head, prompts):
    taus = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        out = generate(
            model,
            head,
            ids,
            max_new_tokens=32,
            tree=DynamicTreeSpec(depth=4, top_k=2, nodes=8),
            lookup=False,
            fallback=False,
        )
        taus.append(out.stats.mean_accepted)
    return sum(taus) / len(taus)


def twelve_answer_corpus(tiny_chat, tmp_path):
    """A corpus of the tiny chat model's answers to its first 12 prompts (first turns, 8 new tokens at most)."""
    from training.distill import DistillConfig, distill

    return distill(
        DistillConfig(
            model=str(tiny_chat / "model"),
            dtype="float32",
            prompts=str(tiny_chat / "prompts.jsonl"),
            corpus_root=str(tmp_path / "distill"),
            answers=12,
            second_turn_share=0,
            max_new_tokens=8,
            workers=1,
        )
    )


def test_data_holds_out_corpus_answers_and_adds_dataset_answers_elsewhere(tiny_chat, tmp_path):
    from training.config import DataConfig
    from training.corpus import read_corpus
    from training.data import build_datasets

    model, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    corpus = twelve_answer_corpus(tiny_chat, tmp_path)
    records = read_corpus(corpus)
    data = DataConfig(
        path=str(tiny_chat / "prompts.jsonl"),
        corpus=str(corpus),
        eval_prompts=4,
        dataset_responses=8,
        cache_dir=str(tmp_path / "cache"),
    )
    train_set, eval_set = build_datasets(data, tokenizer, model, "tiny", seed=0)
    # held out: the corpus's first four answers, which are the target's own greedy continuations
    for record, row in zip(records[:4], eval_set):
        prompt = record["prompt_ids"]
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2)[
            0, len(prompt) :
        ].tolist()
        assert row["input_ids"] == prompt + (greedy[: greedy.index(2) + 1] if 2 in greedy else greedy)
    assert len(eval_set) == 4
    # training: the other 8 corpus answers and 8 dataset answers, to 16 different prompts, none of them held out
    prompts = [tuple(row["input_ids"][: row["loss_mask"].index(1)]) for row in train_set]
    held_out = {tuple(r["prompt_ids"]) for r in records[:4]}
    corpus_rows = {tuple(r["prompt_ids"] + r["answer_ids"]) for r in records[4:]}
    assert len(train_set) == 16 and len(set(prompts)) == 16 and not held_out & set(prompts)
    assert sum(tuple(row["input_ids"]) in corpus_rows for row in train_set) == 8
    # a prefix of the corpus, for scaling curves; more than it holds is a clear error
    few, _ = build_datasets(replace(data, corpus_answers=3, dataset_responses=0), tokenizer, model, "tiny", seed=0)
    assert sorted(map(tuple, few["input_ids"])) == sorted(
        tuple(r["prompt_ids"] + r["answer_ids"]) for r in records[4:7]
    )
    # at most N answers of each prompt source, the first in corpus order
    capped, _ = build_datasets(
        replace(data, corpus_per_source=1, dataset_responses=0), tokenizer, model, "tiny", seed=0
    )
    first_of_source = {}
    for r in records[4:]:
        first_of_source.setdefault(r["source"], r)
    assert len(first_of_source) > 1
    assert sorted(map(tuple, capped["input_ids"])) == sorted(
        tuple(r["prompt_ids"] + r["answer_ids"]) for r in first_of_source.values()
    )
    with pytest.raises(ValueError, match="holds 8 answers besides the 4 held out"):
        build_datasets(replace(data, corpus_answers=9), tokenizer, model, "tiny", seed=0)
    # the caches are keyed on the file's content: a new modification time (a fresh copy) reuses them
    written = sorted((tmp_path / "cache").iterdir())
    os.utime(tiny_chat / "prompts.jsonl", ns=(10**18, 10**18))
    build_datasets(data, tokenizer, model, "tiny", seed=0)
    assert sorted((tmp_path / "cache").iterdir()) == written


def test_long_sequences_pack_whole_conversations_and_sources_can_be_left_out(tiny_chat, tmp_path):
    from training.config import ConfigError, DataConfig
    from training.corpus import read_corpus
    from training.data import build_datasets

    model, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    corpus = twelve_answer_corpus(tiny_chat, tmp_path)
    records = read_corpus(corpus)
    data = DataConfig(
        path=str(tiny_chat / "prompts.jsonl"),
        corpus=str(corpus),
        eval_prompts=2,
        dataset_responses=0,
        max_length=64,
        cache_dir=str(tmp_path / "cache"),
    )
    single, single_eval = build_datasets(data, tokenizer, model, "tiny", seed=0)
    longest = max(len(row) for row in single["input_ids"])
    pack = max(3 * longest, data.max_length)
    packs, packs_eval = build_datasets(replace(data, pack_length=pack), tokenizer, model, "tiny", seed=0)
    # fewer, longer sequences of the same conversations, in the same order, each one's loss mask kept
    assert len(packs) < len(single) and max(len(row) for row in packs["input_ids"]) > longest
    assert all(len(row) <= pack for row in packs["input_ids"])
    assert sum(packs["input_ids"], []) == sum(single["input_ids"], [])
    assert sum(packs["loss_mask"], []) == sum(single["loss_mask"], [])
    assert packs_eval["input_ids"] == single_eval["input_ids"]  # held-out scores stay comparable
    with pytest.raises(ConfigError, match="pack_length .* must be at least data.max_length"):
        replace(data, pack_length=32)

    # leave-one-source-out: none of a left-out source's answers is trained on
    trained_sources = {r["source"] for r in records[2:]}
    left_out = sorted(trained_sources)[0]
    without, _ = build_datasets(replace(data, exclude_sources=[left_out]), tokenizer, model, "tiny", seed=0)
    rows = {tuple(row) for row in without["input_ids"]}
    expected = {tuple(r["prompt_ids"] + r["answer_ids"]) for r in records[2:] if r["source"] != left_out}
    assert rows == expected and len(rows) < len(single)
    with pytest.raises(ConfigError, match="does not hold; its sources are"):
        build_datasets(replace(data, exclude_sources=["no-such-source"]), tokenizer, model, "tiny", seed=0)


def test_another_models_corpus_is_refused(tiny_chat, tmp_path):
    from transformers import AutoModelForCausalLM

    from training.config import DataConfig
    from training.data import build_datasets

    model, tokenizer = load_target(str(tiny_chat / "model"), compile=False)
    other = AutoModelForCausalLM.from_config(model.config)  # the same shapes, other weights
    data = DataConfig(
        path=str(tiny_chat / "prompts.jsonl"),
        corpus=str(tiny_chat / "distill" / "model-float32"),
        cache_dir=str(tmp_path),
    )
    with pytest.raises(ValueError, match="another model's answers"):
        build_datasets(data, tokenizer, other, "other", seed=0)
    with pytest.raises(ValueError, match="not a distilled corpus"):
        build_datasets(replace(data, corpus=str(tmp_path)), tokenizer, model, "tiny", seed=0)


def test_trained_eagle_head_loses_loss_and_drafts_better(tiny_chat, tmp_path):
    result = train(recipe(tiny_chat, tmp_path / "eagle", eagle_unroll=2))
    first, last = result["history"][0], result["history"][-1]
    assert last["eval/loss"] < first["eval/loss"]
    assert "eval/top1/depth2" in last  # the unrolled step is evaluated as a second draft depth
    model, tokenizer = load_target(tiny_chat / "model", compile=False)
    trained = load_heads(tmp_path / "eagle", model)
    untrained = EagleHead(EagleConfig.for_target(model.config)).eval()
    held_out = [json.loads(line)["prompt"] for line in (tiny_chat / "prompts.jsonl").read_text().splitlines()[:16]]
    tau_trained, tau_untrained = (
        mean_tau(model, tokenizer, trained, held_out),
        mean_tau(model, tokenizer, untrained, held_out),
    )
    assert tau_trained > tau_untrained + 0.1, (tau_trained, tau_untrained)
    saved = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert saved["training"]["steps"] == 150 and saved["training"]["config"]["eagle_unroll"] == 2
    assert saved["training"]["eval_history"][-1] == {k: round(v, 4) for k, v in last.items()}


def test_eagle3_layout_trains_and_exports_for_serving(tiny_chat, tmp_path, capsys):
    """A head trained in EAGLE-3's serving layout learns, and leaves in speculators' format (what vLLM loads)
    unchanged."""
    from heads.formats import write_format

    options = {
        "head.architecture": "eagle3",
        "head.feature_layers": "[0, 1]",
        "head.draft_vocab_size": 24,
        "max_steps": 60,
        "eval_every": 30,
    }
    with pytest.raises(SystemExit):  # EAGLE-3 has no target feature to regress on: the default weight is refused
        train(recipe(tiny_chat, tmp_path / "refused", **options))
    assert "set eagle_regression_weight: 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # lm_heads of their own are read from Medusa's files, never trained here
        train(recipe(tiny_chat, tmp_path / "refused", **{"head.kind": "medusa", "head.own_lm_heads": "true"}))
    assert "head.own_lm_heads is for Medusa heads read from FasterDecoding's files" in capsys.readouterr().err
    result = train(recipe(tiny_chat, tmp_path / "eagle3", eagle_regression_weight=0, eagle_unroll=2, **options))
    first, last = result["history"][0], result["history"][-1]
    assert last["eval/loss"] < first["eval/loss"] and last["eval/top1/depth1"] > first["eval/top1/depth1"]
    model, _ = load_target(tiny_chat / "model", compile=False)
    trained = load_heads(tmp_path / "eagle3", model)
    assert trained.config.architecture == "eagle3" and trained.lm_head.weight.shape == (24, model.config.hidden_size)
    write_format(trained, tmp_path / "served", "speculators", model, dtype=torch.float32)
    served = load_heads(tmp_path / "served", model)
    for name, tensor in trained.state_dict().items():
        assert torch.equal(tensor, served.state_dict()[name]), name


def test_trained_early_exit_adapter_loses_loss_and_drafts_better(tiny_chat, tmp_path):
    result = train(
        recipe(
            tiny_chat,
            tmp_path / "exit",
            **{"head.kind": "early_exit", "head.exit_layer": 1, "head.lora_rank": 8, "learning_rate": 1e-2},
        )
    )
    first, last = result["history"][0], result["history"][-1]
    assert last["eval/loss"] < first["eval/loss"] and last["eval/agree/depth1"] > first["eval/agree/depth1"]
    model, tokenizer = load_target(tiny_chat / "model", compile=False)
    trained = load_heads(tmp_path / "exit", model)
    assert isinstance(trained, EarlyExitHead) and (tmp_path / "exit" / "adapter_model.safetensors").is_file()
    untrained = EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=1, lora_rank=None), model).eval()
    held_out = [json.loads(line)["prompt"] for line in (tiny_chat / "prompts.jsonl").read_text().splitlines()[:16]]
    tau_trained, tau_untrained = (
        mean_tau(model, tokenizer, trained, held_out),
        mean_tau(model, tokenizer, untrained, held_out),
    )
    assert tau_trained > tau_untrained + 0.1, (tau_trained, tau_untrained)
    # hard labels (the corpus text, the target's own greedy tokens): no pass of the whole target, and it learns too
    hard = train(
        recipe(
            tiny_chat,
            tmp_path / "exit-hard",
            **{
                "head.kind": "early_exit",
                "head.exit_layer": 1,
                "early_exit_soft_labels": False,
                "max_steps": 60,
                "eval_every": 20,
            },
        )
    )
    assert hard["history"][-1]["eval/loss"] < hard["history"][0]["eval/loss"]
    assert hard["history"][-1]["eval/top1/depth1"] > hard["history"][0]["eval/top1/depth1"]


def test_medusa_training_runs_and_reloads(tiny_chat, tmp_path):
    result = train(
        recipe(
            tiny_chat,
            tmp_path / "medusa",
            **{
                "head.kind": "medusa",
                "head.num_heads": 3,
                "max_steps": 40,
                "eval_every": 20,
                "head.draft_vocab_size": 24,
                "target_dtype": "bfloat16",
                "report_to": "tensorboard",
                "log_every": 5,
            },
        )
    )
    assert list((tmp_path / "medusa.train-state").rglob("events.out.tfevents.*")), "no tensorboard log written"
    assert result["history"][-1]["eval/loss"] < result["history"][0]["eval/loss"] + 1e-6
    assert {"eval/top1/depth2", "eval/top1/depth4"} <= set(result["history"][-1])
    model, tokenizer = load_target(tiny_chat / "model", compile=False)
    heads = load_heads(tmp_path / "medusa", model)
    assert heads.config.num_heads == 3 and heads.draft_ids.shape == (24,)
    accuracy = heads.config.rank_accuracy  # measured at the end, it shapes the default tree
    assert len(accuracy) == 3 and all(len(row) == 4 for row in accuracy)
    assert accuracy == [
        [round(result["history"][-1].get(f"eval/{m}/depth{d}", 0.0), 4) for m in ("top1", "rank2", "rank3", "rank4")]
        for d in (2, 3, 4)
    ]
    assert tokenizer.eos_token_id in heads.draft_ids.tolist()  # every answer ends with it: among the most frequent


def test_sequential_medusa_heads_train_and_draft_better(tiny_chat, tmp_path):
    extra = {
        "head.kind": "medusa",
        "head.sequential": "true",
        "head.num_heads": 4,
        "head.num_layers": 2,
        "medusa_soft_labels": "true",
    }
    result = train(recipe(tiny_chat, tmp_path / "sequential", **extra))
    first, last = result["history"][0], result["history"][-1]
    assert last["eval/loss"] < first["eval/loss"]
    assert {"eval/top1/depth2", "eval/top1/depth5"} <= set(last)
    model, tokenizer = load_target(tiny_chat / "model", compile=False)
    trained = load_heads(tmp_path / "sequential", model)
    assert trained.config.sequential and trained.config.num_heads == 4
    untrained = MedusaHeads(replace(trained.config, rank_accuracy=None)).eval()
    held_out = [json.loads(line)["prompt"] for line in (tiny_chat / "prompts.jsonl").read_text().splitlines()[:16]]
    tau_trained, tau_untrained = (
        mean_tau(model, tokenizer, trained, held_out),
        mean_tau(model, tokenizer, untrained, held_out),
    )
    assert tau_trained > tau_untrained + 0.1, (tau_trained, tau_untrained)


def test_medusa_soft_labels_are_the_targets_distribution_for_the_same_token():
    from heads import DraftVocabulary, MedusaConfig, MedusaHeads
    from training.losses import medusa_loss

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(8, 10, bias=False)
    hidden = 50 * torch.randn(1, 12, 8)  # sharp: the target's distribution is all but one-hot
    input_ids = torch.cat(
        [torch.zeros(1, 1, dtype=torch.long), lm_head(hidden).argmax(-1)[:, :-1]], dim=1
    )  # its greedy text
    heads = MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=10, num_heads=2))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    args = (heads, DraftVocabulary(lm_head), hidden, input_ids, torch.ones(1, 12), 0.8, 64)
    hard, _ = medusa_loss(*args)
    soft, _ = medusa_loss(*args, soft_labels=True)
    # on greedy text each label is the argmax of the target's distribution one position earlier; a teacher
    # read at any other position would disagree with the hard labels
    torch.testing.assert_close(soft, hard, rtol=0.01, atol=0)
    other_labels, _ = medusa_loss(
        heads, DraftVocabulary(lm_head), hidden, torch.randint(0, 10, (1, 12)), torch.ones(1, 12), 0.8, 64
    )
    assert abs(other_labels.item() - soft.item()) > 0.1 * soft.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_in_blocks_equals_the_formula_and_its_gradient(dtype):
    from training.losses import SOFT_CE_ROWS, soft_cross_entropy

    torch.manual_seed(0)
    rows = 2 * SOFT_CE_ROWS + 44  # a last block that is not full
    logits = (3 * torch.randn(rows, 1000)).to(dtype).requires_grad_()
    teacher = (3 * torch.randn(rows, 1000)).to(dtype)
    blocked = soft_cross_entropy(logits, teacher)
    (grad,) = torch.autograd.grad(2.0 * blocked, logits)
    reference = -(torch.softmax(teacher.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1).mean()
    (expected,) = torch.autograd.grad(2.0 * reference, logits)
    torch.testing.assert_close(blocked, reference, rtol=1e-5, atol=1e-5)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, expected, rtol=0.01 if dtype == torch.bfloat16 else 1e-5, atol=1e-7)


def test_cached_features_train_like_features_computed_every_step(tiny_chat, tmp_path, monkeypatch):
    from training import features

    digest = features.file_digest
    common = dict(max_steps=8, eval_every=8, save_every=8, eagle_unroll=2, **{"head.feature_layers": "[1,-1]"})
    live_run = train(recipe(tiny_chat, tmp_path / "live", **common))
    cached_run = train(recipe(tiny_chat, tmp_path / "cached", cache_features="true", **common))
    shards = sorted((tiny_chat / "cache").glob("features-*/shard-*.safetensors"))
    assert shards, "no feature shards written"
    # the same features up to how the target's batches were padded (float32 sums in another order, ~1e-7),
    # so: the same held-out loss, and weights within one rounding step of the bf16 checkpoints (features
    # cached 0.1% off move the loss by 2.6e-5 and some weights by ten steps)
    assert abs(live_run["history"][-1]["eval/loss"] - cached_run["history"][-1]["eval/loss"]) < 2e-6
    model, _ = load_target(tiny_chat / "model", compile=False)
    live, cached = load_heads(tmp_path / "live", model), load_heads(tmp_path / "cached", model)
    for (name, a), b in zip(live.named_parameters(), cached.parameters()):
        assert torch.allclose(a, b, rtol=2**-7, atol=1e-6), name
    stamps = [p.stat().st_mtime_ns for p in shards]
    hashed = []
    monkeypatch.setattr(features, "file_digest", lambda path: hashed.append(path) or digest(path))
    train(recipe(tiny_chat, tmp_path / "again", cache_features="true", **common))  # a rerun reuses the shards
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    assert not hashed, "shards checked when they were written were hashed again, unchanged since"
    content = shards[0].read_bytes()
    shards[0].write_bytes(content[:-8] + bytes(8))  # a shard damaged on disk: its digest no longer matches
    with pytest.warns(UserWarning, match="does not match its sha256"):
        again = train(recipe(tiny_chat, tmp_path / "repaired", cache_features="true", **common))
    assert shards[0].read_bytes() == content, "computed again, as it was"
    assert abs(again["history"][-1]["eval/loss"] - cached_run["history"][-1]["eval/loss"]) < 2e-6


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")), ids=lambda path: path.name
)
def test_every_shipped_recipe_loads(path):
    from training.config import load_config

    cfg = load_config(path)  # unknown or mistyped keys are errors
    assert cfg.head["kind"] in ("eagle", "medusa", "early_exit")


def test_features_are_found_where_the_same_rows_are_kept_at_more_layers(tmp_path):
    from training.features import ABOUT, find_features

    rows, other = {"input_ids": [[1, 2, 3], [4, 5]]}, {"input_ids": [[1, 2, 3], [4, 6]]}
    eagle, layers = find_features(tmp_path, "target", rows, [3, 15, -1], torch.bfloat16)
    assert layers == [-1, 3, 15] and (eagle / ABOUT).is_file()
    assert find_features(tmp_path, "target", rows, [-1], torch.bfloat16) == (eagle, [-1, 3, 15])
    assert find_features(tmp_path, "target", rows, [-1, 3, 15], torch.bfloat16) == (eagle, [-1, 3, 15])
    for different in [("target", other, [-1]), ("target", rows, [-1, 7]), ("another", rows, [-1])]:
        assert find_features(tmp_path, *different, torch.bfloat16)[0] != eagle, different
    assert find_features(tmp_path, "target", rows, [-1], torch.float32)[0] != eagle
    (eagle / ABOUT).write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert find_features(tmp_path, "target", rows, [3], torch.bfloat16)[0] != eagle


def test_medusa_heads_train_on_features_an_eagle_recipe_cached_over_the_same_rows(tiny_chat, tmp_path, capsys):
    common = dict(max_steps=4, eval_every=4, save_every=4)
    train(recipe(tiny_chat, tmp_path / "eagle", cache_features="true", **{"head.feature_layers": "[1,-1]"}, **common))
    directories = set((tiny_chat / "cache").glob("features-*"))  # the EAGLE run's (and other tests')
    medusa = {"head.kind": "medusa", "head.num_heads": 2, **common}
    live = train(recipe(tiny_chat, tmp_path / "live", **medusa))
    capsys.readouterr()
    cached = train(recipe(tiny_chat, tmp_path / "cached", cache_features="true", **medusa))
    assert set((tiny_chat / "cache").glob("features-*")) == directories, "no features of its own"
    out = capsys.readouterr().out
    assert re.search(r"reading layers \[-1\] from \S+/features-\w+, which holds \[-1, 1\]", out), out
    assert abs(live["history"][-1]["eval/loss"] - cached["history"][-1]["eval/loss"]) < 2e-6
    # other rows (eight more, fewer held out) are not served by those features
    train(recipe(tiny_chat, tmp_path / "more", cache_features="true", **{"data.eval_prompts": 8}, **medusa))
    assert len(set((tiny_chat / "cache").glob("features-*")) - directories) == 1


def test_fused_head_warm_started_from_a_one_layer_head_computes_what_it_did(tiny_chat, tmp_path, capsys):
    from heads import save_heads

    model, _ = load_target(tiny_chat / "model", compile=False)
    torch.manual_seed(0)
    source = EagleHead(EagleConfig.for_target(model.config, draft_vocab_size=16))
    source.draft_ids.copy_(torch.randperm(model.config.vocab_size)[:16])
    save_heads(source, tmp_path / "one-layer", model, dtype=torch.float32)
    # learning rate 0: the saved head is the warm start itself
    train(
        recipe(
            tiny_chat,
            tmp_path / "fused",
            max_steps=2,
            eval_every=2,
            learning_rate=0,
            init_from=tmp_path / "one-layer",
            **{"head.draft_vocab_size": 16, "head.feature_layers": "[1,-1]"},
        )
    )
    fused = load_heads(tmp_path / "fused", model)
    assert torch.equal(fused.draft_ids, source.draft_ids)
    last, low = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    tokens, positions = torch.randn(1, 5, 64), torch.arange(5)[None]
    with torch.no_grad():
        # bf16 checkpoints: the same head up to one bf16 rounding of its weights
        torch.testing.assert_close(
            fused(torch.cat([low, last], -1), tokens, position_ids=positions),
            source.eval()(last, tokens, position_ids=positions),
            rtol=0.02,
            atol=0.02,
        )
        assert not torch.allclose(
            fused(torch.cat([low + 1, last], -1), tokens, position_ids=positions),
            fused(torch.cat([low, last + 1], -1), tokens, position_ids=positions),
        )
        # raw residual-stream layers are RMS-normalised before fusing: their scale does not matter, the final one's does
        torch.nn.init.normal_(fused.fuse.weight, std=0.1)
        torch.testing.assert_close(
            fused(torch.cat([1000 * low, last], -1), tokens, position_ids=positions),
            fused(torch.cat([low, last], -1), tokens, position_ids=positions),
            rtol=1e-4,
            atol=1e-4,
        )
        assert not torch.allclose(
            fused(torch.cat([low, 1000 * last], -1), tokens, position_ids=positions),
            fused(torch.cat([low, last], -1), tokens, position_ids=positions),
            rtol=1e-2,
            atol=1e-2,
        )

    # a head may grow a copy input too: its weights start at zero, so whatever is copied, it computes what it did
    train(
        recipe(
            tiny_chat,
            tmp_path / "copying",
            max_steps=2,
            eval_every=2,
            learning_rate=0,
            init_from=tmp_path / "one-layer",
            **{"head.draft_vocab_size": 16, "head.feature_layers": "[1,-1]", "head.copy_input": "true"},
        )
    )
    copying = load_heads(tmp_path / "copying", model)
    assert copying.config.copy_input and torch.equal(copying.draft_ids, source.draft_ids)
    with torch.no_grad():
        for copies in (torch.zeros(1, 5, 64), torch.randn(1, 5, 64)):
            torch.testing.assert_close(
                copying(torch.cat([low, last], -1), tokens, copies, position_ids=positions),
                source(last, tokens, position_ids=positions),
                rtol=0.02,
                atol=0.02,
            )
        with pytest.raises(ValueError, match="needs copy_embedding"):
            copying(torch.cat([low, last], -1), tokens, position_ids=positions)

    for extra, message in [
        (
            {"head.draft_vocab_size": 16, "head.feature_layers": "[0,1]"},
            "may only grow from the final layer alone ([-1]) to several layers that include it",
        ),
        ({"head.draft_vocab_size": 8}, "does not fit this recipe's head"),
        ({"head.kind": "medusa"}, "holds eagle heads, but this recipe trains medusa heads"),
    ]:
        with pytest.raises(SystemExit):
            train(recipe(tiny_chat, tmp_path / "bad", max_steps=1, init_from=tmp_path / "one-layer", **extra))
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train(recipe(tiny_chat, tmp_path / "bad", max_steps=1, init_from=tmp_path / "nowhere"))
    error = capsys.readouterr().err
    assert "init_from:" in error and "is not a head checkpoint" in error


def test_sequential_medusa_heads_warm_started_with_a_prefix_layer_compute_what_they_did(tiny_chat, tmp_path):
    from heads import MedusaConfig, save_heads

    model, _ = load_target(tiny_chat / "model", compile=False)
    torch.manual_seed(0)
    source = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3, sequential=True, draft_vocab_size=16))
    for p in source.parameters():
        torch.nn.init.normal_(p, std=0.05)
    source.draft_ids = torch.randperm(model.config.vocab_size)[:16]
    save_heads(source, tmp_path / "plain", model, dtype=torch.float32)
    train(  # learning rate 0: the saved heads and a new layer are the warm start itself
        recipe(
            tiny_chat,
            tmp_path / "prefix",
            max_steps=2,
            eval_every=2,
            learning_rate=0,
            init_from=tmp_path / "plain",
            **{"head.kind": "medusa", "head.sequential": "true", "head.prefix_layer": "true"},
            **{"head.num_heads": 3, "head.draft_vocab_size": 16},
        )
    )
    grown = load_heads(tmp_path / "prefix", model)
    assert grown.prefix is not None and torch.equal(grown.draft_ids, source.draft_ids)
    texts, tokens, at = torch.randn(2, 6, 64), torch.randn(4, 3, 64), torch.tensor([[0, 5], [1, 2], [0, 0], [1, 5]])
    with torch.no_grad():  # bf16 checkpoints: the same heads up to one bf16 rounding of their weights
        torch.testing.assert_close(
            grown(texts, tokens, at=at), source.eval()(texts[at[:, 0], at[:, 1]], tokens), rtol=0.02, atol=0.02
        )


def run_script(args, env_extra=None, **kwargs):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", **(env_extra or {})}
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs
    )


def test_two_cpu_processes_end_with_the_same_weights(tiny_chat, tmp_path):
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--main_process_port",
        "29533",
        "training/train_heads.py",
    ]
    proc = run_script(
        launch
        + recipe(
            tiny_chat,
            tmp_path / "ddp",
            max_steps=6,
            eval_every=3,
            save_every=3,
            target_dtype="bfloat16",
            eagle_unroll=2,
            **{"head.draft_vocab_size": 16, "head.feature_layers": "[1,-1]"},
        ),  # EAGLE-3: fused layers, unrolled
        {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
    )
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    # the ranks write to one pipe, so a rank's line may land in the middle of the other's
    digests = dict(re.findall(r"(rank \d): weights sha256 ([0-9a-f]+)", output))
    assert set(digests) == {"rank 0", "rank 1"}, output[-3000:]
    assert digests["rank 0"] == digests["rank 1"]
    # each rank's random state is in each checkpoint (the main process renames it into place only after both wrote)
    checkpoints = sorted((tmp_path / "ddp.train-state").glob("step-*"))
    assert checkpoints and all(
        {"random_states_0.pkl", "random_states_1.pkl"} <= {f.name for f in c.iterdir()} for c in checkpoints
    )
    assert not list((tmp_path / "ddp.train-state").glob(".step-*")), "a checkpoint left behind half written"


def test_killed_run_resumes_to_the_same_weights(tiny_chat, tmp_path):
    # enough steps after the first checkpoint that the kill lands mid-run: on a fast CPU 20 tiny steps took
    # less than one polling interval, and the run had finished before the kill (a flaky ProcessLookupError)
    common = dict(max_steps=120, save_every=10, eval_every=10)
    reference = train(recipe(tiny_chat, tmp_path / "straight", **common))
    args = [sys.executable, "training/train_heads.py"] + recipe(tiny_chat, tmp_path / "killed", **common)
    proc = run_script(args, start_new_session=True)
    checkpoint = tmp_path / "killed.train-state" / "step-0000010" / "trainer_state.json"
    deadline = time.time() + 240
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists(), "the run never wrote its first checkpoint"
    assert not (tmp_path / "killed" / "model.safetensors").exists(), "the run finished before it was killed"
    with pytest.raises(SystemExit):  # starting afresh over the killed run's checkpoints is refused
        train(recipe(tiny_chat, tmp_path / "killed", **common))
    resumed = train(recipe(tiny_chat, tmp_path / "killed", **common) + ["--resume"])
    assert resumed["resumed_from"] >= 10, "the resumed run started over instead of continuing"
    assert resumed["weights_sha256"] == reference["weights_sha256"]
    assert resumed["history"] == reference["history"], "the held-out curve before the kill was lost"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max_stepz", "3"], "unknown key"),
        (["--data.path", "/nowhere/prompts.jsonl"], "not found"),
        (["--data.prompt_field", "question"], "has no 'question' field"),
        (["--data.balance_field", "topic"], "is not a field"),
        (["--head.feature_layers", "[1, 99]"], "reads target layers [99], but the target has 3 hidden states"),
        (["--head.hidden_size", "32"], "comes from the target"),
        (["--lr_schedule", "exotic"], "lr_schedule"),
        (["--mixed_precision", "fp32"], "mixed_precision must be no, bf16, fp16 or auto"),
        (["--target_dtype", "bf32"], "target_dtype must be one of"),
        (["--medusa_soft_labels", "maybe"], "medusa_soft_labels must be true or false"),
        (
            ["--keep_checkpoints", "0"],
            "keep_checkpoints must be >= 1",
        ),  # pruning to the newest 0 (or -1) deleted each checkpoint
        (["--keep_checkpoints", "-1"], "keep_checkpoints must be >= 1"),
    ],
)
def test_recipe_mistakes_are_clear_errors(tiny_chat, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        train(recipe(tiny_chat, tmp_path / "bad", max_steps=1) + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_mixed_precision_no_is_the_word_not_yaml_false():
    # YAML 1.1 reads a bare `no` as false; accelerate would then reject False with a message about its own API
    from training.config import load_config

    assert load_config(None, ["--mixed_precision", "no"]).mixed_precision == "no"
    assert load_config(None, ["--mixed_precision", "bf16"]).mixed_precision == "bf16"


@pytest.mark.parametrize("faster, dtype, precision", [(True, "bfloat16", "bf16"), (False, "float32", "no")])
def test_auto_precision_is_bfloat16_only_where_it_is_faster(monkeypatch, faster, dtype, precision):
    import inference.target
    from training.config import load_config

    monkeypatch.setattr(inference.target, "bfloat16_is_faster", lambda device_type="cpu", faster=faster: faster)
    cfg = load_config(None, ["--target_dtype", "auto", "--mixed_precision", "auto"])
    cfg.resolve_auto_precision("cpu")
    assert (cfg.target_dtype, cfg.mixed_precision) == (dtype, precision)
    assert inference.target.as_dtype("auto") == getattr(torch, dtype)


def test_bfloat16_where_it_is_emulated_is_loaded_with_a_warning(monkeypatch, tiny_chat):
    import inference.target

    for faster in (False, True):
        monkeypatch.setattr(inference.target, "bfloat16_is_faster", lambda device_type="cpu", faster=faster: faster)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, _ = load_target(tiny_chat / "model", dtype="bfloat16", compile=False)
        slow = [w for w in caught if "slower than float32 on this CPU" in str(w.message)]
        assert model.dtype == torch.bfloat16 and len(slow) == (0 if faster else 1)
