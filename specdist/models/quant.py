"""Weight-only low-bit linears: int8 per channel ("self-w8") and int4 per group of 32 (GGUF blocks, "self-w4").

**Int8** (:class:`Int8WeightOnlyLinear`, the ``self-w8`` draft):

A draft is a copy of the target whose every ``nn.Linear`` (``lm_head`` included,
untied from the embedding) stores its weight as int8 with one bf16 scale per
output row (symmetric, absmax / 127). On x86 CPUs it runs through the Q8 block kernel
(:mod:`specdist.models.kernels.cpu_kernels`: the row's scale for each block of 32, activations rounded
per block to bytes); elsewhere activations run in bf16 through ``torch.ops.aten._weight_int8pack_mm``. Not on
CUDA: torch's CUDA kernel of that op is a naive loop (a thread per output, no tiling, float32 activations), slower
than the bf16 matmul of the target the copy would draft for, so a config that asks for it on CUDA is refused
before any model loads (:func:`refuse_int8_on`) and :func:`quantize_model_int8` refuses CUDA weights
(:data:`INT8_ON_CUDA`); ``self-w4`` runs there on torch's int4 kernel (tinygemm, 0.625 bytes a weight).

Cost: 1 byte per weight plus 2 bytes per output channel (vs 4 bytes in fp32); a
tied ``lm_head`` gets its own int8 copy, adding ``vocab * hidden`` bytes. Embeddings
and norms stay float. The result is only an approximation of the target and is
used solely as a draft: exactness comes from the target's verification step,
never from the draft.

**Int4 groups** (:class:`Int4GroupLinear`): a weight ``[out, in]`` stored as 4-bit codes
``c in 0..15`` with one bf16 ``(scale, zero)`` pair per 32 input columns of a row, computed as
``w = (c - 8) * scale + zero`` by ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (bf16
activations; fp32 activations take a much slower path). This is GGUF's Q4_0 (``zero = 0``)
and Q4_1 (``w = d * c + m``: ``scale = d``, ``zero = m + 8 d``) block layout, so a GGUF
file's own blocks run as they are stored (:mod:`specdist.models.native`); Q8_0's signed 8-bit
codes ``c8 = 16 h + l`` (``h in -8..7``, ``l in 0..15``) become two int4 halves over a doubled
input, ``[x, x] @ [16 d (h + 8 - 8); d (l - 8) + 8 d]``, exact in the codes; Q5_0 (``c8 = q - 16``) likewise, and
Q5_1 / Q5_K (``w = d q + m``, ``c8 = q``) with the low half's zero ``8 d + m``, and IQ4_NL / IQ4_XS (``c8`` the
signed byte of the IQ4 table each 4-bit index stands for, a scale per block) and the IQ grid types (``c8`` the grid
values with their signs, ``native.GRID_TYPES``). Q6_K's codes ``q = 16 h + l``
(``h in 0..3``, ``l in 0..15``) with a scale ``D`` per 16 elements, ``w = D (q - 32)``, become four int4 segments
over a quadrupled input, each holding one half (16 elements) of every block of 32 and zero weights in the other:
``16 D (h - 2)`` (codes h, scale 16 D, zero 96 D; code 2 where masked) for the first and the second halves, then
``D l`` (codes l, scale D, zero 8 D; code 0 where masked) for both, all exact in float32. Q2_K's ``w = D q + M``
(``q in 0..3``, ``D`` and ``M`` per 16) takes four segments too: ``D q`` (codes q, scale D, zero 8 D; code 0 where
masked) for each half, then ``M`` (codes 15, scale and zero ``M / 8``; code 7 where masked) for each. A float linear
quantizes to the same layout (asymmetric min/max per group, as Q4_1).

Two backends run these blocks, chosen by device when the module is built (``blocks``):

- x86 CPUs with AVX2: :mod:`specdist.models.kernels.cpu_kernels`, llama.cpp's way: GGUF's own Q4 codes with ``(d, m)``
  pairs, Q8_0 as signed bytes (one pass, not two halves), Q5_0, Q5_1 and Q5_K as 5-bit codes (a nibble and a high bit)
  with a ``(d, m)`` pair a block, Q6_K as 6-bit codes (a nibble and 2 high bits) with its two scales a block (one pass,
  not four segments; IQ1_M too), IQ2_XS and IQ2_S as 7-bit codes in bytes with their two scales a block (their segments'
  zeros ``64 D``), Q3_K as nibbles with its two scales a block, Q2_K as 2-bit codes with its two scales and offsets a
  block, IQ4_NL and IQ4_XS as their 4-bit indices into the IQ4 table of signed bytes (elsewhere as those bytes),
  repacked in groups of 8 rows (``cpu_kernels.pack_q4`` / ``pack_q5`` / ``pack_q6`` / ``pack_q7`` / ``pack_q8`` /
  ``pack_q2``), the activations rounded per block of 32 to bytes. The scales keep their file's values in the fewest
  bytes that hold them exactly: float16 (the legacy types, and the int4 copy of a float linear), the K-quants'
  super-block form (``super_scales``), or float32.
- CUDA, and CPUs without AVX2: torch's int4 kernels, scales rounded to bf16 (8 significant bits),
  bf16 activations, output rows in tiles.

Either way the numerics are close to, not equal to, the file's de-quantized floats; whatever they
are, the target's numerics define p.
Cost: half a byte per weight plus 4 bytes per group of 32 (0.625 byte per weight; Q4 blocks on the
CPU kernels: 4 bytes per group with float16 scales, 0.625; 3 with Q4_K's super-block scales, 0.59; 8 with float32
scales, 0.75).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdist.errors import ConfigError
from specdist.models.dtypes import HalfStoredLinear
from specdist.models.kernels import cpu_kernels

# The CPU kernel silently gives wrong results (or crashes) when in_features % 16 != 0.
_KERNEL_K_MULTIPLE = 16
GROUP = cpu_kernels.GROUP  # input columns per (scale, zero) pair; GGUF's block size
INT4_ROWS = 16  # the int4 kernels pack output rows in tiles: CPU needs out_features % 16 == 0 (CUDA % 8)
_CUDA_INNER_K_TILES = (8, 4, 2)  # the CUDA int4 kernel's inner k tiles (of 16 columns), largest dividing in_features
_CODES_CHUNK = 1024  # identity rows per matmul in Int4GroupLinear.codes
# the refusal of int8 weight-only linears on CUDA (the module doc says why), on the setting that asks for them
INT8_ON_CUDA = (
    "draft.method",
    "'self-w8' does not run on CUDA: torch's int8 weight-only matmul there is a naive "
    "kernel, slower than the target it would draft for; use 'self-w4' (torch's int4 kernel) or a draft "
    "model ('model')",
)


def refuse_int8_on(copy: str | None, device_type: str) -> None:
    """ConfigError (:data:`INT8_ON_CUDA`) where a draft that is the target's ``self-w8`` copy (``copy``: what
    :func:`specdist.cores.proposers.target_copy` says the method drafts with; hybrid's is ``self-w8``) would run on
    CUDA: what a config is checked by before any model loads, so the refusal does not wait for the target's
    weights and their copy."""
    if copy == "self-w8" and device_type == "cuda":
        raise ConfigError(*INT8_ON_CUDA)


class Int8WeightOnlyLinear(nn.Module):
    """``y = x @ (weight_int8 * scales[:, None]).T + bias``: on x86 CPUs through the Q8 block kernel of
    :mod:`specdist.models.kernels.cpu_kernels` (a row's scale repeated for each block of 32, activations rounded
    per block to bytes), elsewhere through torch's int8 kernel with bf16 activations."""

    weight_int8: torch.Tensor | None  # [out, in] int8, codes in -127..127 (torch's kernel; None on the blocks)
    scales: torch.Tensor  # [out] bf16
    block_codes: torch.Tensor | None  # [ceil(out/8), in/32, 256] int8: the codes packed for the CPU kernel
    block_scales: torch.Tensor | None  # [ceil(out/8), in/32, 8] float16 or float32: the row's scale per block (packed)
    bias: torch.Tensor | None  # [out] float32

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())
        blocks = weight_int8.device.type == "cpu" and self.in_features % GROUP == 0 and cpu_kernels.available()
        codes, block_scales = (
            cpu_kernels.pack_q8(weight_int8, self.scales.float()[:, None].expand(-1, self.in_features // GROUP))
            if blocks
            else (None, None)
        )
        self.register_buffer("weight_int8", None if blocks else weight_int8.contiguous())
        self.register_buffer("block_codes", codes)
        self.register_buffer("block_scales", block_scales)

    def codes(self) -> torch.Tensor:
        """The int8 codes ``[out, in]``, row by row, whichever kernel holds them."""
        if self.weight_int8 is not None:
            return self.weight_int8
        return cpu_kernels.unpack_q8(self.block_codes, self.out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        w = linear.weight.detach().to(torch.float32)  # [out, in]
        absmax = w.abs().amax(dim=1)  # [out]
        scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))  # [out]
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if self.block_codes is not None:
            y = cpu_kernels.block_mm(
                x.reshape(-1, self.in_features),
                self.block_codes,
                self.block_scales,
                self.out_features,
                cpu_kernels.LIN_Q8,
            )  # [n, out]
            return _shaped(y, lead, x.dtype, self.bias)
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [n, in]
        if self.in_features % _KERNEL_K_MULTIPLE == 0:
            # [n, out]; torch's int8 weight-only kernel exists only as a private aten op
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales)  # noqa: SLF001
        else:  # rare fallback: dequantize on the fly
            y = F.linear(x2, self.weight_int8.to(torch.bfloat16) * self.scales[:, None])  # [n, out]
        return _shaped(y, lead, x.dtype, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4GroupLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W[o, g*32 + j] = (codes[o, g*32 + j] - 8) * scale[g, o] + zero[g, o]``.

    ``repeat_input``: the input is repeated that many times along its last dim before the
    matmul (2 for GGUF Q8_0, whose codes are split into two int4 halves; 4 for Q6_K's four segments; see the
    module doc).
    """

    packed: torch.Tensor  # the codes in the kernel's layout (see ``blocks``)
    scales_and_zeros: torch.Tensor  # the kernel's float pairs (see ``blocks``)
    bias: torch.Tensor | None  # [out] float32

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
        repeat_input: int = 1,
        super_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        # codes [out, in_eff] integers in 0..15 (any integer dtype); scales, zeros [out, in_eff / 32];
        # super_scales: a K-quant's scales in its file's form (native.super_scales), which the CPU block kernels read
        # in place of the float32 ones where they give the same scales
        super().__init__()
        out, in_eff = codes.shape
        if in_eff % GROUP or in_eff % repeat_input:
            raise ValueError(f"int4 groups need in_features divisible by {GROUP}, got {in_eff}")
        if out % INT4_ROWS:
            raise ValueError(f"int4 groups need out_features divisible by {INT4_ROWS}, got {out}")
        self.out_features, self.in_features = out, in_eff // repeat_input
        self.repeat_input = repeat_input
        # blocks: "q4" / "q5" / "q6_16" / "q7_16" / "q8" / "q4_16" / "q2m_16" / "iq4" where cpu_kernels run them (x86
        # CPUs with AVX2, BLOCK_KINDS), else None (torch's int4 kernels)
        self.blocks: str | None = None
        if codes.device.type == "cpu" and cpu_kernels.available() and repeat_input in _BLOCK_PACKERS:
            self.blocks, packed, sz = _BLOCK_PACKERS[repeat_input](codes, scales.float(), zeros.float())
            if super_scales is not None:
                sz = _super_packed(self.blocks, codes, scales.float(), zeros.float(), repeat_input, *super_scales, sz)
        else:
            packed = pack_int4(codes)
        if self.blocks is None:
            sz = int4_scales_and_zeros(scales, zeros)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())

    @property
    def rows_dim_of_scales(self) -> int:
        """The dimension of ``scales_and_zeros`` that runs over output rows."""
        return 0 if self.blocks else 1

    def codes(self) -> torch.Tensor:
        """The codes ``[out, in * repeat_input]`` (uint8, 0..15) of torch's int4 layouts (``blocks`` None).

        torch does not promise its packed layout (it differs between AVX2, AVX-512 and CUDA), so the codes are read
        back through torch's own kernel rather than unpacked by hand: with every ``(scale, zero)`` pair ``(1, 8)`` the
        kernel's weight is ``(c - 8) * 1 + 8 = c``, and rows of the identity as input return the columns of ``W``,
        each output one product ``1 * c``: exact in bf16. Costs a matmul of ``in * repeat_input`` rows (run once, when
        projections are fused); keeping the codes instead would double the weights' bytes for the module's life."""
        if self.blocks is not None:
            raise ValueError(f"codes() reads torch's int4 layouts, not the block kernels' ({self.blocks})")
        k, dev = self.in_features * self.repeat_input, self.packed.device
        unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16, device=dev)  # (scale, zero): w = c
        unit = unit.expand(k // GROUP, self.out_features, 2).contiguous()  # [G, out, 2]
        mm = int4_mm(dev.type)
        cols = []  # [n, out] each: W.T's rows start..start + n
        for start in range(0, k, _CODES_CHUNK):  # in chunks, so the identity's rows never take k * k
            n = min(_CODES_CHUNK, k - start)
            eye = torch.eye(n, k, dtype=torch.bfloat16, device=dev).roll(start, 1)  # [n, k]: rows start.. of I
            cols.append(mm(eye, self.packed, GROUP, unit))
        return torch.cat(cols).T.to(torch.uint8)  # [out, k]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4GroupLinear:
        """Asymmetric min/max codes per group of 32 (GGUF Q4_1's rule: scale = (max - min) / 15, and the scale and
        the minimum float16 values, so the block kernels read them at half the bytes)."""
        w = linear.weight.detach().to(torch.float32)  # [out, in]
        out, k = w.shape
        if k % GROUP:
            raise ValueError(f"int4 groups need in_features divisible by {GROUP}, got {k}")
        g = w.reshape(out, k // GROUP, GROUP)  # [out, G, 32]
        lo, hi = g.amin(-1).half().float(), g.amax(-1)  # [out, G]
        scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi)).half().float()  # [out, G]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a tiny range rounds to 0 in float16
        codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).reshape(out, k)  # [out, in]
        return cls(codes, scale, lo + 8 * scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if self.blocks is not None:
            x2 = x.reshape(-1, self.in_features)  # [n, in]
            y = cpu_kernels.block_mm(
                x2, self.packed, self.scales_and_zeros, self.out_features, BLOCK_KINDS[self.blocks]
            )  # [n, out] float32
        else:
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [n, in]
            if self.repeat_input > 1:
                x2 = x2.repeat(1, self.repeat_input)  # [n, in * r]
            if x2.device != self.packed.device:
                raise RuntimeError(
                    f"int4 weights were packed for {self.packed.device}, not {x2.device}: build them there"
                )
            y = int4_mm(x2.device.type)(x2.contiguous(), self.packed, GROUP, self.scales_and_zeros)  # [n, out]
        return _shaped(y, lead, x.dtype, self.bias)

    def extra_repr(self) -> str:
        r = f", repeat_input={self.repeat_input}" if self.repeat_input > 1 else ""
        b = f", blocks={self.blocks}" if self.blocks else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{r}{b}"


def int4_mm(device_type: str):
    """torch's int4 weight-only matmul for a device type: ``(x [n, in] bf16, packed, group, scales_and_zeros) ->
    [n, out]``; the packed layout is :func:`pack_int4`'s for that device type. (Private aten ops: torch gives
    these kernels no public name.)"""
    if device_type == "cuda":
        return torch.ops.aten._weight_int4pack_mm  # noqa: SLF001 - tinygemm: bf16 x, [out / 8, in / (16 t), 32, t / 2]
    return torch.ops.aten._weight_int4pack_mm_for_cpu  # noqa: SLF001


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:  # [out, G] x2 -> [G, out, 2]
    """The (scale, zero) pairs of torch's int4 kernels: bf16, groups first, contiguous."""
    return torch.stack([scales, zeros], -1).to(torch.bfloat16).transpose(0, 1).contiguous()


