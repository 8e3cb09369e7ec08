"""A prepared check for one GPU: is the engine exact there, how fast is it, and where does its time go?

    .venv/bin/python scripts/gpu_check.py            # on a GPU, in --budget-seconds (480): docs/results/gpu-<card>.md
    .venv/bin/python scripts/gpu_check.py --dry-run  # the same code paths on the CPU, tiny random models, in seconds

Four sections, each with the command line that made it: 1. exactness: the shipped EAGLE and Medusa heads through
the default call on dev first turns against HF greedy, float32 outputs identical and bfloat16 divergences proven
near-ties of the target; 2. speed against HF generate(), methods interleaved prompt by prompt, the default call and
FIXED_TREE, eager and compiled, at batch 1 and 8; 3. the engine at scale: a Llama-3.1-8B-shaped model with random
weights, driven by a drafter that replays a trained head's accepted lengths, against HF generate() on it, and where
the loop's time goes; 4. host synchronisations per decode step (scripts/host_syncs.py).

Each section gets its share of the time left when it starts (BUDGET_SHARES) and stops taking prompts when the next
would likely end past it. --dry-run builds tiny random-weight models instead and keeps its calibrations and packages
in a temporary folder; tests/test_gpu_check.py runs it, so the real run's code cannot rot between GPU sessions.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from common import (
    DEFAULT_QUESTIONS,
    REPO,
    command,
    divergence,
    divergence_note,
    first_turns,
    hf_greedy,
    hf_method,
    interleaved,
    our_method,
    parser,
    positive,
    read_questions,
    table,
    timed,
    while_time_allows,
)
from engine_at_scale import LLAMA_8B_SHAPE, REPLAY_DEPTH, llama_shape, random_llama, random_prompts, scale
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, load_heads
from host_syncs import recording_host_reads, recording_syncs
from inference import DynamicTreeSpec, generate, load_target, warm_up
from inference.calibrate import calibrated_tree, device_name
from inference.compiled import compile_target, is_compiled
from inference.target import dtype_name

HEAD_CHECKPOINTS = {
    "EAGLE": REPO / "checkpoints" / "smollm2-135m-instruct-eagle-cpu-stage2",
    "Medusa": REPO / "checkpoints" / "smollm2-135m-instruct-medusa",
}
SPEED_HEAD = "EAGLE"  # the head of the README's headline figures
FIXED_TREE = DynamicTreeSpec(depth=5, top_k=8, nodes=15)
BATCH = 8
EXACTNESS_DTYPES = (torch.float32, torch.bfloat16)
TINY_SHAPE = llama_shape(64, 2, 4, 2, 128, 97)  # the dry run's target, shaped like tests/conftest.py's tiny_model
TINY_EOS = 3
TINY_INIT = 0.15  # logits spread enough that float32 argmaxes are never near-ties (tests/conftest.py)
BUDGET_SHARES = {"exactness": 0.30, "speed": 0.40, "scale": 0.25, "syncs": 0.05}  # of the time left at its start
SECTION_TITLES = {
    "exactness": "## 1. Exactness",
    "speed": "## 2. Speed against HF generate()",
    "scale": "## 3. The engine at scale: a Llama-3.1-8B-shaped model",
    "syncs": "## 4. Host synchronisations per decode step",
}


class Budget:
    """The run's seconds, handed to the sections in turn: each gets its share of what is left when it starts."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.pending = seconds, time.perf_counter(), dict(BUDGET_SHARES)

    def deadline(self, section: str) -> float:
        """The perf_counter time by which `section` should end."""
        left = max(self.seconds - (time.perf_counter() - self.started), 0.0)
        share = self.pending.pop(section)
        return time.perf_counter() + left * share / (share + sum(self.pending.values()))


