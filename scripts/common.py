"""Helpers the scripts share: reading Spec-Bench questions and building chat prompts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "dev.jsonl"


def read_questions(path: str | Path, limit: int | None = None) -> list[dict]:
    """Spec-Bench's question format: one JSON object a line with question_id, category and turns."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"question file {path} not found; pass --questions FILE.jsonl")
    questions = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not isinstance(item.get("turns"), list) or not item["turns"]:
            raise SystemExit(f"{path}:{number}: expected a non-empty 'turns' list (Spec-Bench format)")
        questions.append(item)
        if limit is not None and len(questions) >= limit:
            break
    return questions


def chat_prompt(tokenizer, turns: list[str], answers: list[str] = ()) -> torch.Tensor:
    """Token ids of a conversation ending with the assistant's turn to speak."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)
