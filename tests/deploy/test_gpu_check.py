"""The GPU check script (``python -m specdist.bench.gpu_check``), run here as far as a CPU allows: the
one-line refusal without CUDA, the random checkpoints, the steps' logging, summary and time limits, and
the decode benchmark (:mod:`specdist.bench.gpu_decode`) on a toy model."""

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


@pytest.mark.slow
def test_steps_print_each_test_and_write_the_summary_as_they_end(tmp_path, capsys):
    """The CPU smoke run of two steps: each test's name, outcome and seconds printed as it ends and listed in
    gpu_check.json, whose steps carry status, seconds and limit."""
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--steps", "env,tests", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0 and "gpu_check: all steps passed" in printed
    summary = json.load(open(tmp_path / "gpu_check.json"))
    env, tests = summary["steps"]
    assert (env["name"], env["status"], tests["name"], tests["status"]) == ("env", "passed", "tests", "passed")
    assert tests["counts"]["passed"] >= 5 and tests["counts"]["failed"] == 0 and tests["limit_s"] == 240
    for t in tests["tests"]:
        assert t["name"].startswith("tests/unit/test_paged_attention.py::") and t["seconds"] >= 0
        assert f"[gpu_check] {t['outcome'].upper()}" in printed and t["name"] in printed
    assert summary["passed"] is True and "[gpu_check] PASSED" in open(tmp_path / "gpu_check.log").read()


def test_a_step_past_its_limit_is_killed_and_the_summary_says_so(tmp_path):
    """A step that overruns its limit is killed with its process group; the summary records it as a timeout and
    the next step still runs."""
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--steps", "env,env", "--limit", "env=0.3", "--out", str(tmp_path)])
    summary = json.load(open(tmp_path / "gpu_check.json"))
    assert rc == 1 and [s["status"] for s in summary["steps"]] == ["timeout", "timeout"]
    assert all(s["seconds"] < 30 for s in summary["steps"]) and summary["passed"] is False


def test_the_decode_benchmark_reports_the_bound_and_transformers_tokens(tmp_path):
    """gpu_decode on a toy model on the CPU: the bound from the measured bandwidth and the weight bytes, and
    specdist's greedy tokens equal to transformers' generate on the same model."""
    from specdist.bench import gpu_decode

    path = str(tmp_path / "decode.json")
    assert gpu_decode.main(["--device", "cpu", "--tiny", "--models", "random-1b", "--tokens", "12", "--json", path]) == 0
    report = json.load(open(path))
    r = report["models"]["random-1b"]
    assert report["copy_bandwidth_gb_s"] > 0 and r["bound_tok_s"] == pytest.approx(
        report["copy_bandwidth_gb_s"] * 1e9 / r["weight_bytes_per_token"])
    assert r["specdist"]["tokens"] == 12 and r["same_tokens_as_transformers"] is True
    assert r["specdist"]["decode_tok_s"] > 0 and r["transformers"]["decode_tok_s"] > 0
