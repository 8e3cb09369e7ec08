"""Command line: answer a prompt (or chat) with speculative decoding, streaming the output.

python -m inference "Summarise the plot of Hamlet." --heads checkpoints/smollm2-135m-instruct-eagle --stats
python -m inference --chat --heads checkpoints/smollm2-135m-instruct-eagle --no-lookup
"""

from __future__ import annotations

import argparse
import sys

from transformers import TextStreamer

from heads import load_heads

from . import DynamicTreeSpec, generate, load_target, warm_up
from .calibrate import calibrated_tree
from .cli import run
from .drafters import as_drafter, medusa_tree_spec
from .generate import with_defaults


def parse_tree(text: str | None, heads, model):
    """'depth,top_k,nodes' for an EAGLE or early-exit head, 'N' (nodes) for Medusa; by default sized to this machine
    at every step."""
    if heads is None:
        return None
    eagle = getattr(heads.config, "kind", "") in ("eagle", "early_exit")  # both grow dynamic trees
    if text in (None, "auto"):  # from this machine's measured pass costs
        return calibrated_tree(model, heads, verbose=True)
    usage = "auto or depth,top_k,nodes (e.g. 5,4,15)" if eagle else "auto or the number of draft nodes (e.g. 15)"
    try:
        numbers = [int(x) for x in text.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) != (3 if eagle else 1):
        raise ValueError(
            f"--tree for {'an EAGLE or early-exit head' if eagle else 'Medusa heads'} is {usage}, got {text!r}"
        )
    return DynamicTreeSpec(*numbers) if eagle else medusa_tree_spec(heads, nodes=numbers[0])


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m inference", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt", nargs="?", help="one prompt to answer (omit with --chat)")
    parser.add_argument("--chat", action="store_true", help="an interactive conversation; an empty line ends it")
    parser.add_argument(
        "--model", default=None, help="hub id or directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--heads", default=None, help="a head checkpoint directory (EAGLE or Medusa)")
    parser.add_argument(
        "--no-lookup", action="store_true", help="do not merge prompt-lookup drafts into the head's tree"
    )
    parser.add_argument(
        "--no-fallback", action="store_true", help="draft at every step, even where plain decoding would be faster"
    )
    parser.add_argument(
        "--tree",
        default=None,
        help="auto (default: sized to this machine, see inference.calibrate); or EAGLE: depth,top_k,nodes; Medusa: "
        "nodes",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="float32 (default) is exact; auto picks bfloat16 where this machine computes it faster",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--stats", action="store_true", help="print tau, tokens/s and target forwards after each answer"
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compiled target passes (AOTInductor: faster on a CPU, docs/benchmarks.md; built once a machine, then "
        "loaded in seconds)",
    )
    args = parser.parse_args(argv)
    if not args.chat and not args.prompt:
        parser.error("give a prompt, or --chat for a conversation")

    model, tokenizer = load_target(args.model, dtype=args.dtype, compile=args.compile)
    heads = load_heads(args.heads, model) if args.heads else None
    warm_up(model, heads)  # compiles now with a progress line, or loads what an earlier run compiled
    tree = parse_tree(args.tree, heads, model)
    as_drafter(
        with_defaults(heads, not args.no_lookup), model, tree
    )  # a tree that does not fit: refused now, not after a question

    messages = []

    def answer(text: str) -> None:
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = generate(
            model,
            heads,
            prompt,
            tokenizer=tokenizer,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            tree=tree,
            seed=args.seed,
            lookup=not args.no_lookup,
            fallback=not args.no_fallback,
            streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
        )
        messages.append({"role": "assistant", "content": out.text})
        if args.stats:
            s = out.stats
            by_depth = " ".join(f"{a:.2f}" for a in s.acceptance_by_depth) or "-"
            print(
                f"[{s.new_tokens} tokens in {s.seconds:.2f} s: {s.tokens_per_second:.1f} tokens/s, tau "
                f"{s.mean_accepted:.2f}, {s.target_forwards} target forwards ({s.plain_steps} plain); first token "
                f"{1e3 * s.time_to_first_token:.0f} ms, then {1e3 * s.time_per_output_token:.1f} ms/token; acceptance "
                f"by depth {by_depth}]",
                file=sys.stderr,
            )

    if not args.chat:
        answer(args.prompt)
        return
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            break
        if not text:
            break
        answer(text)


if __name__ == "__main__":
    run(main, "python -m inference")
