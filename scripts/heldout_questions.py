"""The prompts a training recipe held out, as benchmark questions: choose a tree shape on them, not on the dev set.

    python scripts/heldout_questions.py --config configs/smollm2-135m-instruct-medusa-sequential.yaml \\
        --out /tmp/heldout.jsonl
    python scripts/benchmark.py --questions /tmp/heldout.jsonl --methods medusa --medusa checkpoints/... --top-k 4 ...

A corpus recipe (`data.corpus`) trains on none of its first `data.eval_prompts` conversations (its held-out
top-1 is measured on them); the corpus interleaves prompt sources, so they are balanced. This writes them in
Spec-Bench's question format, the category being the prompt's source, the turns its prompt and follow-up.

A recipe that leaves whole prompt sources out of training (`data.exclude_sources`, a leave-one-source-out check)
holds all of their prompts out: `--source NAME --count N` writes that source's first N conversations.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import parser
from training.config import load_config
from training.corpus import read_corpus
from training.data import held_out_ids


def heldout_questions(
    prompts_path: str | Path, corpus: str | Path, count: int, source: str | None = None
) -> list[dict]:
    """Spec-Bench questions of the corpus's first `count` conversations (of `source` only, when given), in corpus
    order."""
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
    with open(prompts_path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                item = json.loads(line)
                if item["id"] in held_out:
                    prompts[item["id"]] = item["prompt"]
    questions = []
    for record in firsts:
        if record["id"] not in held_out:
            continue
        prompt = record.get("prompt") or prompts.get(record["id"])  # a self-prompted request keeps its own text
        if prompt is None:
            raise SystemExit(
                f"prompt {record['id']} of {corpus} is not in {prompts_path}: the corpus was distilled from another "
                "prompt file"
            )
        turns = [prompt] + ([record["follow_up"]] if record["follow_up"] else [])
        questions.append({"question_id": record["id"], "category": record["source"], "turns": turns})
    return questions


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--config", required=True, help="a training recipe with data.corpus")
    p.add_argument("--out", required=True, help="the questions file to write (.jsonl)")
    p.add_argument("--source", help="a source the recipe leaves out of training (data.exclude_sources)")
    p.add_argument("--count", type=int, help="conversations to write (default: the recipe's data.eval_prompts)")
    args, overrides = p.parse_known_args(argv)  # --data.key value, as training takes them
    data = load_config(args.config, overrides).data
    if not data.corpus:
        raise SystemExit(f"{args.config} trains without a corpus (data.corpus is empty): it holds no prompts out")
    if args.source is not None and args.source not in data.exclude_sources:
        raise SystemExit(
            f"{args.config} trains on source {args.source!r} (data.exclude_sources: {data.exclude_sources}): its "
            "prompts are not held out"
        )
    questions = heldout_questions(data.path, data.corpus, args.count or data.eval_prompts, args.source)
    Path(args.out).write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    print(f"{len(questions)} held-out prompts of {data.corpus} written to {args.out}")


if __name__ == "__main__":
    main()
