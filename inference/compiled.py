"""The target's decoding passes compiled ahead of time (torch.export + AOTInductor), the Hugging Face model as it is.

    model, tokenizer = load_target(dtype="bfloat16", compile=True)   # or: compile_target(model)
    generate(model, heads, prompt, tokenizer=tokenizer)              # its verification and plain passes compiled

Why: an eager pass of SmolLM2-135M runs at a fraction of what the hardware allows. On a 2-core AMD EPYC
(AVX512-BF16, bfloat16, 200 tokens cached) a one-token pass took 40 ms eager and 17 ms compiled, a 16-token pass
53 ms and 25 ms, a one-token pass of 8 rows 48 ms and 25 ms. Nearly all of it is the weights: frozen into the
compiled code (inductor's `freezing`), they are packed once for the CPU's matrix kernels.

One pass, `DecodingPass` (token ids, positions, the additive mask and the cache as plain tensors in; logits,
hidden states and the new tokens' keys and values out), is exported with every size dynamic (rows, tokens,
cache length), so one compiled graph serves plain steps, trees and batches. Compiling takes a minute or two on
2 CPU cores; the result is a package on disk (under SPECHEADS_CACHE/compiled, keyed by the weights, the dtype, the
CPU's instruction set and the library versions), so a second process loads it in about 2 s. The prefill stays
eager (one pass a prompt). A model that does not export or compile decodes eagerly, after one warning naming
the reason.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from heads.attention import grouped_attention

from .cache import new_cache
from .target import cache_root

FORMAT = 2  # DecodingPass's inputs and outputs; bump it when they change, so that older packages are not loaded
INDUCTOR_OPTIONS = {"freezing": True}  # weights as constants: packed once for the matrix kernels
PASSES = "_specheads_compiled_passes"  # the model's attribute holding its CompiledPasses (they live and die together)
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError, torch._inductor.exc.CppCompileError)


class DecodingPass(torch.nn.Module):
    """One decoding pass of `model` with its cache as plain tensors, the form torch.export takes: key_stores[i] and
    value_stores[i] [rows, kv_heads, capacity, head_dim] for layer i, whose first entries are the cached ones (as
    many as the mask's keys less the new tokens; the rest is room the caller's buffer keeps for later). Returns the
    logits, every layer's hidden states and the new tokens' keys and values, which the caller writes into its cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, key_stores: list[torch.Tensor], value_stores: list[torch.Tensor]):
        new = input_ids.shape[1]
        cached = attention_mask.shape[-1] - new
        layers = [_filled_layer(k[:, :, :cached], v[:, :, :cached]) for k, v in zip(key_stores, value_stores, strict=True)]
        cache = Cache(layers=layers)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache, use_cache=True, output_hidden_states=True)
        new_keys = [layer.keys[:, :, -new:] for layer in cache.layers]
        new_values = [layer.values[:, :, -new:] for layer in cache.layers]
        return out.logits, tuple(out.hidden_states), new_keys, new_values


