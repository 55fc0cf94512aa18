"""A whole deployment on a local Ray cluster: a 2-rank tensor-parallel target + 2 draft workers.

Greedy generation driven over the real gRPC stubs (the coordinator loop of test_workers.py),
a ragged batch split across the two drafts and run concurrently against the one target,
must equal the single-process Engine token for token. Then health, drain, and a stop that
leaves no actor, no actor process and no placement group behind.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
import ray

from conftest import tiny_config
from test_workers import K, MAX_TOKENS, PROMPTS, run_generation
from cluster.deployment import ClusterSpec, Deployment
from specdist.sampling_params import SamplingParams
from specdist.v1 import draft_pb2, draft_pb2_grpc, target_pb2_grpc

BRING_UP_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def deployment(local_ray, tiny_models):
    spec = ClusterSpec(tensor_parallel_size=2, num_draft_workers=2, cpus_per_rank=0.5, cpus_per_draft=0.5)
    dep = Deployment(spec)
    target_addr, draft_addrs = dep.start(tiny_config(tiny_models, method="model", k=K), timeout_s=BRING_UP_TIMEOUT_S)
    try:
        yield dep, target_addr, draft_addrs
    finally:
        dep.stop()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a reaped-late zombie still answers kill(0); it runs nothing
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_deployment_generates_like_engine_then_stops_clean(deployment, tiny_models):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdist.engine import Engine
    from specdist.models.loader import eos_token_ids

    dep, target_addr, draft_addrs = deployment
    assert len(draft_addrs) == 2 and len(set(draft_addrs + [target_addr])) == 3

    # ---- health of every actor, before any traffic
    health = dep.health()
    assert set(health) == {"target rank 0", "target rank 1", "draft 0", "draft 1"}
    assert all(h["ok"] for h in health.values()), health
    assert health["target rank 0"]["state"] == "serving" and health["target rank 0"]["address"] == target_addr
    assert health["target rank 1"]["following"] and health["target rank 1"]["world_size"] == 2
    assert [health[f"draft {i}"]["address"] for i in range(2)] == draft_addrs
    assert all(health[n]["warmup_s"] is not None for n in ("target rank 0", "draft 0", "draft 1"))
    assert len({h["pid"] for h in health.values()}) == 4  # one process per actor
    pids = [h["pid"] for h in health.values()]

    # ---- the reference: single-process engine
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=(i % 2 == 0)) for i, m in enumerate(MAX_TOKENS)]
    engine = Engine.from_config(tiny_config(tiny_models, method="model", k=K))
    want = [o.token_ids for o in engine.generate(PROMPTS, params)]
    eos = eos_token_ids(engine.target.model, engine.tokenizer)

    # ---- over gRPC: requests 0, 2 on draft 0 and 1, 3 on draft 1, both batches at once on the one target
    chans = [grpc.insecure_channel(a) for a in [target_addr, *draft_addrs]]
    try:
        for ch in chans:
            grpc.channel_ready_future(ch).result(timeout=30)
            hstub = health_pb2_grpc.HealthStub(ch)
            assert hstub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        tstub = target_pb2_grpc.TargetWorkerStub(chans[0])
        dstubs = [draft_pb2_grpc.DraftWorkerStub(ch) for ch in chans[1:]]
        split = [[0, 2], [1, 3]]
        got: list = [None] * len(PROMPTS)
        errors: list = []

        def drive(d: int) -> None:
            try:
                idx = split[d]
                outs, _ = run_generation(tstub, dstubs[d], [PROMPTS[i] for i in idx], [params[i] for i in idx], eos,
                                         prefix=f"dep{d}-")
                for i, o in zip(idx, outs):
                    got[i] = o
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(d,)) for d in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert got == want

        health = dep.health()
        assert all(h["ok"] and h["requests"] == 0 for h in health.values()), health
        # rank 1 replays rank 0's frees with the next forward (or the shutdown broadcast), so only
        # the serving actors are checked for free KV slots here
        assert all(health[n]["kv_slots_in_use"] == 0 for n in ("target rank 0", "draft 0", "draft 1")), health
        assert health["target rank 1"]["following"]

        # ---- drain: no new requests (UNAVAILABLE), health NOT_SERVING
        drained = dep.drain(timeout_s=5)
        assert all(d["drained"] for d in drained.values()), drained
        with pytest.raises(grpc.RpcError) as ei:
            dstubs[1].Start(draft_pb2.StartRequest(items=[draft_pb2.StartItem(request_id="late", prompt_token_ids=[1])]))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        hstub = health_pb2_grpc.HealthStub(chans[0])
        assert hstub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        for ch in chans:
            ch.close()

    # ---- stop: every actor dead, its process gone, the placement groups removed
    actors = dep.actors()
    pgs = list(dep.placement.groups)
    follower_refs = list(dep.follower_refs.values())
    dep.stop()
    forwards = ray.get(follower_refs, timeout=10)  # run_follower() returned normally: released, not killed
    assert len(forwards) == 1 and forwards[0] > 0
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.ping.remote(), timeout=30)
    table = ray.util.placement_group_table()
    for pg in pgs:
        assert table[pg.id.hex()]["state"] == "REMOVED"
    deadline = time.monotonic() + 20
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_pid_alive(p) for p in pids), [p for p in pids if _pid_alive(p)]
    _assert_nothing_left()  # resources come back asynchronously after the groups are removed
    dep.stop()  # idempotent


def _assert_nothing_left():
    table = ray.util.placement_group_table()
    assert all(pg["state"] == "REMOVED" for pg in table.values()), table
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 4.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == pytest.approx(4.0)


def test_failed_and_timed_out_bring_up_name_the_culprit_and_clean_up(local_ray, tiny_models, tmp_path):
    from cluster.deployment import DeploymentError

    spec = ClusterSpec(tensor_parallel_size=1, num_draft_workers=1, cpus_per_rank=0.5, cpus_per_draft=0.5)
    cfg = tiny_config(tiny_models, method="model", k=K)
    cfg["draft"]["model"] = str(tmp_path / "no-such-model")
    dep = Deployment(spec)
    with pytest.raises(DeploymentError) as ei:
        dep.start(cfg, timeout_s=BRING_UP_TIMEOUT_S)
    assert "draft 0 failed in phase 'load'" in str(ei.value) and "no-such-model" in str(ei.value)
    assert "draft.model" in str(ei.value)
    assert not dep.actors() and dep.placement is None
    _assert_nothing_left()

    dep = Deployment(spec)
    with pytest.raises(DeploymentError) as ei:
        dep.start(tiny_config(tiny_models, method="model", k=K), timeout_s=0.5)
    msg = str(ei.value)
    assert "did not come up within" in msg and "phase" in msg and ("target rank 0" in msg or "draft 0" in msg), msg
    _assert_nothing_left()
