"""The Triton kernels of specdist.models.kernels.triton_attention against the torch reference, case by case.

Imported by tests/unit/test_paged_attention.py (the GPU cases, compiled), and run as a script with
TRITON_INTERPRET=1 set before Triton is imported (the CPU cases, under Triton's interpreter: it needs
the variable when triton.language's own functions are decorated, so it cannot be switched on in a
process that imported Triton already). The script prints one line a case and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from specdist.models.backends.paged import paged_attention_reference, rope_and_write_reference
from specdist.models.kernels.triton_attention import _tanh
from support.kernel_checks import Report, within_tolerance

ATTENTION_CASES = [(None, None), (5, None), (None, 4.0), (6, 3.0)]  # (window, softcap)
# split-KV over long contexts: (window, softcap, splits; None: the launcher's choice, 2 for these shapes)
SPLIT_CASES = [(None, None, None), (None, None, 3), (100, None, 5), (None, 30.0, 16), (100, 30.0, 3)]
TANH_ULPS = 2.5  # the kernels' tanh against float64, in float32 epsilons of the result (torch's CPU tanh: 0.5)


def _compare(got, want, n_new, bsz: int, t_pad: int, dtype) -> str | None:
    why = within_tolerance(got, want, dtype)
    if why is not None:
        return why
    padded = torch.arange(t_pad, device=got.device)[None, :] >= n_new[:, None].long()  # [B, T]
    if padded.any() and got.view(bsz, t_pad, -1)[padded].abs().max().item() != 0:
        return "padded rows are not zeros"
    return None


def check_attention(device: str, dtype: torch.dtype, window, softcap) -> str | None:
    """None when the kernel equals the reference (within the dtype's tolerance, padded rows exactly 0), else why."""
    from specdist.models.kernels.triton_attention import paged_attention

    torch.manual_seed(0)
    bsz, t_pad, hq, hkv, hd, nb, bs, width = 3, 5, 6, 2, 32, 40, 4, 6
    kc = torch.randn(nb, bs, hkv, hd, dtype=dtype, device=device)
    vc = torch.randn(nb, bs, hkv, hd, dtype=dtype, device=device)
    table = (torch.randperm(nb - 1)[: bsz * width] + 1).view(bsz, width).to(torch.int32).to(device)
    starts = torch.tensor([0, 7, 12], dtype=torch.int32, device=device)  # ragged: 5, 1 and 3 new tokens
    n_new = torch.tensor([5, 1, 3], dtype=torch.int32, device=device)
    q = torch.randn(bsz * t_pad, hq, hd, dtype=dtype, device=device)
    want = paged_attention_reference(q, kc, vc, table, starts, n_new, t_pad, 0.3, window, softcap)
    got = paged_attention(q, kc, vc, table, starts, n_new, t_pad, 0.3, window, softcap)
    return _compare(got, want, n_new, bsz, t_pad, dtype)


def check_split_attention(device: str, dtype: torch.dtype, window, softcap, splits, t_pad: int = 4) -> str | None:
    """Split-KV against the reference: 4 query heads a KV head, block tables of 640 keys, ragged requests (a
    verification at position 600, one token at 37, an empty graph-padding request); ``t_pad`` 20: a prefill of
    20 tokens at 500 (two row blocks of 64). ``splits`` key ranges a row block (some past the short rows' keys)."""
    from specdist.models.kernels.triton_attention import paged_attention, split_count

    torch.manual_seed(2)
    bsz, hq, hkv, hd, bs, width = 3, 8, 2, 32, 16, 40
    nb = bsz * width + 1
    kc = torch.randn(nb, bs, hkv, hd, dtype=dtype, device=device)
    vc = torch.randn(nb, bs, hkv, hd, dtype=dtype, device=device)
    table = (torch.randperm(nb - 1) + 1).view(bsz, width).to(torch.int32).to(device)
    first = [500, 20] if t_pad == 20 else [600, 4]
    starts = torch.tensor([first[0], 37, 0], dtype=torch.int32, device=device)
    n_new = torch.tensor([first[1], 1, 0], dtype=torch.int32, device=device)
    q = torch.randn(bsz * t_pad, hq, hd, dtype=dtype, device=device)
    if splits is None and split_count(bsz * hkv, width * bs) < 2:
        return "the launcher's rule does not split these shapes"
    want = paged_attention_reference(q, kc, vc, table, starts, n_new, t_pad, 0.2, window, softcap)
    got = paged_attention(q, kc, vc, table, starts, n_new, t_pad, 0.2, window, softcap, splits=splits)
    return _compare(got, want, n_new, bsz, t_pad, dtype)


@triton.jit
def _tanh_kernel(X, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, _tanh(tl.load(X + i)))


def check_tanh(device: str) -> str | None:
    """The soft-cap's tanh (triton_attention._tanh) against float64: None within TANH_ULPS, else the worst."""
    small = torch.logspace(-7, 1.7, 2048, dtype=torch.float64)  # 1e-7 .. 50, both signs
    x = torch.cat([torch.linspace(-30, 30, 4096, dtype=torch.float64), small, -small]).float().to(device)
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, N=x.numel())
    want = torch.tanh(x.double())
    ulps = ((y.double() - want).abs() / (want.abs() * torch.finfo(torch.float32).eps)).max().item()
    return None if ulps <= TANH_ULPS else f"tanh off by {ulps:.3g} float32 epsilons"


