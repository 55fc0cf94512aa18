"""The GPU check script (``python -m specdist.bench.gpu_check``), run here as far as a CPU allows:
the one-line refusal without CUDA, and its benchmark step with tiny random checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specdist.bench import gpu_check
from specdist.bench.checkpoints import write_random_llama


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_without_cuda_it_says_so_in_one_line(capsys):
    assert gpu_check.main(["--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "CUDA is not available" in err


def test_random_checkpoint_has_the_requested_size_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    arch = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    w = write_random_llama(str(tmp_path), 50, torch.float32, shard_bytes=30_000, **arch)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1  # split into several files, with an index
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) == w.num_params
    assert w.num_bytes == 4 * w.num_params == index["metadata"]["total_size"]
    assert os.path.getsize(tmp_path / "config.json") > 0


def test_cpu_smoke_run_of_the_benchmark_step(tmp_path, capfd):
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--skip-tests", "--prompts", "1", "--max-tokens", "4",
                         "--workdir", str(tmp_path)])
    out = capfd.readouterr().out
    assert rc == 0, out
    assert "| float32 | 0 | engine-spec |" in out and "gpu_check: all steps passed" in out
