"""Spec-Bench-style benchmark: every method on the same prompts, in one process, interleaved question by question.

    python scripts/benchmark.py --questions ../shared/data/eval/dev.jsonl --methods hf eagle medusa \
        --eagle checkpoints/smollm2-135m-instruct-eagle --medusa checkpoints/smollm2-135m-instruct-medusa \
        --per-category 2 --max-new-tokens 128 --dtype float32 --out docs/results/dev-fp32

Methods: hf (HF generate() greedy: the baseline), hf-lookup (HF prompt lookup decoding), plain (our loop, no
drafter), lookup (our prompt lookup drafter), eagle and medusa (a head alone), eagle+lookup and medusa+lookup
(the head's tree and a copied span merged into one tree), eagle-default and medusa-default (the default call
`generate(model, head, prompt)`: the tree sized to this machine, lookup merged, the fallback on, whatever
--tree, --no-fallback and --no-context-vocab say). Our other methods fall back to plain decoding where drafting does
not pay (--no-fallback: never).
A multi-turn question is answered turn by turn through the chat template; every method is given the
baseline's earlier answers, so all methods see identical prompts. Reports per category and overall:
tokens/s, speedup over the baseline, tau (new tokens per target forward) and the share of outputs
identical to the baseline's, then our methods' time to first token, time per output token, plain steps and
acceptance by draft depth; writes <out>.json, <out>.md and <out>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_QUESTIONS, chat_prompt, read_questions  # noqa: E402
from heads import EarlyExitConfig, EarlyExitHead, load_heads  # noqa: E402
from inference import DynamicTreeSpec, PromptLookupDrafter, generate, load_target, warm_up  # noqa: E402
from inference.calibrate import calibrated_tree, device_name  # noqa: E402
from inference.drafters import as_drafter, is_trained, medusa_tree_spec  # noqa: E402
from inference.numerics import NEAR_TIE_STEPS, near_tie  # noqa: E402
from inference.target import dtype_name  # noqa: E402

METHODS = (
    "hf",
    "hf-lookup",
    "plain",
    "lookup",
    "eagle",
    "eagle+lookup",
    "eagle-default",
    "medusa",
    "medusa+lookup",
    "medusa-default",
    "early-exit",
    "early-exit+lookup",
    "early-exit-default",
)


def load_early_exit(spec: str, model):
    """A checkpoint directory, or a bare layer number: the target's untrained exit after that many layers."""
    if spec.isdigit():
        return EarlyExitHead(
            EarlyExitConfig.for_target(model.config, exit_layer=int(spec), lora_rank=None), model
        ).eval()
    return load_heads(spec, model)


def hf_generate(model, prompt, max_new_tokens, **extra):
    started = time.perf_counter()
    prompt = prompt.to(model.device)
    out = model.generate(
        prompt[None],
        attention_mask=torch.ones_like(prompt)[None],
        do_sample=False,
        max_new_tokens=max_new_tokens,
        **extra,
    )
    tokens = out[0, len(prompt) :].tolist()
    return tokens, time.perf_counter() - started, None, None


def load_method_heads(args, model) -> dict:
    """The heads --methods name, loaded once: kind (eagle, medusa, early-exit) -> head."""
    heads = {}
    if any("eagle" in m for m in args.methods):
        if not args.eagle:
            raise SystemExit("the eagle methods need --eagle CHECKPOINT_DIR")
        heads["eagle"] = load_heads(args.eagle, model)
    if any("medusa" in m for m in args.methods):
        if not args.medusa:
            raise SystemExit("the medusa method needs --medusa CHECKPOINT_DIR")
        heads["medusa"] = load_heads(args.medusa, model)
    if any("early-exit" in m for m in args.methods):
        if not args.early_exit:
            raise SystemExit(
                "the early-exit methods need --early-exit CHECKPOINT_DIR (or an exit layer number: the untrained exit)"
            )
        heads["early-exit"] = load_early_exit(args.early_exit, model)
    return heads


