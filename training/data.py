"""Prompts -> chat template -> training sequences, from a dataset's own responses and/or self-distillation.

Two sources of response text:
- the dataset's `response` field, on which the frozen target later supplies its own soft labels (cheap);
- self-distillation: the frozen target writes the responses itself (batched generate), which matches
  its distribution best. Answers are kept on disk per prompt, in shards written as they finish: an
  interrupted run resumes where it stopped, and a rerun, or a recipe that picks other prompts, reuses
  every answer already written.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pyarrow
import torch
from datasets import Dataset, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError
from tqdm.auto import tqdm

from heads.io import written_atomically

from .config import ConfigError, DataConfig

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# the settings that shape a self-distilled answer to a given prompt (which prompts are asked is up to the recipe)
DISTILL_SETTINGS = ("distill_max_new_tokens", "distill_batch_size", "distill_temperature")


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
        raise ConfigError(f"{data.path} has no {field!r} field (columns: {records.column_names}); set data.prompt_field or data.messages_field")
    return records


def load_local_file(path: Path) -> Dataset:
    """A local file's records. A malformed file is named here, with the line: datasets' own error names neither."""
    if not path.is_file():
        raise ConfigError(f"data file {path} not found; set data.path to a .jsonl, .json or .parquet file or a hub dataset name")
    if path.stat().st_size == 0:
        raise ConfigError(f"data file {path} is empty; it should hold prompt records (one JSON object per line for .jsonl)")
    if path.suffix in (".jsonl", ".json"):
        check_json_file(path)
    try:
        return load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    except (DatasetGenerationError, pyarrow.ArrowException) as error:
        raise ConfigError(f"data file {path} cannot be read as {path.suffix[1:]} ({error.__cause__ or error}); check that it is "
                          "a complete file of that format, or convert it to .jsonl with one JSON object per line") from None


def check_json_file(path: Path) -> None:
    """A .jsonl file holds one JSON object per line; a .json file one JSON document (a list of records) or, as
    datasets reads it too, JSON Lines."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # datasets skips a byte-order mark too
    except UnicodeDecodeError as error:
        raise ConfigError(f"data file {path} is not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8") from None
    if path.suffix == ".json":
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            if error.msg != "Extra data":  # "Extra data": a first complete value, then more: JSON Lines
                raise ConfigError(f"data file {path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
                                  "a .json file holds a list of records [{...}, ...]; fix the file or name it .jsonl, one record per line") from None
        else:
            if document in ([], {}):
                raise ConfigError(f"data file {path} holds no records; it should hold a list of prompt records [{{...}}, ...]")
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
            raise ConfigError(f"data file {path}, line {number}: not valid JSON ({error.msg}, column {error.colno}); each line must "
                              "be one complete JSON object: fix or delete that line") from None
        if not isinstance(record, dict):
            raise ConfigError(f"data file {path}, line {number}: a JSON {type(record).__name__}, not an object {{...}}; each line must be one record")
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


