"""Int8 weight-only quantization for the "self-w8" draft model.

A draft is a copy of the target whose every ``nn.Linear`` (``lm_head`` included,
untied from the embedding) stores its weight as int8 with one bf16 scale per
output row (symmetric, absmax / 127). Activations run in bf16 through
``torch.ops.aten._weight_int8pack_mm``.

Cost: 1 byte per weight plus 2 bytes per output channel (vs 4 bytes in fp32); a
tied ``lm_head`` gets its own int8 copy, adding ``vocab * hidden`` bytes. Embeddings
and norms stay float. The result is only an approximation of the target and is
used solely as a draft: exactness comes from the target's verification step,
never from the draft.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# The CPU kernel silently gives wrong results (or crashes) when in_features % 16 != 0.
_KERNEL_K_MULTIPLE = 16


class Int8WeightOnlyLinear(nn.Module):
    """``y = x @ (weight_int8 * scales[:, None]).T + bias`` with bf16 activations."""

    weight_int8: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bf16
    bias: torch.Tensor | None  # [out] float32

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        w = linear.weight.detach().to(torch.float32)  # [out, in]
        absmax = w.abs().amax(dim=1)  # [out]
        scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))  # [out]
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [n, in]
        if self.in_features % _KERNEL_K_MULTIPLE == 0:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales)  # [n, out]
        else:  # rare fallback: dequantize on the fly
            y = F.linear(x2, self.weight_int8.to(torch.bfloat16) * self.scales[:, None])  # [n, out]
        y = y.reshape(*lead, self.out_features).to(x.dtype)  # [..., out]
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _untie(model: nn.Module) -> None:
    """Stop transformers from re-tying lm_head to the embedding (it has no ``weight`` any more)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
        if getattr(module, "all_tied_weights_keys", None):
            module.all_tied_weights_keys = {}


def quantize_model_int8(model: nn.Module, skip: Callable[[str], bool] | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` (unless ``skip(name)``) in place; returns ``model``."""
    replaced: dict[int, Int8WeightOnlyLinear] = {}  # keeps shared Linear modules shared
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(module, nn.Linear) or (skip is not None and skip(name)):
            continue
        if id(module) not in replaced:
            replaced[id(module)] = Int8WeightOnlyLinear.from_linear(module)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, replaced[id(module)])
    _untie(model)
    return model


def quantized_copy(model: nn.Module) -> nn.Module:
    """Deep-copy ``model`` and quantize the copy; the original is left untouched."""
    from specdist.models.fusion import remove_fusion

    clone = copy.deepcopy(model)
    if hasattr(clone, "model") and hasattr(clone.model, "layers"):
        remove_fusion(clone)  # quantize the original projections once; fuse again afterwards
    return quantize_model_int8(clone)
