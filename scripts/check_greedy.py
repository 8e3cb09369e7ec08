"""Is a recorded benchmark run the target's own greedy output? One teacher-forced pass a turn, no baseline rerun.

    python scripts/check_greedy.py docs/results/dev-all-eagle-corpus2800-fp32-epyc.json

For every turn and method of a `scripts/benchmark.py` record (its .json), the target runs once over the prompt, rebuilt
as the benchmark built it, and the answer: every answer token must be its argmax, and the answer must stop where greedy
stops (the first EOS, or max_new_tokens). Run it in the record's dtype (float32 for an exactness claim). A
teacher-forced pass rounds unlike one-token passes, so each mismatch comes with its logit gap (~1e-5 in float32 is
rounding), beside the smallest top-two gap along all answers. Exits 1 when any turn fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from common import chat_prompt, eos_ids, load, parser, read_questions, table


@torch.inference_mode()
def check_answer(model, prompt: torch.Tensor, answer: list[int], eos: set[int], max_new_tokens: int) -> dict:
    """The positions where the answer is not the argmax (with the gap to the top logit), the smallest top-two gap on
    the path, and whether the answer stops where greedy would."""
    if not answer:
        return {"mismatches": [], "min_gap": None, "stops_right": max_new_tokens == 0}
    ids = torch.cat([prompt, torch.tensor(answer, dtype=torch.long)]).to(model.device)
    # the last len(answer) + 1 positions' logits; the first len(answer) of them predict the answer's tokens
    logits = model(ids[None], logits_to_keep=len(answer) + 1).logits[0, :-1].float()
    top2 = logits.topk(2, dim=-1)
    chosen = torch.tensor(answer, device=logits.device)
    wrong = (top2.indices[:, 0] != chosen).nonzero().flatten().tolist()
    mismatches = [{"position": p, "gap": float(top2.values[p, 0] - logits[p, answer[p]])} for p in wrong]
    stops_right = not any(t in eos for t in answer[:-1]) and (answer[-1] in eos or len(answer) == max_new_tokens)
    gaps = top2.values[:, 0] - top2.values[:, 1]
    return {"mismatches": mismatches, "min_gap": float(gaps.min()), "stops_right": stops_right}


def check_run(model, tokenizer, run: dict, questions: list[dict]) -> dict:
    """Per method: turns, tokens, turns with a mismatch or a wrong stop, and the smallest top-two gap."""
    methods, max_new_tokens, eos = run["args"]["methods"], run["args"]["max_new_tokens"], eos_ids(model)
    by_id = {q["question_id"]: q for q in questions}
    report = {m: {"turns": 0, "tokens": 0, "wrong_turns": [], "min_gap": float("inf")} for m in methods}
    answers: list[str] = []
    for record in tqdm(run["records"], desc="turns"):
        question = by_id.get(record["question_id"])
        if question is None:
            raise SystemExit(f"question {record['question_id']} is not in the questions: pass the run's --questions")
        if record["turn"] == 0:
            answers = []
        prompt = chat_prompt(tokenizer, question["turns"][: record["turn"] + 1], answers)
        for method in methods:
            answer = record["tokens"][method]
            result = check_answer(model, prompt, answer, eos, max_new_tokens)
            entry = report[method]
            entry["turns"] += 1
            entry["tokens"] += len(answer)
            if result["min_gap"] is not None:
                entry["min_gap"] = min(entry["min_gap"], result["min_gap"])
            if result["mismatches"] or not result["stops_right"]:
                entry["wrong_turns"].append({"question_id": record["question_id"], "turn": record["turn"], **result})
        answers.append(tokenizer.decode(record["tokens"][methods[0]], skip_special_tokens=True))  # as benchmark.py did
    return report


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("record", help="a benchmark run's .json (scripts/benchmark.py --out)")
    p.add_argument("--questions", help="the question file the run used (default: the one it recorded)")
    p.add_argument("--dtype", help="default: the dtype the run recorded")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    path = Path(args.record)
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass the .json a benchmark run wrote with --out")
    run = json.loads(path.read_text())
    if not isinstance(run, dict) or "records" not in run or "args" not in run:
        raise SystemExit(f"{path} is not a benchmark record with answers (no 'args' and 'records'; not --batch-sizes)")
    recorded = run["args"]
    dtype = args.dtype or recorded.get("dtype", "float32")
    model, tokenizer = load(recorded.get("model"), dtype=dtype, device=args.device, compile=False)
    report = check_run(model, tokenizer, run, read_questions(args.questions or recorded["questions"]))
    rows = [[m, e["turns"], e["tokens"], len(e["wrong_turns"]), f"{e['min_gap']:.3g}"] for m, e in report.items()]
    print(
        table(["method", "turns", "tokens", "turns not the target's greedy output", "smallest top-two logit gap"], rows)
    )
    wrong = {m: e["wrong_turns"] for m, e in report.items() if e["wrong_turns"]}
    if wrong:
        print(json.dumps(wrong, indent=1))
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    from inference.cli import run

    run(main, "check_greedy.py")
