"""The GPU check script (``python -m specdist.bench.gpu_check``), run here as far as a CPU allows:
the one-line refusal without CUDA, the random checkpoints, and the benchmark command it builds."""

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


def test_benchmark_step_writes_checkpoints_and_calls_bench_engine_with_valid_flags(tmp_path, monkeypatch, capsys):
    """The benchmark step on the CPU (``--device cpu --tiny``) up to the bench command, which is
    parsed by the bench's own argument parser instead of run (tests/test_dtypes.py runs the bench
    with a model draft and several dtypes)."""
    import argparse

    from model_zoo import save_word_tokenizer
    from specdist.bench import engine_bench

    from transformers import AutoTokenizer

    save_word_tokenizer(str(tmp_path / "tok"), 40)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    monkeypatch.setattr("specdist.models.loader.load_tokenizer", lambda source, progress=None: tok)
    calls = []
    monkeypatch.setattr(gpu_check.subprocess, "call", lambda cmd, cwd=None: calls.append(cmd) or 0)
    rc = gpu_check.main(["--device", "cpu", "--tiny", "--skip-tests", "--workdir", str(tmp_path / "work")])
    assert rc == 0 and "gpu_check: all steps passed" in capsys.readouterr().out
    cmd, w4, compiled, eagle, suffix = calls
    assert cmd[1:5] == w4[1:5] == compiled[1:5] == eagle[1:5] == suffix[1:5] == ["-m", "specdist.cli", "bench", "engine"]
    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    assert parser.parse_args(w4[5:]).draft == "self-w4"  # the int4 kernel on the device
    assert (parser.parse_args(compiled[5:]).draft, parser.parse_args(compiled[5:]).compile) == ("self-w4", "on")
    assert (parser.parse_args(suffix[5:]).draft, parser.parse_args(suffix[5:]).length_policy) == ("suffix", "adaptive")
    args = parser.parse_args(cmd[5:])
    assert (args.draft, args.dtype, args.device) == ("model", "float32", "cpu")
    for path in (args.model, args.draft_model):  # both checkpoints load, with the tokenizer's vocabulary
        cfg = json.load(open(os.path.join(path, "config.json")))
        assert cfg["vocab_size"] == len(tok) and os.path.isfile(os.path.join(path, "tokenizer.json"))
    # the EAGLE-3 step: a head in the published layout that loads for the target it was written for
    from specdist.models.eagle3 import load_eagle3_head
    from specdist.models.loader import load_model, resolve_model

    head_args = parser.parse_args(eagle[5:])
    assert head_args.draft == "eagle3" and head_args.model == args.model
    target = load_model(resolve_model(args.model), "float32")
    head = load_eagle3_head(head_args.draft_model, target.config, target.get_input_embeddings(), torch.float32, "cpu")
    assert head.spec.draft_vocab_size == len(tok) // 3 and head.spec.aux_layers == (1, 1, 0)
