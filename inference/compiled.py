"""The target's decoding passes compiled ahead of time (torch.export + AOTInductor), the Hugging Face model as it is.

    model, tokenizer = load_target(dtype="bfloat16", compile=True)   # or: compile_target(model)
    generate(model, heads, prompt, tokenizer=tokenizer)              # its passes (and an EAGLE head's) compiled

Why: an eager pass of SmolLM2-135M runs at a fraction of what the hardware allows. On a 2-core AMD EPYC
(AVX512-BF16, bfloat16, 200 tokens cached) a one-token pass took 40 ms eager and 17 ms compiled, a 16-token pass
53 ms and 25 ms, a one-token pass of 8 rows 48 ms and 25 ms. Nearly all of it is the weights: frozen into the
compiled code (inductor's `freezing`), they are packed once for the CPU's matrix kernels.

One pass, `DecodingPass` (token ids, positions, the additive mask and the cache's buffers as plain tensors in; logits
and hidden states out; the new tokens' keys and values written into the buffers in place, after the cached entries, as
gpt-fast's cache is, so no pass copies the cache), is exported with every size dynamic (rows, tokens, cache length), so
one exported program serves plain steps, trees, batches and prompts (the logits of their last tokens only). On a CPU it
is compiled into two packages: passes of up to NARROW_TOKENS tokens in all (plain steps, small trees) run through one
whose matrix products are inductor's C++ GEMM template, which reads the weights of a few rows at nearly the memory's
pace (a one-token pass of SmolLM2-135M in bf16: 12.4 ms against 17-23 ms through oneDNN), and wider passes through one
with oneDNN's products, which the template falls far behind past a few rows. An EAGLE head's passes (over the committed
tokens and each draft level) are compiled the same way when the target's are: 4.9 ms of drafting a step instead of 6.9;
so are the early-exit draft's, which took it from 1.01x to 1.10x plain decoding in float32 on dev. The first call waits
about 70 s on 2 CPU cores (65-72 s for SmolLM2-135M's package and its EAGLE head's on a 2-core EPYC) for the target's
package every pass can run through and the head's. A second process compiles the head's package while this one exports
the target's program (on a fresh machine after building the C++ headers every package shares); the program is then cut
in two between its layers (split_program), and each process compiles a half; the second process then compiles the narrow
package in the background, stopped while a call of this process generates, and the calls that start after it lands run
through it. The result is kept on disk (under SPECHEADS_CACHE/compiled, keyed by the weights, the dtype, the CPU's
instruction set, the threads and the library versions), so a second process loads it in a few seconds. A prompt longer
than COMPILED_PREFILL_TOKENS is prefilled eagerly. A model that does not export or compile decodes eagerly, after one
warning naming the reason; the failure is recorded beside where its package would be, so that later processes do not
spend minutes failing again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import transformers
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
from tqdm import tqdm
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from heads.attention import grouped_attention
from heads.eagle import causal_mask

from .cache import PositionLayer, position_cache
from .split_program import HalvesRunner, split_program
from .target import cache_root

FORMAT = 7  # the passes' inputs, outputs and sizes; bump it when they change, so that older packages are not loaded
# weights as constants, packed once for the matrix kernels; the wrapper (the calls between kernels) compiled at -O0:
# 13 s less to compile (94.7 s against 106 in all on a 2-core EPYC) and no slower a pass. Linear layers reading the
# same input (queries, keys and values; gate and up) as one matrix product: 2 kernel calls a layer fewer, a bfloat16
# pass over 1 / 8 / 16 tokens 10% / 5% / 4% faster (2-core EPYC with AVX512-BF16, 200 tokens cached)
INDUCTOR_OPTIONS = {
    "freezing": True,
    "aot_inductor.compile_wrapper_opt_level": "O0",
    "cpp.enable_concat_linear": True,
}
# On a CPU, a pass of at most NARROW_TOKENS tokens in all (rows x tokens: a plain step, a small tree) runs through a
# second package whose matrix products are inductor's own C++ GEMM template instead of oneDNN's (max_autotune with
# the CPP backend alone: one candidate a product, so nothing is benchmarked). For a few rows it reads the weights at
# nearly the memory's pace, where oneDNN's kernels read them at half of it: SmolLM2-135M in bfloat16, 300 tokens
# cached, 2-core EPYC, one token 12.4-12.6 ms against 17.3-23.0, four tokens 13.4-15.9 against 15.1-17.5; past
# that the template falls far behind (nine tokens 52-56 ms against 19-24), so wider passes keep oneDNN's package.
# The template is generated for a fixed number of threads: those of the process that compiles it.
NARROW_TOKENS = 4
NARROW_OPTIONS = {**INDUCTOR_OPTIONS, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
# a helper's job (_start_helper) standing for those the first process writes, once it knows them, to this file in
# the helper's scratch folder: the second half of the target's program, cut after the heads' programs went ahead
MORE_JOBS = "more-jobs.json"
PASSES = "_specheads_compiled_passes"  # the module's attribute holding its compiled passes (they live and die together)
# sizes above 1 for every dynamic dimension (torch specializes 0 and 1), and room after the cached entries
EXAMPLE_ROWS, EXAMPLE_TOKENS, EXAMPLE_CACHED, EXAMPLE_CAPACITY, EXAMPLE_LOGITS = 2, 3, 5, 9, 2
# every input's rows, and every store's capacity, one named size each. With a size of its own (Dim.AUTO) each of
# SmolLM2-135M's 60 stores brought two symbols of one value that inductor reasons about one by one: compiling its
# pass took 104.5 s with them and 82.8 s with these (2-core EPYC). Token counts stay Dim.AUTO: named, export refuses
# a guard it cannot simplify (t * min(64, 192 t) == 64 t).
ROWS, CAPACITY = torch.export.Dim("rows"), torch.export.Dim("capacity")
# prompts up to this long are prefilled through the package too (one prompt, bfloat16, 2-core EPYC: 16 / 64 / 256 /
# 1,024 tokens 2.3x / 1.6x / 1.1x / 1.06x faster than eager); longer ones run eagerly, where the model's own causal
# attention needs no mask (the package's holds the prompt's length squared) and gains as much
COMPILED_PREFILL_TOKENS = 1024
COMPILE_ERRORS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._inductor.exc.InductorError,
    torch._inductor.exc.CppCompileError,
)


class DecodingPass(torch.nn.Module):
    """One decoding pass of `model` with its cache as plain tensors, the form torch.export takes: key_stores[i] and
    value_stores[i] [rows, kv_heads, capacity, head_dim] for layer i, whose first entries are the cached ones (as
    many as the mask's keys less the new tokens), followed by room for at least the new tokens' entries, which the
    pass writes there in place (_StoreLayer). Returns the logits at `logits_positions` (the new tokens' indices: all
    of them to verify a tree, the last ones to prefill prompts) and every layer's hidden states."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        logits_positions,
        key_stores: list[torch.Tensor],
        value_stores: list[torch.Tensor],
    ):
        cache = _stored_cache(key_stores, value_stores, attention_mask.shape[-1] - input_ids.shape[1])
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_positions,
        )
        return out.logits, tuple(out.hidden_states)


