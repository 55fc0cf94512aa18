"""Fuse a layer's q/k/v projections, and its gate/up projections, into one matmul each.

One wide matmul instead of three (or two) narrow ones cuts per-op overhead, which
dominates small-batch decoding on CPU. The fused weight is the row-wise
concatenation of the originals; afterwards each original module's weight is made a
*view* into the fused tensor, so no memory is duplicated and the unmodified HF
``forward`` (used by transformers' own generate) still works on the same model.

Works on ``nn.Linear`` and on :class:`~specdist.models.quant.Int8WeightOnlyLinear`
(per-output-channel scales concatenate exactly). Layers whose projections have
biases or mixed types are left alone.
"""

from __future__ import annotations

import torch
from torch import nn

from specdist.models.quant import Int8WeightOnlyLinear


class FusedLinear(nn.Module):
    """A row-concatenation of several linears; ``forward`` returns the parts split."""

    def __init__(self, inner: nn.Module, split_sizes: list[int]):
        super().__init__()
        self.inner = inner
        self.split_sizes = split_sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # each [..., size_i]
        return self.inner(x).split(self.split_sizes, dim=-1)


def _plain_linear(p: nn.Module) -> bool:
    """An unbiased ``x @ W.T``: nn.Linear, or DeepSpeed AutoTP's column shard ``LinearLayer``
    (its forward is a plain matmul on the local rows; nothing is all-reduced)."""
    return (type(p) is nn.Linear or type(p).__name__ == "LinearLayer") and getattr(p, "bias", None) is None


def _fuse(parts: list[nn.Module]) -> FusedLinear | None:
    if all(_plain_linear(p) for p in parts):
        weight = torch.cat([p.weight.detach() for p in parts], 0)  # [sum(out), in]
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        sizes, off = [], 0
        for p in parts:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(weight[off : off + n], requires_grad=False)  # view, shares storage
            sizes.append(n)
            off += n
        return FusedLinear(fused, sizes)
    if all(type(p) is Int8WeightOnlyLinear and p.bias is None for p in parts):
        w = torch.cat([p.weight_int8 for p in parts], 0)  # [sum(out), in] int8
        s = torch.cat([p.scales for p in parts], 0)  # [sum(out)]
        fused = Int8WeightOnlyLinear(w, s)
        sizes, off = [], 0
        for p in parts:
            n = p.out_features
            p.weight_int8, p.scales = fused.weight_int8[off : off + n], fused.scales[off : off + n]
            sizes.append(n)
            off += n
        return FusedLinear(fused, sizes)
    return None


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Add ``self_attn.fused_qkv`` and ``mlp.fused_gate_up`` to every decoder layer. Returns layers fused."""
    count = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "fused_qkv"):
            fused = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.fused_qkv = fused
        if not hasattr(mlp, "fused_gate_up") and hasattr(mlp, "gate_proj"):
            fused = _fuse([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                mlp.fused_gate_up = fused
        count += int(hasattr(attn, "fused_qkv") and hasattr(mlp, "fused_gate_up"))
    return count


def remove_fusion(model: nn.Module) -> None:
    """Drop the fused modules (the originals still hold their weights, as views)."""
    for layer in model.model.layers:
        for mod, name in ((layer.self_attn, "fused_qkv"), (layer.mlp, "fused_gate_up")):
            if hasattr(mod, name):
                delattr(mod, name)
