"""A model's weight file rewritten in place under a loaded model (run as a script by
tests/unit/test_rewritten_weights.py: a weight that still read the file's mapping would die of SIGBUS, so the case
runs in a process of its own). Usage: ``rewritten_weights_case.py DIR KIND...``, kinds ``safetensors``, ``gguf-float``
and ``gguf-native``. For each: loads a tiny model, keeps its parameters and the logits of a prompt, rewrites the file
in place (truncated, then half as many different bytes: ``cp``, ``rsync --inplace`` and volume re-syncs write in
place), and prints "KIND | same" if every parameter and the logits are unchanged, "KIND | changed: NAMES" otherwise."""

from __future__ import annotations

import os
import sys

import torch

from specdist.models.loader import load_model, resolve_model
from support.gguf_writer import write_tiny_gguf
from support.helpers import save_tiny_llama


def case(root: str, kind: str) -> str:
    root = os.path.join(root, kind)
    os.makedirs(root)
    if kind == "safetensors":
        spec = save_tiny_llama(os.path.join(root, "tiny"), seed=1)
        path, weights = os.path.join(spec, "model.safetensors"), "float"
    else:
        spec = path = write_tiny_gguf(os.path.join(root, "tiny.gguf"))
        weights = kind.removeprefix("gguf-")
    model = load_model(resolve_model(spec), "float32", weights=weights)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        logits = model(ids).logits
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # in place: the same inode, cut to nothing, then other bytes
        f.truncate(0)
        f.write(bytes((7 * i + 1) % 251 for i in range(size // 2)))
        f.flush()
        os.fsync(f.fileno())
    changed = [name for name, t in model.state_dict().items() if not torch.equal(t, before[name])]
    with torch.no_grad():
        if not torch.equal(model(ids).logits, logits):
            changed.append("logits")
    return "same" if not changed else f"changed: {' '.join(changed)}"


if __name__ == "__main__":
    for kind in sys.argv[2:]:
        print(f"{kind} | {case(sys.argv[1], kind)}", flush=True)
