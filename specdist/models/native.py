"""Run a GGUF model on its own quantized blocks instead of de-quantized floats.

transformers loads a GGUF file by de-quantizing every tensor to float (the default model:
92 MB of Q4_1 / Q8_0 blocks become 540 MB of fp32 read per token). :func:`use_native_blocks`
replaces each ``nn.Linear`` whose GGUF tensor is one of ``NATIVE_TYPES`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants
Q2_K to Q6_K, and the IQ types) by an
:class:`~specdist.models.quant.Int4GroupLinear` built from the file's own blocks (the codes
bit for bit; on x86 CPUs the file's scales exactly and llama.cpp's kernels' arithmetic, elsewhere
scales in bf16 for torch's int4 kernels: see :mod:`specdist.models.quant`). A Q4_K tensor's sub-blocks of 32
are Q4_1 blocks with scale ``d * sc`` and zero ``8 d sc - dmin m``, and run as those (activations rounded per
32 as for Q4_1, where llama.cpp rounds them per 256 for Q4_K). A Q5_0 block's codes ``q - 16`` are signed bytes with
one scale, decoded as Q8_0's are (llama.cpp's Q4_K_M of a model whose width is not a multiple of 256, such as the
built-in one, holds mostly Q5_0: K-quants need whole super-blocks of 256); Q5_1 and Q5_K blocks (``w = d q + m``, q in
0..31; Q5_K's d and m per sub-block of 32 as Q4_K's) as bytes with an offset per block. The CPU kernels run all three
as 5-bit codes with a scale and an offset per block (Q5_0: ``q`` with the offset ``-16 d``), as Q4_1 runs on
nibbles. A Q6_K tensor's codes run as 6-bit codes ``q`` (``w = d sc (q - 32)``) with its two scales a block of 32,
where the CPU block kernels run;
elsewhere it stays float (as four int4 passes it would read more than bf16 does). Q3_K's codes (``q3`` in -4..3, a
6-bit scale per 16) run the same way as ``q3 + 32`` (on the CPU kernels as nibbles). Q2_K's codes (0..3, a scale and
an offset per 16) run as 2-bit codes with both per 16, on the CPU kernels only. Most Q4_K_M and Q5_K_M files hold
Q6_K value and down projections in some layers and a Q6_K output head. IQ4_NL's and IQ4_XS's 4-bit indices stand for
the signed bytes of a fixed table (``IQ4_VALUES``) with a scale per block of 32 (IQ4_XS: ``d (ls - 32)``, ``ls`` 6
bits), so they run as Q8_0 does, on those bytes; the CPU kernels keep them as 4-bit indices (``quant._q8_blocks``).
IQ3_S, IQ3_XXS, IQ2_XXS and IQ1_S (``GRID_TYPES``) index grids of small integers with signs, times a scale per block
of 32: they run as those integers in bytes (:func:`_decode_grid`). IQ2_XS, IQ2_S and IQ1_M (``GRID16_TYPES``) have a
scale per 16: their integers run as Q6_K's codes do, 7-bit (IQ2_XS, IQ2_S) or 6-bit (IQ1_M), on the CPU block kernels
only (:func:`_decode_grid16`). Other tensors (norms, embeddings, F16/F32, and linears whose output rows the int4 kernel
cannot tile, ``out_features % 16 != 0``) keep the float weights transformers loaded.

Which GGUF tensor is which module, and how transformers reorders its rows (Llama's q/k
permutation for llama.cpp's RoPE layout), is taken from transformers' own GGUF mapping: the
row order comes from running its tensor processor on a column of row indices. Each block
tensor is then checked against the float weight transformers loaded: the file's blocks,
de-quantized here in float32, must equal it to float32 rounding (Q4_1's ``m + 8 d`` rounds once
more than gguf's ``d * c + m``, as do Q4_K's, Q5_1's and Q5_K's), or the load fails naming the tensor. A row permutation
leaves blocks whole: a block spans 32 columns of one row.

A tied output head (``lm_head`` sharing the embedding's weight) gets its own native copy of
the embedding's blocks; the embedding keeps its float table for the token lookup.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specdist.errors import ConfigError
from specdist.models.fusion import quantized_copy, unfused_copy
from specdist.models.kernels import cpu_kernels
from specdist.models.quant import GROUP, INT4_ROWS, Int4GroupLinear, untie_lm_head

log = logging.getLogger("specdist.load")

# GGUF block types run natively
NATIVE_TYPES = (
    "Q4_0",
    "Q4_1",
    "Q8_0",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
    "IQ3_S",
    "IQ3_XXS",
    "IQ2_XXS",
    "IQ1_S",
    "IQ2_XS",
    "IQ2_S",
    "IQ1_M",
)
# native only where the CPU block kernels run them (a scale per 16: as torch's int4 groups they would take four passes)
CPU_BLOCKS_ONLY = ("Q2_K", "Q3_K", "Q6_K", "IQ2_XS", "IQ2_S", "IQ1_M")
Q2_K_BYTES = 84  # a Q2_K super-block: 16 bytes of 4-bit scales and mins, 64 of 2-bit codes, d, dmin (fp16)
Q4_K_BYTES = 144  # a Q4_K super-block: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of codes for 256
Q3_K_BYTES = 110  # a Q3_K super-block: 32 bytes of mask bits, 64 of 2-bit codes, 12 of 6-bit scales, d (fp16)
Q5_K_BYTES = 176  # a Q5_K super-block: Q4_K's 16 bytes of scales, 32 of high bits, 128 of low 4 bits for 256
Q6_K_BYTES = 210  # a Q6_K super-block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d (fp16)
IQ4_NL_BYTES = 18  # an IQ4_NL block of 32: d (fp16), 16 bytes of 4-bit indices into IQ4_VALUES
IQ4_XS_BYTES = 136  # an IQ4_XS super-block: d (fp16), 2 + 4 bytes of 6-bit block scales, 128 of 4-bit indices for 256
IQ4_VALUES = np.array(cpu_kernels.IQ4_VALUES, np.int8)  # the signed byte an IQ4 index stands for
# GGUF's grid types whose weights are a scale per block of 32 times small integers (grid values with their signs): the
# bytes of a super-block of 256 (each starting with its fp16 d), and the integers' denominator (IQ1_S: grid values
# -1, 0, 1 plus a delta of +-1/8)
GRID_TYPES = {"IQ3_S": (110, 1), "IQ3_XXS": (98, 1), "IQ2_XXS": (66, 1), "IQ1_S": (50, 8)}
# a grid type's block scale is d / GRID_FACTOR times an integer (IQ2_XXS: d (2 ls + 1) / 8; IQ3_XXS: d (2 ls + 1) / 4;
# IQ3_S: d (1 + 2 sc); IQ1_S: d (2 k + 1) / 8)
GRID_FACTOR = {"IQ3_S": 1, "IQ3_XXS": 4, "IQ2_XXS": 8, "IQ1_S": 8}
# the grid types with a scale per 16: super-block bytes, and the zero point of their codes (mid: the integers in
# -mid..127 - mid; IQ2_XS, IQ2_S: grid values 8, 25, 43 with signs; IQ1_M: 8 times -1, 0, 1 plus +-1/8). A scale is
# d / 8 times 2 s + 1 (IQ2_XS, IQ2_S: d (0.5 + s) / 4, s 4 bits; IQ1_M: d (2 s + 1) with the values times 8, s 3 bits).
GRID16_TYPES = {"IQ2_XS": (74, 64), "IQ2_S": (82, 64), "IQ1_M": (56, 32)}


def decode_blocks(raw: np.ndarray, kind: str, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One GGUF tensor's blocks as int4 groups: ``(codes [rows, r * cols], scales, zeros [rows, r * cols / 32], r)``.

    ``raw`` is the tensor's bytes, ``[rows, bytes per row]`` uint8 (gguf's ``ReaderTensor.data``).
    Dequantized weight ``w[o, j] = (codes[o, j] - 8) * scales[o, j // 32] + zeros[o, j // 32]``, with
    the input repeated ``r`` times (Q8_0: r = 2, its codes split into a high and a low int4 half; Q6_K: r = 4,
    see :mod:`specdist.models.quant`).
    """
    rows = raw.shape[0]
    if kind == "Q4_K":
        return _decode_q4_k(raw, rows, cols)
    if kind == "Q2_K":
        return _decode_q2_k(raw, rows, cols)
    if kind == "Q6_K":
        return _decode_q6_k(raw, rows, cols)
    if kind == "Q5_K":
        return _decode_q5_k(raw, rows, cols)
    if kind == "Q3_K":
        return _decode_q3_k(raw, rows, cols)
    if kind in ("IQ4_NL", "IQ4_XS"):
        return _decode_iq4(raw, kind, rows, cols)
    if kind in GRID_TYPES:
        return _decode_grid(raw, kind, rows, cols)
    if kind in GRID16_TYPES:
        return _decode_grid16(raw, kind, rows, cols)
    nb = cols // GROUP
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24}[kind]  # bytes per block of 32
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, size)  # [rows, nb, size]
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))  # [rows, nb]
    if kind == "Q8_0":
        return _q8_halves(torch.from_numpy(blocks[..., 2:].copy().view(np.int8)), d)
    if kind in ("Q5_0", "Q5_1"):  # q's high bits in a uint32 of the block (after Q5_1's m), its low 4 as Q4_0's
        qh = blocks[..., -20:-16].copy().view(np.uint32)  # [rows, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, nb, 32]
        qs = blocks[..., -16:]  # [rows, nb, 16]
        q = torch.from_numpy(np.concatenate([qs & 15, qs >> 4], -1) | high << 4)  # [rows, nb, 32] in 0..31
        if kind == "Q5_0":  # w = d * (q - 16)
            return _q8_halves(q.to(torch.int8) - 16, d)
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return _q8_halves(q, d, m)  # w = d * q + m
    qs = torch.from_numpy(blocks[..., -16:].copy())  # [rows, nb, 16]: element j low nibble, j + 16 high
    codes = torch.cat([qs & 15, qs >> 4], -1).to(torch.int32).reshape(rows, cols)  # [rows, cols]
    if kind == "Q4_0":  # w = d * (c - 8)
        return codes, d, torch.zeros_like(d), 1
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))  # [rows, nb]
    return codes, d, m + 8 * d, 1  # Q4_1: w = d * c + m = d * (c - 8) + (m + 8 d)


