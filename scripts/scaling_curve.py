"""tau against training tokens: how much of its own text a target needs for its heads to draft well.

    python scripts/scaling_curve.py docs/results/scaling-eagle-*.json --out docs/results/scaling-eagle

Each input is a benchmark result (scripts/benchmark.py --out) of one head; results of the same head (a run split
with --shard K/N) are merged. The head's own config.json (saved with its weights) says how many loss tokens and
sequences it was trained on. Writes OUT.md (a table: overall and per-category tau by training tokens) and OUT.png
(tau against tokens, log scale; the overall curve and the lowest category's).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from benchmark import summarise


def head_of(result: dict, path: Path) -> tuple[str, str]:
    """(method, checkpoint) of a benchmark result of one head."""
    methods = [m for m in result["args"]["methods"] if m in ("eagle", "medusa")]
    if len(methods) != 1:
        raise SystemExit(
            f"{path}: expected a run of one head method (eagle or medusa), got {result['args']['methods']}"
        )
    return methods[0], result["args"][methods[0]]


def point(paths: list[Path]) -> dict:
    """One head's figures from its results (several when its run was split with --shard)."""
    results = [json.loads(path.read_text()) for path in paths]
    method, head = head_of(results[0], paths[0])
    records = [r for result in results for r in result["records"]]
    if len({(r["question_id"], r["turn"]) for r in records}) != len(records):
        raise SystemExit(
            f"{', '.join(map(str, paths))}: these results answer some questions twice (the same --shard twice?)"
        )
    checkpoint = Path(head)
    config = json.loads((checkpoint / "config.json").read_text())
    training = config.get("training")
    if not training:
        raise SystemExit(
            f"{checkpoint}/config.json records no training (tokens, sequences): was it written by "
            "training/train_heads.py?"
        )
    summary = summarise(records, [method])
    return {
        "head": str(checkpoint),
        "method": method,
        "tokens": training["tokens"],
        "sequences": training["sequences"],
        "steps": training["steps"],
        "minutes": training["train_seconds"] / 60,
        "tau": summary["overall"][method]["tau"],
        "categories": {c: summary[c][method]["tau"] for c in summary if c != "overall"},
        "turns": len(records),
        "setting": setting(results[0]["args"]),
    }


def setting(args: dict) -> str:
    """How tau was measured, from a benchmark run's arguments: the points of one curve must share it."""
    tree = f"{args['tree']} tree of {args['nodes']} drafts (depth {args['depth']}, top-k {args['top_k']})"
    fallback = ", no fallback" if args["no_fallback"] else ""
    return (
        f"{args['dtype']} on {args.get('device', 'cpu')}, {args['max_new_tokens']} new tokens a turn, {tree}{fallback}"
    )


def table(points: list[dict]) -> str:
    categories = sorted({c for p in points for c in p["categories"]})
    lines = [
        "| answers (sequences) | loss tokens | steps | training min | tau | lowest category | "
        + " | ".join(c.replace("mt_bench/", "mt-") for c in categories)
        + " |",
        "|" + "---|" * (6 + len(categories)),
    ]
    for p in points:
        low = min(p["categories"], key=p["categories"].get)
        lines.append(
            f"| {p['sequences']:,} | {p['tokens']:,} | {p['steps']:,} | {p['minutes']:.0f} | **{p['tau']:.2f}** | "
            f"{p['categories'][low]:.2f} ({low.replace('mt_bench/', 'mt-')}) | "
            + " | ".join(f"{p['categories'].get(c, float('nan')):.2f}" for c in categories)
            + " |"
        )
    return "\n".join(lines) + "\n"


def chart(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [p["tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(tokens, [p["tau"] for p in points], "o-", label="whole dev set")
    ax.plot(tokens, [min(p["categories"].values()) for p in points], "s--", label="lowest category")
    for p in points:
        ax.annotate(
            f"{p['tau']:.2f}",
            (p["tokens"], p["tau"]),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_xlabel("training loss tokens (the target's own answers)")
    ax.set_ylabel("tau (new tokens per target pass)")
    ax.set_title(f"{points[0]['method']} head: acceptance against training data")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "results",
        nargs="+",
        type=Path,
        help="benchmark result .json files of one head each (a head's shards are merged)",
    )
    parser.add_argument("--out", type=Path, required=True, help="write OUT.md and OUT.png")
    args = parser.parse_args(argv)
    by_head = defaultdict(list)
    for path in args.results:
        by_head[head_of(json.loads(path.read_text()), path)].append(path)
    points = sorted((point(paths) for paths in by_head.values()), key=lambda p: p["tokens"])
    if len({p["turns"] for p in points}) != 1:
        raise SystemExit(
            f"the results cover different question sets ({sorted({p['turns'] for p in points})} turns): compare like "
            "with like"
        )
    if len({p["setting"] for p in points}) != 1:
        raise SystemExit(
            f"the results were measured differently ({sorted({p['setting'] for p in points})}): compare like with like"
        )
    text = f"tau on {points[0]['turns']} turns, {points[0]['setting']}.\n\n" + table(points)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    chart(points, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.md')} and .png")


if __name__ == "__main__":
    main()
