"""The command line: streaming generate, cost model, and one-line errors (exit 2, no traceback)."""

from __future__ import annotations

import pytest
import yaml
from support.helpers import tiny_config

from specdist.cli import main


def _write_config(tmp_path, cfg) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_generate_streams_text_and_prints_stats(tiny_models, tmp_path, capsys):
    cfg = _write_config(tmp_path, tiny_config(tiny_models, "model", 3))
    rc = main(["generate", "--config", cfg, "--max-tokens", "6", "--temperature", "0", "--raw", "a b c"])
    out, err = capsys.readouterr()
    assert rc == 0
    words = out.strip().split()
    assert 0 < len(words) <= 6 and all(w in "abcdefg" for w in words)
    assert "acceptance=" in err and "tokens/s=" in err and "draft=model" in err


def test_cost_model_prints_worked_example(capsys, tmp_path):
    plot = tmp_path / "s.png"
    assert main(["cost-model", "--alpha", "0.8", "--k", "4", "--draft-cost", "0.1", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "3.3616" in out and "2.401" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["cost-model", "--alpha", "1.5", "--k", "4"], "alpha"),
        (["cost-model", "--alpha", "0.5", "--k", "-1"], "k"),
        (["generate", "--config", "/nonexistent.yaml", "x"], "does not exist"),
        (["generate", "--temperature", "-1", "x"], "temperature"),
        (["generate", "--top-p", "0", "x"], "top_p"),
        (["generate", "--max-tokens", "0", "x"], "max_tokens"),
    ],
)
def test_errors_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specdist: error:") and needle in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_bad_config_value_names_the_key(tmp_path, capsys):
    cfg = _write_config(tmp_path, {"draft": {"method": "medusa"}})
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--config", cfg, "x"])
    assert ei.value.code == 2
    assert "draft.method" in capsys.readouterr().err


def test_generate_respects_stop_string(tiny_models, tmp_path, capsys):
    cfg = _write_config(tmp_path, tiny_config(tiny_models, "ngram", 3))
    main(["generate", "--config", cfg, "--max-tokens", "12", "--temperature", "0", "--raw", "a b c"])
    full = capsys.readouterr().out.strip()
    words = full.split()
    if len(words) >= 3:  # cut at the third word
        main(
            [
                "generate",
                "--config",
                cfg,
                "--max-tokens",
                "12",
                "--temperature",
                "0",
                "--raw",
                "--stop",
                words[2],
                "a b c",
            ]
        )
        cut = capsys.readouterr().out.strip()
        assert cut == full[: full.index(words[2])].strip()


@pytest.mark.ray
def test_demo_runs_the_ray_deployment_and_stops_clean(tiny_models, tmp_path, capsys):
    """`specdist demo` (the README's first command, here on tiny models): a Ray deployment with a
    target rank and a draft worker, concurrent gRPC streams, counters back to 0, nothing left. (Served
    tensor-parallel targets on Ray are test_worker_faults' and test_multinode's: one rank here saves
    an actor process, seconds of CPU.)"""
    import ray
    from support.helpers import raylets, stop_local_ray

    stop_local_ray()  # the demo starts its own local Ray (and must stop it): none may be running before
    cfg = tiny_config(tiny_models, "model", 3)
    cfg["cluster"] = {
        "enabled": True,
        "tensor_parallel_size": 1,
        "num_draft_workers": 1,
        "cpus_per_rank": 0.5,
        "cpus_per_draft": 0.5,
        "bringup_timeout_s": 180,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["demo", "--config", str(path), "--requests", "3", "--max-tokens", "5", "--raw"]) == 0
    out, err = capsys.readouterr()
    assert out.count("    tokens=") == 3 and "tokens/s" in out and "acceptance" in out
    assert "tensor_parallel=1 draft_replicas=1" in out
    assert "running=0 queued=0 target_kv_slots=0 draft_kv_slots=0" in out
    from specdist.models.kernels import cpu_kernels

    # GetServerInfo reports what the target rank loaded with (engine.cpu_kernels: auto), this machine's backend
    assert f"server: CPU kernels of the target: {cpu_kernels.backend()}\n" in out
    assert "stopped cleanly" in err
    for phase in ("placement", "start", "rendezvous", "load", "follow", "warmup", "serve"):  # bring-up progress
        assert f"[specdist] bring-up: {phase} done after " in err, phase
    assert "deployment stopped in " in err and "(2 actors, placement groups removed" in err
    assert not ray.is_initialized() and raylets() == 0


def test_demo_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--requests", "0"])
    assert e.value.code == 2
    assert "--requests must be >= 1" in capsys.readouterr().err
