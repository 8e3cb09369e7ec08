"""A prepared check for one GPU: is the engine exact there, how fast is it, and where does its time go?

    .venv/bin/python scripts/gpu_check.py            # on a GPU, in --budget-seconds (480): docs/results/gpu-<card>.md
    .venv/bin/python scripts/gpu_check.py --dry-run  # the same code paths on the CPU, tiny random models, in seconds

Four sections, each with the command line that made it:

1. Exactness: the shipped EAGLE and Medusa heads through the default call `generate(model, head, prompt)` on first
   turns of the dev set; float32 outputs must be identical to HF greedy `model.generate(do_sample=False)`, and in
   bfloat16 every divergence must be a proven near-tie of the target (scripts/benchmark.py's `divergence`).
2. Speed against HF generate(), in one process, methods interleaved prompt by prompt: the default call and a fixed
   tree (DynamicTreeSpec(depth=5, top_k=8, nodes=15), no lookup, no fallback), eager and compiled
   (inference.compile_target: AOTInductor compiles for the GPU too), at batch 1 and batch 8 (against HF's batched,
   left-padded generate()).
3. The engine at scale: a Llama-3.1-8B-shaped model with random weights, built on the device in bfloat16, driven by
   a drafter that replays a trained head's accepted lengths (ACCEPTED_LENGTHS) against HF greedy's continuation;
   the speedup over HF generate() on the same model, and where the loop's time goes.
4. Host synchronisations per decode step of the default call and of our loop alone, counted under
   torch.cuda.set_sync_debug_mode("warn"), with the source lines that cause them; on the CPU, the reads of tensor
   values back to Python that would synchronise a GPU (HostReadRecorder) stand in for them.

The budget is kept by shrinking prompt counts: every section gets its share of the time left when it starts
(BUDGET_SHARES) and stops taking prompts when the next one would likely end past it (one prompt at least).
--dry-run builds tiny random-weight models instead of the shipped checkpoints and the 8B shape, a few prompts of
random token ids and a few new tokens, and keeps its calibrations and compiled packages in a temporary folder; a
test runs it (tests/test_gpu_check.py), so the real run's code cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import linecache
import os
import random
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import divergence, divergence_note, hf_batch  # noqa: E402
from common import DEFAULT_QUESTIONS, chat_prompt, read_questions  # noqa: E402
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads, load_heads  # noqa: E402
from inference import DynamicTreeSpec, Generation, Tree, generate, load_target, warm_up  # noqa: E402
from inference.calibrate import calibrated_tree, device_name  # noqa: E402
from inference.compiled import compile_target, is_compiled  # noqa: E402
from inference.drafters import TokenDrafter  # noqa: E402
from inference.target import dtype_name  # noqa: E402

THIS_FILE = Path(__file__).resolve()
REPO = THIS_FILE.parents[1]
HEAD_CHECKPOINTS = {
    "EAGLE": REPO / "checkpoints" / "smollm2-135m-instruct-eagle-cpu-stage2",
    "Medusa": REPO / "checkpoints" / "smollm2-135m-instruct-medusa",
}
SPEED_HEAD = "EAGLE"  # the head of the README's headline figures
FIXED_TREE = DynamicTreeSpec(depth=5, top_k=8, nodes=15)
BATCH = 8
EXACTNESS_DTYPES = (torch.float32, torch.bfloat16)

# Llama-3.1-8B's shape (its config.json); random weights, built on the device: nothing is downloaded
LLAMA_8B_SHAPE = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
)
# the dry run's stand-in, shaped like tests/conftest.py's tiny_model
TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=97,
)
TINY_EOS = 3
TINY_INIT = 0.15  # logits spread enough that float32 argmaxes are never near-ties (tests/conftest.py)

# Accepted lengths to replay: ACCEPTED_LENGTHS[n] is how many drafting steps accepted exactly n drafted tokens, in
# docs/results/dev2-aoti-head-default-bf16-epyc (the CPU stage-2 EAGLE head through the default call, bfloat16,
# compiled; 38 turns, tau 3.00 with the prefill and the fallback's plain steps), read from the record's
# accepted_to_depth counts: 1,458 drafting steps, 2.18 drafts accepted a step on average, 3.18 tokens a pass.
ACCEPTED_LENGTHS = (278, 633, 191, 87, 49, 70, 8, 18, 22, 8, 94)
REPLAY_DEPTH = len(ACCEPTED_LENGTHS) - 1  # deep enough for the longest accepted length recorded
REPLAY_ROUNDS = 4  # runs of a prompt at most, until the loop reproduces the continuation it replays

# each section's share of the time left when it starts (what one leaves goes to those after it)
BUDGET_SHARES = {"exactness": 0.30, "speed": 0.40, "scale": 0.25, "syncs": 0.05}
SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says at every sync

SECTION_TITLES = {
    "exactness": "## 1. Exactness",
    "speed": "## 2. Speed against HF generate()",
    "scale": "## 3. The engine at scale: a Llama-3.1-8B-shaped model",
    "syncs": "## 4. Host synchronisations per decode step",
}


# --- time -------------------------------------------------------------------------------------------------------


def synchronize() -> None:
    """Wait for the device's queued work: a CUDA call returns before its kernels finish."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(call: Callable):
    """(call(), its wall seconds), the device's queued work before and after included."""
    synchronize()
    started = time.perf_counter()
    result = call()
    synchronize()
    return result, time.perf_counter() - started


