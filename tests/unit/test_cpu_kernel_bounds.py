"""The CPU kernels' wrappers check every index and shape before the C code sees them: a scheduler bug
becomes a ValueError naming what is wrong, never a read or write outside the cache (the C code indexes
``slots[b]``, query and write positions without a bound). The cases run in a process of their own
(tests/support/kernel_bounds_cases.py): before the checks some read or wrote outside the cache, and one crashed it.
Also the RMS norm's weight length, a decoder layer's o / down row counts and norm shapes (the C code wrote past the
residual), and index tensors edited in place under inference mode after a first call had checked them (no version
counter told: the C code now checks every index itself)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import SUPPORT

from specdist.models.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs the CPU kernels (x86 with AVX2)")


def test_bad_indices_and_shapes_are_refused_before_the_call():
    script = os.path.join(SUPPORT, "kernel_bounds_cases.py")
    run = subprocess.run(
        [sys.executable, script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    outcomes = dict(line.split(" | ", 1) for line in run.stdout.splitlines())
    assert run.returncode == 0 and len(outcomes) == 29, run.stdout + run.stderr[-1500:]
    for case, outcome in outcomes.items():
        if case.endswith("valid"):
            assert outcome == "ok", (case, outcome)
        else:
            assert outcome.startswith("ValueError: "), (case, outcome)
