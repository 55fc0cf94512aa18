"""Triton kernels of the paged attention backend (:mod:`specdist.models.backends.paged`) on GPUs.

Rows: a step of ``B`` requests and ``T`` tokens per request has ``N = B * T`` rows, request ``b``'s
token ``t`` at row ``b * T + t``; a request with fewer than ``T`` new tokens leaves its last rows padded.

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
- Split-KV (flash-decoding): when a step has too few (request, KV head, row block) programs to fill
  the GPU and its block tables are long, each program's keys are cut into ``splits`` ranges, one
  program a range (:func:`_paged_attention_split_kernel` writes each range's running max, sum and
  unnormalised output), and :func:`_split_reduce_kernel` combines them. The number of ranges comes
  from static quantities only (batch, heads, rows, table width: :func:`split_count`), so a CUDA
  graph captured once per bucket stays right for every length; each program cuts the real length
  (read from device memory) into equal ranges, and a range past it writes a neutral partial.

Compile keys: every int that varies from step to step (``T``, the table's row stride, the window,
the split count) is ``do_not_specialize``, and the step buffer's segments start on 16 bytes
(:func:`~specdist.models.backends.paged.step_layout`), so a kernel compiles once per row-block size
(decode and verification, or prefill) and dtype, never per bucket or prompt length.

All are plain Triton: they run under ``TRITON_INTERPRET=1`` on a CPU (float16 / float32; the
interpreter has no bfloat16), which is how the CPU tests check them against the torch reference.
The key loop is a ``tl.range`` (software-pipelined by Triton) when compiled and a ``while`` loop in
the interpreter, whose ``range`` takes no tensor bounds under numpy 2; the body is one function.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

NO_WINDOW = 1 << 30  # the window passed for full attention: every key at or before a query's position
SPLIT_MIN_KEYS = 256  # split-KV: each range holds at least this many keys when the table is full
MAX_SPLITS = 64
H100_SMS = 132  # the SM count split_count assumes off a CUDA device (the CPU tests, sm_90 compiles)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def _rope_write_kernel(
    Q,
    K,
    V,
    COS,
    SIN,
    POS,
    SLOT,
    KC,
    VC,
    sq_n,
    sq_h,
    sk_n,
    sk_h,
    sv_n,
    sv_h,
    s_cos,
    skc_r,
    skc_h,
    svc_r,
    svc_h,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
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
    q1 = tl.load(q1p, mask=qm, other=0.0).to(tl.float32)  # [BLOCK_HQ, BLOCK_HALF]
    q2 = tl.load(q1p + HALF, mask=qm, other=0.0).to(tl.float32)
    tl.store(q1p, (q1 * cos - q2 * sin).to(Q.dtype.element_ty), mask=qm)
    tl.store(q1p + HALF, (q2 * cos + q1 * sin).to(Q.dtype.element_ty), mask=qm)
    # k rotated the same way, then k and v into the cache row
    hk = tl.arange(0, BLOCK_HKV)[:, None]
    km = (hk < HKV) & jm[None, :]
    k1p = K + row * sk_n + hk * sk_h + j[None, :]
    k1 = tl.load(k1p, mask=km, other=0.0).to(tl.float32)  # [BLOCK_HKV, BLOCK_HALF]
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
    v = tl.load(V + row * sv_n + hk * sv_h + d, mask=vm, other=0.0)  # [BLOCK_HKV, BLOCK_D]
    tl.store(VC + slot * svc_r + hk * svc_h + d, v.to(VC.dtype.element_ty), mask=vm)


def rope_and_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Rotate ``q`` [N, Hq, hd] in place and write rotated ``k`` and ``v`` [N, Hkv, hd] into ``k_cache`` /
    ``v_cache`` [blocks, block_size, Hkv, hd] at rows ``slot_mapping`` [N]. ``cos`` / ``sin`` [L, rd] are the
    half-rotation tables whose two halves are equal (transformers' layout); ``positions`` [N] index them.
    q, k, v may be strided views (the fused projection's output); their last dimension is contiguous."""
    n, hq, hd = q.shape
    hkv = k.shape[1]
    half = cos.shape[-1] // 2
    kc = k_cache.view(-1, hkv, hd)  # [blocks * block_size, Hkv, hd]
    vc = v_cache.view(-1, hkv, hd)
    _rope_write_kernel[(n,)](
        q,
        k,
        v,
        cos,
        sin,
        positions,
        slot_mapping,
        kc,
        vc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        kc.stride(0),
        kc.stride(1),
        vc.stride(0),
        vc.stride(1),
        HQ=hq,
        HKV=hkv,
        HD=hd,
        HALF=half,
        BLOCK_HQ=_pow2(hq),
        BLOCK_HKV=_pow2(hkv),
        BLOCK_HALF=_pow2(half),
        BLOCK_D=_pow2(hd),
    )