class Budget:
    """The run's seconds, handed to the sections in turn: each gets its share of what is left when it starts."""

    def __init__(self, seconds: float, shares: dict[str, float]):
        self.seconds, self.started, self.pending = seconds, time.perf_counter(), dict(shares)

    def left(self) -> float:
        return max(self.seconds - (time.perf_counter() - self.started), 0.0)

    def deadline(self, section: str) -> float:
        """The perf_counter time by which `section` should end."""
        share = self.pending.pop(section)
        return time.perf_counter() + self.left() * share / (share + sum(self.pending.values()))


def part_of(deadline: float, share: float) -> float:
    """A deadline `share` of the way from now to `deadline`: a section's first loop, leaving the rest to the next."""
    now = time.perf_counter()
    return now + max(deadline - now, 0.0) * share


def while_time_allows(items: Iterable, deadline: float, minimum: int = 1) -> Iterator:
    """The items, until the next one would likely end past `deadline` (judged by the mean time of those before it);
    at least `minimum` of them, so that every section reports a figure."""
    started = time.perf_counter()
    for count, item in enumerate(items):
        if count >= minimum:
            mean = (time.perf_counter() - started) / count
            if time.perf_counter() + mean > deadline:
                return
        yield item


# --- models, heads and prompts -----------------------------------------------------------------------------------


def random_llama(
    shape: dict, device: torch.device, dtype: torch.dtype, *, seed: int, eos: int | None, init: float = 0.02
):
    """A Llama of `shape` with random weights, created on `device` in `dtype` (no float32 copy on the host first:
    an 8B model would need 32 GB of it). Without `eos` it decodes to max_new_tokens, as a benchmark wants."""
    config = LlamaConfig(
        **shape,
        max_position_embeddings=4096,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def round_robin(questions: list[dict]) -> list[dict]:
    """The questions one category at a time, in turn: a run cut short by the budget still spans the categories."""
    by_category = defaultdict(list)
    for question in questions:
        by_category[question["category"]].append(question)
    return [q for turn in itertools.zip_longest(*by_category.values()) for q in turn if q is not None]


class Models:
    """Where a run's models, heads and prompts come from; each model and its heads are made once and shared by the
    sections (the exactness section's model in the speed dtype is the speed section's eager one, calibrated once)."""

    what: str  # a line for the report
    speed_dtype: torch.dtype  # what sections 2 and 4 decode in
    large_prompt_tokens: int  # the random prompts' length in section 3

    def __init__(self, device: torch.device):
        self.device = device
        self._small: dict[tuple[torch.dtype, bool], torch.nn.Module] = {}
        self._heads: dict[int, dict[str, torch.nn.Module]] = {}

    def small(self, dtype: torch.dtype, compiled: bool = False):
        """The target the heads were made for, in `dtype`; `compiled`: another instance, decoded with compiled
        passes (compile_target marks a model for good)."""
        if (dtype, compiled) not in self._small:
            self._small[dtype, compiled] = self._load_small(dtype, compiled)
        return self._small[dtype, compiled]

    def heads(self, model) -> dict[str, torch.nn.Module]:
        """{"EAGLE": head, "Medusa": heads} for `model`, in its dtype and on its device."""
        if id(model) not in self._heads:
            self._heads[id(model)] = self._load_heads(model)
        return self._heads[id(model)]

    def _load_small(self, dtype: torch.dtype, compiled: bool):
        raise NotImplementedError

    def _load_heads(self, model) -> dict[str, torch.nn.Module]:
        raise NotImplementedError

    def prompts(self, count: int) -> list[torch.Tensor]:
        """The first `count` prompts of sections 1 and 2 (token ids)."""
        raise NotImplementedError

    def large(self):
        """Section 3's model, random weights, on the device in bfloat16."""
        raise NotImplementedError

    def large_prompts(self, count: int) -> list[torch.Tensor]:
        raise NotImplementedError


class ShippedModels(Models):
    """The real run: the embedded SmolLM2-135M-Instruct with the shipped heads, dev-set first turns, the 8B shape."""

    what = "SmolLM2-135M-Instruct (embedded, inference.load_target) with the shipped heads " + ", ".join(
        f"`{path.relative_to(REPO)}`" for path in HEAD_CHECKPOINTS.values()
    )
    speed_dtype = torch.bfloat16  # what a GPU decodes in
    large_prompt_tokens = 128

    def __init__(self, questions: str):
        super().__init__(torch.device("cuda"))
        self.questions = questions
        self.tokenizer = None

    def _load_small(self, dtype: torch.dtype, compiled: bool):
        model, self.tokenizer = load_target(dtype=dtype, device=self.device, compile=compiled)
        return model

    def _load_heads(self, model) -> dict[str, torch.nn.Module]:
        return {name: load_heads(path, model) for name, path in HEAD_CHECKPOINTS.items()}

    def prompts(self, count: int) -> list[torch.Tensor]:
        self.small(torch.float32)  # the tokenizer comes with the model
        return [chat_prompt(self.tokenizer, q["turns"][:1]) for q in round_robin(read_questions(self.questions))][
            :count
        ]

    def large(self):
        return random_llama(LLAMA_8B_SHAPE, self.device, torch.bfloat16, seed=0, eos=None)

    def large_prompts(self, count: int) -> list[torch.Tensor]:
        return random_prompts(LLAMA_8B_SHAPE["vocab_size"], count, self.large_prompt_tokens)


class TinyModels(Models):
    """The dry run: tiny random-weight Llamas and heads (as tests/test_exactness_tiny.py builds them) on the CPU."""

    what = "a tiny random-weight Llama (2 layers, hidden 64, vocab 97) with random EAGLE and Medusa heads, on the CPU"
    # float32: bfloat16 is emulated on many CPUs, and the exactness section's float32 model, calibrated, is reused
    speed_dtype = torch.float32
    large_prompt_tokens = 12

    def __init__(self):
        super().__init__(torch.device("cpu"))

    def _load_small(self, dtype: torch.dtype, compiled: bool):
        model = random_llama(TINY_SHAPE, self.device, torch.float32, seed=0, eos=TINY_EOS, init=TINY_INIT).to(dtype)
        return compile_target(model) if compiled else model

    def _load_heads(self, model) -> dict[str, torch.nn.Module]:
        torch.manual_seed(1)
        # like the shipped EAGLE head: a low layer's features beside the last, a copy input and a draft vocabulary
        eagle = EagleHead(
            EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True, draft_vocab_size=48)
        )
        eagle.draft_ids.copy_(torch.randperm(model.config.vocab_size)[:48].sort().values)
        medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=4))
        for parameter in medusa.parameters():
            torch.nn.init.normal_(parameter, std=0.05)  # not the zero init: candidates should vary
        return {
            name: head.to(model.device, model.dtype).eval() for name, head in (("EAGLE", eagle), ("Medusa", medusa))
        }

    def prompts(self, count: int) -> list[torch.Tensor]:
        return random_prompts(TINY_SHAPE["vocab_size"], count, 20, low=TINY_EOS + 1)

    def large(self):
        return random_llama(TINY_SHAPE, self.device, torch.bfloat16, seed=2, eos=None)

    def large_prompts(self, count: int) -> list[torch.Tensor]:
        return random_prompts(TINY_SHAPE["vocab_size"], count, self.large_prompt_tokens)


