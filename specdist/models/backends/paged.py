"""The paged cache's backends (:class:`~specdist.models.kv.paged.PagedKVCache`: blocks of ``block_size``
positions read through each request's block table, shared by prefix and copied on write): ``paged``, the Triton
kernels of :mod:`specdist.models.kernels.triton_attention` (one fused rotary + cache write and one attention
kernel a layer: no gathered prefix, no math backend), and ``paged-torch``, torch's reference of the same two
(anywhere: the CPU tests, devices without Triton).

A step's metadata is one host-to-device copy (:func:`pack_step`, pinned on GPUs) from which the device derives
positions, cache rows and key lengths (:func:`unpack_step`): no host value of a step is baked into the pass, so
one CUDA graph serves every key length. Rows: a step of ``B`` requests and ``T`` tokens per request (padded) has
``B * T`` rows, request b's token t at row ``b * T + t``. Padded rows (``t >= n_new[b]``) write the scratch
block and their outputs are zeros.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdist.models.backends.base import AttentionBackend, register
from specdist.models.kv.paged import PagedKVCache


@functools.cache
def triton_available() -> bool:
    """Triton imports and drives CUDA here (the GPU kernels of this backend)."""
    try:
        import triton  # noqa: F401

        return torch.cuda.is_available()
    except ImportError:
        return False


@dataclass
class PagedStep:
    """One step's metadata on the device (views of the one buffer the host sent, and what the
    device derived from it)."""

    bsz: int  # B (padded to a graph bucket, or the call's own)
    tokens: int  # T
    ids: torch.Tensor  # [B, T] int32 token ids (padded: 0)
    positions: torch.Tensor  # [B * T] int32: each row's position (padded rows: their request's last)
    slot_mapping: torch.Tensor  # [B * T] int64: each row's cache row (block * block_size + offset; padded: 0)
    table: torch.Tensor  # [B, max_blocks] int32 block tables (padded with the scratch block)
    starts: torch.Tensor  # [B] int32: tokens each request held before the step
    n_new: torch.Tensor  # [B] int32: its new tokens
    logits_rows: torch.Tensor  # [B * T] int32: rows whose logits are returned (first num_logits rows used)
    logits_dst: torch.Tensor  # [B * T] int32: where each of those goes in the [B, n_out] left-aligned layout
    extra: torch.Tensor | None = None  # [W] int32: the caller's words that rode in the same copy, or None


_SEGMENTS = ("ids", "starts", "n_new", "table", "logits_rows", "logits_dst")  # a step buffer's, in order
_ALIGN = 4  # int32 words: every segment starts on 16 bytes (the kernels' pointers are then specialised once)


def _segment_lengths(bsz: int, tokens: int, width: int) -> tuple[int, ...]:
    bt = bsz * tokens
    return bt, bsz, bsz, bsz * width, bt, bt


def step_layout(bsz: int, tokens: int, width: int) -> dict[str, slice]:
    """Where each segment of a step's buffer (:func:`pack_step`) lies: ``ids [B*T] | starts [B] | n_new [B] |
    table [B*width] | logits_rows [B*T] | logits_dst [B*T]``, each starting on a multiple of 4 words (16 bytes:
    Triton specialises a kernel on whether each pointer is 16-byte aligned, so views at batch-dependent
    misalignments would compile it again per bucket), zeros between."""
    out, at = {}, 0
    for name, n in zip(_SEGMENTS, _segment_lengths(bsz, tokens, width)):
        out[name] = slice(at, at + n)
        at += -(-n // _ALIGN) * _ALIGN
    return out


def step_size(bsz: int, tokens: int, width: int) -> int:
    """Ints in one step's buffer (:func:`pack_step`; a multiple of 4)."""
    return sum(-(-n // _ALIGN) * _ALIGN for n in _segment_lengths(bsz, tokens, width))


def pack_step(
    cache: PagedKVCache,
    slots: list[int],
    tokens: list[list[int]],
    starts: list[int],
    num_logits: list[int],
    bsz: int,
    t_pad: int,
    width: int,
) -> list[int]:
    """The host's part of a step, as one flat int list of :func:`step_size` ints laid out as :func:`step_layout`
    says; requests past ``len(slots)`` (graph padding) are empty. ``logits_rows``: request b's last
    ``num_logits[b]`` tokens, requests one after another; ``logits_dst``: their places in ``[B, max(num_logits)]``."""
    ids: list[int] = []
    for t in tokens:
        ids += t
        ids += [0] * (t_pad - len(t))
    n_new = [len(t) for t in tokens]
    rows: list[int] = []
    dst: list[int] = []
    n_out = max(num_logits) if num_logits else 0
    for b, (n, m) in enumerate(zip(n_new, num_logits)):
        rows += range(b * t_pad + n - m, b * t_pad + n)
        dst += range(b * n_out, b * n_out + m)
    values = {
        "ids": ids,
        "starts": list(starts),
        "n_new": n_new,
        "table": cache.table_rows(slots, width),
        "logits_rows": rows,
        "logits_dst": dst,
    }
    out = [0] * step_size(bsz, t_pad, width)  # padding requests, unused rows and the gaps: zeros
    for name, where in step_layout(bsz, t_pad, width).items():
        out[where.start : where.start + len(values[name])] = values[name]
    return out


def unpack_step(buf: torch.Tensor, bsz: int, t_pad: int, width: int, block_size: int) -> PagedStep:
    """The device's part: views of ``buf`` (what :func:`pack_step` wrote) and the positions and cache rows
    derived from them. Only device work: safe inside a CUDA graph."""
    bt = bsz * t_pad
    seg = {name: buf[where] for name, where in step_layout(bsz, t_pad, width).items()}
    starts, n_new = seg["starts"], seg["n_new"]
    table = seg["table"].view(bsz, width)
    t = torch.arange(t_pad, device=buf.device, dtype=torch.int32)  # [T]
    valid = t[None, :] < n_new[:, None]  # [B, T]
    pos = starts[:, None] + t[None, :]  # [B, T]
    last = (starts + n_new - 1).clamp(min=0)  # [B]
    pos = torch.minimum(pos, last[:, None])  # padded rows: their request's last position
    block = table.gather(1, (pos // block_size).long())  # [B, T]
    slot_mapping = torch.where(valid, block.long() * block_size + (pos % block_size).long(), 0)
    return PagedStep(
        bsz,
        t_pad,
        seg["ids"].view(bsz, t_pad),
        pos.reshape(bt),
        slot_mapping.reshape(bt),
        table,
        starts,
        n_new,
        seg["logits_rows"],
        seg["logits_dst"],
    )


def rope_and_write_reference(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache) -> torch.Tensor:
    """torch's form of :func:`specdist.models.kernels.triton_attention.rope_and_write`: returns the rotated q
    [N, Hq, hd] (q itself is left alone) and writes the rotated k and v into the caches."""
    c, s = cos[positions.long()][:, None], sin[positions.long()][:, None]  # [N, 1, rd]
    q, k = _rotate(q, c, s), _rotate(k, c, s)
    hkv, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [N, H, hd], [N, 1, rd]
    """Half-rotation RoPE of the first rd dims (transformers' rotate_half), the rest passed."""
    rd = cos.shape[-1]
    x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
    rot = x[..., :rd] * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rot if rd == x.shape[-1] else torch.cat((rot, x[..., rd:]), dim=-1)


def paged_attention_reference(
    q, k_cache, v_cache, table, starts, n_new, t_pad: int, scale: float, window: int | None, softcap: float | None
) -> torch.Tensor:
    """torch's form of :func:`specdist.models.kernels.triton_attention.paged_attention`: each request's keys gathered
    through its table (a copy of ``width * block_size`` positions; the CPU tests' reference), then SDPA under
    the causal (and window) mask."""
    rows, hq, hd = q.shape
    bsz, width = table.shape
    _, bs, hkv, _ = k_cache.shape
    keys = k_cache[table.long()].reshape(bsz, width * bs, hkv, hd).transpose(1, 2)  # [B, Hkv, S, hd]
    vals = v_cache[table.long()].reshape(bsz, width * bs, hkv, hd).transpose(1, 2)
    qb = q.reshape(bsz, t_pad, hq, hd).transpose(1, 2)  # [B, Hq, T, hd]
    t = torch.arange(t_pad, device=q.device)
    qpos = starts[:, None].long() + t[None, :]  # [B, T]
    j = torch.arange(width * bs, device=q.device)  # [S]
    seen = j[None, None, :] <= qpos[:, :, None]  # [B, T, S]
    if window is not None:
        seen &= j[None, None, :] > qpos[:, :, None] - window
    valid = t[None, :] < n_new[:, None]  # [B, T]
    seen |= ~valid[:, :, None]  # padded rows see everything (their outputs are zeroed below), so no row is empty
    if hq != hkv:
        keys, vals = keys.repeat_interleave(hq // hkv, 1), vals.repeat_interleave(hq // hkv, 1)
    if softcap is None:
        o = F.scaled_dot_product_attention(
            qb, keys.to(qb.dtype), vals.to(qb.dtype), attn_mask=seen[:, None], scale=scale
        )
    else:
        scores = torch.matmul(qb.float(), keys.float().transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~seen[:, None], float("-inf"))
        o = torch.matmul(scores.softmax(-1), vals.float()).to(q.dtype)
    o = o.transpose(1, 2) * valid[:, :, None, None]  # [B, T, Hq, hd]
    return o.reshape(rows, hq, hd)


class _PagedBackend(AttentionBackend):
    """The paged backends over one :class:`PagedKVCache` (see the module doc): the Triton kernels or their torch
    reference (``use_triton_kernels``)."""

    kv_layout = "paged"
    use_triton_kernels = False

    def __init__(self, cache, scaling, windows, softcap, rope):
        super().__init__(cache, scaling, windows, softcap, rope)
        self.use_triton = self.use_triton_kernels
        # the fused rotary needs transformers' duplicated halves (cos = cat(c, c)), as every family has
        self.fused_rope = self.use_triton and all(
            torch.equal(c[:, : c.shape[1] // 2], c[:, c.shape[1] // 2 :]) for c, _ in rope
        )
        self.pinned = cache.k[0].device.type == "cuda"

    @classmethod
    def make_cache(
        cls, num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device, num_blocks=None, block_size=16
    ):
        """``num_blocks`` None: every slot's full length, and the scratch block."""
        if num_blocks is None:
            num_blocks = num_slots * PagedKVCache.blocks_for(max_len, block_size) + 1
        return PagedKVCache(
            num_layers, num_slots, num_kv_heads, head_dim, max_len, num_blocks, block_size, dtype, device
        )

    def plan(self, slots, tokens, starts, num_logits, bsz, t_pad, extra=None, width=None, into=None):
        """The blocks each request writes taken first (copy on write where shared), then the step's one copy:
        :func:`pack_step`'s words, then the caller's ``extra`` words from an even word (8-byte views stay
        aligned), into ``into`` when given (a CUDA graph's static buffer). ``width``: the block tables' width
        (default: the longest sequence's blocks)."""
        cache = self.cache
        for s, st, t in zip(slots, starts, tokens):
            cache.ensure(s, st + len(t))
        if width is None:
            width = PagedKVCache.blocks_for(max(st + len(t) for st, t in zip(starts, tokens)), cache.block_size)
        host = pack_step(cache, slots, tokens, starts, num_logits, bsz, t_pad, width)
        at = len(host) + len(host) % 2
        words = host if extra is None else np.concatenate([host, [0] * (at - len(host)), extra])
        buf = self.send(words, None if into is None else into[: len(words)])
        step = unpack_step(buf[: len(host)], bsz, t_pad, width, cache.block_size)
        step.extra = buf[at : at + len(extra)] if extra is not None else None
        return step

    def send(self, host, into: torch.Tensor | None = None) -> torch.Tensor:
        """The step's one host-to-device copy: ``host`` (from :func:`pack_step`) through a pinned staging tensor
        on GPUs, copied without blocking the host (torch's pinned allocator keeps the staging memory until the
        copy ran), into ``into`` when given (a CUDA graph's static buffer). Returns the device buffer."""
        src = torch.from_numpy(np.asarray(host, dtype=np.int32))
        if self.pinned:
            src = src.pin_memory()
        if into is not None:
            return into.copy_(src, non_blocking=True)
        dev = self.cache.k[0].device
        return src.to(dev, non_blocking=True) if dev.type != "cpu" else src

    def forward(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: PagedStep) -> torch.Tensor:
        """Layer ``i``: q [N, Hq, hd], k, v [N, Hkv, hd] (N = B * T rows, before the rotary) -> [N, Hq, hd]."""
        kc, vc = self.cache.k[i], self.cache.v[i]
        cos, sin = self.rope[i]
        if self.fused_rope:
            from specdist.models.kernels.triton_attention import rope_and_write

            rope_and_write(q, k, v, cos, sin, step.positions, step.slot_mapping, kc, vc)
        else:
            q = rope_and_write_reference(q, k, v, cos, sin, step.positions, step.slot_mapping, kc, vc)
        if self.use_triton:
            from specdist.models.kernels.triton_attention import paged_attention

            return paged_attention(
                q, kc, vc, step.table, step.starts, step.n_new, step.tokens, self.scaling, self.windows[i], self.softcap
            )
        return paged_attention_reference(
            q, kc, vc, step.table, step.starts, step.n_new, step.tokens, self.scaling, self.windows[i], self.softcap
        )


@register
class TritonPagedBackend(_PagedBackend):
    name = "paged"
    use_triton_kernels = True

    @classmethod
    def unavailable(cls, device, dtype):
        if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's interpreter: the kernels on the CPU (tests)
            return None if dtype != torch.bfloat16 else "Triton's interpreter has no bfloat16"
        if device.type != "cuda" or not triton_available():
            return "the Triton kernels need CUDA and Triton"
        return None


@register
class TorchPagedBackend(_PagedBackend):
    name = "paged-torch"