def our_settings(args, heads: dict, model=None) -> dict[str, dict]:
    """Each of our methods in --methods -> its generate() keywords (heads, tree, lookup, fallback). With
    --no-context-vocab (and so a fixed tree) a head's drafter is built here, lookup merged in, to pass it
    `context_vocab=False`; that needs the `model`."""
    # calibrated: what generate() does by default (tree=None); fixed: the same --nodes every step (grown: EAGLE and
    # early exit)
    fixed = args.tree == "fixed"

    def shaped(
        own: DynamicTreeSpec,
    ) -> DynamicTreeSpec:  # a drafter's own tree shape unless --depth / --top-k say otherwise
        return replace(own, depth=args.depth or own.depth, top_k=args.top_k or own.top_k)

    grown_tree = shaped(DynamicTreeSpec(nodes=args.nodes)) if fixed else None
    medusa_tree = None
    if fixed and "medusa" in heads:
        own = medusa_tree_spec(heads["medusa"], nodes=args.nodes)
        if args.depth is not None and args.depth > own.depth:
            raise SystemExit(
                f"--depth {args.depth}: the Medusa heads draft at most {own.depth} tokens ahead (one head a token)"
            )
        medusa_tree = shaped(own)

    def ours(drafter, tree=None, lookup=False):
        if args.no_context_vocab and is_trained(drafter):
            drafter = as_drafter(
                [drafter, PromptLookupDrafter()] if lookup else drafter, model, tree, context_vocab=False
            )
            tree, lookup = None, False
        return dict(heads=drafter, tree=tree, lookup=lookup, fallback=not args.no_fallback)

    def default(drafter):  # generate(model, head, prompt) as it is, whatever --tree and --no-fallback say
        return dict(heads=drafter)

    table = {
        "plain": ours(None),
        "lookup": ours(PromptLookupDrafter()),
        "eagle": ours(heads.get("eagle"), grown_tree),
        "eagle+lookup": ours(heads.get("eagle"), grown_tree, lookup=True),  # with --tree calibrated: the default call
        "medusa": ours(heads.get("medusa"), medusa_tree),
        "medusa+lookup": ours(heads.get("medusa"), medusa_tree, lookup=True),
        "eagle-default": default(heads.get("eagle")),
        "medusa-default": default(heads.get("medusa")),
        "early-exit": ours(heads.get("early-exit"), grown_tree),
        "early-exit+lookup": ours(heads.get("early-exit"), grown_tree, lookup=True),
        "early-exit-default": default(heads.get("early-exit")),
    }
    return {name: table[name] for name in args.methods if name in table}


def build_methods(args, model, heads: dict):
    """name -> function(prompt) -> (tokens, seconds, target forwards or None, our loop's stats or None); `heads` as
    load_method_heads gives them."""
    for head in heads.values():  # measure this machine's pass costs before any timing (cached afterwards)
        calibrated_tree(model, head, verbose=True)

    def ours(settings):
        def run(prompt):
            out = generate(model, prompt_or_input_ids=prompt, max_new_tokens=args.max_new_tokens, **settings)
            return out.token_ids, out.stats.seconds, out.stats.target_forwards, out.stats.as_dict()

        return run

    table = {
        "hf": lambda p: hf_generate(model, p, args.max_new_tokens),
        "hf-lookup": lambda p: hf_generate(model, p, args.max_new_tokens, prompt_lookup_num_tokens=10),
        **{name: ours(settings) for name, settings in our_settings(args, heads, model).items()},
    }
    return {name: table[name] for name in args.methods}


def divergence(model, prompt, ours, baseline):
    """Where `ours` first departs from the baseline, and whether the target itself has a near-tie there
    (inference.numerics: both tokens within a few rounding steps of the top, teacher-forced on the shared prefix or,
    where that finds no tie, in the logits generate() computed itself)."""
    position = next((i for i, (a, b) in enumerate(zip(ours, baseline)) if a != b), min(len(ours), len(baseline)))
    if position >= min(len(ours), len(baseline)):  # one stopped early: not a token-choice divergence
        return {"position": position, "near_tie": False, "steps": None}
    context = prompt.tolist() + baseline[:position]
    tie, steps = near_tie(model, context, ours[position], baseline[position], prompt_length=len(prompt))
    return {"position": position, "near_tie": tie, "steps": steps}


