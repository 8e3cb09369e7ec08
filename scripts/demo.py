"""Answer one prompt with the shipped EAGLE head (plus prompt lookup), streaming, then compare with plain decoding.

    python scripts/demo.py ["your prompt"] [--heads DIR] [--dtype bfloat16]
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

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-eagle"
PROMPT = "Explain in a short paragraph why the sky is blue, then list three everyday examples of light scattering."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default=PROMPT)
    parser.add_argument("--heads", default=str(SHIPPED), help="head checkpoint directory (default: the shipped EAGLE head)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    model, tokenizer = load_target(dtype=args.dtype)
    drafters = [PromptLookupDrafter()]
    if Path(args.heads, "config.json").is_file():
        drafters.insert(0, load_heads(args.heads, model))
        print(f"drafting with {args.heads} + prompt lookup")
    else:
        print(f"no head checkpoint at {args.heads}: drafting with prompt lookup only")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    print(f"\n> {args.prompt}\n")
    out = generate(model, drafters, prompt, tokenizer=tokenizer, max_new_tokens=args.max_new_tokens,
                   streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))

    ids = torch.tensor([prompt["input_ids"]])
    started = time.perf_counter()
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_new_tokens)
    plain_seconds = time.perf_counter() - started
    plain_tokens = plain.shape[1] - ids.shape[1]
    s = out.stats
    print(f"\nspeculative: {s.new_tokens} tokens in {s.seconds:.2f} s = {s.tokens_per_second:.1f} tokens/s, "
          f"tau {s.mean_accepted:.2f} tokens per target forward")
    print(f"plain HF generate(): {plain_tokens} tokens in {plain_seconds:.2f} s = {plain_tokens / plain_seconds:.1f} tokens/s")
    print(f"speedup {s.tokens_per_second / (plain_tokens / plain_seconds):.2f}x; "
          f"output identical to plain decoding: {out.token_ids == plain[0, ids.shape[1]:].tolist()}")


if __name__ == "__main__":
    main()
