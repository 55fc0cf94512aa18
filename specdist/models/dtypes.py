"""The dtypes a model can run in, and what ``auto`` means on each device.

``target.dtype`` / ``draft.dtype`` name the dtype of the weights, the activations and the KV
cache (the cache follows the model). Logits leave the model as float32 and the sampling
transform, verification and the draft's q run in float32 (fp16-exact q on the wire) whatever
the model's dtype, so exactness does not depend on it.
"""

from __future__ import annotations

import contextlib

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = (*TORCH_DTYPES, "auto")

# `auto` on the CPU: the dtype in which CausalLMRunner.forward of the default model runs faster
# for 1, 5 and 9 tokens, measured by `specdist bench runner` (BENCHMARKS.md, "Dtypes"). The
# development CPU has AVX-512 BF16, where bf16 wins at every size; a CPU without native bf16
# should rerun the measurement and use float32 explicitly if it loses.
CPU_AUTO_DTYPE = "bfloat16"


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> str:
    """``name`` with ``auto`` resolved for ``device``: bfloat16 on CUDA GPUs that run it natively,
    float16 on other CUDA GPUs, :data:`CPU_AUTO_DTYPE` on the CPU. Other names come back as given."""
    if name != "auto":
        if name not in TORCH_DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
        return name
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device) if device.index is not None else contextlib.nullcontext():
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bfloat16" if native else "float16"
    if device.type == "cpu":
        return CPU_AUTO_DTYPE
    raise ValueError(f"dtype auto is not defined for device {device}")
