"""The launches of the Triton kernels (specdist.models.kernels.triton_attention and triton_layer), recorded on a
CPU and compiled for sm_90.

- :class:`Recorder`: while active, each ``kernel[grid](...)`` of those modules is bound by Triton's own JIT
  binder for a CUDA sm_90 target (``create_function_from_signature``, what ``JITFunction.run`` calls; it
  reads only shapes, dtypes, strides, data pointers and int values, so CPU tensors do) and recorded,
  not run: its compile key (what ``JITFunction.run`` looks its compiled kernels up by) and what
  ``triton.compile`` takes (signature, constexprs, attributes, options).
- :func:`launch_step`: one layer's launches at the shapes a runner step has (the step buffer's views
  from :func:`~specdist.models.backends.paged.unpack_step`, q / k / v as views of one fused projection).
- :func:`compile_sm90`: a recorded launch compiled for the H100 / H200 (``GPUTarget("cuda", 90, 32)``,
  no GPU needed: Triton ships its ptxas), with the registers and spills its ``ptxas -v`` reported.
- ``FAMILY_SHAPES``: the attention shapes of the supported families' checkpoints and of the tiny
  models the cuda tests run.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import specdist.models.kernels.triton_attention as kernels
import specdist.models.kernels.triton_layer as layer_kernels
from specdist.models.backends.paged import step_size, unpack_step

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
KERNEL_MODULES = (kernels, layer_kernels)  # the modules whose ``*_kernel`` functions a Recorder records


@dataclass(frozen=True)
class AttentionShape:
    name: str  # the checkpoint it is read off
    hq: int  # query heads
    hkv: int  # key / value heads
    hd: int  # head size
    window: int | None = None  # sliding window of its windowed layers
    softcap: float | None = None  # attention soft-cap


# The supported families' checkpoints (config.json's heads and head sizes), and the cuda tests' tiny models.
FAMILY_SHAPES = [
    AttentionShape("smollm2-135m (llama, built-in)", 9, 3, 64),
    AttentionShape("llama-3.2-1b / random-1b", 32, 8, 64),
    AttentionShape("qwen2.5-0.5b", 14, 2, 64, window=32768),
    AttentionShape("phi-3-mini", 32, 32, 96, window=2047),
    AttentionShape("llama-3.1-8b", 32, 8, 128),
    AttentionShape("mistral-7b", 32, 8, 128, window=4096),
    AttentionShape("qwen2.5-7b", 28, 4, 128, window=32768),
    AttentionShape("qwen3-0.6b", 16, 8, 128),
    AttentionShape("qwen3-30b-a3b (moe)", 32, 4, 128),
    AttentionShape("gemma2-2b", 8, 4, 256, window=4096, softcap=50.0),
    AttentionShape("gemma3-1b", 4, 1, 256, window=512),
    AttentionShape("tiny test models (model_zoo)", 4, 2, 8, window=4, softcap=2.0),
    AttentionShape("tiny llama (tests)", 8, 2, 16),
]


@dataclass
class Launch:
    kernel: str  # the kernel's name
    grid: tuple
    key: tuple  # JITFunction.run's cache key: (specialization of every argument, launch options)
    source: ASTSource  # what triton.compile takes
    options: dict


class Recorder:
    """Records (instead of running) every launch of the module's kernels while active (``with``)."""

    def __init__(self):
        self.launches: list[Launch] = []
        self.backend = make_backend(TARGET)
        self._saved: dict[str, JITFunction] = {}

    def __enter__(self) -> "Recorder":
        for module in KERNEL_MODULES:
            for name, fn in vars(module).items():
                if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                    self._saved[(module, name)] = fn
                    setattr(module, name, _Bound(self, fn))
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)

    def keys(self) -> dict[str, set]:
        """Each kernel's distinct compile keys."""
        out: dict[str, set] = {}
        for launch in self.launches:
            out.setdefault(launch.kernel, set()).add(launch.key)
        return out


