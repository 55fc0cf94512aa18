"""Matmuls on GGUF's 4- and 8-bit blocks on x86 CPUs (AVX2), as llama.cpp computes them.

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) reads a GGUF model's Q4 blocks at a few
GB/s and has no Q8 kernel (Q8_0 runs as two int4 halves, twice the work). ``block_kernels.c``
computes ``x @ W.T`` on the blocks themselves: each row of ``x`` is quantized per block of 32 to
signed bytes (scale ``max |x| / 127``), and a block's dot product is one byte multiply-add
(``vpmaddubsw``) scaled by the two blocks' floats. Weights keep the file's float scales (fp16,
exact in fp32); nothing is rounded to bf16. A row's result does not depend on the other rows of
the batch (same instructions, same order), so verification of k tokens computes each position's
linears as a one-token decode does.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``; gcc and
clang work) into ``~/.cache/specdist/kernels`` (``$SPECDIST_KERNEL_CACHE`` overrides), one file
per source and flags hash, written atomically so that concurrent workers share it. It runs its
threads in the process's OpenMP runtime (the ``libgomp`` torch already loaded), so
``torch.set_num_threads`` governs both. :func:`available` is False on CPUs without AVX2, where
no compiler works, or with ``SPECDIST_BLOCK_KERNELS=0``; callers then use torch's int4 kernel.

Under ``torch.compile`` the two matmuls are the custom ops ``specdist::q4_mm`` /
``specdist::q8_mm`` (opaque to inductor); eager calls go straight to the library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile

import torch

log = logging.getLogger("specdist.kernels")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "block_kernels.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")
BLOCK = 32  # elements per GGUF block


def _cache_dir() -> str:
    return os.environ.get("SPECDIST_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdist", "kernels")


def _build() -> str:
    """Compile the C file unless its library is cached; returns the library's path."""
    cc = os.environ.get("CC", "cc")
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    path = os.path.join(out_dir, f"block_kernels-{digest}.so")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, SOURCE], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-400:]}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same source writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (logged once, with the reason)."""
    if os.environ.get("SPECDIST_BLOCK_KERNELS", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.info("block kernels: this CPU has no AVX2 (%s); torch's int4 kernel runs the blocks",
                 torch.backends.cpu.get_cpu_capability())
        return None
    try:
        lib = ctypes.CDLL(_build())
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("block kernels unavailable (%s); torch's int4 kernel runs the blocks", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.specdist_q4_mm, lib.specdist_q8_mm):  # (x, M, K, codes, scales, N, y)
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr]
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    return library() is not None


def _call(fn, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32).contiguous()  # [M, K]
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)  # [M, N]
    if m and fn(x.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), n, y.data_ptr()):
        raise MemoryError(f"block kernel: no memory to quantize a [{m}, {k}] input")
    return y


def q4_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` float32, W in Q4 blocks: ``codes [N, K/32, 16]`` uint8 (byte i of a
    block: element i in the low nibble, i + 16 in the high), ``scales [N, K/32, 2]`` float32 (d, m):
    ``w = d * c + m``."""
    if torch.compiler.is_compiling():
        return torch.ops.specdist.q4_mm(x, codes, scales)
    return _call(library().specdist_q4_mm, x, codes, scales)


def q8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` float32, W in Q8 blocks: ``codes [N, K]`` int8, ``scales [N, K/32]``
    float32: ``w = d * c``."""
    if torch.compiler.is_compiling():
        return torch.ops.specdist.q8_mm(x, codes, scales)
    return _call(library().specdist_q8_mm, x, codes, scales)


@torch.library.custom_op("specdist::q4_mm", mutates_args=())
def _q4_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _call(library().specdist_q4_mm, x, codes, scales)


@torch.library.custom_op("specdist::q8_mm", mutates_args=())
def _q8_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _call(library().specdist_q8_mm, x, codes, scales)


@_q4_op.register_fake
def _(x, codes, scales):
    return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)


@_q8_op.register_fake
def _(x, codes, scales):
    return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)