class Models:
    """Where a run's models, heads and prompts come from: the embedded SmolLM2-135M-Instruct with the shipped heads,
    dev-set first turns and the 8B shape on the GPU, or (dry run) tiny random-weight Llamas and heads on the CPU. Each
    model and its heads are made once and shared by the sections."""

    def __init__(self, dry_run: bool, questions: str):
        self.dry_run, self.questions, self.tokenizer = dry_run, questions, None
        self.device = torch.device("cpu" if dry_run else "cuda")
        # the dry run in float32: bfloat16 is emulated on many CPUs, and the exactness section's model is reused
        self.speed_dtype = torch.float32 if dry_run else torch.bfloat16
        self.large_shape, self.large_prompt_tokens = (TINY_SHAPE, 12) if dry_run else (LLAMA_8B_SHAPE, 128)
        self.what = (
            "a tiny random-weight Llama (2 layers, hidden 64, vocab 97) with random EAGLE and Medusa heads, on the CPU"
            if dry_run
            else "SmolLM2-135M-Instruct (embedded, inference.load_target) with the shipped heads "
            + ", ".join(f"`{path.relative_to(REPO)}`" for path in HEAD_CHECKPOINTS.values())
        )
        self._small, self._heads = {}, {}

    def small(self, dtype: torch.dtype, compiled: bool = False):
        """The target the heads were made for, in `dtype`; `compiled`: another instance, decoded with compiled
        passes (compile_target marks a model for good)."""
        if (dtype, compiled) not in self._small:
            if self.dry_run:
                model = random_llama(TINY_SHAPE, self.device, torch.float32, seed=0, eos=TINY_EOS, init=TINY_INIT)
                model = compile_target(model.to(dtype)) if compiled else model.to(dtype)
            else:
                model, self.tokenizer = load_target(dtype=dtype, device=self.device, compile=compiled)
            self._small[dtype, compiled] = model
        return self._small[dtype, compiled]

    def heads(self, model) -> dict[str, torch.nn.Module]:
        """{"EAGLE": head, "Medusa": heads} for `model`, in its dtype and on its device."""
        if id(model) not in self._heads:
            if self.dry_run:
                self._heads[id(model)] = tiny_heads(model)
            else:
                self._heads[id(model)] = {name: load_heads(path, model) for name, path in HEAD_CHECKPOINTS.items()}
        return self._heads[id(model)]

    def prompts(self, count: int) -> list[torch.Tensor]:
        """The first `count` prompts of sections 1 and 2: first turns, one category after another, so that a run cut
        short by the budget still spans the categories (dry run: random token ids)."""
        if self.dry_run:
            return random_prompts(TINY_SHAPE["vocab_size"], count, 20, low=TINY_EOS + 1)
        self.small(torch.float32)  # the tokenizer comes with the model
        by_category = {}
        for question in read_questions(self.questions):
            by_category.setdefault(question["category"], []).append(question)
        in_turn = [q for round_ in zip(*by_category.values(), strict=False) for q in round_]
        return first_turns(self.tokenizer, in_turn[:count])

    def large(self):
        """Section 3's model, random weights, on the device in bfloat16."""
        return random_llama(self.large_shape, self.device, torch.bfloat16, seed=2 if self.dry_run else 0, eos=None)

    def large_prompts(self, count: int) -> list[torch.Tensor]:
        return random_prompts(self.large_shape["vocab_size"], count, self.large_prompt_tokens)


def tiny_heads(model) -> dict[str, torch.nn.Module]:
    """Random heads as tests/test_exactness_tiny.py builds them; the EAGLE head like the shipped one: a low layer's
    features beside the last, a copy input and a draft vocabulary."""
    torch.manual_seed(1)
    config = EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True, draft_vocab_size=48)
    eagle = EagleHead(config)
    eagle.draft_ids.copy_(torch.randperm(model.config.vocab_size)[:48].sort().values)
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=4))
    for parameter in medusa.parameters():
        torch.nn.init.normal_(parameter, std=0.05)  # not the zero init: candidates should vary
    return {name: head.to(model.device, model.dtype).eval() for name, head in (("EAGLE", eagle), ("Medusa", medusa))}


# --- 1. exactness ------------------------------------------------------------------------------------------------


def agreement(outcomes: list[dict | None], dtype: torch.dtype) -> tuple[int, int, int, bool]:
    """(identical, proven near-ties, other divergences, exact) of outputs against HF greedy, each None (identical) or
    its divergence. Exact: float32, every output identical; bfloat16, every divergence a proven near-tie."""
    identical, ties = outcomes.count(None), sum(d["near_tie"] for d in outcomes if d)
    exact = identical + (0 if dtype == torch.float32 else ties) == len(outcomes)
    return identical, ties, len(outcomes) - identical - ties, exact


