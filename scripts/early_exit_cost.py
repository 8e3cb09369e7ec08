"""What an early-exit draft costs against the exit layer: one pass of the first N layers over 1 token (a draft
level of a chain; the root alone, as a draft sharing the target's cache would run it) and over k tokens (the
catch-up pass over the tokens committed since the last proposal, which a draft with its own cache runs), and
how often the untrained exit's top token is the target's own next token on the target's own answers (the
corpus). Costs are relative to one token through the whole target, with `--context` tokens cached; medians of
`--repeats`.

    python scripts/early_exit_cost.py --dtype bfloat16 --layers 4 6 8 10 12 15 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from heads import EarlyExitConfig, EarlyExitHead  # noqa: E402
from inference import load_target  # noqa: E402
from inference.calibrate import device_name, median_seconds  # noqa: E402
from training.corpus import read_corpus  # noqa: E402


@torch.inference_mode()
def pass_seconds(forward, tokens: torch.Tensor, context: int, k: int, repeats: int) -> float:
    """One pass of `forward(ids, cache=...)` over k new tokens on top of `context` cached ones, cropped back after
    each."""
    cache = DynamicCache()
    forward(tokens[None, :context], cache=cache)

    def step():
        forward(tokens[None, context : context + k], cache=cache)
        cache.crop(-k)

    return median_seconds(step, repeats)


@torch.inference_mode()
def exit_agreement(model, head, records: list[dict]) -> float:
    """How often the exit's top token (through the output projection) is the target's own greedy next token,
    over the answer positions of corpus records."""
    agree = total = 0
    lm_head = model.get_output_embeddings()
    for record in records:
        ids = torch.tensor(record["prompt_ids"] + record["answer_ids"])
        answer = slice(len(record["prompt_ids"]) - 1, ids.shape[0] - 1)  # positions whose next token is an answer token
        target = model(ids[None]).logits[0, answer].argmax(-1)
        drafted = lm_head(head(ids[None])[0, answer]).argmax(-1)
        agree += int((target == drafted).sum())
        total += target.shape[0]
    return agree / total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 6, 8, 10, 12, 15, 20])
    parser.add_argument("--catch-up", type=int, nargs="+", default=[2, 3, 4], help="token counts of the catch-up pass")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--corpus",
        default="data/distill/smollm2-135m-instruct-bfloat16",
        help="the target's own answers (training.distill)",
    )
    parser.add_argument("--answers", type=int, default=20, help="how many of them, for the agreement column")
    args = parser.parse_args(argv)

    model, _ = load_target(args.model, dtype=args.dtype, compile=False)
    tokens = torch.randint(
        model.config.vocab_size, (args.context + max(args.catch_up),), generator=torch.Generator().manual_seed(0)
    )
    records = read_corpus(args.corpus)[: args.answers]

    one = pass_seconds(
        lambda ids, cache: model(input_ids=ids, cache=cache, use_cache=True), tokens, args.context, 1, args.repeats
    )
    print(
        f"{device_name(model.device)}, {model.dtype}, {torch.get_num_threads()} threads; one target pass over 1 token: "
        f"{1e3 * one:.1f} ms\n"
    )
    header = (
        "| exit layer | 1 token | " + " | ".join(f"{k} tokens" for k in args.catch_up) + " | exit's top-1 = target's |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for layer in args.layers:
        head = EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=layer, lora_rank=None), model).eval()
        costs = [pass_seconds(head, tokens, args.context, k, args.repeats) / one for k in [1, *args.catch_up]]
        agreement = exit_agreement(model, head, records)
        print(f"| {layer} | " + " | ".join(f"{c:.2f}" for c in costs) + f" | {agreement:.1%} |", flush=True)


if __name__ == "__main__":
    main()
