"""Our CPU kernels for bfloat16 passes on CPUs with AVX512-BF16, built from C++ into one extension:

- decode_attention.cpp, `specheads::decode_attention`: attention of a few query rows over a long cache, which it
  reads several times faster than ATen's flash attention does (docs/experiments.md, row X9). heads.attention's
  grouped attention runs through it.
- packed_linear.cpp, `specheads::pack_linear_weight`, `specheads::quantize_int8` and `specheads::packed_linear`:
  linear layers over weights packed once (a draft's in int8), which a pass of a few tokens reads faster than
  oneDNN's products do (row X14).
  graph_passes.packed_products puts them in the compiled passes, on CPUs without AMX tiles (with them, inductor's
  GEMM template serves every pass: inference.compiled).

The extension is built once a machine into the store (C++ through torch's extension builder) when bfloat16 passes
are compiled on such a CPU; compiled packages hold the ops (and load them to run). Where it cannot be built, a warning
says why and the passes run through ATen's and oneDNN's kernels as before.
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

SOURCES = [Path(__file__).with_name(name) for name in ("decode_attention.cpp", "packed_linear.cpp")]
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]
# ATen's vector types at 512 bits; -fopenmp: at::parallel_for is OpenMP inlined from ATen's headers (single-threaded
# without it)
FLAGS += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
_LOCK = threading.Lock()
_failed: str | None = None  # why it could not be built, once it could not


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether passes of `dtype` on `device` take the kernels: bfloat16 on a CPU with AVX512-BF16, unless building
    them failed in this process."""
    return (
        device.type == "cpu" and dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported() and _failed is None
    )


def packs_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether compiled passes of `dtype` on `device` take the packed linear layers: where the kernels are wanted and
    the CPU has no AMX tiles (with them, inductor's GEMM template serves every pass: inference.compiled)."""
    return wanted(device, dtype) and not torch.cpu._is_amx_tile_supported()


def fits_packed(outputs: int, inputs: int) -> bool:
    """Whether the packed linear kernel takes a weight [outputs, inputs]: outputs in groups of 64, inputs in pairs."""
    return outputs % 64 == 0 and inputs % 2 == 0


def digest() -> str:
    """Part of the compiled packages' key: packages traced with the kernels hold this version of them."""
    return get_hash_for_files(tuple(str(source) for source in SOURCES)).hex()


def load(verbose: bool = True) -> bool:
    """Build (once a machine) and register the kernels, and give the attention kernel to heads.attention; False,
    after one warning, where they cannot be built."""
    global _failed
    with _LOCK:
        if _failed is not None:
            return False
        if hasattr(torch.ops.specheads, "packed_linear"):  # registered by an earlier call
            attention.use_decode_kernel(torch.ops.specheads.decode_attention.default)
            return True
        name = f"specheads_kernels_{store.artefact_key(digest(), FLAGS, torch.__version__)}"
        directory = store.artefact_path("kernels", name)
        if verbose and not (directory / f"{name}.so").exists():
            print(f"building our CPU kernels (once a machine; kept in {directory})...", file=sys.stderr)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name,
                [str(source) for source in SOURCES],
                extra_cflags=FLAGS,
                build_directory=str(directory),
                is_python_module=False,
            )
        except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
            lines = str(error).strip().splitlines() or [type(error).__name__]
            _failed = next((line for line in lines if "error:" in line), lines[-1])  # the compiler's first error
            warnings.warn(
                f"our CPU kernels (inference/*.cpp) could not be built in {directory} ({_failed}); passes run "
                "through ATen's and oneDNN's kernels",
                stacklevel=3,
            )
            return False
        torch.library.register_fake("specheads::decode_attention")(_output_like_query)
        torch.library.register_fake("specheads::pack_linear_weight")(_packed_weight_like)
        torch.library.register_fake("specheads::quantize_int8")(_quantized_like)
        torch.library.register_fake("specheads::packed_linear")(_linear_output_like)
        attention.use_decode_kernel(torch.ops.specheads.decode_attention.default)
        return True


def _output_like_query(query, key, value, mask, scale):
    """decode_attention's output for tracing: shaped as the folded query, contiguous."""
    return query.new_empty(query.shape)


def _packed_weight_like(weight):
    """pack_linear_weight's output for tracing: groups of 64 output columns, each [K/2, 4, 16, 2]."""
    columns, inputs = weight.shape
    return weight.new_empty(columns // 64, inputs // 2, 4, 16, 2)


def _quantized_like(weight):
    """quantize_int8's outputs for tracing: the int8 weight and each output's scale (float32)."""
    return weight.new_empty(weight.shape, dtype=torch.int8), weight.new_empty(weight.shape[0], dtype=torch.float32)


def _linear_output_like(input, packed, bias, scales=None):
    """packed_linear's output for tracing: the input's shape with the packed weight's outputs last."""
    return input.new_empty(*input.shape[:-1], packed.shape[0] * 64)
