"""Self-distillation throughput on this machine: answer tokens per second of batched greedy generate() against
batch size, cache, dtype and threads, on the same seeded sample of training prompts.

    python scripts/distill_speed.py --prompts 64 \\
        --settings static,bfloat16,32,2 static,bfloat16,32,1 dynamic,bfloat16,32,2

Each setting is cache,dtype,batch,threads (cache: static, dynamic, or continuous for transformers' continuous
batching). A 1-thread figure times one of `workers` processes: two of them run side by side on two cores, so
python -m training.distill's throughput is about workers x that figure. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference.target import load_target  # noqa: E402
from training.config import DEFAULT_PROMPTS  # noqa: E402
from training.data import prompt_ids  # noqa: E402


def answer_tokens(rows: list[list[int]], eos: int) -> int:
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


def run(model, tokenizer, prompts: list[list[int]], cache: str, batch: int, max_new_tokens: int) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    if cache == "continuous":
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return [out.generated_tokens for out in model.generate_batch(prompts, generation_config=config).values()]
    rows = []
    for start in range(0, len(prompts), batch):
        group = sorted(prompts[start : start + batch], key=len)  # as training.distill batches them
        width = max(map(len, group))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in group])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        out = model.generate(
            input_ids=ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=eos,
            **extra,
        )
        rows += out[:, width:].tolist()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="hub id or directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--prompts-file", default=DEFAULT_PROMPTS)
    parser.add_argument(
        "--prompts", type=int, default=64, help="how many prompts (a seeded sample) each setting answers"
    )
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--settings", nargs="+", required=True, help="cache,dtype,batch,threads ...")
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in Path(args.prompts_file).read_text().split("\n") if line.strip()]
    random.Random(0).shuffle(records)
    print("| cache | dtype | batch | threads | answer tokens | seconds | tokens/s |\n|---|---|---|---|---|---|---|")
    for setting in args.settings:
        cache, dtype, batch, threads = setting.split(",")
        if cache not in ("static", "dynamic", "continuous"):
            parser.error(f"{setting}: the cache is static, dynamic or continuous")
        torch.set_num_threads(int(threads))
        model, tokenizer = load_target(args.model, dtype=dtype, compile=False)
        prompts = [prompt_ids(tokenizer, [{"role": "user", "content": r["prompt"]}]) for r in records[: args.prompts]]
        run(
            model, tokenizer, prompts[: int(batch)], cache, int(batch), 8
        )  # warm-up: first-call costs out of the timing
        started = time.perf_counter()
        rows = run(model, tokenizer, prompts, cache, int(batch), args.max_new_tokens)
        seconds = time.perf_counter() - started
        tokens = answer_tokens(rows, tokenizer.eos_token_id)
        print(
            f"| {cache} | {dtype} | {batch} | {threads} | {tokens} | {seconds:.1f} | {tokens / seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
