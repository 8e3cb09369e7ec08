"""Convert draft heads between this project's checkpoints and the published formats (a command of this layer, not of
`heads`: it loads the target, which heads.formats only takes as an argument).

    python -m inference.convert SRC DST --to {ours,eagle,eagle3,speculators,medusa} [--model M]

SRC is any directory `heads.load_heads` reads (its format is recognised from its files); DST must be new or
empty. The target model (`--model`, default the embedded SmolLM2-135M-Instruct) is loaded to check the heads
against it and to supply what a format copies from it (the token embedding, Medusa's per-head lm_heads).
Weights are written in `--dtype` (default: the dtype they were read in, float32 for a pickle), so a round trip
gives the same tensors back.
"""

from __future__ import annotations

import argparse

import torch

from heads.formats import EXPORTS, detect_format, write_format
from heads.io import load_heads, save_heads

from .target import load_target


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m inference.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "src", help="a head directory: ours, EAGLE-1/2, EAGLE-3 (SafeAILab, SpecForge), speculators or Medusa"
    )
    parser.add_argument("dst", help="a new or empty directory to write")
    parser.add_argument("--to", required=True, choices=["ours", *EXPORTS], help="the format to write")
    parser.add_argument(
        "--model",
        default=None,
        help="the heads' target: hub id or directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the written weights' dtype (default: as read)",
    )
    parser.add_argument(
        "--full-vocabulary",
        action="store_true",
        help="medusa: write heads with a reduced draft vocabulary as heads that draft from every token",
    )
    args = parser.parse_args(argv)

    source = detect_format(args.src)
    model, _ = load_target(args.model, dtype=torch.float32, tokenizer=False, compile=False)
    heads = load_heads(args.src, model)
    dtype = getattr(torch, args.dtype) if args.dtype else _stored_dtype(args.src)
    if args.to == "ours":
        save_heads(heads, args.dst, model, dtype=dtype)
    else:
        write_format(heads, args.dst, args.to, model, dtype=dtype, full_vocabulary=args.full_vocabulary)
    print(f"{args.src} ({source}) -> {args.dst} ({args.to}, {str(dtype).removeprefix('torch.')})")


def _stored_dtype(path) -> torch.dtype:
    """The floating-point dtype of the weights in a head directory (float32 when it cannot tell)."""
    from pathlib import Path

    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():
                tensor = weights.get_slice(name)
                dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(tensor.get_dtype())
                if dtype is not None:
                    return dtype
    return torch.float32


if __name__ == "__main__":
    from .cli import run

    run(main, "python -m inference.convert")