def exactness(models: Models, args, deadline: float) -> str:
    prompts = models.prompts(args.prompts)
    targets = {dtype: models.small(dtype) for dtype in EXACTNESS_DTYPES}
    found = {(dtype, name): [] for dtype in EXACTNESS_DTYPES for name in HEAD_CHECKPOINTS}
    # every dtype and head on a prompt before the next: a run cut short keeps them all
    for prompt in tqdm(while_time_allows(prompts, deadline), total=len(prompts), desc="1. exactness (prompts)"):
        for dtype, model in targets.items():
            reference = hf_greedy(model, prompt, args.max_new_tokens)
            for name, head in models.heads(model).items():
                ours = generate(model, head, prompt, max_new_tokens=args.max_new_tokens).token_ids
                found[dtype, name].append(None if ours == reference else divergence(model, prompt, ours, reference))
    rows = [[dtype_name(d), name, len(o), *agreement(o, d)] for (d, name), o in found.items()]
    exact = {d: all(agreement(found[d, n], d)[3] for n in HEAD_CHECKPOINTS) for d in EXACTNESS_DTYPES}
    done = len(found[EXACTNESS_DTYPES[0], SPEED_HEAD])
    source = "random token ids" if models.dry_run else "the dev set's, one category after another"
    columns = ["dtype", "head", "prompts", "identical to HF", "proven near-ties", "other divergences", "exact"]
    return (
        f"{models.what}; the default call `generate(model, head, prompt)` on {done} of {len(prompts)} first turns "
        f"({source}), {args.max_new_tokens} new tokens at most, against HF greedy "
        "`model.generate(do_sample=False)` of the same model. Exact: float32 outputs identical to HF's; bfloat16 "
        "divergences each a proven near-tie of the target (teacher-forced on the shared prefix).\n\n"
        + table(columns, [[*row[:-1], "yes" if row[-1] else "NO"] for row in rows])
        + "".join(f"\n- {dtype_name(d)} exact: {'yes' if yes else 'NO'}" for d, yes in exact.items())
        + divergence_note({f"{dtype_name(d)} {n}": [x for x in o if x] for (d, n), o in found.items()})
    )


# --- 2. speed ----------------------------------------------------------------------------------------------------


def speed(models: Models, args, deadline: float) -> str:
    eager, compiled = models.small(models.speed_dtype), models.small(models.speed_dtype, compiled=True)
    _, compile_seconds = timed(lambda: warm_up(compiled))  # the target's pass compiled (or loaded) now, not timed
    prompts = models.prompts(args.prompts)
    methods, first_call = {"HF generate()": hf_method(eager, args.max_new_tokens)}, {}
    for variant, model in (("eager", eager), ("compiled", compiled)):
        head = models.heads(model)[SPEED_HEAD]
        for size in sorted({1, min(BATCH, len(prompts))}):  # the default call's trees, measured once and cached
            calibrated_tree(model, head, batch=size, verbose=True)
        for name, settings in (
            (f"default call, {variant}", dict(heads=head)),
            (f"fixed tree, {variant}", dict(heads=head, tree=FIXED_TREE, lookup=False, fallback=False)),
        ):
            # untimed: the first call (which compiles or loads the compiled head's pass) and a first batch
            _, first_call[name] = timed(lambda s=settings, m=model: our_method(m, 16, **s)(prompts[0]))
            our_method(model, 8, **settings)([p.tolist() for p in prompts[:BATCH]], BATCH)
            methods[name] = our_method(model, args.max_new_tokens, **settings)
    hf_greedy(eager, prompts[0], 8)  # nor HF's first call

    batch_one = time.perf_counter() + 0.6 * max(deadline - time.perf_counter(), 0.0)  # the rest for batch 8
    one = interleaved(methods, prompts, deadline=batch_one, desc="2. speed, batch 1 (prompts)")
    chunks = [[p.tolist() for p in prompts[start : start + BATCH]] for start in range(0, len(prompts), BATCH)]
    eight = interleaved(methods, chunks, BATCH, deadline=deadline, desc=f"2. speed, batch {BATCH} (chunks)")
    batch_rows = sum(map(len, chunks[: eight["HF generate()"].runs]))
    rows = []
    for batch, tallies in ((1, one), (BATCH, eight)):
        base = tallies["HF generate()"].tokens_per_second
        for name, t in tallies.items():
            ratio, tau = t.tokens_per_second / base if base else 0.0, f"{t.tau:.2f}" if t.tau is not None else "-"
            rows.append([batch, name, f"{t.tokens_per_second:.1f}", f"{ratio:.2f}x", tau])
    tree = f"DynamicTreeSpec(depth={FIXED_TREE.depth}, top_k={FIXED_TREE.top_k}, nodes={FIXED_TREE.nodes})"
    firsts = "; ".join(f"{name}: {seconds:.1f} s" for name, seconds in first_call.items())
    return (
        f"{models.what}; the {SPEED_HEAD} head, {dtype_name(models.speed_dtype)}, {args.max_new_tokens} new tokens at "
        f"most. Batch 1: {one['HF generate()'].runs} of {len(prompts)} prompts; batch {BATCH}: {batch_rows} prompts in "
        f"chunks (HF decodes a chunk, left-padded, until its last row ends; ours keeps at most {BATCH} rows at once). "
        "Methods interleaved prompt by prompt (chunk by chunk); tokens/s: new tokens over wall seconds, the device "
        "synchronised around each call; tau: new tokens per target pass (a row's own passes in a batch). The fixed "
        f"tree: `{tree}`, lookup=False, fallback=False. Compiled: `inference.compile_target` (AOTInductor), the "
        f"target's pass compiled or loaded in {compile_seconds:.0f} s; untimed: that, the default calls' trees "
        f"calibrated, and every method's first call ({firsts}). HF generate() runs the eager model."
        + (
            ""
            if is_compiled(compiled)
            else " Compiling FAILED (see the warning above it): the compiled rows ran eager."
        )
        + "\n\n"
        + table(["batch", "method", "tokens/s", "x HF generate()", "tau"], rows)
    )


