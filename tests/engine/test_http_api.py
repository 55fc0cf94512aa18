"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client against a real server.

``start_serving`` (as ``specdist serve --http-port`` runs it) puts the gRPC server and the HTTP
API over one coordinator on a background event loop, on free 127.0.0.1 ports, over the tiny
models. The gRPC API is the reference: the same request through both must give the same text
and the same per-request statistics. Where a test needs a request to stay live (the
disconnect), it holds the engine's steps and waits on the coordinator's counters, never on a
sleep.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import openai
import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, tiny_config

from specdist import Engine
from specdist.api.serving import Backend, start_serving
from specdist.client import SpecDistClient

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} g {% endfor %}"  # "a b" -> "a b g "
GAUGES = ("running", "queued", "target_kv_slots_used", "draft_kv_slots_used", "active_streams", "live_requests")


class Hold:
    """While ``when(engine)`` is true, engine.step does nothing and returns after 1 ms: requests
    neither advance nor finish, but queued commands (adds, aborts) still run between steps.
    ``fail_next``: the next step raises (the coordinator then fails the batch's requests)."""

    def __init__(self, engine):
        self.engine, self.real_step, self.when, self.fail_next = engine, engine.step, None, False
        engine.step = self.step

    def step(self):
        when = self.when
        if when is not None and when(self.engine):
            time.sleep(0.001)
            return []
        if self.fail_next and self.engine.waiting:  # once the request is there: fail the step admitting it
            self.fail_next = False
            raise RuntimeError("injected step failure")
        return self.real_step()


@pytest.fixture(scope="module")
def srv(tiny_models):
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    hold = Hold(engine)
    lt = LoopThread()
    serving = lt.run(start_serving(backend=Backend(engine), host="127.0.0.1", port=0, http_port=0, drain_seconds=1))
    http = httpx.Client(trust_env=False, timeout=30)
    s = SimpleNamespace(
        engine=engine,
        hold=hold,
        serving=serving,
        coordinator=serving.server.coordinator,
        model=engine.config.target.model,
        base=f"http://{serving.http.address}",
        http=http,
        client=openai.OpenAI(
            base_url=f"http://{serving.http.address}/v1", api_key="unused", max_retries=0, http_client=http
        ),
        grpc=SpecDistClient(serving.address),
    )
    yield s
    hold.when = None
    s.grpc.close()
    lt.run(serving.stop())
    http.close()
    assert serving.http.task.done()  # uvicorn stopped with the rest
    lt.close()


def wait_idle(coordinator, timeout: float = 10.0) -> dict[str, int]:
    """Poll the coordinator's counters until every gauge is back to 0 (or fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        counters = coordinator.counters()
        if all(counters[g] == 0 for g in GAUGES) or time.monotonic() > deadline:
            assert {g: counters[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0)
            return counters
        time.sleep(0.01)


def grpc_run(s, prompt, **kw):
    text, _, finish, stats = s.grpc.generate_text(prompt, **kw)
    return text, finish, stats


def assert_usage_is(usage, stats) -> None:
    """The HTTP usage block against the gRPC API's RequestStats of the same request."""
    assert (usage.prompt_tokens, usage.completion_tokens) == (stats.prompt_tokens, stats.output_tokens)
    assert usage.total_tokens == stats.prompt_tokens + stats.output_tokens
    spec = usage.model_extra["speculative"]
    assert (spec["drafted"], spec["accepted"], spec["steps"]) == (stats.drafted, stats.accepted, stats.steps)
    assert spec["steps"] > 0 and spec["drafted"] > 0  # k = 3 drafts on every step here
    assert spec["acceptance_rate"] == pytest.approx(stats.accepted / stats.drafted, abs=1e-12)  # the same ratio
    assert 1.0 <= spec["mean_acceptance_length"] <= 4.0  # 1 to k + 1 tokens per verification step


