"""The HTTP front end checks capacity before it does work, caps its connections and times out slow bodies.

A server at its ``max_queued`` answers 503 before it reads the body, renders the chat template or
tokenizes (gRPC already checked first); a body that does not arrive within ``BODY_TIMEOUT_S`` gets 408
and its connection closed; past the connection cap (uvicorn's ``limit_concurrency``) a request gets 503.
A server on 127.0.0.1 with ``max_queued`` 2, its engine's steps held so that admitted requests stay live.
"""

from __future__ import annotations

import socket
import time

import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, tiny_config, wait_until
from test_http_api import CHAT_TEMPLATE, Hold

from specdist import Engine, SamplingParams
from specdist.api import http_server
from specdist.api.coordinator import Coordinator


@pytest.fixture
def srv(tiny_models):
    engine = Engine.from_config(tiny_config(tiny_models, "none"))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    hold = Hold(engine)
    hold.when = lambda eng: True  # nothing advances: admitted requests stay live
    lt = LoopThread()
    coordinator = Coordinator(engine, max_queued=2)
    http = lt.run(http_server.start_http(coordinator, "127.0.0.1", 0, max_connections=6))
    client = httpx.Client(trust_env=False, timeout=30)
    yield lt, coordinator, http, client
    hold.when = None
    client.close()
    lt.run(http.stop())
    lt.run(coordinator.close())
    lt.close()


def test_a_full_server_refuses_before_reading_rendering_or_tokenizing(srv, monkeypatch):
    lt, coordinator, http, client = srv
    streams = [lt.run(coordinator.open([1, 2, 3], SamplingParams(max_tokens=5))) for _ in range(2)]
    encoded = []
    real = coordinator.encode
    monkeypatch.setattr(coordinator, "encode", lambda *a, **k: encoded.append(a) or real(*a, **k))
    r = client.post(
        f"http://{http.address}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2},
    )
    assert r.status_code == 503 and "max_queued" in r.json()["error"]["message"]
    assert encoded == []  # refused before the chat template or the tokenizer ran
    for s in streams:
        s.close()
    wait_until("the held requests to go", lambda: lt.run(_live(coordinator)) == 0, 10)


def test_a_body_that_does_not_arrive_times_out(srv, monkeypatch):
    lt, coordinator, http, client = srv
    monkeypatch.setattr(http_server, "BODY_TIMEOUT_S", 0.5)
    host, port = http.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": '
        )  # then nothing
        t0 = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 5, reply[:200]


def test_connections_past_the_cap_get_503(srv):
    lt, coordinator, http, client = srv
    host, port = http.address.rsplit(":", 1)
    idle = []
    try:
        state = http.server.server_state
        for n in range(1, 6):  # each holds a request open: its headers sent, its body pending
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            idle.append(s)
            # the server runs its request before the next connection comes (a request read after the next
            # connection's accept would count it, and be refused itself)
            wait_until(f"request {n} running", lambda n=n: len(state.tasks) == n and len(state.connections) == n, 10)
        r = client.get(f"http://{http.address}/v1/models")  # the sixth connection: the cap is 6
        assert r.status_code == 503
    finally:
        for s in idle:
            s.close()
    wait_until("a free connection", lambda: client.get(f"http://{http.address}/v1/models").status_code == 200, 10)


async def _live(coordinator) -> int:
    return coordinator.counters()["live_requests"]
