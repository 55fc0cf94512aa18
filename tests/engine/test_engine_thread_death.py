"""Issue 21, review finding 4: the Coordinator's engine thread dies of an unexpected error.

What must follow: health NOT_SERVING (gRPC) and not ready (HTTP ``GET /health`` 503), the
reason logged once; every request in flight ends promptly with UNAVAILABLE saying the engine
thread died (gRPC status, HTTP stream error event; the cause itself only in the log and in
``Coordinator.engine_error``: no exception text to clients, issue 21 finding 10); a new request is
refused with UNAVAILABLE at once; nothing leaks (streams closed, gauges and slots back to 0).

The engine's ``step`` is replaced by one that raises an error no handler of the coordinator
catches (a ``BaseException`` that is not an ``Exception``: a failing step that raises an
``Exception`` only fails its batch, and the thread serves on). Events say when requests are in
flight and when the step has raised; every wait is bounded and polls state, never a sleep hoping
something happened.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import grpc
import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import serving_in_process
from test_coordinator import FakeEngine, coordinator, engine_threads, params, run_async, wait_until

from specdist.api.grpc_server import SERVICE_NAME
from specdist.api.refusals import ENGINE_DOWN_MESSAGE
from specdist.client import RemoteError, SpecDistClient
from specdist.errors import ErrorCode, code_of

WAIT_S = 10.0  # bound on every wait: the old behaviour (waiting forever) fails here instead of hanging
DIED = "the specdist engine thread died"
GAUGES = ("running_requests", "queued_requests", "target_kv_slots_used", "draft_kv_slots_used", "active_streams")


class EngineThreadKilled(BaseException):
    """An error none of the coordinator's handlers catch: the engine thread dies of it."""


def wait_for(predicate, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for a state"
        time.sleep(0.01)


def died_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and DIED in r.getMessage()]


class DyingStep:
    """``engine.step`` that lets ``n`` requests in and one step each, holds them there (no progress;
    1 ms per step, so commands still run) until ``armed``, then raises :class:`EngineThreadKilled`."""

    def __init__(self, engine, n: int):
        self.engine, self.real_step, self.n = engine, engine.step, n
        self.armed = threading.Event()
        self.raised = threading.Event()
        engine.step = self.step

    def step(self):
        eng = self.engine
        if self.armed.is_set():
            self.raised.set()
            raise EngineThreadKilled("injected: the engine loop broke")
        held = eng.running and all(r.output.token_ids for r in eng.running)  # each has had its step
        if len(eng.running) + len(eng.waiting) < self.n or held:
            time.sleep(0.001)  # hold: nothing admitted, no token
            return []
        return self.real_step()


