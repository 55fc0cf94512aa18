"""Holes a fault and security review found (issue 21) on the serving side, each closed and kept closed.

- Finding 7: chat templating and tokenizing run on tokenizer threads on the event loop's side,
  before a request is queued to the engine thread: a request whose templating takes long (a huge
  conversation, n = 16 choices) stalls no running stream, and its prompt is templated once for
  all of its choices.
- Finding 8: with TLS, the ``--metrics-port`` server does each connection's handshake on that
  connection's thread, with a timeout: a client that connects and sends nothing stops no scrape.
- Findings 10 and 13: a stream cut by a target worker's failure ends, over gRPC, with UNAVAILABLE
  (a rank died: a retry may succeed) naming the rank, or INTERNAL (anything else), and over HTTP
  with an error event carrying the same code; what the client reads never holds a worker's
  address, a process id or exception text (the server log does). The worker failure is injected
  in process: the target's own core served over gRPC on loopback (conftest ServedCores), failing
  as rank 0 fails when a follower rank died (its collective's error, INTERNAL) while the
  deployment's diagnosis names the dead rank.
- Liveness: ``specdist.v1.Liveness`` turns NOT_SERVING once the server cannot recover by itself:
  its engine thread died, or the supervisor lost the target group for good (``target_lost``).

Waits are on events and polled state with deadlines; no sleep hopes for something to happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import threading
import time
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, remote_engine_like, serving_in_process, tiny_config
from test_coordinator import FakeEngine, coordinator, params, run_async
from test_engine_thread_death import DyingStep
from test_security import pki  # noqa: F401 (the certificates fixture)

from specdist.api.refusals import TargetDown
from specdist.api.serving import Backend, start_serving, watch_deployment
from specdist.client import RemoteError, SpecDistClient
from specdist.engine.local import Engine
from specdist.engine.output_processor import StepEvent
from specdist.errors import ErrorCode
from specdist.transport import security
from specdist.transport.grpc_host import LIVENESS
from specdist.transport.security import ServerSecurity, ServerTLS, start_metrics_server

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread is faster on a shared box

WAIT_S = 10.0  # bound on every wait: the old behaviour (a stall) fails here instead of hanging
# what rank 0 of a tensor-parallel target answers when a follower rank died in a collective ...
GLOO_ERROR = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"
# ... and what the deployment's diagnosis then says (cluster.deployment.Deployment.diagnose_target)
DEAD_RANK_1 = "target rank 1 (pid 4242) died"


def wait_for(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _internals_absent(message: str, *internals: str) -> None:
    """A client-visible message names no worker address, process id or Python exception."""
    for bad in ("127.0.0.1", "pid", "Error", "Exception", "gloo", *internals):
        assert bad not in message, (bad, message)


# ---------------------------------------------------------------- finding 7: tokenizing off the engine thread
def test_templating_runs_off_the_engine_thread_once_for_n_choices(tiny_models):
    """A gRPC stream runs; an HTTP chat request with n = 16 arrives whose templating stalls until the
    engine has run 3 more steps of that stream. It must run on a tokenizer thread (on the engine
    thread the steps could never come), once for the 16 choices; both requests then finish."""
    with serving_in_process(tiny_models) as (engine, serving):
        tok = engine.tokenizer
        real_template = tok.apply_chat_template
        steps, goal = [0], [None]
        stepping, templating, steps_ran = threading.Event(), threading.Event(), threading.Event()
        calls: list[tuple[str, bool]] = []  # (thread templating, did the engine step meanwhile)

        def listener(event) -> None:  # on the engine thread, after each step
            if not isinstance(event, StepEvent):
                return
            steps[0] += 1
            stepping.set()
            if goal[0] is not None and steps[0] >= goal[0]:
                steps_ran.set()
            templating.wait(WAIT_S)  # the running stream holds until the templating has begun

        def slow_template(*args, **kwargs):
            if not calls:  # the first call stalls until 3 more engine steps ran (or WAIT_S passed)
                goal[0] = steps[0] + 3
                templating.set()
                calls.append((threading.current_thread().name, steps_ran.wait(WAIT_S)))
            else:
                calls.append((threading.current_thread().name, True))
            return real_template(*args, **kwargs)

        engine.listeners.append(listener)
        tok.apply_chat_template = slow_template
        client = SpecDistClient(serving.address, timeout=4 * WAIT_S)
        out: dict[str, object] = {}

        def stream() -> None:
            out["grpc"] = list(client.generate([1], max_tokens=30, ignore_eos=True, temperature=0))

        def chat() -> None:
            body = {"messages": [{"role": "user", "content": "a b"}], "n": 16, "max_tokens": 2, "temperature": 0}
            with httpx.Client(trust_env=False, timeout=4 * WAIT_S) as http:
                out["http"] = http.post(f"http://{serving.http.address}/v1/chat/completions", json=body)

        threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=chat, daemon=True)]
        try:
            threads[0].start()
            assert stepping.wait(WAIT_S), "the stream never stepped"  # it is running in the engine
            threads[1].start()
            for t in threads:
                t.join(4 * WAIT_S)
                assert not t.is_alive()
        finally:
            templating.set()
            del tok.apply_chat_template  # the class's method again
            client.close()
    name, stepped = calls[0]
    assert name.startswith("specdist-tokenize") and stepped, calls  # not "specdist-engine", which steps
    assert len(calls) == 1, calls  # one templating for the 16 choices
    assert out["grpc"][-1].finish_reason == "length" and sum(len(c.token_ids) for c in out["grpc"]) == 30
    r = out["http"]
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text


@run_async
async def test_a_bad_prompt_is_refused_naming_its_field_before_the_engine_sees_it():
    """The errors stay those of the engine's prompt rule (InvalidArgument naming the field), raised
    before any command reaches the engine thread."""
    from specdist.errors import InvalidArgument

    engine = FakeEngine()
    async with coordinator(engine) as coord:
        for prompt, chat, field in (
            ([], False, "prompt"),
            ("", False, "prompt"),
            ([1], True, "apply_chat_template"),
            ([10**6], False, "prompt"),
            ([1] * 64, False, "prompt"),
        ):
            with pytest.raises(InvalidArgument) as e:
                await coord.open(prompt, params(2), chat=chat)
            assert e.value.field == field, (prompt, chat, e.value)
        assert engine.calls == 0 and coord.counters()["live_requests"] == 0


# ---------------------------------------------------------------- finding 8: the TLS metrics port
def test_an_idle_tls_connection_does_not_stop_metrics_scrapes(pki, monkeypatch):  # noqa: F811
    monkeypatch.setattr(security, "METRICS_CONNECTION_TIMEOUT_S", 0.5, raising=False)
    tls = ServerTLS.load(pki.server, pki.server_key)
    httpd = start_metrics_server(0, "127.0.0.1", CollectorRegistry(), ServerSecurity(tls=tls))
    ctx = ssl.create_default_context(cafile=pki.ca)
    url = f"https://127.0.0.1:{httpd.server_port}/metrics"
    idle = socket.create_connection(("127.0.0.1", httpd.server_port), timeout=WAIT_S)  # connects, sends nothing
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=WAIT_S / 2) as r:  # accepted after the idle one
            assert r.status == 200
        assert idle.recv(1) == b""  # the idle client is dropped at the handshake timeout, not held forever
    finally:
        idle.close()
        httpd.shutdown()
        httpd.server_close()


# ---------------------------------------------------------------- findings 10 and 13: failures as clients see them
class FailingTarget:
    """The target core's ``verify`` fails with ``error`` once armed (rank 0's answer when a follower
    died: the worker sends INTERNAL with the exception's text)."""

    def __init__(self, core, error: Exception):
        self.core, self.error, self.real = core, error, core.verify
        self.armed = False
        core.verify = self.verify

    def verify(self, items):
        if self.armed:
            raise self.error
        return self.real(items)