class _StoreLayer(DynamicLayer):
    """A cache layer over an exported pass's stores: its first `cached` entries are the cached ones, and the pass's
    new entries are written in place after them, so attention reads the stores as they are. DynamicLayer's way
    concatenated a copy of the whole cache with the new entries in every layer of every pass, which the caller then
    wrote into its own cache: a one-token pass of SmolLM2-135M (bfloat16, 2-core EPYC) took 13.4-13.8 ms with 50
    tokens cached and 17.8-19.4 ms with 1,000 that way, 10.3-12.0 and 13.5-15.6 ms this way."""

    def __init__(self, key_store: torch.Tensor, value_store: torch.Tensor, cached: int):
        super().__init__()
        self.key_store, self.value_store, self.cached = key_store, value_store, cached
        self.lazy_initialization(key_store, value_store)
        self.keys, self.values = key_store[:, :, :cached], value_store[:, :, :cached]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.cached + key_states.shape[-2]
        self.key_store[:, :, self.cached : end].copy_(key_states)
        self.value_store[:, :, self.cached : end].copy_(value_states)
        self.keys, self.values = self.key_store[:, :, :end], self.value_store[:, :, :end]
        return self.keys, self.values


def _stored_cache(key_stores: list[torch.Tensor], value_stores: list[torch.Tensor], cached: int) -> Cache:
    """A cache over each layer's first `cached` entries of its stores, which takes new entries in place after them
    (an exported pass's cache argument)."""
    return Cache(layers=[_StoreLayer(k, v, cached) for k, v in zip(key_stores, value_stores, strict=True)])