def test_engine_thread_death_over_grpc_and_http(tiny_models, caplog):
    caplog.set_level(logging.ERROR)
    with serving_in_process(tiny_models) as (engine, serving):
        dying = DyingStep(engine, n=2)
        base = f"http://{serving.http.address}"
        client = SpecDistClient(serving.address, timeout=WAIT_S)
        outcome: dict[str, object] = {}
        first_chunk = {"grpc": threading.Event(), "http": threading.Event()}

        def grpc_request() -> None:
            chunks = []
            try:
                for c in client.generate([1], max_tokens=50, ignore_eos=True, temperature=0.0, request_id="in-flight"):
                    chunks.append(c)
                    first_chunk["grpc"].set()
                outcome["grpc"] = ("finished", chunks[-1].finish_reason)
            except RemoteError as e:
                outcome["grpc"] = (e.code, e.message)

        def http_request() -> None:
            events = []
            # greedy: the first token is the same every run (an unseeded sample that decodes to part of a
            # character streams no text until the next token, which the held step never makes)
            body = {"prompt": [2], "max_tokens": 50, "ignore_eos": True, "stream": True, "temperature": 0.0}
            try:
                with (
                    httpx.Client(trust_env=False, timeout=WAIT_S) as http,
                    http.stream("POST", base + "/v1/completions", json=body) as r,
                ):
                    outcome["http_status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: ") :])
                            first_chunk["http"].set()
            except httpx.HTTPError as e:
                events.append(f"client error: {e!r}")
            outcome["http"] = events

        threads = [threading.Thread(target=f, daemon=True) for f in (grpc_request, http_request)]
        try:
            for t in threads:
                t.start()
            for name, ev in first_chunk.items():  # both requests are streaming: in flight
                assert ev.wait(WAIT_S), f"the {name} request never streamed its first chunk"
            assert client.health() == "SERVING"
            dying.armed.set()
            assert dying.raised.wait(WAIT_S), "the engine never stepped again"

            # (2) the requests in flight end promptly, with UNAVAILABLE naming the cause
            for t in threads:
                t.join(2 * WAIT_S)
                assert not t.is_alive(), "a request in flight is still waiting"
            code, message = outcome["grpc"]
            assert code == grpc.StatusCode.UNAVAILABLE, outcome["grpc"]
            assert message == ENGINE_DOWN_MESSAGE, message
            assert outcome["http_status"] == 200
            last = outcome["http"][-1]
            assert last != "[DONE]", outcome["http"]
            error = json.loads(last)["error"]
            assert error["code"] == "unavailable" and error["message"].endswith(ENGINE_DOWN_MESSAGE), error

            # (1) health: gRPC NOT_SERVING (the server and the service), HTTP /health not ready
            wait_for(lambda: client.health() == "NOT_SERVING")
            assert client.health(SERVICE_NAME) == "NOT_SERVING"
            with httpx.Client(trust_env=False, timeout=WAIT_S) as http:
                r = http.get(base + "/health")
                assert r.status_code == 503 and r.json()["status"] == "engine down", r.text

                # (2) new requests are refused at once with UNAVAILABLE
                t0 = time.monotonic()
                with pytest.raises(RemoteError) as e:
                    client.generate_text([3], max_tokens=2)
                assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.message == ENGINE_DOWN_MESSAGE, e.value
                r = http.post(base + "/v1/completions", json={"prompt": [3], "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
                r = http.post(base + "/v1/completions", json={"prompt": [3], "max_tokens": 2, "stream": True})
                assert r.status_code == 503, r.text
                assert time.monotonic() - t0 < WAIT_S / 2

            # (3) nothing leaks: gauges back to 0, both requests counted as failed, no KV slot held
            wait_for(lambda: all(client.server_info().counters[g] == 0 for g in GAUGES))
            counters = client.server_info().counters
            assert (counters["requests_total"], counters["requests_failed"]) == (2, 2), counters
            assert all(v == 0 for v in engine.kv_slots_in_use().values())  # the engine thread is gone
            assert not engine.running and not engine.waiting
            assert len(died_records(caplog)) == 1  # the reason, logged once
            assert "injected" in str(died_records(caplog)[0].exc_info[1])  # the cause, in the log
        finally:
            dying.armed.set()
            client.close()
    assert not engine_threads()


@run_async
async def test_death_fails_streams_queued_commands_and_refuses_new_requests(caplog):
    """On the fake engine: a stream in flight, an add queued behind the dying step and a
    ``call_soon`` all end with UNAVAILABLE; availability listeners hear False once; close() returns."""
    caplog.set_level(logging.ERROR)
    engine = FakeEngine()
    changes: list[bool] = []
    async with coordinator(engine) as coord:
        coord.availability_listeners.append(changes.append)
        running = await coord.open([1], params(10**9), request_id="r0")
        assert (await running.__anext__()).token_ids  # in flight

        entered, go = threading.Event(), threading.Event()

        def dying_step():
            entered.set()
            assert go.wait(WAIT_S)
            raise EngineThreadKilled("injected: the engine loop broke")

        engine.step = dying_step
        await wait_until(entered.is_set)  # the engine thread is inside the step that will raise
        queued = asyncio.create_task(coord.open([2], params(5), request_id="r1"))
        await wait_until(lambda: coord.counters()["live_requests"] == 2)  # r1's add is queued behind the step
        side = coord.call_soon(lambda: "never runs")
        go.set()

        rest = await asyncio.wait_for(_drain(running), WAIT_S)
        last = rest[-1]
        assert last.finish_reason == "error" and last.code == ErrorCode.UNAVAILABLE, last
        assert "EngineThreadKilled" in last.error and "injected" in last.error  # the server side's detail
        assert last.message == ENGINE_DOWN_MESSAGE  # what a client is told
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(queued, WAIT_S)
        assert code_of(e.value) == ErrorCode.UNAVAILABLE and str(e.value) == ENGINE_DOWN_MESSAGE
        assert "EngineThreadKilled: injected" in coord.engine_error
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(asyncio.wrap_future(side), WAIT_S)
        assert code_of(e.value) == ErrorCode.UNAVAILABLE
        with pytest.raises(Exception) as e:
            await coord.open([3], params(2))
        assert code_of(e.value) == ErrorCode.UNAVAILABLE
        assert not coord.accepting and coord.engine_error is not None
        assert not await coord.cancel("r0")
        await wait_until(lambda: changes == [False])

        c = coord.counters()
        assert (c["live_requests"], c["active_streams"], c["running"], c["queued"]) == (0, 0, 0, 0), c
        assert (c["target_kv_slots_used"], c["requests_total"], c["requests_failed"]) == (0, 1, 1), c
        assert not engine.running and not engine.waiting  # released by the dying thread
        assert await coord.drain(0)
    assert not engine_threads()
    assert len(died_records(caplog)) == 1
    assert changes == [False]


async def _drain(stream):
    return [d async for d in stream]
