"""Prompts and answers -> chat template -> training sequences.

Two sources of answer text:
- a self-distilled corpus (`data.corpus`, written by `python -m training.distill`): the target's own greedy
  answers, token ids kept in the repository, so the data grows from run to run instead of being regenerated;
- the dataset's `response` field, on which the frozen target later supplies its own soft labels (cheap, but
  not the target's text).
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
from pathlib import Path

import pyarrow
import torch
from datasets import Dataset, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

from heads.files import written_atomically

from .config import ConfigError, DataConfig
from .corpus import corpus_records

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_records(data: DataConfig) -> Dataset:
    """The raw prompt records, from a local file or (for users with network) a hub dataset."""
    path = Path(data.path)
    if path.suffix in LOCAL_FORMATS:
        records = load_local_file(path)
    elif path.exists():
        raise ConfigError(f"data.path {path} is not a .jsonl, .json or .parquet file")
    else:
        records = load_dataset(data.path, split=data.split)
    if len(records) == 0:
        raise ConfigError(f"{data.path} holds no records; set data.path to a file (or split) of prompt records")
    field = data.messages_field or data.prompt_field
    if field not in records.column_names:
        raise ConfigError(
            f"{data.path} has no {field!r} field (columns: {records.column_names}); set data.prompt_field or "
            "data.messages_field"
        )
    return records


def load_local_file(path: Path) -> Dataset:
    """A local file's records. A malformed file is named here, with the line: datasets' own error names neither."""
    if not path.is_file():
        raise ConfigError(
            f"data file {path} not found; set data.path to a .jsonl, .json or .parquet file or a hub dataset name"
        )
    if path.stat().st_size == 0:
        raise ConfigError(
            f"data file {path} is empty; it should hold prompt records (one JSON object per line for .jsonl)"
        )
    if path.suffix in (".jsonl", ".json"):
        check_json_file(path)
    try:
        return load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    except (DatasetGenerationError, pyarrow.ArrowException) as error:
        raise ConfigError(
            f"data file {path} cannot be read as {path.suffix[1:]} ({error.__cause__ or error}); check that it is "
            "a complete file of that format, or convert it to .jsonl with one JSON object per line"
        ) from None


def check_json_file(path: Path) -> None:
    """A .jsonl file holds one JSON object per line; a .json file one JSON document (a list of records) or, as
    datasets reads it too, JSON Lines."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # datasets skips a byte-order mark too
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"data file {path} is not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8"
        ) from None
    if path.suffix == ".json":
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            if error.msg != "Extra data":  # "Extra data": a first complete value, then more: JSON Lines
                raise ConfigError(
                    f"data file {path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
                    "a .json file holds a list of records [{...}, ...]; fix the file or name it .jsonl, one record per "
                    "line"
                ) from None
        else:
            if document in ([], {}):
                raise ConfigError(
                    f"data file {path} holds no records; it should hold a list of prompt records [{{...}}, ...]"
                )
            return
    check_json_lines(path, text)


def check_json_lines(path: Path, text: str) -> None:
    records = 0
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines(): JSON strings may hold U+2028 unescaped
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"data file {path}, line {number}: not valid JSON ({error.msg}, column {error.colno}); each line must "
                "be one complete JSON object: fix or delete that line"
            ) from None
        if not isinstance(record, dict):
            raise ConfigError(
                f"data file {path}, line {number}: a JSON {type(record).__name__}, not an object {{...}}; each line "
                "must be one record"
            )
        records += 1
    if not records:
        raise ConfigError(f"data file {path} holds no records; it should hold one JSON object per line")


