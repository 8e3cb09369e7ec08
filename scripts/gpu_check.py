"""A prepared check for one GPU: is the engine exact there, how fast is it, and where does its time go?

    .venv/bin/python scripts/gpu_check.py            # on a GPU: docs/results/gpu-<card>.md
    .venv/bin/python scripts/gpu_check.py --dry-run  # the same code paths on the CPU, tiny random models

Sections 1-4 are scripts/benchmark.py runs (RUNS) on the dev set's first question of each category: HF generate()
against the default call with the shipped EAGLE and Medusa heads and a fixed tree, float32, bfloat16 eager and
compiled, batches. 5: a Llama-3.1-8B-shaped model with random weights, a drafter replaying a trained head's accepted
lengths. 6: host synchronisations per decode step.
"""

from __future__ import annotations

import gc
import os
import random
import re
import tempfile
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import benchmark
from common import (
    DEFAULT_QUESTIONS,
    REPO,
    Run,
    Tally,
    chat_prompt,
    command,
    hf_greedy,
    load,
    parser,
    positive,
    read_questions,
    synchronize,
    table,
    timed,
)
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, save_heads
from host_syncs import recording_host_reads, recording_syncs
from inference import DynamicTreeSpec, Tree, generate
from inference.calibrate import device_name
from inference.drafters import TokenDrafter
from inference.target import default_model_dir, dtype_name

HEAD_CHECKPOINTS = {
    "eagle": REPO / "checkpoints" / "smollm2-135m-instruct-eagle",
    "medusa": REPO / "checkpoints" / "smollm2-135m-instruct-medusa",
}
FIXED = DynamicTreeSpec(depth=5, top_k=8, nodes=15)  # the benchmark's `eagle` method, no lookup, no fallback
ALONE = dict(lookup=False, fallback=False)  # a drafter alone: no prompt lookup merged, no plain steps
FIXED_TREE = f"--tree fixed --depth {FIXED.depth} --top-k {FIXED.top_k} --nodes {FIXED.nodes} --no-fallback"
RUNS = {  # sections 1-4: scripts/benchmark.py's options beside the target, heads, questions and output
    "1. Float32, eager": "--methods hf eagle-default medusa-default --dtype float32",
    "2. Bfloat16, eager": "--methods hf eagle-default medusa-default eagle --dtype bfloat16",
    "3. Bfloat16, compiled": "--methods hf eagle-default eagle --dtype bfloat16 --compile",
    "4. Batches of 1 and 8": "--methods hf eagle-default eagle --dtype bfloat16 --compile --batch-sizes 1 8",
}
SCALE, SYNCS = "5. The engine at scale: a Llama-3.1-8B-shaped model", "6. Host synchronisations per decode step"
LLAMA_8B_SHAPE = dict(  # Llama-3.1-8B's config.json
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336
)
TINY_SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
)
# ACCEPTED_LENGTHS[n]: the steps that accepted exactly n drafts in docs/results/dev2-aoti-head-default-bf16-epyc (the
# CPU stage-2 EAGLE head's default call, bfloat16, compiled), from the record's accepted_to_depth counts
ACCEPTED_LENGTHS = (278, 633, 191, 87, 49, 70, 8, 18, 22, 8, 94)
REPLAY_DEPTH = len(ACCEPTED_LENGTHS) - 1  # deep enough for the longest accepted length recorded
REPLAY_ROUNDS = 4  # runs of a prompt at most, until the loop reproduces the continuation it replays
DRY_RUN_NOTE = "\n**Dry run**: tiny random-weight models on the CPU; the figures check the script, not the engine.\n"
DRY_RUN_QUESTIONS = (
    '{"question_id": 1, "category": "writing", "turns": ["Write a short poem about the sea."]}',
    '{"question_id": 2, "category": "code", "turns": ["Write a Python function that reverses a list."]}',
)


def random_llama(shape: dict, device, dtype: torch.dtype, *, vocab: int, eos: int | None, seed: int, init=0.02):
    """A Llama of `shape` with random weights, created on `device` in `dtype` (no float32 copy on the host first:
    an 8B model would need 32 GB of it). Without `eos` it decodes to max_new_tokens, as a benchmark wants."""
    pad = eos if eos is not None else 0
    config = LlamaConfig(**shape, vocab_size=vocab, max_position_embeddings=4096, initializer_range=init)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, eos, pad
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    return model.eval()