@contextlib.contextmanager
def remote_serving(tiny_models):
    """``specdist serve --http-port`` over a RemoteEngine whose target and draft cores are served
    over gRPC on loopback (no Ray); yields (engine holding the cores, RemoteEngine, ServedCores, Serving)."""
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    remote, served = remote_engine_like(engine)
    lt = LoopThread()
    try:
        serving = lt.run(start_serving(backend=Backend(remote), host="127.0.0.1", port=0, http_port=0, drain_seconds=1))
        try:
            yield engine, remote, served, serving
        finally:
            lt.run(serving.stop())
    finally:
        lt.close()
        remote.close()
        served.close()


@pytest.mark.parametrize("fault", ["rank-death", "worker-bug"])
def test_a_target_failure_ends_streams_with_a_clean_status(tiny_models, caplog, fault):
    """A gRPC and an HTTP stream are in flight when every Verify starts failing. A dead rank
    (diagnosed): gRPC UNAVAILABLE naming ``target rank 1``, HTTP an ``unavailable`` error event; a
    worker bug (no rank diagnosed): INTERNAL / ``internal_error``. Neither message holds the
    worker's address, a pid or the exception; the server log holds them."""
    caplog.set_level(logging.WARNING)
    with remote_serving(tiny_models) as (engine, remote, served, serving):
        if fault == "rank-death":
            failing = FailingTarget(engine.target_core, RuntimeError(GLOO_ERROR))
            remote.target_diagnosis = lambda: DEAD_RANK_1
            want_grpc, want_http = grpc.StatusCode.UNAVAILABLE, "unavailable"
        else:
            failing = FailingTarget(engine.target_core, KeyError(f"boom at {served.target_address}"))
            remote.target_diagnosis = lambda: None
            want_grpc, want_http = grpc.StatusCode.INTERNAL, "internal_error"
        paused, resume = threading.Event(), threading.Event()

        def hold(event) -> None:  # both requests ran a step: hold the engine while the fault is armed
            running = list(remote.running)
            if len(running) == 2 and min(r.metrics.steps for r in running) >= 1 and not resume.is_set():
                paused.set()
                resume.wait(WAIT_S)

        remote.listeners.append(hold)
        client = SpecDistClient(serving.address, timeout=WAIT_S)
        out: dict[str, object] = {}

        def grpc_stream() -> None:
            chunks = []
            try:
                for c in client.generate([1, 2], max_tokens=40, ignore_eos=True, temperature=0):
                    chunks.append(c)
                out["grpc"] = ("finished", chunks)
            except RemoteError as e:
                out["grpc"] = (e.code, e.message, chunks)

        def http_stream() -> None:
            body = {"prompt": [3], "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
            with (
                httpx.Client(trust_env=False, timeout=WAIT_S) as http,
                http.stream("POST", f"http://{serving.http.address}/v1/completions", json=body) as r,
            ):
                out["http"] = (r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")])

        threads = [threading.Thread(target=f, daemon=True) for f in (grpc_stream, http_stream)]
        try:
            for t in threads:
                t.start()
            assert paused.wait(WAIT_S), "the two streams never ran together"
            failing.armed = True
            resume.set()
            for t in threads:
                t.join(2 * WAIT_S)
                assert not t.is_alive()
        finally:
            resume.set()
            client.close()

    code, message, chunks = out["grpc"]
    assert code == want_grpc, out["grpc"]
    assert chunks and chunks[-1].finish_reason == "error"  # cut mid-stream, with a last message
    status, events = out["http"]
    assert status == 200 and events[-1] != "[DONE]" and len(events) >= 2, events  # an error event, not a cut
    error = json.loads(events[-1])["error"]
    assert error["code"] == want_http and error["type"] == "server_error", error
    for text in (message, error["message"]):
        _internals_absent(text, served.target_address, "boom", "4242", "KeyError")
        if fault == "rank-death":
            assert "target rank 1" in text and "retry" in text, text
        else:
            assert text.endswith("internal error: the target failed the request"), text
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert served.target_address in logged  # the details are in the server log
    assert (GLOO_ERROR if fault == "rank-death" else "boom") in logged


@pytest.fixture(scope="module")
def ngram_engine(tiny_models):
    eng = Engine.from_config(tiny_config(tiny_models, "ngram", 3))
    yield eng
    eng.close()


@pytest.mark.parametrize(
    "code, item, diagnosis, want",
    [
        ("UNAVAILABLE", None, None, ErrorCode.UNAVAILABLE),  # rank 0 unreachable (its process died)
        ("DEADLINE_EXCEEDED", None, None, ErrorCode.UNAVAILABLE),  # rank 0 hung past the call's deadline
        ("INTERNAL", None, DEAD_RANK_1, ErrorCode.UNAVAILABLE),  # rank 0's collective failed: a follower died
        ("INTERNAL", None, None, ErrorCode.INTERNAL),  # rank 0 failed, every rank healthy: a bug
        ("FAILED_PRECONDITION", 0, DEAD_RANK_1, ErrorCode.INTERNAL),  # one item refused: not the target's failure
    ],
)
def test_the_code_a_failed_target_call_gives_its_requests(ngram_engine, code, item, diagnosis, want):
    """``Request.error_code`` (what the coordinator answers with): UNAVAILABLE, which a client may
    retry, when the target group failed as a whole; INTERNAL otherwise."""
    from specdist.sampling_params import SamplingParams
    from specdist.transport.protocol import TransportError

    eng = ngram_engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for p in ([1, 2], [3])]
    eng.step()
    assert len(eng.running) == 2
    verify, calls = eng.scheduler.verifier.verify, []

    def failing(items):
        calls.append(len(items))
        if len(calls) == 1:  # the first call fails, as the whole call or on one item; a retry succeeds
            ids = [it.request_id for it in items]
            raise TransportError(f"127.0.0.1:1: injected {code}", ids if item is None else [ids[item]], code, item)
        return verify(items)

    eng.scheduler.verifier.verify, eng.target_diagnosis = failing, (lambda: diagnosis)
    try:
        eng.step()
    finally:
        del eng.scheduler.verifier.verify
        eng.target_diagnosis = None
        for r in reqs:
            eng.abort(r.request_id)
    failed = reqs if item is None else [reqs[item]]
    for r in failed:
        assert r.output.finish_reason == "error" and r.error_code == want, (r.error, r.error_code)
    assert all(r.error_code is None for r in reqs if r not in failed)


@run_async
async def test_target_down_ends_streams_unavailable_naming_only_the_rank():
    """The supervisor's target_down (its reason: the diagnosis) ends running streams UNAVAILABLE and
    refuses new requests, naming the rank and nothing else of the diagnosis."""
    engine = FakeEngine()
    async with coordinator(engine) as coord:
        stream = await coord.open([1], params(10**9))
        assert (await stream.__anext__()).token_ids
        coord.target_down(DEAD_RANK_1)
        last = [d async for d in stream][-1]
        assert last.finish_reason == "error" and last.code == ErrorCode.UNAVAILABLE, last
        assert DEAD_RANK_1 in last.error  # the whole reason stays on the server side
        assert "target rank 1" in last.message and "retry" in last.message, last.message
        _internals_absent(last.message, "4242")
        with pytest.raises(TargetDown) as e:
            await coord.open([2], params(2))
        assert "target rank 1" in str(e.value)
        _internals_absent(str(e.value), "4242")


# ---------------------------------------------------------------- liveness
def test_liveness_turns_not_serving_when_the_engine_thread_dies(tiny_models):
    with serving_in_process(tiny_models) as (engine, serving):
        dying = DyingStep(engine, n=1)
        dying.armed.set()  # the first step raises what no handler catches
        client = SpecDistClient(serving.address, timeout=WAIT_S)
        try:
            assert client.health(LIVENESS) == "SERVING"
            with pytest.raises(RemoteError) as e:
                client.generate_text([1], max_tokens=4)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            _internals_absent(e.value.message, "EngineThreadKilled", "injected")  # the cause is in the log
            wait_for(lambda: client.health(LIVENESS) == "NOT_SERVING", "liveness NOT_SERVING")
            assert client.health() == "NOT_SERVING"
        finally:
            client.close()


def test_liveness_turns_not_serving_when_the_target_is_lost(tiny_models):
    """A deployment's supervisor reports target_down, then target_lost (every rebuild failed): the
    server stays alive through the first (a rebuild may bring it back) and not after the second."""
    with serving_in_process(tiny_models) as (engine, serving):
        deployment = SimpleNamespace(listeners=[], diagnose_target=lambda: None)
        watch_deployment(deployment, serving.server.coordinator)
        client = SpecDistClient(serving.address, timeout=WAIT_S)

        def event(kind: str, message: str) -> None:  # as the supervisor emits them, from its own thread
            t = threading.Thread(
                target=lambda: [
                    f(SimpleNamespace(kind=kind, worker="target", message=message, address=None, index=None))
                    for f in deployment.listeners
                ]
            )
            t.start()
            t.join(WAIT_S)

        try:
            event("target_down", DEAD_RANK_1)
            wait_for(lambda: client.health() == "NOT_SERVING", "health NOT_SERVING")
            assert client.health(LIVENESS) == "SERVING"  # a rebuild is under way: no restart
            event("target_lost", f"3 rebuild attempts failed after: {DEAD_RANK_1}")
            wait_for(lambda: client.health(LIVENESS) == "NOT_SERVING", "liveness NOT_SERVING")
            with pytest.raises(RemoteError) as e:
                client.generate_text([1], max_tokens=4)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "target rank 1" in e.value.message
            _internals_absent(e.value.message, "4242")
        finally:
            client.close()


def test_coordinator_has_no_generate():
    """Issue 20's leftover: the public streaming path is ``open``; ``generate`` was used by tests only."""
    from specdist.api.coordinator import Coordinator

    assert not hasattr(Coordinator, "generate")
    assert asyncio.iscoroutinefunction(Coordinator.open)