def test_models_and_health(srv):
    models = srv.client.models.list()
    assert [m.id for m in models.data] == [srv.model]
    card = models.data[0].model_extra
    assert card["max_model_len"] == 64 and card["specdist"]["num_speculative_tokens"] == 3
    r = srv.http.get(srv.base + "/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    r = srv.http.get(srv.base + "/metrics")  # the coordinator's Prometheus metrics (tests/engine/test_metrics.py)
    assert r.status_code == 200 and r.headers["content-type"] == srv.coordinator.metrics.render()[1]
    assert b"specdist_spec_decode_num_draft_tokens_total" in r.content


def test_completion_equals_grpc_and_seed_reproduces(srv):
    kw = dict(max_tokens=12, temperature=1.0, seed=7)
    want_text, want_finish, stats = grpc_run(srv, "a b c", ignore_eos=True, **kw)
    first = srv.client.completions.create(model=srv.model, prompt="a b c", extra_body={"ignore_eos": True}, **kw)
    again = srv.client.completions.create(
        prompt="a b c", model=srv.model, extra_body={"ignore_eos": True, "seed": 7}, max_tokens=12, temperature=1.0
    )  # seed as an extra body field too
    assert first.object == "text_completion" and first.model == srv.model
    assert [c.text for c in first.choices] == [want_text] == [c.text for c in again.choices]
    assert first.choices[0].finish_reason == want_finish == "length"
    assert_usage_is(first.usage, stats)
    assert first.usage.completion_tokens == 12
    wait_idle(srv.coordinator)


def test_token_id_prompt_and_top_k(srv):
    want_text, _, stats = grpc_run(srv, [0, 1, 2], max_tokens=6, temperature=1.0, top_k=2, seed=3)
    got = srv.client.completions.create(
        model=srv.model, prompt=[0, 1, 2], max_tokens=6, temperature=1.0, seed=3, extra_body={"top_k": 2}
    )
    assert got.choices[0].text == want_text
    assert_usage_is(got.usage, stats)


def test_streamed_completion(srv):
    kw = dict(model=srv.model, prompt="a b", max_tokens=10, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    whole = srv.client.completions.create(**kw)
    chunks = list(srv.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    *text_chunks, last = chunks
    assert len(text_chunks) > 1  # one per engine step that produced text, not one at the end
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    plain = list(srv.client.completions.create(stream=True, **kw))  # without include_usage: no usage chunk
    assert "".join(c.choices[0].text for c in plain) == whole.choices[0].text and plain[-1].choices


def test_chat(srv):
    want_text, want_finish, stats = grpc_run(srv, "a b", max_tokens=10, temperature=0, apply_chat_template=True)
    messages = [{"role": "user", "content": "a b"}]
    got = srv.client.chat.completions.create(
        model=srv.model, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want_text and got.choices[0].finish_reason == want_finish
    assert_usage_is(got.usage, stats)
    chunks = list(
        srv.client.chat.completions.create(
            model=srv.model, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == want_finish
    # a conversation goes through the template whole; text parts are joined with newlines
    convo = [
        {"role": "system", "content": "c"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    want_convo, _, _ = grpc_run(srv, "c g a\nb g ", max_tokens=6, temperature=0)  # CHAT_TEMPLATE's rendering
    got = srv.client.chat.completions.create(model=srv.model, messages=convo, max_tokens=6, temperature=0)
    assert got.choices[0].message.content == want_convo
    wait_idle(srv.coordinator)


def test_stop_strings(srv):
    kw = dict(model=srv.model, prompt="a", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = srv.client.completions.create(**kw).choices[0].text
    words = full.split()
    assert len(words) >= 4
    stop = words[3]
    want = full[: full.index(stop)]  # cut just before the first occurrence, the stop string excluded
    got = srv.client.completions.create(stop=[stop, "zz"], **kw)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop")
    streamed = list(srv.client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want and streamed[-1].choices[0].finish_reason == "stop"


def test_n2(srv):
    kw = dict(model=srv.model, prompt="a b", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    got = srv.client.completions.create(n=2, seed=20, **kw)
    singles = [srv.client.completions.create(seed=seed, **kw) for seed in (20, 21)]  # choice i samples with seed + i
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [s.choices[0].text for s in singles]
    assert got.choices[0].text != got.choices[1].text  # two seeds, two samples (checked: they differ here)
    assert got.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once
    assert got.usage.completion_tokens == 16
    for key in ("drafted", "accepted", "steps"):
        assert got.usage.model_extra["speculative"][key] == sum(
            s.usage.model_extra["speculative"][key] for s in singles
        )
    chunks = list(
        srv.client.chat.completions.create(
            model=srv.model,
            messages=[{"role": "user", "content": "a"}],
            n=2,
            seed=20,
            max_tokens=8,
            temperature=1.0,
            stream=True,
        )
    )
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    whole = srv.client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "a"}], n=2, seed=20, max_tokens=8, temperature=1.0
    )
    assert texts == [c.message.content for c in whole.choices]
    wait_idle(srv.coordinator)


@pytest.mark.parametrize(
    "endpoint, kwargs, param",
    [
        ("completions", dict(temperature=-1.0), "temperature"),
        ("completions", dict(extra_body={"temperature": "hot"}), "temperature"),
        ("completions", dict(top_p=0.0), "top_p"),
        ("completions", dict(max_tokens=0), "max_tokens"),
        ("completions", dict(extra_body={"top_k": -2}), "top_k"),
        ("completions", dict(extra_body={"frequency_penalty_x": 1}), "frequency_penalty_x"),
        ("completions", dict(logprobs=21), "logprobs"),
        ("completions", dict(seed=-1), "seed"),
        ("completions", dict(n=2, seed=2**64 - 1), "seed"),  # choice 1 would sample with seed + 1 = 2**64
        ("completions", dict(n=0), "n"),
        ("completions", dict(prompt=[0, 99]), "prompt"),
        ("completions", dict(prompt=["a", "b"]), "prompt"),
        ("completions", dict(stream_options={"include_usage": True}), "stream_options"),
        ("chat", dict(top_logprobs=2), "top_logprobs"),
        ("chat", dict(max_completion_tokens=0), "max_completion_tokens"),
        ("chat", dict(messages=[]), "messages"),
        ("chat", dict(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    ],
)
def test_bad_request_names_the_field(srv, endpoint, kwargs, param):
    if endpoint == "completions":
        call = srv.client.completions.create
        kwargs = {"model": srv.model, "prompt": "a", **kwargs}
    else:
        call = srv.client.chat.completions.create
        kwargs = {"model": srv.model, "messages": [{"role": "user", "content": "a"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        call(**kwargs)
    assert e.value.status_code == 400
    err = e.value.body  # the client hands over the body's "error" object
    assert err["param"] == param and err["message"].startswith(param + ":"), err
    assert err["type"] == "invalid_request_error"


def test_other_errors(srv):
    with pytest.raises(openai.NotFoundError) as e:
        srv.client.completions.create(model="another-model", prompt="a")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    r = srv.http.post(srv.base + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = srv.http.post(srv.base + "/v1/completions", json={"prompt": "a", "max_tokens": 2})  # model may be omitted
    assert r.status_code == 200 and r.json()["model"] == srv.model
    wait_idle(srv.coordinator)


def test_disconnect_mid_stream_frees_every_slot(srv):
    before = wait_idle(srv.coordinator)["requests_cancelled"]
    # once the request has output, hold it there: it can neither finish nor free its slots by itself
    srv.hold.when = lambda engine: any(r.output.token_ids for r in engine.running)
    try:
        stream = srv.client.completions.create(
            model=srv.model, prompt="a b", max_tokens=40, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(stream))
        assert first.choices[0].text and first.choices[0].finish_reason is None
        assert srv.coordinator.counters()["live_requests"] == 1
        assert srv.engine.kv_slots_in_use() == {"target": 1, "draft": 1}
        stream.close()  # the connection goes away mid-stream
        counters = wait_idle(srv.coordinator)
    finally:
        srv.hold.when = None
    assert counters["requests_cancelled"] == before + 1
    assert srv.engine.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_disconnect_while_waiting_for_json_frees_every_slot(srv):
    import socket

    before = wait_idle(srv.coordinator)["requests_cancelled"]
    srv.hold.when = lambda engine: any(r.output.token_ids for r in engine.running)  # admitted, then held
    body = json.dumps({"prompt": "a b", "max_tokens": 40, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {srv.serving.http.address}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection((srv.serving.http.host, srv.serving.http.port), timeout=30) as sock:
            sock.sendall(head + body)
            deadline = time.monotonic() + 10
            while srv.coordinator.counters()["running"] != 1:  # the request holds its slots now
                assert time.monotonic() < deadline
                time.sleep(0.01)
        counters = wait_idle(srv.coordinator)  # the socket is closed: no response will be read
    finally:
        srv.hold.when = None
    assert counters["requests_cancelled"] == before + 1
    assert srv.engine.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_full_server_is_503_and_a_refused_choice_frees_the_others(srv, monkeypatch):
    max_queued = srv.coordinator.max_queued
    srv.hold.when = lambda engine: True  # nothing advances: an admitted first choice stays live
    before = srv.coordinator.counters()["requests_cancelled"]
    try:
        srv.coordinator.max_queued = 1
        # room for one, two asked for: refused before any choice is admitted
        with pytest.raises(openai.InternalServerError) as e:
            srv.client.completions.create(model=srv.model, prompt="a", n=2, max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "resource_exhausted"
        assert e.value.body["type"] == "server_error" and "max_queued=1" in e.value.body["message"]
        assert wait_idle(srv.coordinator)["requests_cancelled"] == before  # nothing was admitted
        # the room taken between the check and the admission (the check passes, admission refuses the second
        # choice): the admitted first choice is aborted
        monkeypatch.setattr(srv.coordinator, "check_room", lambda n=1: None)
        with pytest.raises(openai.InternalServerError) as e:
            srv.client.completions.create(model=srv.model, prompt="a", n=2, max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "resource_exhausted"
        counters = wait_idle(srv.coordinator)
    finally:
        monkeypatch.undo()
        srv.coordinator.max_queued = max_queued
        srv.hold.when = None
    assert counters["requests_cancelled"] == before + 1
    assert srv.engine.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_a_failed_request_is_a_500_or_an_error_event(srv):
    srv.hold.fail_next = True
    with pytest.raises(openai.InternalServerError) as e:
        srv.client.completions.create(model=srv.model, prompt="a", max_tokens=4)
    assert e.value.status_code == 500 and e.value.body["message"].endswith("internal error: the engine step failed")
    assert "injected" not in e.value.body["message"]  # the exception stays in the server log
    srv.hold.fail_next = True
    with pytest.raises(openai.APIError) as e:
        list(
            srv.client.chat.completions.create(
                model=srv.model, messages=[{"role": "user", "content": "a"}], max_tokens=4, stream=True
            )
        )
    assert e.value.body["code"] == "internal_error" and "injected" not in e.value.body["message"]
    wait_idle(srv.coordinator)


def test_metrics_endpoint_serves_the_coordinators_metrics(srv):
    """/metrics renders coordinator.metrics when the coordinator has one, else 404 (app over stand-ins)."""
    from fastapi.testclient import TestClient

    from specdist.api.http_server import create_app

    class FakeMetrics:
        def render(self):
            return b"specdist_requests_total 3\n", "text/plain; version=0.0.4; charset=utf-8"

    coordinator = SimpleNamespace(engine=srv.engine, accepting=True, target_is_down=False)
    with TestClient(create_app(coordinator)) as c:
        r = c.get("/metrics")
        assert r.status_code == 404 and r.json()["error"]["message"].startswith("metrics are not enabled")
        coordinator.metrics = FakeMetrics()
        r = c.get("/metrics")
        assert (r.status_code, r.content) == (200, b"specdist_requests_total 3\n")
        assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        coordinator.accepting = False
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "shutting down"})
        coordinator.target_is_down = True  # a deployment's target is being rebuilt
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "target down"})


def test_cli_http_port_without_the_extra(monkeypatch, capsys):
    from specdist.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", "--http-port", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install -e ".[http]"' in err, err
    monkeypatch.delitem(sys.modules, "fastapi")
    with pytest.raises(SystemExit):
        main(["serve", "--port", "50999", "--http-port", "50999"])
    assert "--http-port 50999" in capsys.readouterr().err


def test_events_are_sse(srv):
    """The raw stream: ``data: {json}`` events, the last one ``data: [DONE]``."""
    with srv.http.stream(
        "POST", srv.base + "/v1/completions", json={"prompt": "a", "max_tokens": 3, "stream": True, "temperature": 0}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.slow
def test_serve_process_runs_both_protocols_and_stops_on_sigint(tiny_models, tmp_path):
    """`specdist serve --http-port` as a process: gRPC and HTTP up on one coordinator giving the
    same text, and SIGINT drains and stops both, exit status 0."""
    import os
    import signal
    import subprocess

    import yaml

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_models, "model", 3)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdist.cli", "serve", "--config", str(cfg), "--port", "0", "--http-port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        lines = []
        while not any("OpenAI-compatible HTTP API on" in line for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)  # the process ended before serving
            lines.append(line)
        base = lines[-1].split(" on ")[-1].strip().removesuffix("/v1")
        grpc_address = next(line for line in lines if line.startswith("[specdist] serving")).split(" on ")[-1].strip()
        frozen = next(line for line in lines if "start-up objects frozen out of the garbage collector" in line)
        assert int(frozen.split()[1]) > 10_000  # the loaded engine's objects (specdist.gc_freeze)
        with httpx.Client(trust_env=False, timeout=30) as http:
            assert http.get(base + "/health").json() == {"status": "ok"}
            r = http.post(base + "/v1/completions", json={"prompt": "a b", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        with SpecDistClient(grpc_address) as c:
            assert c.generate_text("a b", max_tokens=4, temperature=0)[0] == r.json()["choices"][0]["text"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_same_seed_twice_gives_the_same_text_under_local_yaml(smollm2_loaded):
    """The shipped configs/local.yaml (native weights, suffix drafts, adaptive lengths, gumbel
    coupling) through the official client: the second request drafts differently (the suffix index
    learned the first one's text, and the length rule has new measurements) and gives the same text."""
    from pathlib import Path

    tok, _, native = smollm2_loaded
    engine = Engine.from_config(
        str(Path(__file__).resolve().parents[2] / "configs" / "local.yaml"), tokenizer=tok, target=native
    )
    lt = LoopThread()
    serving = lt.run(start_serving(backend=Backend(engine), host="127.0.0.1", port=0, http_port=0, drain_seconds=1))
    try:
        with httpx.Client(trust_env=False, timeout=60) as http:
            client = openai.OpenAI(
                base_url=f"http://{serving.http.address}/v1", api_key="unused", max_retries=0, http_client=http
            )
            kw = dict(
                model=engine.config.target.model,
                max_tokens=32,
                temperature=0.9,
                seed=11,
                messages=[{"role": "user", "content": "Write two sentences about the sea."}],
            )
            texts = [client.chat.completions.create(**kw).choices[0].message.content for _ in range(2)]
        assert texts[0] == texts[1] and len(texts[0]) > 0
        assert engine.stats.drafted > 0  # speculation ran
    finally:
        lt.run(serving.stop())
        lt.close()
