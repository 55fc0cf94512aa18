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
               "--max-tokens", "6", "--raw", "--json", str(out_json)])
    assert rc == 0
    rows = json.loads(out_json.read_text())
    assert [(r["variant"], r["concurrency"]) for r in rows] == [("spec", 1), ("spec", 3), ("no-spec", 1), ("no-spec", 3)]
    for r in rows:
        assert r["output_tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0
        assert (r["acceptance"] is None) == (r["variant"] == "no-spec")
        assert r["phase_share"]["verify"] > 0
    table = capsys.readouterr().out
    assert "| spec | 3 | 3 |" in table and "| no-spec | 1 | 3 |" in table
