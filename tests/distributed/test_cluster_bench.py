"""`specdist bench cluster` end to end on the tiny models (smoke runs: it measures, it does not judge),
its Poisson arrivals, its JSON schema, its plots, its HTTP target and its flag errors."""

from __future__ import annotations

import json
import math
import socket

import pytest
import yaml
from support.helpers import serving_in_process, tiny_config

from specdist.bench import cluster_bench
from specdist.bench.cluster_bench import VARIANTS, poisson_arrivals
from specdist.cli import main

pytestmark = pytest.mark.ray

LEVEL_KEYS = {
    "variant",
    "mode",
    "label",
    "concurrency",
    "request_rate",
    "requests",
    "wall_s",
    "output_tokens",
    "output_tokens_per_s",
    "request_throughput",
    "acceptance",
    "phase_share",
    "phase_ms_per_step",
    "per_request",
    "pipeline_hit_rate",
    "draft_overlap",
    "passes_output_tokens_per_s",
} | {f"{m}_{s}_ms" for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")}
REQUEST_KEYS = {
    "ttft_s",
    "e2e_s",
    "tokens",
    "prompt_tokens",
    "drafted",
    "accepted",
    "pipeline_hits",
    "pipeline_misses",
    "itl_s",
}


def test_poisson_arrivals_are_reproducible_exponential_with_the_right_mean():
    n, rate = 4000, 5.0
    times = poisson_arrivals(n, rate, seed=7)
    assert times == poisson_arrivals(n, rate, seed=7) and times != poisson_arrivals(n, rate, seed=8)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    gaps = [b - a for a, b in zip(times, times[1:])]
    # the mean of N = 3999 exponential gaps has standard deviation (1/rate)/sqrt(N) = 1.58% of 1/rate;
    # a 5-sigma band (7.9%) fails for a correct generator with probability < 6e-7 over seeds
    assert abs(sum(gaps) / len(gaps) * rate - 1) < 5 / math.sqrt(len(gaps))
    from scipy import stats

    # the whole distribution: Kolmogorov-Smirnov against Exp(rate); a correct generator fails
    # with probability 1e-3 over seeds (uniform gaps of the same mean give p ~ 1e-100 here)
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 1e-3
    # every rate scales the same unit-rate draws; inf sends everything at once
    assert poisson_arrivals(50, 2.0, 7) == pytest.approx([t * rate / 2.0 for t in times[:50]], rel=1e-12)
    assert poisson_arrivals(5, math.inf, 7) == [0.0] * 5


def test_variants_are_config_overrides(tiny_models):
    """Every VARIANTS entry merged into a config is a valid config; no-spec drafts nothing, in
    process and on a deployment (where it also starts no draft worker); the rest is kept."""
    from specdist.bench.cluster_bench import apply_overrides
    from specdist.config import load_config

    base = tiny_config(tiny_models, "model", 3)
    deployment = {**base, "cluster": {"enabled": True, "tensor_parallel_size": 2, "num_draft_workers": 1}}
    for cfg in (base, deployment):
        full = load_config(cfg).to_dict()
        assert load_config(apply_overrides(full, VARIANTS["spec"])).to_dict() == full
        off = load_config(apply_overrides(full, VARIANTS["no-spec"])).to_dict()
        assert (off["draft"]["method"], off["draft"]["model"], off["cluster"]["num_draft_workers"]) == ("none", None, 0)
        assert off["target"] == full["target"] and off["engine"] == full["engine"]
        assert off["cluster"]["tensor_parallel_size"] == full["cluster"]["tensor_parallel_size"]
        for overrides in VARIANTS.values():
            load_config(apply_overrides(full, overrides))  # raises ConfigError if a variant is invalid
    assert apply_overrides({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 5}, "d": {"e": 1}}) == {
        "a": {"b": 5, "c": 2},
        "d": {"e": 1},
    }  # mappings merge, anything else is replaced


