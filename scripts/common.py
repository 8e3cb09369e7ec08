"""What the measurement scripts share: questions and prompts, the target and its heads, HF's greedy baseline, methods
timed in turn on the same input, the exactness check at near-ties, the results' header, tables and files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the scripts run without installing the project: they import this module first

from heads import load_heads  # noqa: E402
from inference import generate, load_target  # noqa: E402
from inference.calibrate import device_name  # noqa: E402
from inference.numerics import NEAR_TIE_STEPS, near_tie  # noqa: E402

DEFAULT_QUESTIONS = REPO.parent / "shared" / "data" / "eval" / "dev.jsonl"
SHIPPED_EAGLE = REPO / "checkpoints" / "smollm2-135m-instruct-eagle"  # found from any working directory
SHIPPED_EAGLE3 = REPO / "checkpoints" / "smollm2-135m-instruct-eagle3"  # EAGLE-3's layout, for vLLM


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


def pick(questions: list[dict], per_category: int | None, limit: int | None, shard=None) -> list[dict]:
    """The first `per_category` questions of each category, the first `limit` of those, then shard (K, N)'s."""
    if per_category:
        count, chosen = defaultdict(int), []
        for question in questions:
            count[question["category"]] += 1
            if count[question["category"]] <= per_category:
                chosen.append(question)
        questions = chosen
    questions = questions[:limit] if limit else questions
    return questions[shard[0] :: shard[1]] if shard else questions


def chat_prompt(tokenizer, turns: list[str], answers: list[str] = ()) -> torch.Tensor:
    """Token ids of a conversation ending with the assistant's turn to speak."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def first_turns(tokenizer, questions: list[dict]) -> list[torch.Tensor]:
    return [chat_prompt(tokenizer, question["turns"][:1]) for question in questions]


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, its docstring (with the example commands) as the help's description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def shard(text: str) -> tuple[int, int]:
    """An argparse type: --shard K/N, every N-th question from the K-th."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index, count = 0, 0  # not K/N: refused below
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N, got {text!r}")
    return index, count


def command(script: str, argv: list[str] | None) -> str:
    """The command line that ran `script`, as its results record it."""
    return " ".join(["python", f"scripts/{script}", *(sys.argv[1:] if argv is None else argv)])


def load(model: str | None = None, *heads: str, **options) -> tuple:
    """(target, tokenizer, each of `heads` loaded for it) from inference.load_target(model, **options)."""
    target, tokenizer = load_target(model, **options)
    return target, tokenizer, *(load_heads(path, target) for path in heads)


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def hf_batch(model, prompts: list[list[int]], max_new_tokens: int, **options) -> list[list[int]]:
    """HF greedy generate() on a left-padded batch: each row's tokens up to its first EOS."""
    width, pad = max(map(len, prompts)), model.generation_config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, **options)
    eos = eos_ids(model)
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out[:, width:].tolist()]


def hf_greedy(model, prompt: torch.Tensor | list[int], max_new_tokens: int, **options) -> list[int]:
    """HF greedy `model.generate(do_sample=False)` of one prompt."""
    return hf_batch(model, [torch.as_tensor(prompt).tolist()], max_new_tokens, **options)[0]


def hf_in_chunks(model, prompts: list[list[int]], size: int, max_new_tokens: int) -> list[list[int]]:
    """HF generate() batched as a user without continuous batching runs it: the prompts in chunks of `size`."""
    chunks = (prompts[start : start + size] for start in range(0, len(prompts), size))
    return [row for chunk in chunks for row in hf_batch(model, chunk, max_new_tokens)]


@dataclass
class Run:
    """A method's answers: each prompt's new tokens, the target passes (0: not counted, as for HF), our loop's stats."""

    outputs: list[list[int]]
    forwards: int = 0
    stats: list[dict] = field(default_factory=list)


Method = Callable[..., Run]


def hf_method(model, max_new_tokens: int, **options) -> Method:
    """HF generate() greedy: one prompt (with `options`, e.g. prompt_lookup_num_tokens), or a list in chunks."""

    def run(prompts, batch_size: int = 1) -> Run:
        if isinstance(prompts, torch.Tensor):
            return Run([hf_greedy(model, prompts, max_new_tokens, **options)])
        return Run(hf_in_chunks(model, prompts, batch_size, max_new_tokens))

    return run


