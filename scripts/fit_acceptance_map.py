"""Fit a head's map from its draft probabilities to the target's acceptance (inference.acceptance_map) on held-out
prompts, and write it into the checkpoint's config.json.

    python scripts/questions.py heldout --config configs/smollm2-135m-instruct-eagle-corpus-continued.yaml \\
        --out /tmp/heldout.jsonl
    python scripts/fit_acceptance_map.py checkpoints/smollm2-135m-instruct-eagle --questions /tmp/heldout.jsonl --write

The head decodes each first turn greedily with a fixed dynamic tree, keeping every step's drafts and whether the target
wrote their path; the map is fitted (logistic regression) on the drafts whose parent the target wrote, and replaying
the steps estimates the drafts the old and new scores get accepted. Use prompts the head did not train on, not dev.
For every head that grows dynamic trees (EAGLE, early exit, sequential Medusa); docs/training.md has more.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from common import command, first_turns, load, parser, read_questions, table
from heads.config import head_config_from_dict
from heads.files import read_checkpoint_config, written_atomically
from inference import DynamicTreeSpec, generate
from inference.acceptance_map import acceptance_log_probs, draft_outcomes, fit_weights, path_scores
from inference.drafters import as_drafter
from inference.drafters.dynamic import DynamicTreeDrafter, drafted_nodes
from inference.tree import Tree
from inference.tree_select import select_best_nodes


def record_drafts(model, head, prompts: list[torch.Tensor], tree: DynamicTreeSpec, max_new_tokens: int) -> list:
    """Every step's drafts of every prompt, scored by the head itself, each as (the grown nodes as a Tree, their
    log-probabilities given their parents [N], whether the target wrote their paths [N])."""
    head.config.acceptance_map = None  # record the head's own probabilities
    drafter = as_drafter(head, model, tree)
    if not isinstance(drafter, DynamicTreeDrafter):
        raise SystemExit(f"{type(drafter).__name__} does not grow dynamic trees: it has no draft scores to map")
    steps, grown = [], []

    def keep(texts, nodes, limits, k):
        count = drafted_nodes(limits[0], k)
        row = (nodes.tokens[0, :count], nodes.parents[0, :count], nodes.scores[0, :count])
        grown.append((texts[0].shape[0], *(t.cpu() for t in row)))

    drafter.on_grown = keep
    for ids in tqdm(prompts, desc="decoding held-out prompts", unit="prompt"):
        grown.clear()
        out = generate(model, drafter, ids, max_new_tokens=max_new_tokens, lookup=False, fallback=False)
        text = torch.cat([ids, torch.as_tensor(out.token_ids)])
        for start, tokens, parents, scores in grown:
            nodes = Tree.from_parents(tokens, parents, check=False)
            steps.append((nodes, *draft_outcomes(nodes, scores, start, text)))
    return steps


def accepted_drafts(steps: list, nodes: int, weights: list[float] | None) -> float:
    """Drafts a step would get accepted, on average over `steps`, verifying the `nodes` best by path score
    (mapped by `weights`, or the head's own)."""
    total = 0
    for tree, local, accepted in steps:
        if weights is not None:
            local = torch.cat([local[:1], acceptance_log_probs(local[1:], weights)])
        keep = select_best_nodes(path_scores(tree, local), tree.depth, nodes)
        total += int((tree.depth[keep] * accepted[keep]).max())
    return total / max(len(steps), 1)


def map_table(local: torch.Tensor, accepted: torch.Tensor, weights: list[float]) -> str:
    """Markdown: by the head's probability, how often the target accepted, and what the map says."""
    edges = [0.0, 0.02, 0.14, 0.37, 0.61, 0.82, 0.95, 1.0001]
    p, mapped, rows = local.exp(), acceptance_log_probs(local, weights).exp(), []
    for low, high in zip(edges, edges[1:]):
        if (inside := (p >= low) & (p < high)).any():
            figures = (p[inside].mean(), accepted[inside].double().mean(), mapped[inside].mean())
            rows.append([f"{low:.2f}-{min(high, 1):.2f}", f"{int(inside.sum()):,}", *(f"{x:.3f}" for x in figures)])
    return table(["head's probability", "drafts", "head (mean)", "target accepted", "map (mean)"], rows)


def write_weights(checkpoint: Path, weights: list[float]) -> None:
    """Set head.acceptance_map in the checkpoint's config.json, atomically (checked first)."""
    config = read_checkpoint_config(checkpoint)
    config["head"]["acceptance_map"] = list(weights)
    head_config_from_dict(config["head"])  # refuse to write what load_heads would refuse to read
    with written_atomically(checkpoint / "config.json") as staging:
        staging.write_text(json.dumps(config, indent=2) + "\n")


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("checkpoint", help="a head checkpoint directory of this project")
    p.add_argument("--questions", required=True, help="held-out prompts (scripts/questions.py heldout)")
    p.add_argument("--model", default=None, help="hub id or directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--limit", type=int, default=64, help="at most this many questions (first turns)")
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--nodes", type=int, default=15, help="draft nodes the replay verifies a step")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--write", action="store_true", help="write the fitted map into CHECKPOINT/config.json")
    args = p.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    read_checkpoint_config(checkpoint)  # a clear error for a foreign or broken checkpoint, before the model loads

    model, tokenizer, head = load(args.model, checkpoint, dtype="float32", compile=False)
    prompts = first_turns(tokenizer, read_questions(args.questions, args.limit))
    tree = DynamicTreeSpec(depth=args.depth, top_k=args.top_k, nodes=args.nodes)
    steps = record_drafts(model, head, prompts, tree, args.max_new_tokens)

    # the drafts whose parent the target wrote: whether the target wrote them too
    wrote_parent = [accepted[tree.parents[1:]] for tree, _, accepted in steps]
    local = torch.cat([step[1][1:][mask] for step, mask in zip(steps, wrote_parent)])
    accepted = torch.cat([step[2][1:][mask] for step, mask in zip(steps, wrote_parent)])
    weights = fit_weights(local, accepted)
    before, after = accepted_drafts(steps, args.nodes, None), accepted_drafts(steps, args.nodes, weights)
    report = (
        f"Command: `{command('fit_acceptance_map.py', argv)}`  \n"
        f"{len(prompts)} prompts, {len(steps):,} decode steps, {local.numel():,} drafts whose parent the target wrote; "
        f"tree depth {args.depth}, top-k {args.top_k}, {args.nodes} nodes, float32.\n\n"
        f"Fitted map: w0 {weights[0]:.4f}, w1 {weights[1]:.4f}, w2 {weights[2]:.4f}.\n\n"
        + map_table(local, accepted, weights)
        + f"\nReplaying the recorded steps: tau {1 + before:.3f} with the head's own scores, {1 + after:.3f} with "
        "the map's (the same steps: an estimate).\n"
    )
    print(report)
    if args.write:
        write_weights(checkpoint, weights)
        print(f"wrote head.acceptance_map into {checkpoint / 'config.json'}")


if __name__ == "__main__":
    main()