def _stores_with_room(layer, like: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's entries in the layout a package takes (contiguous, the cached entries first) with room for `new`
    entries after them: a PositionLayer's buffer rows, which the pass then writes into, else a copy. `like`: entries
    [rows, heads, any count, dim] of the cache's dtype (its own where it has some)."""
    if isinstance(layer, PositionLayer):
        return layer.reserve(like, new)
    used = layer.get_seq_length() if layer.is_initialized else 0
    room = like.new_empty(*like.shape[:-2], new, like.shape[-1])
    entries = (layer.keys, layer.values) if used else (like, like)
    return tuple(torch.cat([part, room], dim=-2) for part in entries)


def _take_entries(layer, key_store: torch.Tensor, value_store: torch.Tensor, cached: int, new: int) -> None:
    """The cache takes in the `new` entries a pass wrote into its stores after the `cached` ones."""
    if isinstance(layer, PositionLayer):
        layer.extend(key_store.shape[0], new)
    else:
        layer.update(key_store[:, :, cached : cached + new], value_store[:, :, cached : cached + new])


class CompiledPasses:
    """Calls the model like `model(**kwargs)` for a decoding pass (input_ids, position_ids, a 4D attention_mask
    and a filled cache), through the compiled packages (on a CPU, the narrow passes' one for passes of at most
    NARROW_TOKENS tokens in all); compiles or loads them on first use. Falls back to the eager model, once and with a
    warning, if exporting or compiling fails."""

    what, takes = "the target's decoding pass", "one and a half minutes"  # for the progress line
    narrow_passes = True  # a second package for passes of at most NARROW_TOKENS tokens, on a CPU
    split_passes = True  # on a CPU, compiled in two halves by two processes at once (split_program)

    def __init__(self, module):
        self.module = module
        self.runner = None
        self.narrow_runner = None  # the narrow passes' package, where there is one
        self.path: Path | None = None  # the package, once loaded
        self.narrow_path: Path | None = None  # the narrow passes' package, once loaded
        self.narrow_pending: Path | None = None  # the narrow passes' package while it compiles in the background
        self.helper: subprocess.Popen | None = None  # the process compiling it, where this one started it
        self.failed: str | None = None
        self.compile_seconds = 0.0  # what preparing the package took in this process (compiling, or loading it)
        self.cache_shapes: list[tuple[int, int]] | None = None  # read when a prompt's pass first needs them
        self._lock = threading.Lock()  # one thread compiles; the others wait for its package
        self._pausing = 0  # generate() calls running while `helper` compiles: it is stopped until none runs

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
        if cached == 0:  # a prompt's pass (the target's only): stores shaped as its cache
            if self.cache_shapes is None:
                self.cache_shapes = self.read_cache_shapes()
            likes = [
                torch.empty(rows, heads, 0, dim, dtype=self.module.dtype, device=device)
                for heads, dim in self.cache_shapes
            ]
        else:
            likes = [layer.keys for layer in cache.layers]
        stores = [_stores_with_room(layer, like, new) for layer, like in zip(cache.layers, likes, strict=True)]
        keys, values = [k for k, _ in stores], [v for _, v in stores]
        narrow = self.narrow_runner is not None and rows * new <= NARROW_TOKENS
        outputs = (self.narrow_runner if narrow else self.runner)(
            *[x.contiguous() for x in inputs], keys, values, *[x.contiguous() for x in extra]
        )
        for layer, (key_store, value_store) in zip(cache.layers, stores, strict=True):
            _take_entries(layer, key_store, value_store, cached, new)
        return outputs

    def read_cache_shapes(self) -> list[tuple[int, int]]:
        """(kv_heads, head_dim) of each layer's cache entries."""
        model = self.module
        one = torch.zeros(1, 1, dtype=torch.long, device=model.device)
        return _cache_shapes(lambda cache: model(input_ids=one, cache=cache, use_cache=True))

    def ready(self, verbose: bool = True, alongside: list[CompiledPasses] = ()) -> bool:
        """Load or compile the packages if that was not done yet; False when compiling failed (decode eagerly). If
        these compile, the packages of `alongside` (a head's) compile beside them; each loads its own on its first
        `ready`. On a CPU the narrow passes' package may still be compiling in the background when this returns:
        take_narrow() loads it once it has landed."""
        if self.runner is None and self.failed is None:
            with self._lock:
                if self.runner is None and self.failed is None:
                    self._prepare(verbose, alongside)
        return self.runner is not None

    def package_path(self) -> Path:
        model = self.module
        name = Path(getattr(model.config, "_name_or_path", "") or type(model).__name__).name or "model"
        return (
            cache_root()
            / "compiled"
            / (
                f"{name}-{str(model.dtype).removeprefix('torch.')}-"
                f"{package_key(model, model.config.to_json_string())}.pt2"
            )
        )

    def narrow_package_path(self, path: Path | None = None) -> Path | None:
        """Where the narrow passes' package goes, beside the package at `path` (package_path(), keyed by the weights,
        by default) and keyed by its options and this process's threads (which its products are generated for), or
        None where there is none: not on a CPU."""
        if not self.narrow_passes or next(self.module.parameters()).device.type != "cpu":
            return None
        path = path or self.package_path()
        key = hashlib.blake2b(repr((NARROW_OPTIONS, torch.get_num_threads())).encode(), digest_size=6).hexdigest()
        return path.with_name(f"{path.stem}-narrow-{key}.pt2")

    def export(self):
        """The pass as torch.export's program, every size dynamic."""
        model = self.module
        self.cache_shapes = shapes = self.read_cache_shapes()
        rows, tokens, cached = EXAMPLE_ROWS, EXAMPLE_TOKENS, EXAMPLE_CACHED
        example = (
            torch.zeros(rows, tokens, dtype=torch.long, device=model.device),
            (torch.arange(tokens, device=model.device) + cached).expand(rows, -1).contiguous(),
            torch.zeros(rows, 1, tokens, cached + tokens, dtype=model.dtype, device=model.device),
            torch.arange(EXAMPLE_LOGITS, device=model.device),  # fewer than the tokens: no size shared by chance
        )
        auto = torch.export.Dim.AUTO
        dynamic = ({0: ROWS, 1: auto}, {0: ROWS, 1: auto}, {0: ROWS, 2: auto, 3: auto}, {0: auto})
        with grouped_attention(model):  # the attention generate() decodes with
            return _export(DecodingPass(model), example, dynamic, shapes, model.dtype, model.device)

    def _prepare(self, verbose: bool, alongside: list[CompiledPasses] = ()) -> None:
        started = time.perf_counter()
        path = self.package_path()
        narrow = self.narrow_package_path(path)
        if path.exists():
            try:
                self.runner = _load_package(path)
            except (RuntimeError, OSError) as error:  # a package this machine cannot load (copied from another, say)
                _delete_package(path)
                warnings.warn(
                    f"could not load the compiled package {path} ({_first_line(error)}); compiling it again",
                    stacklevel=4,
                )
        compiles = self.runner is None
        if compiles and _failed_marker(path).exists():  # nothing to gain from minutes of failing again
            marker = _failed_marker(path)
            return self._fail(f"{marker.read_text().strip()}, when this machine tried; to try again, delete {marker}")
        if narrow is not None and not narrow.exists() and _failed_marker(narrow).exists():
            warnings.warn(_narrow_failed_before(narrow), stacklevel=4)
            narrow = None  # the other package serves every pass
        if compiles or _narrow_to_compile(narrow):
            alongside = [
                p for p in alongside if p.runner is None and p.failed is None and not p.package_path().exists()
            ]
            if verbose:
                what = self.what if compiles else f"the package for passes of up to {NARROW_TOKENS} tokens"
                also = "".join(f", then {p.what}" for p in alongside)
                print(
                    f"compiling {what}{also} (AOTInductor: {self.takes} on 2 CPU cores, once a machine; "
                    f"kept in {path.parent})...",
                    file=sys.stderr,
                    flush=True,
                )
            try:
                with seconds_counted("  compiling", verbose):
                    self.helper = _compile_package(self, path, alongside)
            except COMPILE_ERRORS as error:
                if compiles:
                    reason = _reason(error)
                    _record_failure(path, reason)
                    return self._fail(reason)
                narrow = None  # the other package serves every pass
            if compiles:
                try:
                    self.runner = _load_package(path)
                except (RuntimeError, OSError) as error:  # just compiled and still unloadable: decode eagerly
                    _delete_package(path)
                    return self._fail(f"the compiled package does not load: {_first_line(error)}")
            if verbose:
                background = (
                    f"; the package for passes of up to {NARROW_TOKENS} tokens goes on compiling in the background "
                    "and serves the calls that start after it lands"
                    if self.helper is not None
                    else ""
                )
                print(f"  compiled in {time.perf_counter() - started:.0f} s{background}", file=sys.stderr, flush=True)
        self.path = path
        if narrow is not None:
            self.narrow_pending = narrow
            self.take_narrow()
        self.compile_seconds = time.perf_counter() - started

    def take_narrow(self, wait: bool = False, verbose: bool = False) -> None:
        """Load the narrow passes' package if it has landed since (or, with `wait`, once it lands, saying so on
        stderr when `verbose`); until then every pass runs through the other package. generate() calls it first
        (through warm_up), so that a package compiled in the background serves the calls after it lands, each
        call's passes through the same ones."""
        narrow = self.narrow_pending
        if narrow is None:
            return
        shown = wait and verbose and self._narrow_compiling(narrow) and not narrow.exists()
        if shown:
            print(
                f"waiting for the package for passes of up to {NARROW_TOKENS} tokens (compiling in the background)...",
                file=sys.stderr,
                flush=True,
            )
        with seconds_counted("  waiting", shown):
            while True:
                compiling = self._narrow_compiling(narrow)  # asked before looking for the file, which may land now
                if narrow.exists() or not compiling:
                    break
                if not wait:
                    return
                time.sleep(0.2)
        self.narrow_pending = None  # landed, or its compile ended without it (_load_narrow says so, once)
        self.narrow_runner = _load_narrow(narrow)
        self.narrow_path = narrow if self.narrow_runner is not None else None

    def _narrow_compiling(self, narrow: Path) -> bool:
        return (self.helper is not None and self.helper.poll() is None) or _compiling_elsewhere(narrow)

    def _fail(self, reason: str) -> None:
        """Run eagerly from now on, after one warning naming the reason."""
        self.failed = reason
        warnings.warn(f"compiling failed on {type(self.module).__name__} ({reason}); running it eagerly", stacklevel=5)


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


def _wiring_path(path: Path) -> Path:
    """Where a package compiled in two halves (split_program) keeps their wiring; the first half is the package at
    `path` itself, which lands last, and the wiring names the second half's file."""
    return path.with_suffix(".json")


def _second_half_path(path: Path, wiring: dict) -> Path:
    """The second half's package, named by the cut it was compiled for: a second half left by an earlier process
    serves only a first half cut at the same place."""
    key = hashlib.blake2b(json.dumps(wiring, sort_keys=True).encode(), digest_size=6).hexdigest()
    return path.with_name(f"{path.stem}-second-{key}.pt2")


def _write_wiring(path: Path, wiring: dict) -> None:
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
    staging.write_text(json.dumps(wiring))
    os.replace(staging, path)


def _load_package(path: Path):
    """The package at `path`, or the two halves it was compiled in, run as one (HalvesRunner)."""
    if not _wiring_path(path).exists():
        return torch._inductor.aoti_load_package(str(path))
    try:
        wiring = json.loads(_wiring_path(path).read_text())
        matches = path.stat().st_size == wiring["first_bytes"]  # not when two processes cut it differently
    except (ValueError, KeyError) as error:
        raise RuntimeError(f"the wiring of the package at {path} does not read ({error!r})") from error
    if not matches:
        raise RuntimeError(f"the first half at {path} is not the one its wiring was written for")
    return HalvesRunner(
        torch._inductor.aoti_load_package(str(path)),
        torch._inductor.aoti_load_package(str(path.with_name(wiring["second_package"]))),
        wiring,
    )


def _delete_package(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        path.with_name(json.loads(_wiring_path(path).read_text())["second_package"]).unlink(missing_ok=True)
    for part in (path, _wiring_path(path)):
        part.unlink(missing_ok=True)


def _load_narrow(path: Path):
    """The narrow passes' package, or None (after a warning: the wide package serves every pass) when it was not
    compiled or does not load."""
    if not path.exists() and _failed_marker(path).exists():
        warnings.warn(_narrow_failed_before(path), stacklevel=5)
        return None
    try:
        return torch._inductor.aoti_load_package(str(path))
    except (RuntimeError, OSError) as error:
        path.unlink(missing_ok=True)
        warnings.warn(
            f"the package for passes of up to {NARROW_TOKENS} tokens ({path}) is missing or does not load "
            f"({_first_line(error)}); those passes run through the other package, more slowly",
            stacklevel=5,
        )
        return None


def logits_positions(logits_to_keep, new: int, device) -> torch.Tensor:
    """The indices of the new tokens whose logits a pass computes, from a model's `logits_to_keep` (None or 0:
    all of them; an int k: the last k; a 1-D tensor: these)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep
    return torch.arange(new - (logits_to_keep or new), new, device=device)


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]  # some start with a blank line
    return lines[0] if lines else type(error).__name__


def _reason(error: Exception) -> str:
    """Why a compile failed, in one line (the warning's, and the failure record's)."""
    return f"{type(error).__name__}: {_first_line(error)}"


def _export(
    module, example: tuple, dynamic: tuple, shapes: list[tuple[int, int]], dtype, device, extra=(), extra_dynamic=()
):
    """torch.export of `module(*example, key_stores, value_stores, *extra)`: stores shaped like a cache of `shapes`."""
    stores = [
        torch.zeros(EXAMPLE_ROWS, kv_heads, EXAMPLE_CAPACITY, head_dim, dtype=dtype, device=device)
        for kv_heads, head_dim in shapes
    ]
    cache_dynamic = [{0: ROWS, 2: CAPACITY}] * len(shapes)
    with torch.no_grad():  # not inference mode: the program writes into its stores, which must not be inference tensors
        return torch.export.export(
            module.eval(),
            (*example, stores, [s.clone() for s in stores], *extra),
            dynamic_shapes=(*dynamic, cache_dynamic, cache_dynamic, *extra_dynamic),
            strict=False,
        )


def _compile_package(passes: CompiledPasses, path: Path, alongside: list[CompiledPasses] = ()):
    """Export the pass and compile it into the package at `path` (atomically, where it is missing). On a CPU a
    second process compiles, meanwhile, the packages of the passes `alongside` (a head's: exported first, so that
    they compile while this process exports the target's, which takes 15 s for SmolLM2-135M) and the second half of
    the target's program (split_program: its inductor work grows with the graph, so two processes compiling a half
    each take about two thirds of the time), both of which this waits for; then the narrow passes' package (where
    it is missing), which it leaves compiling in the background at the lowest priority: returns that process while
    it does (None otherwise). Elsewhere the whole program, then the heads', compile here."""
    narrow = passes.narrow_package_path(path)
    device = next(passes.module.parameters()).device
    scratch = Path(tempfile.mkdtemp(prefix="specheads-programs-"))  # the helper's, which deletes it
    path.parent.mkdir(parents=True, exist_ok=True)  # where the helper marks the narrow package as compiling
    split = device.type == "cpu" and passes.split_passes and not path.exists()
    head_jobs, narrow_job = [], None
    if device.type == "cpu":
        for other in alongside:
            try:
                head_jobs.append(_saved_job(other.export(), scratch, other.package_path()))
            except (*COMPILE_ERRORS, RuntimeError, OSError):
                continue  # left to its own `ready`, which compiles it again or says why not
        if _narrow_to_compile(narrow):
            narrow_job = _job(scratch, narrow, narrow=True)  # its program is saved once this process has compiled
    # the second half (MORE_JOBS) follows the heads' packages, once the target's program is exported and cut
    jobs = head_jobs + ([MORE_JOBS] if split else []) + ([narrow_job] if narrow_job is not None else [])
    helper = _start_helper(device, jobs, scratch)
    if helper is None:
        shutil.rmtree(scratch, ignore_errors=True)
    first = path.with_name(f"{path.stem}-first.pt2")
    halves = None
    try:
        program = passes.export()
        if split:
            halves = split_program(program, share=_first_share(len(head_jobs), _headers_to_build()))
        if halves is not None:
            second = _second_half_path(path, halves.wiring)
        if helper is not None and split:
            _write_jobs(scratch / MORE_JOBS, [] if halves is None else [_saved_job(halves.second, scratch, second)])
        if halves is not None:
            _package(halves.first, first)
        elif not path.exists():
            _package(program, path)
        if narrow_job is not None and helper is not None:
            _save(program, Path(narrow_job[0]))
        if halves is not None:
            _wait_for_packages([second], helper)
            if not second.exists():  # the helper failed it or was killed: compile it here (or raise the reason)
                _failed_marker(second).unlink(missing_ok=True)
                _package(halves.second, second)
            wiring = {**halves.wiring, "second_package": second.name, "first_bytes": first.stat().st_size}
            _write_wiring(_wiring_path(path), wiring)
            os.replace(first, path)  # the package is whole once its first half is where it belongs
    except BaseException:
        if helper is not None:
            helper.kill()  # its packages would serve a target that decodes eagerly
        first.unlink(missing_ok=True)
        raise
    if helper is None:
        for other in alongside:
            try:
                _package(other.export(), other.package_path())
            except (*COMPILE_ERRORS, RuntimeError, OSError):
                continue
        return None
    # a head's package it failed is compiled, or refused, by the head's `ready`
    _wait_for_packages([Path(job[1]) for job in head_jobs], helper)
    return helper if helper.poll() is None else None


def _first_share(heads: int, headers: bool) -> float:
    """The share of the target's layers this process compiles, so that it and the helper, which compiles the rest,
    finish at about the same time: under half, as this process then saves the whole program for the narrow
    package's compile (4-5 s), and more where the helper first builds the C++ headers or compiles more heads'
    packages than fit in the 15-20 s this process spends exporting the target's program and cutting it (2-core
    EPYC, SmolLM2-135M: a decoder layer 2-2.7 s, the EAGLE head's package 10-19 s, the headers 15 s)."""
    return min(0.8, 0.45 + 0.08 * max(heads - 1, 0) + (0.1 if headers else 0.0))


def _wait_for_packages(packages: list[Path], helper: subprocess.Popen | None) -> None:
    """Wait until each package has landed or failed to compile (_failed_marker), or the helper has ended."""
    while helper is not None and helper.poll() is None:
        if all(p.exists() or _failed_marker(p).exists() for p in packages):
            return
        time.sleep(0.1)


def _job(scratch: Path, package: Path, narrow: bool = False) -> tuple[str, str, int, bool]:
    """A helper's job: the program saved as `scratch`/<package's name>, compiled into `package` with this process's
    threads (which the kernels are generated for: the helper runs on one), as the narrow passes' package or the
    other kind."""
    return str(scratch / f"{package.stem}.pt2"), str(package), torch.get_num_threads(), narrow


def _saved_job(program, scratch: Path, package: Path, narrow: bool = False) -> tuple[str, str, int, bool]:
    job = _job(scratch, package, narrow)
    _save(program, Path(job[0]))
    return job


def _save(program, saved: Path) -> None:
    """torch.export.save, atomically: the helper takes the file as soon as it is there."""
    staging = saved.with_name(f".{saved.stem}.tmp.pt2")
    torch.export.save(program, staging)
    os.replace(staging, saved)


def _package(program, path: Path, threads: int | None = None, narrow: bool = False) -> None:
    """Compile an exported program into the package at `path`, atomically: with INDUCTOR_OPTIONS, or NARROW_OPTIONS
    for the narrow passes, its kernels generated for `threads` threads (by default this process's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.stem}.tmp{os.getpid()}.pt2")  # the package's name must end in .pt2
    options = dict(NARROW_OPTIONS if narrow else INDUCTOR_OPTIONS)
    if threads is not None:
        options["cpp.threads"] = threads
    try:
        with torch.no_grad():  # inductor freezes the weights only with gradients off
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(staging), inductor_configs=options
            )  # (it adds keys to it)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def _start_helper(device: torch.device, jobs: list = (), scratch: Path | None = None) -> subprocess.Popen | None:
    """On a CPU, start a second process for the work that can run beside this one's compile, on the other core:
    first, once a machine, it compiles a tiny package with the same options, which builds what every package shares
    and inductor keeps on disk (the precompiled C++ headers of the wrapper and of the kernels, the instruction-set
    probe): on a fresh machine about 30 s of g++ (2-core EPYC) that inductor would otherwise run after the
    lowering, one step after another. Then it compiles each job of `jobs` (_saved_job, or MORE_JOBS: the jobs the
    first process writes to that file in `scratch` once it knows them), a narrow passes' package at
    the lowest priority, and deletes `scratch`. None when there is nothing to do. It runs in a session of its own,
    so that a package it is compiling in the background is finished even when this process ends first; nothing
    depends on it: a header it did not build is built by the process that needs it, a head's package it did not
    compile is compiled by that head's `ready`, and without the narrow package every pass runs through the other."""
    build_headers = _headers_to_build()
    if device.type != "cpu" or not (build_headers or jobs):
        return None
    built = str(_headers_built_marker()) if build_headers else None
    code = f"from inference.compiled import run_helper; run_helper({built!r}, {list(jobs)!r}, {str(scratch)!r})"
    package_root = str(Path(__file__).resolve().parents[1])  # where `inference` imports from
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def run_helper(built: str | None, jobs: list, scratch: str | None = None) -> None:
    """What _start_helper's process runs: the shared headers (when `built`, the marker to create, is given), then
    each job's saved program compiled into its package; a MORE_JOBS entry stands for the jobs the first process
    writes to that file in `scratch` once it knows them. A narrow package's compile is announced by a marker file
    (_compiling_elsewhere) so that other processes wait for it instead of compiling it too."""
    markers = [_compiling_marker(Path(job[1])) for job in jobs if job != MORE_JOBS and job[3]]
    starter = os.getppid()
    try:
        for marker in markers:
            marker.write_text(f"{os.getpid()} {starter}")  # this process, and the one that started it
        if built is not None:
            compile_tiny_package(built)
        for job in jobs:
            listed = [job] if job != MORE_JOBS else _read_jobs(Path(scratch) / MORE_JOBS, starter)
            if listed is None:
                return
            for saved, package, threads, narrow in listed:
                if narrow:
                    _lowest_priority()  # it compiles while the first process decodes: only on what that leaves idle
                if not _wait_for_file(Path(saved), starter):
                    return
                try:
                    program = torch.export.load(saved)
                    Path(saved).unlink()
                    _package(program, Path(package), threads, narrow)
                except (*COMPILE_ERRORS, RuntimeError, OSError) as error:
                    # recorded, so that the first process stops waiting for it (it compiles a half again itself, a
                    # head's `ready` says why not); a file or the disk is left to the next process's narrow compile
                    if not (narrow and isinstance(error, OSError)):
                        _record_failure(Path(package), _reason(error))
                    continue  # the next job may still compile
    finally:
        for marker in markers:
            marker.unlink(missing_ok=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _wait_for_file(path: Path, starter: int) -> bool:
    """Wait until `path` exists (a program or job list the first process saves atomically); False when that process
    ended first."""
    while not path.exists():
        if not _alive(starter):
            return False
        time.sleep(0.2)
    return True


def _write_jobs(path: Path, jobs: list) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(jobs))
    os.replace(staging, path)


def _read_jobs(path: Path, starter: int) -> list | None:
    """The jobs the first process wrote to `path` (_write_jobs), once it has; None when it ended first."""
    return [tuple(job) for job in json.loads(path.read_text())] if _wait_for_file(path, starter) else None


def _lowest_priority() -> None:
    """Run this process (every thread of it, and the compilers it starts) only on CPU time nothing else wants
    (SCHED_IDLE), so that it stands aside for whatever else the machine runs. That is not enough for the process
    that started it: beside it, that process's passes still ran ~10x slower, so its generate() calls stop it
    meanwhile (background_compile_paused)."""
    if not hasattr(os, "sched_setscheduler"):  # not on Linux
        if hasattr(os, "nice"):
            os.nice(19)
        return
    for thread in os.listdir("/proc/self/task"):
        os.sched_setscheduler(int(thread), os.SCHED_IDLE, os.sched_param(0))


def _compiling_marker(package: Path) -> Path:
    return package.with_name(package.name + ".compiling")


def _failed_marker(package: Path) -> Path:
    """A file where a package would be whose compile failed, holding the reason, so that later processes do not
    spend minutes failing again. It is named like the package (keyed by the library versions, the CPU, the
    weights), so an upgrade tries again; deleting it does too."""
    return package.with_name(package.name + ".failed")


def _record_failure(package: Path, reason: str) -> None:
    with contextlib.suppress(OSError):  # unrecorded, the next process tries again
        package.parent.mkdir(parents=True, exist_ok=True)
        _failed_marker(package).write_text(reason)


def _narrow_failed_before(package: Path) -> str:
    marker = _failed_marker(package)
    return (
        f"the package for passes of up to {NARROW_TOKENS} tokens failed to compile on this machine "
        f"({marker.read_text().strip()}); those passes run through the other package, more slowly. "
        f"To try compiling it again, delete {marker}"
    )


def _narrow_to_compile(narrow: Path | None) -> bool:
    """Whether the narrow passes' package at `narrow` is to be compiled: it is missing, no process is compiling it
    and no compile of it failed before."""
    return (
        narrow is not None
        and not narrow.exists()
        and not _compiling_elsewhere(narrow)
        and not _failed_marker(narrow).exists()
    )


def _compiling_elsewhere(package: Path) -> bool:
    """Whether a live helper process (this one's or another's) is compiling the package at `package`. One that the
    process which started it left stopped (background_compile_paused, then killed) is resumed."""
    if os.name != "posix":  # no signals to ask a process whether it lives
        return False
    try:
        helper, starter = (int(pid) for pid in _compiling_marker(package).read_text().split())
    except (FileNotFoundError, ValueError):
        return False
    if not _alive(helper):
        return False
    if not _alive(starter):
        _signal_helper_group(helper, signal.SIGCONT)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _headers_to_build() -> bool:
    return torch._inductor.config.aot_inductor.precompile_headers and not _headers_built_marker().exists()


def _headers_built_marker() -> Path:
    """A file beside inductor's precompiled headers (it goes when they go) saying that a header build ran to its end
    for this torch, this CPU and these options."""
    key = repr((torch.__version__, torch.backends.cpu.get_cpu_capability(), INDUCTOR_OPTIONS)).encode()
    return Path(inductor_cache_dir()) / f"specheads-headers-{hashlib.blake2b(key, digest_size=8).hexdigest()}"


def compile_tiny_package(built: str) -> None:
    """Compile a one-layer package with the passes' options, then create the file `built` (what the
    helper process runs first on a fresh machine: _start_helper)."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with torch.inference_mode():
        program = torch.export.export(module, (torch.zeros(2, 8),), strict=False)
    with tempfile.TemporaryDirectory() as scratch, torch.no_grad():
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(Path(scratch) / "tiny.pt2"), inductor_configs=dict(INDUCTOR_OPTIONS)
        )
    Path(built).parent.mkdir(parents=True, exist_ok=True)
    Path(built).touch()


def _cache_shapes(one_token_pass) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer's cache, read from a one-token pass."""
    cache = position_cache()
    with torch.inference_mode():
        one_token_pass(cache)
    return [(layer.keys.shape[1], layer.keys.shape[-1]) for layer in cache.layers]


def package_key(module, config: str) -> str:
    """What a package is compiled for: the weights (a sample of each tensor's values, its name, shape and dtype),
    the config, the attention, the device and its instruction set, and the library versions."""
    digest = hashlib.blake2b(digest_size=12)
    device = next(module.parameters()).device
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    for part in (
        FORMAT,
        torch.__version__,
        transformers.__version__,
        str(device.type),
        hardware,
        INDUCTOR_OPTIONS,
        config,
    ):
        digest.update(repr(part).encode())
    for name, tensor in module.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[
            :: max(1, flat.numel() // 65536)
        ]  # any fine-tuning changes these too; hashing all of an 8B model would take a minute
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(sample.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def package_path(model) -> Path:
    return CompiledPasses(model).package_path()


def compile_target(model):
    """Decode `model` with compiled passes from now on (generate(), calibration); returns the model itself, whose
    own forward stays as it was (model.generate() and direct calls run eagerly). The package is compiled or loaded
    on first use, or ahead of it with `inference.warm_up`. It holds the weights as they were then: a model whose
    weights change afterwards needs compile_target on a fresh instance (its new weights get a package of their
    own)."""
    if not hasattr(model, PASSES):
        setattr(model, PASSES, CompiledPasses(model))
    return model


def compiled_settings(model) -> str | None:
    """What calibration keys its measurements by: None for eager passes, else the compiled packages' file names (a
    pass compiled otherwise costs otherwise), the narrow passes' one where it loaded."""
    if not is_compiled(model):
        return None
    passes = getattr(model, PASSES)
    if passes.path is not None:  # loaded: the packages it runs
        paths = [passes.path, passes.narrow_path]
    else:
        path = passes.package_path()
        paths = [path, passes.narrow_package_path(path)]
    return " + ".join(path.name for path in paths if path is not None)


def is_compiled(model) -> bool:
    passes = getattr(model, PASSES, None)
    return passes is not None and passes.failed is None


def decoding_pass(model):
    """What decoding steps call to run `model`: its compiled passes when compile_target registered them, else the
    model."""
    return getattr(model, PASSES, model)


@contextlib.contextmanager
def background_compile_paused(model):
    """Stop the process compiling `model`'s narrow passes' package in the background (and its compilers) while the
    block runs: beside it, this process's passes ran up to 10x slower (a first call's calibration took 66-73 s
    instead of 6 on a 2-core EPYC, even with the compile at the lowest priority: each parallel region woke a
    thread that waited for the other core). It compiles between calls, and on after this process ends."""
    passes = getattr(model, PASSES, None)
    helper = None if passes is None else passes.helper
    if helper is None or helper.poll() is not None or not hasattr(signal, "SIGSTOP"):
        yield
        return
    with passes._lock:
        passes._pausing += 1
        if passes._pausing == 1:
            _signal_helper(helper, signal.SIGSTOP)
    try:
        yield
    finally:
        with passes._lock:
            passes._pausing -= 1
            if passes._pausing == 0:
                _signal_helper(helper, signal.SIGCONT)


def _signal_helper(helper: subprocess.Popen, sent: int) -> None:
    if helper.poll() is None:
        _signal_helper_group(helper.pid, sent)


def _signal_helper_group(pid: int, sent: int) -> None:
    """Send `sent` to a helper process and the compilers it runs (its own process group)."""
    try:
        os.killpg(pid, sent)
    except (ProcessLookupError, PermissionError):  # it ended meanwhile, or is another user's
        pass


def warm_up_passes(model, heads: list[CompiledPasses] = (), *, verbose: bool = True, wait: bool = False) -> float:
    """Compile `model`'s decoding pass and the heads' passes now (or load them from disk), with a progress line on
    stderr when they compile; returns the seconds spent. When the target's packages compile, the heads' compile
    beside them. On a CPU the narrow passes' package may go on compiling in the background: it is taken up by the
    first call after it lands, or waited for with `wait` (what a benchmark wants). A model not registered by
    compile_target is left alone."""
    passes = getattr(model, PASSES, None)
    if passes is None:
        return 0.0
    started = time.perf_counter()
    if not all(p.runner is not None or p.failed is not None for p in (passes, *heads)):
        passes.ready(verbose, alongside=list(heads))
        for head in heads:
            head.ready(verbose)
    passes.take_narrow(wait=wait, verbose=verbose)
    return time.perf_counter() - started
