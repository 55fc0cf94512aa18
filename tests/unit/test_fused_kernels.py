"""The fused Triton kernels of a decoder layer on the paged CUDA path (specdist/models/kernels/triton_layer.py).

- Kernels a decode step's layer launches in the CUDA configuration (the Triton paged backend, bfloat16), counted
  on the CPU: torch ops that launch device work (views and allocations aside; ``F.rms_norm`` once, as CUDA runs
  it: one fused kernel) plus the Triton launches, recorded instead of run (tests/support/triton_launches.py).
  Llama / Qwen2 / Phi-3: 12 before (4 matmuls, 2 norms, 2 residual adds, SiLU, its product, rotary + cache write,
  attention), 9 after (the residual adds inside the norms, SiLU * up one kernel); Gemma 2: 50 -> 10.
- Where they apply: Llama-style norms in pre-norm layers, Gemma's ``1 + w`` norms in its sandwich, the Triton
  backend only (the CPU keeps its C kernels; the paged torch reference runs the same schedule in torch's ops).
- Under Triton's interpreter: each kernel against float64, and whole runners on them against transformers.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from support.kernel_checks import run_interpreted
from support.layer_kernels_check import DIMS, FAMILIES, SILU_WIDTHS, check_add_rms_norm, check_runner, check_silu_mul
from support.model_zoo import build_tiny
from support.triton_launches import Recorder
from torch.utils._python_dispatch import TorchDispatchMode

from specdist.models.backends.paged import TritonPagedBackend
from specdist.models.kv.options import KVOptions
from specdist.models.runner import CausalLMRunner

_RMS_NORM = F.rms_norm  # torch's own (the tests wrap it while they count)
_NO_WORK = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "detach")


class _TorchKernels(TorchDispatchMode):
    """Counts the aten ops that launch device work (views and allocations aside); a call of ``F.rms_norm`` counts
    once (:meth:`fused`), whatever it decomposes into on the CPU (on CUDA it is ``aten._fused_rms_norm``)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.inside_fused = False

    def fused(self, fn):
        def call(*args, **kwargs):
            if self.inside_fused:
                return fn(*args, **kwargs)
            self.ops[fn.__name__] += 1
            self.inside_fused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside_fused = False

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (self.inside_fused or func.is_view or func.__name__.split(".")[0] in _NO_WORK):
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _decode_kernels(family: str, layers: int, monkeypatch) -> tuple[collections.Counter, list[str]]:
    """(torch ops, Triton launches) of one decode step's decoder stack (a request of 5 tokens decoding its 6th)
    in the CUDA configuration: the paged cache, the Triton backend (taken as if on CUDA), bfloat16."""
    monkeypatch.setattr(TritonPagedBackend, "unavailable", classmethod(lambda cls, device, dtype: None))
    model = build_tiny(family, seed=1, num_hidden_layers=layers).to(torch.bfloat16)
    runner = CausalLMRunner(model, num_slots=2, max_len=32, kv=KVOptions("paged"), attention_backend="paged")
    assert runner.backend.name == "paged" and runner.backend.use_triton
    slot = runner.cache.allocate()
    counter = _TorchKernels()
    with Recorder() as rec:  # the kernels are recorded, not run: their outputs are uninitialised (never read here)
        runner.forward([slot], [[1, 2, 3, 4, 5]], [1])
        step = runner.backend.plan([slot], [[6]], [5], [1], 1, 1)
        before = len(rec.launches)
        with monkeypatch.context() as patch, counter:
            patch.setattr(F, "rms_norm", counter.fused(_RMS_NORM))
            runner.paged_layers(step)
        launches = [launch.kernel for launch in rec.launches[before:]]
    return counter.ops, launches


def _per_layer(family: str, monkeypatch) -> tuple[dict, dict]:
    """Kernels one decoder layer launches: (torch ops, Triton kernels) of a 3-layer stack less a 1-layer one, / 2
    (what a step launches once, the embedding and the last residual add, cancels)."""
    ops1, tri1 = _decode_kernels(family, 1, monkeypatch)
    ops3, tri3 = _decode_kernels(family, 3, monkeypatch)
    ops = {k: (ops3[k] - ops1[k]) / 2 for k in ops3 if ops3[k] != ops1[k]}
    tri = collections.Counter(tri3)
    tri.subtract(tri1)
    return ops, {k: v / 2 for k, v in tri.items() if v}


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_a_decode_layer_launches_9_kernels_on_the_cuda_path(family: str, monkeypatch) -> None:
    """Before: 12 a layer (mm x4 or addmm + mm x3, rms_norm x2, add x2, silu, mul; rotary + cache write and
    attention in Triton). After: the 4 matmuls and 5 Triton kernels: add + norm twice, SiLU * up, rotary + cache
    write, attention."""
    ops, triton_kernels = _per_layer(family, monkeypatch)
    assert triton_kernels == {
        "_add_rms_norm_kernel": 2,
        "_silu_mul_kernel": 1,
        "_rope_write_kernel": 1,
        "_paged_attention_kernel": 1,
    }, triton_kernels
    matmuls = {"qwen2": {"addmm": 1, "mm": 3}}.get(family, {"mm": 4})  # Qwen2's q/k/v bias: one addmm
    assert ops == matmuls, ops
    assert sum(ops.values()) + sum(triton_kernels.values()) == 9


