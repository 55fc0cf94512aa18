"""Requests that cost the server far more than their size: the event loop stays responsive.

A chat body of 140,000 empty messages (3.5 MB) is refused with a 400 naming ``messages`` while a probe
task on the server's event loop measures the loop's longest stall; messages past ``limits.max_messages``
are refused, and each message costs characters of the prompt limit. The server: ``start_http`` over the tiny models on a
background loop.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, tiny_config
from test_http_api import CHAT_TEMPLATE

from specdist import Engine, InvalidArgument, SamplingParams
from specdist.api import http_server
from specdist.api.admission import Limits, check_request
from specdist.api.coordinator import Coordinator

pytestmark = pytest.mark.usefixtures("one_thread")
STALL_LIMIT_S = 0.2


class LoopLag:
    """A task on ``loop`` that sleeps 5 ms at a time and keeps the longest overshoot: the loop's longest stall."""

    def __init__(self, lt: LoopThread):
        self.lt, self.worst, self.running = lt, 0.0, True
        self.task = asyncio.run_coroutine_threadsafe(self._probe(), lt.loop)

    async def _probe(self) -> None:
        while self.running:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, time.perf_counter() - t0 - 0.005)

    def stop(self) -> float:
        self.running = False
        self.task.result(10)
        return self.worst


@pytest.fixture(scope="module")
def srv(tiny_models):
    cfg = dict(tiny_config(tiny_models, "none"), limits={"max_messages": 8})
    engine = Engine.from_config(cfg)
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    lt = LoopThread()
    coordinator = Coordinator(engine, max_queued=16)
    http = lt.run(http_server.start_http(coordinator, "127.0.0.1", 0))
    client = httpx.Client(trust_env=False, timeout=60)
    yield lt, coordinator, http, client
    client.close()
    lt.run(http.stop())
    lt.run(coordinator.close())
    lt.close()


def _body(messages: list[dict], **kw) -> bytes:
    return json.dumps({"messages": messages, **kw}, separators=(",", ":")).encode()


def _chat(srv, messages: list[dict] | bytes, **kw) -> httpx.Response:
    lt, coordinator, http, client = srv
    body = messages if isinstance(messages, bytes) else _body(messages, **kw)
    return client.post(
        f"http://{http.address}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )


def test_messages_past_the_limit_are_refused(srv):
    ok = _chat(srv, [{"role": "user", "content": "a"}] * 8, max_tokens=2)
    assert ok.status_code == 200, ok.text
    r = _chat(srv, [{"role": "user", "content": "a"}] * 9, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"] == "messages: has 9 messages; the limit is 8"


def test_140000_empty_messages_are_refused_without_stalling_the_loop(srv):
    lt = srv[0]
    _chat(srv, [{"role": "user", "content": "a"}], max_tokens=1)  # warm: the first request's one-time costs,
    warm = _chat(srv, [{"role": "user", "content": "," * 20_000}], max_tokens=1)  # the parser process's start too
    assert warm.status_code == 400 and "characters" in warm.json()["error"]["message"]
    body = _body([{"role": "", "content": ""}] * 140_000, max_tokens=2)  # made before the probe: this process
    lag = LoopLag(lt)  # runs the client too, and its work holds the interpreter lock
    t0 = time.monotonic()
    r = _chat(srv, body)
    elapsed = time.monotonic() - t0
    worst = lag.stop()
    assert worst < STALL_LIMIT_S, f"the event loop stalled {worst * 1000:.0f} ms"
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "140000 messages" in r.json()["error"]["message"]
    assert elapsed < 30
    print(f"140,000 messages: refused in {elapsed:.2f} s, the loop's longest stall {worst * 1000:.0f} ms")


def test_each_message_costs_characters_of_the_prompt_limit():
    limits = Limits(
        max_message_bytes=1 << 20,
        max_prompt_chars=100,
        max_prompt_tokens=63,
        max_tokens=64,
        max_stop=4,
        max_stop_chars=8,
        max_stop_token_ids=4,
        max_request_id_chars=16,
        max_n=1,
    )
    empty = {"role": "", "content": ""}
    check_request(limits, [empty] * 4, SamplingParams())  # 3 x 32 = 96 characters
    with pytest.raises(InvalidArgument, match=r"has 128 characters \(32 for each message past the first\)") as e:
        check_request(limits, [empty] * 5, SamplingParams())
    assert e.value.field == "prompt"  # the HTTP API names it messages (test above)
