"""Answer one prompt with the shipped EAGLE head (plus prompt lookup), streaming, then compare its speed with our
plain loop (the same compiled passes, no drafts) and with HF generate().

python scripts/demo.py ["your prompt"] [--heads DIR] [--dtype auto|float32|bfloat16] [--no-compile]
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
from inference.compiled import is_compiled  # noqa: E402
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
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our passes compiled (the default; built once a machine, then loaded), or eager with --no-compile",
    )
    args = parser.parse_args(argv)

    model, tokenizer = load_target(dtype=args.dtype, compile=args.compile)
    dtype = dtype_name(model.dtype)
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
    generate(model, heads, prompt, max_new_tokens=8)  # warm-up for every method (and the packages), outside the timing
    generate(model, None, prompt, max_new_tokens=8)
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    passes = "compiled" if is_compiled(model) else "eager"
    print(f"target in {dtype}, our passes {passes}")

    print(f"\n> {args.prompt}\n")
    out = generate(
        model,
        heads,
        prompt,
        tokenizer=tokenizer,
        max_new_tokens=args.max_new_tokens,
        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
    )

    loop = generate(model, None, prompt, max_new_tokens=args.max_new_tokens).stats
    started = time.perf_counter()
    plain = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_new_tokens
    )
    hf_speed = (plain.shape[1] - ids.shape[1]) / (time.perf_counter() - started)
    s = out.stats
    print(f"\n| method ({dtype}) | tokens/s | speedup over HF | tau |\n|---|---|---|---|")
    print(f"| HF generate(), eager | {hf_speed:.1f} | 1.00x | 1.00 |")
    print(
        f"| our loop, no drafter, {passes} | {loop.tokens_per_second:.1f} | "
        f"{loop.tokens_per_second / hf_speed:.2f}x | 1.00 |"
    )
    print(
        f"| the default call, {passes} | {s.tokens_per_second:.1f} | {s.tokens_per_second / hf_speed:.2f}x | "
        f"{s.mean_accepted:.2f} |"
    )
    reference = plain[0, ids.shape[1] :].tolist()
    print(
        f"\nthe default call: {s.new_tokens} tokens, first after {1e3 * s.time_to_first_token:.0f} ms, "
        f"{s.tokens_per_second / loop.tokens_per_second:.2f}x our plain loop; output identical to HF's: "
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
