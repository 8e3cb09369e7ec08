"""Spec-Bench-style benchmark: every method on the same prompts, in one process, interleaved question by question.

    python scripts/benchmark.py --questions ../shared/data/eval/dev.jsonl --methods hf eagle medusa \\
        --eagle checkpoints/smollm2-135m-instruct-eagle --medusa checkpoints/smollm2-135m-instruct-medusa \\
        --per-category 2 --max-new-tokens 128 --dtype float32 --out docs/results/dev-fp32

Methods: hf (HF generate() greedy, the baseline), hf-lookup (HF prompt lookup), plain (our loop, no drafter), lookup
(our prompt lookup), eagle, medusa, early-exit (a head alone), HEAD+lookup (lookup merged into the head's tree),
HEAD-default (`generate(model, head, prompt)` as it is, whatever --tree, --no-fallback and --no-context-vocab say).
Later turns get the baseline's earlier answers. Per category: tokens/s, speedup, tau (new tokens per target pass),
outputs identical to the baseline's (divergences checked for near-ties), our loop's latency and acceptance by depth.
--batch-sizes measures throughput instead; --merge joins one run's shards.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from itertools import zip_longest
from pathlib import Path

from tqdm import tqdm

from common import (
    DEFAULT_QUESTIONS,
    Tally,
    chat_prompt,
    divergence,
    divergence_note,
    first_turns,
    header,
    hf_greedy,
    hf_in_chunks,
    hf_method,
    load,
    our_method,
    parser,
    pick,
    positive,
    read_questions,
    shard,
    table,
    time_each,
    write_results,
)
from heads import load_heads
from inference import DynamicTreeSpec, PromptLookupDrafter, warm_up
from inference.calibrate import calibrated_tree
from inference.drafters import as_drafter, is_trained, medusa_tree_spec
from inference.target import dtype_name

HEADS = ("eagle", "medusa", "early-exit")
METHODS = ("hf", "hf-lookup", "plain", "lookup", *(f"{h}{s}" for h in HEADS for s in ("", "+lookup", "-default")))


def load_method_heads(args, model) -> dict:
    """The heads --methods name, loaded once: kind (eagle, medusa, early-exit) -> head."""
    heads = {}
    for kind in HEADS:
        if any(method.startswith(kind) for method in args.methods):
            spec = getattr(args, kind.replace("-", "_"))
            if not spec:
                raise SystemExit(f"the {kind} methods need --{kind} CHECKPOINT_DIR")
            heads[kind] = load_heads(spec, model)
    return heads


def our_settings(args, heads: dict, model=None) -> dict[str, dict]:
    """Each of our methods in --methods -> its generate() keywords. --no-context-vocab builds a head's drafter here
    (with the `model`), to pass it `context_vocab=False`."""
    fixed = args.tree == "fixed"  # else calibrated: generate()'s default, tree=None

    def shaped(own: DynamicTreeSpec) -> DynamicTreeSpec:  # a drafter's own shape unless --depth / --top-k say
        return replace(own, depth=args.depth or own.depth, top_k=args.top_k or own.top_k)

    trees = dict.fromkeys(HEADS, shaped(DynamicTreeSpec(nodes=args.nodes)) if fixed else None)
    if fixed and {"medusa", "medusa+lookup"} & set(args.methods):  # a fixed tree of Medusa's own shape
        own = medusa_tree_spec(heads["medusa"], nodes=args.nodes)
        if args.depth is not None and args.depth > own.depth:
            raise SystemExit(f"--depth {args.depth}: the Medusa heads draft at most {own.depth} tokens ahead")
        trees["medusa"] = shaped(own)

    def ours(drafter, tree=None, lookup=False):
        if args.no_context_vocab and is_trained(drafter):
            merged = [drafter, PromptLookupDrafter()] if lookup else drafter
            drafter, tree, lookup = as_drafter(merged, model, tree, context_vocab=False), None, False
        return dict(heads=drafter, tree=tree, lookup=lookup, fallback=not args.no_fallback)

    settings = {"plain": ours(None), "lookup": ours(PromptLookupDrafter())}
    for kind in HEADS:
        head, tree = heads.get(kind), trees[kind]
        settings |= {kind: ours(head, tree), f"{kind}+lookup": ours(head, tree, lookup=True)}
        settings[f"{kind}-default"] = dict(heads=head)  # generate(model, head, prompt) as it is
    return {name: settings[name] for name in args.methods if name in settings}


def build_methods(args, model, heads: dict) -> dict:
    for head in heads.values():  # this machine's pass costs measured before any timing (cached afterwards)
        calibrated_tree(model, head, verbose=True)
    methods = {
        "hf": hf_method(model, args.max_new_tokens),
        "hf-lookup": hf_method(model, args.max_new_tokens, prompt_lookup_num_tokens=10),
        **{name: our_method(model, args.max_new_tokens, **s) for name, s in our_settings(args, heads, model).items()},
    }
    return {name: methods[name] for name in args.methods}


def summarise(records: list[dict], methods: list[str]) -> dict:
    """Per category and overall, for each method: tokens/s, speedup over hf, tau, identical share, divergences."""
    groups = defaultdict(list)
    for record in records:
        groups[record["category"]].append(record)
        groups["overall"].append(record)
    summary = {}
    for category, rows in groups.items():
        figures = summary[category] = {}
        for m in methods:
            tokens, seconds = sum(len(r["tokens"][m]) for r in rows), sum(r["seconds"][m] for r in rows)
            forwards = [r["forwards"][m] for r in rows if r["forwards"][m] is not None]
            same = sum(r["tokens"][m] == r["tokens"]["hf"] for r in rows) / len(rows) if "hf" in methods else None
            figures[m] = {
                "tokens_per_second": tokens / seconds if seconds else 0.0,
                "tau": tokens / sum(forwards) if forwards else None,
                "identical": same,
                "divergences": [r["divergence"][m] for r in rows if m in r.get("divergence", {})],
                "turns": len(rows),
            }
        base = figures["hf"]["tokens_per_second"] if "hf" in methods else 0.0
        for m in methods:
            figures[m]["speedup"] = figures[m]["tokens_per_second"] / base if base else None
    return summary


def markdown(summary: dict, methods: list[str]) -> str:
    def cell(method: str, s: dict) -> str:
        parts = [f"{s['tokens_per_second']:.1f} tok/s"]
        parts += [f"{s['speedup']:.2f}x"] if s["speedup"] is not None and method != "hf" else []
        parts += [f"tau {s['tau']:.2f}"] if s["tau"] is not None else []
        parts += [f"{100 * s['identical']:.0f}% identical"] if s["identical"] is not None and method != "hf" else []
        return ", ".join(parts)

    rows = [
        [f"{c} ({summary[c][methods[0]]['turns']} turns)", *(cell(m, summary[c][m]) for m in methods)]
        for c in sorted(summary, key=lambda c: (c == "overall", c))  # overall last
    ]
    return table(["category", *methods], rows)


def monitoring(records: list[dict], methods: list[str]) -> str:
    """Our loop's latency, share of plain decode steps (the fallback) and acceptance by depth over all turns."""
    rows = []
    for m in methods:
        stats = [r["stats"][m] for r in records if r["stats"].get(m)]
        if not stats:
            continue
        steps = sum(s["target_forwards"] - 1 for s in stats)
        drafted, accepted = (
            [sum(depth) for depth in zip_longest(*(s[key] for s in stats), fillvalue=0)]
            for key in ("drafted_to_depth", "accepted_to_depth")
        )
        depths = ", ".join(f"{a / n:.2f}" for a, n in zip(accepted, drafted) if n) or "-"
        first = 1e3 * sum(s["time_to_first_token"] for s in stats) / len(stats)
        per_token = 1e3 * sum(s["time_per_output_token"] for s in stats) / len(stats)
        plain = 100 * sum(s["plain_steps"] for s in stats) / max(steps, 1)
        rows.append([m, f"{first:.0f} ms", f"{per_token:.1f} ms", f"{plain:.0f}%", depths])
    columns = ["method", "time to first token", "time per output token", "plain steps", "acceptance by depth 1, 2, ..."]
    return "\n" + table(columns, rows) if rows else ""


