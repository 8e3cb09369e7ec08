"""Self-distillation into a corpus that accumulates: the target's own greedy answers, kept as compressed shards.

    python -m training.distill --answers 20000            # the embedded SmolLM2, bf16 where faster, 2 workers
    python -m training.distill --answers 20000 --model HuggingFaceTB/SmolLM2-360M-Instruct --workers 1 --threads 8

A corpus is one folder per target and dtype (`data/distill/<model>-<dtype>/`): `corpus.json` records what shaped
the answers (the target's fingerprint, dtype, generation settings, chat template, prompt file); each
`shard-NNNNN.jsonl.gz` holds up to `shard_answers` records {id, source, turn, follow_up, prompt_ids, answer_ids}.
A run asks only what the corpus lacks, so it grows from run to run and an interrupted run loses at most the shard
each worker was writing. Prompts stay where they are (`prompts`); the corpus keeps their ids, not their text.

Which prompts are answered, in order: first turns taken round-robin across the prompt file's sources (seeded),
so every prefix of the corpus is balanced; then `second_turn_share` of the answers are second turns: a
follow-up request (FOLLOW_UPS) answered after the target's own first answer, as in a two-turn chat. Besides those,
`reinstructed` answers ask a passage of a `reinstruct_source` prompt again under another of that source's
instructions (more text grounded in a document, where the prompt file has one request a passage); their records
have the id "<prompt id>/reinstructed", the source "<source>/reinstructed" and `prompt_of`, the prompt's own id.

`self_prompts` answers, besides those, answer requests the target wrote itself (training/self_prompt.py): sampled
from its chat template's user-turn opening, filtered, answered greedily; `second_turn_share` of them answer a second
user turn the target wrote after its own first answer. Their records have the source "self-prompted", an id
"self-NNNNNNN", and the request's text (`prompt` in a first turn, `follow_up` in a second).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import multiprocessing
import os
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

import inference.target
from heads.config import TargetFingerprint, dataclass_from_dict

from .config import DEFAULT_PROMPTS, ConfigError, check_numbers, parse_overrides
from .corpus import check_manifest, read_corpus, read_corpus_shard, write_shard
from .data import check_json_lines, interleave, prompt_ids
from .self_prompt import TEMPERATURE, TOP_P, RequestFilter, request_text, user_turn

# Second-turn requests: generic enough to follow any first answer (maths, code, documents, role-play, chat),
# varied in what they ask (shorten, extend, rewrite, explain, restructure, critique) like real second turns.
FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Summarize your answer in two sentences.",
    "Rewrite your answer so that a ten-year-old could understand it.",
    "Give me a concrete example.",
    "What are the weaknesses or limitations of your answer?",
    "Turn your answer into a bulleted list of key points.",
    "Rewrite your previous response in a more formal tone.",
    "Rewrite your previous response in a casual, friendly tone.",
    "Is there another way to approach this? Describe it.",
    "What would be a common mistake here, and how do I avoid it?",
    "Write a short title for your answer, then a one-paragraph summary.",
    "Now make your answer about half as long.",
    "Can you double-check your answer and correct any errors?",
    "Explain the most important step again, more slowly.",
    "How would an expert critique your answer?",
    "Add a short conclusion to your answer.",
    "Write three questions I could ask to learn more about this.",
    "Put your answer in a table if that makes sense, otherwise explain why not.",
    "Thanks! What should I do next?",
    "Rewrite your previous response, starting every sentence with a different word.",
)


@dataclass
class DistillConfig:
    model: str | None = None  # hub id or directory; None = the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # the target's dtype while answering; auto: bfloat16 where faster (AVX512-BF16, AMX, a GPU)
    prompts: str = DEFAULT_PROMPTS  # a .jsonl file of prompt records
    id_field: str = "id"
    prompt_field: str = "prompt"
    source_field: str | None = "source"  # balance the order across its values; None: one seeded order
    corpus_root: str = "data/distill"  # the corpus lives in <corpus_root>/<model>-<dtype>/
    answers: int = 2000  # the corpus size this run fills up to (first and second turns), not how many to add
    second_turn_share: float = 0.2  # of those, the share that are second turns
    max_new_tokens: int = 192
    batch_size: int = 32  # prompts per generate() call (32 was fastest here: docs/experiments.md, row C1)
    # processes, each with `threads` threads: on 2 cores two 1-thread workers made more tokens than one 2-thread
    # process (docs/experiments.md, row C1)
    workers: int = 2
    threads: int = 1
    device: str = "auto"  # cuda when there is a GPU (then one worker and larger batches: --workers 1 --batch_size 256)
    shard_answers: int = 256  # answers per shard (small files, each a few minutes of a worker's work)
    seed: int = 0
    reinstruct_source: str | None = (
        None  # a source of "<instruction>\n\n<text>" prompts (or text first) sharing a few instructions
    )
    reinstructed: int = (
        0  # besides `answers`: the first N of its prompts (balanced order) asked under another of its instructions
    )
    self_prompts: int = (
        0  # besides `answers`: self-prompted answers to fill up to (first and second turns, as `answers`)
    )
    request_tokens: int = (
        192  # the longest request the target may write for itself; one it has not closed by then is dropped
    )
    request_tries: int = 4  # samples per request slot before the slot is given up (each refused sample is drawn again)

    def __post_init__(self):
        check_numbers(self)
        if self.reinstructed and not self.reinstruct_source:
            raise ConfigError("reinstructed answers need reinstruct_source: the source whose passages are asked again")
        if min(self.answers, self.reinstructed, self.self_prompts) < 0 or not 0 <= self.second_turn_share <= 1:
            raise ConfigError(
                "answers, reinstructed and self_prompts must be >= 0 and second_turn_share between 0 and 1"
            )
        for name in (
            "max_new_tokens",
            "batch_size",
            "workers",
            "threads",
            "shard_answers",
            "request_tokens",
            "request_tries",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


def corpus_dir(cfg: DistillConfig, model_name: str, dtype: torch.dtype) -> Path:
    slug = model_name.rstrip("/").split("/")[-1].lower()
    return Path(cfg.corpus_root) / f"{slug}-{inference.target.dtype_name(dtype)}"


def existing_corpus_dtype(cfg: DistillConfig, model_name: str) -> str | None:
    """The dtype of this model's corpus that holds answers already (the one with the most shards), if any."""
    shards = {
        name: len(list(corpus_dir(cfg, model_name, dtype).glob("shard-*.jsonl.gz")))
        for name, dtype in inference.target.DTYPES.items()
        if name == inference.target.dtype_name(dtype)
    }
    best = max(shards, key=shards.get)
    return best if shards[best] else None


