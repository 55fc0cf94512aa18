"""Speculative groups as Ray Serve replicas (cluster/serve.py) behind the unchanged gRPC and HTTP front doors.

On the tests' local Ray cluster (4 logical CPUs, loopback): two replicas of the tiny models, each one target rank
and one draft worker placed in its replica's placement group. Checked: a seeded sampled request gives the same
tokens on either replica (the router sends it to both in turn), greedy equals the in-process engine, cancel
reaches the replica, the replicas' counters come back to 0, and stopping leaves nothing on Ray.
"""

from __future__ import annotations

import time

import pytest
from support.helpers import LoopThread, assert_nothing_left_on_ray, tiny_config, wait_until

from specdist.client import SpecDistClient
from specdist.config import load_config
from specdist.engine.local import Engine
from specdist.sampling_params import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.replicas]

POLL_LIMIT_S = 120.0
PROMPT = [1, 2, 3, 4]


def _config(tiny_models, replicas=2, policy: str = "round-robin") -> dict:
    cfg = tiny_config(tiny_models, method="model", k=3)
    cfg["cluster"] = {
        "enabled": True,
        "tensor_parallel_size": 1,
        "num_draft_workers": 1,
        "cpus_per_rank": 0.5,
        "cpus_per_draft": 0.5,
        "bringup_timeout_s": 240,
        "health_interval_s": 0.5,
        "replicas": replicas,
    }
    cfg["router"] = {"policy": policy, "stats_period_s": 5.0}
    return cfg


def test_two_replicas_serve_the_same_tokens(local_ray, tiny_models):
    from specdist.api.serving import start_serving

    cfg = _config(tiny_models)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = Engine.from_config(tiny_config(tiny_models, method="model", k=3)).generate([PROMPT], greedy)[0].token_ids
    lt = LoopThread()
    serving = None
    try:
        serving = lt.run(start_serving(cfg, "127.0.0.1", 0, http_port=0), timeout=300)
        front = serving.backend.replicas.front
        client = SpecDistClient(serving.address, timeout=POLL_LIMIT_S)
        info = client.server_info()
        assert (info.tensor_parallel_size, info.draft_replicas, info.draft_method) == (1, 1, "model")
        assert (info.replicas, info.router_policy) == (2, "round-robin")

        # a seeded sampled request: the same tokens whichever replica ran it (round-robin: both do)
        runs = [
            client.generate_text(PROMPT, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)[1] for _ in range(4)
        ]
        assert len(front.routed) == 2, front.routed  # (round-robin over the trusted reports: each got some)
        assert all(r == runs[0] for r in runs), runs
        assert client.generate_text(PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)[1] == want
        # /metrics: the replicas and the router's choices, one series per replica
        import urllib.request

        with urllib.request.urlopen(f"http://{serving.http.address}/metrics", timeout=30) as r:
            text = r.read().decode()
        assert "specdist_replicas 2.0" in text
        routed = [line for line in text.splitlines() if line.startswith("specdist_router_requests_total{")]
        assert len(routed) == 2 and all('policy="round-robin"' in line for line in routed), routed
        assert sum(float(line.rsplit(" ", 1)[1]) for line in routed) == 5

        # cancel: the stream ends, the replica aborts it; the replicas' counters back at 0
        async def cancel_one() -> str:
            s = await front.open(
                PROMPT, SamplingParams(max_tokens=2000, ignore_eos=True, temperature=1.0, seed=1), request_id="long"
            )
            first = await s.__anext__()
            assert first.token_ids
            assert await front.cancel("long")
            return s.replica_id

        assert lt.run(cancel_one(), timeout=POLL_LIMIT_S)

        wait_until(
            "the replicas report no request",
            lambda: (
                serving.backend.replicas.reports.counters().get("live_requests", -1) == 0
                and front.counters()["live_requests"] == 0
            ),
            POLL_LIMIT_S,
            0.2,
        )
        assert front.counters()["requests_cancelled"] == 1
    finally:
        if serving is not None:
            lt.run(serving.stop(drain_seconds=2), timeout=180)
        lt.close()
    wait_until("Serve's actors gone", _no_live_actors, 60, 0.5)
    assert_nothing_left_on_ray()


def _no_live_actors() -> bool:
    from ray._private.state import actors as actor_table

    return all(a["State"] == "DEAD" for a in actor_table().values())


def test_more_replicas_than_the_cluster_holds_fail_at_once_naming_what_is_missing(local_ray, tiny_models):
    from cluster.serve import ReplicasError
    from specdist.api.serving import start_backend

    t0 = time.monotonic()
    with pytest.raises(ReplicasError, match=r"cluster.replicas: 8 replica\(s\) need .*missing \{CPU: 4.8\}"):
        start_backend(load_config(_config(tiny_models, replicas=8)))
    assert time.monotonic() - t0 < 30
    assert_nothing_left_on_ray()


