"""A served Ray deployment from bring-up to a clean stop, through worker faults (issue 11's must-shows).

One deployment (a 2-rank tensor-parallel tiny target + 1 model draft worker, on the shared local
Ray cluster, with the supervisor checking every 0.2 s), served by ``start_serving`` as
``specdist serve`` does it, goes through, in order:

0. Up: every actor healthy and on loopback; a raw call to a worker port without the deployment's
   worker secret (or with a wrong one) is UNAUTHENTICATED; 8 concurrent gRPC streams give the
   in-process Engine's greedy tokens, and the HTTP API the same text and stats as gRPC.
1. SIGSTOP of the draft worker's process: the requests finish, exactly, while it is still
   stopped (the step stopped waiting for it at its call deadline); after SIGCONT the supervisor
   sees it answer, it is re-admitted and new requests draft again.
2. SIGSTOP of target rank 1 in the middle of 8 streams (a hang, not a death): rank 0's collective
   times out and rank 1 does not answer its health check; each stream ends with ERROR and a
   message naming rank 1 within 10 s; while the rebuild is held, health is NOT_SERVING and
   Generate answers UNAVAILABLE naming rank 1; after the rebuild health is SERVING again, the
   stopped process is gone and a new request gets the same output as before the fault.
3. Down: counters and every worker's slots at 0; drain (no new requests, NOT_SERVING); a stop
   that leaves no actor, no actor process and no placement group behind.

Deaths are test_multinode's: a draft worker and the target group lost with their nodes
mid-generation (Ray restarts the draft actor elsewhere and the supervisor reloads it; the group
is rebuilt), on a deployment placed over three nodes.

The engine is paused at chosen points with a command on its own thread or a step listener
(``Coordinator.call_soon``, ``engine.listeners``), so "in the middle" is a state, not a time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import ray
from support.helpers import LoopThread, assert_nothing_left_on_ray, healthy_replicas, tiny_config, wait_until

from specdist.client import RemoteError, SpecDistClient
from specdist.engine.local import Engine
from specdist.sampling_params import SamplingParams
from specdist.transport.security import bearer_metadata, new_worker_secret
from specdist.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.ray

PROMPTS = [[1, 2, 3], [4], [5, 6, 1, 2, 3, 4], [2, 2], [6, 5, 4], [3], [1, 6], [0, 4, 2, 1]]
MAX_TOKENS = 40  # ~10 steps at k = 3: room to stop the engine in the middle
POLL_S, POLL_LIMIT_S = 0.02, 120.0  # every wait below polls state, bounded


def _config(tiny_models) -> dict:
    cfg = tiny_config(tiny_models, method="model", k=3)
    cfg["cluster"] = {
        "enabled": True,
        "tensor_parallel_size": 2,
        "num_draft_workers": 1,
        "cpus_per_rank": 0.5,
        "cpus_per_draft": 0.5,
        "bringup_timeout_s": 180,
        "health_interval_s": 0.2,
        "health_timeout_s": 2.0,
        "max_restarts": 2,
        "collective_timeout_s": 3.0,
    }
    return cfg


def _until(what: str, cond, limit_s: float = POLL_LIMIT_S):
    return wait_until(what, cond, limit_s, POLL_S)


def _greedy(client: SpecDistClient, prompt) -> tuple[list[int], object]:
    _, ids, finish, stats = client.generate_text(prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert finish == "length"
    return ids, stats


class Streams:
    """8 greedy streams, one thread and channel each; ``results[i]``: (token ids, last chunk, error)."""

    def __init__(self, address: str):
        self.results: list = [None] * len(PROMPTS)
        self.ended_at: list = [None] * len(PROMPTS)
        self.threads = [threading.Thread(target=self._run, args=(address, i), daemon=True) for i in range(len(PROMPTS))]
        for t in self.threads:
            t.start()

    def _run(self, address: str, i: int) -> None:
        ids, last, error = [], None, None
        with SpecDistClient(address, timeout=POLL_LIMIT_S) as c:
            try:
                for chunk in c.generate(PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0):
                    ids.extend(chunk.token_ids)
                    last = chunk
            except RemoteError as e:
                error = e
        self.ended_at[i] = time.monotonic()
        self.results[i] = (ids, last, error)

    def join(self) -> list:
        for t in self.threads:
            t.join(POLL_LIMIT_S)
        assert all(r is not None for r in self.results)
        return self.results


def _start_paused(serving) -> Streams:
    """Start the 8 streams with the engine held, so one pass admits them all together."""
    coordinator = serving.server.coordinator
    release = threading.Event()
    coordinator.call_soon(lambda: release.wait(POLL_LIMIT_S))
    streams = Streams(serving.address)
    _until("8 requests queued", lambda: coordinator.counters()["live_requests"] == len(PROMPTS))
    release.set()
    return streams


def _pause_after_steps(engine, steps: int) -> tuple[threading.Event, threading.Event]:
    """A step listener that holds the engine once all 8 requests ran ``steps`` steps (returns
    (paused, resume)); the listener removes itself when resumed."""
    paused, resume = threading.Event(), threading.Event()

    def gate(event) -> None:
        running = list(engine.running)
        if len(running) == len(PROMPTS) and min(r.metrics.steps for r in running) >= steps:
            engine.listeners.remove(gate)
            paused.set()
            resume.wait(POLL_LIMIT_S)

    engine.listeners.append(gate)
    return paused, resume


def _signal_mid_generation(serving, pid: int, sig: int) -> tuple[list, float]:
    """Send ``sig`` to ``pid`` while 8 streams are paused mid-generation, then let them run on.
    Returns (each stream's result, seconds from the signal to the last stream's end)."""
    paused, resume = _pause_after_steps(serving.backend.engine, 2)
    streams = _start_paused(serving)
    _until("the engine paused mid-generation", paused.is_set)
    os.kill(pid, sig)
    sent_at = time.monotonic()
    resume.set()
    results = streams.join()
    return results, max(streams.ended_at) - sent_at


def _assert_failed_naming_rank_1(results: list) -> None:
    for ids, last, error in results:
        assert last is not None and last.finish_reason == "error"
        assert error is not None and "target rank 1" in error.message, error


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _check_up(dep, target_addr: str, draft_addrs: list[str]) -> None:
    """Every actor healthy and on loopback; the worker ports speak mutual TLS only (the deployment's
    certificate), answer health to its holders, and Verify and Propose only with the deployment's worker secret."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = dep.health()
    assert set(health) == {"target rank 0", "target rank 1", "draft 0"}
    assert all(h["ok"] for h in health.values()), health
    assert health["target rank 0"]["state"] == "serving" and health["target rank 0"]["address"] == target_addr
    assert health["target rank 1"]["following"] and health["target rank 1"]["world_size"] == 2
    assert health["draft 0"]["address"] == draft_addrs[0]
    assert all(health[n]["warmup_s"] is not None for n in ("target rank 0", "draft 0"))
    assert len({h["pid"] for h in health.values()}) == 3  # one process per actor
    # every actor, the follower too, froze its start-up objects (specdist.gc_freeze) once the deployment served
    assert all(h["frozen_objects"] > 10_000 for h in health.values()), health
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    assert all(h["node_ip"] == "127.0.0.1" for h in health.values()), health
    assert all(a.startswith("127.0.0.1:") for a in [target_addr, *draft_addrs])
    for address in [target_addr, *draft_addrs]:  # mutual TLS only: a plaintext handshake fails
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as ei:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    chans = [dep.worker_tls.channel(a) for a in [target_addr, *draft_addrs]]
    try:
        for ch in chans:
            grpc.channel_ready_future(ch).result(timeout=30)
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="")).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        intruder = [
            (
                target_pb2_grpc.TargetWorkerStub(chans[0]).Verify,
                target_pb2.VerifyRequest(
                    items=[target_pb2.VerifyItem(request_id="intruder", draft_token_ids=[1], seq_len=1)]
                ),
            ),
            (
                draft_pb2_grpc.DraftWorkerStub(chans[1]).Propose,
                draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(request_id="intruder", num_tokens=1, seq_len=1)]),
            ),
        ]
        for method, request in intruder:
            for metadata in (None, bearer_metadata(new_worker_secret())):
                with pytest.raises(grpc.RpcError) as ei:
                    method(request, timeout=30, metadata=metadata)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, ei.value.details()
    finally:
        for ch in chans:
            ch.close()