def conversation(record: dict, data: DataConfig) -> tuple[list[dict], str | None]:
    """(messages up to the assistant's turn, the dataset's response or None)."""
    if data.messages_field:
        messages = list(record[data.messages_field])
        if messages and messages[-1]["role"] == "assistant":
            return messages[:-1], messages[-1]["content"]
        return messages, None
    response = record.get(data.response_field) if data.response_field else None
    return [{"role": "user", "content": record[data.prompt_field]}], response or None


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def example(prompt: list[int], response: list[int], max_length: int) -> dict:
    """One training sequence; the loss covers response tokens only."""
    ids = (prompt + response)[:max_length]
    mask = ([0] * len(prompt) + [1] * len(response))[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


def response_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def collate(pad_id: int):
    """A DataLoader collate_fn: rows right-padded to the longest, with attention and loss masks (and cached
    features, when the rows carry them)."""

    def pad(batch):
        width = max(len(x["input_ids"]) for x in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        loss_mask = torch.zeros((len(batch), width), dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, x in enumerate(batch):
            n = len(x["input_ids"])
            ids[row, :n] = torch.tensor(x["input_ids"])
            loss_mask[row, :n] = torch.tensor(x["loss_mask"])
            attention[row, :n] = 1
        out = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}
        if "features" in batch[0]:  # cached hidden states (training/features.py), padded like the rows
            out["features"] = {
                layer: torch.nn.utils.rnn.pad_sequence([x["features"][layer] for x in batch], batch_first=True)
                for layer in batch[0]["features"]
            }
        return out

    return pad


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_datasets(
    data: DataConfig, tokenizer, target, fingerprint: str, seed: int, is_main: bool = True
) -> tuple[Dataset, Dataset]:
    """(train, eval) tokenized datasets, cached on disk under data.cache_dir.

    Training text: the corpus's self-distilled answers (data.corpus), then the dataset's own answers to prompts the
    corpus has not answered (data.dataset_responses). Held out: the corpus's first `eval_prompts` first turns (and
    their second turns), balanced across sources as the corpus is; without a corpus, the file's first prompts."""
    source = Path(data.path)
    # contents, not modification times: a copied or re-checked-out file keeps its cache
    stamp = hashlib.sha256(source.read_bytes()).hexdigest() if source.is_file() else None
    shards = sorted(Path(data.corpus).glob("shard-*.jsonl.gz")) if data.corpus else []
    corpus_stamp = [hashlib.sha256(p.read_bytes()).hexdigest() for p in shards]
    key = cache_key(fingerprint, data.__dict__, stamp, corpus_stamp, seed, getattr(tokenizer, "name_or_path", ""))
    root = Path(data.cache_dir) / f"data-{key}"
    if (root / "train").is_dir() and (root / "eval").is_dir():
        return load_from_disk(str(root / "train")), load_from_disk(str(root / "eval"))

    train, evaluation, answered = [], [], set()
    if data.corpus:
        records = corpus_records(data.corpus, target)
        held_out = held_out_ids(records, data.eval_prompts)
        answered = {r["id"] for r in records}
        used = [
            r for r in records if r.get("prompt_of", r["id"]) not in held_out
        ]  # a reinstructed prompt: its passage too
        if data.exclude_sources:
            sources = {r["source"] for r in records}
            if not set(data.exclude_sources) <= sources:
                raise ConfigError(
                    f"data.exclude_sources names {sorted(set(data.exclude_sources) - sources)}, which {data.corpus} "
                    f"does not hold; its sources are {sorted(sources)}"
                )
            used = [r for r in used if r["source"] not in data.exclude_sources]
        if data.corpus_answers is not None:
            if data.corpus_answers > len(used):
                raise ConfigError(
                    f"data.corpus_answers is {data.corpus_answers} but {data.corpus} holds {len(used)} answers "
                    f"besides the {len(held_out)} held out; write more with `python -m training.distill --answers N`"
                )
            used = used[: data.corpus_answers]
        if data.corpus_per_source is not None:  # the prompt file is 45% grade-school maths: cap what a source adds
            taken, capped = collections.Counter(), []
            for r in used:
                taken[r["source"]] += 1
                if taken[r["source"]] <= data.corpus_per_source:
                    capped.append(r)
            used = capped
        train += [example(r["prompt_ids"], r["answer_ids"], data.max_length) for r in used]
        evaluation += [
            example(r["prompt_ids"], r["answer_ids"], data.max_length) for r in records if r["id"] in held_out
        ]
    if data.response_field and data.dataset_responses != 0:
        train_part, eval_part = dataset_examples(data, tokenizer, seed, answered)
        train += train_part
        evaluation += [] if data.corpus else eval_part
    kept = [x for x in train if any(x["loss_mask"])]  # a prompt longer than max_length leaves nothing to learn
    if not kept:
        raise ConfigError(
            f"no training sequences: set data.corpus to a distilled corpus (python -m training.distill), or give "
            f"{data.path} {data.response_field!r} responses, and keep data.max_length ({data.max_length}) above the "
            "prompts' length"
        )
    random.Random(seed).shuffle(kept)
    if data.pack_length is not None:
        kept = packed(kept, data.pack_length)
    evaluation = [x for x in evaluation if any(x["loss_mask"])]
    train_set, eval_set = Dataset.from_list(kept), Dataset.from_list(evaluation or kept[:8])
    if is_main:
        with written_atomically(root) as staging:
            train_set.save_to_disk(str(staging / "train"))
            eval_set.save_to_disk(str(staging / "eval"))
    return train_set, eval_set


def packed(examples: list[dict], length: int) -> list[dict]:
    """The examples, in order, placed one after another into sequences of at most `length` tokens, each loss mask
    kept. Nothing resets between them: the target's soft labels and features come from its own pass over the whole
    sequence, so a later conversation is read after the earlier ones, as a long prompt or a long chat is."""
    sequences, ids, mask = [], [], []
    for x in examples:
        if ids and len(ids) + len(x["input_ids"]) > length:
            sequences.append({"input_ids": ids, "loss_mask": mask})
            ids, mask = [], []
        ids, mask = ids + x["input_ids"], mask + x["loss_mask"]
    if ids:
        sequences.append({"input_ids": ids, "loss_mask": mask})
    return sequences


def held_out_ids(records: list[dict], count: int) -> set:
    """The prompts a corpus recipe keeps out of training (both turns): its first `count` conversations, which
    the corpus balances across sources. Tree shapes are chosen on these, not on the dev set."""
    return {r["id"] for r in [r for r in records if r["turn"] == 1 and "prompt_of" not in r][:count]}


def dataset_examples(data: DataConfig, tokenizer, seed: int, answered: set) -> tuple[list[dict], list[dict]]:
    """(training, held-out) examples of the dataset's own answers; prompts whose id is in `answered` are left to the
    corpus."""
    records = load_records(data)
    if data.balance_field and data.balance_field not in records.column_names:
        raise ConfigError(
            f"data.balance_field {data.balance_field!r} is not a field of {data.path} (columns: {records.column_names})"
        )
    ids = list(records[data.id_field]) if data.id_field in records.column_names else [None] * len(records)
    pairs = [conversation(r, data) for r in records]
    held_out = pairs[: data.eval_prompts]
    rest = [i for i in range(data.eval_prompts, len(pairs)) if pairs[i][1] and ids[i] not in answered]
    if data.exclude_sources:
        if "source" not in records.column_names:
            raise ConfigError(
                f"data.exclude_sources needs a 'source' field in {data.path} (columns: {records.column_names})"
            )
        sources = records["source"]
        rest = [i for i in rest if sources[i] not in data.exclude_sources]
    if data.max_prompts is not None:
        rest = rest[: data.max_prompts]
    random.Random(seed).shuffle(rest)
    if data.balance_field:
        groups = list(records[data.balance_field])
        rest = interleave(rest, [groups[i] for i in rest])
    chosen = rest if data.dataset_responses is None else rest[: data.dataset_responses]
    train = [
        example(prompt_ids(tokenizer, pairs[i][0]), response_ids(tokenizer, pairs[i][1]), data.max_length)
        for i in sorted(chosen)
    ]
    evaluation = [
        example(prompt_ids(tokenizer, m), response_ids(tokenizer, r), data.max_length) for m, r in held_out if r
    ]
    return train, evaluation


def interleave(items: list, groups: list) -> list:
    """`items` taken round-robin across their groups (each keeping its order): every prefix is balanced until a
    group runs out."""
    queues: dict = {}
    for item, group in zip(items, groups):
        queues.setdefault(group, []).append(item)
    rounds = max((len(q) for q in queues.values()), default=0)
    return [q[r] for r in range(rounds) for q in queues.values() if r < len(q)]