def _rank_pids_by_replica() -> dict[str, int]:
    """Each Serve replica's (one) live target rank's process id, by replica id: a rank is owned by the replica's
    worker process (the replica's Deployment created it), so its owner's address is the replica actor's."""
    from ray._private.state import actors as actor_table

    table = list(actor_table().values())
    alive = [a for a in table if a["State"] == "ALIVE"]
    replicas = {(a["Address"]["IPAddress"], a["Address"]["Port"]): a["Name"] for a in alive}
    ranks = [a for a in alive if a["ActorClassName"] == "TargetRankActor"]
    return {replicas[(a["OwnerAddress"]["IPAddress"], a["OwnerAddress"]["Port"])]: a["Pid"] for a in ranks}


def test_a_replica_losing_its_target_rank_under_load(local_ray, tiny_models):
    """SIGKILL one replica's target rank mid-stream: that replica's streams end with UNAVAILABLE within seconds
    (those with no token yet go to the other replica), new requests meanwhile are answered by the other, the
    group is rebuilt and serves again, and every counter is back at 0."""
    import asyncio
    import os
    import signal

    from specdist.api.serving import start_serving
    from specdist.errors import ErrorCode

    cfg = _config(tiny_models, policy="least-loaded")
    cfg["engine"]["max_model_len"] = 128  # (the tiny models' whole window: the streams run as long as they can)
    cfg["cluster"].update(health_interval_s=0.2, health_timeout_s=2.0, collective_timeout_s=3.0)
    lt = LoopThread()
    serving = None
    try:
        serving = lt.run(start_serving(cfg, "127.0.0.1", 0), timeout=300)
        front = serving.backend.replicas.front
        params = SamplingParams(max_tokens=120, ignore_eos=True, temperature=1.0, seed=3)
        rank_of = _rank_pids_by_replica()
        assert len(rank_of) == 2, rank_of

        async def run() -> tuple[str, str, list]:
            streams = [await front.open([1, 2, 3, i], params, request_id=f"s{i}") for i in range(6)]
            # the victim: the replica of the stream opened last (the tiny model may finish the earlier ones of
            # its replica before the kill; this one is killed as its first token arrives)
            watched = streams[-1]
            victim = watched.replica_id
            first = await watched.__anext__()
            os.kill(rank_of[victim], signal.SIGSTOP)  # its replica's steps stop here...
            os.kill(rank_of[victim], signal.SIGKILL)  # ... and its rank dies
            killed = time.monotonic()
            ends = []
            for s in streams:
                last = first if s is watched else await asyncio.wait_for(s.__anext__(), 60)
                while not last.finished:
                    last = await asyncio.wait_for(s.__anext__(), 60)
                ends.append((s.request_id, s.replica_id, last.finish_reason, last.code, time.monotonic() - killed))
            return victim, watched.request_id, ends

        victim, watched, ends = lt.run(run(), timeout=180)
        for request_id, rid, reason, code, after in ends:
            if request_id == watched:  # mid-stream on the victim: ends in error, within seconds
                assert (rid, reason, code) == (victim, "error", ErrorCode.UNAVAILABLE) and after < 15, ends
            elif rid == victim:  # opened earlier there: run to its end before the kill, or ended by it
                assert reason == "length" or (code == ErrorCode.UNAVAILABLE and after < 15), ends
            else:  # the other replica's streams: untouched
                assert reason == "length", ends

        # meanwhile (the group rebuilding) new requests are answered: by the other replica
        client = SpecDistClient(serving.address, timeout=POLL_LIMIT_S)
        for i in range(4):
            assert client.generate_text([2, i], temperature=0.0, max_tokens=8, ignore_eos=True)[2] == "length"
        # the group is rebuilt in its replica and serves again; nothing left on either
        wait_until(
            "the rebuilt replica reports accepting again",
            lambda: len([r for r in serving.backend.replicas.reports.fresh().values() if r.get("accepting")]) == 2,
            POLL_LIMIT_S,
            0.2,
        )
        wait_until(
            "both replicas' counters at 0",
            lambda: (
                serving.backend.replicas.reports.counters().get("live_requests", -1) == 0
                and front.counters()["live_requests"] == 0
            ),
            POLL_LIMIT_S,
            0.2,
        )
    finally:
        if serving is not None:
            lt.run(serving.stop(drain_seconds=2), timeout=180)
        lt.close()
    wait_until("Serve's actors gone", _no_live_actors, 60, 0.5)
    assert_nothing_left_on_ray()


