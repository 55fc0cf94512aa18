"""Holes a security / fault review found (issue 21), each closed and kept closed here.

- Finding 11: sampling floats are checked as the float32 values the samplers use. A value that
  float32 makes 0, subnormal or infinite (``top_p = 1e-46`` -> 0: NaN probabilities;
  ``temperature = 1e39`` -> inf: a 500 over Ray) is INVALID_ARGUMENT / HTTP 400 naming the
  field, in process, over gRPC and over HTTP; a value float32 holds (``top_p = 1e-30``) is served.
- Finding 7: ``limits.max_prompt_chars`` follows ``engine.max_model_len`` (``PROMPT_CHARS_PER_TOKEN``
  characters per token) unless set; a chat prompt over it is refused before it is tokenized.
- Finding 9: with a bearer token the HTTP API's ``/openapi.json`` needs it too (``/docs`` and
  ``/redoc`` are not served); ``/health`` stays open for the probes.

One server (gRPC + HTTP over one coordinator, tiny models, max_model_len 64, a token) serves the
request tests; a second one without a token checks that /openapi.json is then open.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import grpc
import openai
import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import TINY_CHAT_TEMPLATE, LoopThread, serving_in_process, tiny_config

from specdist import Engine
from specdist.api.admission import MESSAGE_COST_CHARS, Limits, check_request
from specdist.api.serving import Backend, start_serving
from specdist.config import PROMPT_CHARS_PER_TOKEN, load_config
from specdist.errors import InvalidArgument
from specdist.sampling_params import SamplingParams
from specdist.transport.security import ServerSecurity, bearer_metadata
from specdist.v1 import common_pb2, specdist_pb2, specdist_pb2_grpc

TOKEN = "review-holes-token-0123456789"
MAX_MODEL_LEN = 64  # tiny_config's
GREEDY = dict(max_tokens=4, temperature=0, ignore_eos=True)
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


@pytest.fixture(scope="module")
def srv(tiny_models):
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3, max_model_len=MAX_MODEL_LEN))
    engine.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    lt = LoopThread()
    serving = lt.run(
        start_serving(
            backend=Backend(engine),
            host="127.0.0.1",
            port=0,
            http_port=0,
            drain_seconds=1,
            security=ServerSecurity(token=TOKEN),
        )
    )
    channel = grpc.insecure_channel(serving.address)
    http = httpx.Client(trust_env=False, timeout=30)
    base = f"http://{serving.http.address}"
    s = SimpleNamespace(
        engine=engine,
        coordinator=serving.server.coordinator,
        http=http,
        base=base,
        stub=specdist_pb2_grpc.SpecDecodeStub(channel),
        openai=openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, http_client=http),
        model=engine.config.target.model,
    )
    yield s
    channel.close()
    http.close()
    lt.run(serving.stop())
    lt.close()


def _generate(srv, params: dict, text: str = "a b", chat: bool = False) -> list:
    req = specdist_pb2.GenerateRequest(params=common_pb2.SamplingParams(**params), text=text, apply_chat_template=chat)
    return list(srv.stub.Generate(req, timeout=30, metadata=bearer_metadata(TOKEN)))


def _requests_total(srv) -> int:
    return srv.coordinator.counters()["requests_total"]


def _wait_idle(srv, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while srv.coordinator.counters()["live_requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


# ---------------------------------------------------------------- finding 11: float32 sampling floats
# (field, value): each is a valid Python float that float32 makes 0, subnormal or infinite
FLOAT32_BAD = [
    ("top_p", 1e-46),  # float32 0: top-p keeps nothing, NaN probabilities
    ("top_p", 1e-40),  # float32 subnormal: 0 wherever subnormals are flushed
    ("temperature", 1e39),  # float32 inf
    ("temperature", -1e39),
    ("temperature", 1e-46),  # > 0 (sampled) in Python, 0 (greedy) in float32
    ("temperature", 1e-40),  # subnormal: the sampler divides by it
    ("temperature", 10**400),  # an int float() cannot even hold
]
FLOAT32_OK = [
    dict(top_p=1e-30),
    dict(top_p=FLOAT32_TINY),
    dict(temperature=1e-30),
    dict(temperature=3e38),
    dict(temperature=0),
    dict(top_p=1.0),
]


@pytest.mark.parametrize(
    "name, value", FLOAT32_BAD, ids=[f"{n}={v:.0e}" if isinstance(v, float) else f"{n}=10**400" for n, v in FLOAT32_BAD]
)
def test_sampling_params_refuse_floats_float32_breaks(name, value):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**{name: value})
    assert e.value.field == name and "float32" in e.value.message, str(e.value)


@pytest.mark.parametrize("kw", FLOAT32_OK, ids=[str(k) for k in FLOAT32_OK])
def test_sampling_params_keep_floats_float32_holds(kw):
    sp = SamplingParams(**kw)
    assert all(getattr(sp, k) == v for k, v in kw.items())  # stored as given, not rounded


def test_engine_samples_with_tiny_top_p_and_huge_temperature(srv):
    """In process: values float32 holds sample real tokens (no NaN probabilities, no error)."""
    for kw in (dict(top_p=1e-30), dict(temperature=3e38), dict(temperature=1e-30)):
        out = srv.engine.generate(["a b"], SamplingParams(max_tokens=4, ignore_eos=True, seed=1, **kw))[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length", kw
        # top_p = 1e-30 keeps only the most likely token: greedy's tokens
        if "top_p" in kw:
            assert out.token_ids == srv.engine.generate(["a b"], SamplingParams(**GREEDY))[0].token_ids


@pytest.mark.parametrize(
    "name, value", [("top_p", 1e-46), ("temperature", 1e39), ("top_p", 1e-40), ("temperature", 1e-40)]
)
def test_grpc_refuses_floats_float32_breaks(srv, name, value):
    before = _requests_total(srv)
    with pytest.raises(grpc.RpcError) as e:
        _generate(srv, dict(max_tokens=2, **{name: value}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert e.value.details().startswith(f"params.{name}: "), e.value.details()
    assert "\n" not in e.value.details()
    assert _requests_total(srv) == before


def test_grpc_serves_floats_float32_holds(srv):
    for kw in FLOAT32_OK:
        last = _generate(srv, dict(max_tokens=2, ignore_eos=True, **kw))[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH, kw
    _wait_idle(srv)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize(
    "name, value", [("top_p", 1e-46), ("temperature", 1e39), ("top_p", 1e-40), ("temperature", 1e-46)]
)
def test_http_refuses_floats_float32_breaks(srv, chat, name, value):
    before = _requests_total(srv)
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            srv.openai.chat.completions.create(
                model=srv.model, messages=[{"role": "user", "content": "a b"}], max_tokens=2, **{name: value}
            )
        else:
            srv.openai.completions.create(model=srv.model, prompt="a b", max_tokens=2, **{name: value})
    assert e.value.status_code == 400
    assert e.value.body["param"] == name and e.value.body["message"].startswith(f"{name}: "), e.value.body
    assert _requests_total(srv) == before


def test_http_serves_floats_float32_holds(srv):
    for kw in FLOAT32_OK:
        out = srv.openai.completions.create(
            model=srv.model, prompt="a b", max_tokens=2, seed=3, extra_body={"ignore_eos": True}, **kw
        )
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2, kw
    _wait_idle(srv)


# ---------------------------------------------------------------- finding 7: max_prompt_chars follows max_model_len
def test_limits_take_each_setting_of_the_config_section_by_its_name():
    defaults = load_config(None).limits
    section = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(Limits)}  # each a key of the config
    changed = {k: (not v) if isinstance(v, bool) else 40 if v is None else v - 1 for k, v in section.items()}
    engine = SimpleNamespace(config=load_config({"limits": changed}), max_model_len=MAX_MODEL_LEN)
    assert dataclasses.asdict(Limits.of(engine)) == changed
    unset = SimpleNamespace(config=load_config(None), max_model_len=MAX_MODEL_LEN)
    resolved = Limits.of(unset)
    assert (resolved.max_prompt_tokens, resolved.max_tokens) == (MAX_MODEL_LEN - 1, MAX_MODEL_LEN)


def test_max_prompt_chars_default_follows_max_model_len(srv):
    assert load_config(None).limits.max_prompt_chars is None  # null: derived from the served engine
    assert PROMPT_CHARS_PER_TOKEN >= 16  # generous: no real tokenizer averages that many characters a token
    assert Limits.of(srv.engine).max_prompt_chars == MAX_MODEL_LEN * PROMPT_CHARS_PER_TOKEN
    explicit = SimpleNamespace(config=load_config({"limits": {"max_prompt_chars": 1 << 20}}), max_model_len=64)
    assert Limits.of(explicit).max_prompt_chars == 1 << 20  # an explicit setting is honoured
    limits, cap = Limits.of(srv.engine), MAX_MODEL_LEN * PROMPT_CHARS_PER_TOKEN

    def chat(chars: int) -> list[dict]:  # every string of the messages counts, the roles too, and the second message
        return [
            {"role": "user", "content": "a" * (chars - 14 - MESSAGE_COST_CHARS)},
            {"role": "assistant", "content": "b"},
        ]

    check_request(limits, chat(cap), SamplingParams())  # at the cap: passes the character check
    with pytest.raises(InvalidArgument) as e:
        check_request(limits, chat(cap + 1), SamplingParams())
    assert e.value.field == "prompt" and f"has {cap + 1} characters" in e.value.message


def _over_cap_messages() -> list[dict]:
    cap = MAX_MODEL_LEN * PROMPT_CHARS_PER_TOKEN
    half = "a b " * (cap // 8 + 1)  # two messages of about cap / 2 characters each, together over the cap
    return [{"role": "user", "content": half}, {"role": "user", "content": half}]


@pytest.fixture
def no_tokenizing(srv, monkeypatch):
    """Fails any tokenization of a prompt while the test runs (the refusal must come first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    for name in ("apply_chat_template", "encode", "__call__"):
        monkeypatch.setattr(type(srv.engine.tokenizer), name, refuse)


def test_http_chat_over_the_derived_char_cap_is_refused_before_tokenizing(srv, no_tokenizing):
    cap = MAX_MODEL_LEN * PROMPT_CHARS_PER_TOKEN
    before = _requests_total(srv)
    with pytest.raises(openai.BadRequestError) as e:
        srv.openai.chat.completions.create(model=srv.model, messages=_over_cap_messages(), max_tokens=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "messages", e.value.body
    assert e.value.body["message"].startswith("messages: has ") and f"the limit is {cap}" in e.value.body["message"]
    assert _requests_total(srv) == before


def test_grpc_chat_over_the_derived_char_cap_is_refused_before_tokenizing(srv, no_tokenizing):
    cap = MAX_MODEL_LEN * PROMPT_CHARS_PER_TOKEN
    before = _requests_total(srv)
    with pytest.raises(grpc.RpcError) as e:
        _generate(srv, dict(max_tokens=2), text="a b " * (cap // 4 + 1), chat=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prompt: has ") and f"the limit is {cap}" in e.value.details()
    assert _requests_total(srv) == before


# ---------------------------------------------------------------- finding 9: /openapi.json behind the token
def test_openapi_needs_the_token(srv):
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        r = srv.http.get(srv.base + "/openapi.json", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert TOKEN not in r.text
    r = srv.http.get(srv.base + "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"], r.text
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):  # not served, with or without the token
        assert srv.http.get(srv.base + path).status_code in (401, 404), path
        assert srv.http.get(srv.base + path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404, path
    assert srv.http.get(srv.base + "/health").status_code == 200  # probes stay open
    # the official client, through its raw-request path, with and without the key
    bad = openai.OpenAI(base_url=srv.base, api_key="not-the-token", max_retries=0, http_client=srv.http)
    with pytest.raises(openai.AuthenticationError):
        bad.get("openapi.json", cast_to=httpx.Response)
    good = openai.OpenAI(base_url=srv.base, api_key=TOKEN, max_retries=0, http_client=srv.http)
    assert good.get("openapi.json", cast_to=httpx.Response).status_code == 200


def test_openapi_open_without_a_token(tiny_models):
    with serving_in_process(tiny_models) as (_, serving):
        with httpx.Client(trust_env=False, timeout=30) as http:
            r = http.get(f"http://{serving.http.address}/openapi.json")
            assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
            assert http.get(f"http://{serving.http.address}/docs").status_code == 404