def check_rope(device: str, dtype: torch.dtype, rotary: int) -> str | None:
    """None when the fused rotary + cache write equals the reference, else why (``rotary`` < 32: partial)."""
    from specdist.models.kernels.triton_attention import rope_and_write

    torch.manual_seed(1)
    n, hq, hkv, hd, nb, bs = 7, 6, 2, 32, 10, 4
    ang = torch.rand(64, rotary // 2)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype).to(device)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype).to(device)
    qkv = torch.randn(n, (hq + 2 * hkv) * hd, dtype=dtype, device=device)  # views of one projection, as the runner's
    q, k, v = (x.view(n, -1, hd) for x in qkv.split([hq * hd, hkv * hd, hkv * hd], -1))
    pos = torch.randint(0, 64, (n,), dtype=torch.int32, device=device)
    rows = torch.randperm(nb * bs)[:n].to(device)
    k1 = torch.zeros(nb, bs, hkv, hd, dtype=dtype, device=device)
    v1, k2, v2 = k1.clone(), k1.clone(), k1.clone()
    want_q = rope_and_write_reference(q.clone(), k, v, cos, sin, pos, rows, k1, v1)
    got_q = q.clone()
    rope_and_write(got_q, k, v, cos, sin, pos, rows, k2, v2)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for what, got, want in (("q", got_q, want_q), ("k cache", k2, k1), ("v cache", v2, v1)):
        if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            return f"{what}: max error {(got.float() - want.float()).abs().max().item():.3g}"
    return None


def main() -> int:
    report = Report()
    report("tanh", check_tanh("cpu"))
    for dtype in (torch.float32, torch.float16):  # the interpreter has no bfloat16
        for window, softcap in ATTENTION_CASES:
            report(
                f"attention {dtype} window {window} softcap {softcap}", check_attention("cpu", dtype, window, softcap)
            )
        for window, softcap, splits in SPLIT_CASES:
            report(
                f"split-KV {dtype} window {window} softcap {softcap} splits {splits}",
                check_split_attention("cpu", dtype, window, softcap, splits),
            )
        report(f"split-KV prefill {dtype} window 64 splits 3", check_split_attention("cpu", dtype, 64, None, 3, 20))
        for rotary in (32, 16):
            report(f"rope {dtype} rotary {rotary}", check_rope("cpu", dtype, rotary))
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