def test_qwen3_s_q_k_norms_stay_torch_s(monkeypatch) -> None:
    """Qwen3: the same 9 and its per-head q/k norms (2): 14 -> 11."""
    ops, triton_kernels = _per_layer("qwen3", monkeypatch)
    assert triton_kernels == {
        "_add_rms_norm_kernel": 2,
        "_silu_mul_kernel": 1,
        "_rope_write_kernel": 1,
        "_paged_attention_kernel": 1,
    }, triton_kernels
    assert ops == {"mm": 4, "rms_norm": 2}, ops


def test_gemma_s_four_norms_and_two_adds_are_two_kernels(monkeypatch) -> None:
    """Gemma 2's sandwich of 1 + w norms (each module about 12 torch ops: float32 copies, pow, mean, rsqrt, ...):
    50 kernels a layer before, 10 after (each block's output norm, residual add and the next norm one kernel; its
    GELU MLP stays torch's: gelu, mul)."""
    ops, triton_kernels = _per_layer("gemma2", monkeypatch)
    assert triton_kernels == {"_add_rms_norm_kernel": 2, "_rope_write_kernel": 1, "_paged_attention_kernel": 1}
    assert ops == {"mm": 4, "gelu": 1, "mul": 1}, ops


@pytest.mark.parametrize(
    "family,fused",
    [
        ("llama", True),
        ("qwen2", True),
        ("phi3", True),
        ("qwen3", True),
        ("qwen3_moe", True),
        ("gemma2", True),
        ("gemma3", True),
    ],
)
def test_the_fused_kernels_run_on_the_triton_backend_for_llama_and_gemma_norms_only(
    family: str, fused: bool, monkeypatch
) -> None:
    """The Triton backend: residual add + norm fused where every norm of every layer is Llama-style in pre-norm
    layers, or Gemma's 1 + w in its sandwich; SiLU * up where gate and up are one matmul followed by SiLU (not a
    mixture-of-experts layer, not Gemma's GELU). Other backends: never the Triton kernels (the CPU's C kernels and SDPA
    unchanged);
    the paged torch reference adds a residual with the next norm as well, in torch's ops."""
    model = build_tiny(family, seed=1)
    for backend, kv in (("cpu", "slots"), ("sdpa", "slots"), ("paged-torch", "paged")):
        runner = CausalLMRunner(model, num_slots=2, max_len=32, kv=KVOptions(kv), attention_backend=backend)
        assert not runner.layer_triton and runner.silu_gate_up == [None] * len(runner.layers), backend
        assert runner.add_norms == (fused and kv == "paged"), backend
    monkeypatch.setattr(TritonPagedBackend, "unavailable", classmethod(lambda cls, device, dtype: None))
    runner = CausalLMRunner(model, num_slots=2, max_len=32, kv=KVOptions("paged"), attention_backend="paged")
    assert runner.add_norms == runner.layer_triton == fused
    assert runner.norm_offset == (1.0 if family.startswith("gemma") else 0.0)
    silu = [
        fused and not family.startswith("gemma") and not hasattr(layer.mlp, "experts")  # qwen3_moe: layer 0 dense
        for layer in runner.layers
    ]
    assert [g is not None for g in runner.silu_gate_up] == silu


def test_the_kernels_under_triton_s_interpreter_equal_float64_and_the_runners_transformers() -> None:
    """tests/support/layer_kernels_check.py under TRITON_INTERPRET=1 (about 18 s; in a process of its own: the
    interpreter is chosen before Triton is imported): add + norm (with and without the residual; Gemma's, its
    delta normed first) and SiLU * up at several widths in float32 and float16 against float64; then llama, qwen2,
    phi3, qwen3, gemma2 and gemma3 runners on the Triton backend (the paged kernels and these, under the interpreter)
    against transformers' logits over a prefill, a
    ragged verification and decodes, and their greedy tokens against its generate."""
    out = run_interpreted("layer_kernels_check.py", timeout=600)
    assert out.count(": ok") == 2 * (3 * len(DIMS) + len(SILU_WIDTHS)) + len(FAMILIES), out


NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("with_delta,gemma", [(True, False), (False, False), (True, True)])
@pytest.mark.cuda
@NO_GPU
def test_the_compiled_add_rms_norm_equals_float64(dtype, dim, with_delta, gemma):
    assert check_add_rms_norm("cuda", dtype, dim, with_delta, gemma) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", SILU_WIDTHS)
@pytest.mark.cuda
@NO_GPU
def test_the_compiled_silu_mul_equals_float64(dtype, width):
    assert check_silu_mul("cuda", dtype, width) is None


@pytest.mark.slow  # gpu_check's tests-slow step: each runner compiles the attention kernels for its shapes
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.cuda
@NO_GPU
def test_a_cuda_runner_on_the_fused_kernels_gives_transformers_logits_and_tokens(family):
    assert check_runner("cuda", family) is None
