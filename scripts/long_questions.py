"""Long-context questions in Spec-Bench's format: news articles of a questions file's summarization category packed
into one prompt of about N tokens, then one request about them.

    python scripts/long_questions.py --questions ../shared/data/eval/dev.jsonl --tokens 1024 2048 4096 8000 \\
        --per-length 3 --out /tmp/long.jsonl
    python scripts/benchmark.py --questions /tmp/long.jsonl --methods plain eagle-default --dtype float32 ...

Each question's category is `long-<N>`, so the benchmark reports each length on its own row. The requests rotate
(summarise them all, the last one, what they have in common), so that the answer is not always a summary of one
text. The output is derived from the questions file: write it outside the repository, like the file itself.
"""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from common import chat_prompt, parser, positive, read_questions
from inference.target import default_model_dir

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
    questions, start = [], 0
    for length in lengths:
        for index in range(per_length):
            request = REQUESTS[len(questions) % len(REQUESTS)]
            packed: list[str] = []
            while len(packed) < len(texts):
                candidate = packed + [texts[(start + len(packed)) % len(texts)]]
                turn = _turn(candidate, request)
                if packed and chat_prompt(tokenizer, [turn]).shape[0] > length:
                    break
                packed = candidate
            start = (start + len(packed)) % len(texts)
            turn = _turn(packed, request)
            tokens = chat_prompt(tokenizer, [turn]).shape[0]
            questions.append(
                {
                    "question_id": f"long-{length}-{index}",
                    "category": f"long-{length}",
                    "turns": [turn],
                    "prompt_tokens": tokens,
                }
            )
    return questions


def _turn(texts: list[str], request: str) -> str:
    body = "\n\n".join(f"Article {number}: {text}" for number, text in enumerate(texts, 1))
    return f"Here are {len(texts)} news articles.\n\n{body}\n\n{request}"


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--questions", required=True, help="a Spec-Bench questions file with summarization questions")
    p.add_argument("--model", help="whose tokenizer counts tokens (default: the embedded target)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8000], help="prompt lengths, at most")
    p.add_argument("--per-length", type=positive, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if min(args.tokens) < 64:
        p.error(f"every --tokens must be at least 64 (a chat template and a request), got {min(args.tokens)}")
    tokenizer = AutoTokenizer.from_pretrained(args.model or default_model_dir())
    questions = long_questions(articles(read_questions(args.questions)), tokenizer, args.tokens, args.per_length)
    with open(args.out, "w", encoding="utf-8") as out:
        for question in questions:
            out.write(json.dumps(question) + "\n")
    sizes = ", ".join(f"{q['category']}: {q['prompt_tokens']}" for q in questions)
    print(f"wrote {len(questions)} questions to {args.out} (prompt tokens {sizes})")


if __name__ == "__main__":
    main()