def summarise(records, methods):
    """Per category and overall: tokens/s, speedup over hf, tau, identical share."""
    groups = defaultdict(list)
    for r in records:
        groups[r["category"]].append(r)
        groups["overall"].append(r)
    summary = {}
    for category, rows in groups.items():
        summary[category] = {}
        for m in methods:
            tokens = sum(len(r["tokens"][m]) for r in rows)
            seconds = sum(r["seconds"][m] for r in rows)
            forwards = [r["forwards"][m] for r in rows if r["forwards"][m] is not None]
            summary[category][m] = {
                "tokens_per_second": tokens / seconds if seconds else 0.0,
                "tau": tokens / sum(forwards) if forwards else None,
                "identical": sum(r["tokens"][m] == r["tokens"]["hf"] for r in rows) / len(rows)
                if "hf" in methods
                else None,
                "divergences": [r["divergence"][m] for r in rows if m in r.get("divergence", {})],
                "turns": len(rows),
            }
        if "hf" in methods:
            base = summary[category]["hf"]["tokens_per_second"]
            for m in methods:
                summary[category][m]["speedup"] = summary[category][m]["tokens_per_second"] / base if base else None
    return summary


def markdown(summary, methods, header):
    lines = [header, "", "| category | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for category in sorted(summary, key=lambda c: (c == "overall", c)):
        cells = []
        for m in methods:
            s = summary[category][m]
            cell = f"{s['tokens_per_second']:.1f} tok/s"
            if s.get("speedup") is not None and m != "hf":
                cell += f", {s['speedup']:.2f}x"
            if s["tau"] is not None:
                cell += f", tau {s['tau']:.2f}"
            if s["identical"] is not None and m != "hf":
                cell += f", {100 * s['identical']:.0f}% identical"
            cells.append(cell)
        lines.append(f"| {category} ({summary[category][methods[0]]['turns']} turns) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def monitoring(records, methods) -> str:
    """Our loop's latency and acceptance, over all turns: time to first token, time per output token, the share
    of decode steps taken plainly (the fallback), and acceptance by draft depth (accepted / drafted that deep)."""
    lines = [
        "",
        "| method | time to first token | time per output token | plain steps | acceptance by depth 1, 2, 3, ... |",
        "|---|---|---|---|---|",
    ]
    for m in methods:
        stats = [r["stats"][m] for r in records if r["stats"].get(m)]
        if not stats:
            continue
        steps = sum(s["target_forwards"] - 1 for s in stats)
        drafted, accepted = (
            [0] * max(len(s["drafted_to_depth"]) for s in stats),
            [0] * max(len(s["drafted_to_depth"]) for s in stats),
        )
        for s in stats:
            for d, (n, a) in enumerate(zip(s["drafted_to_depth"], s["accepted_to_depth"])):
                drafted[d], accepted[d] = drafted[d] + n, accepted[d] + a
        depths = ", ".join(f"{a / n:.2f}" for a, n in zip(accepted, drafted) if n) or "-"
        lines.append(
            f"| {m} | {1e3 * sum(s['time_to_first_token'] for s in stats) / len(stats):.0f} ms | "
            f"{1e3 * sum(s['time_per_output_token'] for s in stats) / len(stats):.1f} ms | "
            f"{100 * sum(s['plain_steps'] for s in stats) / max(steps, 1):.0f}% | {depths} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 3 else ""


def divergence_note(overall, methods) -> str:
    lines = []
    for m in methods:
        found = overall[m]["divergences"]
        if not found:
            continue
        ties = [d for d in found if d["near_tie"]]
        worst = max((d["steps"] for d in found if d["steps"] is not None), default=None)
        lines.append(
            f"- {m}: {len(found)} outputs differ from the baseline; {len(ties)} of them first at a proven near-tie"
            + (f" (largest logit gap {worst:.1f} rounding steps)" if worst is not None else "")
        )
    return (
        (
            f"\nDivergences (logit gap at the first differing token, teacher-forced, or where that finds no tie in "
            f"the logits HF generate() computed itself; a near-tie: both tokens within {NEAR_TIE_STEPS} rounding steps "
            f"of the top logit):\n\n" + "\n".join(lines) + "\n"
        )
        if lines
        else ""
    )


def chart(summary, methods, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = sorted(summary, key=lambda c: (c == "overall", c))
    # without the baseline there is no speedup, and tau (new tokens per target pass) is what the machine does not change
    key = (
        "speedup"
        if "hf" in methods
        else "tau"
        if all(summary["overall"][m]["tau"] for m in methods)
        else "tokens_per_second"
    )
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(categories)), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        values = [summary[c][m].get(key) or 0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=m)
    ax.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(categories))],
        [c.replace("mt_bench/", "mt-") for c in categories],
        rotation=30,
        ha="right",
    )
    ax.set_ylabel(
        {
            "speedup": "speedup over HF greedy",
            "tau": "tau (new tokens per target pass)",
            "tokens_per_second": "tokens/s",
        }[key]
    )
    if key == "speedup":
        ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def pick(questions, per_category, limit, shard=None):
    """The questions a run answers: the first `per_category` of each category, the first `limit`, then every
    N-th from the K-th for --shard K/N (a long run split across processes; --merge puts them together)."""
    if per_category:
        count = defaultdict(int)
        chosen = []
        for q in questions:
            if count[q["category"]] < per_category:
                chosen.append(q)
                count[q["category"]] += 1
        questions = chosen
    questions = questions[:limit] if limit else questions
    if shard:
        index, count = shard
        questions = questions[index::count]
    return questions


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
            raise SystemExit(
                f"--merge: cannot read {path} ({error}); pass the .json files that benchmark.py --shard K/N --out wrote"
            ) from None

    def setting(result):  # what must agree between shards of one run
        return {k: v for k, v in result["args"].items() if k not in ("shard", "out", "merge")}

    first = setting(results[0])
    for path, result in zip(paths[1:], results[1:]):
        other = setting(result)
        different = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        if different:
            raise SystemExit(
                f"--merge: {path} was run with other settings than {paths[0]} ({', '.join(different)}): only the "
                "shards of one run merge"
            )
    shards = sorted(tuple(r["args"]["shard"]) if r["args"].get("shard") else (0, 1) for r in results)
    count = shards[0][1]
    if shards != [(k, count) for k in range(count)]:
        raise SystemExit(
            f"--merge needs every shard of one run once (0/{count} .. {count - 1}/{count}), got "
            f"{', '.join(f'{k}/{n}' for k, n in shards)}"
        )
    methods = results[0]["args"]["methods"]
    records = [record for result in results for record in result["records"]]
    summary = summarise(records, methods)
    lines = [result.get("header", "").split("  \n") for result in results]  # Command, Machine, what was run
    commands = [shard[0] or f"Command: not recorded in {path}" for shard, path in zip(lines, paths)]
    machine = lines[0][1] if len(lines[0]) > 1 else "Machine: not recorded."
    settings = lines[0][2].split(" turns, ", 1)[-1] if len(lines[0]) > 2 else ""
    merged = f"Merged from {count} shards by `python scripts/benchmark.py --merge {' '.join(paths)} --out {out}`, each:"
    header = "  \n".join([merged, *commands, machine, f"{len(records)} turns, {settings}"])
    write_result(out, {"args": results[0]["args"], "header": header, "summary": summary, "records": records}, methods)


