"""The paged cache's backends (:class:`~specdist.models.paged_cache.PagedKVCache`: blocks of ``block_size``
positions read through each request's block table, shared by prefix and copied on write): ``paged``, the Triton
kernels of :mod:`specdist.models.triton_attention` (one fused rotary + cache write and one attention kernel a
layer), and ``paged-torch``, torch's reference of the same two (anywhere: the CPU tests, devices without Triton).
A step's metadata is one host-to-device copy (:func:`~specdist.models.attention.pack_step`, pinned on GPUs) from
which the device derives positions, cache rows and key lengths (:func:`~specdist.models.attention.unpack_step`):
no host value of a step is baked into the pass, so one CUDA graph serves every key length."""

from __future__ import annotations

import os

import numpy as np
import torch

from specdist.models.attention import PagedAttention, pack_step, triton_available, unpack_step
from specdist.models.backends.base import AttentionBackend, register
from specdist.models.paged_cache import PagedKVCache


class _PagedBackend(PagedAttention, AttentionBackend):
    kv_layout = "paged"
    use_triton_kernels = False

    def __init__(self, cache, scaling, windows, softcap, rope):
        PagedAttention.__init__(self, cache, scaling, windows, softcap, rope, use_triton=self.use_triton_kernels)

    @classmethod
    def make_cache(cls, num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device, num_blocks=None,
                   block_size=16):
        """``num_blocks`` None: every slot's full length, and the scratch block."""
        if num_blocks is None:
            num_blocks = num_slots * PagedKVCache.blocks_for(max_len, block_size) + 1
        return PagedKVCache(num_layers, num_slots, num_kv_heads, head_dim, max_len, num_blocks, block_size, dtype,
                            device)

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
        step.extra = buf[at: at + len(extra)] if extra is not None else None
        return step


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
