"""The target's decoding passes through torch.compile (inductor), the Hugging Face model as it is.

    model, tokenizer = load_target(dtype="bfloat16", compile=True)   # or: compile_target(model)
    generate(model, heads, prompt, tokenizer=tokenizer)              # its verification and plain passes compiled

Why: an eager pass of SmolLM2-135M runs at a fraction of what the hardware allows. On a 2-core AMD EPYC
(AVX512-BF16, bfloat16, 200 tokens cached) a one-token pass took 38 ms eager and 17 ms compiled, a 16-token pass
62 ms and 33 ms. Nearly all of it is the weights: frozen into the graph (inductor's `freezing`), they are packed
once for the CPU's matrix kernels, and `max_autotune` picks inductor's own GEMM template where it beats oneDNN
(a one-row product, which reads the weights at about twice oneDNN's pace).

Shapes are kept from recompiling: the cache length is dynamic, so one graph serves a sequence as it grows. A
pass over one token and a pass over a tree are two graphs (torch specializes sizes of 1), and so are one row and
a batch: at most four graphs, each compiled the first time it is needed. The prefill stays eager (one pass a
prompt, every length different). Compiling is slow (60-110 s a graph on 2 cores) and inductor does not
cache graphs with packed weights across processes; its kernels and autotuning results are cached on disk
(under SPECHEADS_CACHE/inductor), which cuts a second process's compile by about a fifth. `warm_up` compiles the
graphs ahead of the first call, with a progress line. A model that does not compile decodes eagerly, after one
warning naming the reason.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch

from heads.attention import grouped_attention

from .cache import new_cache
from .target import cache_root
from .tree import chain_inputs

# Inductor settings, applied around each compiled call (inductor reads them when it compiles), never set globally.
# Weights are frozen into the graph (packed once for the matrix kernels). One row's one-token pass also autotunes
# inductor's GEMM template against oneDNN: it reads the weights about twice as fast there (bf16, AMD EPYC: 17 ms a
# pass against 24 ms frozen alone). A pass whose rows vary (a tree's tokens, a batch's rows) is left to oneDNN:
# autotuned, its GEMMs were tuned for the row count seen first and ran up to 5x slower at others (16 tokens: 90 ms
# against 33 ms; a batch of 8 decoding plainly: 0.86x HF batched against the eager loop's 1.08x).
TREE_OPTIONS = {"freezing": True}
ONE_TOKEN_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,  # quiet: no table of kernels for every matrix product
    "max_autotune_report_choices_stats": False,
}

PASSES = "_specheads_compiled_passes"  # the model's attribute holding its CompiledPasses (they live and die together)


class CompiledPasses:
    """Calls the model like `model(**kwargs)`, through torch.compile, the sizes that change from pass to pass
    marked dynamic. Falls back to the eager model, once and with a warning, if compiling fails."""

    def __init__(self, model):
        self.model = model
        with torch.inference_mode():
            # transformers installs its hidden-state hooks on the first call that asks for hidden states, which
            # torch.compile cannot trace: one eager call does it first
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), cache=new_cache(model), output_hidden_states=True)
        self.forward = torch.compile(model, dynamic=False)
        self.failed: str | None = None
        self.warm_rows: set[int] = set()  # row counts (1, or 2 for any batch) whose graphs warm_up compiled

    def __call__(self, **kwargs):
        if self.failed is not None:
            return self.model(**kwargs)
        # every pass returns the hidden states, asked for or not: a graph without them would be one more to compile
        kwargs["output_hidden_states"] = True
        prepare_inputs(kwargs)
        one_row_one_token = kwargs["input_ids"].shape == (1, 1) and self.model.device.type == "cpu"
        try:
            with torch._inductor.config.patch(ONE_TOKEN_OPTIONS if one_row_one_token else TREE_OPTIONS):
                return self.forward(**kwargs)
        except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError) as error:
            # compiling failed before the pass ran (the cache is untouched): decode eagerly from here on
            self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(f"torch.compile failed on {type(self.model).__name__} ({self.failed}); decoding with the eager model", stacklevel=2)
            return self.model(**kwargs)


def prepare_inputs(kwargs: dict) -> None:
    """Mark what changes between passes as dynamic: the cache length, the number of tokens (past one) and the
    number of rows (past one)."""
    ids, cache, mask = kwargs["input_ids"], kwargs["cache"], kwargs.get("attention_mask")
    rows, new = ids.shape
    for layer in cache.layers:
        if layer.is_initialized:
            # one memory layout for every pass, or the graph is compiled again for each: a cropped cache (its
            # rejected entries dropped) and one in a buffer (after the prefill) are views with other strides
            if not layer.keys.is_contiguous():
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
            for tensor in (layer.keys, layer.values):
                torch._dynamo.mark_dynamic(tensor, 2)
                if rows > 1:
                    torch._dynamo.mark_dynamic(tensor, 0)
    varying = [ids, kwargs.get("position_ids")]
    if mask is not None:
        torch._dynamo.mark_dynamic(mask, 3)
        varying.append(mask)
    for tensor in varying:
        if tensor is None:
            continue
        if new > 1:
            torch._dynamo.mark_dynamic(tensor, tensor.dim() - 2 if tensor is mask else 1)
        if rows > 1:
            torch._dynamo.mark_dynamic(tensor, 0)


def compile_target(model):
    """Decode `model` with compiled passes from now on (generate(), calibration); returns the model itself, whose
    own forward stays as it was (model.generate() and direct calls run eagerly). Compiling happens on first use,
    or ahead of it with `warm_up`."""
    if not hasattr(model, PASSES):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        setattr(model, PASSES, CompiledPasses(model))
    return model


def compiled_settings(model) -> str | None:
    """What calibration keys its measurements by: None for eager passes, else the compiled passes' settings (a
    pass compiled otherwise costs otherwise)."""
    return repr((TREE_OPTIONS, ONE_TOKEN_OPTIONS)) if is_compiled(model) else None


def is_compiled(model) -> bool:
    passes = getattr(model, PASSES, None)
    return passes is not None and passes.failed is None


def decoding_pass(model):
    """What decoding steps call to run `model`: its compiled passes when compile_target registered them, else the model."""
    return getattr(model, PASSES, model)


@torch.inference_mode()
def warm_up(model, *, batch: bool = False, verbose: bool = True) -> float:
    """Compile `model`'s decoding graphs now, those not compiled yet (a one-token pass and a tree pass; for one
    row, and for batches too with `batch`), printing a line for each on stderr; returns the seconds spent.
    generate() calls it first, so that no call spends minutes compiling without saying so. A model not
    registered by compile_target is left alone."""
    passes = getattr(model, PASSES, None)
    if passes is None:
        return 0.0
    started = time.perf_counter()
    with grouped_attention(model):  # the attention generate() decodes with (another one is another graph)
        for rows in (1, 2) if batch else (1,):
            if rows not in passes.warm_rows and passes.failed is None:
                _compile_passes(passes, rows, verbose)
                passes.warm_rows.add(rows)
    return time.perf_counter() - started


def _compile_passes(passes: CompiledPasses, rows: int, verbose: bool) -> None:
    """Run a one-token and a 4-token pass for `rows` rows through `passes`, which compiles them."""
    model = passes.model
    prompt = torch.randint(model.config.vocab_size, (rows, 8), generator=torch.Generator().manual_seed(0)).to(model.device)
    cache = new_cache(model)
    model(input_ids=prompt, cache=cache, use_cache=True)
    for width in (1, 4):
        if verbose:
            what = f"{width}-token pass for {rows} row{'s' if rows > 1 else ''}"
            print(f"compiling the target's {what} (torch.compile: a minute or two on 2 CPU cores, once a process)...", file=sys.stderr, flush=True)
        tick = time.perf_counter()
        passes(cache=cache, use_cache=True, **chain_inputs(prompt[0, :width], cache.get_seq_length(), rows, model.dtype))
        if verbose:
            print(f"  compiled in {time.perf_counter() - tick:.0f} s", file=sys.stderr, flush=True)
