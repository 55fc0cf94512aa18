"""``specdist bench runner``: one model's ``CausalLMRunner.forward`` in several dtypes.

What ``auto`` means on the CPU is decided by this measurement: batch 1, ``--context`` tokens
already in the KV cache, one forward of 1, 5 and 9 new tokens (a decode step, the
verification of 4 and of 8 drafts), median of ``--repeats`` timed runs after two warm-ups,
each dtype in turn in one process. The dtype that is faster at every size is the one ``auto`` should
mean on such a CPU (``specdist.models.dtypes.cpu_auto_dtype``: bfloat16 where the CPU multiplies it
natively, float32 elsewhere); float32 when none is. Run it on a quiet machine and record the table
in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="model spec (built-in name, dir, .gguf)")
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma-separated: float32, bfloat16, float16, or float32-wide (float32 held in float32 even "
        "where bf16 / fp16 holds the weights exactly: the runner's half-width storage off)",
    )
    p.add_argument(
        "--round-bf16",
        action="store_true",
        help="round the model's matrices to bfloat16 values first, as a bf16 checkpoint holds them",
    )
    p.add_argument("--tokens", default="1,5,9", help="comma-separated new-token counts per forward")
    p.add_argument("--context", type=int, default=64, help="tokens in the KV cache before each timed forward")
    p.add_argument("--repeats", type=int, default=12, help="timed forwards per (dtype, tokens); the median is reported")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")


def time_forward(runner, context: list[int], n_tokens: int, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of ``repeats`` forwards of ``n_tokens`` new tokens after ``context``, rolled back after each."""
    import torch

    slot = runner.cache.allocate()
    try:
        runner.forward([slot], [context], [0])
        new = [(5 * i + 11) % runner.vocab_size for i in range(n_tokens)]
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            logits = runner.forward([slot], [new], [n_tokens])
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            runner.cache.rollback(slot, len(context))
        return times
    finally:
        runner.cache.free(slot)


WIDE = "float32-wide"  # float32 weights held in float32 whatever they are (CausalLMRunner(half_storage=False))


def choose_auto(medians: dict[str, dict[int, float]]) -> str:
    """The dtype with the lowest median at every token count; float32 when no dtype is."""
    medians = {d: by_n for d, by_n in medians.items() if d != WIDE}
    sizes = sorted({n for by_n in medians.values() for n in by_n})
    for dtype, by_n in medians.items():
        others = [d for d in medians if d != dtype]
        if all(by_n[n] < medians[o][n] for n in sizes for o in others):
            return dtype
    return "float32"


def run(args: argparse.Namespace) -> int:
    import torch

    from specdist.models.devices import device_for
    from specdist.models.dtypes import TORCH_DTYPES
    from specdist.models.loader import load_model, resolve_model
    from specdist.models.runner import CausalLMRunner

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in (*TORCH_DTYPES, WIDE):
            raise ValueError(f"--dtypes: unknown dtype {d!r}; choose from {', '.join((*TORCH_DTYPES, WIDE))}")
    sizes = [int(n) for n in args.tokens.split(",")]
    if min(sizes) < 1 or args.context < 1 or args.repeats < 1:
        raise ValueError("--tokens, --context and --repeats must be >= 1")
    device = device_for(args.device)
    src = resolve_model(args.model, "--model")
    medians: dict[str, dict[int, float]] = {}
    for dtype in dtypes:
        model = load_model(src, "float32" if dtype == WIDE else dtype, device)
        if args.round_bf16:
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() >= 2:
                        p.copy_(p.to(torch.bfloat16).to(p.dtype))
        runner = CausalLMRunner(model, 1, args.context + max(sizes) + 1, half_storage=dtype != WIDE)
        context = [(7 * i + 3) % runner.vocab_size for i in range(args.context)]
        medians[dtype] = {}
        for n in sizes:
            medians[dtype][n] = statistics.median(time_forward(runner, context, n, args.repeats))
            print(f"  {dtype:8s} {n:2d} tokens: {medians[dtype][n] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        del runner, model
    print(format_report(medians, args, torch.get_num_threads(), str(device)))
    return 0


def format_report(medians: dict[str, dict[int, float]], args, threads: int, device: str) -> str:
    dtypes = list(medians)
    sizes = sorted({n for by_n in medians.values() for n in by_n})
    lines = [
        f"specdist bench runner: {args.model}{' (matrices rounded to bf16)' if args.round_bf16 else ''} on {device}, "
        f"batch 1, {args.context} tokens cached, median of {args.repeats}, torch threads {threads}",
        "",
        "| new tokens | "
        + " | ".join(f"{d} ms" for d in dtypes)
        + " | "
        + " | ".join(f"{d} / {dtypes[0]}" for d in dtypes[1:])
        + " |",
        "|---" * (1 + 2 * len(dtypes) - 1) + "|",
    ]
    for n in sizes:
        row = [f"{medians[d][n] * 1e3:.1f}" for d in dtypes]
        row += [f"{medians[d][n] / medians[dtypes[0]][n]:.2f}" for d in dtypes[1:]]
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    lines += [
        "",
        f"auto on this device: {choose_auto(medians)} (the dtype faster at every size, float32 when none "
        "is; on the CPU: cpu_auto_dtype in specdist/models/dtypes.py)",
    ]
    return "\n".join(lines)