def pack_int4(codes: torch.Tensor, device_type: str | None = None) -> torch.Tensor:
    """Codes ``[out, in]`` (integers in 0..15) packed by torch for its int4 kernel on ``device_type`` (default: the
    codes' device's). The layout is torch's, unpromised and different per instruction set and device: read it only
    through torch's kernels (:func:`int4_mm`)."""
    codes = codes.to(torch.int32)
    if (device_type or codes.device.type) == "cuda":  # the CUDA op takes two codes per byte, high nibble first
        # it needs in_features % (16 * inner k tiles) == 0: 8 tiles for 128 | K, down to 2 for any K % 32 == 0
        inner = next(t for t in _CUDA_INNER_K_TILES if codes.shape[1] % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(  # noqa: SLF001 - torch's op, no public name
            (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous(), inner
        )
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)  # noqa: SLF001 - torch's op


def _shaped(y: torch.Tensor, lead: tuple, dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """A matmul's ``[n, out]`` output back to the input's leading dims and dtype, plus the bias
    (no-op conversions skipped: a linear runs hundreds of times a forward)."""
    y = y.reshape(*lead, y.shape[-1])  # [..., out]
    if y.dtype != dtype:
        y = y.to(dtype)
    if bias is None:
        return y
    return y + (bias if bias.dtype == dtype else bias.to(dtype))


def _q4_blocks(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """GGUF's Q4 blocks (``w = d * c + m``, here ``m = zero - 8 * scale``) packed for cpu_kernels.block_mm."""
    out, k = codes.shape
    g = codes.reshape(out, k // GROUP, GROUP).to(torch.uint8)  # [out, G, 32]
    gguf = g[..., :16] | (g[..., 16:] << 4)  # [out, G, 16]: byte i holds element i low, i + 16 high
    return ("q4", *cpu_kernels.pack_q4(gguf, torch.stack([scales, zeros - 8 * scales], 1)))  # (d, m) [out, 2, G]


def _q8_blocks(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Byte codes back from two int4 halves (see the module doc): with the high half's scale 16 times the low
    half's, ``w = (ch - 8) 16 d + zh + (cl - 8) d + zl = d c + m`` for the signed byte ``c = 16 (ch - 8) + cl`` and
    the offset ``m = zh + zl - 8 d``. Q8_0 (m = 0) packs for the Q8 kernel; 5-bit codes for the Q5 one (Q5_1 and Q5_K:
    ``c`` in 0..31 with their offsets; Q5_0: ``c`` in -16..15, as ``c + 16`` with ``m = -16 d``), 0.625 code bytes a
    weight; bytes that are all values of the IQ4 table (IQ4_NL's, IQ4_XS's) as their 4-bit indices, 0.5."""
    out, k = codes.shape[0], codes.shape[1] // 2
    d = scales[:, k // GROUP :]
    if not torch.equal(scales[:, : k // GROUP], 16 * d):
        raise ValueError("repeat_input=2 holds byte codes as two int4 halves only: scales (16 d, d)")
    codes = codes.to(torch.int16)
    c8 = (16 * (codes[:, :k] - 8) + codes[:, k:]).to(torch.int8)  # [out, K] in -128..127
    m = zeros[:, : k // GROUP] + zeros[:, k // GROUP :] - 8 * d  # [out, G]
    lo = 0 if m.any() else -16  # 5-bit codes: Q5_1's and Q5_K's q, Q5_0's q - 16
    if int(c8.min()) >= lo and int(c8.max()) < lo + 32:
        c5 = (c8.to(torch.int16) - lo).to(torch.uint8).reshape(out, k // GROUP, GROUP)  # [out, G, 32] in 0..31
        return ("q5", cpu_kernels.pack_q5(c5), cpu_kernels.pack_scale_vectors(torch.stack([d, m + lo * d], -1)))
    if m.any():
        raise ValueError("repeat_input=2 with offsets holds 5-bit codes (0..31) only")
    index = torch.full((256,), -1, dtype=torch.int16)  # byte + 128 -> its index in the IQ4 table, or -1
    index[torch.tensor(cpu_kernels.IQ4_VALUES) + 128] = torch.arange(16, dtype=torch.int16)
    idx = index[c8.long() + 128]  # [out, K]
    if bool((idx >= 0).all()):  # every byte one of IQ4_NL's values (IQ4_NL, IQ4_XS): its 4-bit index, half the bytes
        g = idx.to(torch.uint8).reshape(out, k // GROUP, GROUP)  # [out, G, 32]
        return (
            "iq4",
            cpu_kernels.pack_q4(g[..., :16] | g[..., 16:] << 4, d.new_zeros(out, 2, k // GROUP))[0],
            cpu_kernels.pack_scale_vectors(d[..., None]),
        )
    return ("q8", *cpu_kernels.pack_q8(c8, d))


def _per16_blocks(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Codes with a scale ``D`` per 16 elements back from four int4 segments (see the module doc): ``q = 16 h + l -
    mid`` with ``mid`` 32 (GGUF Q6_K, Q3_K, IQ1_M: the h segments' zeros ``96 D``, masked code 2) or 64 (IQ2_XS, IQ2_S:
    zeros ``64 D``, masked code 4), ``w = D q``. Packed in the fewest bits that hold every code: nibbles ``q + 8``
    (``LIN_Q4_16``, 0.5 code bytes a weight: Q3_K's -4..3), 6-bit codes ``q + 32`` (``LIN_Q6_16``, 0.75) or 7-bit codes
    ``q + 64`` in bytes (``LIN_Q7_16``, 1)."""
    out, k = codes.shape[0], codes.shape[1] // 4
    codes = codes.to(torch.int16).reshape(out, 4, k // GROUP, 2, GROUP // 2)  # [out, segment, G, half, 16]
    s, z = scales.reshape(out, 4, k // GROUP), zeros.reshape(out, 4, k // GROUP)  # [out, segment, G]
    d = s[:, 2:]  # [out, half, G]: the l segments' scales are D
    mid = next((m for m in (32, 64) if torch.equal(z[:, :2], (128 - m) * d)), None)
    masked = None if mid is None else mid // 16  # the h segments' code where the other half's weights are
    if mid is None or not (
        torch.equal(s[:, :2], 16 * d)
        and torch.equal(z[:, 2:], 8 * d)
        and bool((codes[:, 0, :, 1] == masked).all())
        and bool((codes[:, 1, :, 0] == masked).all())
        and not codes[:, 2, :, 1].any()
        and not codes[:, 3, :, 0].any()
    ):
        raise ValueError(
            "repeat_input=4 holds GGUF Q6_K or Q2_K segments only: scales (16 D, D), zeros "
            "((128 - mid) D, 8 D), masked codes (mid / 16, 0) for mid 32 or 64"
        )
    half = torch.arange(2)
    h, low = codes[:, half, :, half], codes[:, 2 + half, :, half]  # [half, out, G, 16]: each half's own segment
    q = (16 * h + low - mid).permute(1, 2, 0, 3).reshape(out, k)  # [out, K] in -mid..127 - mid
    d16 = cpu_kernels.pack_scale_vectors(d.transpose(1, 2).reshape(out, k // GROUP, 2))  # each half's D
    lo, hi = int(q.min()), int(q.max())
    if lo >= -8 and hi <= 7:  # 4-bit codes (Q3_K's -4..3): nibbles c = q + 8
        c = (q + 8).to(torch.uint8).reshape(out, k // GROUP, GROUP)  # [out, G, 32]
        return "q4_16", cpu_kernels.pack_q4(c[..., :16] | c[..., 16:] << 4, d.new_zeros(out, 2, k // GROUP))[0], d16
    if lo >= -32 and hi <= 31:
        return "q6_16", cpu_kernels.pack_q6((q + 32).reshape(out, k // GROUP, GROUP)), d16
    if lo < -64 or hi > 63:
        raise ValueError(f"codes with a scale per 16 in -64..63 only, not {lo}..{hi}")
    return "q7_16", cpu_kernels.pack_q7((q + 64).reshape(out, k // GROUP, GROUP)), d16


def _q2_segments(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether four int4 segments are GGUF Q2_K's (native._decode_q2_k): values (codes 0..3) with zero 8 D and code 0
    where masked, then offsets with zero = scale and codes 15 / 7."""
    out, k = codes.shape[0], codes.shape[1] // 4
    c = codes.reshape(out, 4, k // GROUP, 2, GROUP // 2)  # [out, segment, G, half, 16]
    s, z = scales.reshape(out, 4, k // GROUP), zeros.reshape(out, 4, k // GROUP)
    return (
        torch.equal(z[:, :2], 8 * s[:, :2])
        and torch.equal(z[:, 2:], s[:, 2:])
        and int(c[:, :2].max()) <= 3
        and not c[:, 0, :, 1].any()
        and not c[:, 1, :, 0].any()
        and bool((c[:, 2, :, 0] == 15).all())
        and bool((c[:, 2, :, 1] == 7).all())
        and bool((c[:, 3, :, 0] == 7).all())
        and bool((c[:, 3, :, 1] == 15).all())
    )


def _q2_blocks(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """GGUF's Q2_K back from its four int4 segments: codes q (0..3) with a scale D and an offset M per 16 (``w = D q +
    M``: the value segments' scales, 8 times the offset segments'), 2-bit codes packed for cpu_kernels.block_mm's
    ``LIN_Q2M_16``."""
    out, k = codes.shape[0], codes.shape[1] // 4
    g = k // GROUP
    c = codes.to(torch.uint8).reshape(out, 4, g, 2, GROUP // 2)
    q = torch.stack([c[:, 0, :, 0], c[:, 1, :, 1]], 2).reshape(out, g, GROUP)  # [out, G, 32]: each half's own segment
    s = scales.reshape(out, 4, g)
    per_block = torch.stack([s[:, 0], s[:, 1], 8 * s[:, 2], 8 * s[:, 3]], -1)  # [out, G, 4]: D_0, D_1, M_0, M_1
    return ("q2m_16", cpu_kernels.pack_q2(q), cpu_kernels.pack_scale_vectors(per_block))


def _four_segments(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Four int4 segments (repeat_input=4): GGUF Q2_K's or Q6_K's (Q3_K's) layout."""
    if _q2_segments(codes, scales, zeros):
        return _q2_blocks(codes, scales, zeros)
    return _per16_blocks(codes, scales, zeros)


def _super_packed(
    blocks: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    repeat: int,
    factors: torch.Tensor,
    ints: torch.Tensor,
    packed: torch.Tensor,
) -> torch.Tensor:
    """The block kernels' scales for a K-quant in its file's form (cpu_kernels.pack_super_scales: a float16 factor per
    256 elements times an int8 per block or per 16, 0.09 bytes a weight of Q4_K against 0.25 as float32 pairs) where
    those products are exactly the scales (and offsets) the weight's int4 groups hold; else ``packed``, the float32
    ones. ``factors [out, in / 256, F]``, ``ints [out, in / 32, P]``: native.super_scales."""
    out, k = codes.shape[0], codes.shape[1] // repeat
    g = k // GROUP
    if k % 256 or factors.shape != (out, k // 256, factors.shape[2]) or ints.shape[:2] != (out, g):
        return packed
    f = factors.float().repeat_interleave(8, 1)  # [out, G, F]: each block's factors
    prod = f[..., :1] * ints[..., :2].float()  # [out, G, <= 2]: factor 0 times the first two ints
    if blocks == "q2m_16" and factors.shape[2] == 2 and ints.shape[2] == 4:  # Q2_K: (d sc_h, -dmin m_h) per half
        s = scales.reshape(out, 4, g)
        exact = torch.equal(prod, s[:, :2].permute(0, 2, 1)) and torch.equal(
            f[..., 1:] * ints[..., 2:].float(), 8 * s[:, 2:].permute(0, 2, 1)
        )
    elif factors.shape[2] == 1 and ints.shape[2] == 1:  # a factor times an int a block (IQ4_XS, grid types), as bytes
        if blocks in ("q8", "iq4"):
            exact = torch.equal(f[..., 0] * ints[..., 0].float(), scales[:, g:])
        elif blocks == "q5":  # bytes in -16..15 as 5-bit codes with the offset -16 d (quant._q8_blocks): (f, -16 f)
            d = scales[:, g:]
            exact = torch.equal(f[..., 0] * ints[..., 0].float(), d) and not (zeros[:, :g] + zeros[:, g:] - 8 * d).any()
            factors, ints = torch.cat([factors, -16 * factors], -1), torch.cat([ints, ints], -1)
        else:
            return packed
    elif ints.shape[2] != 2:
        return packed
    elif blocks == "q4" and factors.shape[2] == 2:  # Q4_K: (d sc, -dmin m); zeros = 8 d sc - dmin m
        exact = torch.equal(prod[..., 0], scales) and torch.equal(zeros, 8 * scales + f[..., 1] * ints[..., 1].float())
    elif blocks == "q5" and factors.shape[2] == 2:  # Q5_K as byte halves (quant's module doc): low half's d, zero
        d = scales[:, g:]
        exact = torch.equal(prod[..., 0], d) and torch.equal(zeros[:, g:], 8 * d + f[..., 1] * ints[..., 1].float())
    elif blocks in ("q6_16", "q4_16", "q7_16") and factors.shape[2] == 1:  # segments: the l segments' scales per 16
        exact = torch.equal(prod, scales.reshape(out, 4, g)[:, 2:].permute(0, 2, 1))
    else:
        return packed
    return cpu_kernels.pack_super_scales(factors, ints) if exact else packed


# repeat_input -> the packer for the CPU block kernels: (Int4GroupLinear.blocks, codes, scales)
_BLOCK_PACKERS = {1: _q4_blocks, 2: _q8_blocks, 4: _four_segments}
# Int4GroupLinear.blocks -> the kernels' matmul kind
BLOCK_KINDS = {
    "q4": cpu_kernels.LIN_Q4,
    "q8": cpu_kernels.LIN_Q8,
    "q6_16": cpu_kernels.LIN_Q6_16,
    "q5": cpu_kernels.LIN_Q5,
    "q4_16": cpu_kernels.LIN_Q4_16,
    "q2m_16": cpu_kernels.LIN_Q2M_16,
    "iq4": cpu_kernels.LIN_IQ4,
    "q7_16": cpu_kernels.LIN_Q7_16,
}


def untie_lm_head(model: nn.Module) -> None:
    """Stop transformers from re-tying lm_head to the embedding (it has no ``weight`` any more)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
        if getattr(module, "all_tied_weights_keys", None):
            module.all_tied_weights_keys = {}


def quantize_model_int8(
    model: nn.Module, skip: Callable[[str], bool] | None = None, kind: type[nn.Module] = Int8WeightOnlyLinear
) -> nn.Module:
    """Replace every ``nn.Linear`` (a runner's :class:`~specdist.models.dtypes.HalfStoredLinear` too: the same
    numbers) unless ``skip(name)`` by ``kind.from_linear`` in place; returns ``model``.
    ``kind``: :class:`Int8WeightOnlyLinear`, or :class:`Int4GroupLinear` for linears whose inputs split
    into groups of 32 and whose outputs into the kernel's tiles of 16 rows (any other stays float). Int8 on CUDA
    weights is refused (:data:`INT8_ON_CUDA`)."""
    if kind is Int8WeightOnlyLinear and any(p.device.type == "cuda" for p in model.parameters()):
        raise ConfigError(*INT8_ON_CUDA)
    replaced: dict[int, nn.Module] = {}  # keeps shared Linear modules shared
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if not isinstance(module, (nn.Linear, HalfStoredLinear)) or (skip is not None and skip(name)):
            continue
        if kind is Int4GroupLinear and (module.in_features % GROUP or module.out_features % INT4_ROWS):
            continue
        if id(module) not in replaced:
            replaced[id(module)] = kind.from_linear(module)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, replaced[id(module)])
    untie_lm_head(model)
    return model


def on_cpu_blocks(model: nn.Module) -> bool:
    """Whether any of the model's linears runs on quantized blocks through :mod:`specdist.models.kernels.cpu_kernels`
    (a native GGUF target, a self-w4 / self-w8 draft): its activations are rounded to bytes per block."""
    return any(
        getattr(m, "blocks", None) is not None or getattr(m, "block_codes", None) is not None for m in model.modules()
    )
