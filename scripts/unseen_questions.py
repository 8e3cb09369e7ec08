"""Questions of task types that neither the training prompts nor the dev set hold, in Spec-Bench's format: a check
of how heads generalise that nothing was tuned to.

    python scripts/unseen_questions.py --per-category 6 --out /tmp/unseen.jsonl
    python scripts/benchmark.py --questions /tmp/unseen.jsonl --methods eagle --eagle checkpoints/... \\
        --tree fixed --depth 10 --top-k 8 --nodes 15 --no-fallback --dtype float32

The text comes from what every Python installation carries, the module docstrings of the standard library (no
download, the same on every machine of one Python version); each category puts it under another kind of request:
turning it into JSON, correcting a copy with typos put in, labelling its topic, an email about it, a quiz on it,
and a post of under 280 characters. The training prompts are maths problems, code tasks, documents to summarise or
extract from, role-play and self-instruct or self-written requests; dev is MT-bench, translation, summarisation,
question answering, maths and retrieval. Each question has one turn. Seeded: the same file every run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import re
from pathlib import Path

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
        text = (module.__doc__ or "").strip()
        text = re.sub(r"[ \t]+", " ", text)
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
            if category == "fix-typos":
                text = with_typos(text, rng)
            questions.append(
                {
                    "question_id": f"{category}-{number}-{module}",
                    "category": category,
                    "turns": [request.format(text=text)],
                }
            )
    return questions


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=6, help="questions a category (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="the questions file to write (.jsonl)")
    args = parser.parse_args(argv)
    questions = unseen_questions(args.per_category, args.seed)
    Path(args.out).write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    print(f"{len(questions)} questions in {len(CATEGORIES)} categories written to {args.out}")


if __name__ == "__main__":
    main()
