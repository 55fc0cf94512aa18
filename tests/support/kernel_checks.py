"""What the Triton kernel checks share (tests/support/paged_kernels_check.py, layer_kernels_check.py): the
tolerance of a dtype, the comparison against a reference, the script's one line a case, and running a check
script under Triton's interpreter.

A check script runs in a process of its own with TRITON_INTERPRET=1: the interpreter must be on before Triton is
imported (triton.language's own functions are decorated then), so it cannot be switched on in a process that
imported Triton already. This module imports no Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from support import SUPPORT

# a kernel's output against a float64 (or torch) reference: its largest error relative to the largest output
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def within_tolerance(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when ``got`` is within ``dtype``'s tolerance of ``want`` (scaled by the largest output), else why."""
    err = (got.double() - want.double()).abs().max().item()
    return None if err <= TOLERANCE[dtype] * (1 + want.double().abs().max().item()) else f"max error {err:.3g}"


class Report:
    """A check script's output: one line a case (``what: ok`` or ``what: why``), the mismatches counted."""

    def __init__(self) -> None:
        self.failed = 0

    def __call__(self, what: str, why: str | None) -> None:
        print(f"{what}: {why or 'ok'}")
        self.failed += why is not None

    def exit_code(self) -> int:
        return 1 if self.failed else 0


def run_interpreted(script: str, timeout: float) -> str:
    """Run tests/support/``script`` under Triton's interpreter (this process's import path); its output, once it
    exited 0 (an AssertionError with its output and errors otherwise)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, script)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return run.stdout