def tiny_checkpoints(folder: Path) -> tuple[Path, dict[str, Path]]:
    """The dry run's target (a random Llama with the embedded target's tokenizer, its logits spread enough for no
    float32 near-ties) and random heads for it, the EAGLE head shaped like the shipped one."""
    tokenizer, target = AutoTokenizer.from_pretrained(default_model_dir()), folder / "target"
    eos = tokenizer.eos_token_id
    model = random_llama(TINY_SHAPE, "cpu", torch.float32, vocab=len(tokenizer), eos=eos, seed=0, init=0.15)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    torch.manual_seed(1)
    config = EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True, draft_vocab_size=48)
    eagle = EagleHead(config)
    eagle.draft_ids.copy_(torch.randperm(model.config.vocab_size)[:48].sort().values)
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=4))
    for parameter in medusa.parameters():
        torch.nn.init.normal_(parameter, std=0.05)  # not the zero init: candidates should vary
    heads = {"eagle": eagle.eval(), "medusa": medusa.eval()}
    return target, {kind: save_heads(h, folder / kind, model, dtype=torch.float32) for kind, h in heads.items()}


class ReplayDrafter(TokenDrafter):
    """Replays accepted lengths: a chain of `depth` tokens a step whose first n are the true continuation (the whole
    expected sequence, prompt included) and the rest wrong, n drawn from `lengths` (lengths[n]: how often n were
    accepted), so that a random-weight target runs at a trained head's pace."""

    def __init__(self, continuation: torch.Tensor, depth: int, vocab_size: int, lengths=ACCEPTED_LENGTHS, seed=0):
        self.continuation, self.depth, self.vocab_size = continuation, depth, vocab_size
        self.lengths, self.seed = tuple(lengths), seed
        self.reset()

    def reset(self, rows: int = 1) -> None:
        self.draws = random.Random(self.seed)  # every run of a prompt replays the same lengths, step by step

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        position = tokens.shape[0]
        truth = self.continuation[position : position + min(self.depth, max_depth)]
        right = min(self.draws.choices(range(len(self.lengths)), weights=self.lengths)[0], truth.shape[0])
        wrong = (truth[right:] + 1) % self.vocab_size  # never the target's own next token after a right prefix
        return Tree.chain(torch.cat([tokens[-1:], truth[:right], wrong]))


def expected_accepted(lengths: Sequence[int], depth: int) -> float:
    """Mean drafts accepted a step when n is drawn from `lengths` and a chain holds `depth`."""
    return sum(min(n, depth) * count for n, count in enumerate(lengths)) / sum(lengths)


def replayed_run(model, prompt: torch.Tensor, reference: list[int], limit: int, seed: int):
    """(our loop's output replaying accepted lengths, its seconds, runs, whether it reproduced what it replayed). A
    bfloat16 chain pass may part from HF's continuation at a near-tie, making every later replayed token wrong: the
    run is then repeated on the loop's own output until it reproduces it, and the last run counts."""
    truth = reference
    for runs in range(1, REPLAY_ROUNDS + 1):
        continuation = torch.cat([prompt, torch.tensor(truth, dtype=torch.long)]).to(model.device)
        drafter = ReplayDrafter(continuation, REPLAY_DEPTH, model.config.vocab_size, seed=seed)
        # each target pass waits for the device, so that target_seconds holds its device time, not its launches
        handle = model.register_forward_hook(lambda *_: synchronize())
        try:
            out, seconds = timed(lambda d=drafter: generate(model, d, prompt, max_new_tokens=limit, **ALONE))
        finally:
            handle.remove()
        if out.token_ids == truth:
            return out, seconds, runs, True
        truth = out.token_ids
    return out, seconds, REPLAY_ROUNDS, False