def random_prompts(vocab_size: int, count: int, length: int, low: int = 0) -> list[torch.Tensor]:
    """`count` prompts of random token ids in [low, vocab_size), of `length` tokens or a little fewer."""
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(low, vocab_size, (length - index % 3,), generator=generator, dtype=torch.long)
        for index in range(count)
    ]


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """HF greedy `model.generate(do_sample=False)` of one prompt (scripts/benchmark.py's hf_batch of one row)."""
    return hf_batch(model, [prompt.tolist()], max_new_tokens)[0]


def free_device_memory() -> None:
    """Give the memory of the models just dropped back to the device now, not when the allocator next needs it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- 1. exactness ------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One (dtype, head)'s outputs against HF greedy."""

    prompts: int = 0
    identical: int = 0
    divergences: list[dict] = field(default_factory=list)  # scripts/benchmark.py's divergence() of each differing one

    @property
    def near_ties(self) -> int:
        return sum(d["near_tie"] for d in self.divergences)

    def exact(self, dtype: torch.dtype) -> bool:
        """float32: every output identical; bfloat16: every divergence a proven near-tie of the target."""
        if dtype == torch.float32:
            return self.identical == self.prompts
        return self.identical + self.near_ties == self.prompts


def exactness(models: Models, args, deadline: float) -> list[str]:
    prompts = models.prompts(args.prompts)
    targets = {dtype: models.small(dtype) for dtype in EXACTNESS_DTYPES}
    outcomes = {(dtype, name): Outcome() for dtype in EXACTNESS_DTYPES for name in HEAD_CHECKPOINTS}
    progress = tqdm(while_time_allows(prompts, deadline), total=len(prompts), desc="1. exactness (prompts)")
    for prompt in progress:  # every dtype and head on a prompt before the next: a cut-short run keeps them all
        for dtype, model in targets.items():
            reference = hf_greedy(model, prompt, args.max_new_tokens)
            for name, head in models.heads(model).items():
                ours = generate(model, head, prompt, max_new_tokens=args.max_new_tokens).token_ids
                outcome = outcomes[dtype, name]
                outcome.prompts += 1
                if ours == reference:
                    outcome.identical += 1
                else:
                    outcome.divergences.append(divergence(model, prompt, ours, reference))
    progress.close()

    asked = len(prompts)
    done = outcomes[EXACTNESS_DTYPES[0], SPEED_HEAD].prompts
    lines = [
        f"{models.what}; the default call `generate(model, head, prompt)` (the tree sized to this machine, prompt "
        f"lookup merged, the fallback on) on {done} of {asked} first turns ({prompt_source(models)}), "
        f"{args.max_new_tokens} new tokens at most, against HF greedy `model.generate(do_sample=False)` of the same "
        "model. Exact: float32 outputs identical to HF's; bfloat16 divergences each a proven near-tie of the target "
        "(scripts/benchmark.py's `divergence`, teacher-forced on the shared prefix).",
        "",
        "| dtype | head | prompts | identical to HF | proven near-ties | other divergences | exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for (dtype, name), outcome in outcomes.items():
        others = len(outcome.divergences) - outcome.near_ties
        lines.append(
            f"| {dtype_name(dtype)} | {name} | {outcome.prompts} | {outcome.identical} | {outcome.near_ties} | "
            f"{others} | {'yes' if outcome.exact(dtype) else 'NO'} |"
        )
    lines.append("")
    for dtype in EXACTNESS_DTYPES:
        exact = all(outcomes[dtype, name].exact(dtype) for name in HEAD_CHECKPOINTS)
        lines.append(f"- {dtype_name(dtype)} exact: {'yes' if exact else 'NO'}")
    note = divergence_note(
        {f"{dtype_name(d)} {n}": {"divergences": o.divergences} for (d, n), o in outcomes.items()},
        [f"{dtype_name(d)} {n}" for d, n in outcomes],
    )
    return lines + ([note.rstrip()] if note else [])


def prompt_source(models: Models) -> str:
    if isinstance(models, ShippedModels):
        return f"{Path(models.questions).name}, one category after another"
    return "random token ids"


# --- 2. speed ----------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """One method's tokens, seconds and target passes over a loop."""

    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    runs: int = 0

    def add(self, tokens: int, seconds: float, forwards: int = 0) -> None:
        self.tokens, self.seconds, self.forwards, self.runs = (
            self.tokens + tokens,
            self.seconds + seconds,
            self.forwards + forwards,
            self.runs + 1,
        )

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None


def speed_methods(models: Models) -> dict[str, tuple[torch.nn.Module, dict]]:
    """name -> (model, generate() keywords): the default call and the fixed tree, on the eager and compiled target."""
    methods = {}
    for variant, compiled in (("eager", False), ("compiled", True)):
        model = models.small(models.speed_dtype, compiled)
        head = models.heads(model)[SPEED_HEAD]
        methods[f"default call, {variant}"] = (model, dict(heads=head))
        methods[f"fixed tree, {variant}"] = (model, dict(heads=head, tree=FIXED_TREE, lookup=False, fallback=False))
    return methods


def prepare_speed(methods: dict, prompts: list[torch.Tensor], rows: int) -> dict[str, float]:
    """Untimed: the default calls' trees calibrated for batch 1 and `rows` (the compiled head's package compiled or
    loaded there), then every method run once for 16 new tokens and once as a batch. Returns the seconds of each
    method's first call."""
    first = {}
    for name, (model, settings) in methods.items():
        if settings.get("tree") is None:  # measured once per batch size and cached
            for size in sorted({1, rows}):
                calibrated_tree(model, settings["heads"], batch=size, verbose=True)
        _, first[name] = timed(
            lambda m=model, s=settings: generate(m, prompt_or_input_ids=prompts[0], max_new_tokens=16, **s)
        )
        batch = [p.tolist() for p in prompts[:rows]]
        generate(model, prompt_or_input_ids=batch, max_new_tokens=8, batch_size=BATCH, **settings)
    return first


def speed(models: Models, args, deadline: float) -> list[str]:
    eager = models.small(models.speed_dtype)
    compiled = models.small(models.speed_dtype, compiled=True)
    _, compile_seconds = timed(lambda: warm_up(compiled))  # the target's pass compiled (or loaded) now, not timed
    methods = speed_methods(models)
    prompts = models.prompts(args.prompts)
    rows = min(BATCH, len(prompts))
    first_call = prepare_speed(methods, prompts, rows)
    hf_batch(eager, [prompts[0].tolist()], 8)  # nor HF's first call

    def ours(name: str, prompt_or_prompts, **extra) -> list[Generation]:
        model, settings = methods[name]
        out = generate(
            model, prompt_or_input_ids=prompt_or_prompts, max_new_tokens=args.max_new_tokens, **settings, **extra
        )
        return out if isinstance(out, list) else [out]

    # batch 1: every method on a prompt before the next, so that a slow spell of the machine slows each alike
    one = {"HF generate()": Tally(), **{name: Tally() for name in methods}}
    loop = while_time_allows(prompts, part_of(deadline, 0.6))
    for prompt in tqdm(loop, total=len(prompts), desc="2. speed, batch 1 (prompts)"):
        reference, seconds = timed(lambda p=prompt: hf_greedy(eager, p, args.max_new_tokens))
        one["HF generate()"].add(len(reference), seconds)
        for name in methods:
            results, seconds = timed(lambda n=name, p=prompt: ours(n, p))
            one[name].add(len(results[0].token_ids), seconds, results[0].stats.target_forwards)

    # batch 8: HF's batched, left-padded generate() against ours (at most 8 rows at once), chunk by chunk
    chunks = [[p.tolist() for p in prompts[start : start + BATCH]] for start in range(0, len(prompts), BATCH)]
    eight = {"HF generate()": Tally(), **{name: Tally() for name in methods}}
    for chunk in tqdm(while_time_allows(chunks, deadline), total=len(chunks), desc=f"2. speed, batch {BATCH} (chunks)"):
        outputs, seconds = timed(lambda c=chunk: hf_batch(eager, c, args.max_new_tokens))
        eight["HF generate()"].add(sum(map(len, outputs)), seconds)
        for name in methods:
            results, seconds = timed(lambda n=name, c=chunk: ours(n, c, batch_size=BATCH))
            tokens, forwards = sum(len(r.token_ids) for r in results), sum(r.stats.target_forwards for r in results)
            eight[name].add(tokens, seconds, forwards)
    batch_rows = sum(len(chunk) for chunk in chunks[: eight["HF generate()"].runs])

    lines = [
        f"{models.what}; the {SPEED_HEAD} head, {dtype_name(models.speed_dtype)}, {args.max_new_tokens} new tokens "
        "at most. "
        f"Batch 1: {one['HF generate()'].runs} of {len(prompts)} prompts; batch {BATCH}: {batch_rows} prompts in "
        f"chunks of at most {BATCH} (HF decodes a chunk, left-padded, until its last row ends; ours keeps at most "
        f"{BATCH} rows at once). Methods interleaved prompt by prompt (chunk by chunk) in one process; tokens/s: new "
        "tokens over wall seconds, the device synchronised before and after each call; tau: new tokens per target "
        "pass (a row's own passes at batch 8). The default call is `generate(model, head, prompt)`; the fixed tree "
        f"`{FIXED_TREE.__class__.__name__}(depth={FIXED_TREE.depth}, top_k={FIXED_TREE.top_k}, "
        f"nodes={FIXED_TREE.nodes})` with lookup=False, fallback=False. Compiled: `inference.compile_target` "
        f"(AOTInductor), the target's pass compiled or loaded in {compile_seconds:.0f} s, untimed; untimed too: the "
        "default calls' trees calibrated (which compiles the compiled head's pass), and every method's first call ("
        + "; ".join(f"{name}: {seconds:.1f} s" for name, seconds in first_call.items())
        + ")"
        + ". HF generate() runs the eager model."
        + (
            ""
            if is_compiled(compiled)
            else " Compiling FAILED (see the warning above it): the compiled rows ran eagerly."
        ),
        "",
        "| batch | method | tokens/s | x HF generate() | tau |",
        "|---|---|---|---|---|",
    ]
    for batch, tallies in ((1, one), (BATCH, eight)):
        base = tallies["HF generate()"].tokens_per_second
        for name, tally in tallies.items():
            ratio = tally.tokens_per_second / base if base else 0.0
            tau = f"{tally.tau:.2f}" if tally.tau is not None else "-"
            lines.append(f"| {batch} | {name} | {tally.tokens_per_second:.1f} | {ratio:.2f}x | {tau} |")
    return lines


# --- 3. the engine at scale --------------------------------------------------------------------------------------


class ReplayDrafter(TokenDrafter):
    """Replays accepted lengths: a chain of `depth` tokens a step whose first n are the true continuation and the rest
    wrong, n drawn from `lengths` (lengths[n]: how often n were accepted). A random-weight model has no trained head,
    but the target then accepts exactly n drafts a step, as with one, so the engine runs at a head's pace. Like
    OracleDrafter it knows the answer: `continuation` is the whole expected sequence, prompt included."""

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


@contextmanager
def passes_synchronised(model):
    """Each forward pass of `model` waits for the device before it returns, so that GenerationStats.target_seconds
    (host time around the pass) holds the pass's device time rather than its launches. The loop synchronises at
    every step anyway (it reads the accepted tokens), so this only moves where the wait is counted."""
    handle = model.register_forward_hook(lambda module, inputs, output: synchronize())
    try:
        yield
    finally:
        handle.remove()


@dataclass
class ReplayedRun:
    out: Generation
    seconds: float
    runs: int
    reproduced: bool


def replayed_run(
    model, prompt: torch.Tensor, reference: list[int], depth: int, max_new_tokens: int, seed: int
) -> ReplayedRun:
    """Our loop replaying accepted lengths on `prompt`, timed. A bfloat16 pass over a chain does not round like HF's
    one-token passes, so the loop may part from HF's continuation at a near-tie, after which every replayed "true"
    token would be wrong; the run is then repeated with the loop's own output as the continuation until it reproduces
    it (scripts/engine_overhead.py does the same), and the last run counts."""
    truth = reference
    for runs in range(1, REPLAY_ROUNDS + 1):
        continuation = torch.cat([prompt, torch.tensor(truth, dtype=torch.long)]).to(model.device)
        drafter = ReplayDrafter(continuation, depth, model.config.vocab_size, seed=seed)
        with passes_synchronised(model):
            out, seconds = timed(
                lambda d=drafter: generate(
                    model, d, prompt, max_new_tokens=max_new_tokens, lookup=False, fallback=False
                )
            )
        if out.token_ids == truth:
            return ReplayedRun(out, seconds, runs, True)
        truth = out.token_ids
    return ReplayedRun(out, seconds, REPLAY_ROUNDS, False)


@dataclass
class AtScale:
    """Section 3's figures over its prompts: HF's and our replayed runs, and where our runs' time went."""

    hf: Tally = field(default_factory=Tally)
    ours: Tally = field(default_factory=Tally)
    target: float = 0.0  # GenerationStats.target_seconds, summed
    draft: float = 0.0  # draft_seconds
    loop: float = 0.0  # engine_seconds: the rest
    steps: int = 0  # decode steps (the prefills are none)
    reproduced: int = 0  # runs that reproduced the continuation they replayed
    identical: int = 0  # outputs identical to HF's
    runs: int = 0  # our runs, all told (a prompt takes more than one when its output parts from the replayed one)

    def add(self, reference: list[int], hf_seconds: float, run: ReplayedRun) -> None:
        stats = run.out.stats
        self.hf.add(len(reference), hf_seconds)
        self.ours.add(stats.new_tokens, run.seconds, stats.target_forwards)
        self.target += stats.target_seconds
        self.draft += stats.draft_seconds
        self.loop += stats.engine_seconds
        self.steps += stats.target_forwards - 1
        self.reproduced += run.reproduced
        self.identical += run.out.token_ids == reference
        self.runs += run.runs


def replay_at_scale(model, prompts: list[torch.Tensor], args, deadline: float) -> AtScale:
    """HF generate() and our replayed runs, prompt by prompt, until the deadline."""
    # untimed first calls: kernels loaded, the allocator grown
    warm = hf_greedy(model, prompts[0], 8)
    replayed_run(model, prompts[0], warm, args.replay_depth, max_new_tokens=8, seed=0)
    figures = AtScale()
    loop = while_time_allows(list(enumerate(prompts)), deadline)
    for index, prompt in tqdm(loop, total=len(prompts), desc="3. engine at scale (prompts)"):
        reference, seconds = timed(lambda p=prompt: hf_greedy(model, p, args.max_new_tokens))
        figures.add(
            reference, seconds, replayed_run(model, prompt, reference, args.replay_depth, args.max_new_tokens, index)
        )
    return figures


def scale(models: Models, args, deadline: float) -> list[str]:
    model, build_seconds = timed(models.large)
    prompts = models.large_prompts(args.scale_prompts)
    figures = replay_at_scale(model, prompts, args, deadline)
    shape = ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in shape_of(model).items())
    dtype = model.dtype
    del model  # 16 GB at the 8B shape
    free_device_memory()

    hf, ours, done = figures.hf, figures.ours, figures.hf.runs
    expected = 1 + expected_accepted(ACCEPTED_LENGTHS, args.replay_depth)
    speedup = ours.tokens_per_second / hf.tokens_per_second if hf.tokens_per_second else 0.0
    lines = [
        f"A Llama with {shape}, random weights (`LlamaConfig`, built under `torch.device({str(models.device)!r})`), "
        f"{dtype_name(dtype)}, made in {build_seconds:.0f} s. {done} of {len(prompts)} prompts of about "
        f"{models.large_prompt_tokens} random token ids, {args.max_new_tokens} new tokens each (no EOS). HF greedy "
        "gives each prompt's continuation; our loop is driven by a replay drafter: a chain of "
        f"{args.replay_depth} tokens a step, the first n the continuation's and the rest wrong, n drawn from "
        "ACCEPTED_LENGTHS (the CPU stage-2 EAGLE head's accepted lengths through the default call in "
        f"docs/results/dev2-aoti-head-default-bf16-epyc: {expected:.2f} tokens a pass expected). The loop reproduced "
        f"the continuation it replayed on {figures.reproduced} of {done} prompts ({figures.runs / max(done, 1):.1f} "
        "runs a prompt, the last timed; a bfloat16 chain pass may part from HF's output at a near-tie); "
        f"{figures.identical} of {done} outputs identical to HF's.",
        "",
        "| method | tokens/s | x HF generate() | tau | ms per new token |",
        "|---|---|---|---|---|",
        f"| HF generate() | {hf.tokens_per_second:.1f} | 1.00x | 1.00 | {1e3 / max(hf.tokens_per_second, 1e-9):.1f} |",
        f"| our loop, replayed lengths | {ours.tokens_per_second:.1f} | {speedup:.2f}x | {ours.tau or 0:.2f} | "
        f"{1e3 / max(ours.tokens_per_second, 1e-9):.1f} |",
        "",
        f"Where our loop's time goes (GenerationStats over {figures.steps} decode steps; a forward hook synchronises "
        "the device after each target pass, so that target_seconds holds the passes' device time, not only their "
        "launches):",
        "",
        "| part | seconds | share | ms per decode step |",
        "|---|---|---|---|",
    ]
    total = figures.target + figures.draft + figures.loop
    for part, seconds in (
        ("target passes (target_seconds, the prefills included)", figures.target),
        ("drafting (draft_seconds: propose and observe)", figures.draft),
        ("the loop (the rest: trees, masks, acceptance, cache)", figures.loop),
    ):
        share, per_step = 100 * seconds / max(total, 1e-9), 1e3 * seconds / max(figures.steps, 1)
        lines.append(f"| {part} | {seconds:.2f} | {share:.0f}% | {per_step:.2f} |")
    return lines


