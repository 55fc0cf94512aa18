"""The CPU block kernels (``specdist/models/kernels/cpu_kernels.c``): GGUF Q4 / Q8 blocks against an exact reference.

The reference quantizes ``x`` as the kernel does (per block of 32, step ``max |x| / 127``, round half
to even) and multiplies in float64: the kernel's integer block sums are exact, so the only
difference left is float32 accumulation (``2**-20`` of ``|x^| @ |W|.T`` bounds it). Shapes cover
one and several tiles of rows of ``x``, weights below and above the threshold where OpenMP threads
start, and output counts that are not multiples of anything (the packed groups of 8 rows padded).
"""

from __future__ import annotations

import pytest
import torch

from specdist.models.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="block kernels need x86 AVX2 and a C compiler")

GROUP = 32


def _quantized_x(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: per block of 32, ``round(x * 127 / amax) * amax / 127`` in float32."""
    m, k = x.shape
    xb = x.reshape(m, k // GROUP, GROUP)
    amax = xb.abs().amax(-1, keepdim=True)  # [m, G, 1]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(m, k)


def _q4_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, g, _ = codes.shape
    c = torch.cat([codes & 15, codes >> 4], -1).double()  # [N, G, 32]: low nibbles first
    return (c * scales[:, 0, :, None].double() + scales[:, 1, :, None].double()).reshape(n, g * GROUP)


def _q8_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` times ``scales [N, K / s]``: a scale per ``s`` elements (32: Q8_0, 16: Q6_K)."""
    n, k = codes.shape
    s = k // scales.shape[1]
    return (codes.double().reshape(n, k // s, s) * scales[..., None].double()).reshape(n, k)


def q4(x, codes, scales):
    """The kernel on GGUF's Q4 layout (codes [N, G, 16], scales [N, 2, G]), packed as a model load packs it."""
    return cpu_kernels.block_mm(x, *cpu_kernels.pack_q4(codes, scales), codes.shape[0], cpu_kernels.LIN_Q4)


def q8(x, codes, scales):
    """The Q8 kernel: signed byte codes with a scale per block (Q8_0)."""
    return cpu_kernels.block_mm(x, *cpu_kernels.pack_q8(codes, scales), codes.shape[0], cpu_kernels.LIN_Q8)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    xq = _quantized_x(x).double()
    ref = xq @ w.T
    bound = 2**-20 * (xq.abs() @ w.abs().T) + 1e-30
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert float(((y.double() - ref).abs() / bound).max()) <= 1.0


# row counts 1-9, 13 and 15: every tile size up to the largest kind's (7 rows) alone, and calls split into tiles that
# differ by one row (9: 5 + 4 or 3 + 3 + 3; 13: 7 + 6 or 5 + 4 + 4; 15: 5 + 5 + 5 or 4 + 4 + 4 + 3)
SHAPES = [
    (1, 16, 64),
    (3, 40, 96),
    (3, 21, 64),
    (2, 13, 96),
    (4, 48, 576),
    (5, 200, 576),
    (6, 24, 64),
    (7, 40, 96),
    (8, 24, 576),
    (9, 1536, 576),
    (13, 40, 96),
    (15, 24, 64),
    (2, 120, 1536),
]


@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 41, 96), (4, 9, 13), (7, 200, 576), (17, 63, 1536), (32, 130, 576)])
def test_dense_float32_rows_equal_the_product_and_stand_alone(m, n, k):
    """f32_mm: x @ W.T within float32 rounding of a float64 product (K % 8 tails, W row counts not a multiple
    of the 4-row groups, x row counts not a multiple of the 3-row tiles), and each row the same bits alone
    as in the call: its sums run in an order fixed by K."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    y = cpu_kernels.f32_mm(x, w)
    want = (x.double() @ w.double().T).float()
    assert float((y - want).abs().max()) <= 1e-5 * k**0.5 * float(want.abs().max())
    assert torch.equal(torch.cat([cpu_kernels.f32_mm(x[i : i + 1], w) for i in range(m)]), y)
    assert torch.equal(cpu_kernels.f32_mm(x[: m // 2 + 1], w), y[: m // 2 + 1])
    assert cpu_kernels.f32_mm(x[:0], w).shape == (0, n)
    with pytest.raises(ValueError, match="does not take"):
        cpu_kernels.f32_mm(x, w[:, :-1].contiguous())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 41, 96), (4, 9, 13), (7, 200, 576), (17, 63, 1536)])
def test_dense_half_width_weights_give_the_float32_bits(dtype, m, n, k):
    """f32_mm on a bfloat16 or float16 weight: the bits of f32_mm on the same weight converted to float32 (each
    element converts exactly and the arithmetic is the same), including the K % 8 tails; a weight of another
    dtype is refused."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(dtype)
    assert torch.equal(cpu_kernels.f32_mm(x, w), cpu_kernels.f32_mm(x, w.float()))
    with pytest.raises(ValueError, match="not one of"):
        cpu_kernels.f32_mm(x, w.double())


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_q4_blocks_equal_the_quantized_product(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    codes = torch.randint(0, 256, (n, k // GROUP, 16), dtype=torch.uint8, generator=g)
    scales = torch.randn(n, 2, k // GROUP, generator=g) * 0.02
    y = q4(x, codes, scales)
    _check(y, x, _q4_weight(codes, scales))
    # each row alone gives the same bits as in the batch
    assert torch.equal(torch.cat([q4(x[i : i + 1], codes, scales) for i in range(m)]), y)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_q8_blocks_equal_the_quantized_product(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + 7)
    x = torch.randn(m, k, generator=g)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // GROUP, generator=g) * 0.01
    y = q8(x, codes, scales)
    _check(y, x, _q8_weight(codes, scales))
    assert torch.equal(torch.cat([q8(x[i : i + 1], codes, scales) for i in range(m)]), y)


# bits -> (packer, kind, code bytes a block of 8 rows, zero point) of the codes with a scale per 16 in 6 or 7 bits
WIDE_16 = {
    6: (cpu_kernels.pack_q6, cpu_kernels.LIN_Q6_16, 192, 32),
    7: (cpu_kernels.pack_q7, cpu_kernels.LIN_Q7_16, 256, 64),
}


@pytest.mark.parametrize("bits", sorted(WIDE_16))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_six_and_seven_bit_codes_with_a_scale_per_16_equal_the_quantized_product(m, n, k, bits):
    """6-bit codes c = q in 0..63 (GGUF Q6_K, IQ1_M: w = d_h (c - 32); LIN_Q6_16, a nibble and 2 high bits each) and
    7-bit codes c = q + 64 in 0..127 (IQ2_XS, IQ2_S: w = d_h (c - 64); LIN_Q7_16, a byte each), a scale per 16: each
    half's exact byte sum (widened before it could overflow 16 bits: the largest codes against bytes of +-127 below)
    times its scale, minus the zero point's scales times the x half's sum; rows stand alone as in the batch; the
    packing holds every code's bits where the kernel reads them; scales or codes of another kind are refused."""
    pack, kind, code_bytes, mid = WIDE_16[bits]
    g = torch.Generator().manual_seed(m * 1000 + n + 16 + bits)
    x = torch.randn(m, k, generator=g)
    x[0, :GROUP] = 1.0  # a block of bytes at 127
    c = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    c[0] = (1 << bits) - 1
    scales = (torch.rand(n, k // 16, generator=g) - 0.5) * 0.02  # Q6_K's int8 scales may be negative
    codes = pack(c.reshape(n, k // GROUP, GROUP))
    assert codes.shape == (-(-n // 8), k // GROUP, code_bytes)
    packed_scales = cpu_kernels.pack_scale_vectors(scales.reshape(n, k // GROUP, 2))

    def run(rows, cc=codes):
        return cpu_kernels.block_mm(rows, cc, packed_scales, n, kind)

    y = run(x)
    _check(y, x, _q8_weight(c.to(torch.int16) - mid, scales))
    assert torch.equal(torch.cat([run(x[i : i + 1]) for i in range(m)]), y)
    # one bit of one code set among codes 0: each bit reaches only its own weight
    for bit in range(bits):
        one = torch.zeros(n, k, dtype=torch.uint8)
        row, col = n // 2, k - 7
        one[row, col] = 1 << bit
        _check(run(x, pack(one.reshape(n, k // GROUP, GROUP))), x, _q8_weight(one.to(torch.int16) - mid, scales))
    with pytest.raises(ValueError, match="not those of kind"):  # one scale a block is another kind's layout
        cpu_kernels.block_mm(x, codes, cpu_kernels.pack_scale_vectors(scales[:, ::2, None]), n, kind)
    with pytest.raises(ValueError, match="do not hold"):  # these codes under a kind of another width
        cpu_kernels.block_mm(x, codes, packed_scales, n, cpu_kernels.LIN_Q4_16)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_five_bit_codes_with_an_offset_equal_the_quantized_product(m, n, k):
    """5-bit codes with a scale and an offset per block (GGUF Q5_1 / Q5_K: w = d q + m, q in 0..31; Q5_0 with
    m = -16 d; LIN_Q5, a nibble and a high bit each): the block's exact byte sum (each half's 16-bit sums widened apart:
    codes at 31 against bytes of 127 below) times d plus m times the x block's sum, as Q4_1 computes it; rows stand
    alone as in the batch; the packing holds each of a code's bits where the kernel reads it."""
    g = torch.Generator().manual_seed(m * 1000 + n + 5)
    x = torch.randn(m, k, generator=g)
    x[0, :GROUP] = 1.0  # a block of bytes at 127
    codes = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g)
    codes[0] = 31
    scales = torch.rand(n, k // GROUP, generator=g) * 0.01
    mins = -torch.rand(n, k // GROUP, generator=g) * 0.16
    packed_scales = cpu_kernels.pack_scale_vectors(torch.stack([scales, mins], -1))

    def run(rows, c=codes):
        packed = cpu_kernels.pack_q5(c.reshape(n, k // GROUP, GROUP))
        assert packed.shape == (-(-n // 8), k // GROUP, 160)
        return cpu_kernels.block_mm(rows, packed, packed_scales, n, cpu_kernels.LIN_Q5)

    y = run(x)
    _check(y, x, _q8_weight(codes.to(torch.int16), scales) + mins.double().repeat_interleave(GROUP, 1))
    assert torch.equal(torch.cat([run(x[i : i + 1]) for i in range(m)]), y)
    for bit in range(5):  # one bit of one code set among codes 0
        one = torch.zeros(n, k, dtype=torch.uint8)
        one[n // 2, k - 7] = 1 << bit
        _check(run(x, one), x, _q8_weight(one.to(torch.int16), scales) + mins.double().repeat_interleave(GROUP, 1))


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_nibbles_with_a_scale_per_16_equal_the_quantized_product(m, n, k):
    """Q4 codes c = q + 8 with a scale per 16 (GGUF Q3_K's codes, -4..3, as nibbles: LIN_Q4_16): each half's exact
    byte sum times its scale minus 8 scales times the x half's sum; rows stand alone as in the batch; a Q4 kind
    that is not one is refused."""
    g = torch.Generator().manual_seed(m * 1000 + n + 316)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 16, generator=g) - 0.5) * 0.02
    c = (q + 8).to(torch.uint8).reshape(n, k // GROUP, GROUP)
    codes, _ = cpu_kernels.pack_q4(c[..., :16] | c[..., 16:] << 4, torch.zeros(n, 2, k // GROUP))
    packed_scales = cpu_kernels.pack_scale_vectors(scales.reshape(n, k // GROUP, 2))

    def run(rows):
        return cpu_kernels.block_mm(rows, codes, packed_scales, n, cpu_kernels.LIN_Q4_16)

    y = run(x)
    _check(y, x, _q8_weight(q, scales))
    assert torch.equal(torch.cat([run(x[i : i + 1]) for i in range(m)]), y)
    with pytest.raises(ValueError, match="do not hold"):  # Q4 codes under the 6-bit kind
        cpu_kernels.block_mm(x, codes, packed_scales, n, cpu_kernels.LIN_Q6_16)
    with pytest.raises(ValueError, match="not a block kind"):
        cpu_kernels.block_mm(x, codes, packed_scales, n, cpu_kernels.LIN_F32)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_two_bit_codes_with_a_scale_and_an_offset_per_16_equal_the_quantized_product(m, n, k):
    """2-bit codes with a scale and an offset per 16 (GGUF Q2_K: w = d_h q + m_h, q in 0..3; LIN_Q2M_16): each half's
    exact byte sum times its scale plus its offset times the x half's sum; rows stand alone as in the batch; the
    packing holds every code where the kernel reads it (one code set at a time)."""
    g = torch.Generator().manual_seed(m * 1000 + n + 216)
    x = torch.randn(m, k, generator=g)
    q = torch.randint(0, 4, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // 16, generator=g) * 0.02
    mins = -torch.rand(n, k // 16, generator=g) * 0.1
    codes = cpu_kernels.pack_q2(q.reshape(n, k // GROUP, GROUP))
    assert codes.shape == (-(-n // 8), k // GROUP, 64)
    per_block = torch.cat([scales.reshape(n, -1, 2), mins.reshape(n, -1, 2)], -1)  # [n, G, 4]: d_0, d_1, m_0, m_1
    packed_scales = cpu_kernels.pack_scale_vectors(per_block)
    assert packed_scales.shape == (-(-n // 8), k // GROUP, 32)

    def run(rows, c=codes):
        return cpu_kernels.block_mm(rows, c, packed_scales, n, cpu_kernels.LIN_Q2M_16)

    y = run(x)
    _check(y, x, _q8_weight(q.to(torch.int16), scales) + mins.double().repeat_interleave(16, 1))
    assert torch.equal(torch.cat([run(x[i : i + 1]) for i in range(m)]), y)
    # one code of one row set (3) among zeros: only that weight's column of x times its scale reaches that output
    one = torch.zeros(n, k, dtype=torch.uint8)
    row, col = n // 2, k - 7
    one[row, col] = 3
    y1 = run(x, cpu_kernels.pack_q2(one.reshape(n, k // GROUP, GROUP)))
    w1 = mins.double().repeat_interleave(16, 1)
    w1[row, col] += 3 * float(scales[row, col // 16])
    _check(y1, x, w1)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_iq4_indices_equal_the_quantized_product(m, n, k):
    """4-bit indices into GGUF's IQ4 table of signed bytes with a scale per block (IQ4_NL, IQ4_XS: LIN_IQ4, pack_q4's
    nibble layout): the bits the Q8 kernel gives on the looked-up bytes (the same exact byte sums), rows standing alone
    as in the batch; the table's extremes (-127 against inputs of +-127) do not saturate the 16-bit pair sums."""
    g = torch.Generator().manual_seed(m * 1000 + n + 44)
    x = torch.randn(m, k, generator=g)
    x[0, :GROUP] = torch.where(torch.arange(GROUP) % 3 == 0, -1.0, 1.0)  # a block of +-127 bytes
    idx = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    idx[0] = 0  # the table's -127 throughout a row
    scales = (torch.rand(n, k // GROUP, generator=g) - 0.5) * 0.02  # IQ4_XS's d (ls - 32) may be negative
    values = torch.tensor(cpu_kernels.IQ4_VALUES, dtype=torch.int8)[idx.long()]  # [n, k]
    c = idx.reshape(n, k // GROUP, GROUP)
    codes, _ = cpu_kernels.pack_q4(c[..., :16] | c[..., 16:] << 4, torch.zeros(n, 2, k // GROUP))
    packed_scales = cpu_kernels.pack_scale_vectors(scales[..., None])

    def run(rows):
        return cpu_kernels.block_mm(rows, codes, packed_scales, n, cpu_kernels.LIN_IQ4)

    y = run(x)
    _check(y, x, _q8_weight(values, scales))
    assert torch.equal(y, q8(x, values, scales))
    assert torch.equal(torch.cat([run(x[i : i + 1]) for i in range(m)]), y)


KINDS = {
    "q4": cpu_kernels.LIN_Q4,
    "q8": cpu_kernels.LIN_Q8,
    "q6_16": cpu_kernels.LIN_Q6_16,
    "q5": cpu_kernels.LIN_Q5,
    "q7_16": cpu_kernels.LIN_Q7_16,
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (3, 21, 64), (5, 200, 576), (9, 40, 1536)])
def test_float16_scales_give_the_float32_bits(kind, m, n, k):
    """Scales that are all float16 values (GGUF's legacy blocks) pack as float16, half the bytes, and every kind's
    kernel gives the bits it gives on the same scales in float32; one scale off the float16 grid keeps the weight's
    scales in float32; scales of another dtype are refused."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    per_block = 2 if kind in ("q6_16", "q7_16") else 1
    scales = (torch.rand(n, per_block * (k // GROUP), generator=g) * 0.02).half().float()
    mins = (-torch.rand(n, k // GROUP, generator=g) * 0.16).half().float()
    if kind == "q4":
        codes = torch.randint(0, 256, (n, k // GROUP, 16), dtype=torch.uint8, generator=g)
        packed, sc = cpu_kernels.pack_q4(codes, torch.stack([scales, -8 * scales], 1))

        def run(s):
            return cpu_kernels.block_mm(x, packed, s, n, KINDS[kind])
    elif kind == "q5":
        codes = torch.randint(0, 32, (n, k // GROUP, GROUP), dtype=torch.uint8, generator=g)
        packed, sc = cpu_kernels.pack_q5(codes), cpu_kernels.pack_scale_vectors(torch.stack([scales, mins], -1))

        def run(s):
            return cpu_kernels.block_mm(x, packed, s, n, KINDS[kind])
    elif kind in ("q6_16", "q7_16"):
        pack, _, _, mid = WIDE_16[6 if kind == "q6_16" else 7]
        codes = torch.randint(0, 2 * mid, (n, k // GROUP, GROUP), dtype=torch.uint8, generator=g)
        packed, sc = pack(codes), cpu_kernels.pack_scale_vectors(scales.reshape(n, k // GROUP, 2))

        def run(s):
            return cpu_kernels.block_mm(x, packed, s, n, KINDS[kind])
    else:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        packed, sc = cpu_kernels.pack_q8(codes, scales)

        def run(s):
            return cpu_kernels.block_mm(x, packed, s, n, KINDS[kind])

    assert sc.dtype == torch.float16 and sc.is_contiguous()
    assert torch.equal(run(sc), run(sc.float()))
    with pytest.raises(ValueError, match="scales must be contiguous"):
        run(sc.double())
    off_grid = scales.clone()
    off_grid[-1, -1] *= 1 + 2**-20  # no float16 holds it (11 significant bits)
    if kind == "q4":
        assert cpu_kernels.pack_q4(codes, torch.stack([off_grid, -8 * off_grid], 1))[1].dtype == torch.float32
    elif kind in ("q6_16", "q7_16"):
        assert cpu_kernels.pack_scale_vectors(off_grid.reshape(n, k // GROUP, 2)).dtype == torch.float32
    elif kind == "q5":
        assert cpu_kernels.pack_scale_vectors(torch.stack([off_grid, mins], -1)).dtype == torch.float32
    else:
        assert cpu_kernels.pack_q8(codes, off_grid)[1].dtype == torch.float32


def test_extreme_inputs():
    """Zero blocks, a block of equal elements (every byte 127), codes at the ends of their range, and the largest
    byte sums (no 16-bit saturation inside the multiply-add)."""
    k, n = 64, 16
    x = torch.zeros(3, k)
    x[1, :32] = 1.0  # every element at the block maximum: q = 127
    x[2] = torch.linspace(-3, 3, k)
    codes4 = torch.full((n, k // GROUP, 16), 0xFF, dtype=torch.uint8)  # every code 15
    scales4 = torch.ones(n, 2, k // GROUP)
    y4 = q4(x, codes4, scales4)
    assert torch.equal(y4[0], torch.zeros(n))
    _check(y4, x, _q4_weight(codes4, scales4))
    codes8 = torch.full((n, k), -127, dtype=torch.int8)
    codes8[::2] = 127
    scales8 = torch.ones(n, k // GROUP)
    y8 = q8(x, codes8, scales8)
    assert float(y8[1, 0]) == 127 * 32 / 127 * 127  # x^ = 1 exactly, 32 codes of 127
    _check(y8, x, _q8_weight(codes8, scales8))


def test_non_finite_inputs_reach_the_output():
    """A NaN or infinity in a row's input makes that row's outputs NaN (the engine's NaN check sees it);
    other rows are untouched."""
    k, n = 64, 32
    x = torch.randn(3, k)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    codes = torch.randint(0, 256, (n, k // GROUP, 16), dtype=torch.uint8)
    scales = torch.randn(n, 2, k // GROUP)
    y = q4(x, codes, scales)
    assert y[:2].isnan().all() and y[2].isfinite().all()
    assert torch.equal(y[2], q4(x[2:], codes, scales)[0])
    y8 = q8(x, torch.ones(n, k, dtype=torch.int8), torch.ones(n, k // GROUP))
    assert y8[:2].isnan().all() and y8[2].isfinite().all()


def test_under_torch_compile_the_kernels_are_opaque_ops():
    """Traced by dynamo (aot_eager: the graph without inductor's code generation), the matmuls are the
    custom op ``specdist::block_mm`` and give the eager bits."""
    k, n = 96, 48
    x = torch.randn(5, k)
    c4 = torch.randint(0, 256, (n, k // GROUP, 16), dtype=torch.uint8)
    s4 = torch.randn(n, 2, k // GROUP)
    c8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n, k // GROUP)
    p4, p8 = cpu_kernels.pack_q4(c4, s4), cpu_kernels.pack_q8(c8, s8)

    def f(x):
        return cpu_kernels.block_mm(x, *p4, n, cpu_kernels.LIN_Q4) + cpu_kernels.block_mm(
            torch.relu(x), *p8, n, cpu_kernels.LIN_Q8
        )

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))


# ----------------------------------------------------------------------------- attention
def _reference_attention(q, kc, vc, slots, qpos, window, scale, cap):
    """Float64 softmax attention of each query over keys max(0, p - window + 1) .. p of its slot."""
    bsz, hq, t, hd = q.shape
    group = hq // kc.shape[1]
    out = torch.zeros(bsz, hq, t, hd, dtype=torch.float64)
    for b in range(bsz):
        for i in range(t):
            p = int(qpos[b, i])
            lo = max(0, p - window + 1) if window else 0
            for h in range(hq):
                keys = kc[slots[b], h // group, lo : p + 1].double()  # [S', hd]
                s = keys @ q[b, h, i].double() * scale
                if cap:
                    s = cap * torch.tanh(s / cap)
                out[b, h, i] = torch.softmax(s, 0) @ vc[slots[b], h // group, lo : p + 1].double()
    return out


@pytest.mark.parametrize(
    "window,cap,hd,hq",
    [
        (None, None, 24, 6),
        (5, None, 24, 6),
        (None, 30.0, 24, 6),
        (None, None, 136, 6),
        (5, None, 20, 6),
        (None, None, 24, 10),
        (5, None, 40, 2),
    ],
)
def test_attention_equals_the_reference_and_rows_stand_alone(window, cap, hd, hq):
    """GQA (hq query heads over 2 KV heads: groups of 3, of 5 = 3 + 2 heads sharing each key load, and of 1),
    ragged positions over non-adjacent slots, a query tensor that is a transposed view (the runner's layout);
    each row equals the float64 reference to float32 rounding, equals itself computed with its request and
    query alone, and equals its head computed alone over a one-head cache. Head sizes: 24 (one slice of
    value columns, key chunks with partial ones), 136 (five slices, the last of one vector), 40 (two), 20
    (not a multiple of 8: the one-key-at-a-time row)."""
    g = torch.Generator().manual_seed(5)
    slots_n, hkv, length = 4, 2, 40
    group = hq // hkv
    kc = torch.randn(slots_n, hkv, length + 1, hd, generator=g)
    vc = torch.randn(slots_n, hkv, length + 1, hd, generator=g)
    q = torch.randn(3, 4, hq, hd, generator=g).transpose(1, 2)  # [B, Hq, T, hd] with T-major strides
    slots = torch.tensor([3, 0, 2])
    qpos = torch.tensor([[10, 11, 12, 13], [0, 1, 2, 3], [35, 36, 37, 38]])
    out = cpu_kernels.attention(q, kc, vc, slots, qpos, window, 0.3, cap)
    ref = _reference_attention(q, kc, vc, slots, qpos, window, 0.3, cap)
    assert out.shape == q.shape and float((out.double() - ref).abs().max()) < 1e-5
    for b in range(3):
        for i in range(4):
            alone = cpu_kernels.attention(
                q[b : b + 1, :, i : i + 1], kc, vc, slots[b : b + 1], qpos[b : b + 1, i : i + 1], window, 0.3, cap
            )
            assert torch.equal(alone[0, :, 0], out[b, :, i])
    for h in range(hq):
        kh, vh = (c[:, h // group : h // group + 1].contiguous() for c in (kc, vc))
        head = cpu_kernels.attention(q[:, h : h + 1], kh, vh, slots, qpos, window, 0.3, cap)
        assert torch.equal(head[:, 0], out[:, h])
    h = min(2, hq - 1)  # a NaN query reaches its own row only, not the heads that share its key loads
    q[1, h, 0, 0] = float("nan")
    bad = cpu_kernels.attention(q, kc, vc, slots, qpos, window, 0.3, cap)
    assert bad[1, h, 0].isnan().all()
    bad[1, h, 0] = out[1, h, 0]
    assert torch.equal(bad, out)


@pytest.mark.parametrize("window,cap,hd", [(None, None, 24), (5, 30.0, 136), (None, None, 20)])
def test_a_float16_cache_reads_as_the_float32_values_it_holds(window, cap, hd):
    """engine.kv_cache_dtype float16: every element converts exactly, so attention over a float16 cache gives the
    bits it gives over a float32 cache holding the same (rounded) values, in the vector rows (24, 136: partial
    chunks, two value slices) and the one-key-at-a-time row (20)."""
    g = torch.Generator().manual_seed(6)
    kc = torch.randn(3, 2, 41, hd, generator=g).half()
    vc = torch.randn(3, 2, 41, hd, generator=g).half()
    q = torch.randn(2, 6, 3, hd, generator=g)
    slots, qpos = torch.tensor([2, 0]), torch.tensor([[7, 8, 9], [30, 31, 40]])
    out = cpu_kernels.attention(q, kc, vc, slots, qpos, window, 0.3, cap)
    assert torch.equal(out, cpu_kernels.attention(q, kc.float(), vc.float(), slots, qpos, window, 0.3, cap))
    ref = _reference_attention(q, kc.float(), vc.float(), slots, qpos, window, 0.3, cap)
    assert float((out.double() - ref).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="float32 or float16"):
        cpu_kernels.attention(q, kc.bfloat16(), vc.bfloat16(), slots, qpos, window, 0.3, cap)


def test_rope_attention_rounds_what_it_writes_into_a_float16_cache():
    """The fused layer call stores each rotated key and each value rounded to nearest even, as torch's .half()
    does, and leaves every other cache row as it was."""
    g = torch.Generator().manual_seed(8)
    bsz, t, hq, hkv, hd, length = 2, 3, 6, 2, 16, 20
    q, k, v = (torch.randn(bsz, t, h, hd, generator=g) * 3 for h in (hq, hkv, hkv))
    ang = torch.randn(bsz, t, hd // 2, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    k16 = torch.randn(3, hkv, length + 1, hd, generator=g).half()
    v16 = torch.randn(3, hkv, length + 1, hd, generator=g).half()
    k32, v32 = k16.float(), v16.float()
    slots, write_pos = torch.tensor([2, 0]), torch.tensor([[5, 6, 7], [10, 11, length]])  # length: scratch
    query_pos = torch.tensor([[5, 6, 7], [10, 11, 11]])
    out16 = cpu_kernels.rope_attention(q, k, v, cos, sin, k16, v16, slots, write_pos, query_pos, None, 0.25)
    cpu_kernels.rope_attention(q, k, v, cos, sin, k32, v32, slots, write_pos, query_pos, None, 0.25)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
    assert out16.shape == (bsz, t, hq, hd) and out16.isfinite().all()


def test_the_kv_cache_dtype_choice():
    """auto: float16 where the kernels run attention for a model on blocks, the model's dtype elsewhere; model:
    the model's; float16 where the kernels do not run is a one-line ConfigError naming the key, and the config
    refuses other names."""
    from specdist.config import load_config
    from specdist.errors import ConfigError
    from specdist.models.runner import kv_dtype

    assert kv_dtype("auto", torch.float32, True, blocks=True) == torch.float16
    assert kv_dtype("auto", torch.float32, True, blocks=False) == torch.float32  # a float model: transformers' numerics
    assert kv_dtype("auto", torch.bfloat16, False) == torch.bfloat16
    assert kv_dtype("model", torch.float32, True, blocks=True) == torch.float32
    assert kv_dtype("float16", torch.float32, True) == torch.float16
    with pytest.raises(ConfigError, match="engine.kv_cache_dtype: float16 is read by the CPU attention kernels"):
        kv_dtype("float16", torch.bfloat16, False)
    with pytest.raises(ConfigError, match=r"engine.kv_cache_dtype: must be one of auto, model, float16, got 'fp8'"):
        load_config({"engine": {"kv_cache_dtype": "fp8"}})


@pytest.mark.slow
def test_a_float16_cache_keeps_the_default_model_close_to_its_float32_cache(smollm2_loaded):
    """The built-in model on its native blocks with engine.kv_cache_dtype model (float32) and auto (float16),
    teacher-forced over 37 tokens after a 60-token prefix: the same greedy token at >= 90% of positions (all 37
    when measured) and next-token distributions within total variation 0.1 (0.037 at most when measured: the
    float16 rounding moves byte-rounded activations by a code here and there). A wrong conversion would give
    unrelated distributions."""
    from specdist.models.runner import CausalLMRunner

    tokenizer, _, native = smollm2_loaded
    text = (
        "The river carried the spring snowmelt down from the mountains, past the mill and the old stone bridge, "
        "where children gathered each evening to watch the water rise. "
    ) * 3
    ids = tokenizer.encode(text)
    probs = []
    for choice in ("model", "auto"):
        runner = CausalLMRunner(native, 1, 128, fuse=False, kv_cache_dtype=choice)
        slot = runner.cache.allocate()
        runner.forward([slot], [ids[:60]], [0])
        probs.append(runner.forward([slot], [ids[60:]], [len(ids) - 60])[0].softmax(-1))  # [37, V]
    assert runner.cache.k[0].dtype == torch.float16
    f32, f16 = probs
    assert float((f32.argmax(-1) == f16.argmax(-1)).float().mean()) >= 0.9
    assert float(0.5 * (f32 - f16).abs().sum(-1).max()) < 0.1


def _block_model(family: str, **overrides):
    from support.model_zoo import build_tiny

    from specdist.models.fusion import quantized_copy
    from specdist.models.quant import Int4GroupLinear

    model = quantized_copy(build_tiny(family, seed=4, vocab_size=32, hidden_size=64, **overrides), Int4GroupLinear)
    assert all(type(m) is not torch.nn.Linear for m in model.modules()), "every linear runs on blocks"
    return model


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen3"]
)  # qwen2: q/k/v biases, sliding windows; qwen3: q/k norms
def test_a_block_model_forward_does_not_depend_on_the_call(family):
    """Every linear on blocks and attention from these kernels: a position's logits are the same bits when it is
    decoded alone, verified among 4 tokens, or computed beside other requests in one batch."""
    from specdist.models.runner import CausalLMRunner

    runner = CausalLMRunner(_block_model(family), 3, 80)
    assert runner.cpu_attention and runner.cache.k[0].dtype == torch.float16  # engine.kv_cache_dtype auto
    prompts = [list(range(1, 30)), [5, 6, 7], list(range(31, 11, -1))]
    new = [[3, 9, 4, 1], [2, 8, 8, 0], [7, 7, 1, 5]]
    slots = [runner.cache.allocate() for _ in prompts]
    runner.forward(slots, prompts, [1, 1, 1])  # one ragged batched prefill
    lengths = [len(p) for p in prompts]
    together = runner.forward(slots, new, [4, 4, 4])  # [3, 4, V]
    for b, s in enumerate(slots):
        runner.cache.rollback(s, lengths[b])
        one_by_one = torch.cat([runner.forward([s], [[tok]], [1])[0] for tok in new[b]])  # [4, V]
        assert torch.equal(one_by_one, together[b])
        # and the prompt prefilled alone gives the bits the batched prefill gave
        alone = CausalLMRunner(runner.model, 1, 80, fuse=False)
        a = alone.cache.allocate()
        alone.forward([a], [prompts[b]], [1])
        assert torch.equal(alone.forward([a], [new[b]], [4])[0], together[b])
        runner.cache.rollback(s, lengths[b])
    # a ragged verification (4, 1 and 2 tokens) runs one row per token: the same bits, zeros past each request
    ragged = runner.forward(slots, [new[0], new[1][:1], new[2][:2]], [4, 1, 2])  # [3, 4, V]
    for b, n in enumerate([4, 1, 2]):
        assert torch.equal(ragged[b, :n], together[b, :n]) and not ragged[b, n:].any()
    # packed: the same rows one request after another, from the ragged path and from the [B, T] one
    for calls, counts in (([new[0], new[1][:1], new[2][:2]], [4, 1, 2]), (new, [4, 1, 2]), (new, [4, 4, 4])):
        for s, n in zip(slots, lengths):
            runner.cache.rollback(s, n)
        packed = runner.forward(slots, calls, counts, packed=True)  # [sum(counts), V]
        want = torch.cat([together[b, len(calls[b]) - m : len(calls[b])] for b, m in enumerate(counts)])
        assert torch.equal(packed, want)
    for s, n in zip(slots, lengths):  # no logits asked (a prefill), ragged: none, in either layout
        runner.cache.rollback(s, n)
    assert runner.forward(slots, [new[0], new[1][:1], new[2][:2]], [0, 0, 0], packed=True).shape == (0, 32)


def _each_layer_both_ways(runner, seed: int):
    """Each layer of ``runner`` on a random input of 2 requests x 3 tokens, op by op and as one
    ``decoder_layer`` call (the next layer's input is the op-by-op output): ``[(op-by-op output, call output,
    (K, V) the op-by-op layer wrote, (K, V) the call wrote)]`` and ``(last input, slots, write_pos, cos, sin)``."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 3, runner.config.hidden_size, generator=g)
    slots = torch.tensor([runner.cache.allocate(), runner.cache.allocate()])
    write_pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    cos, sin = (tab[write_pos] for tab in runner.rope_tables[None])
    out = []
    for i in range(len(runner.layers)):
        want = _layer_op_by_op(runner, i, h, slots, write_pos, cos, sin)
        cache = runner.cache.k[i].clone(), runner.cache.v[i].clone()
        runner.cache.k[i].zero_(), runner.cache.v[i].zero_()
        got = cpu_kernels.decoder_layer(
            h.clone(),
            runner.layer_kernels[i],
            cos,
            sin,
            runner.cache.k[i],
            runner.cache.v[i],
            slots,
            write_pos,
            write_pos,
            None,
            runner.scaling,
        )
        out.append((want, got, cache, (runner.cache.k[i].clone(), runner.cache.v[i].clone())))
        h = want
    return out, (h, slots, write_pos, cos, sin)


def _layer_op_by_op(runner, i, h, slots, write_pos, cos, sin):
    """Layer i of a block model through the separate kernels and torch ops (the runner's path without
    cpu_kernels.decoder_layer)."""
    from specdist.models import runner as runner_mod

    layer, hd = runner.layers[i], runner.head_dim
    bsz, t, _ = h.shape
    x = runner_mod._rms_norm(layer.input_layernorm, h)
    q, k, v = runner_mod._qkv(layer.self_attn, x, None)
    q, k = q.reshape(bsz, t, -1, hd), k.reshape(bsz, t, -1, hd)
    if runner.qk_norm:  # Qwen3: each head's q and k normed before the rotation
        q, k = runner_mod._rms_norm(layer.self_attn.q_norm, q), runner_mod._rms_norm(layer.self_attn.k_norm, k)
    o = cpu_kernels.rope_attention(
        q,
        k,
        v.reshape(bsz, t, -1, hd),
        cos,
        sin,
        runner.cache.k[i],
        runner.cache.v[i],
        slots,
        write_pos,
        write_pos,
        None,
        runner.scaling,
    )
    h = h + layer.self_attn.o_proj(o.reshape(bsz, t, -1))
    return h + runner_mod._mlp(layer.mlp, runner_mod._rms_norm(layer.post_attention_layernorm, h))


# qwen2: q/k/v biases (the kernel adds them after the matmul); qwen3: per-head q/k RMS norms before the rotation
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_decoder_layer_on_blocks_is_one_kernel_call(family):
    """cpu_kernels.decoder_layer runs each layer of a Llama model on blocks: it writes the cache rows the op-by-op
    layer writes (the same kernels up to attention, biases added as torch adds them, q/k norms by the same row
    kernel: same bits), and its output
    differs from that layer's only by its own silu (e^-g from exp8, not torch's exp) moving a few activations'
    byte rounding. An EAGLE-3 tap of a layer's input is not touched by the in-place update. Gemma's sandwich
    norms run op by op."""
    from specdist.models.runner import CausalLMRunner

    runner = CausalLMRunner(_block_model(family), 2, 80)
    assert len(runner.layer_kernels) >= 2 and all(k is not None for k in runner.layer_kernels)
    # q/k/v fused (the k and v slots empty), o, gate/up, down
    assert [lin.n > 0 for k in runner.layer_kernels for lin in k.linears] == [1, 0, 0, 1, 1, 1] * len(runner.layers)
    biased = [lin.bias is not None for k in runner.layer_kernels for lin in k.linears]
    assert biased == [family == "qwen2", False, False, False, False, False] * len(runner.layers)
    assert all((k.qk_norms is not None) == (family == "qwen3") for k in runner.layer_kernels)
    layers, (h, slots, write_pos, cos, sin) = _each_layer_both_ways(runner, seed=9)
    for want, got, cache, written in layers:
        assert torch.equal(written[0], cache[0]) and torch.equal(written[1], cache[1])
        assert float((got - want).abs().max()) < 1e-3 * float(want.abs().max())
    if family != "llama":
        return
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.decoder_layer(
            h[..., :32].contiguous(),
            runner.layer_kernels[0],
            cos,
            sin,
            runner.cache.k[0],
            runner.cache.v[0],
            slots,
            write_pos,
            write_pos,
            None,
            runner.scaling,
        )
    n = len(runner.layers)
    runner.hidden_layers = (0, 1, n)  # taps: the embeddings, layer 1's input, the last layer's output
    ids = [[3, 9, 4], [2, 8, 8]]
    for s in slots.tolist():
        runner.cache.rollback(s, 0)
    logits = runner.forward(slots.tolist(), ids, [3, 3])
    embedded = runner.model.model.embed_tokens(torch.tensor(ids))
    d = runner.config.hidden_size
    assert torch.equal(runner.last_hidden[..., :d], embedded) and logits.isfinite().all()
    assert not torch.equal(runner.last_hidden[..., d : 2 * d], runner.last_hidden[..., 2 * d :])
    assert all(k is None for k in CausalLMRunner(_block_model("gemma2"), 1, 40).layer_kernels)


def test_a_float32_decoder_layer_is_one_kernel_call_for_a_few_rows():
    """A float32 Llama model's layers run as one call too (dense weights through f32_mm): the same cache bits as
    the op-by-op layer (its q/k/v through torch's GEMM, which rounds differently: the rows agree within float32
    rounding) and the same output; calls of more than F32_MAX_ROWS tokens run op by op, and the output head
    takes f32_mm up to that many rows, matching torch's product."""
    from support.model_zoo import build_tiny

    from specdist.models.runner import CausalLMRunner

    runner = CausalLMRunner(build_tiny("llama", seed=4, vocab_size=32, hidden_size=64).requires_grad_(False), 2, 120)
    assert all(k is not None and k.dense for k in runner.layer_kernels)
    layers, (_, slots, _, _, _) = _each_layer_both_ways(runner, seed=11)
    for want, got, cache, written in layers:
        for new, old in zip(written, cache):
            assert float((new - old).abs().max()) <= 1e-3 * float(old.abs().max())
        assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    g = torch.Generator().manual_seed(12)
    ids = [[3, 9, 4] * 12, [2, 8, 8] * 12]  # 72 tokens: more than F32_MAX_ROWS, so op by op
    assert 2 * len(ids[0]) > cpu_kernels.F32_MAX_ROWS
    for s in slots.tolist():
        runner.cache.rollback(s, 0)
    many = runner.forward(slots.tolist(), ids, [36, 36])
    for s in slots.tolist():
        runner.cache.rollback(s, 0)
    few = torch.cat(
        [runner.forward(slots.tolist(), [a[i : i + 18], b[i : i + 18]], [18, 18]) for a, b in [ids] for i in (0, 18)],
        dim=1,
    )  # two calls of 36 tokens: the layer kernels
    assert float((many - few).abs().max()) < 1e-4 * float(many.abs().max())
    head, hs = runner.model.lm_head, torch.randn(2, 5, runner.config.hidden_size, generator=g)
    from specdist.models.runner import _lm_head

    assert float((_lm_head(head, hs) - head(hs)).abs().max()) < 1e-5 * float(head(hs).abs().max())


def test_greedy_speculation_on_a_block_model_is_plain_decoding(tiny_models):
    """Invariant forwards make greedy speculative output token for token the plain greedy output, whatever
    the drafts (a suffix index, n-grams, and the float model the blocks came from, which agree to different
    extents)."""
    from support.model_zoo import build_tiny
    from test_dtypes import PROMPTS

    from specdist.config import load_config
    from specdist.engine.local import Engine
    from specdist.sampling_params import SamplingParams

    def cfg(method):
        draft = {"method": method, "num_speculative_tokens": 3, "length_policy": "fixed"}
        if method == "model":
            draft["model"] = tiny_models["draft"]  # the path is not loaded: the module below is the draft
        return load_config(
            {
                "target": {"model": tiny_models["target"]},
                "draft": draft,
                "engine": {"max_model_len": 96, "max_batch_size": 4, "device": "cpu"},
            }
        )

    target = _block_model("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[p % 32 for p in prompt] for prompt in PROMPTS]
    plain = [o.token_ids for o in Engine(cfg("none"), target).generate(prompts, greedy)]
    floats = build_tiny("llama", seed=4, vocab_size=32, hidden_size=64)
    for method in ("suffix", "ngram", "model"):
        eng = Engine(cfg(method), target, draft=floats if method == "model" else None)
        assert [o.token_ids for o in eng.generate(prompts, greedy)] == plain, method
        assert eng.stats.accepted > 0  # drafts were accepted, so the verified calls had several tokens
