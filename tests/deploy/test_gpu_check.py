"""The GPU check script (``python -m specdist.bench.gpu_check``), run here as far as a CPU allows: the
one-line refusal without CUDA, the random checkpoints, the steps' logging, summary and time limits (and the
leases they add up to), failures recorded instead of raised, and the decode benchmark
(:mod:`specdist.bench.gpu_decode`) on a toy model."""

from __future__ import annotations

import argparse
import json
import os
import sys

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

    arch = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
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
    assert (
        tests["counts"]["passed"] >= 5
        and tests["counts"]["failed"] == 0
        and tests["limit_s"] == gpu_check.LIMITS["tests"]
    )
    for t in tests["tests"]:
        assert t["name"].startswith("tests/unit/test_paged_attention.py::") and t["seconds"] >= 0
        assert f"[gpu_check] {t['outcome'].upper()}" in printed and t["name"] in printed
    assert summary["passed"] is True and "[gpu_check] PASSED" in open(tmp_path / "gpu_check.log").read()


def test_a_step_past_its_limit_is_killed_and_the_summary_says_so(tmp_path):
    """A step that overruns its limit is killed with its process group; the summary records it as a timeout and
    the next step still runs."""
    rc = gpu_check.main(
        ["--device", "cpu", "--tiny", "--steps", "env,env", "--limit", "env=0.3", "--out", str(tmp_path)]
    )
    summary = json.load(open(tmp_path / "gpu_check.json"))
    assert rc == 1 and [s["status"] for s in summary["steps"]] == ["timeout", "timeout"]
    assert all(s["seconds"] < 30 for s in summary["steps"]) and summary["passed"] is False


def test_the_decode_benchmark_reports_the_bound_and_transformers_tokens(tmp_path):
    """gpu_decode on a toy model on the CPU: the bound from the measured bandwidth and the weight bytes, and
    specdist's greedy tokens equal to transformers' generate on the same model."""
    from specdist.bench import gpu_decode

    path = str(tmp_path / "decode.json")
    assert (
        gpu_decode.main(["--device", "cpu", "--tiny", "--models", "random-1b", "--tokens", "12", "--json", path]) == 0
    )
    report = json.load(open(path))
    r = report["models"]["random-1b"]
    assert report["copy_bandwidth_gb_s"] > 0 and r["bound_tok_s"] == pytest.approx(
        report["copy_bandwidth_gb_s"] * 1e9 / r["weight_bytes_per_token"]
    )
    assert r["specdist"]["tokens"] == 12 and r["same_tokens_as_transformers"] is True
    assert r["specdist"]["decode_tok_s"] > 0 and r["transformers"]["decode_tok_s"] > 0


def test_the_runs_fit_their_leases_by_construction():
    """--quick within 5 minutes, the full run within 8: the start-up and the steps' limits add up to at most the
    lease (a step is killed at its limit, the drafts step's parts share its limit), each test's timeout fits its
    step, and the fast cuda tests run right after env, the slow ones after decode in a step of their own."""
    for quick, lease in ((True, gpu_check.QUICK_S), (False, gpu_check.FULL_S)):
        steps = gpu_check.plan(quick)
        total = gpu_check.STARTUP_S + sum(limit for _, limit in steps)
        assert total <= lease, f"{'quick' if quick else 'full'}: {total} s of limits for a {lease} s lease: {steps}"
        names = [name for name, _ in steps]
        assert names[:3] == ["env", "tests", "decode"]
    assert gpu_check.QUICK_S == 300 and gpu_check.FULL_S == 480
    assert [n for n, _ in gpu_check.plan(False)] == ["env", "tests", "decode", "tests-slow", "tasks", "drafts"]
    assert (
        gpu_check.DRAFTS_SETUP_S + len(gpu_check.DRAFT_VARIANTS) * gpu_check.MIN_VARIANT_S <= gpu_check.LIMITS["drafts"]
    )
    for name in ("tests", "tests-slow"):
        cmd = gpu_check.tests_command(name, "python", gpu_check.LIMITS[name], "cuda", False)
        timeout = float(cmd[cmd.index("--timeout") + 1])
        assert 0 < timeout <= gpu_check.LIMITS[name]
        marks = cmd[cmd.index("-m", cmd.index("--timeout")) + 1]
        assert marks == ("cuda and slow" if name == "tests-slow" else "cuda and not slow")


