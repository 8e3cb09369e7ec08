"""The attention kernel for a few query rows over a long cache (decode_attention.cpp), on CPUs with AVX512-BF16.

ATen's flash attention reads a bfloat16 cache at 11-16 GB/s for one query token a row on a 2-core EPYC (a third of
a batch step's time at 16 rows of 500 entries); the kernel reads it at 55-66 GB/s (docs/experiments.md, row X9).
It is built once a machine into the store (C++ through torch's extension builder, about 20 s) when bfloat16 passes
are compiled on such a CPU, registered as the op `specheads::decode_attention`, and given to heads.attention, whose
grouped attention then runs through it: compiled packages hold the op (and load it to run). Where it cannot be
built, a warning says why and attention runs through ATen's kernels as before.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import get_hash_for_files
from torch.utils import cpp_extension

from heads import attention

from . import store

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]
# ATen's vector types at 512 bits; -fopenmp: at::parallel_for is OpenMP inlined from ATen's headers (single-threaded
# without it)
FLAGS += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
_LOCK = threading.Lock()
_failed: str | None = None  # why it could not be built, once it could not


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether passes of `dtype` on `device` take the kernel: bfloat16 on a CPU with AVX512-BF16, unless building
    it failed in this process."""
    return (
        device.type == "cpu" and dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported() and _failed is None
    )


def digest() -> str:
    """Part of the compiled packages' key: packages traced with the kernel hold this version of it."""
    return get_hash_for_files((str(SOURCE),)).hex()


def load(verbose: bool = True) -> bool:
    """Build (once a machine) and register the kernel, and give it to heads.attention; False, after one warning,
    where it cannot be built."""
    global _failed
    with _LOCK:
        if _failed is not None:
            return False
        if hasattr(torch.ops.specheads, "decode_attention"):  # registered by an earlier call
            attention.use_decode_kernel(torch.ops.specheads.decode_attention.default)
            return True
        name = f"specheads_decode_attention_{store.artefact_key(digest(), FLAGS, torch.__version__)}"
        directory = store.artefact_path("kernels", name)
        if verbose and not (directory / f"{name}.so").exists():
            print(f"building the attention kernel (once a machine; kept in {directory})...", file=sys.stderr)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name, [str(SOURCE)], extra_cflags=FLAGS, build_directory=str(directory), is_python_module=False
            )
        except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
            lines = str(error).strip().splitlines() or [type(error).__name__]
            _failed = next((line for line in lines if "error:" in line), lines[-1])  # the compiler's first error
            warnings.warn(
                f"the attention kernel (inference/decode_attention.cpp) could not be built in {directory} "
                f"({_failed}); attention runs through ATen's kernels",
                stacklevel=3,
            )
            return False
        torch.library.register_fake("specheads::decode_attention")(_output_like_query)
        attention.use_decode_kernel(torch.ops.specheads.decode_attention.default)
        return True


def _output_like_query(query, key, value, mask, scale):
    """The op's output for tracing: shaped as the folded query, contiguous."""
    return query.new_empty(query.shape)