def scale(args, device: torch.device) -> str:
    """Section 5: HF generate() and our loop, replaying accepted lengths, on a Llama-3.1-8B-shaped model."""
    shape, vocab, length, count = (TINY_SHAPE, 97, 12, 2) if args.dry_run else (LLAMA_8B_SHAPE, 128256, 128, 8)
    model, build_seconds = timed(lambda: random_llama(shape, device, torch.bfloat16, vocab=vocab, eos=None, seed=2))
    generator, limit = torch.Generator().manual_seed(0), args.max_new_tokens
    prompts = [torch.randint(vocab, (length - i % 3,), generator=generator) for i in range(count)]
    replayed_run(model, prompts[0], hf_greedy(model, prompts[0], 8), 8, seed=0)  # untimed: the first calls
    hf, ours, parts = Tally(), Tally(), Counter()
    for index, prompt in enumerate(tqdm(prompts, desc=f"{SCALE[:2]} (prompts)")):
        reference, seconds = timed(lambda m=model, p=prompt: hf_greedy(m, p, limit))
        hf.add(Run([reference]), seconds)
        out, seconds, runs, reproduced = replayed_run(model, prompt, reference, limit, seed=index)
        s = out.stats
        ours.add(Run([out.token_ids], s.target_forwards), seconds)
        parts.update(target=s.target_seconds, draft=s.draft_seconds, loop=s.engine_seconds, steps=s.target_forwards - 1)
        parts.update(runs=runs, reproduced=reproduced, identical=out.token_ids == reference)
    described = ", ".join(f"{key.replace('_', ' ')} {getattr(model.config, key)}" for key in [*shape, "vocab_size"])
    del model  # 16 GB at the 8B shape: given back to the device now, not when the allocator next needs it
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    speeds = [
        [name, f"{t.tokens_per_second:.1f}", f"{t.tokens_per_second / max(hf.tokens_per_second, 1e-9):.2f}x"]
        + [f"{t.tau or 1.0:.2f}", f"{1e3 / max(t.tokens_per_second, 1e-9):.1f}"]
        for name, t in (("HF generate()", hf), ("our loop, replayed lengths", ours))
    ]
    total, steps = max(parts["target"] + parts["draft"] + parts["loop"], 1e-9), max(parts["steps"], 1)
    split = [
        [part, f"{parts[key]:.2f}", f"{100 * parts[key] / total:.0f}%", f"{1e3 * parts[key] / steps:.2f}"]
        for part, key in (
            ("target passes (target_seconds, the prefills included)", "target"),
            ("drafting (draft_seconds: propose and observe)", "draft"),
            ("the loop (the rest: trees, masks, acceptance, cache)", "loop"),
        )
    ]
    return (
        f"A Llama with {described}, random weights, bfloat16 on {device} (built in {build_seconds:.0f} s). {count} "
        f"prompts of about {length} random token ids, {limit} new tokens each (no EOS). A replay drafter drives our "
        f"loop: chains of {REPLAY_DEPTH} tokens whose first n are HF greedy's continuation, n drawn from "
        "ACCEPTED_LENGTHS (the CPU stage-2 EAGLE head's default call in docs/results/dev2-aoti-head-default-bf16-epyc: "
        f"{1 + expected_accepted(ACCEPTED_LENGTHS, REPLAY_DEPTH):.2f} tokens a pass expected). The loop reproduced "
        f"what it replayed on {parts['reproduced']} of {count} prompts ({parts['runs'] / count:.1f} runs a prompt, the "
        f"last timed: a bfloat16 chain pass may part from HF at a near-tie); {parts['identical']} outputs identical "
        "to HF's.\n\n"
        + table(["method", "tokens/s", "x HF generate()", "tau", "ms per new token"], speeds)
        + f"\nWhere our loop's time goes (GenerationStats over {parts['steps']} decode steps; a forward hook "
        "synchronises the device after each target pass, so that target_seconds holds the passes' device time):\n\n"
        + table(["part", "seconds", "share", "ms per decode step"], split)
    )


def syncs(args, device: torch.device, target: str | None, heads: dict[str, Path], questions: Path) -> str:
    """Section 6: the host synchronisations of the default call, plain decoding and the fixed tree, and of HF's."""
    dtype = torch.float32 if args.dry_run else torch.bfloat16  # bfloat16 is emulated on many CPUs
    model, tokenizer, head = load(target, heads["eagle"], dtype=dtype, device=device, compile=False)
    prompt, limit = chat_prompt(tokenizer, read_questions(questions, 1)[0]["turns"][:1]), args.max_new_tokens
    generate(model, head, prompt, max_new_tokens=limit)  # its trees calibrated and warm: not counted
    recording, counted = recording_syncs if device.type == "cuda" else recording_host_reads, {}
    for name, drafter, settings in (
        ("default", head, {}),
        ("plain", None, ALONE),
        ("fixed", head, dict(tree=FIXED, **ALONE)),
    ):
        with recording() as recorder:
            out = generate(model, drafter, prompt, max_new_tokens=limit, **settings)
        counted[name] = (recorder, max(out.stats.target_forwards - 1, 1), out.stats)
    with recording() as hf:
        reference = hf_greedy(model, prompt, limit)
    how = (
        'under `torch.cuda.set_sync_debug_mode("warn")` (each warning one host synchronisation)'
        if device.type == "cuda"
        else "counting every read of a tensor's values back to Python (`tolist`, `item`, `bool()`, `nonzero`, a "
        "boolean index...: scripts/host_syncs.py's HostReadRecorder), each of which synchronises a GPU; without "
        "CUDA they stand in for the synchronisations"
    )
    (ours, steps, stats), (plain, plain_steps, _), (tree, tree_steps, _) = counted.values()
    return (
        f"One default call `generate(model, head, prompt)` with the EAGLE head, {dtype_name(dtype)}, eager, on the "
        f"first question's first turn, {limit} new tokens at most, after an uncounted call, {how}: **{ours.count} "
        f"synchronisations in {steps} decode steps and the prefill, {ours.count / steps:.2f} per decode step** "
        f"({stats.new_tokens} new tokens, tau {stats.mean_accepted:.2f}). Our loop without a drafter (`heads=None`): "
        f"{plain.count} in {plain_steps} decode steps and the prefill, {plain.count / plain_steps:.2f} a step. The "
        f"fixed tree (`{FIXED}`, no lookup, no fallback): {tree.count} in {tree_steps} decode steps and the prefill, "
        f"{tree.count / tree_steps:.2f} a step. HF generate() on the same prompt: {hf.count} in {len(reference)} new "
        f"tokens, {hf.count / max(len(reference), 1):.2f} a token.\n\n"
        "Where the default call's come from, most frequent first (the line that synchronised; for a line outside this "
        f"repository, the innermost line of ours that led there):\n\n{ours.rows(steps)}\nThe fixed tree's:\n\n"
        + tree.rows(tree_steps)
    )