def manifest(cfg: DistillConfig, model, tokenizer) -> dict:
    """What shapes an answer to a given prompt: answers from another model, dtype or setting are another corpus."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "target": dataclasses.asdict(TargetFingerprint.of(model)),
        "dtype": inference.target.dtype_name(model.dtype),
        "max_new_tokens": cfg.max_new_tokens,
        "decoding": "greedy",
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "prompts": Path(cfg.prompts).name,
        "follow_ups": list(FOLLOW_UPS),
        "self_prompting": {"temperature": TEMPERATURE, "top_p": TOP_P, "request_tokens": cfg.request_tokens},
    }


def read_prompts(cfg: DistillConfig) -> list[dict]:
    path = Path(cfg.prompts)
    if not path.is_file() or path.suffix != ".jsonl":
        raise ConfigError(f"prompts {path} is not a .jsonl file of prompt records")
    check_json_lines(path, path.read_text(encoding="utf-8"))
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    for field in (cfg.id_field, cfg.prompt_field) + ((cfg.source_field,) if cfg.source_field else ()):
        if field not in records[0]:
            raise ConfigError(f"{path} records have no {field!r} field (fields: {sorted(records[0])})")
    if len({r[cfg.id_field] for r in records}) != len(records):
        raise ConfigError(f"{path}: the {cfg.id_field!r} field is not unique; answers are keyed by it")
    return records


def balanced_order(records: list[dict], source_field: str | None, seed: int) -> list[dict]:
    """A seeded shuffle, then round-robin across sources: every prefix is balanced until a source runs out."""
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    return interleave(shuffled, [r[source_field] if source_field else None for r in shuffled])


def seeded_choice(key, seed: int, choices: list | tuple):
    """One of `choices`, fixed by (key, seed): the same prompt gets the same choice in every run."""
    digest = hashlib.sha256(repr((key, seed)).encode()).digest()
    return choices[int.from_bytes(digest[:4], "little") % len(choices)]


def follow_up(prompt_id, seed: int) -> str:
    return seeded_choice(prompt_id, seed, FOLLOW_UPS)


def reinstructed_prompts(prompts: list[str], seed: int) -> list[str | None]:
    """Each prompt of two paragraphs, an instruction and a text (either order), rewritten with another of the
    instructions these prompts share (a paragraph found in more than one prompt), chosen by a seeded hash, in that
    instruction's own order; None for a prompt without exactly one shared paragraph, or without another instruction."""
    paragraphs = [p.split("\n\n") for p in prompts]
    seen = Counter(part for parts in paragraphs if len(parts) == 2 for part in set(parts))
    layouts = []  # (instruction, instruction first?, text) or None
    for parts in paragraphs:
        shared = [i for i, part in enumerate(parts) if seen[part] > 1] if len(parts) == 2 else []
        layouts.append((parts[shared[0]], shared[0] == 0, parts[1 - shared[0]]) if len(shared) == 1 else None)
    templates = sorted({(layout[0], layout[1]) for layout in layouts if layout})
    rewritten = []
    for n, layout in enumerate(layouts):
        others = [t for t in templates if layout and t[0] != layout[0]]
        if not others:
            rewritten.append(None)
            continue
        instruction, first = seeded_choice(prompts[n], seed, others)
        rewritten.append(f"{instruction}\n\n{layout[2]}" if first else f"{layout[2]}\n\n{instruction}")
    return rewritten