def test_the_tests_steps_find_every_cuda_test_file_telling_ones_first():
    """Every test file with a cuda twin (``devices()``) or the cuda marker is in the tests steps, those of FIRST
    first in its order; with a limit below the default timeout the timeout follows the limit."""
    files = gpu_check.cuda_test_files()
    for path in (
        "tests/unit/test_paged_attention.py",
        "tests/unit/test_model_families.py",
        "tests/unit/test_coupling.py",
        "tests/engine/test_eagle3.py",
        "tests/distributed/test_tensor_parallel.py",
    ):
        assert path in files
    first = [f for f in gpu_check.FIRST if f in files]
    assert files[: len(first)] == first and files[0] == "tests/unit/test_paged_attention.py"
    for f in files:
        text = open(os.path.join(gpu_check.ROOT, f)).read()
        assert "devices(" in text or "mark.cuda" in text
    cmd = gpu_check.tests_command("tests", "python", 30, "cuda", False)
    assert cmd[cmd.index("--timeout") + 1] == "30" and cmd[-len(files) :] == files


def test_a_drafts_setup_that_fails_is_recorded_and_the_run_goes_on(tmp_path):
    """The drafts step writes its checkpoints (and finds the built-in tokenizer) in a limited step of its own:
    cut at its limit, it is recorded as a timeout, the variants as skipped, and the next step still runs;
    gpu_check itself raises nothing."""
    rc = gpu_check.main(
        ["--device", "cpu", "--tiny", "--steps", "drafts,env", "--limit", "drafts=0.5", "--out", str(tmp_path)]
    )
    summary = json.load(open(tmp_path / "gpu_check.json"))
    steps = {s["name"]: s for s in summary["steps"]}
    assert rc == 1 and summary["passed"] is False
    assert steps["drafts-setup"]["status"] == "timeout" and steps["drafts-setup"]["limit_s"] == 0.5
    for v in gpu_check.DRAFT_VARIANTS:
        assert steps[f"drafts-{v}"]["status"] == "skipped" and "drafts-setup timeout" in steps[f"drafts-{v}"]["error"]
    assert steps["env"]["status"] == "passed"


def test_a_step_that_cannot_start_or_read_its_results_is_recorded(tmp_path, monkeypatch):
    """A step whose command cannot start, and one whose results cannot be read, fail with the reason in
    gpu_check.json; the run goes on and ends with its exit status, not a traceback."""
    run = gpu_check.Run(str(tmp_path), str(tmp_path), argparse.Namespace(quick=True, device="cpu", tiny=True))
    missing = run.step("missing", [str(tmp_path / "no-such-program")], 5)
    assert missing["status"] == "failed" and missing["error"].startswith("cannot start:")

    def unreadable(entry):
        raise ValueError("not JSON")

    bad = run.step("bad", [sys.executable, "-c", "print('[gpu_check] a line')"], 30, parse=unreadable)
    assert bad["status"] == "failed" and "ValueError: not JSON" in bad["error"]
    saved = json.load(open(tmp_path / "gpu_check.json"))
    assert [s["status"] for s in saved["steps"]] == ["failed", "failed"]

    def broken(*args, **kwargs):
        raise RuntimeError("configs/gpu.yaml unreadable")

    monkeypatch.setattr(gpu_check, "_cpu_config", broken)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--steps", "tasks,env", "--out", str(tmp_path / "t")]) == 1
    steps = json.load(open(tmp_path / "t" / "gpu_check.json"))["steps"]
    assert [(s["name"], s["status"]) for s in steps] == [("tasks", "failed"), ("env", "passed")]
    assert steps[0]["error"] == "RuntimeError: configs/gpu.yaml unreadable"
