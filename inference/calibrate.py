"""Measure, once per machine, what a verification pass over k tokens costs (and one level of drafting).

    python -m inference.calibrate [--model DIR_OR_HUB_ID] [--heads CHECKPOINT] [--dtype auto] [--batch N] [--refresh]

The best tree depends on the hardware: how much more a pass over k tokens costs than a one-token pass, and what a
draft level costs, differ by instruction set and dtype. The measurement takes seconds and is kept in the artefact
store (inference.store) per (model, heads, dtype, device, threads, compiled packages, torch version, the engine's
own code: inference.store.code_digest); `load_or_measure` reads it back, and generate() sizes its trees with it
(DynamicTreeSpec(cost=...)). A measurement that the machine's load could have distorted (other processes busy
meanwhile, its rounds disagreeing, a cost that cannot be right) is taken again; if it stays doubtful it serves this
process only, with a warning.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from heads.attention import grouped_attention
from heads.files import written_atomically

from . import store
from .accept import Sampling
from .cache import new_cache
from .compiled import compiled_settings, decoding_pass, is_compiled
from .compiled_heads import warm_up
from .doubts import Measurement, busy_elsewhere_since, doubt_about
from .drafters import TrainedHeads, as_drafter, drafter_class, grows_dynamic_trees, trained_head
from .loop import decode
from .tree import chain_inputs
from .tree_size import DynamicTreeSpec, PassCost, calibration_batch

# 4 and 5 both: on a CPU, passes of up to 4 tokens run through a package of their own (inference.compiled.NARROW_TOKENS)
# and cost much less than those of 5, so no cost between them is interpolated
TOKEN_COUNTS = (1, 2, 4, 5, 8, 12, 16, 24, 32, 48)
# Tokens a row: a batch's trees are smaller, and every width is measured, as a batch's cost is not smooth in it. Matrix
# products run in blocks of rows: at 8 rows a bfloat16 pass over 3 tokens a row cost what one over 4 did (Xeon, AMX),
# 7 what 8 did, so an interpolated cost at 5 or 7 would buy widths that waste a block.
BATCH_TOKEN_COUNTS = tuple(range(1, 17))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved_times(runs, repeats: int) -> list[list[float]]:
    """The seconds of each run in each round (each run once a round), so that a burst of load from elsewhere on the
    machine slows every run alike instead of one of them."""
    for run in runs:
        run()  # warm-up
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, spent in zip(runs, times):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            started = time.perf_counter()
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            spent.append(time.perf_counter() - started)
    return times


def interleaved_medians(runs, repeats: int) -> list[float]:
    return [statistics.median(spent) for spent in interleaved_times(runs, repeats)]


def median_seconds(run, repeats: int) -> float:
    return interleaved_medians([run], repeats)[0]


@torch.inference_mode()
def measure(
    model,
    head: TrainedHeads | None = None,
    spec: DynamicTreeSpec | None = None,
    *,
    batch: int = 1,
    context: int = 256,
    token_counts=None,
    repeats: int = 7,
) -> Measurement:
    """The PassCost relative to a one-token pass (and the seconds of that pass), with `context` tokens cached, for
    `batch` sequences verified together (a batch's pass costs more, so each row's tree pays for fewer drafts).

    Each pass is a verification pass as generate() makes it (4D tree mask, explicit positions), every row
    verifying k tokens; its entries are cropped from the cache again, so every measurement sees the same context.
    With a head, whole steps of the decoding loop are timed too (loop_step_seconds), over `context` tokens of random
    text a row, to price a draft level and what every step costs besides its pass and its levels.
    """
    with grouped_attention(model):  # the attention generate() verifies with
        return _measure(
            model,
            head,
            spec,
            batch,
            context,
            token_counts or (TOKEN_COUNTS if batch == 1 else BATCH_TOKEN_COUNTS),
            repeats,
        )


def _measure(model, head, spec, batch: int, context: int, token_counts, repeats: int) -> Measurement:
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    tokens = torch.randint(vocab, (batch, context), generator=generator).to(model.device)
    cache = new_cache(model)  # holds `context` tokens a row
    model(input_ids=tokens, cache=cache, use_cache=True)
    step_pass = decoding_pass(model)  # compiled passes are priced as compiled (inference.compiled)

    def verify(k: int):
        chain = torch.randint(vocab, (k,), generator=generator).to(model.device)
        # hidden states as decoding with a head asks for them
        step_pass(
            cache=cache,
            use_cache=True,
            output_hidden_states=head is not None,
            **chain_inputs(chain, context, batch, model.dtype),
        )
        cache.crop(-k)

    times = interleaved_times([lambda k=k: verify(k) for k in token_counts], repeats)
    seconds = [statistics.median(spent) for spent in times]
    halves = [(statistics.median(times[i][::2]), statistics.median(times[i][1::2])) for i in (0, -1)]
    disagreement = max(abs(a - b) / min(a, b) for a, b in halves)
    # a pass over fewer tokens never costs more than one over more: a measurement that noise inflated is capped
    seconds = [min(seconds[i:]) for i in range(len(seconds))]
    draft_level = draft_step = 0.0
    if head is not None:
        # Whole steps of the decoding loop, one draft kept a row (a 2-token pass), drafting one level or
        # spec.depth levels: a level is what the deeper step costs more, and whatever is left of the shallow
        # step beyond its level and its pass is what every step pays (the head reading the committed tokens,
        # the loop's own accepting and moving of cache entries). Timing the drafting alone put that at 0.02 of a
        # one-token pass at batch 8 (Xeon, AMX, bfloat16); whole steps put it at 0.15-0.17, which keeps wider trees.
        spec = replace(spec or DynamicTreeSpec(), cost=None)
        depth = max(spec.depth, 2)
        rounds = max(repeats // 2, 1)  # a run gives LOOP_STEPS steps: half the rounds of the passes give more samples
        shallow, deep = loop_step_seconds(
            model, head, [replace(spec, depth=1, nodes=1), replace(spec, depth=depth, nodes=1)], tokens, rounds
        )
        level = max(deep - shallow, 0.0) / (depth - 1)
        draft_level, draft_step = level / seconds[0], max(shallow - level - seconds[1], 0.0) / seconds[0]
    cost = PassCost(tuple(token_counts), tuple(s / seconds[0] for s in seconds), draft_level, draft_step)
    return Measurement(cost, seconds[0], disagreement)


class _StepClock:
    """Stands in for the loop's Fallback (inference.fallback): always drafts, and keeps every step's seconds."""

    def __init__(self):
        self.seconds: list[float] = []

    def use_drafter(self) -> bool:
        return True

    def prompt_joined(self) -> None:
        pass

    def record(self, drafted: bool, tokens: float, seconds: float) -> None:
        self.seconds.append(seconds)


LOOP_STEPS = 6  # steps timed a run, after two untimed (the first also feeds the head each whole prompt)


@torch.inference_mode()
def loop_step_seconds(model, head, specs: list[DynamicTreeSpec], prompts: torch.Tensor, rounds: int) -> list[float]:
    """The median seconds of a step of the decode loop (inference.loop) drafting with `head` at each fixed tree
    spec, over the rows of `prompts` [rows, length]; the runs interleaved in `rounds` (no row ever stops: no EOS)."""

    rows = list(prompts)
    no_eos = torch.empty(0, dtype=torch.long, device=prompts.device)
    times = [[] for _ in specs]
    for _ in range(rounds):
        for spec, spent in zip(specs, times):
            clock = _StepClock()
            # the head's own vocabulary: random text would add thousands of tokens a real prompt does not
            drafter = as_drafter(head, model, spec, context_vocab=False)
            # room for every timed step to draft as deep as the spec asks, however many tokens the ones before took
            decode(
                model,
                drafter,
                rows,
                1 + (2 + LOOP_STEPS) * (spec.nodes + 1) + spec.depth,
                Sampling(),
                [None] * len(rows),
                no_eos,
                clock,
                len(rows),
            )
            spent += clock.seconds[2 : 2 + LOOP_STEPS]
    return [statistics.median(spent) for spent in times]


def cache_path(model, head: TrainedHeads | None, spec: DynamicTreeSpec | None, batch: int = 1) -> Path:
    parts = [
        store.weights_digest(model),
        str(model.dtype),
        device_name(model.device),
        torch.get_num_threads(),
        torch.__version__,
        compiled_settings(model),
        None if head is None else (repr(head.config), store.weights_digest(head)),
        None if spec is None else (spec.depth, spec.top_k),
        batch,
        store.code_digest(),  # an engine changed since prices its steps anew
    ]
    return store.artefact_path("calibration", f"{store.artefact_key(*parts)}.json")


_THIS_PROCESS_ONLY: dict[Path, PassCost] = {}  # doubtful or unwritable measurements, not measured again each call


def load_or_measure(
    model,
    head: TrainedHeads | None = None,
    spec: DynamicTreeSpec | None = None,
    *,
    batch: int = 1,
    refresh: bool = False,
    verbose: bool = False,
) -> PassCost:
    """The cached calibration for this model/head/dtype/machine and batch size, measured first when there is none."""
    path = cache_path(model, head, spec, batch)
    if not refresh:
        cost = _THIS_PROCESS_ONLY.get(path) or _read(path)
        if cost is not None:
            return cost
    if verbose:  # generate() says so too: a first call would otherwise spend seconds in silence
        print(
            f"calibrating pass costs on {device_name(model.device)} ({model.dtype}, batch {batch}), once a machine "
            f"(`python -m inference.calibrate` does it ahead of time); kept in {path}...",
            file=sys.stderr,
            flush=True,
        )
    started = time.perf_counter()
    for attempt in range(2):  # a doubtful measurement is taken once more
        busy = busy_elsewhere_since()
        measured = measure(model, head, spec, batch=batch)
        doubt = doubt_about(measured, head is not None, busy())
        if doubt is None:
            break
        if verbose and attempt == 0:
            print(f"  measuring again: {doubt}", file=sys.stderr, flush=True)
    if verbose:
        print(f"  calibrated in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    cost = measured.cost
    if doubt is not None:
        _THIS_PROCESS_ONLY[path] = cost
        warnings.warn(
            f"the pass-cost calibration is doubtful ({doubt}), so it serves this process only and is not kept: "
            "run `python -m inference.calibrate --refresh` on an otherwise idle machine",
            stacklevel=2,
        )
        return cost
    record = {
        "tokens": cost.tokens,
        "relative": cost.relative,
        "draft_level": cost.draft_level,
        "draft_step": cost.draft_step,
        "one_token_pass_ms": 1e3 * measured.one_pass,
        "disagreement": measured.disagreement,
        "measured_at": time.time(),
        "device": device_name(model.device),
        "dtype": str(model.dtype),
        "batch": batch,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "compiled": is_compiled(model),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_atomically(path) as staging:
            staging.write_text(json.dumps(record, indent=1))
    except OSError as error:
        _THIS_PROCESS_ONLY[path] = cost
        warnings.warn(f"could not keep the calibration in {path} ({error}); it serves this process only", stacklevel=2)
    return cost


def _read(path: Path) -> PassCost | None:
    """The calibration kept at `path`, or None (after a warning when it is damaged)."""
    try:
        saved = json.loads(path.read_text())
        return PassCost(
            tuple(saved["tokens"]),
            tuple(float(c) for c in saved["relative"]),
            float(saved["draft_level"]),
            float(saved["draft_step"]),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:  # JSONDecodeError and TreeError are ValueErrors
        warnings.warn(
            f"the calibration cached in {path} is damaged ({type(error).__name__}: {error}); measuring again",
            stacklevel=3,
        )
        return None


def calibration_age(path: Path) -> str | None:
    """How long ago the calibration at `path` was measured ("3.2 hours"), where it says."""
    try:
        hours = (time.time() - float(json.loads(path.read_text())["measured_at"])) / 3600
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (
        f"{hours * 60:.0f} minutes" if hours < 1 else f"{hours:.1f} hours" if hours < 48 else f"{hours / 24:.0f} days"
    )


def grown_tree_spec(head) -> DynamicTreeSpec | None:
    """The default tree of a head whose drafter grows it a level (a head pass) at a time, so that a level's cost is
    measured too: EAGLE, early exit, sequential Medusa. None for any other head (Medusa-1 drafts in one pass)."""
    return drafter_class(head).default_tree(head) if grows_dynamic_trees(head) else None


def calibrated_widths(model, heads, *, batch: int, verbose: bool = False) -> dict[int, PassCost] | None:
    """The calibrations of every batch width up to `batch` rows (1, 2, 4, ... as calibration_batch rounds them), for a
    head whose drafter grows its tree a level at a time: a batch that shrinks as its rows finish, or a server whose
    batch holds fewer requests than it could, prices each step at the rows it has (DynamicTreeDrafter.costs_by_rows).
    None for any other heads."""
    head = trained_head(heads)
    spec = None if head is None else grown_tree_spec(head)
    if spec is None:
        return None
    widths = [1 << shift for shift in range(calibration_batch(batch).bit_length())]
    return {width: load_or_measure(model, head, spec, batch=width, verbose=verbose) for width in widths}


def calibrated_tree(model, heads, *, batch: int = 1, verbose: bool = False) -> DynamicTreeSpec | None:
    """The default tree of a head (alone or in a list of drafters): sized to this machine's pass costs, for
    `batch` sequences decoded together. None when no trained head drafts."""
    head = trained_head(heads)
    if head is None:
        return None
    batch = calibration_batch(batch)
    spec = grown_tree_spec(head)
    if spec is not None:
        return replace(spec, cost=load_or_measure(model, head, spec, batch=batch, verbose=verbose))
    # Medusa-1: its heads draft every depth in one pass, so only the target's passes are priced
    return replace(drafter_class(head).default_tree(head), cost=load_or_measure(model, batch=batch, verbose=verbose))


def main(argv=None) -> None:
    from heads import load_heads

    from .target import load_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="HF hub id or directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--heads",
        default=None,
        help="an EAGLE, early-exit or sequential Medusa head checkpoint, to measure a draft level too",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the dtype to calibrate (auto, the default: bfloat16 where this machine computes it faster, as the demo "
        "uses)",
    )
    parser.add_argument(
        "--batch", type=int, default=1, help="sequences decoded together (generate() over a list of prompts)"
    )
    parser.add_argument("--refresh", action="store_true", help="measure again even when a calibration is cached")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="price compiled passes (inference.compiled), as `python -m inference` runs them by default; --no-compile "
        "prices eager ones",
    )
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    model, _ = load_target(args.model, dtype=args.dtype, compile=args.compile)
    head = load_heads(args.heads, model) if args.heads else None
    warm_up(model, head)  # prices the packages later calls run through
    spec = grown_tree_spec(head)
    if head is not None and spec is None:
        parser.error(
            f"{args.heads} holds Medusa-1 heads, which draft in one pass; calibration measures the draft levels of "
            "EAGLE, early-exit and sequential Medusa heads (omit --heads for pass costs only)"
        )
    batch = calibration_batch(args.batch)
    path = cache_path(model, head, spec, batch)
    age = None if args.refresh else calibration_age(path)
    cost = load_or_measure(model, head, spec, batch=batch, refresh=args.refresh, verbose=True)
    if age is not None:
        print(f"measured {age} ago, kept in {path} (--refresh measures again)")
    print(f"{'tokens':>6}  cost (x one-token pass)")
    for k, c in zip(cost.tokens, cost.relative):
        print(f"{k:>6}  {c:.2f}")
    if head is not None:
        print(
            f"one draft level: {cost.draft_level:.3f} x a one-token pass; every step besides its pass and levels: "
            f"{cost.draft_step:.3f}"
        )


if __name__ == "__main__":
    from .cli import run

    run(main, "python -m inference.calibrate")
