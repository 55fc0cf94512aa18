"""The Triton kernels of specdist.models.kernels.triton_layer against float64, and runners on them against
transformers.

Imported by tests/unit/test_fused_kernels.py (the GPU cases, compiled), and run as a script with TRITON_INTERPRET=1
set before Triton is imported (the CPU cases, under Triton's interpreter). The script prints one line a case and
exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from support.kernel_checks import TOLERANCE, Report, within_tolerance

DIMS = (32, 576, 2048)  # a tiny model's, the built-in SmolLM2-135M's, Llama 3.2 1B's
SILU_WIDTHS = (64, 2816)  # one partial block; 2 full blocks and a partial one (a 1 B model's 5632 / 2)
FAMILIES = ("llama", "qwen2", "phi3", "qwen3", "gemma2", "gemma3")
# (request, new tokens) a step: a prefill, a ragged prefill + verification (padded rows), decodes, a verification
SCHEDULE = [[(0, 9)], [(1, 5), (0, 3)], [(0, 1), (1, 1)], [(1, 4)], [(0, 1)]]


def check_add_rms_norm(device: str, dtype: torch.dtype, dim: int, with_delta: bool, gemma: bool = False) -> str | None:
    """The residual sum exactly torch's (the sum rounded to the dtype once), the normed rows within the dtype's
    tolerance of float64's norm of that sum, on [3, 5, dim] rows; without a delta, ``h`` itself comes back.
    ``gemma``: Gemma's ``1 + w`` norms, the delta normed (and rounded, as its module returns it) before the add."""
    from specdist.models.kernels.triton_layer import add_rms_norm

    torch.manual_seed(dim)
    h = torch.randn(3, 5, dim, dtype=dtype, device=device) * 3
    delta = torch.randn(3, 5, dim, dtype=dtype, device=device) if with_delta else None
    w, wa = torch.randn(dim, dtype=dtype, device=device), torch.randn(dim, dtype=dtype, device=device)
    offset = 1.0 if gemma else 0.0

    def norm(x, weight, eps):  # float64
        return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * (weight.double() + offset)

    got_h, got_y = add_rms_norm(h, delta, w, 1e-6, (wa, 1e-5) if gemma else None, offset)
    if gemma:  # Gemma2RMSNorm: float32 throughout, one rounding; the rounded output added in the dtype
        normed = (
            delta.float() * torch.rsqrt(delta.float().pow(2).mean(-1, keepdim=True) + 1e-5) * (1.0 + wa.float())
        ).to(dtype)
        if (normed.double() - norm(delta.double(), wa, 1e-5)).abs().max() > TOLERANCE[dtype] * 10:
            return "the test's own Gemma norm is off"
        want_h = h + normed
        if not torch.allclose(got_h.double(), want_h.double(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype]):
            return f"the residual sum is off by {(got_h.double() - want_h.double()).abs().max().item():.3g}"
    else:
        want_h = h + delta if with_delta else h
        if not torch.equal(got_h, want_h):
            return "the residual sum is not torch's"
    if not with_delta and got_h.data_ptr() != h.data_ptr():
        return "without a delta the residual is not h itself"
    return within_tolerance(got_y, norm(got_h.double(), w, 1e-6), dtype)


def check_silu_mul(device: str, dtype: torch.dtype, width: int) -> str | None:
    """``silu(gate) * up`` of [3, 5, 2 * width] rows within the dtype's tolerance of float64's."""
    from specdist.models.kernels.triton_layer import silu_mul

    torch.manual_seed(width)
    gate_up = torch.randn(3, 5, 2 * width, dtype=dtype, device=device) * 3
    gate, up = gate_up.double().chunk(2, -1)
    return within_tolerance(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


def check_runner(device: str, family: str) -> str | None:
    """A float32 runner of ``family``'s tiny model (tests/support/model_zoo.py) on the Triton backend: its logits
    over SCHEDULE within 1e-4 of transformers' forward of the whole sequences (as tests/unit/test_model_families.py
    asks of every place), and its greedy continuation of a prompt transformers' greedy ``generate``."""
    from specdist.models.kv.options import KVOptions
    from specdist.models.runner import CausalLMRunner
    from support.model_zoo import build_tiny

    model = build_tiny(family, seed=1).to(device)
    runner = CausalLMRunner(
        model, num_slots=2, max_len=32, kv_cache_dtype="model", kv=KVOptions("paged"), attention_backend="paged"
    )
    if not runner.layer_triton:
        return "the fused kernels are not in use"
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, model.config.vocab_size, (20,), generator=gen).tolist() for _ in range(2)]
    with torch.inference_mode():
        refs = [model(torch.tensor([s], device=device)).logits[0].cpu() for s in seqs]
    slots = [runner.cache.allocate() for _ in range(2)]
    pos = [0, 0]
    for step in SCHEDULE:
        tokens = [seqs[r][pos[r] : pos[r] + n] for r, n in step]
        logits = runner.forward([slots[r] for r, _ in step], tokens, [n for _, n in step]).cpu()  # [B, T, V]
        for b, (r, n) in enumerate(step):
            err = (logits[b, :n] - refs[r][pos[r] : pos[r] + n]).abs().max().item()
            if err > 1e-4:
                return f"step {step}, request {r}: logits off by {err:.3g}"
            pos[r] += n
    prompt, n = [0, 1, 2, 3, 4, 5, 6, 1], 10
    runner.cache.free(slots[0])
    slot = runner.cache.allocate()
    got, tokens = [], prompt
    for _ in range(n):
        tokens = [int(runner.forward([slot], [tokens], [1])[0, -1].argmax())]
        got += tokens
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        want = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            top_k=None,
            top_p=None,
            temperature=None,
        )[0, len(prompt) :].tolist()
    return None if got == want else f"greedy tokens {got}, transformers' {want}"


def main() -> int:
    report = Report()
    for dtype in (torch.float32, torch.float16):  # the interpreter has no bfloat16
        for dim in DIMS:
            for with_delta in (True, False):
                report(
                    f"add_rms_norm {dtype} dim {dim} delta {with_delta}",
                    check_add_rms_norm("cpu", dtype, dim, with_delta),
                )
            report(f"add_rms_norm {dtype} dim {dim} gemma", check_add_rms_norm("cpu", dtype, dim, True, gemma=True))
        for width in SILU_WIDTHS:
            report(f"silu_mul {dtype} width {width}", check_silu_mul("cpu", dtype, width))
    for family in FAMILIES:
        report(f"runner {family}", check_runner("cpu", family))
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