def requests(cfg: DistillConfig, tokenizer, done: dict) -> list[dict]:
    """The answers this run writes: what the plan asks for and the corpus lacks, first turns before second turns."""
    order = balanced_order(read_prompts(cfg), cfg.source_field, cfg.seed)
    second_turns = round(cfg.answers * cfg.second_turn_share)
    wanted = []
    for r in order[: cfg.answers - second_turns]:
        if (r[cfg.id_field], 1) not in done:
            user = [{"role": "user", "content": r[cfg.prompt_field]}]
            wanted.append(
                {
                    "id": r[cfg.id_field],
                    "source": r.get(cfg.source_field),
                    "turn": 1,
                    "follow_up": None,
                    "prompt_ids": prompt_ids(tokenizer, user),
                }
            )
    # second turns follow first answers already in the corpus; the next run adds those of this run's first turns
    answered = [r for r in order if (r[cfg.id_field], 1) in done][:second_turns]
    for r in answered:
        if (r[cfg.id_field], 2) not in done:
            first = done[(r[cfg.id_field], 1)]
            request = follow_up(r[cfg.id_field], cfg.seed)
            chat = [
                {"role": "user", "content": r[cfg.prompt_field]},
                {"role": "assistant", "content": tokenizer.decode(first["answer_ids"], skip_special_tokens=True)},
                {"role": "user", "content": request},
            ]
            wanted.append(
                {
                    "id": r[cfg.id_field],
                    "source": r.get(cfg.source_field),
                    "turn": 2,
                    "follow_up": request,
                    "prompt_ids": prompt_ids(tokenizer, chat),
                }
            )
    return wanted + reinstructed_requests(cfg, order, tokenizer, done) + self_prompt_requests(cfg, tokenizer, done)


SELF_PROMPTED = "self-prompted"


def self_prompt_requests(cfg: DistillConfig, tokenizer, done: dict) -> list[dict]:
    """Slots for the self-prompted answers the corpus lacks: first turns numbered after the corpus's last one (their
    requests are sampled by the worker), then second turns after self-prompted first answers already in the corpus."""
    if not cfg.self_prompts:
        return []
    user_turn(tokenizer, [])  # a model without a chat template is refused before any work
    firsts = [r for r in done.values() if r["source"] == SELF_PROMPTED and r["turn"] == 1]
    second_turns = round(cfg.self_prompts * cfg.second_turn_share)
    after = max((int(r["id"].split("-")[1]) for r in firsts), default=-1) + 1
    new = max(0, cfg.self_prompts - second_turns - len(firsts))
    wanted = [
        {"id": f"self-{after + n:07d}", "source": SELF_PROMPTED, "turn": 1, "follow_up": None} for n in range(new)
    ]
    for first in firsts[:second_turns]:
        if (first["id"], 2) not in done:
            answer_text = tokenizer.decode(first["answer_ids"], skip_special_tokens=True)
            history = [{"role": "user", "content": first["prompt"]}, {"role": "assistant", "content": answer_text}]
            wanted.append(
                {"id": first["id"], "source": SELF_PROMPTED, "turn": 2, "follow_up": None, "history": history}
            )
    return wanted