def shape_of(model) -> dict[str, int]:
    return {key: getattr(model.config, key) for key in LLAMA_8B_SHAPE}


# --- 4. host synchronisations ------------------------------------------------------------------------------------


@dataclass
class SyncRecorder:
    """Counts the sync warnings and where they come from: the Python line that made the synchronising call (the
    warning's own location), and the innermost line of this repository on the way there."""

    sources: Counter = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.sources.values())

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING not in str(message):
            return  # other warnings are not what this section counts
        self.add(filename, lineno, traceback.extract_stack())

    def add(self, filename: str, lineno: int, stack: traceback.StackSummary) -> None:
        """One synchronisation made at filename:lineno, `stack` the frames that led there."""
        origin = next(
            (
                frame
                for frame in reversed(stack)
                if is_ours(frame.filename)
                and (frame.filename, frame.lineno) != (filename, lineno)
                and Path(frame.filename).resolve() != THIS_FILE
            ),
            None,
        )
        via = f"{shown_path(origin.filename)}:{origin.lineno}" if origin is not None and not is_ours(filename) else ""
        self.sources[f"{shown_path(filename)}:{lineno}", via] += 1


# the calls by which Python reads a tensor's values: on a GPU each waits for the device (a host synchronisation)
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu", "nonzero", "unique"}
HOST_READS |= {"unique_consecutive", "masked_select"}
# the calls that make host values a device tensor: on a GPU, without non_blocking, the host first waits for the device
UPLOADS = {"tensor", "as_tensor", "asarray", "to"}
TORCH_DIR = Path(torch.__file__).resolve().parent