def our_method(model, max_new_tokens: int, **settings) -> Method:
    """generate(model, **settings): one prompt, or a list with at most `batch_size` rows decoding at once."""

    def run(prompts, batch_size: int | None = None) -> Run:
        out = generate(
            model, prompt_or_input_ids=prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, **settings
        )
        outs = out if isinstance(out, list) else [out]
        forwards = sum(o.stats.target_forwards for o in outs)
        return Run([o.token_ids for o in outs], forwards, [o.stats.as_dict() for o in outs])

    return run


def synchronize() -> None:
    """Wait for the device's queued work: a CUDA call returns before its kernels finish."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(call: Callable):
    """(call(), its wall seconds), the device's queued work before and after included."""
    synchronize()
    started = time.perf_counter()
    result = call()
    synchronize()
    return result, time.perf_counter() - started


def time_each(methods: dict[str, Method], *inputs) -> dict[str, tuple[Run, float]]:
    """Every method on the same input in turn, each timed: a slow spell of the machine slows every method alike."""
    return {name: timed(lambda method=method: method(*inputs)) for name, method in methods.items()}


@dataclass
class Tally:
    """One method's tokens, seconds, target passes and outputs over many runs."""

    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, run: Run, seconds: float) -> None:
        self.tokens += sum(map(len, run.outputs))
        self.seconds, self.forwards = self.seconds + seconds, self.forwards + run.forwards
        self.outputs += run.outputs

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None


def divergence(model, prompt: torch.Tensor, ours: list[int], baseline: list[int]) -> dict:
    """Where `ours` first departs from the baseline, and whether the target has a near-tie there (numerics.near_tie)."""
    shorter = min(len(ours), len(baseline))
    position = next((i for i, (a, b) in enumerate(zip(ours, baseline)) if a != b), shorter)
    if position >= shorter:  # one stopped early: not a token-choice divergence
        return {"position": position, "near_tie": False, "steps": None}
    context = prompt.tolist() + baseline[:position]
    tie, steps = near_tie(model, context, ours[position], baseline[position], prompt_length=len(prompt))
    return {"position": position, "near_tie": tie, "steps": steps}


def divergence_note(found: dict[str, list[dict]]) -> str:
    """A paragraph on each method's divergences (`divergence`'s dicts) from the baseline; empty without any."""
    lines = []
    for name, divergences in found.items():
        if divergences:
            ties = sum(d["near_tie"] for d in divergences)
            worst = max((d["steps"] for d in divergences if d["steps"] is not None), default=None)
            lines.append(
                f"- {name}: {len(divergences)} outputs differ from the baseline; {ties} of them first at a proven "
                "near-tie" + (f" (largest logit gap {worst:.1f} rounding steps)" if worst is not None else "")
            )
    if not lines:
        return ""
    return (
        "\nDivergences (logit gap at the first differing token, teacher-forced, or where that finds no tie in the "
        f"logits HF generate() computed itself; a near-tie: both tokens within {NEAR_TIE_STEPS} rounding steps of the "
        "top logit):\n\n" + "\n".join(lines) + "\n"
    )


def instruction_set() -> str:
    """The CPU's widest matrix instructions: AMX, AVX512-BF16, AVX512 or AVX2 (else torch's name for them)."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    for flag, name in (("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return torch.backends.cpu.get_cpu_capability()


def header(script: str, argv: list[str] | None, device: torch.device) -> str:
    """A results file's first lines: the command that made it and the machine it ran on."""
    return (
        f"Command: `{command(script, argv)}`  \nMachine: {device_name(device)}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}."
    )


def table(columns: list[str], rows: Iterable[Iterable]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]) + "\n"


def write_results(out: str | Path, text: str, record=None, indent: int | None = None) -> None:
    """OUT.md holding `text` and, given a `record`, OUT.json holding it; OUT's folder made first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    if record is not None:
        out.with_suffix(".json").write_text(json.dumps(record, indent=indent))
