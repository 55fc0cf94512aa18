"""The HTTP port's connections: a per-peer cap, /health past the cap, idle and write timeouts.

Real sockets on loopback against ``start_http`` over the tiny models. Peers are told apart by their
source address (127.0.0.2, 127.0.0.3, ...: all of 127/8 is loopback on Linux). Each server gets small
``limits.http_*`` values, and a test waits for what it expects by bounded polling, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import time

import pytest
from support.helpers import LoopThread, tiny_config, wait_until
from test_http_api import CHAT_TEMPLATE, GAUGES, Hold

from specdist import Engine
from specdist.api import http_server
from specdist.api.coordinator import Coordinator

pytestmark = pytest.mark.usefixtures("one_thread")


def _serve(tiny_models, max_connections: int, max_model_len: int = 64, **limits):
    engine = Engine.from_config(
        dict(tiny_config(tiny_models, "none", max_model_len=max_model_len, max_batch_size=16), limits=limits)
    )
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    hold = Hold(engine)
    lt = LoopThread()
    coordinator = Coordinator(engine, max_queued=16)
    http = lt.run(http_server.start_http(coordinator, "127.0.0.1", 0, max_connections=max_connections))
    return engine, hold, lt, coordinator, http


def _stop(hold, lt, coordinator, http) -> None:
    hold.when = None
    lt.run(http.stop())
    lt.run(coordinator.close())
    lt.close()


def _connect(port: int, peer: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((peer, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def _request(port: int, peer: str, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection from ``peer``: (status, body); status 0: closed without an answer."""
    data = b"" if body is None else json.dumps(body).encode()
    with _connect(port, peer) as s:
        s.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    if not reply:
        return 0, b""
    head, _, rest = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def _closed(s: socket.socket) -> bool:
    """Whether the server has closed ``s``: EOF or a reset seen now (what it had sent before is read and dropped)."""
    s.settimeout(0.02)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


async def _open_connections(http) -> int:
    return len(http.server.server_state.connections)


def test_a_peer_past_its_cap_is_closed_and_health_answers_past_the_server_cap(tiny_models):
    engine, hold, lt, coordinator, http = _serve(
        tiny_models, max_connections=7, http_connections_per_peer=3, http_idle_timeout_s=120.0
    )
    port = http.port
    held: list[socket.socket] = []
    try:
        mine = [_connect(port, "127.0.0.2") for _ in range(5)]  # idle: they send nothing
        held += mine
        wait_until("the peer's connections past its cap closed", lambda: sum(map(_closed, mine)) == 2, 10)
        assert lt.run(_open_connections(http)) == 3
        # another peer is served as if the first were not there
        assert _request(port, "127.0.0.3", "GET", "/health") == (200, b'{"status":"ok"}')
        status, body = _request(
            port, "127.0.0.3", "POST", "/v1/completions", {"prompt": "a b", "max_tokens": 4, "ignore_eos": True}
        )
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
        # the server's cap full (7 connections, from peers each within theirs): /health still answers
        for peer in ("127.0.0.4", "127.0.0.5"):
            held += [_connect(port, peer) for _ in range(2)]
        wait_until("7 open connections", lambda: lt.run(_open_connections(http)) == 7, 10)
        assert _request(port, "127.0.0.6", "GET", "/health")[0] == 200
        assert _request(port, "127.0.0.6", "GET", "/v1/models")[0] == 503
    finally:
        for s in held:
            s.close()
        _stop(hold, lt, coordinator, http)


def test_idle_connections_and_slow_headers_are_closed(tiny_models):
    engine, hold, lt, coordinator, http = _serve(tiny_models, max_connections=16, http_idle_timeout_s=0.5)
    port = http.port
    silent = _connect(port, "127.0.0.2")
    slow = _connect(port, "127.0.0.2")
    slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    served = _connect(port, "127.0.0.3")  # one request answered, then idle on a kept-alive connection
    served.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert served.recv(4096).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    deadline = t0 + 10
    try:
        while not (_closed(silent) and _closed(served)):
            assert time.monotonic() < deadline, "an idle connection is still open"
            try:  # a header line at a time, each well within the timeout: the deadline still holds
                slow.sendall(b"X-Slow: 1\r\n")
            except OSError:
                pass
        wait_until("the slow client's connection closed", lambda: _closed(slow), 10)
        assert time.monotonic() - t0 >= 0.25  # closed by the timer (0.5 s from connect), not at once
        assert lt.run(_open_connections(http)) == 0
    finally:
        for s in (silent, slow, served):
            s.close()
        _stop(hold, lt, coordinator, http)


async def _watch_paused(http, paused: list[bool], stop: asyncio.Event) -> None:
    """``paused[0]``: whether some connection's writing is paused (its client reads nothing), on the loop."""
    while not stop.is_set():
        paused[0] = any(c.flow.write_paused for c in http.server.server_state.connections)
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def long_context(tiny_models, tmp_path_factory) -> dict[str, str]:
    """The tiny target with room for 1,024 positions (its rotary embedding has no table to outgrow): a stream
    long enough to fill a non-reading client's socket buffers (Linux buffers over a megabyte of it)."""
    path = tmp_path_factory.mktemp("long") / "target"
    shutil.copytree(tiny_models["target"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    return dict(tiny_models, target=str(path))


def test_a_stream_whose_client_reads_nothing_is_dropped_and_its_requests_cancelled(long_context):
    engine, hold, lt, coordinator, http = _serve(
        long_context, max_connections=16, max_model_len=1024, http_write_timeout_s=0.5
    )
    paused, stop = [False], asyncio.Event()
    watch = asyncio.run_coroutine_threadsafe(_watch_paused(http, paused, stop), lt.loop)
    hold.when = lambda eng: paused[0]  # once the client's buffers are full, its requests stay live
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's least: the server's writes back up soon
    try:
        s.settimeout(10)
        s.connect(("127.0.0.1", http.port))
        # 16 choices x 1,000 tokens, each chunk with 8 top entries: about 10 MB of events
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "a"}],
                "max_tokens": 1000,
                "n": 16,
                "logprobs": True,
                "top_logprobs": 8,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )  # then never reads
        wait_until("the stream to fill the client's buffers", lambda: paused[0], 30)
        assert coordinator.counters()["live_requests"] > 0
        wait_until(
            "the stream dropped and its requests cancelled",
            lambda: coordinator.counters()["live_requests"] == 0 and coordinator.counters()["active_streams"] == 0,
            10,
        )
        wait_until("the connection closed", lambda: lt.run(_open_connections(http)) == 0, 10)
        hold.when = None
        wait_until("every gauge back to 0", lambda: all(coordinator.counters()[g] == 0 for g in GAUGES), 10)
    finally:
        lt.loop.call_soon_threadsafe(stop.set)
        watch.result(10)
        s.close()
        _stop(hold, lt, coordinator, http)