# --- 4. host synchronisations ------------------------------------------------------------------------------------


def syncs(models: Models, args, deadline: float) -> str:
    cuda = models.device.type == "cuda"
    recording = recording_syncs if cuda else recording_host_reads
    model = models.small(models.speed_dtype)
    head = models.heads(model)[SPEED_HEAD]
    prompt, limit = models.prompts(1)[0], args.max_new_tokens
    generate(model, head, prompt, max_new_tokens=limit)  # its trees calibrated and warm: not counted
    counted = {}
    for name, heads, settings in (
        ("default", head, {}),
        ("plain", None, dict(lookup=False, fallback=False)),
        ("fixed", head, dict(tree=FIXED_TREE, lookup=False, fallback=False)),
    ):
        with recording() as recorder:
            out = generate(model, heads, prompt, max_new_tokens=limit, **settings)
        counted[name] = (recorder, max(out.stats.target_forwards - 1, 1), out.stats)
    with recording() as hf:
        reference = hf_greedy(model, prompt, limit)
    how = (
        'under `torch.cuda.set_sync_debug_mode("warn")` (each warning one host synchronisation)'
        if cuda
        else "counting every read of a tensor's values back to Python (`tolist`, `item`, `bool()`, `nonzero`, a "
        "boolean index...: scripts/host_syncs.py's HostReadRecorder), each of which synchronises a GPU; without "
        "CUDA they stand in for the synchronisations"
    )
    (ours, steps, stats), (plain, plain_steps, _), (fixed, fixed_steps, _) = counted.values()
    return (
        f"One default call `generate(model, head, prompt)` with the {SPEED_HEAD} head, "
        f"{dtype_name(models.speed_dtype)}, eager, on the first prompt of section 1, {limit} new tokens at most, after "
        f"an uncounted call, {how}: **{ours.count} synchronisations in {steps} decode steps and the prefill, "
        f"{ours.count / steps:.2f} per decode step** ({stats.new_tokens} new tokens, tau {stats.mean_accepted:.2f}). "
        f"Our loop without a drafter (`heads=None`): {plain.count} in {plain_steps} decode steps and the prefill, "
        f"{plain.count / plain_steps:.2f} a step. The fixed tree of section 2 (no lookup, no fallback): {fixed.count} "
        f"in {fixed_steps} decode steps and the prefill, {fixed.count / fixed_steps:.2f} a step. HF generate() on the "
        f"same prompt: {hf.count} in {len(reference)} new tokens, {hf.count / max(len(reference), 1):.2f} a token.\n\n"
        "Where the default call's come from, most frequent first (the line that synchronised; for a line outside this "
        f"repository, the innermost line of ours that led there):\n\n{ours.rows(steps)}\nThe fixed tree's:\n\n"
        + fixed.rows(fixed_steps)
    )


