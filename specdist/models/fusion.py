"""Fuse a layer's q/k/v projections, and its gate/up projections, into one matmul each.

One wide matmul instead of three (or two) narrow ones cuts per-op overhead, which
dominates small-batch decoding on CPU. The fused weight is the row-wise
concatenation of the originals; afterwards each original module's weight is made a
*view* into the fused tensor (torch's int4 layouts aside, below), so no memory is duplicated and the unmodified HF
``forward`` (used by transformers' own generate) still works on the same model.

Works on ``nn.Linear``, on :class:`~specdist.models.quant.Int8WeightOnlyLinear`
(per-output-channel scales concatenate exactly) and on :class:`~specdist.models.quant.Int4GroupLinear`
(per-row group scales concatenate along the output rows; a part keeps its own small contiguous scales), with
biases (Qwen2's q/k/v) when every part has one. On the block kernels (``blocks``, the project's own layout of groups
of 8 rows) packed rows concatenate and the parts become views, as above. torch's int4 layouts are not promised (they
differ between AVX2, AVX-512 and CUDA), so their packed tensors are never sliced or concatenated: the parts' codes,
read back through torch's kernel, are concatenated and packed again by torch, any parts of 16 | out rows; the parts
keep their own packed weights, a second copy. Projections of mixed types, or with a bias on some parts only, are left
alone; so are models whose projections come fused already (Phi-3).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdist.models.quant import Int4GroupLinear, Int8WeightOnlyLinear, pack_int4, quantize_model_int8


class FusedLinear(nn.Module):
    """A row-concatenation of several linears; ``forward`` returns the parts split."""

    def __init__(self, inner: nn.Module, split_sizes: list[int]):
        super().__init__()
        self.inner = inner
        self.split_sizes = split_sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # each [..., size_i]
        return self.inner(x).split(self.split_sizes, dim=-1)


def _plain_linear(p: nn.Module) -> bool:
    """``x @ W.T + b``: an nn.Linear (a tensor-parallel column shard is one too, holding the rank's rows)."""
    return type(p) is nn.Linear


def _fuse(parts: list[nn.Module]) -> FusedLinear | None:
    biases = [getattr(p, "bias", None) for p in parts]
    biased = biases[0] is not None
    if any((b is not None) != biased for b in biases):
        return None
    bias = torch.cat([b.detach() for b in biases], 0) if biased else None  # [sum(out)]
    if all(_plain_linear(p) for p in parts):
        weight = torch.cat([p.weight.detach() for p in parts], 0)  # [sum(out), in]
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biased, dtype=weight.dtype, device=weight.device)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if biased:
            fused.bias = nn.Parameter(bias, requires_grad=False)
        sizes, off = [], 0
        for p in parts:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(weight[off : off + n], requires_grad=False)  # view, shares storage
            if biased:
                p.bias = nn.Parameter(bias[off : off + n], requires_grad=False)
            sizes.append(n)
            off += n
        return FusedLinear(fused, sizes)
    if all(type(p) is Int8WeightOnlyLinear for p in parts):
        blocks = parts[0].block_codes is not None
        if blocks and any(p.out_features % 8 for p in parts):
            return None  # the block kernel packs rows in groups of 8: a part must own whole groups
        w = torch.cat([p.codes() for p in parts], 0)  # [sum(out), in] int8
        s = torch.cat([p.scales for p in parts], 0)  # [sum(out)]
        fused = Int8WeightOnlyLinear(w, s, bias)
        sizes, off = [], 0
        for p in parts:  # each part's codes become a view of the fused ones (no second copy)
            n = p.out_features
            p.scales = fused.scales[off : off + n]
            if blocks:
                p.block_codes = fused.block_codes[off // 8 : (off + n) // 8]
                p.block_scales = fused.block_scales[off // 8 : (off + n) // 8]
            else:
                p.weight_int8 = fused.weight_int8[off : off + n]
            if biased:
                p.bias = fused.bias[off : off + n]
            sizes.append(n)
            off += n
        return FusedLinear(fused, sizes)
    # Float16 and float32 block scales concatenate as float32 (the same values); super-block scales only with
    # super-block scales.
    if (
        all(type(p) is Int4GroupLinear for p in parts)
        and len({(p.repeat_input, p.blocks, p.in_features, p.packed.device) for p in parts}) == 1
        and len({p.scales_and_zeros.dtype == torch.uint8 for p in parts}) == 1
    ):
        blocks = parts[0].blocks is not None
        fused = copy.copy(parts[0])  # same settings; the buffers below replace the part's
        # a shallow copy shares the module's buffer dict (torch keeps it in nn.Module._buffers): unshare it
        fused._buffers = dict(fused._buffers)  # noqa: SLF001 - torch's nn.Module internals
        if blocks:  # the block kernels' layout (cpu_kernels) holds groups of 8 rows, a part (16 | out) whole ones
            fused.packed = torch.cat([p.packed for p in parts], 0)  # [sum(out) / 8, ...]
        else:  # torch's int4 layout is not promised (AVX2, AVX-512 and CUDA tile rows differently): pack the
            # concatenated codes with torch's own op, never slice or concatenate packed rows
            fused.packed = pack_int4(torch.cat([p.codes() for p in parts], 0))  # codes [sum(out), in * repeat]
        # per-row values, concatenated along the rows: [G, sum(out), 2] bf16 pairs on torch's layouts
        fused.scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], parts[0].rows_dim_of_scales)
        fused.bias = bias
        fused.out_features = sum(p.out_features for p in parts)
        if blocks:  # each part's packed rows become a view of the fused ones (no second copy); its scales stay its
            # own: the kernel needs them contiguous, and they are 1/16 of the bytes. On torch's layouts the parts keep
            # their own packed tensors and biases (the fused module holds a second copy of the weights).
            off = 0
            for p in parts:
                p.packed = fused.packed[off // 8 : (off + p.out_features) // 8]
                if biased:
                    p.bias = fused.bias[off : off + p.out_features]
                off += p.out_features
        return FusedLinear(fused, [p.out_features for p in parts])
    return None


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Add ``self_attn.fused_qkv`` and ``mlp.fused_gate_up`` to every decoder layer. Returns layers fused."""
    count = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "fused_qkv") and hasattr(attn, "q_proj"):
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


def unfused_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without fused projections (quantize the originals; fuse again afterwards)."""
    clone = copy.deepcopy(model)
    if hasattr(clone, "model") and hasattr(clone.model, "layers"):
        remove_fusion(clone)
    return clone


def quantized_copy(model: nn.Module, kind: type[nn.Module] = Int8WeightOnlyLinear) -> nn.Module:
    """Deep-copy ``model`` and quantize the copy's linears to ``kind``; the original is left untouched."""
    return quantize_model_int8(unfused_copy(model), kind=kind)