def reinstructed_requests(cfg: DistillConfig, order: list[dict], tokenizer, done: dict) -> list[dict]:
    """The first `reinstructed` prompts of `reinstruct_source` (in the balanced order) that can be asked again, less
    those the corpus holds; each asked alone, under another of the source's instructions."""
    if not cfg.reinstructed:
        return []
    if not cfg.source_field:
        raise ConfigError("reinstruct_source needs source_field: the prompts' source is how its prompts are found")
    chosen = [r for r in order if r[cfg.source_field] == cfg.reinstruct_source]
    if not chosen:
        sources = sorted({str(r[cfg.source_field]) for r in order})
        raise ConfigError(
            f"reinstruct_source {cfg.reinstruct_source!r} is not a source of {cfg.prompts} (its sources: {sources})"
        )
    prompts = reinstructed_prompts([r[cfg.prompt_field] for r in chosen], cfg.seed)
    usable = [(r, p) for r, p in zip(chosen, prompts) if p is not None]
    if not usable:
        raise ConfigError(
            f"no prompt of source {cfg.reinstruct_source!r} is '<instruction>\\n\\n<text>' with an instruction that "
            "other prompts share: there is nothing to ask again"
        )
    wanted, source = [], f"{cfg.reinstruct_source}/reinstructed"
    for r, prompt in usable[: cfg.reinstructed]:
        key = f"{r[cfg.id_field]}/reinstructed"
        if (key, 1) not in done:
            user = [{"role": "user", "content": prompt}]
            wanted.append(
                {
                    "id": key,
                    "source": source,
                    "turn": 1,
                    "follow_up": None,
                    "prompt_of": r[cfg.id_field],
                    "prompt_ids": prompt_ids(tokenizer, user),
                }
            )
    return wanted


@torch.no_grad()
def continuations(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, **options) -> list[list[int]]:
    """What `generate` adds to each prompt of a left-padded batch (greedy unless `options` sample)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad,
        cache_implementation="static",
        **options,
    )  # the dynamic cache was erratic for batched bf16
    return out[:, width:].tolist()


class Float32Products(TorchFunctionMode):
    """Runs a bfloat16 model's linear layers as float32 products of its bfloat16 values, each output rounded back to
    bfloat16: what a native bfloat16 matrix kernel does (products accumulated in float32, the result rounded), on a
    CPU that has none. There torch's emulated bfloat16 products made answers several times slower than this, and
    agreed no better with the answers stored in the corpus (docs/experiments.md). The float32 copies of the weights
    are made once."""

    def __init__(self):
        super().__init__()
        self.weights: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear or args[0].dtype != torch.bfloat16:
            return func(*args, **kwargs)
        x, weight, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
        if weight.data_ptr() not in self.weights:
            self.weights[weight.data_ptr()] = weight.float()
        bias = None if bias is None else bias.float()
        return F.linear(x.float(), self.weights[weight.data_ptr()], bias).to(torch.bfloat16)


def emulated_bfloat16(cfg: DistillConfig) -> bool:
    return cfg.dtype == "bfloat16" and cfg.device == "cpu" and not inference.target.bfloat16_is_faster("cpu")


def load_answering_target(cfg: DistillConfig, device: str = "cpu"):
    """The target in the corpus's dtype, without load_target's warning against emulated bfloat16: its advice (use
    float32) does not apply to a bf16 corpus, and the workers run such a target through Float32Products."""
    with warnings.catch_warnings():
        if emulated_bfloat16(cfg):
            warnings.filterwarnings("ignore", message=".*bfloat16 is slower than float32")
        return inference.target.load_target(cfg.model, dtype=cfg.dtype, device=device, compile=False)


def answer(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers; each ends at (and includes) EOS when one came."""
    eos = tokenizer.eos_token_id
    rows = continuations(model, tokenizer, prompts, max_new_tokens, do_sample=False)
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def write_requests(model, tokenizer, cfg: DistillConfig, slots: list[dict], seen: RequestFilter) -> list[dict]:
    """Fills each slot's prompt with a user turn the target samples (a first request, or a second one after its own
    answer in `history`); a slot whose samples are all refused is left out. First requests must repeat nothing
    `seen`."""
    filled, todo = [], list(slots)
    for attempt in range(cfg.request_tries):
        refused = []
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]
            turns = [user_turn(tokenizer, slot.get("history", [])) for slot in batch]
            openings = [tokenizer(opening, add_special_tokens=False)["input_ids"] for opening, _ in turns]
            torch.manual_seed(
                int(
                    hashlib.sha256(repr((cfg.seed, batch[0]["id"], batch[0]["turn"], attempt)).encode()).hexdigest()[
                        :8
                    ],
                    16,
                )
            )
            stops = sorted({close for _, close in turns} | {tokenizer.eos_token_id})
            rows = continuations(
                model,
                tokenizer,
                openings,
                cfg.request_tokens,
                do_sample=True,
                temperature=TEMPERATURE,
                top_p=TOP_P,
                top_k=0,
                eos_token_id=stops,
            )
            for slot, row, (_, close) in zip(batch, rows, turns):
                text = request_text(tokenizer, row, close)
                if slot["turn"] == 1:
                    reason = seen.reason(text)
                else:  # a second turn may say what many second turns say ("Thanks! Can you explain more?")
                    reason = RequestFilter().reason(text)
                if reason:
                    refused.append(slot)
                    continue
                if slot["turn"] == 1:
                    seen.add(text)
                    slot["prompt"] = text
                    slot["prompt_ids"] = prompt_ids(tokenizer, [{"role": "user", "content": text}])
                else:
                    slot["follow_up"] = text
                    slot["prompt_ids"] = prompt_ids(
                        tokenizer, slot.pop("history") + [{"role": "user", "content": text}]
                    )
                filled.append(slot)
        todo = refused
    order = {id(slot): n for n, slot in enumerate(slots)}
    return sorted(filled, key=lambda slot: order[id(slot)])


