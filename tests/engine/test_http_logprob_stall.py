"""Log-probabilities in HTTP responses cost the event loop little at a time.

A chat request (a JSON response) with ``n = 16``, ``top_logprobs = 20`` and the longest output the model's
context allows asks for 16 x 254 x 21 entries, each with a token's text; a probe task on the server's event loop
(:class:`LoopWork`) measures the loop's longest stall while it runs. The entries are formatted and encoded as
each step's deltas arrive, each token id decoded once, so no one burst formats them all at the end. Past
``limits.max_logprob_entries`` (``n x (top_logprobs + 1) x max_tokens``) a request is refused with a 400 naming the
field. The server: ``start_http`` over a tiny Llama with 32 tokens (each of the 20 top entries is one) on a background
loop.
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

from support.helpers import LoopThread
from support.model_zoo import save_tiny
from test_http_amplification import STALL_LIMIT_S
from test_http_api import CHAT_TEMPLATE

from specdist import Engine
from specdist.api import http_server
from specdist.api.coordinator import Coordinator

pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = 256  # the tiny Llama's positions
N, TOP = 16, 20
MAX_TOKENS = CONTEXT - 2  # the prompt "a" and the template's "g"
ENTRIES_LIMIT = N * (TOP + 1) * MAX_TOKENS  # this request exactly: one more token is past it


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = save_tiny(
        str(tmp_path_factory.mktemp("vocab32") / "target"),
        "llama",
        seed=5,
        vocab_size=32,
        max_position_embeddings=CONTEXT,
    )
    cfg = {
        "target": {"model": path},
        "draft": {"method": "none"},
        "engine": {"max_model_len": CONTEXT, "max_batch_size": N, "device": "cpu"},
        "limits": {"max_n": N, "max_logprob_entries": ENTRIES_LIMIT},
    }
    engine = Engine.from_config(cfg)
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    lt = LoopThread()
    coordinator = Coordinator(engine, max_queued=2 * N)
    http = lt.run(http_server.start_http(coordinator, "127.0.0.1", 0))
    client = httpx.Client(trust_env=False, timeout=60)
    yield lt, http, client
    client.close()
    lt.run(http.stop())
    lt.run(coordinator.close())
    lt.close()


def _chat(srv, **kw) -> httpx.Response:
    lt, http, client = srv
    body = {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "ignore_eos": True, "seed": 3, **kw}
    return client.post(
        f"http://{http.address}/v1/chat/completions",
        content=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )


class LoopWork:
    """A task on ``loop`` that wakes every 5 ms and keeps the loop's longest stall twice: as wall time past its
    5 ms (:class:`test_http_amplification.LoopLag`'s measure), and as the loop thread's CPU time between two
    wakeups: the work other callbacks did in one go, which is what the server costs its loop, without the time
    the other processes of a shared machine held the CPU (that makes wall-time stalls of hundreds of ms here)."""

    def __init__(self, lt: LoopThread):
        self.worst_wall = self.worst_cpu = 0.0
        self.running = True
        self.task = asyncio.run_coroutine_threadsafe(self._probe(), lt.loop)

    async def _probe(self) -> None:
        while self.running:
            t0, c0 = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.005)
            self.worst_wall = max(self.worst_wall, time.perf_counter() - t0 - 0.005)
            self.worst_cpu = max(self.worst_cpu, time.thread_time() - c0)

    def stop(self) -> tuple[float, float]:
        self.running = False
        self.task.result(10)
        return self.worst_cpu, self.worst_wall


def test_16_choices_of_20_top_logprobs_do_not_stall_the_loop(srv):
    warm = _chat(srv, n=1, top_logprobs=1, max_tokens=2)  # the first request's one-time costs
    assert warm.status_code == 200, warm.text
    work = LoopWork(srv[0])
    t0 = time.monotonic()
    r = _chat(srv, n=N, top_logprobs=TOP, max_tokens=MAX_TOKENS)
    elapsed = time.monotonic() - t0
    cpu, wall = work.stop()
    assert r.status_code == 200, r.text[:500]
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == list(range(N))
    for ch in choices:  # every token's entry, each with its 20 top entries (none has probability 0)
        entries = ch["logprobs"]["content"]
        assert len(entries) == MAX_TOKENS and ch["logprobs"]["refusal"] is None
        assert all(len(e["top_logprobs"]) == TOP for e in entries)
        assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    print(
        f"n={N}, top_logprobs={TOP}, max_tokens={MAX_TOKENS}: {elapsed:.2f} s, the loop's longest stall "
        f"{cpu * 1000:.0f} ms of its CPU time ({wall * 1000:.0f} ms of wall time)"
    )
    assert cpu < STALL_LIMIT_S, f"the event loop worked {cpu * 1000:.0f} ms in one go"


def test_logprob_entries_past_the_limit_are_refused(srv):
    r = _chat(srv, n=N, top_logprobs=TOP, max_tokens=MAX_TOKENS + 1)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == "top_logprobs" and str(ENTRIES_LIMIT) in err["message"], err
