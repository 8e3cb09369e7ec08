"""Command line: answer a prompt (or chat) with speculative decoding, streaming the output.

    python -m inference "Summarise the plot of Hamlet." --heads checkpoints/smollm2-135m-instruct-eagle --stats
    python -m inference --chat --heads checkpoints/smollm2-135m-instruct-eagle --lookup
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from transformers import TextStreamer

from heads import load_heads

from . import DynamicTreeSpec, PromptLookupDrafter, generate, load_target
from .calibrate import load_or_measure
from .cli import run
from .drafters import as_drafter, medusa_tree_spec


def parse_tree(text: str | None, heads, model):
    """'depth,top_k,nodes' for an EAGLE head, 'N' (nodes) for Medusa; by default sized to this machine at every step."""
    if heads is None:
        return None
    eagle = getattr(heads.config, "kind", "") == "eagle"
    if text in (None, "auto"):  # from this machine's measured pass costs
        if eagle:
            spec = DynamicTreeSpec()
            return replace(spec, cost=load_or_measure(model, heads, spec, verbose=True))
        return medusa_tree_spec(heads, cost=load_or_measure(model, verbose=True))
    usage = "auto or depth,top_k,nodes (e.g. 5,4,15)" if eagle else "auto or the number of draft nodes (e.g. 15)"
    try:
        numbers = [int(x) for x in text.split(",")]
    except ValueError:
        numbers = []
    if len(numbers) != (3 if eagle else 1):
        raise ValueError(f"--tree for {'an EAGLE head' if eagle else 'Medusa heads'} is {usage}, got {text!r}")
    return DynamicTreeSpec(*numbers) if eagle else medusa_tree_spec(heads, nodes=numbers[0])


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m inference", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", help="one prompt to answer (omit with --chat)")
    parser.add_argument("--chat", action="store_true", help="an interactive conversation; an empty line ends it")
    parser.add_argument("--model", default=None, help="hub id or directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--heads", default=None, help="a head checkpoint directory (EAGLE or Medusa)")
    parser.add_argument("--lookup", action="store_true", help="merge prompt-lookup drafts into the tree")
    parser.add_argument("--tree", default=None, help="auto (default: sized to this machine, see inference.calibrate); or EAGLE: depth,top_k,nodes; Medusa: nodes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                        help="float32 (default) is exact; auto picks bfloat16 where this machine computes it faster")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--stats", action="store_true", help="print tau, tokens/s and target forwards after each answer")
    args = parser.parse_args(argv)
    if not args.chat and not args.prompt:
        parser.error("give a prompt, or --chat for a conversation")

    model, tokenizer = load_target(args.model, dtype=args.dtype)
    heads = load_heads(args.heads, model) if args.heads else None
    tree = parse_tree(args.tree, heads, model)
    drafters = [d for d in (heads, PromptLookupDrafter() if args.lookup else None) if d is not None]
    drafter = drafters[0] if len(drafters) == 1 else (drafters or None)
    as_drafter(drafter, model, tree)  # a tree that does not fit the heads is refused now, not after the first question

    messages = []

    def answer(text: str) -> None:
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out = generate(model, drafter, prompt, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, tree=tree, seed=args.seed,
                       streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
        messages.append({"role": "assistant", "content": out.text})
        if args.stats:
            s = out.stats
            print(f"[{s.new_tokens} tokens in {s.seconds:.2f} s: {s.tokens_per_second:.1f} tokens/s, "
                  f"tau {s.mean_accepted:.2f}, {s.target_forwards} target forwards]", file=sys.stderr)

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
