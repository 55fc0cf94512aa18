"""A weight file rewritten in place under a running server leaves the loaded model as it was: safetensors tensors
whose dtype matched, and GGUF tensors gguf's reader hands out, were views of the file's mapping, so a rewrite
changed the weights silently or, cut short, killed the process with SIGBUS at the next forward
(tests/support/rewritten_weights_case.py runs each case in a process of its own, where a SIGBUS is a return
code)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from support import SUPPORT

from specdist.models.loader import own_weights

KINDS = ("safetensors", "gguf-float", "gguf-native")


def test_a_weight_file_rewritten_in_place_leaves_the_model_as_loaded(tmp_path):
    script = os.path.join(SUPPORT, "rewritten_weights_case.py")
    run = subprocess.run(
        [sys.executable, script, str(tmp_path), *KINDS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert run.returncode == 0, f"exit {run.returncode} (-7: SIGBUS)\n{run.stdout[-1500:]}{run.stderr[-1500:]}"
    assert run.stdout.splitlines() == [f"{kind} | same" for kind in KINDS], run.stdout[-1500:]


def test_own_weights_copies_what_maps_a_file_and_keeps_ties(tmp_path):
    """own_weights on tensors made from a file's mapping: each copied once (a tied weight stays one tensor), the rest
    left alone; a second call copies nothing."""
    path = tmp_path / "w.bin"
    torch.arange(64, dtype=torch.float32).numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=64, dtype=torch.float32)  # [64], a view of the file
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    with torch.no_grad():
        model[0].weight.data = mapped.view(8, 8)
        model[1].weight = model[0].weight  # tied
    model.register_buffer("owned", torch.ones(3))
    assert own_weights(model) == 64 * 4
    assert model[1].weight is model[0].weight and torch.equal(model[0].weight, torch.arange(64.0).view(8, 8))
    assert model[0].weight.untyped_storage().data_ptr() != mapped.untyped_storage().data_ptr()
    assert own_weights(model) == 0