@triton.jit
def _tanh(x):
    """tanh of float32 ``x`` within about one float32 epsilon relative (torch's CPU tanh: half of one; measured by
    tests/support/paged_kernels_check.py): Cephes' tanhf, an odd polynomial below |x| = 0.625 and
    ``1 - 2 / (exp(2|x|) + 1)`` above. ``2 * sigmoid(2x) - 1`` loses small results to the cancellation (up to
    1.7e-7 absolute, 8e-6 on a score soft-capped at 50 as Gemma 2's are)."""
    a = tl.abs(x)
    z = x * x
    small = (
        (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
        - 3.33332819422e-1
    ) * z * x + x
    big = 1.0 - tl.math.div_rn(2.0, tl.exp(2.0 * tl.minimum(a, 10.0)) + 1.0)  # tanh(10) is 1 in float32
    return tl.where(a < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def _query_rows(
    Q,
    STARTS,
    NNEW,
    b,
    h,
    mb,
    sq_n,
    sq_h,
    T,
    G: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    window,
):
    """A program's rows (token, query head of KV head ``h``'s group) ``mb * BLOCK_M ...`` of request ``b``: their
    queries [BLOCK_M, BLOCK_D], positions, flags, and the keys [lo, hi) they see between them (``lo`` on a
    BLOCK_N boundary; ``hi <= lo`` when no row is valid)."""
    start = tl.load(STARTS + b)
    n = tl.load(NNEW + b)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]: row r is token r // G, query head h * G + r % G
    t = r // G
    valid = t < n
    qpos = start + t  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    qrow = (b * T + t).to(tl.int64)
    qhead = h * G + r % G
    q = tl.load(
        Q + qrow[:, None] * sq_n + qhead[:, None] * sq_h + d[None, :],
        mask=valid[:, None] & (d < HD)[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    t_first = (mb * BLOCK_M) // G
    hi = tl.where(t_first < n, start + tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G, n - 1) + 1, 0)
    lo = tl.maximum(start + t_first - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    return q, t, valid, qpos, qrow, qhead, lo, hi


@triton.jit
def _attend_keys(
    q,
    qpos,
    lo,
    hi,
    b,
    h,
    KC,
    VC,
    TABLE,
    s_table,
    skb,
    skt,
    skh,
    svb,
    svt,
    svh,
    scale,
    softcap,
    window,
    HD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    PIPELINE: tl.constexpr,
):
    """The online softmax of the rows' queries ``q`` [BLOCK_M, BLOCK_D] over keys [lo, hi) of request ``b``, KV
    head ``h``: the running max and sum [BLOCK_M] and the unnormalised output [BLOCK_M, BLOCK_D] (float32)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if PIPELINE:
        for k0 in tl.range(lo, hi, BLOCK_N):  # pipelined by Triton: the next tiles load while this one computes
            m_i, l_i, acc = _key_tile(
                q,
                m_i,
                l_i,
                acc,
                k0,
                qpos,
                hi,
                b,
                h,
                KC,
                VC,
                TABLE,
                s_table,
                skb,
                skt,
                skh,
                svb,
                svt,
                svh,
                scale,
                softcap,
                window,
                HD,
                BLOCK_D,
                BS,
                BLOCK_N,
                SOFTCAP,
                PRECISION,
            )
    else:  # Triton's interpreter: its range() takes no tensor bounds (numpy 2 refuses int() of its scalars)
        k0 = lo
        while k0 < hi:
            m_i, l_i, acc = _key_tile(
                q,
                m_i,
                l_i,
                acc,
                k0,
                qpos,
                hi,
                b,
                h,
                KC,
                VC,
                TABLE,
                s_table,
                skb,
                skt,
                skh,
                svb,
                svt,
                svh,
                scale,
                softcap,
                window,
                HD,
                BLOCK_D,
                BS,
                BLOCK_N,
                SOFTCAP,
                PRECISION,
            )
            k0 += BLOCK_N
    return m_i, l_i, acc


@triton.jit
def _key_tile(
    q,
    m_i,
    l_i,
    acc,
    k0,
    qpos,
    hi,
    b,
    h,
    KC,
    VC,
    TABLE,
    s_table,
    skb,
    skt,
    skh,
    svb,
    svt,
    svh,
    scale,
    softcap,
    window,
    HD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One step of the online softmax: keys ``k0 ... k0 + BLOCK_N`` (those below ``hi``) read through the table."""
    kidx = k0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    kin = kidx < hi
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    block = tl.load(TABLE + b * s_table + kidx // BS, mask=kin, other=0).to(tl.int64)  # [BLOCK_N]
    koff = block * skb + (kidx % BS) * skt + h * skh
    k = tl.load(KC + koff[:, None] + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] float32
    if SOFTCAP:
        s = softcap * _tanh(tl.math.div_rn(s, softcap))  # as the reference: tanh(s / softcap) * softcap
    seen = (kidx[None, :] <= qpos[:, None]) & (kidx[None, :] > qpos[:, None] - window) & kin[None, :]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    voff = block * svb + (kidx % BS) * svt + h * svh
    v = tl.load(VC + voff[:, None] + d[None, :], mask=kin[:, None] & dm[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["s_table", "T", "window"])
def _paged_attention_kernel(
    Q,
    KC,
    VC,
    O,
    TABLE,
    STARTS,
    NNEW,
    sq_n,
    sq_h,
    so_n,
    so_h,
    skb,
    skt,
    skh,
    svb,
    svt,
    svh,
    s_table,
    T,
    scale,
    softcap,
    window,
    G: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    PIPELINE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q, t, valid, qpos, qrow, qhead, lo, hi = _query_rows(
        Q, STARTS, NNEW, b, h, mb, sq_n, sq_h, T, G, HD, BLOCK_D, BLOCK_M, BLOCK_N, window
    )
    m_i, l_i, acc = _attend_keys(
        q,
        qpos,
        lo,
        hi,
        b,
        h,
        KC,
        VC,
        TABLE,
        s_table,
        skb,
        skt,
        skh,
        svb,
        svt,
        svh,
        scale,
        softcap,
        window,
        HD,
        BLOCK_M,
        BLOCK_D,
        BS,
        BLOCK_N,
        SOFTCAP,
        PRECISION,
        PIPELINE,
    )
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = tl.where(valid[:, None], o, 0.0)  # padded rows: zeros, so nothing downstream meets garbage
    d = tl.arange(0, BLOCK_D)
    tl.store(
        O + qrow[:, None] * so_n + qhead[:, None] * so_h + d[None, :],
        o.to(O.dtype.element_ty),
        mask=(t < T)[:, None] & (d < HD)[None, :],
    )


@triton.jit(do_not_specialize=["s_table", "T", "window", "splits"])
def _paged_attention_split_kernel(
    Q,
    KC,
    VC,
    STATS,
    ACC,
    TABLE,
    STARTS,
    NNEW,
    sq_n,
    sq_h,
    skb,
    skt,
    skh,
    svb,
    svt,
    svh,
    s_table,
    T,
    scale,
    softcap,
    window,
    splits,
    G: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    PIPELINE: tl.constexpr,
):
    """Program (b, h, mb * splits + s): range s of the keys rows block mb sees, as (max, sum) into STATS [P, 2,
    BLOCK_M] and the unnormalised output into ACC [P, BLOCK_M, BLOCK_D] (float32), P = (b, h, mb, s) flattened."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2) // splits
    s = tl.program_id(2) % splits
    q, t, valid, qpos, qrow, qhead, lo, hi = _query_rows(
        Q, STARTS, NNEW, b, h, mb, sq_n, sq_h, T, G, HD, BLOCK_D, BLOCK_M, BLOCK_N, window
    )
    # the real length cut into `splits` equal ranges of whole tiles; those past it are empty (neutral partials)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), splits), BLOCK_N) * BLOCK_N
    k_lo = lo + s * chunk
    k_hi = tl.minimum(k_lo + chunk, hi)
    m_i, l_i, acc = _attend_keys(
        q,
        qpos,
        k_lo,
        k_hi,
        b,
        h,
        KC,
        VC,
        TABLE,
        s_table,
        skb,
        skt,
        skh,
        svb,
        svt,
        svh,
        scale,
        softcap,
        window,
        HD,
        BLOCK_M,
        BLOCK_D,
        BS,
        BLOCK_N,
        SOFTCAP,
        PRECISION,
        PIPELINE,
    )
    # padded rows: neutral partials (the reduce weighs their finite outputs by exp(-inf) = 0), so they give zeros
    m_i = tl.where(valid, m_i, float("-inf"))
    l_i = tl.where(valid, l_i, 0.0)
    p = ((b * tl.num_programs(1) + h) * tl.num_programs(2) + tl.program_id(2)).to(tl.int64)  # this partial
    i = tl.arange(0, BLOCK_M)
    stats = STATS + p * 2 * BLOCK_M
    tl.store(stats + i, m_i)
    tl.store(stats + BLOCK_M + i, l_i)
    d = tl.arange(0, BLOCK_D)
    tl.store(ACC + p * BLOCK_M * BLOCK_D + i[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit(do_not_specialize=["T", "splits"])
def _split_reduce_kernel(
    STATS,
    ACC,
    O,
    so_n,
    so_h,
    T,
    splits,
    G: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Program (b, h, mb): the `splits` partials of rows block mb combined (the online softmax's rescaling) and
    normalised into O, as :func:`_paged_attention_kernel` writes it."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    p = ((b * tl.num_programs(1) + h) * tl.num_programs(2) + mb).to(tl.int64) * splits  # the first partial's index
    s = 0
    while s < splits:  # a while loop: the interpreter's range() takes no tensor bounds
        stats = STATS + (p + s) * 2 * BLOCK_M
        m_s = tl.load(stats + i)  # [BLOCK_M]
        l_s = tl.load(stats + BLOCK_M + i)
        acc_s = tl.load(ACC + (p + s) * BLOCK_M * BLOCK_D + i[:, None] * BLOCK_D + d[None, :])  # [BLOCK_M, BLOCK_D]
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        beta = tl.exp(m_s - m_safe)  # 0 for an empty range (m_s = -inf; its sum and output are 0)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
        s += 1
    r = mb * BLOCK_M + i  # as in _query_rows
    t = r // G
    qrow = (b * T + t).to(tl.int64)
    qhead = h * G + r % G
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that saw no key (padded): 0
    tl.store(
        O + qrow[:, None] * so_n + qhead[:, None] * so_h + d[None, :],
        o.to(O.dtype.element_ty),
        mask=(t < T)[:, None] & (d < HD)[None, :],
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H100_SMS


def split_count(programs: int, max_keys: int, sms: int = H100_SMS) -> int:
    """Key ranges a row block's keys are cut into: 1 when ``programs`` (requests x KV heads x row blocks) fill the
    ``sms`` SMs or the table holds fewer than ``2 * SPLIT_MIN_KEYS`` keys (``max_keys``: the table's width times
    the block size, a static bound on any request's keys); else enough ranges for about one program an SM, each
    of at least SPLIT_MIN_KEYS keys of a full table, at most MAX_SPLITS."""
    if programs >= sms or max_keys < 2 * SPLIT_MIN_KEYS:
        return 1
    return max(1, min(-(-sms // programs), max_keys // SPLIT_MIN_KEYS, MAX_SPLITS))


def tile_config(hd: int, dtype: torch.dtype, block_m: int) -> dict:
    """Key tile size, warps and pipeline stages for a head size, dtype and row block, chosen so that ptxas reports
    no spills on sm_90 at any head size the families use (tests/unit/test_triton_sm90.py compiles them all):
    float32's IEEE dot runs on FMA units with its operands in registers, so it takes 16-key tiles (and 16-row
    blocks: :func:`paged_attention`); head size 256 takes 32-key tiles; a 64-row block runs on 8 warps above head
    size 64."""
    if dtype == torch.float32:
        block_n, stages = 16, 2
    elif hd > 128:
        block_n, stages = 32, 2
    else:
        block_n, stages = 64, 3
    warps = 8 if block_m >= 64 and (hd > 64 or dtype == torch.float32) else 4
    return dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    starts: torch.Tensor,
    n_new: torch.Tensor,
    tokens_per_request: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [B * T, Hq, hd] (rows as in the module doc) over ``k_cache`` / ``v_cache``
    [blocks, block_size, Hkv, hd] through ``table`` [B, max_blocks] int32; request b's queries are at
    positions ``starts[b] + t`` for ``t < n_new[b]`` and see keys up to their own. -> [B * T, Hq, hd].
    ``splits``: key ranges a row block is cut into (None: :func:`split_count`'s choice; 1: no split-KV)."""
    rows, hq, hd = q.shape
    bsz, width = table.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    groups = hq // hkv
    out = torch.empty(rows, hq, hd, dtype=q.dtype, device=q.device)
    # rows a program: 16 for decode and short verifications, 64 for prefills; float32 (the tests' dtype) 16
    # always, as its FMA dot spills at 64 rows of head size 128 and above
    block_m = 16 if tokens_per_request * groups <= 16 or q.dtype == torch.float32 else 64
    block_d = max(16, _pow2(hd))
    row_blocks = triton.cdiv(tokens_per_request * groups, block_m)
    if splits is None:
        splits = split_count(bsz * hkv * row_blocks, width * bs, _sm_count(q.device))
    common = dict(
        G=groups,
        HD=hd,
        BLOCK_D=block_d,
        BS=bs,
        BLOCK_M=block_m,
        SOFTCAP=softcap is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no TF32 rounding (tests compare)
        PIPELINE=not knobs.runtime.interpret,
        **tile_config(hd, q.dtype, block_m),
    )
    strides = (
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        table.stride(0),
    )
    win = NO_WINDOW if window is None else window
    if splits == 1:
        _paged_attention_kernel[(bsz, hkv, row_blocks)](
            q,
            k_cache,
            v_cache,
            out,
            table,
            starts,
            n_new,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            *strides,
            tokens_per_request,
            scale,
            softcap or 0.0,
            win,
            **common,
        )
        return out
    programs = bsz * hkv * row_blocks * splits
    stats = torch.empty(programs, 2, block_m, dtype=torch.float32, device=q.device)  # running (max, sum) a range
    acc = torch.empty(programs, block_m, block_d, dtype=torch.float32, device=q.device)  # unnormalised outputs
    _paged_attention_split_kernel[(bsz, hkv, row_blocks * splits)](
        q,
        k_cache,
        v_cache,
        stats,
        acc,
        table,
        starts,
        n_new,
        q.stride(0),
        q.stride(1),
        *strides,
        tokens_per_request,
        scale,
        softcap or 0.0,
        win,
        splits,
        **common,
    )
    _split_reduce_kernel[(bsz, hkv, row_blocks)](
        stats,
        acc,
        out,
        out.stride(0),
        out.stride(1),
        tokens_per_request,
        splits,
        G=groups,
        HD=hd,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        num_warps=8 if block_m * block_d > 4096 else 4,
    )
    return out
