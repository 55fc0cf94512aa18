"""The config's ``limits`` on both front doors (specdist/api/admission.py decides them once).

One server (gRPC and the HTTP API over one coordinator, on free 127.0.0.1 ports, tiny models)
with small limits. Each limit: a request at its bound is served, one beyond it is
INVALID_ARGUMENT (gRPC) / 400 (HTTP) naming the field as that API names it. A gRPC message
over ``max_message_bytes`` is RESOURCE_EXHAUSTED (grpc's own check), an HTTP body over it
413, and the server keeps serving.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import grpc
import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, tiny_config

from specdist import Engine
from specdist.api.serving import Backend, start_serving
from specdist.config import load_config
from specdist.errors import ConfigError
from specdist.v1 import common_pb2, specdist_pb2, specdist_pb2_grpc

LIMITS = dict(
    max_message_bytes=4096,
    max_prompt_chars=20,
    max_prompt_tokens=10,
    max_tokens=20,
    max_stop=3,
    max_stop_chars=5,
    max_stop_token_ids=4,
    max_request_id_chars=12,
    max_n=3,
)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} g {% endfor %}"
GAUGES = ("running", "queued", "target_kv_slots_used", "draft_kv_slots_used", "active_streams", "live_requests")


@pytest.fixture(scope="module")
def srv(tiny_models):
    engine = Engine.from_config({**tiny_config(tiny_models, "model", 3), "limits": LIMITS})
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    lt = LoopThread()
    serving = lt.run(start_serving(backend=Backend(engine), host="127.0.0.1", port=0, http_port=0, drain_seconds=1))
    channel = grpc.insecure_channel(serving.address)
    http = httpx.Client(trust_env=False, timeout=30)
    s = SimpleNamespace(
        coordinator=serving.server.coordinator,
        channel=channel,
        stub=specdist_pb2_grpc.SpecDecodeStub(channel),
        http=http,
        base=f"http://{serving.http.address}",
    )
    yield s
    channel.close()
    http.close()
    lt.run(serving.stop())
    lt.close()


def wait_idle(coordinator, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(coordinator.counters()[g] for g in GAUGES):
        assert time.monotonic() < deadline, {g: coordinator.counters()[g] for g in GAUGES}
        time.sleep(0.01)


# (what is checked, gRPC request fields at the bound, the same one beyond it, field named over gRPC)
def _grpc_cases():
    ok_stop = ["a" * 5, "b", "c"]
    return [
        ("text chars", dict(text="a b " * 5), dict(text="a b " * 5 + "c"), "prompt"),
        ("token ids", dict(token_ids=[1] * 10), dict(token_ids=[1] * 11), "prompt"),
        ("max_tokens", dict(params=dict(max_tokens=20)), dict(params=dict(max_tokens=21)), "params.max_tokens"),
        ("stop count", dict(params=dict(stop=ok_stop)), dict(params=dict(stop=ok_stop + ["d"])), "params.stop"),
        ("stop chars", dict(params=dict(stop=ok_stop)), dict(params=dict(stop=["a", "b", "c" * 6])), "params.stop[2]"),
        (
            "stop ids",
            dict(params=dict(stop_token_ids=[1, 2, 3, 4])),
            dict(params=dict(stop_token_ids=[1] * 5)),
            "params.stop_token_ids",
        ),
        ("request_id", dict(request_id="r" * 12), dict(request_id="r" * 13), "request_id"),
        ("request_id chars", dict(request_id="ok-id_1.:"), dict(request_id="a b"), "request_id"),
        ("request_id control", dict(request_id="ok"), dict(request_id="ok\n"), "request_id"),
        ("session_id", dict(session_id="s" * 12), dict(session_id="s" * 13), "session_id"),
        ("session_id chars", dict(session_id="user-7"), dict(session_id="a b"), "session_id"),
    ]


def _grpc_request(fields: dict) -> specdist_pb2.GenerateRequest:
    fields = dict(fields)
    params = dict(max_tokens=2, temperature=0)
    params.update(fields.pop("params", {}))
    req = specdist_pb2.GenerateRequest(
        params=common_pb2.SamplingParams(**params),
        request_id=fields.pop("request_id", ""),
        session_id=fields.pop("session_id", ""),
    )
    if "token_ids" in fields:
        req.token_ids.ids.extend(fields.pop("token_ids"))
    else:
        req.text = fields.pop("text", "a b")
    assert not fields
    return req


@pytest.mark.parametrize("what, at_bound, beyond, field", _grpc_cases(), ids=[c[0] for c in _grpc_cases()])
def test_grpc_limit(srv, what, at_bound, beyond, field):
    last = list(srv.stub.Generate(_grpc_request(at_bound), timeout=30))[-1]
    assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP), what
    with pytest.raises(grpc.RpcError) as e:
        list(srv.stub.Generate(_grpc_request(beyond), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    assert e.value.details().startswith(field + ": "), e.value.details()
    wait_idle(srv.coordinator)


def test_grpc_cancel_checks_the_request_id(srv):
    with pytest.raises(grpc.RpcError) as e:
        srv.stub.Cancel(specdist_pb2.CancelRequest(request_id="r" * 12), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND  # at the bound: a valid id no request has
    for bad in ("r" * 13, "a\x1b[2J", ""):
        with pytest.raises(grpc.RpcError) as e:
            srv.stub.Cancel(specdist_pb2.CancelRequest(request_id=bad), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request_id: ")


def test_grpc_message_over_the_size_limit(srv):
    before = srv.coordinator.counters()["requests_total"]
    with pytest.raises(grpc.RpcError) as e:  # 5000 bytes of prompt: the message is over 4096 bytes
        list(srv.stub.Generate(_grpc_request(dict(text="a" * 5000)), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert srv.coordinator.counters()["requests_total"] == before  # never reached the coordinator
    last = list(srv.stub.Generate(_grpc_request({}), timeout=30))[-1]  # the server keeps serving
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.stats.output_tokens == 2


# (endpoint, body fields at the bound, beyond it, the OpenAI param named)
HTTP_CASES = [
    ("completions", dict(prompt="a b " * 5), dict(prompt="a b " * 5 + "c"), "prompt"),
    ("completions", dict(prompt=[1] * 10), dict(prompt=[1] * 11), "prompt"),
    ("completions", dict(prompt=[[1] * 10]), dict(prompt=[[1] * 11]), "prompt"),
    ("completions", dict(max_tokens=20), dict(max_tokens=21), "max_tokens"),
    ("completions", dict(stop=["a" * 5, "b", "c"]), dict(stop=["a", "b", "c", "d"]), "stop"),
    ("completions", dict(stop=["a", "b", "c" * 5]), dict(stop=["a", "b", "c" * 6]), "stop[2]"),
    ("completions", dict(stop="a" * 5), dict(stop="a" * 6), "stop"),
    ("completions", dict(stop_token_ids=[1, 2, 3, 4]), dict(stop_token_ids=[1] * 5), "stop_token_ids"),
    ("completions", dict(n=3), dict(n=4), "n"),
    ("chat", dict(n=3), dict(n=10**9), "n"),  # refused before anything is built for its choices
    (
        "chat",
        dict(messages=[{"role": "user", "content": "a b " * 4}]),  # 4 + 16 characters
        dict(messages=[{"role": "user", "content": "a b " * 4 + "c"}]),
        "messages",
    ),
    ("chat", dict(max_completion_tokens=20), dict(max_completion_tokens=21), "max_completion_tokens"),
    ("chat", dict(max_tokens=20), dict(max_tokens=21), "max_tokens"),
    ("completions", dict(user="u" * 12), dict(user="u" * 13), "user"),  # the session id: as a request id
    ("chat", dict(user="team-7"), dict(user="a b"), "user"),
]


def _post(srv, endpoint: str, fields: dict):
    if endpoint == "completions":
        body = {"prompt": "a b", "max_tokens": 2, "temperature": 0, **fields}
        return srv.http.post(srv.base + "/v1/completions", json=body)
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "temperature": 0, **fields}
    return srv.http.post(srv.base + "/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    "endpoint, at_bound, beyond, param", HTTP_CASES, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(HTTP_CASES)]
)
def test_http_limit(srv, endpoint, at_bound, beyond, param):
    ok = _post(srv, endpoint, at_bound)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = _post(srv, endpoint, beyond)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ": ") and err["type"] == "invalid_request_error"
    wait_idle(srv.coordinator)


def test_http_chat_default_max_tokens_is_the_limit(srv):
    r = srv.http.post(
        srv.base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a"}], "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LIMITS["max_tokens"]


def test_http_body_over_the_size_limit(srv):
    before = srv.coordinator.counters()["requests_total"]
    body = json.dumps({"prompt": "a", "max_tokens": 2, "user": "u" * 5000}).encode()
    r = srv.http.post(srv.base + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunked():  # no Content-Length: refused while reading
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    r = srv.http.post(srv.base + "/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert srv.coordinator.counters()["requests_total"] == before
    assert _post(srv, "completions", {}).status_code == 200  # the server keeps serving


@pytest.mark.parametrize(
    "key, value",
    [
        ("max_message_bytes", 100),
        ("max_prompt_chars", 0),
        ("max_tokens", 15),
        ("max_stop", -1),
        ("max_request_id_chars", 257),
        ("max_prompt_tokens", "many"),
        ("max_stop_chars", True),
        ("max_n", 0),
    ],
)
def test_bad_limits_config(key, value):
    with pytest.raises(ConfigError) as e:
        load_config({"limits": {key: value}})
    assert e.value.key == f"limits.{key}"