def _drain_and_stop(lt, serving) -> None:
    """Drain (no new requests, NOT_SERVING), then stop: every actor dead, its process gone, the
    placement groups removed, the cluster's CPUs free."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    dep, backend = serving.backend.deployment, serving.backend
    drained = dep.drain(timeout_s=5)
    assert all(d["drained"] for d in drained.values()), drained
    with dep.worker_tls.channel(backend.draft_addresses[0]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            draft_pb2_grpc.DraftWorkerStub(ch).Start(
                draft_pb2.StartRequest(items=[common_pb2.StartItem(request_id="late", prompt_token_ids=[1])]),
                metadata=bearer_metadata(dep.worker_secret),
                timeout=30,
            )
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    with dep.worker_tls.channel(backend.target_address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    actors, pgs = dep.actors(), list(dep.placement.groups)
    pids = [h["pid"] for h in dep.health().values()]
    follower_refs = list(dep.follower_refs.values())
    lt.run(serving.stop(drain_seconds=2), timeout=120)
    forwards = ray.get(follower_refs, timeout=10)  # run_follower() returned normally: released, not killed
    assert len(forwards) == 1 and forwards[0] > 0
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.ping.remote(), timeout=30)
    table = ray.util.placement_group_table()
    assert all(table[pg.id.hex()]["state"] == "REMOVED" for pg in pgs)
    _until("every actor process gone", lambda: all(_dead(p) for p in pids), limit_s=20)
    assert_nothing_left_on_ray()  # resources come back asynchronously after the groups are removed
    dep.stop()  # idempotent


def test_served_deployment_through_faults(local_ray, tiny_models):
    import openai

    from specdist.api.serving import start_serving

    cfg = _config(tiny_models)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [
        o.token_ids for o in Engine.from_config(tiny_config(tiny_models, method="model", k=3)).generate(PROMPTS, params)
    ]
    lt = LoopThread()
    serving = None
    try:
        serving = lt.run(start_serving(cfg, "127.0.0.1", 0, http_port=0), timeout=240)
        backend = serving.backend
        dep, engine = backend.deployment, backend.engine
        assert not backend.owns_ray  # Ray was already up: not ours to stop
        supervisor = dep.supervisor
        events = []
        dep.listeners.append(events.append)

        # 0. up: health, loopback, the worker secret; the Engine's tokens over gRPC, HTTP alike
        _check_up(dep, backend.target_address, backend.draft_addresses)
        client = SpecDistClient(serving.address, timeout=POLL_LIMIT_S)
        info = client.server_info()
        assert (info.tensor_parallel_size, info.draft_replicas, info.draft_method) == (2, 1, "model")
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 8 concurrent streams
            reference = list(pool.map(lambda p: _greedy(client, p), PROMPTS))
        assert [ids for ids, _ in reference] == want
        assert all(stats.drafted > 0 for _, stats in reference)
        http = openai.OpenAI(
            base_url=f"http://{serving.http.address}/v1", api_key="unused", max_retries=0, timeout=POLL_LIMIT_S
        )
        got = http.completions.create(
            model=cfg["target"]["model"],
            prompt=PROMPTS[0],
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        http.close()
        text, ids, _, stats = client.generate_text(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert got.choices[0].text == text and ids == want[0]
        spec = got.usage.model_extra["speculative"]
        assert (got.usage.completion_tokens, spec["drafted"], spec["accepted"]) == (
            stats.output_tokens,
            stats.drafted,
            stats.accepted,
        )
        draft_pid = dep.health()["draft 0"]["pid"]

        # 1. SIGSTOP the draft worker: left behind at its Propose deadline, re-admitted after SIGCONT
        os.kill(draft_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            stopped = [_greedy(client, p)[0] for p in PROMPTS[:2]]
            waited = time.monotonic() - t0
            assert stopped == want[:2]
            assert healthy_replicas(engine) == 0
            assert psutil.Process(draft_pid).status() == psutil.STATUS_STOPPED  # finished while it was stopped
            # one deadline (DEADLINE_FLOOR_S = 2 s, or 8 x its latency), not one per step (~10 steps)
            assert waited < 10, waited
        finally:
            os.kill(draft_pid, signal.SIGCONT)
        _until("the draft re-admitted after SIGCONT", lambda: healthy_replicas(engine) == 1)
        ids, stats = _greedy(client, PROMPTS[0])
        assert ids == want[0] and stats.drafted > 0

        # 2. SIGSTOP target rank 1 in the middle of 8 streams: rank 0's collective times out (3 s
        # here) and rank 1 does not answer its health check (2 s): each stream ends with ERROR naming
        # rank 1; the rebuild is held so that what clients see meanwhile can be checked
        follower_pid = dep.health()["target rank 1"]["pid"]
        hold_rebuild, rebuild_held = threading.Event(), threading.Event()

        def hold(event) -> None:  # runs on the supervisor thread, after the server was told
            if event.kind == "target_down":
                rebuild_held.set()
                hold_rebuild.wait(POLL_LIMIT_S)

        dep.listeners.append(hold)
        results, ended_after = _signal_mid_generation(serving, follower_pid, signal.SIGSTOP)
        _assert_failed_naming_rank_1(results)
        assert ended_after < 10
        _until("the rebuild held", rebuild_held.is_set)
        assert client.health() == "NOT_SERVING"
        try:
            _greedy(client, PROMPTS[0])
            raise AssertionError("Generate succeeded while the target was down")
        except RemoteError as e:
            assert e.code == grpc.StatusCode.UNAVAILABLE and "target rank 1" in e.message
        hold_rebuild.set()
        _until("SERVING after the rebuild", lambda: supervisor.rebuilds == 1 and client.health() == "SERVING")
        assert not psutil.pid_exists(follower_pid) or _dead(follower_pid)  # the stopped process was killed
        assert dep.health()["target rank 1"]["pid"] != follower_pid
        ids, _ = _greedy(client, PROMPTS[4])
        assert ids == want[4]
        assert [e.kind for e in events if e.worker == "target"] == ["target_down", "target_up"]
        counters = serving.server.coordinator.counters()
        assert counters["live_requests"] == 0 and counters["target_kv_slots_used"] == 0

        # every worker, follower rank included, holds nothing once idle. A follower frees its slots
        # when it replays the releases rank 0 broadcasts on going idle, on its own thread: polled
        def held() -> dict:
            return {name: (h.get("requests"), h.get("kv_slots_in_use")) for name, h in dep.health().items()}

        try:
            _until("every worker holding nothing", lambda: all(v == (0, 0) for v in held().values()), limit_s=10)
        except AssertionError as e:
            raise AssertionError(f"{e}: {held()}") from None
        client.close()

        # 3. down: drain, then a stop that leaves nothing behind
        _drain_and_stop(lt, serving)
        serving = None
    finally:
        if serving is not None:
            lt.run(serving.stop(0), timeout=120)
        lt.close()


def test_collective_timeout_follows_the_measured_forwards():
    """CollectiveDeadline: the floor until forwards are measured, then 20 x (overhead + rate x n)."""
    from specdist.cores.collectives import COLLECTIVE_FACTOR, CollectiveDeadline

    d = CollectiveDeadline(floor_s=3.0)
    assert d.timeout_for(1) == d.timeout_for(4096) == 3.0  # nothing measured yet
    d.observe(4, 0.5)  # a small forward: its fixed overhead
    assert d.timeout_for(1) == COLLECTIVE_FACTOR * (0.5 + 0.5 / 8)  # rate guessed from the overhead
    d.observe(1000, 2.0)  # a large one: 2 ms per token
    assert d.timeout_for(2000) == COLLECTIVE_FACTOR * (0.5 + 0.002 * 2000)
    d.observe(1000, 1.0)  # faster forwards never shorten it: it errs long
    assert d.rate == 0.002 and d.overhead == 0.5
