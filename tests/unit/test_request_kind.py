"""A request's kind (gRPC ``GenerateRequest.kind``, the HTTP body's ``kind``): checked at the front doors (a bad one
is INVALID_ARGUMENT / 400 naming the field) and carried to the replicas' router (ReplicaFront.open's ``kind``); a
one-group coordinator, which has no router, is not handed one."""

from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from specdist.api.coordinator import Coordinator
from specdist.api.engine_thread import Delta
from specdist.api.replica_set import Admitted, FrontEngine, ReplicaFront
from specdist.config import load_config
from specdist.engine.request import RequestMetrics
from specdist.v1 import common_pb2, specdist_pb2, specdist_pb2_grpc


class Call:
    def __init__(self, items):
        self.items = list(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self):
        self.items = []


class Transport:
    """Every open admitted on replica A, one token, then the end; records each open's RouteRequest."""

    def __init__(self):
        self.routes = []

    def open(self, prompt, params, request_id, scope, tenant, route, age_s, avoid=""):
        self.routes.append(route)
        end = Delta(request_id, [1], "", finish_reason="length", metrics=RequestMetrics(3, 1))
        return Call([Admitted("A"), end])

    def failure(self, exc):
        return None


def _front():
    cfg = load_config({"target": {"model": "unused"}, "router": {"policy": "round-robin"}})
    engine = FrontEngine(cfg, tokenizer=None, vocab_size=100, max_model_len=64, k=3, replicas=lambda: 2)
    t = Transport()
    return ReplicaFront(engine, t, max_queued=8), t


def test_both_backends_take_the_kind():
    """The servers hand ``kind`` to whichever backend they serve: the replicas' front routes by it, one group's
    coordinator takes it and has no replicas to choose among."""
    for backend in (ReplicaFront, Coordinator):
        assert inspect.signature(backend.open).parameters["kind"].default is None


def test_grpc_kind_reaches_the_router_and_a_bad_one_is_invalid_argument():
    from specdist.api.grpc_server import serve

    front, t = _front()

    async def go():
        server, _ = await serve(front.engine, "127.0.0.1", 0, 8, 0.0, coordinator=front)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = specdist_pb2_grpc.SpecDecodeStub(ch)

                def request(**kw):
                    r = specdist_pb2.GenerateRequest(params=common_pb2.SamplingParams(max_tokens=1), **kw)
                    r.token_ids.ids.extend([1, 2, 3])
                    return r

                [m async for m in stub.Generate(request(kind="edit", session_id="s1"))]
                [m async for m in stub.Generate(request())]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    [m async for m in stub.Generate(request(kind="free writing"))]
                return e.value
        finally:
            await server.stop(0)

    err = asyncio.run(go())
    assert [r.kind for r in t.routes] == ["edit", "default"]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("kind: ")


@pytest.mark.parametrize("kind, status", [("edit", 200), (5, 400), ("a b", 400), ("", 200)])
def test_http_kind_reaches_the_router_and_a_bad_one_is_400_naming_it(kind, status):
    from specdist.api.http_server import start_http

    front, t = _front()

    async def go():
        server = await start_http(front)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
                body = {"prompt": [1, 2, 3], "max_tokens": 1, "kind": kind}
                return await client.post("/v1/completions", json=body, timeout=30)
        finally:
            await server.stop()

    r = asyncio.run(go())
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "kind" and not t.routes
    else:
        assert [route.kind for route in t.routes] == [kind or "default"]
