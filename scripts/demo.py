"""Answer one prompt with the shipped EAGLE head (plus prompt lookup), streaming, then compare with plain decoding.

python scripts/demo.py ["your prompt"] [--heads DIR] [--dtype auto|float32|bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the project
from heads import load_heads  # noqa: E402
from inference import PromptLookupDrafter, generate, load_target  # noqa: E402
from inference.calibrate import calibrated_tree  # noqa: E402
from inference.numerics import near_tie  # noqa: E402
from inference.target import dtype_name  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-eagle"
PROMPT = "Explain in a short paragraph why the sky is blue, then list three everyday examples of light scattering."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default=PROMPT)
    parser.add_argument(
        "--heads", default=str(SHIPPED), help="head checkpoint directory (default: the shipped EAGLE head)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto (default): bfloat16 where this machine computes it faster than float32 (CPUs with "
        "AVX512-BF16 or AMX, where a pass over many tokens costs little more than over one), else float32",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    model, tokenizer = load_target(dtype=args.dtype)
    dtype = dtype_name(model.dtype)
    print(f"target in {dtype}")
    heads = None  # the default call: the head's tree sized to this machine, prompt lookup merged into it
    if Path(args.heads, "config.json").is_file():
        heads = load_heads(args.heads, model)
        calibrated_tree(model, heads, verbose=True)  # measured once, then cached: not inside the timing
        print(f"drafting with {args.heads} + prompt lookup")
    else:
        heads = PromptLookupDrafter()
        print(f"no head checkpoint at {args.heads}: drafting with prompt lookup only")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    ids = torch.tensor([prompt["input_ids"]])
    generate(model, heads, prompt, max_new_tokens=8)  # warm-up for both, outside the timing
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)

    print(f"\n> {args.prompt}\n")
    out = generate(
        model,
        heads,
        prompt,
        tokenizer=tokenizer,
        max_new_tokens=args.max_new_tokens,
        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
    )

    started = time.perf_counter()
    plain = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_new_tokens
    )
    plain_seconds = time.perf_counter() - started
    plain_tokens = plain.shape[1] - ids.shape[1]
    s = out.stats
    print(
        f"\nspeculative: {s.new_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.1f} tokens/s, "
        f"tau {s.mean_accepted:.2f} tokens per target forward, first token after {1e3 * s.time_to_first_token:.0f} ms"
    )
    print(
        f"plain HF generate(): {plain_tokens} tokens in {plain_seconds:.2f} s = {plain_tokens / plain_seconds:.1f} "
        "tokens/s"
    )
    reference = plain[0, ids.shape[1] :].tolist()
    print(
        f"speedup {s.tokens_per_second / (plain_tokens / plain_seconds):.2f}x; output identical to plain decoding: "
        f"{out.token_ids == reference}"
    )
    if out.token_ids != reference:  # bfloat16 only: allowed at a near-tie of the target itself
        at = next(
            (i for i, (a, b) in enumerate(zip(out.token_ids, reference)) if a != b),
            min(len(out.token_ids), len(reference)),
        )
        if at < min(len(out.token_ids), len(reference)):
            tie, steps = near_tie(model, prompt["input_ids"] + reference[:at], out.token_ids[at], reference[at])
            print(
                f"first difference at token {at}: both tokens are within {steps:.1f} {dtype} rounding steps of the "
                "target's top logit there "
                f"({'a near-tie: both are valid greedy choices' if tie else 'NOT a near-tie: please report this'})"
            )


if __name__ == "__main__":
    from inference.cli import run

    run(main, "demo.py")