# --- the report --------------------------------------------------------------------------------------------------

SECTIONS = {"exactness": exactness, "speed": speed, "scale": scale, "syncs": syncs}


@contextmanager
def dry_run_settings(enabled: bool) -> Iterator[None]:
    """A dry run keeps its calibrations and compiled packages in a temporary folder (random tiny models have no place
    in the user's caches) and computes on one thread: a tiny model's passes gain nothing from a second, and stall
    when another process shares the cores."""
    if not enabled:
        yield
        return
    saved_root, saved_threads = os.environ.get("SPECHEADS_CACHE"), torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        os.environ["SPECHEADS_CACHE"] = scratch  # where inference.store keeps packages and calibrations
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(saved_threads)
            if saved_root is None:
                os.environ.pop("SPECHEADS_CACHE")
            else:
                os.environ["SPECHEADS_CACHE"] = saved_root


def render(models: Models, args, line: str, timings: dict[str, float], bodies: dict[str, str]) -> str:
    machine = device_name(models.device)
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    took = ", ".join(f"{key} {seconds:.0f} s" for key, seconds in timings.items())
    lines = [
        f"# GPU check: {machine}\n\nCommand: `{line}`  ",
        f"Machine: {machine}, {os.cpu_count()} CPU cores, torch {torch.__version__}{cuda}, transformers "
        f"{transformers.__version__}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.  ",
        f"Budget {args.budget_seconds:.0f} s; the run took {sum(timings.values()):.0f} s ({took}).",
    ]
    if args.dry_run:
        lines.append(
            "\n**Dry run**: tiny random-weight models on the CPU; the figures check the script, not the engine."
        )
    for key, body in bodies.items():
        lines.append(f"\n{SECTION_TITLES[key]}\n\nCommand: `{line}` ({timings[key]:.0f} s)\n\n{body.rstrip()}")
    return "\n".join(lines) + "\n"


def arguments(argv):
    p = parser(__doc__)
    p.add_argument("--dry-run", action="store_true", help="tiny random-weight models on the CPU (seconds)")
    p.add_argument("--out", help="the report (default: docs/results/gpu-<card>.md; dry run: outputs/)")
    p.add_argument("--budget-seconds", type=float, default=480.0, help="the whole run's time (default 480)")
    p.add_argument("--prompts", type=positive, help="first turns asked (default 20; dry run 3)")
    p.add_argument("--max-new-tokens", type=positive, help="default 128; dry run 16")
    p.add_argument("--scale-prompts", type=positive, help="random prompts for the 8B shape (default 8; dry run 2)")
    p.add_argument("--replay-depth", type=positive, default=REPLAY_DEPTH, help="the replay drafter's chain")
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench style question file")
    args = p.parse_args(argv)
    for name, default in zip(
        ("prompts", "max_new_tokens", "scale_prompts"), (3, 16, 2) if args.dry_run else (20, 128, 8)
    ):
        setattr(args, name, getattr(args, name) or default)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run on a GPU, or with --dry-run (tiny random models on the CPU)")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = arguments(argv)
    if args.out:
        out = Path(args.out)
    elif args.dry_run:
        out = REPO / "outputs" / "gpu-check-dry-run.md"  # outputs/ is ignored by git: random models are no result
    else:
        card = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")  # nvidia-h100-80gb-hbm3
        out = REPO / "docs" / "results" / f"gpu-{card}.md"
    with dry_run_settings(args.dry_run):
        models, budget, timings, bodies = Models(args.dry_run, args.questions), Budget(args.budget_seconds), {}, {}
        for key, section in SECTIONS.items():
            bodies[key], timings[key] = timed(lambda s=section, k=key: s(models, args, budget.deadline(k)))
    text = render(models, args, command("gpu_check.py", argv), timings, bodies)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text + f"\nwrote {out}")
    return out


if __name__ == "__main__":
    from inference.cli import run

    run(main, "gpu_check.py")