def is_upload(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call copies host values to a device synchronously (inference.transfer.to_device does not): a tensor
    made from values with a device named, or `.to(device)` without non_blocking."""
    if name not in UPLOADS or kwargs.get("non_blocking"):
        return False
    if name != "to":
        return kwargs.get("device") is not None
    return kwargs.get("device") is not None or any(isinstance(arg, (torch.device, str)) for arg in args[1:])


class HostReadRecorder(torch.overrides.TorchFunctionMode):
    """Counts, on any device, the calls that read a tensor's values back to Python (tolist, item, bool(), nonzero, a
    boolean mask as an index...) and, from this repository's code, those that copy host values to a device
    synchronously (is_upload), into a SyncRecorder: each one synchronises a GPU, so on the CPU they stand in for the
    synchronisations torch.cuda.set_sync_debug_mode counts there."""

    def __init__(self, recorder: SyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name == "__getitem__" and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool
            for index in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
        upload = is_upload(name, args, kwargs or {})
        if name in HOST_READS or masked or upload:
            stack = traceback.extract_stack()[:-1]
            caller = next(
                (frame for frame in reversed(stack) if not Path(frame.filename).resolve().is_relative_to(TORCH_DIR)),
                stack[-1],
            )
            # ours only: on the CPU a library's .to(device) of a device tensor looks like an upload (a GPU sees all)
            if not upload or is_ours(caller.filename):
                self.recorder.add(caller.filename, caller.lineno, stack)
        return func(*args, **(kwargs or {}))


@functools.cache
def is_ours(filename: str) -> bool:
    """A file of this repository (not "<frozen ...>" or "<string>", which would resolve into the working folder, nor
    a package installed in a virtual environment inside it)."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return path.is_relative_to(REPO) and "site-packages" not in path.parts


