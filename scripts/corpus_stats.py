"""How varied a distilled corpus's requests are, per source: distinct n-grams, lengths, most common openings.

    python scripts/corpus_stats.py --out docs/results/corpus-diversity

Reads the first turns of `data/distill/<target>-<dtype>/` (training.corpus.read_corpus): a prompt-file record's
request is the prompt file's text for its id (or its passage asked again), a self-prompted record's is the text
the target wrote (`prompt`). Writes OUT.md (a table a source) and OUT.png (request lengths in words, a curve a
source). Distinct n-grams are the share of a source's n-grams that occur once or more, counted over an equal
sample of requests from every source (the smallest source's size), so that sources of different sizes compare.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.config import DEFAULT_PROMPTS  # noqa: E402
from training.corpus import read_corpus  # noqa: E402
from training.self_prompt import normalized_words  # noqa: E402

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "data" / "distill" / "smollm2-135m-instruct-bfloat16"
LENGTH_BINS = (0, 10, 20, 40, 80, 160, 320, 640, 10**9)  # words


def requests_by_source(corpus: Path, prompts: Path) -> dict[str, list[str]]:
    """Each source's first-turn request texts, in corpus order."""
    texts = {}
    for line in prompts.read_text(encoding="utf-8").split("\n"):  # not splitlines: texts hold U+2028
        if line.strip():
            record = json.loads(line)
            texts[record["id"]] = record["prompt"]
    by_source: dict[str, list[str]] = {}
    for record in read_corpus(corpus):
        if record["turn"] != 1:
            continue
        if "prompt" in record:
            text = record["prompt"]
        elif "prompt_of" in record:  # a passage asked again: its own text is only in the token ids
            continue
        else:
            text = texts[record["id"]]
        by_source.setdefault(record["source"], []).append(text)
    return by_source


def distinct(requests: list[str], n: int) -> float:
    """Distinct n-grams over all n-grams of `requests` (words, lower case)."""
    grams = Counter()
    for text in requests:
        words = normalized_words(text)
        grams.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return len(grams) / max(sum(grams.values()), 1)


def length_shares(requests: list[str]) -> list[float]:
    lengths = [len(normalized_words(text)) for text in requests]
    counts = [sum(low <= n < high for n in lengths) for low, high in zip(LENGTH_BINS, LENGTH_BINS[1:])]
    return [c / max(len(lengths), 1) for c in counts]


def openings(requests: list[str], top: int = 3) -> str:
    first = Counter(" ".join(normalized_words(text)[:3]) for text in requests)
    return "; ".join(f'"{words}" {count / len(requests):.0%}' for words, count in first.most_common(top))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="the prompt file the corpus's ids refer to")
    parser.add_argument("--out", required=True, help="writes OUT.md and OUT.png")
    args = parser.parse_args(argv)
    by_source = requests_by_source(Path(args.corpus), Path(args.prompts))
    if not by_source:
        raise SystemExit(f"{args.corpus} holds no first turns")
    sample = min(len(texts) for texts in by_source.values())
    rng = random.Random(0)
    rows = []
    for source, texts in sorted(by_source.items()):
        picked = rng.sample(texts, sample)
        words = sorted(len(normalized_words(text)) for text in texts)
        rows.append(
            f"| {source} | {len(texts):,} | {distinct(picked, 1):.3f} | {distinct(picked, 2):.3f} | "
            f"{distinct(picked, 3):.3f} | {words[len(words) // 2]} | {words[len(words) * 9 // 10]} | "
            f"{openings(texts)} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(
        f"Command: `python scripts/corpus_stats.py --out {args.out}`  \n"
        f"First-turn requests of {Path(args.corpus).name}; distinct n-grams over {sample:,} requests a source "
        "(the smallest source's count, sampled with seed 0); lengths in words.\n\n"
        "| source | requests | distinct 1-grams | distinct 2-grams | distinct 3-grams | median length | "
        "90th percentile | most common openings |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    labels = [f"{low}-{high - 1}" if high < 10**9 else f"{low}+" for low, high in zip(LENGTH_BINS, LENGTH_BINS[1:])]
    for source, texts in sorted(by_source.items()):
        axis.plot(labels, length_shares(texts), marker="o", label=f"{source} ({len(texts):,})")
    axis.set_xlabel("request length (words)")
    axis.set_ylabel("share of the source's requests")
    axis.set_title("How long the corpus's first-turn requests are, by source")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
