"""Triton kernels of the paged attention backend (:mod:`specdist.models.attention`) on GPUs.

Two kernels a layer, over the rows of a step (``N = B * T``: request ``b``'s token ``t`` is row
``b * T + t``; a request with fewer than ``T`` new tokens leaves its last rows padded):

- :func:`rope_and_write`: rotary embedding of q (in place) and k, and the rotated k and v written
  into the paged cache at each row's flat cache row (``block * block_size + offset``; padded rows
  write the scratch block). One launch for what takes about ten elementwise kernels and two
  indexed writes in torch.
- :func:`paged_attention`: each row's query over its request's keys ``[lo, p]`` (``p`` its position;
  ``lo = p - window + 1`` under a sliding window, else 0) read through the block table, with an
  online softmax in float32 (FlashAttention's recurrence). A program takes one request, one KV head
  and ``BLOCK_M`` rows of (token, query head of that KV head's group), so grouped-query heads share
  every key tile they load. Nothing is gathered or copied; the key length is read from device
  memory, so one CUDA graph serves every length.

Both are plain Triton: they run under ``TRITON_INTERPRET=1`` on a CPU (float16 / float32; the
interpreter has no bfloat16), which is how the CPU tests check them against the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def _rope_write_kernel(Q, K, V, COS, SIN, POS, SLOT, KC, VC,
                       sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, s_cos, skc_r, skc_h, svc_r, svc_h,
                       HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    pos = tl.load(POS + row)
    slot = tl.load(SLOT + row).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    cos = tl.load(COS + pos * s_cos + j, mask=jm, other=0.0).to(tl.float32)[None, :]  # [1, HALF]
    sin = tl.load(SIN + pos * s_cos + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    # q: x1 * cos - x2 * sin | x2 * cos + x1 * sin on the first 2 * HALF dims (the rest pass), in place
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    qm = (hq < HQ) & jm[None, :]
    q1p = Q + row * sq_n + hq * sq_h + j[None, :]
    q1 = tl.load(q1p, mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q1p + HALF, mask=qm, other=0.0).to(tl.float32)
    tl.store(q1p, (q1 * cos - q2 * sin).to(Q.dtype.element_ty), mask=qm)
    tl.store(q1p + HALF, (q2 * cos + q1 * sin).to(Q.dtype.element_ty), mask=qm)
    # k rotated the same way, then k and v into the cache row
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    km = (hk < HKV) & jm[None, :]
    k1p = K + row * sk_n + hk * sk_h + j[None, :]
    k1 = tl.load(k1p, mask=km, other=0.0).to(tl.float32)
    k2 = tl.load(k1p + HALF, mask=km, other=0.0).to(tl.float32)
    c1p = KC + slot * skc_r + hk * skc_h + j[None, :]
    tl.store(c1p, (k1 * cos - k2 * sin).to(KC.dtype.element_ty), mask=km)
    tl.store(c1p + HALF, (k2 * cos + k1 * sin).to(KC.dtype.element_ty), mask=km)
    d = tl.arange(0, BLOCK_D)[None, :]
    if 2 * HALF < HD:  # partial rotary: the unrotated tail of k
        tm = (hk < HKV) & (d >= 2 * HALF) & (d < HD)
        tail = tl.load(K + row * sk_n + hk * sk_h + d, mask=tm, other=0.0)
        tl.store(KC + slot * skc_r + hk * skc_h + d, tail.to(KC.dtype.element_ty), mask=tm)
    vm = (hk < HKV) & (d < HD)
    v = tl.load(V + row * sv_n + hk * sv_h + d, mask=vm, other=0.0)
    tl.store(VC + slot * svc_r + hk * svc_h + d, v.to(VC.dtype.element_ty), mask=vm)


def rope_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> None:
    """Rotate ``q`` [N, Hq, hd] in place and write rotated ``k`` and ``v`` [N, Hkv, hd] into ``k_cache`` /
    ``v_cache`` [blocks, block_size, Hkv, hd] at rows ``slot_mapping`` [N]. ``cos`` / ``sin`` [L, rd] are the
    half-rotation tables whose two halves are equal (transformers' layout); ``positions`` [N] index them.
    q, k, v may be strided views (the fused projection's output); their last dimension is contiguous."""
    n, hq, hd = q.shape
    hkv = k.shape[1]
    half = cos.shape[-1] // 2
    kc = k_cache.view(-1, hkv, hd)  # [blocks * block_size, Hkv, hd]
    vc = v_cache.view(-1, hkv, hd)
    _rope_write_kernel[(n,)](q, k, v, cos, sin, positions, slot_mapping, kc, vc,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             cos.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                             HQ=hq, HKV=hkv, HD=hd, HALF=half, BLOCK_HQ=_pow2(hq), BLOCK_HKV=_pow2(hkv),
                             BLOCK_HALF=_pow2(half), BLOCK_D=_pow2(hd))


@triton.jit
def _paged_attention_kernel(Q, KC, VC, O, TABLE, STARTS, NNEW,
                            sq_n, sq_h, so_n, so_h, skb, skt, skh, svb, svt, svh, s_table,
                            T, scale, softcap, window,
                            G: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                            WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    start = tl.load(STARTS + b)
    n = tl.load(NNEW + b)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]: row r is token r // G, query head h * G + r % G
    t = r // G
    in_rows = t < T
    valid = t < n
    qpos = start + t  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    qrow = (b * T + t).to(tl.int64)
    qhead = h * G + r % G
    q = tl.load(Q + qrow[:, None] * sq_n + qhead[:, None] * sq_h + d[None, :],
                mask=valid[:, None] & dm[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    # keys [lo, hi): up to the last valid query position of these rows, from the window's first key
    t_last = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G, n - 1)
    hi = start + t_last + 1
    k0 = start * 0
    if WINDOW:
        k0 = tl.maximum(start + (mb * BLOCK_M) // G - window + 1, 0)
        k0 = (k0 // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    while k0 < hi:  # (a while loop: Triton's interpreter takes no tensor bounds in range())
        kidx = k0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        kin = kidx < hi
        block = tl.load(TABLE + b * s_table + kidx // BS, mask=kin, other=0).to(tl.int64)
        koff = block * skb + (kidx % BS) * skt + h * skh  # [BLOCK_N]
        k = tl.load(KC + koff[None, :] + d[:, None], mask=kin[None, :] & dm[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] float32
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        seen = (kidx[None, :] <= qpos[:, None]) & kin[None, :]
        if WINDOW:
            seen = seen & (kidx[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        voff = block * svb + (kidx % BS) * svt + h * svh
        v = tl.load(VC + voff[:, None] + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        k0 += BLOCK_N
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = tl.where(valid[:, None], o, 0.0)  # padded rows: zeros, so nothing downstream meets garbage
    tl.store(O + qrow[:, None] * so_n + qhead[:, None] * so_h + d[None, :], o.to(O.dtype.element_ty),
             mask=in_rows[:, None] & dm[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    starts: torch.Tensor, n_new: torch.Tensor, tokens_per_request: int, scale: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of ``q`` [B * T, Hq, hd] (rows as in the module doc) over ``k_cache`` / ``v_cache``
    [blocks, block_size, Hkv, hd] through ``table`` [B, max_blocks] int32; request b's queries are at
    positions ``starts[b] + t`` for ``t < n_new[b]`` and see keys up to their own. -> [B * T, Hq, hd]."""
    rows, hq, hd = q.shape
    bsz = table.shape[0]
    hkv = k_cache.shape[2]
    groups = hq // hkv
    out = torch.empty(rows, hq, hd, dtype=q.dtype, device=q.device)
    block_m = 16 if tokens_per_request * groups <= 16 else 64
    grid = (bsz, hkv, triton.cdiv(tokens_per_request * groups, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, table, starts, n_new,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), table.stride(0), tokens_per_request, scale, softcap or 0.0, window or 0,
        G=groups, HD=hd, BLOCK_D=max(16, _pow2(hd)), BS=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=64,
        SOFTCAP=softcap is not None, WINDOW=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else None)  # float32: no TF32 rounding (tests compare bits)
    return out
