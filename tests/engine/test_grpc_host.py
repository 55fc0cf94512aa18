"""The one gRPC host (specdist/transport/grpc_host.py) the public server and the worker ports share, and the
draft worker's loading through the engine's factory path (specdist/cores/draft.py).

The host is checked here on its own, over a draft servicer of an n-gram core (no model): the
health statuses of the server and its service, the bearer token (health open), the message
limit, reflection, a port already taken, and the stop. tests/engine/test_server.py, test_security.py
and test_worker_secret.py check the same host behind the public server and the worker actors.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specdist.cores.draft import DrafterCore
from specdist.cores.proposers.ngram import NgramProposer
from specdist.transport.grpc_host import HEALTH_SERVICE, LIVENESS, GrpcHostThread
from specdist.transport.security import bearer_metadata
from specdist.v1 import draft_pb2, draft_pb2_grpc
from workers.draft_worker import DraftServicer

DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name
TOKEN = "s3cret"
LIMIT = 64 << 10  # bytes: far below grpc's 4 MiB default, so a test message can pass it


@pytest.fixture
def servicer():
    s = DraftServicer(DrafterCore(NgramProposer(8), 64))
    yield s
    s.shutdown()


def _host(servicer, port: int = 0, **kw) -> GrpcHostThread:
    def add(server):
        draft_pb2_grpc.add_DraftWorkerServicer_to_server(servicer, server)

    return GrpcHostThread({DRAFT_SERVICE: add}, "127.0.0.1", port, LIMIT, **kw)


def _health(channel, service: str = "") -> str:
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_host_serves_health_token_limit_and_reflection(servicer):
    host = _host(servicer, token=TOKEN, reflection=True, serving=False)
    channel = grpc.insecure_channel(f"127.0.0.1:{host.port}")
    try:
        assert host.port > 0  # port 0: the one the OS picked
        # health: one status for the server and its service, open without the token
        assert _health(channel) == _health(channel, DRAFT_SERVICE) == "NOT_SERVING"
        host.set_serving(True)
        assert _health(channel) == _health(channel, DRAFT_SERVICE) == "SERVING"

        stub = draft_pb2_grpc.DraftWorkerStub(channel)
        release = draft_pb2.DraftReleaseRequest(request_ids=["nobody"])
        with pytest.raises(grpc.RpcError) as ei:
            stub.Release(release, timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.Release(release, timeout=10, metadata=bearer_metadata(TOKEN))  # with the token: served

        big = draft_pb2.DraftReleaseRequest(request_ids=["x" * 1000] * (LIMIT // 1000 + 1))
        with pytest.raises(grpc.RpcError) as ei:
            stub.Release(big, timeout=10, metadata=bearer_metadata(TOKEN))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # reflection: a method like any other, so it needs the token too
        with pytest.raises(grpc.RpcError) as ei:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
            timeout=10,
            metadata=bearer_metadata(TOKEN),
        )
        services = {s.name for r in listing for s in r.list_services_response.service}
        assert services == {DRAFT_SERVICE, HEALTH_SERVICE, "grpc.reflection.v1alpha.ServerReflection"}
    finally:
        channel.close()
        host.stop(0)
    assert not host.thread.is_alive()


def test_host_without_reflection_or_token(servicer):
    host = _host(servicer)  # serving from the start (a worker's default)
    channel = grpc.insecure_channel(f"127.0.0.1:{host.port}")
    try:
        assert _health(channel) == _health(channel, DRAFT_SERVICE) == "SERVING"
        draft_pb2_grpc.DraftWorkerStub(channel).Release(draft_pb2.DraftReleaseRequest(request_ids=["a"]), timeout=10)
        with pytest.raises(grpc.RpcError) as ei:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
        host.stop(0)
    with pytest.raises(grpc.RpcError) as ei:  # stopped: nothing listens there any more
        with grpc.insecure_channel(f"127.0.0.1:{host.port}") as ch:
            _health(ch)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


def test_liveness_stays_serving_while_readiness_drops_and_watches_are_capped(servicer):
    """Liveness (what the chart's livenessProbe asks) stays SERVING while the server and its
    services are NOT_SERVING (a target rebuild), so Kubernetes does not restart a recovering head;
    health Watch streams (open without the token) are capped, the next one refused, and a closed
    one frees its place."""
    host = _host(servicer, token=TOKEN, serving=False)
    host.host.health.max_watches = 2
    channel = grpc.insecure_channel(f"127.0.0.1:{host.port}")
    health = health_pb2_grpc.HealthStub(channel)
    try:
        assert _health(channel) == "NOT_SERVING" and _health(channel, LIVENESS) == "SERVING"
        host.set_serving(True)
        host.set_serving(False)  # e.g. the target group rebuilding
        assert _health(channel, LIVENESS) == "SERVING"

        watches = [health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30) for _ in range(2)]
        for w in watches:  # each answers its first status, so both are open on the server
            assert next(w).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as ei:
            next(health.Watch(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=30))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 2 health Watch streams" in ei.value.details()
        watches[0].cancel()
        deadline = time.monotonic() + 20
        while host.host.health.watches > 1 and time.monotonic() < deadline:  # the server sees the cancel
            time.sleep(0.01)
        again = health.Watch(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=30)
        assert next(again).status == health_pb2.HealthCheckResponse.SERVING
        again.cancel()
        watches[1].cancel()
    finally:
        channel.close()
        host.stop(0)


def test_a_port_in_use_fails_and_leaves_no_thread(servicer):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        threads = threading.active_count()
        with pytest.raises((OSError, RuntimeError), match="cannot listen on|Failed to bind"):
            _host(servicer, port=taken.getsockname()[1])
        assert threading.active_count() == threads


def test_draft_actor_refuses_a_draft_model_of_another_vocabulary(tiny_models):
    """The draft worker checks its draft model against the target's vocabulary, as the engine does
    (specdist.cores.draft.load_draft_model): the deployment fails at load, naming draft.model."""
    from workers.actors import DraftActor

    actor = DraftActor(0, num_threads=None)
    try:
        with pytest.raises(Exception, match="draft.model") as ei:
            actor.load(
                {"method": "model", "model": tiny_models["draft_vocab9"], "num_speculative_tokens": 3},
                tiny_models["target"],
                {"max_batch_size": 2, "max_model_len": 32},
                device="cpu",
            )
        assert "vocabulary size 9 differs from the target's 8" in str(ei.value)
        assert actor.state == "created"
    finally:
        actor.shutdown()