def _iq4_parts(raw: np.ndarray, kind: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ4_NL's or IQ4_XS's indices ``[rows, cols / 32, 32]`` (0..15, element order), the fp16 ``d`` of each block
    (IQ4_NL) or super-block (IQ4_XS) as float32 ``[rows, nb]``, and each block's integer multiplier ``ls - 32``
    (``[rows, cols / 32]`` int8; ones for IQ4_NL): ``w = d (ls - 32) IQ4_VALUES[i]``. A block's 16 index bytes hold
    element ``e`` in the low nibble of byte ``e`` and element ``16 + e`` in the high one (Q4_0's layout). IQ4_XS's
    block ``b`` of a super-block has the low 4 bits of ``ls`` in byte ``b // 2`` of ``scales_l`` (the high nibble for
    odd ``b``) and its high 2 bits at bit ``2 b`` of the uint16 ``scales_h``."""
    if kind == "IQ4_NL":
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, IQ4_NL_BYTES)  # [rows, G, 18]
        qs, ints = blocks[..., 2:], np.ones((rows, cols // GROUP), np.int8)
    else:
        blocks = np.ascontiguousarray(raw).reshape(rows, cols // 256, IQ4_XS_BYTES)  # [rows, nb, 136]
        qs = blocks[..., 8:].reshape(rows, -1, 16)  # [rows, G, 16]
        high = (blocks[..., 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)) & 3  # [rows, nb, 8]
        low = (blocks[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 15  # [rows, nb, 4, 2]: block 2 i + odd
        ints = ((low.reshape(rows, -1, 8) | (high.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8)
        ints = ints.reshape(rows, -1)  # [rows, G] in -32..31
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    return np.concatenate([qs & 15, qs >> 4], -1), d, ints


def _decode_iq4(
    raw: np.ndarray, kind: str, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """IQ4_NL and IQ4_XS as byte codes (:func:`_q8_halves`): each index's table byte ``IQ4_VALUES[i]`` (-127..113) with
    the block's scale ``d (ls - 32)`` (IQ4_NL: ``d``; exact in float32). On the CPU kernels the bytes pack back to
    their 4-bit indices (``quant._q8_blocks``)."""
    idx, d, ints = _iq4_parts(raw, kind, rows, cols)
    scale = np.repeat(d, cols // GROUP // d.shape[1], 1) * ints.astype(np.float32)  # [rows, G]
    return _q8_halves(torch.from_numpy(IQ4_VALUES[idx]), torch.from_numpy(scale))


def _grid_multipliers(blocks: np.ndarray, kind: str) -> np.ndarray:
    """A grid type's block multipliers ``[rows, nb, 8]`` float32, one per block of 32 of each super-block
    (``blocks [rows, nb, bytes]``): a block's scale is the super-block's ``d`` times it (gguf-py's ``db`` / ``dl``).
    IQ2_XXS: ``(0.5 + ls) / 4`` with ``ls`` the top 4 bits of the block's second uint32 (of 16 after ``d``); IQ3_XXS:
    ``(0.5 + ls) / 2``, ``ls`` the top 4 bits of its uint32 after the 64 grid bytes; IQ3_S: ``1 + 2 sc``, ``sc`` its
    nibble
    of the last 4 bytes (low first); IQ1_S: ``2 ((qh >> 12) & 7) + 1`` of its uint16 ``qh`` after the 32 grid bytes."""
    rows, nb, size = blocks.shape
    if kind == "IQ2_XXS":
        return (0.5 + (blocks[..., 2:].copy().view(np.uint32).reshape(rows, nb, 8, 2)[..., 1] >> 28)) * 0.25
    if kind == "IQ3_XXS":
        return (0.5 + (blocks[..., 66:98].copy().view(np.uint32) >> 28)) * 0.5
    if kind == "IQ3_S":
        return 1.0 + 2 * ((blocks[..., 106:110, None] >> np.array([0, 4], np.uint8)) & 15).reshape(rows, nb, 8)
    return 2.0 * ((blocks[..., 34:50].copy().view(np.uint16) >> 12) & 7) + 1  # IQ1_S


def _decode_grid(
    raw: np.ndarray, kind: str, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """IQ3_S, IQ3_XXS, IQ2_XXS and IQ1_S as byte codes (:func:`_q8_halves`) with a scale per block of 32: the grid
    values with their signs (IQ1_S: times 8, its values being ``-1, 0, 1`` plus ``+-1/8``) and ``d`` times the block's
    multiplier (over 8 for IQ1_S; exact in float32). The codes are read from gguf-py's own de-quantization of the
    blocks with ``d`` set to 1 (grid values times the multiplier: exact), divided by the multipliers (exact: the
    quotients are small integers)."""
    import gguf

    size, denominator = GRID_TYPES[kind]
    nb = cols // 256
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    unit_blocks = blocks.copy()
    unit_blocks[..., 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    unit = gguf.quants.dequantize(unit_blocks.reshape(rows, -1), gguf.GGMLQuantizationType[kind])  # [rows, cols]
    mult = _grid_multipliers(blocks, kind).astype(np.float32)  # [rows, nb, 8]
    values = unit.reshape(rows, nb, 8, 32) / mult[..., None] * denominator  # [rows, nb, 8, 32]: small integers
    codes = np.rint(values)
    if not np.array_equal(codes, values) or np.abs(codes).max(initial=0) > 127:
        raise ValueError(f"{kind}: blocks whose values are not a scale times small integers")
    scale = (d[..., None] * mult / denominator).reshape(rows, -1)  # [rows, G]
    return _q8_halves(torch.from_numpy(codes.astype(np.int8).reshape(rows, -1, 32)), torch.from_numpy(scale))


def _grid16_parts(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A per-16 grid type's super-block ``d`` (fp16 as float32, ``[rows, nb]``) and its 16 multipliers ``2 s + 1``
    (``[rows, nb, 16]``, in element order): a group of 16's scale is ``d (2 s + 1) / 8``. IQ2_XS: ``d`` first, the 4-bit
    ``s`` in the 8 bytes after the 64 of codes (low nibble first); IQ2_S: the same 8 bytes at the end; IQ1_M: its four
    uint16 after the 48 bytes of codes hold ``s`` 3 bits at a time from bit 0 (four each) and ``d``'s 16 bits in their
    top nibbles (the first one's lowest)."""
    rows, nb, size = blocks.shape
    if kind == "IQ1_M":
        sc = blocks[..., 48:56].copy().view(np.uint16)  # [rows, nb, 4]
        d = ((sc >> 12) << np.array([0, 4, 8, 12], np.uint16)).sum(-1, dtype=np.uint16)  # distinct bits: a sum is an or
        s = (sc[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7  # [rows, nb, 4, 4]
        return d.view(np.float16).astype(np.float32), 2 * s.reshape(rows, nb, 16).astype(np.int16) + 1
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    s = (blocks[..., size - 8 :, None] >> np.array([0, 4], np.uint8)) & 15  # [rows, nb, 8, 2]
    return d, 2 * s.reshape(rows, nb, 16).astype(np.int16) + 1


def _decode_grid16(
    raw: np.ndarray, kind: str, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """IQ2_XS, IQ2_S and IQ1_M as integer codes with a scale per 16 (:func:`_per16_segments` with their ``mid``): the
    grid values with their signs (IQ1_M: times 8) and ``d (2 s + 1) / 8`` (exact in float32). The integers are read from
    gguf-py's own de-quantization with ``d`` set to 1, divided by the multipliers (exact: small integers)."""
    import gguf

    size, mid = GRID16_TYPES[kind]
    nb = cols // 256
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, size)
    d, mult = _grid16_parts(blocks, kind)  # [rows, nb], [rows, nb, 16]
    unit_blocks = blocks.copy()
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint16)[0]
    if kind == "IQ1_M":  # d's nibbles in the top 4 bits of the four scale words
        words = unit_blocks[..., 48:56].view(np.uint16)
        words[...] = (words & 0x0FFF) | (((one >> np.array([0, 4, 8, 12], np.uint16)) & 15) << 12)
    else:
        unit_blocks[..., 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    unit = gguf.quants.dequantize(unit_blocks.reshape(rows, -1), gguf.GGMLQuantizationType[kind])  # [rows, cols]
    values = unit.reshape(rows, nb, 16, 16) / mult[..., None] * 8  # [rows, nb, 16, 16]: integers
    codes = np.rint(values)
    if not np.array_equal(codes, values) or codes.min(initial=0) < -mid or codes.max(initial=0) > 127 - mid:
        raise ValueError(f"{kind}: blocks whose values are not a scale per 16 times small integers")
    scale = d[..., None] * mult.astype(np.float32) / 8  # [rows, nb, 16]
    return _per16_segments((codes.astype(np.int16) + mid).reshape(rows, cols), scale, mid)


def _q8_halves(
    c8: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Byte codes ``c8 [rows, nb, 32]`` (-128..127) with a scale ``d [rows, nb]`` a block and an offset ``m`` or
    none (``w = d * c8 + m``: Q8_0, Q5_0's ``q - 16``; Q5_1's and Q5_K's ``q``) as two int4 halves over a doubled
    input: ``c8 = 16 * high + low``, high in -8..7 (scale 16 d, zero 0), low in 0..15 (scale d, zero 8 d + m)."""
    rows = c8.shape[0]
    c8 = c8.to(torch.int16)
    high, low = c8 >> 4, c8 & 15
    codes = torch.cat([(high + 8).reshape(rows, -1), low.reshape(rows, -1)], 1).to(torch.uint8)  # [rows, 2 * cols]
    zero = 8 * d if m is None else 8 * d + m
    return codes, torch.cat([16 * d, d], 1), torch.cat([torch.zeros_like(d), zero], 1), 2


def _decode_q4_k(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Q4_K as Q4_1-style blocks of 32: a super-block of 256 weights holds 8 sub-blocks, each with a 6-bit scale
    ``sc`` and min ``m``, so sub-block j is ``w = (d * sc_j) * c - dmin * m_j``, Q4_1's form with the scale
    ``d * sc_j`` (exact in float32) and the zero ``8 d sc_j - dmin m_j``. The codes are the file's."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 256, Q4_K_BYTES)  # [rows, nb, 144]
    scale, low = _k_scales(blocks)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 groups of 32 bytes: sub-block 2i low nibbles, 2i + 1 high
    codes = np.concatenate([qs & 15, qs >> 4], 3).reshape(rows, cols)  # [rows, cols]
    return torch.from_numpy(np.ascontiguousarray(codes)), scale, 8 * scale - low, 1  # codes uint8


def _k_scale_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's super-block factors and sub-block integers from the super-blocks' first 16 bytes: d, dmin
    (fp16, as float32 ``[rows, nb]``), then 6-bit scales ``sc`` and mins ``m`` in 12 bytes (uint8 ``[rows, nb, 8]``)."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    lo, hi, mixed = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]  # the 12 scale bytes, 4 at a time
    sc = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 2) & 48)], -1)  # [rows, nb, 8]
    mn = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 2) & 48)], -1)
    return d, dmin, sc, mn


def _k_scales(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's sub-block scales and mins, ``(d * sc, dmin * m)`` each ``[rows, cols / 32]`` (exact in
    float32)."""
    rows = blocks.shape[0]
    d, dmin, sc, mn = _k_scale_parts(blocks)
    return (
        torch.from_numpy((d[..., None] * sc.astype(np.float32)).reshape(rows, -1)),
        torch.from_numpy((dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1)),
    )


def super_scales(raw: np.ndarray, kind: str, cols: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A K-quant tensor's scales in their file's form, ``(factors [rows, cols / 256, F] float32, ints
    [rows, cols / 32, P] int8)`` (:func:`specdist.models.kernels.cpu_kernels.pack_super_scales`), or None for other
    types. Q2_K: factors ``(d, -dmin)``, a block's ints ``(sc_0, sc_1, m_0, m_1)``, its halves' scales ``d sc`` and
    offsets ``-dmin m``.
    Q4_K / Q5_K: factors ``(d, -dmin)``, a block's ints ``(sc, m)``: scale ``d sc``, offset ``-dmin m``. Q6_K / Q3_K:
    factor ``d``, a block's ints its two scales per 16 (Q3_K's ``sc - 32``): scale ``d sc``. IQ4_XS: factor ``d``, a
    block's int ``ls - 32``. Grid types: factor ``d / GRID_FACTOR``, a block's int its multiplier times that; IQ2_XS,
    IQ2_S and IQ1_M: factor ``d / 8``, a block's ints its two ``2 s + 1``. The products are :func:`decode_blocks`'
    scales."""
    if kind not in ("Q2_K", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_XS", *GRID_TYPES, *GRID16_TYPES):
        return None
    rows, nb = raw.shape[0], cols // 256
    if kind in GRID16_TYPES:
        d, mult = _grid16_parts(np.ascontiguousarray(raw).reshape(rows, nb, GRID16_TYPES[kind][0]), kind)
        return (
            torch.from_numpy(d[..., None] / 8),
            torch.from_numpy(mult.astype(np.int8).reshape(rows, -1, 2)),
        )  # [rows, nb, 1], [rows, G, 2]
    if kind in GRID_TYPES:
        blocks = np.ascontiguousarray(raw).reshape(rows, nb, GRID_TYPES[kind][0])
        d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
        ints = _grid_multipliers(blocks, kind) * GRID_FACTOR[kind] / GRID_TYPES[kind][1]  # [rows, nb, 8]: integers
        return (
            torch.from_numpy(d / GRID_FACTOR[kind]),
            torch.from_numpy(ints.astype(np.int8).reshape(rows, -1, 1)),
        )  # [rows, nb, 1], [rows, G, 1]
    if kind == "IQ4_XS":
        _, d, ints = _iq4_parts(raw, kind, rows, cols)
        return torch.from_numpy(d[..., None]), torch.from_numpy(ints[..., None])  # [rows, nb, 1], [rows, G, 1]
    if kind == "Q2_K":  # factors (d, -dmin), a block's ints (sc_0, sc_1, m_0, m_1): its halves' scales and offsets
        _, sc, mn, d, dmin = _q2_k_parts(raw, rows, cols)
        ints = np.concatenate([sc.reshape(rows, -1, 2), mn.reshape(rows, -1, 2)], -1).astype(np.int8)  # [rows, G, 4]
        return torch.from_numpy(np.stack([d, -dmin], -1)), torch.from_numpy(np.ascontiguousarray(ints))
    size = {"Q4_K": Q4_K_BYTES, "Q5_K": Q5_K_BYTES, "Q6_K": Q6_K_BYTES, "Q3_K": Q3_K_BYTES}[kind]
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, size)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin, sc, mn = _k_scale_parts(blocks)
        factors, ints = np.stack([d, -dmin], -1), np.stack([sc, mn], -1).astype(np.int8)  # [rows, nb, 2], [.., 8, 2]
    elif kind == "Q6_K":
        factors = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
        ints = blocks[..., 192:208].copy().view(np.int8)  # [rows, nb, 16]
    else:
        lo_sc = (blocks[..., 96:104].reshape(rows, nb, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
        hi_sc = (blocks[..., 104:108].reshape(rows, nb, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
        ints = ((lo_sc.reshape(rows, nb, 16) | hi_sc.reshape(rows, nb, 16) << 4).astype(np.int16) - 32).astype(np.int8)
        factors = blocks[..., 108:110].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    return torch.from_numpy(np.ascontiguousarray(factors)), torch.from_numpy(np.ascontiguousarray(ints)).reshape(
        rows, cols // GROUP, 2
    )


def _decode_q5_k(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Q5_K as byte codes with an offset (:func:`_q8_halves`): Q4_K's scales and mins, then 32 bytes whose bit j
    is the high bit of sub-block j's element, then 128 bytes of low 4 bits laid out as Q4_K's codes;
    ``w = (d * sc) * q - dmin * m``."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // 256, Q5_K_BYTES)  # [rows, nb, 176]
    scale, low = _k_scales(blocks)
    qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)  # [rows, nb, -, e]
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [rows, nb, sub-block, e]
    qs = blocks[..., 48:].reshape(rows, -1, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], 3).reshape(rows, -1, 8, 32) | high << 4  # [rows, nb, 8, 32] in 0..31
    return _q8_halves(torch.from_numpy(q.reshape(rows, -1, 32)), scale, -low)


def _decode_q6_k(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Q6_K as four int4 segments (:mod:`specdist.models.quant`'s layout; codes uint8). In a super-block of 256,
    element ``128 h + 32 s + e`` (``h`` in 0..1, ``s`` in 0..3, ``e`` in 0..31) has its low 4 bits in byte
    ``64 h + 32 (s % 2) + e`` of the low part (the high nibble for ``s >= 2``), its high 2 bits at bit ``2 s`` of byte
    ``32 h + e`` of the high part, and the int8 scale of its 16 (times d) for ``w = d sc (q - 32)``."""
    nb = cols // 256
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, Q6_K_BYTES)  # [rows, nb, 210]
    ql = blocks[..., :128].reshape(rows, nb, 2, 1, 2, 32)  # [.., h, -, s % 2, e]
    qh = blocks[..., 128:192].reshape(rows, nb, 2, 1, 32)  # [.., h, -, e]
    low = (ql >> np.array([0, 4], np.uint8).reshape(2, 1, 1)) & 15  # [rows, nb, h, s // 2, s % 2, e]
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [rows, nb, h, s, e]
    q = (high.reshape(rows, cols) << 4) | low.reshape(rows, cols)  # [rows, cols] in 0..63
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, nb, 16]
    d = blocks[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    return _per16_segments(q, d[..., None] * sc)


def _decode_q3_k(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Q3_K as Q6_K's four int4 segments: its codes ``q3 = l - 4 (1 - m)`` in -4..3 (``l`` 2 bits, ``m`` a mask bit)
    are ``q6 - 32`` for ``q6 = q3 + 32``, with the scale ``d (sc - 32)`` per 16 (``sc`` 6 bits). In a super-block of
    256, element ``32 t + e`` (``t = 4 h + s``) has ``l`` at bit ``2 s`` of byte ``32 h + e`` of the 64 code bytes and
    ``m`` at bit ``t`` of byte ``e`` of the 32 mask bytes; the 12 scale bytes hold scale ``j``'s low 4 bits in byte
    ``j % 8`` (the high nibble from ``j = 8``) and its high 2 bits at bit ``2 (j // 4)`` of byte ``8 + j % 4``."""
    nb = cols // 256
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, Q3_K_BYTES)  # [rows, nb, 110]
    mask = (blocks[..., :32].reshape(rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [.., t, e]
    low = (blocks[..., 32:96].reshape(rows, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q6 = (low.reshape(rows, nb, 8, 32).astype(np.int16) - 4 * (1 - mask.astype(np.int16)) + 32).astype(np.uint8)
    lo_sc = (blocks[..., 96:104].reshape(rows, nb, 1, 8) >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15
    hi_sc = (blocks[..., 104:108].reshape(rows, nb, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    sc = (lo_sc.reshape(rows, nb, 16) | hi_sc.reshape(rows, nb, 16) << 4).astype(np.float32) - 32  # [rows, nb, 16]
    d = blocks[..., 108:110].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    return _per16_segments(q6.reshape(rows, cols), d[..., None] * sc)


def _q2_k_parts(
    raw: np.ndarray, rows: int, cols: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K's codes ``q [rows, cols]`` in 0..3, its 4-bit scales ``sc`` and mins ``m`` per 16 (``[rows, nb, 16]``, in
    element order) and its fp16 ``d`` and ``dmin`` per super-block (float32 ``[rows, nb]``): ``w = d sc q - dmin m``.
    Element ``128 n + 32 j + e`` of a super-block has its code at bits ``2 j`` of byte ``32 n + e`` of the 64 code
    bytes; group of 16 ``i`` has its scale in the low nibble of byte ``i`` of the 16 scale bytes, its min in the
    high."""
    nb = cols // 256
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, Q2_K_BYTES)  # [rows, nb, 84]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (blocks[..., 16:80].reshape(rows, nb, 2, 1, 32) >> shifts) & 3  # [rows, nb, n, j, e]
    d = blocks[..., 80:82].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    dmin = blocks[..., 82:84].copy().view(np.float16)[..., 0].astype(np.float32)
    return q.reshape(rows, cols), blocks[..., :16] & 15, blocks[..., :16] >> 4, d, dmin


def _decode_q2_k(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Q2_K as four int4 segments (:mod:`specdist.models.quant`'s layout), each holding one half (16 elements) of
    every block of 32 and zero weights in the other: the values ``D q`` (codes q, scale D, zero 8 D; code 0 where
    masked) of the first and the second halves, then the offsets ``M`` (codes 15, scale and zero M / 8; code 7
    where masked) of both, with ``D = d sc`` and ``M = -dmin m`` per 16 (exact in float32)."""
    q, sc, mn, d, dmin = _q2_k_parts(raw, rows, cols)
    scale = torch.from_numpy((d[..., None] * sc.astype(np.float32)).reshape(rows, cols // 32, 2))  # [rows, G, half]
    offset = torch.from_numpy((-dmin[..., None] * mn.astype(np.float32)).reshape(rows, cols // 32, 2))
    first = torch.from_numpy(np.arange(cols) % 32 < 16)  # [cols]: the first half of its block
    q = torch.from_numpy(np.ascontiguousarray(q))
    zero, seven, fifteen = (torch.tensor(v, dtype=torch.uint8) for v in (0, 7, 15))
    offsets = [
        torch.where(first, fifteen, seven).expand(rows, cols),
        torch.where(first, seven, fifteen).expand(rows, cols),
    ]
    codes = torch.cat([torch.where(first, q, zero), torch.where(first, zero, q), *offsets], 1)  # [rows, 4 cols]
    da, db, ma, mb = scale[..., 0], scale[..., 1], offset[..., 0] / 8, offset[..., 1] / 8  # [rows, G]
    return codes, torch.cat([da, db, ma, mb], 1), torch.cat([8 * da, 8 * db, ma, mb], 1), 4


def _per16_segments(
    q: np.ndarray, scale: np.ndarray, mid: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Codes ``q [rows, cols]`` in 0..2 mid - 1 (``mid`` 32: 6 bits; 64: 7 bits) with a scale ``D`` per 16
    (``scale [rows, nb, 16]``, exact in float32), ``w = D (q - mid)``, as :mod:`specdist.models.quant`'s four int4
    segments (codes uint8): ``16 D (h - mid / 16)`` (codes ``h = q >> 4``, scale 16 D, zero ``(128 - mid) D``; code
    ``mid / 16`` where masked) for each half, then ``D l`` (``l = q & 15``, zero 8 D; code 0 where masked)."""
    rows, cols = q.shape
    scale = torch.from_numpy(np.ascontiguousarray(scale).reshape(rows, cols // 32, 2))  # [rows, G, half]
    first = torch.from_numpy(np.arange(cols) % 32 < 16)  # [cols]: the first half of its block
    h, lo = torch.from_numpy((q >> 4).astype(np.uint8)), torch.from_numpy((q & 15).astype(np.uint8))
    masked, zero = torch.tensor(mid // 16, dtype=torch.uint8), torch.tensor(0, dtype=torch.uint8)
    codes = torch.cat(
        [
            torch.where(first, h, masked),
            torch.where(first, masked, h),
            torch.where(first, lo, zero),
            torch.where(first, zero, lo),
        ],
        1,
    )  # [rows, 4 cols]
    da, db = scale[..., 0], scale[..., 1]  # [rows, G]
    z = 128 - mid
    return codes, torch.cat([16 * da, 16 * db, da, db], 1), torch.cat([z * da, z * db, 8 * da, 8 * db], 1), 4


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, repeat: int) -> torch.Tensor:
    """The float32 weight ``[rows, cols]`` of :func:`decode_blocks`' output (gguf's, to float32 rounding)."""
    rows, n = codes.shape
    g = codes.reshape(rows, n // GROUP, GROUP).to(torch.float32)
    w = ((g - 8) * scales[..., None] + zeros[..., None]).reshape(rows, n)  # [rows, r * cols]
    return w.reshape(rows, repeat, n // repeat).sum(1)  # the halves add up (Q8_0)


def reproduces(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, repeat: int, loaded: torch.Tensor, chunk: int = 4096
) -> bool:
    """Whether the blocks de-quantize to ``loaded`` (to its dtype's rounding), ``chunk`` rows at a time (a
    vocabulary-sized head's float copy would otherwise be held whole, ``repeat`` times over)."""
    eps = max(torch.finfo(loaded.dtype).eps, 1e-6)  # a bf16 / fp16 load rounded the floats once more
    for i in range(0, loaded.shape[0], chunk):
        rows = slice(i, i + chunk)
        w = dequantize(codes[rows], scales[rows], zeros[rows], repeat).to(loaded.dtype).float()
        if not torch.allclose(w, loaded[rows].float(), rtol=2 * eps, atol=1e-6):
            return False
    return True


def self_draft(target: nn.Module, method: str, gguf_path: str | None = None) -> nn.Module:
    """The target's own low-bit copy for a self draft (``draft.method``).

    ``self-w8``: int8 per output channel. ``self-w4``: int4 groups of 32; where the target comes
    from a GGUF file (``gguf_path``), the file's own blocks (where it holds some); where the target already runs on
    int4 groups (``target.weights: native``), the target itself (its modules are shared; the
    draft then proposes what the target computes, at the target's cost).
    """
    if method == "self-w8":
        return quantized_copy(target)
    if method != "self-w4":
        raise ValueError(f"not a self draft: {method!r}")
    if any(type(m) is Int4GroupLinear for m in target.modules()):
        return target
    if gguf_path is None:
        return quantized_copy(target, Int4GroupLinear)
    clone = unfused_copy(target)
    if not use_native_blocks(clone, gguf_path, "draft.method", required=False):
        return quantized_copy(target, Int4GroupLinear)  # no blocks in the file (F16): groups of the floats
    return clone


def _row_order(processor, gguf_name: str, rows: int) -> torch.Tensor:
    """Row ``i`` of transformers' weight is row ``order[i]`` of the GGUF tensor."""
    index = np.arange(rows, dtype=np.int64)[:, None]
    return torch.from_numpy(np.ascontiguousarray(processor.process(index, gguf_name).weights[:, 0]))


def native_tensors(
    model: nn.Module, gguf_path: str, device: torch.device, wanted: Callable[[str, nn.Module], bool]
) -> Iterator[NativeTensor]:
    """The file's block-quantized linears that run natively on ``device`` and whose module ``wanted(name, module)``
    accepts, each decoded whole (:func:`decode_blocks`) with its rows in transformers' order. A tied head's
    blocks are the embedding's, owned by ``lm_head`` (the embedding keeps its float table for the lookups)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = gguf.GGUFReader(gguf_path)  # the cached parse inside loader.gguf_parsed_once
    config = model.config
    processor = TENSOR_PROCESSORS.get(config.model_type, TensorProcessor)(config=config.to_dict())
    name_map = get_gguf_hf_weights_map(model, processor)  # gguf tensor name -> transformers parameter name
    modules = dict(model.named_modules(remove_duplicate=False))
    embed, head = model.get_input_embeddings(), getattr(model, "lm_head", None)
    # tied: the head is the embedding's weight, or (a tensor-parallel rank's head) a view of its rows
    tied = head is not None and (head.weight is embed.weight or getattr(head, "tied_to", None) is not None)
    cpu_blocks = device.type == "cpu" and cpu_kernels.available()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        hf_name = name_map.get(tensor.name)
        if kind not in NATIVE_TYPES or hf_name is None or not hf_name.endswith(".weight"):
            continue
        if kind in CPU_BLOCKS_ONLY and not cpu_blocks:
            continue
        owner = hf_name[: -len(".weight")]
        if tied and modules.get(owner) is embed:
            owner = "lm_head"
        if owner not in modules or not wanted(owner, modules[owner]):
            continue
        rows = tensor.data.shape[0]
        cols = int(tensor.shape[0])  # shape: (cols, rows)
        codes, scales, zeros, repeat = decode_blocks(tensor.data, kind, cols)
        order = _row_order(processor, tensor.name, rows)
        sup = super_scales(tensor.data, kind, cols) if cpu_blocks else None
        yield NativeTensor(
            owner,
            modules[owner],
            tensor.name,
            kind,
            codes[order],
            scales[order],
            zeros[order],
            repeat,
            None if sup is None else (sup[0][order], sup[1][order]),
        )


@dataclass
class NativeTensor:
    """One GGUF tensor as int4 groups (:func:`decode_blocks`), whole, in transformers' row order."""

    owner: str  # the module's name in the model
    module: nn.Module  # the module that holds its float weight now
    name: str  # the GGUF tensor's name
    kind: str  # its GGUF type
    codes: torch.Tensor  # [rows, repeat * cols]
    scales: torch.Tensor  # [rows, repeat * cols / 32]
    zeros: torch.Tensor  # [rows, repeat * cols / 32]
    repeat: int
    # K-quants on the CPU kernels: (factors [rows, cols / 256, F], ints [rows, cols / 32, P]) (super_scales), else None
    super: tuple[torch.Tensor, torch.Tensor] | None = None


def install(model: nn.Module, owner: str, module: nn.Module) -> None:
    """``model.<owner> = module``."""
    parent, _, attr = owner.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


@torch.no_grad()
def use_native_blocks(
    model: nn.Module, gguf_path: str, key: str = "target.weights", required: bool = True
) -> dict[str, int]:
    """Replace the model's block-quantized linears (in place) by int4 groups from ``gguf_path``.

    Returns how many linears run natively per GGUF type. Raises ConfigError naming ``key`` when a tensor's
    blocks do not reproduce the loaded weight, or (``required``: ``weights: native``) when the file holds no
    linear that runs natively here; otherwise (``auto``: an F16 file, or types that run natively on the CPU block
    kernels only, elsewhere) the model keeps its floats.
    """
    device = next(model.parameters()).device
    replaced: dict[str, int] = {}

    def wanted(name: str, m: nn.Module) -> bool:  # a linear the int4 kernel cannot tile keeps its float weight
        return type(m) is nn.Linear and m.out_features % INT4_ROWS == 0

    for t in native_tensors(model, gguf_path, device, wanted):
        target = t.module
        if t.codes.shape[0] != target.out_features:
            raise ConfigError(
                key, f"{gguf_path}: {t.name}: {t.codes.shape[0]} rows in the file, {target.out_features} in the model"
            )
        if not reproduces(t.codes, t.scales, t.zeros, t.repeat, target.weight.detach().cpu()):
            raise ConfigError(
                key,
                f"{gguf_path}: {t.name} ({t.kind}): its blocks do not reproduce the weight transformers "
                f"loaded for {t.owner}; load it with weights: float",
            )
        install(
            model,
            t.owner,
            Int4GroupLinear(
                t.codes.to(device), t.scales.to(device), t.zeros.to(device), target.bias, t.repeat, t.super
            ),
        )
        replaced[t.kind] = replaced.get(t.kind, 0) + 1
    if not replaced:
        if required:
            raise ConfigError(key, f"{gguf_path} holds no {'/'.join(NATIVE_TYPES)} linear weights to run natively")
        log.info("native GGUF blocks: none in %s (the floats stay)", gguf_path)
        return replaced
    untie_lm_head(model)
    log.info("native GGUF blocks: %s", ", ".join(f"{n} {k}" for k, n in sorted(replaced.items())))
    return replaced