def shown_path(filename: str) -> str:
    """A path as the report shows it: relative to the repository, or from site-packages on."""
    if is_ours(filename):
        return str(Path(filename).resolve().relative_to(REPO))
    return filename.split("site-packages/", 1)[-1]


@contextmanager
def recorded_warnings(recorder: SyncRecorder) -> Iterator[SyncRecorder]:
    """Every warning raised inside goes to `recorder` (which keeps the sync warnings), each time it is raised."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")  # every sync, not only the first from each line
        # catch_warnings restores showwarning on the way out; a recorded WarningMessage would lack the stack
        warnings.showwarning = recorder.showwarning
        yield recorder


@contextmanager
def recording_syncs() -> Iterator[SyncRecorder]:
    """Every host synchronisation of the CUDA calls inside, recorded with its source line."""
    with recorded_warnings(SyncRecorder()) as recorder:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield recorder
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextmanager
def recording_host_reads() -> Iterator[SyncRecorder]:
    """Every read of a tensor's values back to Python inside (HostReadRecorder), recorded with its source line."""
    recorder = SyncRecorder()
    with HostReadRecorder(recorder):
        yield recorder


def source_text(location: str) -> str:
    """The code at `path:line`, as the report quotes it."""
    path, _, line = location.rpartition(":")
    candidates = [REPO / path, *(Path(p) / path for p in sys.path if p)]
    for candidate in candidates:
        text = linecache.getline(str(candidate), int(line)).strip()
        if text:
            return text.replace("|", "\\|").replace("`", "'")  # inside a table cell's code span
    return ""


