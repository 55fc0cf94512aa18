"""`specdist serve` on a Ray deployment, in process, the way run_serve does it.

start_serving (specdist.serve_cli) with cluster.enabled: Deployment (2-rank tensor-parallel
tiny target + 2 draft workers on a local Ray) -> RemoteEngine -> the public server. Through
SpecDistClient: greedy output equal to the single-process Engine, 8 concurrent clients,
GetServerInfo, the OpenAI-compatible HTTP API over the same coordinator, counters back to zero;
then stop(): no actor alive, placement groups
removed, and after ray.shutdown no raylet left (conftest's shared local_ray cluster checks that when
it stops).
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

from conftest import LoopThread, tiny_config
from specdist.client import SpecDistClient
from specdist.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3], [4], [5, 6, 1, 2, 3, 4], [2, 2], [6, 5, 4], [3], [1, 6], [0, 4, 2, 1]]
MAX_TOKENS = [8, 5, 12, 7, 9, 4, 10, 6]
GAUGES = ("running_requests", "queued_requests", "target_kv_slots_used", "draft_kv_slots_used", "active_streams")


def _cluster_config(tiny_models) -> dict:
    cfg = tiny_config(tiny_models, method="model", k=3)
    cfg["cluster"] = {"enabled": True, "tensor_parallel_size": 2, "num_draft_workers": 2,
                      "cpus_per_rank": 0.5, "cpus_per_draft": 0.5, "bringup_timeout_s": 180}
    return cfg


def test_serve_on_ray_deployment_matches_engine_and_stops_clean(local_ray, tiny_models):
    from specdist.engine import Engine
    from specdist.serve_cli import start_serving

    cfg = _cluster_config(tiny_models)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=(i % 2 == 0)) for i, m in enumerate(MAX_TOKENS)]
    want = [o.token_ids for o in Engine.from_config(tiny_config(tiny_models, method="model", k=3)).generate(
        PROMPTS, params)]

    lt = LoopThread()
    serving = None
    try:
        serving = lt.run(start_serving(cfg, "127.0.0.1", 0, http_port=0), timeout=240)
        backend = serving.backend
        assert backend.deployment is not None and not backend.owns_ray  # Ray was already up: not ours to stop
        assert len(backend.draft_addresses) == 2
        dep = backend.deployment
        actors, pgs = dep.actors(), list(dep.placement.groups)
        assert len(actors) == 4

        with SpecDistClient(serving.address, timeout=120) as client:
            info = client.server_info()
            assert info.tensor_parallel_size == 2 and info.draft_replicas == 2
            assert info.draft_method == "model" and info.num_speculative_tokens == 3
            # several prompts one after another
            for i in (0, 1, 2):
                text, ids, _, stats = client.generate_text(PROMPTS[i], temperature=0.0, max_tokens=MAX_TOKENS[i],
                                                           ignore_eos=(i % 2 == 0))
                assert ids == want[i], i
                assert stats.drafted > 0
                if i == 0:  # the same request through the HTTP API: the same text and stats
                    import openai

                    http = openai.OpenAI(base_url=f"http://{serving.http.address}/v1", api_key="unused",
                                         max_retries=0, timeout=120)
                    got_http = http.completions.create(model=cfg["target"]["model"], prompt=PROMPTS[0],
                                                       temperature=0.0, max_tokens=MAX_TOKENS[0],
                                                       extra_body={"ignore_eos": True})
                    http.close()
                    assert got_http.choices[0].text == text
                    spec = got_http.usage.model_extra["speculative"]
                    assert (got_http.usage.completion_tokens, spec["drafted"], spec["accepted"]) == (
                        stats.output_tokens, stats.drafted, stats.accepted)

        # 8 concurrent clients, each its own channel
        got: list = [None] * len(PROMPTS)
        errors: list = []

        def one(i: int) -> None:
            try:
                with SpecDistClient(serving.address, timeout=120) as c:
                    got[i] = c.generate_text(PROMPTS[i], temperature=0.0, max_tokens=MAX_TOKENS[i],
                                             ignore_eos=(i % 2 == 0))[1]
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert got == want

        with SpecDistClient(serving.address, timeout=30) as client:
            deadline = time.monotonic() + 10
            while True:  # gauges are as of the coordinator's last tick
                counters = client.server_info().counters
                if all(counters[g] == 0 for g in GAUGES) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert all(counters[g] == 0 for g in GAUGES), counters
            assert counters["requests_finished"] == 3 + 1 + len(PROMPTS) and counters["requests_failed"] == 0, counters
        health = dep.health()
        assert all(h["ok"] and h["requests"] == 0 for h in health.values()), health

        lt.run(serving.stop(drain_seconds=2), timeout=120)
        serving = None
        # no actor alive, the placement groups removed, the resources back
        for a in actors:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(a.ping.remote(), timeout=30)
        table = ray.util.placement_group_table()
        for pg in pgs:
            assert table[pg.id.hex()]["state"] == "REMOVED"
        from ray._private.state import actors as actor_table

        assert all(a["State"] == "DEAD" for a in actor_table().values()), actor_table()
        deadline = time.monotonic() + 20
        while ray.available_resources().get("CPU", 0) < 4.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) == pytest.approx(4.0)
    finally:
        if serving is not None:
            lt.run(serving.stop(drain_seconds=0), timeout=120)
        lt.close()


def test_cluster_config_errors_name_the_key(tiny_models):
    from specdist.config import load_config
    from specdist.errors import ConfigError

    cfg = _cluster_config(tiny_models)
    cfg["cluster"]["num_draft_workers"] = 0
    with pytest.raises(ConfigError, match=r"cluster\.num_draft_workers.*>= 1 when draft.method is 'model'"):
        load_config(cfg)
    cfg = _cluster_config(tiny_models)
    cfg["cluster"]["use_gpu"] = "maybe"
    with pytest.raises(ConfigError, match=r"cluster\.use_gpu"):
        load_config(cfg)
    cfg = _cluster_config(tiny_models)
    cfg["cluster"]["enabled"] = "yes"
    with pytest.raises(ConfigError, match=r"cluster\.enabled"):
        load_config(cfg)
    assert load_config(None).cluster.enabled is False


def test_tp_that_does_not_divide_heads_fails_bring_up_and_cleans_up(local_ray, tiny_models):
    """3 ranks over 4 heads: the deployment names the phase and the reason, and leaves nothing behind."""
    from cluster.deployment import DeploymentError
    from specdist.serve_cli import start_backend

    cfg = _cluster_config(tiny_models)
    cfg["cluster"].update(tensor_parallel_size=3, num_draft_workers=1)
    with pytest.raises(DeploymentError, match=r"not divisible by 3"):
        start_backend(cfg)
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
