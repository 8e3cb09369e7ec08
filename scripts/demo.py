"""Answer one prompt with the shipped EAGLE head (plus prompt lookup), streaming, then compare its speed with our
plain loop (the same compiled passes, no drafts) and with HF generate().

python scripts/demo.py ["your prompt"] [--heads DIR] [--dtype auto|float32|bfloat16] [--no-compile]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import TextStreamer

from common import SHIPPED_EAGLE, chat_prompt, divergence, hf_method, load, our_method, parser, table, time_each
from heads import load_heads
from inference import PromptLookupDrafter, generate
from inference.calibrate import calibrated_tree
from inference.compiled import is_compiled
from inference.target import dtype_name

PROMPT = "Explain in a short paragraph why the sky is blue, then list three everyday examples of light scattering."


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("prompt", nargs="?", default=PROMPT)
    p.add_argument("--heads", default=str(SHIPPED_EAGLE), help="head checkpoint (default: the shipped EAGLE head)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: bfloat16 if faster")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="our passes compiled")
    args = p.parse_args(argv)

    model, tokenizer = load(dtype=args.dtype, compile=args.compile)
    dtype, passes = dtype_name(model.dtype), "compiled" if is_compiled(model) else "eager"
    if Path(args.heads, "config.json").is_file():
        heads = load_heads(args.heads, model)  # the default call: its tree sized to this machine, lookup merged in
        calibrated_tree(model, heads, verbose=True)  # measured once, then cached: not inside the timing
        print(f"drafting with {args.heads} + prompt lookup")
    else:
        heads = PromptLookupDrafter()
        print(f"no head checkpoint at {args.heads}: drafting with prompt lookup only")
    prompt = chat_prompt(tokenizer, [args.prompt])

    hf_name, default_name = "HF generate(), eager", f"the default call, {passes}"

    def methods(tokens: int) -> dict:
        plain, default = our_method(model, tokens, heads=None), our_method(model, tokens, heads=heads)
        return {hf_name: hf_method(model, tokens), f"our loop, no drafter, {passes}": plain, default_name: default}

    time_each(methods(8), prompt)  # warm-up (and the packages loaded), outside the timing
    print(f"target in {dtype}, our passes {passes}\n\n> {args.prompt}\n")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    generate(model, heads, prompt, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens, streamer=streamer)

    runs = time_each(methods(args.max_new_tokens), prompt)
    (hf, hf_seconds), (ours, _) = runs[hf_name], runs[default_name]
    base, rows = len(hf.outputs[0]) / hf_seconds, []
    for name, (run, spent) in runs.items():
        rate, tau = len(run.outputs[0]) / spent, run.stats[0]["mean_accepted"] if run.stats else 1.0
        rows.append([name, f"{rate:.1f}", f"{rate / base:.2f}x", f"{tau:.2f}"])
    print("\n" + table([f"method ({dtype})", "tokens/s", "speedup over HF", "tau"], rows))
    reference, answer = hf.outputs[0], ours.outputs[0]
    first = 1e3 * ours.stats[0]["time_to_first_token"]
    print(f"the default call: first token after {first:.0f} ms; output identical to HF's: {answer == reference}")
    found = divergence(model, prompt, answer, reference) if answer != reference else {"steps": None}
    if found["steps"] is not None:  # bfloat16 only: allowed at a near-tie of the target itself
        verdict = "a near-tie: both are valid greedy choices" if found["near_tie"] else "NOT a near-tie: please report"
        print(
            f"first difference at token {found['position']}: both tokens are within {found['steps']:.1f} {dtype} "
            f"rounding steps of the target's top logit there ({verdict})"
        )


if __name__ == "__main__":
    from inference.cli import run

    run(main, "demo.py")
