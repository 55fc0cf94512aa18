"""The CPU block kernels (``specdist/models/block_kernels.c``): GGUF Q4 / Q8 blocks against an exact reference.

The reference quantizes ``x`` as the kernel does (per block of 32, step ``max |x| / 127``, round half
to even) and multiplies in float64: the kernel's integer block sums are exact, so the only
difference left is float32 accumulation (``2**-20`` of ``|x^| @ |W|.T`` bounds it). Shapes cover
one and several tiles of 4 rows of ``x``, weights below and above the threshold where OpenMP threads
start, and output counts that are not multiples of anything.
"""

from __future__ import annotations

import pytest
import torch

from specdist.models import block_kernels

pytestmark = pytest.mark.skipif(not block_kernels.available(), reason="block kernels need x86 AVX2 and a C compiler")

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
    n, k = codes.shape
    return (codes.double().reshape(n, k // GROUP, GROUP) * scales[..., None].double()).reshape(n, k)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    xq = _quantized_x(x).double()
    ref = xq @ w.T
    bound = 2**-20 * (xq.abs() @ w.abs().T) + 1e-30
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert float(((y.double() - ref).abs() / bound).max()) <= 1.0


SHAPES = [(1, 16, 64), (3, 40, 96), (4, 48, 576), (5, 200, 576), (9, 1536, 576), (2, 120, 1536)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_q4_blocks_equal_the_quantized_product(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    codes = torch.randint(0, 256, (n, k // GROUP, 16), dtype=torch.uint8, generator=g)
    scales = torch.randn(n, 2, k // GROUP, generator=g) * 0.02
    y = block_kernels.q4_mm(x, codes, scales)
    _check(y, x, _q4_weight(codes, scales))
    # each row alone gives the same bits as in the batch
    assert torch.equal(torch.cat([block_kernels.q4_mm(x[i : i + 1], codes, scales) for i in range(m)]), y)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_q8_blocks_equal_the_quantized_product(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + 7)
    x = torch.randn(m, k, generator=g)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // GROUP, generator=g) * 0.01
    y = block_kernels.q8_mm(x, codes, scales)
    _check(y, x, _q8_weight(codes, scales))
    assert torch.equal(torch.cat([block_kernels.q8_mm(x[i : i + 1], codes, scales) for i in range(m)]), y)


def test_extreme_inputs():
    """Zero blocks, a block of equal elements (every byte 127), codes at the ends of their range, and the largest
    byte sums (no 16-bit saturation inside the multiply-add)."""
    k, n = 64, 16
    x = torch.zeros(3, k)
    x[1, :32] = 1.0  # every element at the block maximum: q = 127
    x[2] = torch.linspace(-3, 3, k)
    codes4 = torch.full((n, k // GROUP, 16), 0xFF, dtype=torch.uint8)  # every code 15
    scales4 = torch.ones(n, 2, k // GROUP)
    y4 = block_kernels.q4_mm(x, codes4, scales4)
    assert torch.equal(y4[0], torch.zeros(n))
    _check(y4, x, _q4_weight(codes4, scales4))
    codes8 = torch.full((n, k), -127, dtype=torch.int8)
    codes8[::2] = 127
    scales8 = torch.ones(n, k // GROUP)
    y8 = block_kernels.q8_mm(x, codes8, scales8)
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
    y = block_kernels.q4_mm(x, codes, scales)
    assert y[:2].isnan().all() and y[2].isfinite().all()
    assert torch.equal(y[2], block_kernels.q4_mm(x[2:], codes, scales)[0])
    y8 = block_kernels.q8_mm(x, torch.ones(n, k, dtype=torch.int8), torch.ones(n, k // GROUP))
    assert y8[:2].isnan().all() and y8[2].isfinite().all()


def test_under_torch_compile_the_kernels_are_opaque_ops():
    """Traced by dynamo (aot_eager: the graph without inductor's code generation), the matmuls are the
    custom ops ``specdist::q4_mm`` / ``q8_mm`` and give the eager bits."""
    k, n = 96, 48
    x = torch.randn(5, k)
    c4 = torch.randint(0, 256, (n, k // GROUP, 16), dtype=torch.uint8)
    s4 = torch.randn(n, 2, k // GROUP)
    c8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n, k // GROUP)

    def f(x):
        return block_kernels.q4_mm(x, c4, s4) + block_kernels.q8_mm(torch.relu(x), c8, s8)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))


def test_the_library_builds_into_its_cache(tmp_path, monkeypatch):
    """One shared object per source and flags, built once; a compiler that fails is reported, not raised past
    :func:`block_kernels.library` (callers fall back to torch's int4 kernel)."""
    monkeypatch.setenv("SPECDIST_KERNEL_CACHE", str(tmp_path))
    path = block_kernels._build()
    assert path.startswith(str(tmp_path)) and path.endswith(".so")
    mtime = (tmp_path / path.split("/")[-1]).stat().st_mtime_ns
    assert block_kernels._build() == path and (tmp_path / path.split("/")[-1]).stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.split("/")[-1]]  # no temporary file left
    monkeypatch.setenv("CC", "false")
    with pytest.raises(OSError, match="false failed"):
        block_kernels._build()
    assert [p.name for p in tmp_path.iterdir()] == [path.split("/")[-1]]
