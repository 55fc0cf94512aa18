"""The Triton kernels of specdist.models.triton_attention against the torch reference, case by case.

Imported by tests/unit/test_paged_attention.py (the GPU cases, compiled), and run as a script with
TRITON_INTERPRET=1 set before Triton is imported (the CPU cases, under Triton's interpreter: it needs
the variable when triton.language's own functions are decorated, so it cannot be switched on in a
process that imported Triton already). The script prints one line a case and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from specdist.models.attention import paged_attention_reference, rope_and_write_reference

ATTENTION_CASES = [(None, None), (5, None), (None, 4.0), (6, 3.0)]  # (window, softcap)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def check_attention(device: str, dtype: torch.dtype, window, softcap) -> str | None:
    """None when the kernel equals the reference (within the dtype's tolerance, padded rows exactly 0), else why."""
    from specdist.models.triton_attention import paged_attention

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
    err = (got.float() - want.float()).abs().max().item()
    if not err <= TOLERANCE[dtype] * (1 + want.float().abs().max().item()):
        return f"max error {err:.3g}"
    padded = torch.arange(t_pad, device=device)[None, :] >= n_new[:, None].long()  # [B, T]
    if got.view(bsz, t_pad, -1)[padded].abs().max().item() != 0:
        return "padded rows are not zeros"
    return None


def check_rope(device: str, dtype: torch.dtype, rotary: int) -> str | None:
    """None when the fused rotary + cache write equals the reference, else why (``rotary`` < 32: partial)."""
    from specdist.models.triton_attention import rope_and_write

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
    failed = 0
    for dtype in (torch.float32, torch.float16):  # the interpreter has no bfloat16
        for window, softcap in ATTENTION_CASES:
            why = check_attention("cpu", dtype, window, softcap)
            print(f"attention {dtype} window {window} softcap {softcap}: {why or 'ok'}")
            failed += why is not None
        for rotary in (32, 16):
            why = check_rope("cpu", dtype, rotary)
            print(f"rope {dtype} rotary {rotary}: {why or 'ok'}")
            failed += why is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