def _stores(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's entries in the layout the package takes (contiguous, the cached entries first): a PositionLayer's
    buffer rows as they are when its entries sit at their start (no copy), else a contiguous copy of the entries.
    The compiled code assumes the strides it was exported with: a view of a buffer's first entries has others."""
    entries = (layer.keys, layer.values)
    buffers = (getattr(layer, "key_buffer", None), getattr(layer, "value_buffer", None))
    if all(b is not None and e.data_ptr() == b.data_ptr() and e.stride() == b.stride() and b.is_contiguous() for e, b in zip(entries, buffers)):
        rows = layer.keys.shape[0]
        return buffers[0][:rows], buffers[1][:rows]
    return entries[0].contiguous(), entries[1].contiguous()


def _filled_layer(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    return layer


class CompiledPasses:
    """Calls the model like `model(**kwargs)` for a decoding pass (input_ids, position_ids, a 4D attention_mask
    and a filled cache), through the compiled package; compiles or loads it on first use. Falls back to the eager
    model, once and with a warning, if exporting or compiling fails."""

    def __init__(self, model):
        self.model = model
        self.runner = None
        self.path: Path | None = None  # the package, once loaded
        self.failed: str | None = None
        self.compile_seconds = 0.0  # what preparing the package took in this process (compiling, or loading it)
        self._lock = threading.Lock()  # one thread compiles; the others wait for its package

    def __call__(self, *, input_ids, cache, position_ids=None, attention_mask=None, **unused):
        full_inputs = position_ids is not None and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype == self.model.dtype
        if not (full_inputs and cache.get_seq_length() > 0 and self.ready()):
            # the package takes a decoding pass's inputs as generate() gives them (an additive 4D mask, a filled
            # cache); anything else runs eagerly
            return self.model(input_ids=input_ids, cache=cache, position_ids=position_ids, attention_mask=attention_mask, **unused)
        layers = cache.layers
        keys, values = zip(*(_stores(layer) for layer in layers))
        logits, hidden_states, new_keys, new_values = self.runner(
            input_ids.contiguous(), position_ids.contiguous(), attention_mask.contiguous(), list(keys), list(values)
        )
        for layer, k, v in zip(layers, new_keys, new_values, strict=True):
            layer.update(k, v)
        return CausalLMOutputWithPast(logits=logits, hidden_states=tuple(hidden_states))

    def ready(self, verbose: bool = True) -> bool:
        """Load or compile the package if that was not done yet; False when compiling failed (decode eagerly)."""
        if self.runner is None and self.failed is None:
            with self._lock:
                if self.runner is None and self.failed is None:
                    self._prepare(verbose)
        return self.runner is not None

    def _prepare(self, verbose: bool) -> None:
        started = time.perf_counter()
        path = package_path(self.model)
        compiling = not path.exists()
        if compiling:
            if verbose:
                print(
                    f"compiling the target's decoding pass (AOTInductor: a minute or two on 2 CPU cores, once a machine; kept in {path.parent})...",
                    file=sys.stderr,
                    flush=True,
                )
            try:
                _compile_package(self.model, path)
            except COMPILE_ERRORS as error:
                return self._fail(f"{type(error).__name__}: {_first_line(error)}")
            if verbose:
                print(f"  compiled in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        try:
            self.runner = torch._inductor.aoti_load_package(str(path))
        except RuntimeError as error:
            path.unlink(missing_ok=True)
            if compiling:  # just compiled and still unloadable: decode eagerly
                return self._fail(f"the compiled package does not load: {_first_line(error)}")
            # a package this machine cannot load (copied from another, say): compiled anew
            warnings.warn(f"could not load the compiled package {path} ({_first_line(error)}); compiling it again", stacklevel=4)
            return self._prepare(verbose)
        self.path = path
        self.compile_seconds = time.perf_counter() - started

    def _fail(self, reason: str) -> None:
        """Decode eagerly from now on, after one warning naming the reason."""
        self.failed = reason
        warnings.warn(f"compiling failed on {type(self.model).__name__} ({reason}); decoding with the eager model", stacklevel=5)


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _compile_package(model, path: Path) -> None:
    """Export one decoding pass with every size dynamic and compile it into the package at `path` (atomically)."""
    shapes = _cache_shapes(model)
    layers, (kv_heads, head_dim) = len(shapes), shapes[0]
    # sizes above 1 for every dynamic dimension (torch specializes 0 and 1), and room after the cached entries
    rows, tokens, cached, capacity = 2, 3, 5, 9
    dtype, device = model.dtype, model.device
    past = [torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
    example = (
        torch.zeros(rows, tokens, dtype=torch.long, device=device),
        (torch.arange(tokens, device=device) + cached).expand(rows, -1).contiguous(),
        torch.zeros(rows, 1, tokens, cached + tokens, dtype=dtype, device=device),
        past,
        [p.clone() for p in past],
    )
    auto = torch.export.Dim.AUTO
    cache_shapes = [{0: auto, 2: auto}] * layers
    dynamic_shapes = ({0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto, 2: auto, 3: auto}, cache_shapes, cache_shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.stem}.tmp{os.getpid()}.pt2")  # the package's name must end in .pt2
    try:
        with torch.inference_mode(), grouped_attention(model):  # the attention generate() decodes with
            program = torch.export.export(DecodingPass(model).eval(), example, dynamic_shapes=dynamic_shapes, strict=False)
        with torch.no_grad():  # inductor freezes the weights only with gradients off
            torch._inductor.aoti_compile_and_package(program, package_path=str(staging), inductor_configs=dict(INDUCTOR_OPTIONS))  # (it adds keys to it)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def _cache_shapes(model) -> list[tuple[int, int]]:
    """(kv_heads, head_dim) of each layer's cache, read from a one-token pass."""
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), cache=cache, use_cache=True)
    return [(layer.keys.shape[1], layer.keys.shape[-1]) for layer in cache.layers]


def package_key(model) -> str:
    """What a package is compiled for: the weights (a sample of each tensor's values, its name, shape and dtype),
    the config, the attention, the device and its instruction set, and the library versions."""
    digest = hashlib.blake2b(digest_size=12)
    device = model.device
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    for part in (FORMAT, torch.__version__, transformers.__version__, str(device.type), hardware, INDUCTOR_OPTIONS, model.config.to_json_string()):
        digest.update(repr(part).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 65536)]  # any fine-tuning changes these too; hashing all of an 8B model would take a minute
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(sample.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def package_path(model) -> Path:
    name = Path(getattr(model.config, "_name_or_path", "") or type(model).__name__).name or "model"
    return cache_root() / "compiled" / f"{name}-{str(model.dtype).removeprefix('torch.')}-{package_key(model)}.pt2"


def compile_target(model):
    """Decode `model` with compiled passes from now on (generate(), calibration); returns the model itself, whose
    own forward stays as it was (model.generate() and direct calls run eagerly). The package is compiled or loaded
    on first use, or ahead of it with `warm_up`. It holds the weights as they were then: a model whose weights
    change afterwards needs compile_target on a fresh instance (its new weights get a package of their own)."""
    if not hasattr(model, PASSES):
        setattr(model, PASSES, CompiledPasses(model))
    return model


def compiled_settings(model) -> str | None:
    """What calibration keys its measurements by: None for eager passes, else the compiled package's file name (a
    pass compiled otherwise costs otherwise)."""
    if not is_compiled(model):
        return None
    passes = getattr(model, PASSES)
    return (passes.path or package_path(model)).name


def is_compiled(model) -> bool:
    passes = getattr(model, PASSES, None)
    return passes is not None and passes.failed is None


def decoding_pass(model):
    """What decoding steps call to run `model`: its compiled passes when compile_target registered them, else the model."""
    return getattr(model, PASSES, model)


def warm_up(model, *, verbose: bool = True) -> float:
    """Compile `model`'s decoding pass now (or load it from disk), with a progress line on stderr when it compiles;
    returns the seconds spent. generate() calls it first, so that no call spends minutes compiling without saying
    so. A model not registered by compile_target is left alone."""
    passes = getattr(model, PASSES, None)
    if passes is None or passes.runner is not None or passes.failed is not None:
        return 0.0
    passes.ready(verbose)
    return passes.compile_seconds