def write_result(out: str | None, result: dict, methods: list[str]) -> None:
    """Print the tables; with `out`, write OUT.json (everything) and OUT.md (the tables)."""
    summary = result["summary"]
    found = {m: summary["overall"][m]["divergences"] for m in methods}
    tables = markdown(summary, methods) + divergence_note(found) + monitoring(result["records"], methods)
    text = f"{result['header']}\n\n{tables}"
    print("\n" + text)
    if out:
        write_results(out, text, result, indent=1)
        print(f"wrote {Path(out).with_suffix('.json')} and .md")


def merge_shards(paths: list[str], out: str | None) -> None:
    """One result from the shards of one run (each --shard K/N with its own --out): their turns summarised together,
    with every shard's command in the header. Shards run with other settings, or a shard missing, are refused."""
    if not out:
        raise SystemExit("--merge writes one result: give it --out OUT")
    results = []
    for path in paths:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:
            raise SystemExit(f"--merge: cannot read {path} ({error}); pass --shard K/N runs' .json files") from None
    settings = [{k: v for k, v in r["args"].items() if k not in ("shard", "out", "merge")} for r in results]
    for path, other in zip(paths[1:], settings[1:]):
        different = sorted(k for k in settings[0].keys() | other.keys() if settings[0].get(k) != other.get(k))
        if different:
            raise SystemExit(f"--merge: {path} ran with other settings than {paths[0]} ({', '.join(different)})")
    shards = sorted(tuple(r["args"].get("shard") or (0, 1)) for r in results)
    count = shards[0][1]
    if shards != [(k, count) for k in range(count)]:
        got = ", ".join(f"{k}/{n}" for k, n in shards)
        raise SystemExit(f"--merge needs every shard of one run once (0/{count} .. {count - 1}/{count}), got {got}")
    methods, records = results[0]["args"]["methods"], [record for r in results for record in r["records"]]
    lines = [r["header"].split("  \n") for r in results]  # Command, Machine, what was run
    merged = f"Merged from {count} shards by `python scripts/benchmark.py --merge {' '.join(paths)} --out {out}`, each:"
    what = f"{len(records)} turns, {lines[0][2].split(' turns, ', 1)[-1]}"
    text = "  \n".join([merged, *(shard_lines[0] for shard_lines in lines), lines[0][1], what])
    result = {"args": results[0]["args"], "header": text, "summary": summarise(records, methods), "records": records}
    write_result(out, result, methods)


