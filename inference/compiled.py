"""The target's decoding passes compiled ahead of time (torch.export + AOTInductor), the Hugging Face model as it is.

    model, tokenizer = load_target()               # compiled by default: compile_target(model)
    generate(model, heads, prompt, tokenizer=tokenizer)   # its passes (and an EAGLE head's) through the packages

Why: an eager pass of a small model is mostly overhead between kernels, and its weights reach the matrix kernels
unpacked every call. Exported once with every size dynamic (rows, tokens, cache length), one program serves plain
steps, trees, batches and prompts; inductor's `freezing` packs its weights once for the CPU's kernels. On a CPU
its matrix products go through inductor's C++ GEMM template (TEMPLATE_OPTIONS), which reads the weights of a few rows
at about the memory's pace where oneDNN's kernels read them at about half of it. With AMX tiles, in bfloat16, the
template beats oneDNN at every width (prompts included), so one package serves every pass; elsewhere it falls far
behind past a few rows, so a second package with oneDNN's products serves passes of more than NARROW_TOKENS tokens.
Whether the template's narrow package beats oneDNN's at all differs between CPUs without AMX: the first process to
build it times a one-token pass through each, and keeps it only where it is faster (`narrow_verdict`). In bfloat16 on
a CPU with AVX512-BF16 and no AMX, our own kernel takes the linear layers instead (inference.kernels, put in by
graph_passes.packed_products when the pass is exported): one package, no template.

The first use builds the packages in this process, with a progress line, under a lock (inference.store); later
processes load them in seconds. A package is keyed by a digest of every weight, so changed weights get their own.
Whatever goes wrong (a model that does not export, a cache that cannot be written, a damaged file) ends in eager
passes after one warning that says what happened and what to do. Measured costs: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers.modeling_outputs import CausalLMOutputWithPast

from heads.eagle import causal_mask
from heads.files import written_atomically

from . import huge_pages, kernels, store
from .cache import new_cache
from .graph_passes import ResidualAddsApart
from .passes import cache_shapes, export_decoding_pass, logits_positions, stores_with_room, take_entries

# weights as constants, packed once for the matrix kernels; the wrapper (the calls between kernels) compiled at -O0,
# which compiles faster and runs no slower; linear layers reading the same input (queries, keys and values; gate
# and up) as one matrix product; residual adds in inductor's own kernels, not in oneDNN's products (graph_passes)
INDUCTOR_OPTIONS = {
    "freezing": True,
    "aot_inductor.compile_wrapper_opt_level": "O0",
    "cpp.enable_concat_linear": True,
    "post_grad_custom_pre_pass": ResidualAddsApart(),
}
# Matrix products through inductor's C++ GEMM template (max_autotune with the CPP backend alone: one candidate a
# product, so nothing is benchmarked), generated for the threads of the process that compiles it. Without AMX (or in
# float32) it serves only passes of at most NARROW_TOKENS tokens in all (rows x tokens: plain steps, small trees).
TEMPLATE_OPTIONS = {**INDUCTOR_OPTIONS, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
NARROW_TOKENS = 4
PASSES = "_specheads_compiled_passes"  # the module's attribute holding its compiled passes (they live and die together)
# longer prompts are prefilled eagerly, where the model's own causal attention needs no mask (the package's holds
# the prompt's length squared) and gains about as much as the package would
COMPILED_PREFILL_TOKENS = 1024
COMPILE_ERRORS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._inductor.exc.InductorError,
    torch._inductor.exc.CppCompileError,
)


class CompiledPasses:
    """Calls the model like `model(**kwargs)` for a decoding pass (input_ids, position_ids, a 4D attention_mask
    and a filled cache), through the compiled packages (where there are two, the narrow one for passes of at most
    NARROW_TOKENS tokens in all); loads or builds them on first use. Falls back to the eager model, once and with a
    warning, when they cannot be had."""

    what = "the target's decoding pass"  # for the progress line
    gemm_template = True  # on a CPU, matrix products through inductor's GEMM template (module docstring)

    def __init__(self, module):
        self.module = module
        self.runner = None
        self.narrow_runner = None  # the narrow passes' package, where there is one
        self.paths: list[Path] = []  # the packages loaded
        self.failed: str | None = None
        self.cache_shapes: list[tuple[int, int]] | None = None  # read when a prompt's pass first needs them
        self._lock = threading.Lock()  # one thread prepares the packages; the others wait for them

    def __call__(self, *, input_ids, cache, position_ids=None, attention_mask=None, logits_to_keep=None, **unused):
        model = self.module
        rows, new = input_ids.shape
        prefill = cache.get_seq_length() == 0
        fits = position_ids is not None and (new <= COMPILED_PREFILL_TOKENS or not prefill)
        if fits and prefill and attention_mask is None and self.ready():  # eagerly, the model's own causal mask
            attention_mask = causal_mask(new, 0, model.dtype, input_ids.device).expand(rows, -1, -1, -1)
        full_inputs = (
            fits and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype == model.dtype
        )
        if not (full_inputs and self.ready()):
            # the package takes a pass's inputs as generate() gives them (an additive 4D mask, positions); anything
            # else, and a long prompt (whose mask would hold its length squared), runs eagerly
            keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
            return model(
                input_ids=input_ids,
                cache=cache,
                position_ids=position_ids,
                attention_mask=attention_mask,
                **keep,
                **unused,
            )
        logits, hidden_states = self._run_with_cache(
            cache, [input_ids, position_ids, attention_mask, logits_positions(logits_to_keep, new, input_ids.device)]
        )
        return CausalLMOutputWithPast(logits=logits, hidden_states=tuple(hidden_states))

    def _run_with_cache(self, cache, inputs: list[torch.Tensor], extra: list[torch.Tensor] = ()) -> list:
        """The package's outputs for (inputs, each layer's stores, extra), the narrow passes' package's for a pass of
        at most NARROW_TOKENS tokens in all; the pass writes its new entries into the cache's buffers in place."""
        rows, new = inputs[0].shape[:2]
        cached, device = cache.get_seq_length(), inputs[0].device
        if cached == 0:  # a prompt's pass (the target's prefill, a head's first read): stores shaped as its cache
            if self.cache_shapes is None:
                self.cache_shapes = self.layer_shapes()
            missing = len(self.cache_shapes) - len(cache.layers)
            if missing > 0:  # a cache that adds its layers as a model first writes to them (cache.position_cache)
                cache.layers.extend(cache.layer_class_to_replicate() for _ in range(missing))
            likes = [
                torch.empty(rows, heads, 0, dim, dtype=self.dtype, device=device) for heads, dim in self.cache_shapes
            ]
        else:
            likes = [layer.keys for layer in cache.layers]
        shared = getattr(cache.layers[0], "shared", None)  # cache.SharedBuffers: all layers' buffers in one
        stores = None if shared is None else shared.stores(rows, cached, cached + new)  # the usual case, at once
        at_once = stores is not None
        if not at_once:
            before = None if shared is None else shared.tensor
            stores = [stores_with_room(layer, like, new) for layer, like in zip(cache.layers, likes, strict=True)]
            if shared is not None and shared.tensor is not before and shared.tensor is not None:
                # a layer past the first grew every layer's buffers: the stores taken before it were the old ones
                stores = [stores_with_room(layer, like, new) for layer, like in zip(cache.layers, likes, strict=True)]
        keys, values = [k for k, _ in stores], [v for _, v in stores]
        narrow = self.narrow_runner is not None and rows * new <= NARROW_TOKENS
        outputs = (self.narrow_runner if narrow else self.runner)(
            *[x.contiguous() for x in inputs], keys, values, *[x.contiguous() for x in extra]
        )
        if at_once:
            shared.extend(stores, cached + new)
        else:
            for layer, (key_store, value_store) in zip(cache.layers, stores, strict=True):
                take_entries(layer, key_store, value_store, cached, new)
        return outputs

    def ready(self, verbose: bool = True, recheck: bool = False) -> bool:
        """Load or build the packages if that was not done yet; False when they cannot be had (decode eagerly).
        With `recheck` (once a generate() call), weights changed in place since get packages of their own."""
        if recheck and self.runner is not None and self.packages()[0][0] != self.paths[0]:
            self.runner = self.narrow_runner = None
        if self.runner is None and self.failed is None:
            with self._lock:
                if self.runner is None and self.failed is None:
                    self._prepare(verbose)
        return self.runner is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    def layer_shapes(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) of each layer of the cache the passes take (for a prompt's pass, its cache empty)."""
        return cache_shapes(self.module)

    def key_parts(self) -> list:
        """What a package of these passes depends on, besides the options, the machine and the libraries."""
        model = self.module
        return [model.dtype, model.config.to_json_string(), store.weights_digest(model)]

    def name(self) -> str:
        model = self.module
        name = Path(getattr(model.config, "_name_or_path", "") or type(model).__name__).name or "model"
        return f"{name}-{str(model.dtype).removeprefix('torch.')}"

    def packages(self) -> list[tuple[Path, dict]]:
        """(where it goes, inductor's options) of each package: the one every pass can run through, then, where the
        GEMM template serves only a few tokens, the narrow passes' one."""
        weight = next(self.module.parameters())
        device = weight.device
        hardware = (
            torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
        )
        kernel = kernels.digest() if kernels.wanted(device, weight.dtype) else None
        packs = kernels.packs_products(device, weight.dtype)
        common = [self.key_parts(), kernel, packs, device.type, hardware, torch.__version__, transformers.__version__]
        if device.type != "cpu" or not self.gemm_template or packs:  # our kernel serves the passes of a few rows
            kinds = [("", INDUCTOR_OPTIONS)]
        elif template_serves_every_pass(weight.dtype):
            kinds = [("-template", TEMPLATE_OPTIONS)]
        else:
            kinds = [("", INDUCTOR_OPTIONS), ("-narrow", TEMPLATE_OPTIONS)]
        packages = []
        for suffix, options in kinds:
            threads = torch.get_num_threads() if options is TEMPLATE_OPTIONS else None
            key = store.artefact_key(*common, options, threads)
            packages.append((store.artefact_path("compiled", f"{self.name()}{suffix}-{key}.pt2"), options))
        return packages

    def export(self):
        return export_decoding_pass(self.module)

    def _prepare(self, verbose: bool) -> None:
        weight = next(self.module.parameters())
        if kernels.wanted(weight.device, weight.dtype):  # traced into the packages, and run by them
            kernels.load(verbose)
        packages = self.packages()
        program = []  # exported once, on the first package to build

        def exported():
            if not program:
                program.append(self.export())
            return program[0]

        runners = []
        for number, (path, options) in enumerate(packages):
            if number == 1 and _recorded_verdict(path) is False:
                break  # timed against oneDNN's on this machine, and slower
            what = self.what if number == 0 else f"the package for passes of up to {NARROW_TOKENS} tokens"
            try:
                runners.append(_load_or_build(path, exported, options, what, verbose))
            except COMPILE_ERRORS as error:
                store.record_failure(path, _reason(error))
                problem = f"{_reason(error)}; it is recorded in {store.failure_path(path)}"
            except _RecordedFailure as failure:
                problem = f"{failure}, when this machine tried; to try again, delete {store.failure_path(path)}"
            except OSError as error:  # the store cannot be written (a path through a file, a read-only or full disk)
                problem = f"{_reason(error)}; check that {path.parent} is a writable directory (SPECHEADS_CACHE)"
            except RuntimeError as error:  # built, and still not loading
                problem = f"the package at {path} does not load: {_reason(error)}"
            else:
                continue
            if number == 0:
                return self._fail(problem)
            warnings.warn(f"{what} is not compiled ({problem}); those passes run through the other one", stacklevel=5)
        self.runner, self.narrow_runner = runners[0], (runners[1] if len(runners) > 1 else None)
        if self.narrow_runner is not None:
            try:
                faster = narrow_verdict(self, packages[1][0])
            except RuntimeError as error:  # loaded, and failing when run
                warnings.warn(
                    f"the package for passes of up to {NARROW_TOKENS} tokens does not run ({_reason(error)}); "
                    "those passes run through the other one",
                    stacklevel=5,
                )
                faster = False
            if not faster:
                self.narrow_runner, runners = None, runners[:1]
        self.paths = [path for path, _ in packages[: len(runners)]]

    def _fail(self, reason: str) -> None:
        """Run eagerly from now on, after one warning naming the reason."""
        self.failed = reason
        warnings.warn(f"compiling failed on {type(self.module).__name__} ({reason}); running it eagerly", stacklevel=5)


def narrow_verdict(passes: CompiledPasses, narrow_path: Path) -> bool:
    """Whether the narrow package's one-token pass beats the other package's on this machine: recorded beside the
    narrow package, or timed now (both loaded in `passes`) and recorded."""
    known = _recorded_verdict(narrow_path)
    if known is not None:
        return known
    narrow, other = one_token_seconds(passes)
    with contextlib.suppress(OSError), written_atomically(_verdict_path(narrow_path)) as staging:
        staging.write_text(json.dumps({"narrow_ms": 1e3 * narrow, "other_ms": 1e3 * other}))
    return narrow < other


def one_token_seconds(passes: CompiledPasses, rounds: int = 15) -> tuple[float, float]:
    """Median seconds of a one-row, one-token pass after 64 cached tokens, through the narrow package and through
    the other, interleaved as calibration times its passes (a machine's load weighs on both alike)."""
    from .calibrate import interleaved_medians  # calibration prices compiled passes: it imports this module

    model, context = passes.module, 64
    device = next(model.parameters()).device
    prompt = torch.randint(model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    prompt, token = prompt[:, :context].to(device), prompt[:, context:].to(device)
    cache, narrow = new_cache(model), passes.narrow_runner
    step = {
        "input_ids": token,
        "position_ids": torch.tensor([[context]], device=device),
        "attention_mask": causal_mask(1, context, model.dtype, device),
    }

    def through(package):
        def run():
            passes.narrow_runner = package
            passes(cache=cache, **step)
            cache.crop(-1)

        return run

    try:
        with torch.inference_mode():
            passes(input_ids=prompt, cache=cache, position_ids=torch.arange(context, device=device)[None])
            narrow_seconds, other_seconds = interleaved_medians([through(narrow), through(None)], rounds)
    finally:
        passes.narrow_runner = narrow
    return narrow_seconds, other_seconds


def _verdict_path(narrow_path: Path) -> Path:
    return narrow_path.with_name(narrow_path.name + ".timed.json")


def _recorded_verdict(narrow_path: Path) -> bool | None:
    """What `narrow_verdict` recorded for the package at `narrow_path` on this machine, None if nothing is."""
    try:
        timed = json.loads(_verdict_path(narrow_path).read_text())
        return timed["narrow_ms"] < timed["other_ms"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _RecordedFailure(Exception):
    """A package whose build failed with a compile error before, on this machine."""


def _load_or_build(path: Path, program, options: dict, what: str, verbose: bool):
    """The package at `path`, loaded, or built from `program()` first; one that does not load is built again."""
    if path.exists():
        try:
            return _load(path)
        except (RuntimeError, OSError) as error:  # damaged, or from a machine it was not compiled for
            warnings.warn(
                f"could not load the compiled package {path} ({_reason(error)}); compiling it again", stacklevel=6
            )
            path.unlink(missing_ok=True)
    failure = store.recorded_failure(path)
    if failure is not None:
        raise _RecordedFailure(failure)
    if verbose:
        print(f"compiling {what} (once a machine; kept in {path.parent})...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with seconds_counted("  compiling", verbose):
        store.build_once(path, lambda staging: _package(program(), staging, options), what=what, verbose=verbose)
    if verbose:
        print(f"  ready in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return _load(path)


def _load(path: Path):
    """The package at `path`, loaded, its weights in huge pages where the machine allows (inference.huge_pages)."""
    with huge_pages.for_new_mappings():
        return torch._inductor.aoti_load_package(str(path))


@contextlib.contextmanager
def seconds_counted(what: str, shown: bool = True, stream=None, every: float = 1.0):
    """On a terminal, a line counting the seconds while the block runs (a compile of minutes shows that it goes
    on); elsewhere (a log) nothing: the lines before and after say what ran and how long it took."""
    stream = stream or sys.stderr
    if not (shown and stream.isatty()):
        yield
        return
    line = tqdm(desc=what, bar_format="{desc}: {elapsed}", file=stream, leave=False)
    done = threading.Event()

    def tick():
        while not done.wait(every):
            line.refresh()

    ticking = threading.Thread(target=tick, daemon=True)
    ticking.start()
    try:
        yield
    finally:
        done.set()
        ticking.join()
        line.close()


def _reason(error: Exception) -> str:
    """Why something failed, in one line (the warning's, and the failure record's)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]  # some start with a blank line
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _package(program, path: Path, options: dict) -> None:
    """Compile an exported program into the package at `path` with inductor's `options`."""
    with torch.no_grad():  # inductor freezes the weights only with gradients off
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(options))


def compile_target(model):
    """Decode `model` with compiled passes from now on (generate(), calibration); returns the model itself, whose
    own forward stays as it was (model.generate() and direct calls run eagerly). The packages are loaded or built
    on first use, or ahead of it with `inference.warm_up`. A package holds the weights it was built from: weights
    changed afterwards (in place, or on another instance) get packages of their own at the next generate() call."""
    if not hasattr(model, PASSES):
        setattr(model, PASSES, CompiledPasses(model))
    return model


def compiled_settings(model) -> str | None:
    """What calibration keys its measurements by: None for eager passes, else the packages' file names (a pass
    compiled otherwise costs otherwise)."""
    if not is_compiled(model):
        return None
    passes = getattr(model, PASSES)
    return " + ".join(path.name for path in (passes.paths or package_paths(model)))


def is_compiled(model) -> bool:
    passes = getattr(model, PASSES, None)
    return passes is not None and passes.failed is None


def decoding_pass(model):
    """What decoding steps call to run `model`: its compiled passes when compile_target registered them, else the
    model."""
    return getattr(model, PASSES, model)


def package_paths(model) -> list[Path]:
    """Where `model`'s packages go (as compile_target registered its passes, else as it would)."""
    return [path for path, _ in (getattr(model, PASSES, None) or CompiledPasses(model)).packages()]


def template_serves_every_pass(dtype: torch.dtype) -> bool:
    """Whether inductor's GEMM template beats oneDNN's products at every width on this CPU: with AMX tiles, in
    bfloat16 (docs/benchmarks.md#compiled-passes), so that one package serves every pass."""
    return dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()