class _Bound:
    def __init__(self, recorder: Recorder, fn: JITFunction):
        self.recorder, self.fn = recorder, fn
        self.binder = create_function_from_signature(fn.signature, fn.params, recorder.backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            # what JITFunction.run does before it looks the kernel up (and compiles it on a miss)
            kwargs = dict(kwargs, debug=bool(self.fn.debug), instrumentation_mode="")
            bound, specialization, options = self.binder(*args, **kwargs)
            key = (tuple(specialization), str(options))
            # signature, constexprs and attributes as JITFunction.run derives them for triton.compile
            opts, signature, constexprs, attrs = self.fn._pack_args(  # noqa: SLF001 - Triton's own derivation
                self.recorder.backend, kwargs, bound, specialization, options
            )
            self.recorder.launches.append(
                Launch(
                    self.fn.__name__, tuple(grid), key, ASTSource(self.fn, signature, constexprs, attrs), opts.__dict__
                )
            )

        return launch


def launch_step(
    shape: AttentionShape,
    dtype: torch.dtype,
    bsz: int,
    tokens: int,
    width: int,
    block_size: int = 16,
    windowed: bool = False,
    splits: int | None = None,
) -> None:
    """One layer's launches (rotary + cache write, attention) of a step of ``bsz`` requests of ``tokens`` tokens
    over block tables ``width`` wide, on the views a runner step passes (meant to run under a :class:`Recorder`;
    the tensors are small where their size does not reach the kernels). ``splits``: split-KV's ranges (None: the
    launcher's choice)."""
    buf = torch.zeros(step_size(bsz, tokens, width) + 64, dtype=torch.int32)  # [step + a caller's words]
    step = unpack_step(buf[: step_size(bsz, tokens, width)], bsz, tokens, width, block_size)
    hq, hkv, hd = shape.hq, shape.hkv, shape.hd
    qkv = torch.zeros(bsz * tokens, (hq + 2 * hkv) * hd, dtype=dtype)  # the fused projection's output
    q, k, v = (x.view(bsz * tokens, -1, hd) for x in qkv.split([hq * hd, hkv * hd, hkv * hd], -1))
    k_cache = torch.zeros(4, block_size, hkv, hd, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    cos = torch.zeros(64, hd, dtype=dtype)
    kernels.rope_and_write(q, k, v, cos, cos, step.positions, step.slot_mapping, k_cache, v_cache)
    kernels.paged_attention(
        q,
        k_cache,
        v_cache,
        step.table,
        step.starts,
        step.n_new,
        tokens,
        hd**-0.5,
        shape.window if windowed else None,
        shape.softcap,
        **({} if splits is None else {"splits": splits}),
    )


def compile_sm90(launch: Launch) -> tuple[object, dict[str, int]]:
    """The recorded launch compiled for sm_90 (Triton's cache: wherever TRITON_CACHE_DIR points) and what its
    ``ptxas -v`` reported (:func:`ptxas_report`): Triton runs its own ptxas with ``-v`` and prints the log when
    ``knobs.nvidia.dump_ptxas_log`` is set (and ``always_compile``: a compile the cache answered would run none)."""
    out = io.StringIO()
    knobs = triton.knobs
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
    try:
        with contextlib.redirect_stdout(out):
            kernel = triton.compile(launch.source, target=TARGET, options=launch.options)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return kernel, ptxas_report(out.getvalue())


_PTXAS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    r"|Used (\d+) registers"
)


def ptxas_report(log: str) -> dict[str, int]:
    """Registers a thread, stack frame and spill bytes from a ``ptxas -v`` log (one kernel); empty when the log
    has no such lines."""
    out: dict[str, int] = {}
    for m in _PTXAS.finditer(log):
        if m.group(4):
            out["registers"] = int(m.group(4))
        else:
            out["stack"], out["spill_stores"], out["spill_loads"] = map(int, m.group(1, 2, 3))
    return out