def test_bench_cluster_compares_pipelined_and_sequential_drafting(tiny_models, tmp_path, capsys):
    """The pipelined variant reports its hit rate (from the per-request stats over gRPC) and the
    draft overlap (hidden / all draft time, from the engine); the sequential one reports neither.
    --repeat 2: each variant's server runs twice, the order rotating, and each level pools its passes."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_models, "model", 3)))
    out_json = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "cluster",
                "--config",
                str(cfg),
                "--variants",
                "pipelined,sequential",
                "--concurrency",
                "2",
                "--requests",
                "2",
                "--max-tokens",
                "12",
                "--raw",
                "--temperature",
                "0",
                "--json",
                str(out_json),
                "--no-progress",
                "--repeat",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "pass 1/2: pipelined, sequential" in out.err and "pass 2/2: sequential, pipelined" in out.err
    assert out.err.count("starting a server on the in-process engine") == 4
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["repeat"] == 2
    assert [v["server_info"]["draft_pipeline"] for v in doc["variants"]] == [True, False]
    piped, seq = doc["levels"]
    for r in (piped, seq):
        assert r["requests"] == 4 and len(r["per_request"]) == 4 and r["output_tokens"] == 4 * 12
        rates = r["passes_output_tokens_per_s"]
        assert len(rates) == 2 and all(x > 0 for x in rates)
        # pooled: all tokens over both passes' seconds, between the two passes' own rates
        assert r["output_tokens_per_s"] == pytest.approx(4 * 12 / r["wall_s"], rel=1e-12)
        assert min(rates) * (1 - 1e-9) <= r["output_tokens_per_s"] <= max(rates) * (1 + 1e-9)
        assert abs(sum(r["phase_share"].values()) - 1) < 1e-6
    hits = sum(p["pipeline_hits"] for p in piped["per_request"])
    misses = sum(p["pipeline_misses"] for p in piped["per_request"])
    assert hits + misses > 0 and piped["pipeline_hit_rate"] == hits / (hits + misses)
    assert 0 < piped["draft_overlap"] <= 1
    assert seq["pipeline_hit_rate"] is None and seq["draft_overlap"] is None
    # greedy: the same tokens either way
    assert [p["tokens"] for p in piped["per_request"]] == [p["tokens"] for p in seq["per_request"]]
    ratio = piped["output_tokens_per_s"] / seq["output_tokens_per_s"]
    per_pass = ", ".join(
        f"{a / b:.2f}" for a, b in zip(piped["passes_output_tokens_per_s"], seq["passes_output_tokens_per_s"])
    )
    assert f"- C=2: pipelined / sequential = {ratio:.2f}x (passes: {per_pass})" in out.out


def test_bench_cluster_runs_spec_and_no_spec(tiny_models, tmp_path, capsys, monkeypatch):
    """Closed-loop and Poisson levels through in-process servers of both variants; --json, --plot,
    --hf-baseline and the progress bar (stderr taken for a terminal) in one run."""
    monkeypatch.setattr(cluster_bench, "_stderr_is_tty", lambda: True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_models, "model", 3)))
    out_json, prefix = tmp_path / "r.json", tmp_path / "fig"
    rc = main(
        [
            "bench",
            "cluster",
            "--config",
            str(cfg),
            "--concurrency",
            "1,3",
            "--request-rate",
            "40,inf",
            "--requests",
            "3",
            "--max-tokens",
            "6",
            "--raw",
            "--json",
            str(out_json),
            "--hf-baseline",
            "2",
            "--plot",
            str(prefix),
        ]
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "specdist.bench.cluster/1"
    assert doc["settings"] == {
        "max_tokens": 6,
        "temperature": 0.8,
        "raw": True,
        "seed": 0,
        "requests": 3,
        "concurrency": [1, 3],
        "request_rate": [40.0, "inf"],
        "protocol": "grpc",
        "repeat": 1,
    }
    assert [(v["name"], v["source"], v["overrides"]) for v in doc["variants"]] == [
        (name, "config", VARIANTS[name]) for name in ("spec", "no-spec")
    ]
    assert [v["server_info"]["draft_method"] for v in doc["variants"]] == ["model", "none"]
    assert doc["variants"][1]["config"]["draft"]["method"] == "none"
    hf = doc["hf_plain"]
    assert hf["requests"] == 2 and hf["output_tokens_per_s"] > 0
    rows = doc["levels"]
    assert [(r["variant"], r["label"], r["concurrency"], r["request_rate"]) for r in rows] == [
        (v, *lv)
        for v in ("spec", "no-spec")
        for lv in (("C=1", 1, None), ("C=3", 3, None), ("R=40/s", None, 40.0), ("R=inf", None, "inf"))
    ]
    for r in rows:
        assert set(r) == LEVEL_KEYS | {"vs_hf_plain"}
        assert abs(r["vs_hf_plain"] * hf["output_tokens_per_s"] - r["output_tokens_per_s"]) < 1e-6
        assert r["output_tokens"] == 3 * 6 and r["output_tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0
        assert r["request_throughput"] == pytest.approx(3 / r["wall_s"], rel=1e-12)  # 3 requests each
        assert (r["acceptance"] is None) == (r["variant"] == "no-spec")
        assert len(r["per_request"]) == 3
        for p in r["per_request"]:
            assert set(p) == REQUEST_KEYS and p["tokens"] == 6 and 0 < p["ttft_s"] <= p["e2e_s"]
            # gRPC: one gap per token after the first message (which holds 1 token without speculation),
            # together at most the time from the first to the last token (1e-5: values rounded to 1 us)
            assert 1 <= len(p["itl_s"]) <= 5 and (len(p["itl_s"]) == 5 or r["variant"] == "spec")
            assert sum(p["itl_s"]) <= p["e2e_s"] - p["ttft_s"] + 1e-5
        assert r["phase_share"]["verify"] > 0
        assert abs(sum(r["phase_share"].values()) - 1) < 1e-6, r["phase_share"]
        assert r["phase_share"]["scheduling"] > 0 and r["phase_share"]["network+serialization"] == 0  # in process
    out = capsys.readouterr()
    assert "| spec | C=3 | 3 |" in out.out and "| no-spec | R=inf | 3 |" in out.out and "| spec | R=40/s |" in out.out
    assert "orchestration" in out.out and "transformers generate, one request at a time" in out.out
    assert "spec C=3: 100%" in out.err and "no-spec R=inf: 100%" in out.err and "3/3" in out.err  # tqdm's bars
    import matplotlib.image

    for kind in ("throughput", "latency"):
        path = tmp_path / f"fig-{kind}.png"
        assert f"wrote {path}" in out.out
        img = matplotlib.image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0  # drawn, not blank
    from specdist.bench import bench_plot

    assert bench_plot.main([str(out_json), str(tmp_path / "again")]) == 0  # redrawn from the --json file
    for kind in ("throughput", "latency"):
        assert (
            matplotlib.image.imread(tmp_path / f"again-{kind}.png").shape
            == matplotlib.image.imread(tmp_path / f"fig-{kind}.png").shape
        )


@pytest.fixture(scope="module")
def both_protocols(tiny_models):
    """``specdist serve --http-port`` in process: gRPC and HTTP over one coordinator, free loopback ports."""
    with serving_in_process(tiny_models) as (_, serving):
        yield serving


def _by_variant(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in doc["levels"]:
        out.setdefault(r["variant"], []).append(r)
    return out


def test_http_target_counts_the_same_tokens_as_grpc(both_protocols, tiny_models, tmp_path):
    """--server and --http against one server (chat template, greedy): the same tokens, prompt tokens,
    drafted and accepted per request; with --raw, also an in-process server reached over HTTP."""
    grpc_addr, url = both_protocols.address, f"http://{both_protocols.http.address}"
    out_json = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "cluster",
                "--server",
                grpc_addr,
                "--http",
                url,
                "--concurrency",
                "1",
                "--request-rate",
                "inf",
                "--requests",
                "3",
                "--max-tokens",
                "7",
                "--temperature",
                "0",
                "--no-progress",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    doc = json.loads(out_json.read_text())
    assert [(v["name"], v["protocol"], v["server_info"]["draft_method"]) for v in doc["variants"]] == [
        (grpc_addr, "grpc", "model"),
        (url, "http", "model"),
    ]
    levels = _by_variant(doc)
    for g, h in zip(levels[grpc_addr], levels[url], strict=True):
        assert set(h) == LEVEL_KEYS and g["label"] == h["label"]
        assert g["output_tokens"] == h["output_tokens"] == 3 * 7
        for pg, ph in zip(g["per_request"], h["per_request"], strict=True):
            assert (pg["tokens"], pg["prompt_tokens"]) == (ph["tokens"], ph["prompt_tokens"])
            assert pg["prompt_tokens"] > 0 and 0 < ph["ttft_s"] <= ph["e2e_s"] and ph["itl_s"]
            if g["label"] == "C=1":  # one request at a time: the same steps, so the same drafts
                assert (pg["drafted"], pg["accepted"]) == (ph["drafted"], ph["accepted"]) and ph["drafted"] > 0

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_models, "model", 3)))
    assert (
        main(
            [
                "bench",
                "cluster",
                "--server",
                grpc_addr,
                "--http",
                url + "/v1/",
                "--config",
                str(cfg),
                "--protocol",
                "http",
                "--variants",
                "spec",
                "--raw",
                "--concurrency",
                "1",
                "--requests",
                "2",
                "--max-tokens",
                "5",
                "--temperature",
                "0",
                "--no-progress",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    doc = json.loads(out_json.read_text())
    assert [(v["name"], v["protocol"]) for v in doc["variants"]] == [
        (grpc_addr, "grpc"),
        (url, "http"),
        ("spec", "http"),
    ]
    per_request = [
        [(p["tokens"], p["prompt_tokens"], p["drafted"], p["accepted"]) for p in r["per_request"]]
        for r in doc["levels"]
    ]
    assert per_request[0] == per_request[1] == per_request[2] and per_request[0][0][0] == 5
    assert doc["levels"][2]["phase_share"]["verify"] > 0  # the in-process server's breakdown, also over HTTP


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once closed


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--server", "x:1", "--request-rate", "0"], "--request-rate: need positive requests/s or inf"),
        (["--server", "x:1", "--request-rate", "fast"], "--request-rate: need positive requests/s or inf"),
        (["--server", "x:1", "--request-rate", "1,,2"], "--request-rate: a comma-separated list without empty"),
        (["--server", "x:1", "--concurrency", "0"], "--concurrency: need positive integers"),
        (["--server", "x:1", "--concurrency", "2.5"], "--concurrency: need positive integers"),
        (["--request-rate", "1"], "--server, --http or --config: say what to measure"),
        (["--http", "127.0.0.1:8000"], "--http: need a base URL like http://127.0.0.1:8000"),
        (["--config", "c.yaml", "--variants", "spec,fast"], "--variants: a comma-separated subset of spec,no-spec"),
        (["--server", "x:1", "--plot", "/nonexistent/dir/fig"], "--plot: the directory of '/nonexistent/dir/fig'"),
        (["--server", "x:1", "--requests", "-1"], "--requests: must be >= 0"),
        (["--server", "x:1", "--repeat", "0"], "--repeat: must be >= 1"),
        (["--http", "http://127.0.0.1:{port}"], "http://127.0.0.1:{port}/v1/models: cannot connect"),
        (["--server", "127.0.0.1:{port}"], "--server 127.0.0.1:{port}: UNAVAILABLE"),
    ],
)
def test_invalid_flags_are_one_line_errors(flags, message, capsys):
    port = _closed_port()
    flags, message = [f.format(port=port) for f in flags], message.format(port=port)
    with pytest.raises(SystemExit) as e:
        main(["bench", "cluster", "--no-progress", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdist: error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("module, flags", [("matplotlib", ["--plot", "fig"]), ("tqdm", [])])
def test_a_missing_optional_package_is_a_one_line_error(module, flags, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, module, None)  # `import module` raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["bench", "cluster", "--server", "x:1", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and module in err and "pip install" in err, err


def test_bench_cluster_over_a_ray_deployment(local_ray, tiny_models, tmp_path, capsys):
    """--config with cluster.enabled: the bench brings the Ray deployment up (1 target rank + 2
    draft workers over gRPC; test_worker_faults and test_multinode run tensor-parallel
    ones) on the running local Ray cluster, measures it, reports the network share, and tears
    its deployment down, leaving Ray up (not the bench's to stop). A local Ray the command
    starts itself is shut down by the same Backend.close: test_cli's demo test."""
    import ray
    from support.helpers import assert_nothing_left_on_ray

    cfg = tiny_config(tiny_models, "model", 3)
    cfg["cluster"] = {
        "enabled": True,
        "tensor_parallel_size": 1,
        "num_draft_workers": 2,
        "cpus_per_rank": 0.5,
        "cpus_per_draft": 0.5,
        "bringup_timeout_s": 180,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out_json = tmp_path / "r.json"
    rc = main(
        [
            "bench",
            "cluster",
            "--config",
            str(path),
            "--concurrency",
            "2",
            "--requests",
            "2",
            "--max-tokens",
            "5",
            "--raw",
            "--variants",
            "spec",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert doc["variants"][0]["server_info"]["draft_replicas"] == 2
    [row] = doc["levels"]
    assert row["variant"] == "spec" and row["output_tokens_per_s"] > 0 and row["acceptance"] is not None
    share = row["phase_share"]
    assert share["network+serialization"] > 0 and share["draft"] > 0 and share["verify"] > 0
    assert abs(sum(share.values()) - 1) < 1e-6
    assert ray.is_initialized()  # Ray was up before the bench: left running
    assert_nothing_left_on_ray()  # the deployment's actors are dead and its placement groups removed
