"""`specdist bench cluster` end to end on the tiny models (a smoke run: it measures, it does not judge)."""

from __future__ import annotations

import json

import yaml

from conftest import tiny_config
from specdist.cli import main


def test_bench_cluster_runs_spec_and_no_spec(tiny_models, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_models, "model", 3)))
    out_json = tmp_path / "r.json"
    rc = main(["bench", "cluster", "--config", str(cfg), "--concurrency", "1,3", "--requests", "3",
               "--max-tokens", "6", "--raw", "--json", str(out_json), "--hf-baseline", "2"])
    assert rc == 0
    rows = json.loads(out_json.read_text())
    hf = rows.pop()
    assert hf["variant"] == "hf-plain" and hf["requests"] == 2 and hf["output_tokens_per_s"] > 0
    assert [(r["variant"], r["concurrency"]) for r in rows] == [("spec", 1), ("spec", 3), ("no-spec", 1), ("no-spec", 3)]
    for r in rows:
        assert abs(r["vs_hf_plain"] * hf["output_tokens_per_s"] - r["output_tokens_per_s"]) < 1e-6
        assert r["output_tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0
        assert (r["acceptance"] is None) == (r["variant"] == "no-spec")
        assert r["phase_share"]["verify"] > 0
        assert abs(sum(r["phase_share"].values()) - 1) < 1e-6, r["phase_share"]
        assert r["phase_share"]["scheduling"] > 0 and r["phase_share"]["network+serialization"] == 0  # in process
    table = capsys.readouterr().out
    assert "| spec | 3 | 3 |" in table and "| no-spec | 1 | 3 |" in table
    assert "orchestration" in table and "transformers generate, one request at a time" in table


def test_bench_cluster_over_a_ray_deployment(tiny_models, tmp_path, capsys):
    """--config with cluster.enabled: the bench brings the Ray deployment up (2 target ranks + 1
    draft worker over gRPC), measures it, reports the network share, and tears everything down."""
    import ray

    from conftest import raylets

    cfg = tiny_config(tiny_models, "model", 3)
    cfg["cluster"] = {"enabled": True, "tensor_parallel_size": 2, "num_draft_workers": 1,
                      "cpus_per_rank": 0.5, "cpus_per_draft": 0.5, "bringup_timeout_s": 180}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out_json = tmp_path / "r.json"
    rc = main(["bench", "cluster", "--config", str(path), "--concurrency", "2", "--requests", "2",
               "--max-tokens", "5", "--raw", "--variants", "spec", "--json", str(out_json)])
    assert rc == 0
    [row] = json.loads(out_json.read_text())
    assert row["variant"] == "spec" and row["output_tokens_per_s"] > 0 and row["acceptance"] is not None
    share = row["phase_share"]
    assert share["network+serialization"] > 0 and share["draft"] > 0 and share["verify"] > 0
    assert abs(sum(share.values()) - 1) < 1e-6
    assert not ray.is_initialized() and raylets() == 0  # the bench's own local Ray is gone