def self_prompted_requests(directory: Path, names: set) -> list[str]:
    """The first requests of self-prompted records in the shards not in `names` (which is extended with theirs)."""
    texts = []
    for path in sorted(directory.glob("shard-*.jsonl.gz")):
        if path.name not in names:
            names.add(path.name)
            texts += [r["prompt"] for r in read_corpus_shard(path) if r["source"] == SELF_PROMPTED and r["turn"] == 1]
    return texts


def worker(rank: int, cfg: DistillConfig, jobs: list[tuple[Path, list[dict]]]) -> None:
    """Answers each job's requests (batches of similar prompt length) and writes them as the job's shard."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        with Float32Products() if emulated_bfloat16(cfg) else contextlib.nullcontext():
            answer_jobs(rank, cfg, jobs)
    finally:  # a worker run in the caller's process (workers=1) leaves its thread count as it was
        torch.set_num_threads(threads)


def answer_jobs(rank: int, cfg: DistillConfig, jobs: list[tuple[Path, list[dict]]]) -> None:
    model, tokenizer = load_answering_target(cfg, cfg.device)
    bar = tqdm(
        total=sum(len(j) for _, j in jobs), desc=f"worker {rank}", position=rank, unit="answer", dynamic_ncols=True
    )
    parent = os.getppid()
    seen, read = RequestFilter(), set()
    for path, chunk in jobs:
        ready, slots = [r for r in chunk if "prompt_ids" in r], [r for r in chunk if "prompt_ids" not in r]
        if slots:
            for text in self_prompted_requests(path.parent, read):
                seen.add(text)
            bar.set_postfix_str(f"the target writes {len(slots)} requests first")  # minutes with no answer done
            written = write_requests(model, tokenizer, cfg, slots, seen)
            bar.set_postfix_str("")
            bar.update(len(slots) - len(written))
            chunk = ready + written
        by_length = sorted(chunk, key=lambda r: len(r["prompt_ids"]))
        for start in range(0, len(by_length), cfg.batch_size):
            if os.getppid() != parent:  # the command was killed: an orphaned worker must not go on writing shards
                return
            batch = by_length[start : start + cfg.batch_size]
            for request, ids in zip(
                batch, answer(model, tokenizer, [r["prompt_ids"] for r in batch], cfg.max_new_tokens)
            ):
                request["answer_ids"] = ids
            bar.update(len(batch))
        with open(path.parent / "corpus.lock", "w") as lock:  # another worker's requests, written meanwhile, came first
            fcntl.flock(lock, fcntl.LOCK_EX)
            others = RequestFilter()
            for text in self_prompted_requests(path.parent, read):
                others.add(text)
                seen.add(text)
            chunk = [
                r for r in chunk if r["source"] != SELF_PROMPTED or r["turn"] != 1 or not others.reason(r["prompt"])
            ]
            write_shard(path, chunk)  # in the plan's order (the answers were filled in place): a prefix stays balanced
            read.add(path.name)
    bar.close()


def distill(cfg: DistillConfig) -> Path:
    """Fills the corpus up to cfg.answers; returns its folder."""
    if cfg.device == "auto":  # resolved once, for every worker
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    asked = cfg.dtype
    cfg.dtype = inference.target.dtype_name(inference.target.as_dtype(cfg.dtype, cfg.device))
    model, tokenizer = load_answering_target(cfg)
    directory = corpus_dir(cfg, str(model.config._name_or_path), model.dtype)
    grown = existing_corpus_dtype(cfg, str(model.config._name_or_path)) if asked == "auto" else None
    if grown is not None and grown != cfg.dtype and not any(directory.glob("shard-*.jsonl.gz")):
        # "auto" differs between machines (bfloat16 is emulated on some CPUs): grow the corpus there is
        print(
            f"dtype auto: growing the {grown} corpus that exists instead of starting a {cfg.dtype} one "
            f"(--dtype {cfg.dtype} starts it)",
            file=sys.stderr,
        )
        cfg.dtype = grown
        model, tokenizer = load_answering_target(cfg)
        directory = corpus_dir(cfg, str(model.config._name_or_path), model.dtype)
    check_manifest(directory, manifest(cfg, model, tokenizer))
    del model
    if emulated_bfloat16(cfg):
        print(
            "bfloat16 is emulated on this CPU: the workers run the target's linear layers as float32 products rounded "
            "to bfloat16, as native bfloat16 kernels do (much faster than emulated bfloat16)",
            file=sys.stderr,
        )
    done = {(r["id"], r["turn"]): r for r in read_corpus(directory)}
    todo = requests(cfg, tokenizer, done)
    extra = f" and {cfg.reinstructed} reinstructed" if cfg.reinstructed else ""
    print(
        f"{directory}: {len(done)} answers, {len(todo)} to write (filling up to {cfg.answers}{extra})", file=sys.stderr
    )
    if not todo:
        return directory
    shards = sorted(directory.glob("shard-*.jsonl.gz"))
    first = int(shards[-1].name.split("-")[1].split(".")[0]) + 1 if shards else 0
    chunks = [todo[i : i + cfg.shard_answers] for i in range(0, len(todo), cfg.shard_answers)]
    jobs = [(directory / f"shard-{first + n:05d}.jsonl.gz", chunk) for n, chunk in enumerate(chunks)]
    began = time.perf_counter()
    if cfg.workers == 1:
        worker(0, cfg, jobs)
    else:
        spawn = multiprocessing.get_context("spawn")  # fresh processes: fork would share torch's thread pools
        processes = [
            spawn.Process(target=worker, args=(rank, cfg, jobs[rank :: cfg.workers])) for rank in range(cfg.workers)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        failed = [p.exitcode for p in processes if p.exitcode != 0]
        if failed:
            raise RuntimeError(
                f"{len(failed)} worker(s) failed (exit codes {failed}); rerun to resume: finished shards are kept"
            )
    written = read_corpus(directory)
    tokens = sum(len(r["answer_ids"]) for r in written) - sum(len(r["answer_ids"]) for r in done.values())
    seconds = time.perf_counter() - began
    print(
        f"{directory}: {len(written)} answers ({len(written) - len(done)} new, {tokens} tokens in {seconds / 60:.1f} "
        f"min, {tokens / seconds:.0f} tokens/s)",
        file=sys.stderr,
    )
    return directory


def load_distill_config(arguments: list[str]) -> DistillConfig:
    values: dict = {}
    if arguments[:1] == ["--config"]:
        path = Path(arguments[1])
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        values = yaml.safe_load(path.read_text()) or {}
        arguments = arguments[2:]
    for key, value in parse_overrides(arguments):
        values[key] = value
    return dataclass_from_dict(DistillConfig, values, "distill")


def main(argv=None) -> None:
    arguments = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(arguments):
        print(f"usage: python -m training.distill [--config FILE.yaml] [--key value ...]\n{__doc__}")
        print("settings (--key value, or the same keys in a YAML file given first with --config), defaults:")
        for setting in dataclasses.fields(DistillConfig):
            print(f"  --{setting.name} {getattr(DistillConfig, setting.name, None)!r}")
        return
    distill(load_distill_config(arguments))


if __name__ == "__main__":
    from inference.cli import run

    run(main, "python -m training.distill")
