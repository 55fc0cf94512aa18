"""The dtypes a model can run in, and what ``auto`` means on each device.

``target.dtype`` / ``draft.dtype`` name the dtype of the weights, the activations and the KV
cache (the cache follows the model). Logits leave the model as float32 and the sampling
transform, verification and the draft's q run in float32 (fp16-exact q on the wire) whatever
the model's dtype, so exactness does not depend on it.
"""

from __future__ import annotations

import contextlib

import torch

from specdist.config import DTYPES

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}  # the config's dtypes in torch

# `auto` on the CPU: bfloat16 where the CPU multiplies it natively (AVX-512 BF16 or AMX tiles), float32
# elsewhere. `specdist bench runner` (docs/performance.md) measured CausalLMRunner.forward of the default
# model for 1, 5 and 9 tokens: on a CPU with AVX-512 BF16, bf16 won at every size; on an AVX2 CPU without it,
# torch's bf16 matmuls ran 1.2x (1 token) to 3.9x (7 tokens) slower than float32. A bf16 checkpoint loaded in
# float32 keeps its weights in bf16 there (HalfStoredLinear below: same bits, half the bytes).


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX tiles), as torch reads it."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(p is not None and p() for p in probes)


def cpu_auto_dtype() -> str:
    """What ``auto`` means on this CPU."""
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> str:
    """``name`` with ``auto`` resolved for ``device``: bfloat16 on CUDA GPUs that run it natively,
    float16 on other CUDA GPUs, :func:`cpu_auto_dtype` on the CPU. Other names come back as given."""
    if name != "auto":
        if name not in TORCH_DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
        return name
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device) if device.index is not None else contextlib.nullcontext():
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bfloat16" if native else "float16"
    if device.type == "cpu":
        return cpu_auto_dtype()
    raise ValueError(f"dtype auto is not defined for device {device}")


def half_width(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (float32) in bfloat16, else float16, where that dtype holds every element exactly (a bf16 or
    fp16 checkpoint loaded in float32 does), contiguous; None where neither does."""
    if weight.dtype != torch.float32:
        return None
    head = weight.detach()[:1]  # its first row first: a weight of other values fails here, unconverted
    for dt in (torch.bfloat16, torch.float16):
        if not torch.equal(head.to(dt).float(), head):
            continue
        half = weight.detach().to(dt).contiguous()
        if torch.equal(half.float(), weight):  # NaN never equals: such a weight stays float32
            return half
    return None


class HalfStoredLinear(torch.nn.Module):
    """A float32 ``nn.Linear`` whose weight is held in the half-width dtype that holds it exactly
    (:func:`half_width`): half the bytes to keep and to read, the same numbers. ``forward`` multiplies by the
    weight converted back to float32 (what the ``nn.Linear`` computed, bit for bit); the CPU kernels read the
    half-width weight itself (:func:`specdist.models.kernels.cpu_kernels.f32_mm` converts each element exactly as it
    loads it), which is where decoding and verification on the CPU spend their time."""

    def __init__(self, linear: torch.nn.Linear, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = torch.nn.Parameter(weight, requires_grad=False)  # [out, in] bfloat16 or float16
        self.bias = linear.bias  # float32 or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight.dtype}"


class HalfStoredEmbedding(torch.nn.Module):
    """The input embedding of a model whose output head is tied to it, held in the head's half-width weight
    (the same tensor: a tie keeps one copy): a lookup converts the rows it reads back to float32, the values
    of the float32 table."""

    def __init__(self, embedding: torch.nn.Embedding, weight: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.weight = weight  # [V, D] bfloat16 or float16, a Parameter shared with the head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., D] float32
        return torch.nn.functional.embedding(ids, self.weight).float()


def store_half_width(
    parent: torch.nn.Module, name: str, owner: torch.nn.Module | None = None, parts: tuple[str, ...] = ()
) -> bool:
    """Replace ``parent.<name>``, a float32 ``nn.Linear`` on the CPU, by a :class:`HalfStoredLinear` where a
    half-width dtype holds its weight exactly; whether it did. A fused projection
    (:class:`~specdist.models.fusion.FusedLinear`'s ``inner``) names the modules it fused, ``owner.<parts>``,
    whose weights are views of its rows: they become views of the half-width rows, so that no float32 copy
    stays alive (and transformers' own forward keeps working)."""
    linear = getattr(parent, name)
    if type(linear) is not torch.nn.Linear or not linear.weight.is_cpu:
        return False
    half = half_width(linear.weight)
    if half is None:
        return False
    setattr(parent, name, HalfStoredLinear(linear, half))
    row = 0
    for part_name in parts:
        part = getattr(owner, part_name)
        n = part.out_features
        setattr(owner, part_name, HalfStoredLinear(part, half[row : row + n]))  # [n, in] view
        row += n
    return True