def identical_rows(outputs: list[list[int]], alone: list[list[int]], per_round: int) -> int:
    """How many reference rows were identical to HF alone in every round (outputs: the rounds one after another)."""
    rounds = [outputs[start : start + per_round] for start in range(0, len(outputs), per_round)]
    return sum(all(rows[index] == reference for rows in rounds) for index, reference in enumerate(alone))


def batch_throughput(args, argv, model, tokenizer, heads: dict, questions: list[dict]) -> None:
    """Total new tokens per second over the first turns at each batch size: HF generate() on chunks of that size beside
    each of --methods through generate(..., batch_size=size), in --rounds rounds of every method in turn."""
    runs = our_settings(args, heads, model)
    prompts = [prompt.tolist() for prompt in first_turns(tokenizer, questions)]
    alone = [hf_greedy(model, prompt, args.max_new_tokens) for prompt in prompts[: args.reference_rows]]
    # untimed: a process's first decoding of these prompts runs slower than later ones, penalising the first method
    largest = max(args.batch_sizes)
    hf_in_chunks(model, prompts, largest, 16)
    for settings in runs.values():
        if settings.get("tree") is None and settings["heads"] is not None:  # measured once per batch size, cached
            for size in args.batch_sizes:
                calibrated_tree(model, settings["heads"], batch=min(size, len(prompts)), verbose=True)
        our_method(model, 16, **settings)(prompts, largest)
    methods = {"hf": hf_method(model, args.max_new_tokens)}
    methods |= {name: our_method(model, args.max_new_tokens, **settings) for name, settings in runs.items()}
    rows = []
    for size in args.batch_sizes:
        tallies = {name: Tally() for name in methods}
        for _ in tqdm(range(args.rounds), desc=f"batch {size} (rounds)"):  # every method in turn, round by round
            for name, (run, seconds) in time_each(methods, prompts, size).items():
                tallies[name].add(run, seconds)
        hf, ours = tallies["hf"].tokens_per_second, [tallies[name] for name in runs]
        cells = [f"{t.tokens_per_second:.1f} ({t.tokens_per_second / hf:.2f}x, tau {t.tau:.2f})" for t in ours]
        same = [f"{identical_rows(tallies[name].outputs, alone, len(prompts))}/{len(alone)}" for name in runs]
        rows.append([size, f"{hf:.1f}", *cells, ", ".join(same)])
    text = (
        f"{header('benchmark.py', argv, model.device)}  \n{len(prompts)} first turns, {args.max_new_tokens} new tokens "
        f"at most, {dtype_name(model.dtype)}, greedy, {args.rounds} round(s); total new tokens per second (ours / HF, "
        "and tau: a row's new tokens per target pass it took part in, in parentheses). HF decodes the prompts in "
        "chunks of the batch size; ours keeps at most that many rows at once, a prompt joining as another finishes. "
        f"The last column counts the first {len(alone)} rows identical to HF generate() of that prompt alone (in "
        "every round).\n\n" + table(["batch", "HF generate() batched", *runs, "identical"], rows)
    )
    print("\n" + text)
    if args.out:
        write_results(args.out, text)