def syncs(models: Models, args, deadline: float) -> list[str]:
    cuda = models.device.type == "cuda"
    recording = recording_syncs if cuda else recording_host_reads
    model = models.small(models.speed_dtype)
    head = models.heads(model)[SPEED_HEAD]
    prompt = models.prompts(1)[0]
    progress = tqdm(total=3, desc="4. host synchronisations (calls)")
    generate(model, head, prompt, max_new_tokens=args.max_new_tokens)  # its trees calibrated and warm: not counted
    progress.update()
    with recording() as ours:
        out = generate(model, head, prompt, max_new_tokens=args.max_new_tokens)
    progress.update()
    with recording() as plain:
        plain_out = generate(model, None, prompt, max_new_tokens=args.max_new_tokens, lookup=False, fallback=False)
    with recording() as fixed:
        fixed_out = generate(
            model, head, prompt, max_new_tokens=args.max_new_tokens, tree=FIXED_TREE, lookup=False, fallback=False
        )
    with recording() as hf:
        reference = hf_greedy(model, prompt, args.max_new_tokens)
    progress.update()
    progress.close()
    steps = max(out.stats.target_forwards - 1, 1)
    plain_steps = max(plain_out.stats.target_forwards - 1, 1)
    fixed_steps = max(fixed_out.stats.target_forwards - 1, 1)
    counted = (
        'under `torch.cuda.set_sync_debug_mode("warn")` (each warning one host synchronisation)'
        if cuda
        else "counting every read of a tensor's values back to Python (`tolist`, `item`, `bool()`, `nonzero`, a "
        "boolean index...: scripts/gpu_check.py's HostReadRecorder), each of which synchronises a GPU; without "
        "CUDA they stand in for the synchronisations"
    )
    lines = [
        f"One default call `generate(model, head, prompt)` with the {SPEED_HEAD} head, "
        f"{dtype_name(models.speed_dtype)}, eager, on the first prompt of section 1, {args.max_new_tokens} new tokens "
        f"at most, after an uncounted call, {counted}: "
        f"**{ours.count} synchronisations in {steps} decode steps and the prefill, {ours.count / steps:.2f} per "
        f"decode step** ({out.stats.new_tokens} new tokens, tau {out.stats.mean_accepted:.2f}). Our loop without a "
        f"drafter (`heads=None`): {plain.count} in {plain_steps} decode steps and the prefill, "
        f"{plain.count / plain_steps:.2f} a step. The fixed tree of section 2 (no lookup, no fallback): "
        f"{fixed.count} in {fixed_steps} decode steps and the prefill, {fixed.count / fixed_steps:.2f} a step. HF "
        f"generate() on the same prompt: {hf.count} in {len(reference)} new tokens, "
        f"{hf.count / max(len(reference), 1):.2f} a token.",
        "",
        "Where the default call's come from, most frequent first (the line that synchronised; for a line outside this "
        "repository, the innermost line of ours that led there):",
        "",
    ]
    lines += source_rows(ours, steps) + ["", "The fixed tree's:", ""] + source_rows(fixed, fixed_steps)
    return lines


