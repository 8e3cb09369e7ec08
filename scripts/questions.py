"""Question files in Spec-Bench's format for `scripts/benchmark.py --questions`: the prompts a training recipe held out,
task types nothing was tuned to, or long contexts.

    python scripts/questions.py heldout --config configs/smollm2-135m-instruct-eagle-corpus.yaml \\
        --out /tmp/heldout.jsonl
    python scripts/questions.py unseen --per-category 6 --out /tmp/unseen.jsonl
    python scripts/questions.py long --tokens 1024 8000 --per-length 3 --out /tmp/long.jsonl
    python scripts/benchmark.py --questions /tmp/unseen.jsonl --methods eagle --eagle checkpoints/... --dtype float32

heldout: the first `data.eval_prompts` conversations of a corpus recipe, which it trains on none of (choose a tree
shape on them, not on dev), or with `--source NAME --count N` a source it leaves out. unseen: nine task types neither
training nor dev holds, over the standard library's module docstrings (the same file every run). long: summarization
articles packed into one prompt of about N tokens, then a request. docs/training.md has more.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from pathlib import Path

from common import DEFAULT_QUESTIONS, chat_prompt, parser, positive, read_questions


def heldout_questions(prompts_path, corpus, count: int, source: str | None = None) -> list[dict]:
    """The corpus's first `count` conversations (of `source` only, when given), in corpus order."""
    from training.corpus import read_corpus
    from training.data import held_out_ids

    firsts = [r for r in read_corpus(corpus) if r["turn"] == 1]
    if not firsts:
        raise SystemExit(f"{corpus} holds no answers: nothing was held out")
    if source is None:
        held_out = held_out_ids(firsts, count)
    else:
        held_out = {r["id"] for r in [r for r in firsts if r["source"] == source and "prompt_of" not in r][:count]}
        if not held_out:
            raise SystemExit(f"{corpus} holds no conversation of source {source!r}")
    prompts = {}
    for line in Path(prompts_path).read_text(encoding="utf-8").split("\n"):  # not splitlines(): prompts hold U+2028
        if line.strip() and (item := json.loads(line))["id"] in held_out:
            prompts[item["id"]] = item["prompt"]
    questions = []
    for record in (r for r in firsts if r["id"] in held_out):
        prompt = record.get("prompt") or prompts.get(record["id"])  # a self-prompted request keeps its own text
        if prompt is None:
            raise SystemExit(
                f"prompt {record['id']} of {corpus} is not in {prompts_path}: the corpus was distilled from another "
                "prompt file"
            )
        turns = [prompt] + ([record["follow_up"]] if record["follow_up"] else [])
        questions.append({"question_id": record["id"], "category": record["source"], "turns": turns})
    return questions


def heldout(args, overrides: list[str]) -> list[dict]:
    from training.config import load_config

    data = load_config(args.config, overrides).data
    if not data.corpus:
        raise SystemExit(f"{args.config} trains without a corpus (data.corpus is empty): it holds no prompts out")
    if args.source is not None and args.source not in data.exclude_sources:
        raise SystemExit(
            f"{args.config} trains on source {args.source!r} (data.exclude_sources: {data.exclude_sources}): its "
            "prompts are not held out"
        )
    return heldout_questions(data.path, data.corpus, args.count or data.eval_prompts, args.source)


# unseen: the modules whose docstrings the questions quote, listed so that every Python writes the same file
MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "email",
    "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http", "imaplib", "inspect", "io", "ipaddress",
    "itertools", "json", "keyword", "linecache", "locale", "logging", "mailbox", "mimetypes", "netrc", "numbers",
    "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint",
    "profile", "pstats", "pydoc", "queue", "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "site", "smtplib", "socket", "sqlite3", "stat",
    "statistics", "string", "struct", "subprocess", "symtable", "tabnanny", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "token", "tokenize", "trace", "traceback", "tracemalloc", "typing", "unittest", "urllib",
    "uuid", "warnings", "wave", "weakref", "xml", "zipapp", "zipfile", "zipimport", "zoneinfo",
)  # fmt: skip
TOPICS = ("networking", "files and data formats", "text processing", "mathematics", "concurrency", "debugging")
CATEGORIES = {
    "to-json": 'Turn the following description into a JSON object with the keys "name", "purpose" and '
    '"main_features" (a list). Answer with the JSON only.\n\n{text}',
    "fix-typos": "Correct the spelling mistakes in the following text and return the corrected text only.\n\n{text}",
    "topic-label": "Which of these topics fits the following text best: " + ", ".join(TOPICS) + "? Answer with the "
    "topic, then explain your choice in two sentences.\n\n{text}",
    "email": "Write a short email to a colleague who has never used the Python module described below, telling them "
    "what it is good for and suggesting they try it.\n\n{text}",
    "quiz": "Write three multiple-choice questions, each with four options and the correct answer marked, that test "
    "whether someone understood the following text.\n\n{text}",
    "short-post": "Rewrite the following text as a social media post of under 280 characters.\n\n{text}",
    # Spec-Bench's translation, retrieval-augmented QA and closed-book QA have no counterpart in dev either
    "translate": "Translate the following text into French.\n\n{text}",
    "passage-qa": "Answer the question using only the text below.\n\nText: {text}\n\nQuestion: What is the {module} "
    "module for, and what does it provide?",
    "closed-qa": "What is Python's {module} module for? Answer in a few sentences, without code.",
}
MIN_CHARS, MAX_CHARS = 200, 900