def arguments(argv):
    p = parser(__doc__)
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    p.add_argument("--model", help="hub id or directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--methods", nargs="+", default=["hf", "hf-lookup", "eagle", "eagle+lookup"], choices=METHODS)
    p.add_argument("--eagle", help="EAGLE head checkpoint directory")
    p.add_argument("--medusa", help="Medusa heads checkpoint directory")
    p.add_argument("--early-exit", help="early-exit head checkpoint directory")
    p.add_argument("--depth", type=positive, help="fixed trees' depth (default: EAGLE, early exit 5; Medusa: heads)")
    p.add_argument("--top-k", type=positive, help="fixed trees' width a level (default: EAGLE, early exit 4)")
    p.add_argument("--nodes", type=positive, default=15, help="at most this many draft nodes (the root on top)")
    p.add_argument("--tree", choices=["calibrated", "fixed"], default="calibrated", help="fixed: always --nodes")
    p.add_argument("--no-fallback", action="store_true", help="our methods draft at every step, even where slower")
    p.add_argument("--no-context-vocab", action="store_true", help="heads draft their own vocabulary only (fixed tree)")
    p.add_argument("--per-category", type=positive, help="the first N questions of each category")
    p.add_argument("--shard", type=shard, metavar="K/N", help="answer every N-th question from the K-th (0-based)")
    p.add_argument("--max-new-tokens", type=positive, default=128)
    p.add_argument("--compile", action="store_true", help="our methods' passes compiled; HF generate() stays eager")
    p.add_argument("--dtype", default="float32", help="float32 (default, exact), bfloat16, or auto")
    p.add_argument("--device", default="cpu", help="where the target runs: cpu (default) or cuda")
    p.add_argument("--out", help="write OUT.json and OUT.md")
    p.add_argument("--batch-sizes", type=positive, nargs="+", help="throughput instead: first turns in batches")
    p.add_argument("--reference-rows", type=positive, default=4, help="--batch-sizes: rows compared with HF alone")
    p.add_argument("--rounds", type=positive, default=1, help="--batch-sizes: how often every method decodes them all")
    p.add_argument("--merge", nargs="+", metavar="SHARD.json", help="merge one run's --shard results into --out")
    args = p.parse_args(argv)
    if args.no_context_vocab and args.tree != "fixed":
        p.error("--no-context-vocab builds the heads' drafters with a fixed tree: add --tree fixed")
    if args.batch_sizes and "hf-lookup" in args.methods:
        p.error("--batch-sizes batches HF generate(); hf-lookup decodes one sequence at a time: leave it out")
    if "hf" in args.methods:  # the baseline first: its answers are fed back to every method
        args.methods = ["hf"] + [m for m in args.methods if m != "hf"]
    return args


def main(argv=None):
    args = arguments(argv)
    if args.merge:
        return merge_shards(args.merge, args.out)
    model, tokenizer = load(args.model, dtype=args.dtype, device=args.device, compile=args.compile)
    heads = load_method_heads(args, model)
    compile_seconds = warm_up(model, list(heads.values()))  # every package, so that every pass runs as it will
    questions = pick(read_questions(args.questions), args.per_category, None, args.shard)
    if args.batch_sizes:
        return batch_throughput(args, argv, model, tokenizer, heads, questions)
    methods = build_methods(args, model, heads)
    time_each(methods, chat_prompt(tokenizer, ["Hello"])[:16])  # warm-up, outside the measurement

    records = []
    progress = tqdm(questions, desc="questions")
    for question in progress:
        answers = []
        for turn in range(len(question["turns"])):
            prompt = chat_prompt(tokenizer, question["turns"][: turn + 1], answers)
            runs = time_each(methods, prompt)
            record = {"question_id": question["question_id"], "category": question["category"], "turn": turn}
            record["tokens"] = {name: run.outputs[0] for name, (run, _) in runs.items()}
            record["seconds"] = {name: seconds for name, (_, seconds) in runs.items()}
            record["forwards"] = {name: run.forwards or None for name, (run, _) in runs.items()}
            record["stats"] = {name: run.stats[0] if run.stats else None for name, (run, _) in runs.items()}
            if "hf" in methods:
                baseline = record["tokens"]["hf"]
                record["divergence"] = {
                    name: divergence(model, prompt, tokens, baseline)
                    for name, tokens in record["tokens"].items()
                    if tokens != baseline
                }
            records.append(record)
            overall = summarise(records, args.methods)["overall"]  # a long run shows where it is heading
            progress.set_postfix({f"tau {m}": f"{s['tau']:.2f}" for m, s in overall.items() if s["tau"] is not None})
            answers.append(tokenizer.decode(record["tokens"][args.methods[0]], skip_special_tokens=True))

    text = (
        f"{header('benchmark.py', argv, model.device)}  \n{len(questions)} questions, {len(records)} turns, "
        f"{args.max_new_tokens} new tokens per turn, {dtype_name(model.dtype)}, greedy."
    )
    if args.compile:
        text += f"  \nOur methods' passes compiled (AOTInductor; {compile_seconds:.0f} s to compile or load first; HF "
        text += "generate() eager)."
    result = {"args": vars(args), "header": text, "summary": summarise(records, args.methods), "records": records}
    write_result(args.out, result, args.methods)


if __name__ == "__main__":
    from inference.cli import run

    run(main, "benchmark.py")