def write_result(out: str | None, result: dict, methods: list[str]) -> None:
    """Print the tables; with `out`, write OUT.json (everything), OUT.md (the tables) and OUT.png (the chart)."""
    summary = result["summary"]
    table = (
        markdown(summary, methods, result["header"])
        + divergence_note(summary["overall"], methods)
        + monitoring(result["records"], methods)
    )
    print("\n" + table)
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(table)
        chart(summary, methods, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.json')}, .md and .png")


def parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shard takes K/N (this run answers every N-th question from the K-th, 0 <= K < N), got {text!r}"
        ) from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N, got {text!r}")
    return index, count


def hf_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF generate() on a left-padded batch; each row's tokens up to its first EOS (the padding after it dropped)."""
    width, pad = max(map(len, prompts)), model.generation_config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


def hf_in_chunks(model, prompts: list[list[int]], size: int, max_new_tokens: int) -> list[list[int]]:
    """HF generate() batched as a user without continuous batching runs it: the prompts in chunks of `size`."""
    return [
        row
        for start in range(0, len(prompts), size)
        for row in hf_batch(model, prompts[start : start + size], max_new_tokens)
    ]


def identical_rows(outputs: list[list[int]], alone: list[list[int]], per_round: int) -> int:
    """How many reference rows were identical to HF alone in every round (outputs holds the rounds one after
    another)."""
    rounds = [outputs[start : start + per_round] for start in range(0, len(outputs), per_round)]
    return sum(all(rows[index] == reference for rows in rounds) for index, reference in enumerate(alone))