def arguments(argv):
    p = parser(__doc__)
    p.add_argument("--dry-run", action="store_true", help="tiny random-weight models on the CPU (a minute)")
    p.add_argument("--out", help="the report (default: docs/results/gpu-<card>.md; dry run: outputs/)")
    p.add_argument("--per-category", type=positive, default=1, help="benchmark questions a category (default 1)")
    p.add_argument("--max-new-tokens", type=positive, help="default 128; dry run 16")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench style question file")
    args = p.parse_args(argv)
    args.max_new_tokens = args.max_new_tokens or (16 if args.dry_run else 128)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run on a GPU, or with --dry-run (tiny random models on the CPU)")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = arguments(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.out:
        out = Path(args.out)
    elif args.dry_run:
        out = REPO / "outputs" / "gpu-check-dry-run.md"  # outputs/ is ignored by git: random models are no result
    else:
        card = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")  # nvidia-h100-80gb-hbm3
        out = REPO / "docs" / "results" / f"gpu-{card}.md"
    bodies, timings = {}, {}
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-")))
        target, heads, questions = None, HEAD_CHECKPOINTS, Path(args.questions)
        if args.dry_run:  # random models have no place in the user's caches; a tiny pass gains nothing from a thread
            stack.enter_context(mock.patch.dict(os.environ, SPECHEADS_CACHE=str(scratch / "cache")))
            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(1)
            target, heads = tiny_checkpoints(scratch)
            questions = scratch / "questions.jsonl"
            questions.write_text("".join(line + "\n" for line in DRY_RUN_QUESTIONS))
        options = ["--model", str(target)] if target else []
        options += ["--questions", str(questions), "--device", str(device), *FIXED_TREE.split()]
        options += ["--eagle", str(heads["eagle"]), "--medusa", str(heads["medusa"])]
        options += ["--per-category", str(args.per_category), "--max-new-tokens", str(args.max_new_tokens)]
        for title, run in RUNS.items():
            name = scratch / title.split(".")[0]
            _, timings[title] = timed(lambda r=run, n=name: benchmark.main([*options, *r.split(), "--out", str(n)]))
            bodies[title] = name.with_suffix(".md").read_text()
        bodies[SCALE], timings[SCALE] = timed(lambda: scale(args, device))
        line = f"Command: `{command('gpu_check.py', argv)}`"
        bodies[SCALE] = f"{line}\n\n{bodies[SCALE]}"
        body, timings[SYNCS] = timed(lambda: syncs(args, device, target, heads, questions))
        bodies[SYNCS] = f"{line}\n\n{body}"
    machine = device_name(device)
    took = ", ".join(f"{title.split('.')[0]}. {seconds:.0f} s" for title, seconds in timings.items())
    text = (
        f"# GPU check: {machine}\n\n{line}  \nMachine: {machine}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
        f"{f' (CUDA {torch.version.cuda})' if torch.version.cuda else ''}, transformers {transformers.__version__}; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC.  \nThe run took {sum(timings.values()):.0f} s ({took}).\n"
        + (DRY_RUN_NOTE if args.dry_run else "")
        + "".join(f"\n## {title}\n\n{body.rstrip()}\n" for title, body in bodies.items())
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text + f"\nwrote {out}")
    return out


if __name__ == "__main__":
    from inference.cli import run

    run(main, "gpu_check.py")
