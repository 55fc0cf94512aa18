"""A whole deployment on a local Ray cluster, driven by the same scheduler as the in-process Engine.

- `specdist serve` on a 2-rank tensor-parallel target + 2 draft workers (start_serving, as
  run_serve does it): every actor healthy and on loopback; a raw call to a worker port without
  the deployment's worker secret (or with a wrong one) is UNAUTHENTICATED; through the public
  gRPC server, the HTTP API and 8 concurrent clients, greedy output equals the Engine's token
  for token, with both drafts serving; counters and slots back to 0; drain; then a stop that
  leaves no actor, no actor process and no placement group behind.
- A 1-rank target + 1 draft worker: seeded sampled requests give the Engine's tokens bit for bit
  (one seed rule, one step, the same cores; only tensor parallelism may change float sums).
- A bring-up that fails (a missing model) or times out names the culprit and cleans up.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
import ray
import torch

from conftest import assert_nothing_left_on_ray, tiny_config
from cluster.deployment import ClusterSpec, Deployment
from specdist.engine import Engine
from specdist.remote_engine import RemoteEngine
from specdist.sampling_params import SamplingParams
from specdist.security import bearer_metadata, new_worker_secret
from specdist.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

BRING_UP_TIMEOUT_S = 180
K = 3
PROMPTS = [[1, 2, 3], [4], [5, 6, 1, 2, 3, 4], [2, 2], [6, 5, 4], [3], [1, 6], [0, 4, 2, 1]]
MAX_TOKENS = [8, 5, 12, 7, 9, 4, 10, 6]


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


def test_served_deployment_matches_engine_then_drains_and_stops_clean(local_ray, tiny_models):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from conftest import LoopThread
    from specdist.client import SpecDistClient
    from specdist.serve_cli import start_serving

    cfg = tiny_config(tiny_models, method="model", k=K)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=(i % 2 == 0)) for i, m in enumerate(MAX_TOKENS)]
    want = [o.token_ids for o in Engine.from_config(cfg).generate(PROMPTS, params)]
    cfg["cluster"] = {"enabled": True, "tensor_parallel_size": 2, "num_draft_workers": 2,
                      "cpus_per_rank": 0.5, "cpus_per_draft": 0.5, "bringup_timeout_s": BRING_UP_TIMEOUT_S}

    lt = LoopThread()
    serving = chans = None
    try:
        serving = lt.run(start_serving(cfg, "127.0.0.1", 0, http_port=0), timeout=BRING_UP_TIMEOUT_S + 60)
        backend = serving.backend
        assert backend.deployment is not None and not backend.owns_ray  # Ray was already up: not ours to stop
        dep, target_addr, draft_addrs = backend.deployment, backend.target_address, backend.draft_addresses
        assert len(draft_addrs) == 2 and len(set(draft_addrs + [target_addr])) == 3

        # ---- health of every actor, before any traffic; Ray and every worker on loopback
        health = dep.health()
        assert set(health) == {"target rank 0", "target rank 1", "draft 0", "draft 1"}
        assert all(h["ok"] for h in health.values()), health
        assert health["target rank 0"]["state"] == "serving" and health["target rank 0"]["address"] == target_addr
        assert health["target rank 1"]["following"] and health["target rank 1"]["world_size"] == 2
        assert [health[f"draft {i}"]["address"] for i in range(2)] == draft_addrs
        assert all(health[n]["warmup_s"] is not None for n in ("target rank 0", "draft 0", "draft 1"))
        assert len({h["pid"] for h in health.values()}) == 4  # one process per actor
        pids = [h["pid"] for h in health.values()]
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        assert all(h["node_ip"] == "127.0.0.1" for h in health.values()), health
        assert all(a.startswith("127.0.0.1:") for a in [target_addr, *draft_addrs])

        chans = [grpc.insecure_channel(a) for a in [target_addr, *draft_addrs]]
        for ch in chans:
            grpc.channel_ready_future(ch).result(timeout=30)
            hstub = health_pb2_grpc.HealthStub(ch)
            assert hstub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        # ---- the worker ports need the deployment's secret (health above did not)
        intruder = [
            (target_pb2_grpc.TargetWorkerStub(chans[0]).Verify, target_pb2.VerifyRequest(items=[
                target_pb2.VerifyItem(request_id="intruder", draft_token_ids=[1], seq_len=1)])),
            (draft_pb2_grpc.DraftWorkerStub(chans[1]).Propose, draft_pb2.ProposeRequest(items=[
                draft_pb2.ProposeItem(request_id="intruder", num_tokens=1, seq_len=1)])),
        ]
        for method, request in intruder:
            for metadata in (None, bearer_metadata(new_worker_secret())):
                with pytest.raises(grpc.RpcError) as ei:
                    method(request, timeout=30, metadata=metadata)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, ei.value.details()

        # ---- the public server over the deployment: one client, then the HTTP API, then 8 at once
        with SpecDistClient(serving.address, timeout=120) as client:
            info = client.server_info()
            assert info.tensor_parallel_size == 2 and info.draft_replicas == 2
            assert info.draft_method == "model" and info.num_speculative_tokens == K
            text, ids, _, stats = client.generate_text(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS[0],
                                                       ignore_eos=True)
            assert ids == want[0] and stats.drafted > 0
        import openai

        http = openai.OpenAI(base_url=f"http://{serving.http.address}/v1", api_key="unused", max_retries=0,
                             timeout=120)
        got_http = http.completions.create(model=cfg["target"]["model"], prompt=PROMPTS[0], temperature=0.0,
                                           max_tokens=MAX_TOKENS[0], extra_body={"ignore_eos": True})
        http.close()
        assert got_http.choices[0].text == text
        spec = got_http.usage.model_extra["speculative"]
        assert (got_http.usage.completion_tokens, spec["drafted"], spec["accepted"]) == (
            stats.output_tokens, stats.drafted, stats.accepted)

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
        assert all(rep.proposed_tokens > 0 for rep in backend.engine.replicas)  # both drafts served requests

        coordinator = serving.server.coordinator
        deadline = time.monotonic() + 10
        while coordinator.counters()["live_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        counters = coordinator.counters()
        assert counters["live_requests"] == 0 and counters["target_kv_slots_used"] == 0, counters
        assert counters["requests_finished"] == 2 + len(PROMPTS) and counters["requests_failed"] == 0, counters
        health = dep.health()
        assert all(h["ok"] and h["requests"] == 0 for h in health.values()), health
        assert all(h["kv_slots_in_use"] == 0 for h in health.values()), health  # followers included

        # ---- drain: no new requests (UNAVAILABLE), health NOT_SERVING
        drained = dep.drain(timeout_s=5)
        assert all(d["drained"] for d in drained.values()), drained
        with pytest.raises(grpc.RpcError) as ei:
            draft_pb2_grpc.DraftWorkerStub(chans[2]).Start(draft_pb2.StartRequest(items=[draft_pb2.StartItem(
                request_id="late", prompt_token_ids=[1])]), metadata=bearer_metadata(dep.worker_secret))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        hstub = health_pb2_grpc.HealthStub(chans[0])
        assert hstub.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.NOT_SERVING

        # ---- stop: every actor dead, its process gone, the placement groups removed
        actors = dep.actors()
        pgs = list(dep.placement.groups)
        follower_refs = list(dep.follower_refs.values())
        lt.run(serving.stop(drain_seconds=2), timeout=120)
        serving = None
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
    finally:
        for ch in chans or ():
            ch.close()
        if serving is not None:
            lt.run(serving.stop(drain_seconds=0), timeout=120)
        lt.close()


def _assert_nothing_left():
    assert_nothing_left_on_ray()  # groups removed, actors dead, the cluster's 4 CPUs free again


def test_one_rank_deployment_gives_the_engines_tokens_bit_for_bit(local_ray, tiny_models):
    """Seeded sampling (T 0.8, top-p 0.9), 8 prompts in one batch, fixed draft lengths: the
    in-process Engine and a 1-rank target + 1 draft worker deployment emit the same tokens."""
    cfg = tiny_config(tiny_models, method="model", k=K)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, seed=100 + i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the actors: the same GEMM kernels and summation order
    try:
        want = [o.token_ids for o in Engine.from_config(cfg).generate(PROMPTS, params)]
    finally:
        torch.set_num_threads(threads)
    spec = ClusterSpec(tensor_parallel_size=1, num_draft_workers=1, cpus_per_rank=0.5, cpus_per_draft=0.5)
    dep = Deployment(spec)
    try:
        target_addr, draft_addrs = dep.start(cfg, timeout_s=BRING_UP_TIMEOUT_S)
        with RemoteEngine.from_addresses(cfg, target_addr, draft_addrs, worker_secret=dep.worker_secret) as remote:
            outs = remote.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == want
        assert sum(o.metrics.accepted for o in outs) > 0 and any(o.metrics.accepted < o.metrics.drafted for o in outs)
    finally:
        dep.stop()
    _assert_nothing_left()


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
