"""Triton kernels of a decoder layer's elementwise work on the paged CUDA path (:meth:`specdist.models.runner.
CausalLMRunner._layers`): each replaces several torch kernels by one launch, which matters where a decode step is
bound by the number of kernels a layer launches rather than by the bytes it reads (docs/performance.md, GPU).

- :func:`add_rms_norm`: the residual add of a block's output and the next RMS norm (Llama-style: ``w * x /
  rms(x)``; Gemma's ``(1 + w) * x / rms(x)``, its block output normed before the add), in one pass that writes
  the new residual stream and the normed rows; without a block output, the norm alone. Replaces torch's add
  and its fused RMS norm (two kernels; Gemma's norm modules run about ten each).
- :func:`silu_mul`: ``silu(gate) * up`` of a fused gate/up projection's output ``[N, 2F]`` (gate first), one
  kernel where torch launches two.

Rows are the step's ``N = B * T`` token rows; the grids depend on ``N`` but no argument does (strides and sizes
are the model's), so every CUDA-graph bucket shares one compile key per kernel, dtype and width. Arithmetic is
float32 with one rounding to the output dtype; the residual sum is rounded to its dtype first, as torch's add
rounds it, and the norm reads the rounded sum (what the next layer's residual holds). Plain Triton: they run
under ``TRITON_INTERPRET=1`` on a CPU (float16 / float32), how the CPU tests check them against float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024  # elements of one row a silu_mul program takes


@triton.jit
def _add_rms_norm_kernel(
    H,
    A,
    W,
    WA,
    Y,
    H_OUT,
    s_h,
    s_a,
    s_y,
    s_o,
    eps,
    eps_a,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    NORM_DELTA: tl.constexpr,
    OFFSET: tl.constexpr,
):
    """Program r: row r. ``H_OUT = H + A`` (when HAS_DELTA; A normed by WA first when NORM_DELTA) and
    ``Y = (W + OFFSET) * s / sqrt(mean(s^2) + eps)`` of the sum ``s`` (else of ``H``)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(H + row * s_h + d, mask=m, other=0.0).to(tl.float32)  # [BLOCK_D]
    if HAS_DELTA:
        a = tl.load(A + row * s_a + d, mask=m, other=0.0).to(tl.float32)
        if NORM_DELTA:  # Gemma's post-block norm, rounded to the dtype as its module returns it
            inv_a = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(a * a, 0) / D + eps_a))
            wa = tl.load(WA + d, mask=m, other=0.0).to(tl.float32) + OFFSET
            a = (a * inv_a * wa).to(H_OUT.dtype.element_ty).to(tl.float32)
        x = (x + a).to(H_OUT.dtype.element_ty)  # the residual stream in its own dtype, as torch's add leaves it
        tl.store(H_OUT + row * s_o + d, x, mask=m)
        x = x.to(tl.float32)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, 0) / D + eps))  # IEEE-rounded: no approximate rsqrt
    w = tl.load(W + d, mask=m, other=0.0).to(tl.float32) + OFFSET
    tl.store(Y + row * s_y + d, (x * inv * w).to(Y.dtype.element_ty), mask=m)


def add_rms_norm(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    delta_norm: tuple[torch.Tensor, float] | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s) * (weight + offset))`` of ``s = h + delta`` (``h``, ``delta`` [..., D], rows with a
    contiguous last dimension); ``delta`` None: ``s = h``. ``delta_norm``: ``(weight, eps)`` of a norm applied to
    ``delta`` before the add (Gemma's post-attention and post-feedforward norms; the same ``offset``, its output
    rounded to the dtype). ``offset`` 1: Gemma's ``1 + w`` norms, else 0 (Llama's). Both outputs in ``h``'s dtype;
    ``h`` is left alone (a caller may keep it: EAGLE-3's taps)."""
    dim = h.shape[-1]
    x = h.reshape(-1, dim)  # [N, D]
    y = torch.empty_like(x)
    out = torch.empty_like(x) if delta is not None else x
    a = delta.reshape(-1, dim) if delta is not None else x
    wa, eps_a = delta_norm if delta_norm is not None else (weight, eps)
    block = triton.next_power_of_2(dim)
    _add_rms_norm_kernel[(x.shape[0],)](
        x,
        a,
        weight,
        wa,
        y,
        out,
        x.stride(0),
        a.stride(0),
        y.stride(0),
        out.stride(0),
        eps,
        eps_a,
        D=dim,
        BLOCK_D=block,
        HAS_DELTA=delta is not None,
        NORM_DELTA=delta_norm is not None,
        OFFSET=float(offset),
        num_warps=min(16, max(4, block // 512)),
    )
    return out.view(h.shape), y.view(h.shape)


@triton.jit
def _silu_mul_kernel(GU, OUT, s_gu, s_o, F, BLOCK: tl.constexpr):
    """Program (r, c): columns ``c * BLOCK ...`` of row r: ``OUT = silu(GU[:F]) * GU[F:]``."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < F
    g = tl.load(GU + row * s_gu + j, mask=m, other=0.0).to(tl.float32)  # [BLOCK]
    u = tl.load(GU + row * s_gu + F + j, mask=m, other=0.0).to(tl.float32)
    y = tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u
    tl.store(OUT + row * s_o + j, y.to(OUT.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [..., 2F] (gate the first F columns, up the last; a contiguous last
    dimension) -> [..., F] in its dtype."""
    two_f = gate_up.shape[-1]
    x = gate_up.reshape(-1, two_f)  # [N, 2F]
    f = two_f // 2
    out = torch.empty(x.shape[0], f, dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(x.shape[0], triton.cdiv(f, SILU_BLOCK))](
        x, out, x.stride(0), out.stride(0), f, BLOCK=SILU_BLOCK, num_warps=4
    )
    return out.view(*gate_up.shape[:-1], f)