@pytest.fixture
def one_replica_cluster():
    """A Ray cluster of this machine's processes with room for one replica only (1 CPU at its head; the test's
    replica takes 0.1 + 0.45 + 0.45): the second node (1 CPU) joins when the test says. Torn down with no raylet
    left."""
    import ray
    from ray.cluster_utils import Cluster
    from support.helpers import raylets, stop_local_ray

    if ray.is_initialized():  # the shared local cluster of other tests: not this one
        stop_local_ray()
    lean = {"include_log_monitor": False}
    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, "no_monitor": True, **lean}
    )
    try:
        ray.init(address=c.address, log_to_driver=False)
        yield c, lambda: c.add_node(num_cpus=1, **lean)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        wait_until("every raylet gone", lambda: raylets() == 0, 30, 0.2)


def test_autoscaling_grows_with_a_queue_and_shrinks_when_idle(one_replica_cluster, tiny_models):
    """cluster.replicas {min 1, max 2}: a queue of requests makes Serve want a second replica, which starts once a
    node with room joins; with both serving, idle time shrinks them back to one (drained: its streams end
    first). Every request is answered."""
    import threading

    from ray import serve

    from cluster.serve import APP_NAME, DEPLOYMENT_NAME
    from specdist.api.serving import start_serving

    _, add_node = one_replica_cluster
    cfg = _config(
        tiny_models,
        replicas={"min": 1, "max": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5, "downscale_delay_s": 4},
        policy="least-loaded",
    )
    cfg["cluster"].update(cpus_per_rank=0.45, cpus_per_draft=0.45)

    def states() -> dict:
        return dict(serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states or {})

    lt = LoopThread()
    serving = None
    stop, results, lock = threading.Event(), [], threading.Lock()
    try:
        serving = lt.run(start_serving(cfg, "127.0.0.1", 0), timeout=300)
        front = serving.backend.replicas.front
        assert states() == {"RUNNING": 1}

        def clients(i: int) -> None:
            client = SpecDistClient(serving.address, timeout=POLL_LIMIT_S)
            for n in range(400):  # bounded: the test stops it long before
                if stop.is_set():
                    break
                _, ids, finish, _ = client.generate_text([1, i, n % 7], temperature=0.0, max_tokens=40, ignore_eos=True)
                with lock:
                    results.append((finish, len(ids)))

        threads = [threading.Thread(target=clients, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        wait_until("Serve wants a second replica", lambda: sum(states().values()) == 2, POLL_LIMIT_S, 0.2)
        add_node()  # a node with room joins: the pending replica is placed and comes up
        wait_until("two replicas running", lambda: states().get("RUNNING") == 2, 240, 0.5)
        wait_until("both replicas took requests", lambda: len(front.routed) == 2, POLL_LIMIT_S, 0.2)
        stop.set()
        for t in threads:
            t.join(POLL_LIMIT_S)
        wait_until("idle: back to one replica", lambda: states() == {"RUNNING": 1}, 120, 0.5)
        assert results and all(r == ("length", 40) for r in results), results[:5]
        assert front.counters()["requests_total"] == front.counters()["requests_finished"] == len(results)
    finally:
        stop.set()
        if serving is not None:
            lt.run(serving.stop(drain_seconds=2), timeout=180)
        lt.close()


def test_the_serve_application_serves_grpc_from_its_front_deployment(local_ray, tiny_models):
    """cluster.serve:build_app, as a RayService's Serve config imports it: a front deployment serving gRPC on its
    port over one replica; a config without cluster.replicas is refused in one line."""
    import socket

    from ray import serve

    from cluster.serve import ReplicasError, build_app

    cfg = tiny_config(tiny_models, method="model", k=3)
    with pytest.raises(ReplicasError, match=r"^cluster.replicas: a Serve application needs it set"):
        build_app({"config": {**cfg, "cluster": {"enabled": True, "num_draft_workers": 1}}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(proxy_location="Disabled")
    try:
        serve.run(
            build_app({"config": _config(tiny_models, replicas=1), "grpc_port": port, "host": "127.0.0.1"}),
            name="specdist-rs",
            route_prefix=None,
        )
        client = SpecDistClient(f"127.0.0.1:{port}", timeout=POLL_LIMIT_S)
        wait_until("the front sees its replica", lambda: client.server_info().replicas == 1, POLL_LIMIT_S, 0.2)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        want = Engine.from_config(cfg).generate([PROMPT], greedy)[0].token_ids
        assert client.generate_text(PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)[1] == want
        assert client.health() == "SERVING"
    finally:
        serve.shutdown()
    wait_until("Serve's actors gone", _no_live_actors, 60, 0.5)
    assert_nothing_left_on_ray()