def batch_throughput(args, argv) -> None:
    """Total new tokens per second over the first turns at each batch size: HF generate() batched (the prompts in
    chunks of the batch size, each chunk decoded until its last row ends) beside each of --methods through
    generate(model, heads, prompts, batch_size=size) (at most that many rows at once, a prompt joining as another
    finishes), in --rounds rounds of every method in turn; rows are compared with HF alone."""
    if "hf-lookup" in args.methods:
        raise SystemExit(
            "--batch-sizes compares HF generate() batched with our methods; hf-lookup decodes one sequence at a time: "
            "leave it out"
        )
    model, tokenizer = load_target(args.model, dtype=args.dtype, device=args.device, compile=args.compile)
    heads = load_method_heads(args, model)
    warm_up(model, list(heads.values()))  # every package, so that every pass runs as it will
    runs = our_settings(args, heads, model)  # method -> generate() keywords
    prompts = [
        chat_prompt(tokenizer, q["turns"][:1]).tolist()
        for q in pick(read_questions(args.questions), args.per_category, args.limit, args.shard)
    ]
    alone = [hf_batch(model, [p], args.max_new_tokens)[0] for p in prompts[: args.reference_rows]]  # the reference rows
    # Warm-up, untimed: a process's first decoding of these prompts ran ~8% slower than the same one again (Xeon,
    # batch 8), which would penalise whichever method comes first; every prompt, a few tokens, at the largest batch.
    largest = max(args.batch_sizes)
    hf_in_chunks(model, prompts, largest, 16)
    for run in runs.values():
        if run.get("tree") is None and run["heads"] is not None:  # measured once per batch size and cached: not timed
            for size in args.batch_sizes:
                calibrated_tree(model, run["heads"], batch=min(size, len(prompts)), verbose=True)
        generate(model, prompt_or_input_ids=prompts, max_new_tokens=16, batch_size=largest, **run)
    rows = []
    progress = tqdm(total=len(args.batch_sizes) * args.rounds * (1 + len(runs)), desc="batch size x round x method")
    for size in args.batch_sizes:
        names = ["hf", *runs]
        seconds, outputs, forwards = (
            dict.fromkeys(names, 0.0),
            {name: [] for name in names},
            dict.fromkeys(names, 0),
        )  # forwards: each row's own target passes
        # every method in turn, round after round: a slow spell of this machine slows each method alike
        for round_ in range(args.rounds):
            for name in names:
                progress.set_postfix_str(f"batch {size}, round {round_ + 1}, {name}")
                started = time.perf_counter()
                if name == "hf":
                    new = hf_in_chunks(model, prompts, size, args.max_new_tokens)
                else:
                    results = generate(
                        model,
                        prompt_or_input_ids=prompts,
                        max_new_tokens=args.max_new_tokens,
                        batch_size=size,
                        **runs[name],
                    )
                    new = [o.token_ids for o in results]
                    forwards[name] += sum(o.stats.target_forwards for o in results)
                seconds[name] += time.perf_counter() - started
                outputs[name] += new
                progress.update(1)
        timings = {}
        for name in names:
            tokens = sum(map(len, outputs[name]))
            timings[name] = (tokens / seconds[name], outputs[name], tokens / forwards[name] if forwards[name] else None)
        rows.append((size, timings))
        progress.write(
            f"batch {size}: " + ", ".join(f"{name} {rate:.1f} tok/s" for name, (rate, *_) in timings.items())
        )
    progress.close()
    header = (
        f"Command: `python scripts/benchmark.py {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
        f"Machine: {device_name(model.device)}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}.  \n"
        f"{len(prompts)} first turns, {args.max_new_tokens} new tokens at most, {dtype_name(model.dtype)}, greedy, "
        f"{args.rounds} round(s); total new tokens per second (ours / HF, and tau: "
        "a row's new tokens per target pass it took part in, in parentheses). HF decodes the prompts in chunks of the "
        "batch size; ours keeps at most that many rows at once, a prompt joining as another finishes. The last column "
        f"counts the first {len(alone)} rows identical to HF generate() of that prompt alone (in every round).\n\n"
    )
    table = (
        "| batch | HF generate() batched | "
        + " | ".join(runs)
        + " | identical |\n|---|---|"
        + "---|" * len(runs)
        + "---|\n"
    )
    for size, timings in rows:
        hf = timings["hf"][0]
        cells = " | ".join(
            f"{timings[name][0]:.1f} ({timings[name][0] / hf:.2f}x, tau {timings[name][2]:.2f})" for name in runs
        )
        same = ", ".join(f"{identical_rows(timings[name][1], alone, len(prompts))}/{len(alone)}" for name in runs)
        table += f"| {size} | {hf:.1f} | {cells} | {same} |\n"
    print("\n" + header + table)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(header + table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    parser.add_argument(
        "--model", default=None, help="hub id or directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--methods", nargs="+", default=["hf", "hf-lookup", "eagle", "eagle+lookup"], choices=METHODS)
    parser.add_argument("--eagle", help="EAGLE head checkpoint directory")
    parser.add_argument("--medusa", help="Medusa heads checkpoint directory")
    parser.add_argument(
        "--early-exit", help="early-exit head checkpoint directory, or an exit layer number (the untrained exit)"
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=None,
        help="fixed trees' depth (default: EAGLE and early exit 5, Medusa its head count)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="fixed trees' width a level (default: EAGLE and early exit 4, Medusa its own)",
    )
    parser.add_argument("--nodes", type=int, default=15, help="at most this many draft nodes (the root comes on top)")
    parser.add_argument(
        "--tree",
        choices=["calibrated", "fixed"],
        default="calibrated",
        help="calibrated: each step keeps the drafts that pay for themselves on this machine (inference.calibrate); "
        "fixed: always --nodes",
    )
    parser.add_argument(
        "--no-fallback",
        action="store_true",
        help="our methods draft at every step, even where plain decoding would be faster",
    )
    parser.add_argument(
        "--no-context-vocab",
        action="store_true",
        help="heads draft from their own draft vocabulary only, not also the tokens of the prompt and output so far "
        "(needs --tree fixed)",
    )
    parser.add_argument("--limit", type=int, default=None, help="at most this many questions")
    parser.add_argument("--per-category", type=int, default=None, help="the first N questions of each category")
    parser.add_argument(
        "--shard",
        type=parse_shard,
        default=None,
        metavar="K/N",
        help="answer every N-th question from the K-th (0-based)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="our methods decode with compiled passes (inference.compiled); HF generate() stays eager",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="float32 (default, exact), bfloat16, or auto: bfloat16 where this machine computes it faster",
    )
    parser.add_argument("--device", default="cpu", help="where the target runs: cpu (default) or cuda")
    parser.add_argument("--out", default=None, help="write OUT.json, OUT.md and OUT.png")
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="throughput instead: first turns in batches of these sizes, HF generate() batched beside ours",
    )
    parser.add_argument(
        "--reference-rows",
        type=int,
        default=4,
        help="with --batch-sizes: how many first rows are compared with HF generate() of that prompt alone",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --batch-sizes: how many times every method decodes all the prompts, in turn",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="SHARD.json",
        help="instead of a run: merge the results of one run's shards (--shard K/N) into --out",
    )
    args = parser.parse_args(argv)
    if args.merge:
        return merge_shards(args.merge, args.out)
    if args.no_context_vocab and args.tree != "fixed":
        parser.error("--no-context-vocab builds the heads' drafters with a fixed tree: add --tree fixed")
    if args.reference_rows < 1:
        parser.error(f"--reference-rows must be at least 1, got {args.reference_rows}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.batch_sizes:
        return batch_throughput(args, argv)
    if "hf" in args.methods and args.methods[0] != "hf":
        args.methods = ["hf"] + [m for m in args.methods if m != "hf"]

    model, tokenizer = load_target(args.model, dtype=args.dtype, device=args.device, compile=args.compile)
    heads = load_method_heads(args, model)
    compile_seconds = warm_up(model, list(heads.values()))
    runners = build_methods(args, model, heads)
    questions = pick(read_questions(args.questions), args.per_category, args.limit, args.shard)
    warm = chat_prompt(tokenizer, ["Hello"])
    for run in runners.values():  # warm-up, outside the measurement
        run(warm[:16])

    records = []
    progress = tqdm(questions, desc="questions")
    for q in progress:
        answers = []
        for turn in range(len(q["turns"])):
            prompt = chat_prompt(tokenizer, q["turns"][: turn + 1], answers)
            record = {
                "question_id": q["question_id"],
                "category": q["category"],
                "turn": turn,
                "tokens": {},
                "seconds": {},
                "forwards": {},
                "stats": {},
            }
            for name, run in runners.items():
                record["tokens"][name], record["seconds"][name], record["forwards"][name], record["stats"][name] = run(
                    prompt
                )
            if "hf" in runners:
                record["divergence"] = {
                    name: divergence(model, prompt, tokens, record["tokens"]["hf"])
                    for name, tokens in record["tokens"].items()
                    if tokens != record["tokens"]["hf"]
                }
            records.append(record)
            overall = summarise(records, args.methods)["overall"]  # a long run shows where it is heading
            progress.set_postfix({f"tau {m}": f"{s['tau']:.2f}" for m, s in overall.items() if s["tau"] is not None})
            first = record["tokens"][args.methods[0]]  # the baseline's answer is fed back to every method
            answers.append(tokenizer.decode(first, skip_special_tokens=True))

    summary = summarise(records, args.methods)
    header = (
        f"Command: `python scripts/benchmark.py {' '.join(argv if argv is not None else sys.argv[1:])}`  \n"
        f"Machine: {device_name(model.device)}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}.  \n"
        f"{len(questions)} questions, {len(records)} turns, {args.max_new_tokens} new tokens per turn, "
        f"{dtype_name(model.dtype)}, greedy."
        + (
            f"  \nOur methods' passes compiled (AOTInductor; {compile_seconds:.0f} s to compile or load first; HF "
            "generate() eager)."
            if args.compile
            else ""
        )
    )
    write_result(args.out, {"args": vars(args), "header": header, "summary": summary, "records": records}, args.methods)


if __name__ == "__main__":
    from inference.cli import run

    run(main, "benchmark.py")