def build_datasets(data: DataConfig, tokenizer, target, fingerprint: str, seed: int, is_main: bool = True) -> tuple[Dataset, Dataset]:
    """(train, eval) tokenized datasets, cached on disk under data.cache_dir."""
    source = Path(data.path)
    # the file's content, not its modification time: a copied or re-checked-out file keeps its cache
    stamp = hashlib.sha256(source.read_bytes()).hexdigest() if source.is_file() else None
    written_in = str(target.dtype) if data.self_distill else None  # self-distilled text depends on the dtype
    key = cache_key(fingerprint, data.__dict__, stamp, seed, getattr(tokenizer, "name_or_path", ""), written_in)
    root = Path(data.cache_dir) / f"data-{key}"
    if (root / "train").is_dir() and (root / "eval").is_dir():
        return load_from_disk(str(root / "train")), load_from_disk(str(root / "eval"))

    records = load_records(data)
    if data.balance_field and data.balance_field not in records.column_names:
        raise ConfigError(f"data.balance_field {data.balance_field!r} is not a field of {data.path} (columns: {records.column_names})")
    pairs = [conversation(r, data) for r in records]
    held_out, rest = pairs[: data.eval_prompts], pairs[data.eval_prompts :]
    if data.max_prompts is not None:
        rest = rest[: data.max_prompts]
    order = list(range(len(rest)))
    random.Random(seed).shuffle(order)
    if data.balance_field:
        groups = list(records[data.balance_field])[data.eval_prompts :]
        order = interleave(order, groups)

    train = []
    # the dataset's answers come from prompts the target does not answer itself: more variety per token
    with_response = [i for i in order[data.self_distill :] if rest[i][1]][: data.dataset_responses]
    for i in sorted(with_response):
        messages, response = rest[i]
        train.append(example(prompt_ids(tokenizer, messages), response_ids(tokenizer, response), data.max_length))
    if data.self_distill:
        # answers are stored per prompt, keyed on what shapes them only (the dtype too: bf16 greedy text is
        # not fp32's): raising data.self_distill, or choosing other prompts, reuses every answer already written
        store = root.parent / f"answers-{cache_key(fingerprint, [getattr(data, k) for k in DISTILL_SETTINGS] + [written_in])}"
        chosen = [prompt_ids(tokenizer, rest[i][0]) for i in order[: data.self_distill]]
        written = self_distill(target, tokenizer, chosen, data, store, is_main)
        train += [example(p, r, data.max_length) for p, r in zip(chosen, written)]
        # the heads will draft the target's own text: score them on its answers to the held-out prompts
        asked = [prompt_ids(tokenizer, m) for m, _ in held_out]
        answers = self_distill(target, tokenizer, asked, data, store, is_main)
        evaluation = [example(p, r, data.max_length) for p, r in zip(asked, answers)]
    else:
        evaluation = [example(prompt_ids(tokenizer, m), response_ids(tokenizer, r), data.max_length) for m, r in held_out if r]
    if not train:
        raise ConfigError(f"no training sequences: {data.path} has no {data.response_field!r} responses and data.self_distill is 0")
    random.Random(seed).shuffle(train)
    train_set, eval_set = Dataset.from_list(train), Dataset.from_list(evaluation or train[:8])
    if is_main:
        with written_atomically(root) as staging:
            train_set.save_to_disk(str(staging / "train"))
            eval_set.save_to_disk(str(staging / "eval"))
    return train_set, eval_set


def interleave(order: list[int], groups: list) -> list[int]:
    """`order` taken round-robin across the groups (each keeping its own order): every prefix is balanced
    until a group runs out."""
    queues: dict = {}
    for i in order:
        queues.setdefault(groups[i], []).append(i)
    rounds = max((len(q) for q in queues.values()), default=0)
    return [q[r] for r in range(rounds) for q in queues.values() if r < len(q)]


@torch.no_grad()
def self_distill(target, tokenizer, prompts: list[list[int]], data: DataConfig, directory: Path, is_main: bool = True) -> list[list[int]]:
    """The target's own responses to `prompts`, from the answer store in `directory`; the missing ones are
    generated in shards of {"prompts", "responses"}, each written whole, so an interruption loses at most one."""
    directory.mkdir(parents=True, exist_ok=True)
    known: dict[tuple, list[int]] = {}
    shards = sorted(directory.glob("shard-*.json"))
    for path in shards:
        shard = json.loads(path.read_text())
        known.update(zip(map(tuple, shard["prompts"]), shard["responses"]))
    missing = list(dict.fromkeys(tuple(p) for p in prompts if tuple(p) not in known))
    shard_size = data.distill_batch_size * 4
    first = int(shards[-1].stem.split("-")[1]) + 1 if shards else 0
    chunks = [missing[i : i + shard_size] for i in range(0, len(missing), shard_size)]
    for number, chunk in enumerate(tqdm(chunks, desc="self-distilling", disable=not is_main), first):
        # batches of similar prompt length: left padding to the longest prompt costs every row its width
        by_length = sorted(chunk, key=len)
        written = []
        for start in range(0, len(by_length), data.distill_batch_size):
            batch = by_length[start : start + data.distill_batch_size]
            written += generate_batch(target, tokenizer, [list(p) for p in batch], data)
        path = directory / f"shard-{number:05d}.json"
        with written_atomically(path) as staging:  # a shard is either complete or absent
            staging.write_text(json.dumps({"prompts": [list(p) for p in by_length], "responses": written}))
        known.update(zip(by_length, written))
    return [known[tuple(p)] for p in prompts]


def generate_batch(target, tokenizer, prompts: list[list[int]], data: DataConfig) -> list[list[int]]:
    """Left-padded batched generation; each response ends at (and includes) EOS when one came."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
    sampling = {"do_sample": True, "temperature": data.distill_temperature} if data.distill_temperature > 0 else {"do_sample": False}
    out = target.generate(
        input_ids=input_ids, attention_mask=attention, max_new_tokens=data.distill_max_new_tokens, pad_token_id=pad,
        cache_implementation="static", **sampling,  # the dynamic cache was erratic for batched bf16 generation
    )
    eos = tokenizer.eos_token_id
    responses = []
    for row in out[:, width:].tolist():
        responses.append(row[: row.index(eos) + 1] if eos in row else row)
    return responses
