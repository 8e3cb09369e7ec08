"""Build the compiled passes ahead of time, so that no later call waits for them.

    python -m inference.compile --heads checkpoints/smollm2-135m-instruct-eagle --dtype auto

The first generate() call on a machine builds them itself (inference.compiled); this does it now, for a target
and its heads, and says where they are kept. A later process loads them in seconds.
"""

from __future__ import annotations

import argparse

from .compiled import decoding_pass, is_compiled
from .compiled_heads import head_passes, warm_up


def main(argv=None) -> None:
    from heads import load_heads

    from .target import load_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="HF hub id or directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--heads", default=None, help="a head checkpoint whose draft passes to build too (EAGLE, early exit, Medusa-1)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the dtype to build for (auto, the default: bfloat16 where this machine computes it faster)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    model, _ = load_target(args.model, dtype=args.dtype, device=args.device, tokenizer=False)
    heads = load_heads(args.heads, model) if args.heads else None
    seconds = warm_up(model, heads)
    if not is_compiled(model):
        raise SystemExit("not compiled: the warning above says why; generate() decodes this model eagerly")
    print(f"ready in {seconds:.0f} s:")
    for passes in (decoding_pass(model), *head_passes(heads, model)):
        for path in passes.paths:
            print(f"  {passes.what}: {path}")


if __name__ == "__main__":
    from .cli import run

    run(main, "python -m inference.compile")