def docstrings() -> list[tuple[str, str]]:
    """(module, its docstring: whitespace tidied, cut at a paragraph end near MAX_CHARS) for each module whose
    docstring is long enough."""
    found = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:  # removed from a later Python: the list is the same, fewer texts
            continue
        text = re.sub(r"[ \t]+", " ", (module.__doc__ or "").strip())
        if len(text) > MAX_CHARS:
            cut = text.rfind("\n\n", 0, MAX_CHARS)
            text = text[: cut if cut >= MIN_CHARS else MAX_CHARS].strip()
        if len(text) >= MIN_CHARS:
            found.append((name, text))
    return found


def with_typos(text: str, rng: random.Random, share: float = 0.08) -> str:
    """`text` with `share` of its longer words (one at least) misspelt: two neighbouring letters swapped, so that each
    misspelt word differs from the original."""
    words = [m for m in re.finditer(r"[A-Za-z]{5,}", text) if len(set(m.group(0)[1:-1])) > 1]
    chosen = sorted(rng.sample(words, max(1, round(share * len(words)))), key=lambda m: m.start())
    pieces, end = [], 0
    for match in chosen:
        word = match.group(0)
        at = rng.choice([i for i in range(1, len(word) - 2) if word[i] != word[i + 1]])
        pieces += [text[end : match.start()], word[:at] + word[at + 1] + word[at] + word[at + 2 :]]
        end = match.end()
    return "".join(pieces) + text[end:]


def unseen_questions(per_category: int, seed: int = 0) -> list[dict]:
    """`per_category` questions a category, each over another module's docstring (drawn without replacement)."""
    texts = docstrings()
    if per_category * len(CATEGORIES) > len(texts):
        raise SystemExit(
            f"only {len(texts)} docstrings are long enough: ask for at most {len(texts) // len(CATEGORIES)} a category"
        )
    rng = random.Random(seed)
    rng.shuffle(texts)
    questions = []
    for index, (category, request) in enumerate(CATEGORIES.items()):
        for number, (module, text) in enumerate(texts[index * per_category : (index + 1) * per_category]):
            text = with_typos(text, rng) if category == "fix-typos" else text
            turn = request.format(text=text, module=module)
            questions.append({"question_id": f"{category}-{number}-{module}", "category": category, "turns": [turn]})
    return questions


ARTICLE = "Article: "
REQUESTS = (
    "Summarize the articles above in a few sentences.",
    "Summarize the last article above in a few sentences.",
    "List the main point of each article above, one line each.",
    "What do the articles above have in common? Answer in a short paragraph.",
)


def articles(questions: list[dict]) -> list[str]:
    """The article text of every summarization question (its first turn after 'Article: ')."""
    found = [q["turns"][0].split(ARTICLE, 1)[1].strip() for q in questions if ARTICLE in q["turns"][0]]
    if not found:
        raise SystemExit("the questions file has no summarization questions with 'Article: ' in their first turn")
    return found


def long_questions(texts: list[str], tokenizer, lengths: list[int], per_length: int) -> list[dict]:
    """per_length questions of each length: consecutive articles (wrapping around the list, each question starting
    where the last one stopped) until the prompt would pass the length, then a request."""

    def turn(packed: list[str], request: str) -> str:
        body = "\n\n".join(f"Article {number}: {text}" for number, text in enumerate(packed, 1))
        return f"Here are {len(packed)} news articles.\n\n{body}\n\n{request}"

    questions, start = [], 0
    for length in lengths:
        for index in range(per_length):
            request, packed = REQUESTS[len(questions) % len(REQUESTS)], []
            while len(packed) < len(texts):
                candidate = packed + [texts[(start + len(packed)) % len(texts)]]
                if packed and chat_prompt(tokenizer, [turn(candidate, request)]).shape[0] > length:
                    break
                packed = candidate
            start = (start + len(packed)) % len(texts)
            text = turn(packed, request)
            tokens = chat_prompt(tokenizer, [text]).shape[0]
            question = {"question_id": f"long-{length}-{index}", "category": f"long-{length}", "turns": [text]}
            questions.append({**question, "prompt_tokens": tokens})
    return questions


def long(args) -> list[dict]:
    from transformers import AutoTokenizer

    from inference.target import default_model_dir

    if min(args.tokens) < 64:
        raise SystemExit(f"every --tokens must be at least 64 (a chat template and a request), got {min(args.tokens)}")
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())  # the embedded target's, which counts the tokens
    return long_questions(articles(read_questions(args.questions)), tokenizer, args.tokens, args.per_length)


def main(argv=None) -> None:
    p = parser(__doc__)
    kinds = p.add_subparsers(dest="kind", required=True)
    held = kinds.add_parser("heldout", help="the prompts a training recipe held out")
    held.add_argument("--config", required=True, help="a training recipe with data.corpus")
    held.add_argument("--source", help="a source the recipe leaves out of training (data.exclude_sources)")
    held.add_argument("--count", type=positive, help="conversations to write (default: the recipe's data.eval_prompts)")
    unseen = kinds.add_parser("unseen", help="task types neither training nor dev holds")
    unseen.add_argument("--per-category", type=positive, default=6, help="questions a category (default 6)")
    packed = kinds.add_parser("long", help="articles packed into prompts of about N tokens")
    packed.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="a file with summarization questions")
    packed.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8000], help="prompt lengths")
    packed.add_argument("--per-length", type=positive, default=3)
    for kind in (held, unseen, packed):
        kind.add_argument("--out", required=True, help="the questions file to write (.jsonl)")
    args, overrides = p.parse_known_args(argv)
    if overrides and args.kind != "heldout":
        p.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.kind == "heldout":
        questions = heldout(args, overrides)
    else:
        questions = unseen_questions(args.per_category) if args.kind == "unseen" else long(args)
    Path(args.out).write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    print(f"{len(questions)} {args.kind} questions in {len({q['category'] for q in questions})} categories: {args.out}")


if __name__ == "__main__":
    main()
