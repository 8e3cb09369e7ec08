"""How fast can the engine go when every draft is right? HF generate() against our loop driven by an oracle.

The oracle drafter proposes the true continuation on one branch of a chain or tree (wrong tokens on the
others), so every step accepts the deepest path and the figures show the engine's ceiling and its own
per-step cost (trees, masks, acceptance, cache compaction), next to Hugging Face's greedy generate(),
in one process on the same prompts, methods interleaved prompt by prompt.

    python scripts/engine_overhead.py --prompts 5 --max-new-tokens 128 --out docs/results/engine-overhead.md

In bfloat16 a tree pass does not round exactly like one-token passes, so the oracle follows the engine's
own bf16 output (iterated to a fixed point) rather than HF's; the 'identical' column says how often the
output still equals HF's.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_QUESTIONS, chat_prompt, read_questions  # noqa: E402
from inference import NoDrafter, OracleDrafter, best_static_paths, chain_paths, generate, load_target  # noqa: E402
from inference.calibrate import device_name  # noqa: E402
from inference.tree_size import default_accuracy  # noqa: E402


def methods(chains, trees):
    out = [("engine, no drafter", None)]
    out += [(f"oracle chain {k} ({k + 1} tokens/pass)", chain_paths(k)) for k in chains]
    out += [(f"oracle tree {n} nodes", best_static_paths(n - 1, default_accuracy(depth=8, ranks=4))) for n in trees]
    return out


def hf_greedy(model, prompt, max_new_tokens):
    started = time.perf_counter()
    out = model.generate(
        prompt[None],
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    return out[0, len(prompt) :], time.perf_counter() - started


def self_consistent_continuation(model, prompt, reference, tree, max_new_tokens, rounds=8):
    """An oracle continuation that the engine with this tree reproduces exactly (in float32: HF's own)."""
    vocab, current = model.config.vocab_size, reference.tolist()
    for _ in range(rounds):
        drafter = OracleDrafter(torch.cat([prompt, torch.tensor(current, dtype=torch.long)]), tree, vocab)
        produced = generate(model, drafter, prompt, max_new_tokens=max_new_tokens).token_ids
        if produced == current:
            break
        current = produced
    return torch.tensor(current, dtype=torch.long)


def run(dtype, args, questions):
    model, tokenizer = load_target(args.model, dtype=dtype, compile=False)
    prompts = [chat_prompt(tokenizer, q["turns"][:1]) for q in questions]
    rows = {"HF generate() greedy": dict(tokens=0, seconds=0.0, identical=0)}
    table = methods(args.chains, args.trees)
    for name, _ in table:
        rows[name] = dict(tokens=0, seconds=0.0, identical=0, forwards=0, target=0.0, draft=0.0, engine=0.0, nodes=0)
    hf_greedy(model, prompts[0][:8], 4)  # warm-up
    for prompt in tqdm(prompts, desc=f"{dtype} prompts"):
        reference, seconds = hf_greedy(model, prompt, args.max_new_tokens)
        baseline = rows["HF generate() greedy"]
        baseline.update(tokens=baseline["tokens"] + len(reference), seconds=baseline["seconds"] + seconds)
        baseline["identical"] += 1
        for name, tree in table:
            if tree is None:
                drafter = NoDrafter()
            else:
                truth = self_consistent_continuation(model, prompt, reference, tree, args.max_new_tokens)
                drafter = OracleDrafter(torch.cat([prompt, truth]), tree, model.config.vocab_size)
            out = generate(model, drafter, prompt, max_new_tokens=args.max_new_tokens)
            s, row = out.stats, rows[name]
            row["tokens"] += s.new_tokens
            row["seconds"] += s.seconds
            row["forwards"] += s.target_forwards
            row["target"] += s.target_seconds
            row["draft"] += s.draft_seconds
            row["engine"] += s.engine_seconds
            row["nodes"] += s.tree_nodes
            row["identical"] += out.token_ids == reference.tolist()
    return rows, len(prompts)


def markdown(dtype, rows, prompts):
    base = rows["HF generate() greedy"]
    base_speed = base["tokens"] / base["seconds"]
    lines = [
        f"### {dtype}",
        "",
        "| method | tokens/s | speedup vs HF | tau | tokens/pass | target ms/pass | engine ms/step | "
        "engine % of a pass | identical to HF |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| HF generate() greedy | {base_speed:.1f} | 1.00x | 1.00 | 1 | | | | {base['identical']}/{prompts} |",
    ]
    for name, row in rows.items():
        if name == "HF generate() greedy":
            continue
        speed = row["tokens"] / row["seconds"]
        per_pass = row["target"] / row["forwards"] * 1000
        steps = max(row["forwards"] - prompts, 1)  # decode steps: the prefill excluded
        engine = row["engine"] / steps * 1000
        lines.append(
            f"| {name} | {speed:.1f} | {speed / base_speed:.2f}x | {row['tokens'] / row['forwards']:.2f} | "
            f"{row['nodes'] / steps:.1f} | {per_pass:.1f} | {engine:.2f} | {100 * engine / per_pass:.1f}% | "
            f"{row['identical']}/{prompts} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="hub id or directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench style question file")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--chains", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--trees", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    args = parser.parse_args(argv)
    questions = read_questions(args.questions, args.prompts)
    header = [
        "## Engine overhead: HF generate() vs our loop with an oracle drafter",
        "",
        f"Command: `python scripts/engine_overhead.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {device_name(torch.device('cpu'))} ({platform.machine()}, {os.cpu_count()} cores), "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; "
        f"{len(questions)} prompts (first turns of {Path(args.questions).name}), {args.max_new_tokens} new tokens "
        "each.",
        "",
        "tau = new tokens per target forward (prefill included). engine ms/step = wall time outside the target's "
        "forward and the drafter (trees, masks, acceptance, cache compaction, bookkeeping), per decode step.",
        "",
    ]
    sections = []
    for dtype in args.dtypes:
        rows, prompts = run(dtype, args, questions)
        sections.append(markdown(dtype, rows, prompts))
        print("\n" + sections[-1] + "\n", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(header) + "\n" + "\n\n".join(sections) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
