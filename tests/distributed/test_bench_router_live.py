"""`specdist bench router` on real replicas (no --simulate), end to end on the tiny models: two policies, each on
two Ray Serve replicas brought up afresh on the tests' local Ray; the printed table's and the JSON's shape (it
measures, it does not judge: no timing is asserted)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from support.helpers import tiny_config

from specdist.bench.router_bench import METRICS
from specdist.cli import main

pytestmark = [pytest.mark.ray, pytest.mark.slow]

POLICIES = ("speculative", "round-robin")


def test_bench_router_on_two_replicas_prints_each_policy_and_its_ratios(local_ray, tiny_models, tmp_path, capsys):
    cfg = tiny_config(tiny_models, method="model", k=3, max_model_len=128)
    cfg["cluster"] = {
        "enabled": True,
        "tensor_parallel_size": 1,
        "num_draft_workers": 1,
        "cpus_per_rank": 0.5,
        "cpus_per_draft": 0.5,
        "bringup_timeout_s": 240,
        "replicas": 2,
    }
    cfg["router"] = {"stats_period_s": 1.0}
    path = tmp_path / "replicas.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out_json = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "router",
                "--config",
                str(path),
                "--policies",
                ",".join(POLICIES),
                "--workload",
                "sessions",
                "--requests",
                "6",
                "--clients",
                "2",
                "--output-scale",
                "0.03",
                "--max-text-words",
                "6",
                "--warmup",
                "2",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    # the warm-up ran on each policy's replicas and is not among the 6 measured requests (asserted below)
    assert re.findall(r"\[(\S+)\] warm-up: (\d+) requests, not measured", printed.err) == [
        (p, "2") for p in POLICIES
    ], printed.err
    out = [line for line in printed.out.splitlines() if "(raylet)" not in line]  # (Ray's own lines)
    out = out[next(i for i, line in enumerate(out) if line.startswith("workload ")) :]

    assert re.match(r"workload sessions, 2 replicas of .*, 6 requests \(0 turns too long", out[0]), out[0]
    assert out[0].endswith("after a warm-up of about 2 requests"), out[0]
    assert out[1].split() == [
        "policy",
        "tok/step",
        "accept",
        "hit",
        "tokens",
        "TTFT",
        "p50",
        "TTFT",
        "p99",
        "e2e",
        "p50",
        "e2e",
        "p99",
        "tok/s",
    ]
    rows = [line.split() for line in out[2:4]]
    assert [r[0] for r in rows] == list(POLICIES)
    for r in rows:  # tok/step, acceptance %, hit tokens (measured: a count), 2 x ms, 2 x s, tok/s
        assert len(r) == 9, r
        float(r[1]), float(r[2].rstrip("%")), int(r[3]), float(r[8])
        assert all(x.endswith("ms") for x in r[4:6]) and all(x.endswith("s") for x in r[6:8]), r
    # (no least-loaded in the run: no ratios to it)
    assert len(out) == 6 and out[4] == "ratios to round-robin:", out
    name, *pairs = out[5].split()
    assert name == "speculative" and [p.split("=")[0] for p in pairs] == list(METRICS), out[5]
    assert all(re.fullmatch(r"\d+\.\d\dx|-", p.split("=")[1]) for p in pairs), out[5]

    doc = json.loads(out_json.read_text())
    assert doc["settings"]["replicas"] == 2 and doc["settings"]["skipped"] == []
    assert doc["settings"]["rounds"] == 1 and len(doc["rounds"]) == 1
    results = doc["rounds"][0]["results"]
    assert [r["policy"] for r in results] == list(POLICIES)
    # every policy ran the same requests: the same prompts (seeded outputs, the same on any replica)
    assert len({(r["requests"], r["output_tokens"], r["prompt_tokens"]) for r in results}) == 1, results
    assert all(r["requests"] == 6 and r["prefix_hit_tokens"] >= 0 and sum(r["choices"].values()) == 6 for r in results)
    assert set(doc["rounds"][0]["ratios"]["round-robin"]["speculative"]) == set(METRICS)