def source_rows(recorder: SyncRecorder, steps: int) -> list[str]:
    """A table of where the synchronisations came from, most frequent first."""
    rows = ["| synchronisations | per decode step | line | code | reached from |", "|---|---|---|---|---|"]
    for (location, via), count in recorder.sources.most_common():
        code = source_text(location)
        rows.append(f"| {count} | {count / steps:.2f} | `{location}` | `{code}` | {via and f'`{via}`'} |")
    return rows


# --- the report --------------------------------------------------------------------------------------------------


def slug(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def default_out(dry_run: bool) -> Path:
    if dry_run:
        return REPO / "outputs" / "gpu-check-dry-run.md"  # outputs/ is ignored by git: random models are no result
    return REPO / "docs" / "results" / f"gpu-{slug(torch.cuda.get_device_name())}.md"


@contextmanager
def dry_run_settings(enabled: bool) -> Iterator[None]:
    """A dry run keeps its calibrations and compiled packages in a temporary folder (random tiny models have no place
    in the user's caches, and a package compiled from them would never be used again), and computes on one thread:
    a tiny model's passes gain nothing from a second, and stall when another process shares the cores."""
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
                os.environ.pop("SPECHEADS_CACHE", None)
            else:
                os.environ["SPECHEADS_CACHE"] = saved_root


SECTIONS = {"exactness": exactness, "speed": speed, "scale": scale, "syncs": syncs}


def render(models: Models, args, command: str, timings: dict[str, float], bodies: dict[str, list[str]]) -> str:
    machine = device_name(models.device)
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    lines = [
        f"# GPU check: {machine}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}, {os.cpu_count()} CPU cores, torch {torch.__version__}{cuda}, transformers "
        f"{transformers.__version__}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.  ",
        f"Budget {args.budget_seconds:.0f} s; the run took {sum(timings.values()):.0f} s ("
        + ", ".join(f"{key} {seconds:.0f} s" for key, seconds in timings.items())
        + ").",
    ]
    if args.dry_run:
        lines += [
            "",
            "**Dry run**: tiny random-weight models on the CPU; the figures check the script, not the engine.",
        ]
    for key, body in bodies.items():
        lines += ["", SECTION_TITLES[key], "", f"Command: `{command}` ({timings[key]:.0f} s)", "", *body]
    return "\n".join(lines) + "\n"


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny random-weight models on the CPU instead of the shipped checkpoints and the 8B shape (seconds)",
    )
    parser.add_argument(
        "--out", default=None, help="the report (default: docs/results/gpu-<card>.md; dry run: outputs/)"
    )
    parser.add_argument("--budget-seconds", type=float, default=480.0, help="the whole run's time (default 480)")
    parser.add_argument("--prompts", type=int, default=None, help="first turns asked (default 20; dry run 3)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 128; dry run 16")
    parser.add_argument(
        "--scale-prompts", type=int, default=None, help="random prompts for the 8B shape (default 8; dry run 2)"
    )
    parser.add_argument(
        "--replay-depth", type=int, default=REPLAY_DEPTH, help=f"the replay drafter's chain (default {REPLAY_DEPTH})"
    )
    parser.add_argument("--questions", default=str(DEFAULT_QUESTIONS), help="Spec-Bench style question file")
    args = parser.parse_args(argv)
    defaults = (3, 16, 2) if args.dry_run else (20, 128, 8)
    for name, default in zip(("prompts", "max_new_tokens", "scale_prompts"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.replay_depth < 1:
        parser.error(f"--replay-depth must be at least 1, got {args.replay_depth}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU, or with --dry-run (tiny random models on the CPU)")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_arguments(argv)
    command = " ".join(["python scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out) if args.out else default_out(args.dry_run)
    with dry_run_settings(args.dry_run):
        models = TinyModels() if args.dry_run else ShippedModels(args.questions)
        budget = Budget(args.budget_seconds, BUDGET_SHARES)
        timings, bodies = {}, {}
        for key, section in SECTIONS.items():
            started = time.perf_counter()
            bodies[key] = section(models, args, budget.deadline(key))
            timings[key] = time.perf_counter() - started
    text = render(models, args, command, timings, bodies)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text + f"\nwrote {out}")
    return out


if __name__ == "__main__":
    from inference.cli import run

    run(main, "gpu_check.py")
