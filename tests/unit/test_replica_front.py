"""ReplicaFront (specdist/api/replica_set.py) over a scripted transport: admission, retries once elsewhere before
the first token, never after, cancel reaching the replica, counters and the front's metrics."""

from __future__ import annotations

import asyncio

import pytest

from specdist.api.coordinator import Delta, DuplicateRequestId, Overloaded, TargetDown
from specdist.api.replica_set import Admitted, FrontEngine, Refused, ReplicaFront
from specdist.config import load_config
from specdist.errors import ErrorCode, InvalidArgument


class Call:
    """One scripted stream: its items, then StopAsyncIteration; records cancel()."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled or not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class ReplicaDied(Exception):
    pass


class Transport:
    def __init__(self, scripts):
        self.scripts = list(scripts)  # one per open, in order
        self.opened: list[tuple[str, str]] = []  # (request id, avoid)
        self.calls: list[Call] = []

    def open(self, prompt, params, request_id, scope, tenant, route, age_s, avoid=""):
        self.opened.append((request_id, avoid))
        self.calls.append(Call(self.scripts.pop(0)))
        return self.calls[-1]

    def failure(self, exc):
        return "died" if isinstance(exc, ReplicaDied) else None


def _front(scripts, max_queued=4):
    cfg = load_config({"target": {"model": "unused"}, "router": {"policy": "round-robin"}})
    engine = FrontEngine(cfg, tokenizer=None, vocab_size=100, max_model_len=64, k=3, replicas=lambda: 2)
    t = Transport(scripts)
    return ReplicaFront(engine, t, max_queued=max_queued), t


def _tok(rid, ids, finish=None, code=None):
    return Delta(rid, ids, "", finish_reason=finish, code=code)


async def _drain(stream):
    out = []
    async for d in stream:
        out.append(d)
    return out


def test_a_stream_runs_on_the_replica_that_admitted_it():
    front, t = _front([[Admitted("A"), _tok("r", [1, 2]), _tok("r", [3], "length")]])

    async def go():
        s = await front.open([1, 2, 3], request_id="r")
        return s.replica_id, await _drain(s)

    rid, deltas = asyncio.run(go())
    assert rid == "A" and [d.token_ids for d in deltas] == [[1, 2], [3]]
    assert front.routed == {"A": 1} and front.counters()["live_requests"] == 0
    assert front.tally["requests_finished"] == 1
    body, _ = front.metrics.render()
    assert b'specdist_router_requests_total{policy="round-robin",replica="A"} 1.0' in body
    assert b"specdist_replicas 2.0" in body


def test_a_replica_refusing_as_unavailable_sends_the_request_once_to_another():
    front, t = _front([[Refused(TargetDown("down"), "A")], [Admitted("B"), _tok("r", [5], "length")]])

    async def go():
        s = await front.open([1], request_id="r")
        return s.replica_id, await _drain(s)

    rid, deltas = asyncio.run(go())
    assert rid == "B" and deltas[-1].finish_reason == "length"
    assert t.opened == [("r", ""), ("r", "A")] and front.tally["retried"] == 1


def test_other_refusals_are_the_clients_answer_as_they_are():
    bad = InvalidArgument("params.top_p", "must be in (0, 1]")
    front, t = _front([[Refused(bad, "A")]])
    with pytest.raises(InvalidArgument, match="params.top_p"):
        asyncio.run(front.open([1], request_id="r"))
    assert len(t.opened) == 1 and front.counters()["live_requests"] == 0


def test_a_replica_failing_before_the_first_token_is_retried_once_after_never():
    # 1: the replica dies before any token -> reopened elsewhere, avoiding it
    front, t = _front([[Admitted("A"), ReplicaDied()], [Admitted("B"), _tok("r", [7], "length")]])

    async def go(f):
        return await _drain(await f.open([1], request_id="r"))

    assert [d.token_ids for d in asyncio.run(go(front))] == [[7]]
    assert t.opened == [("r", ""), ("r", "A")]
    # 2: an UNAVAILABLE error delta before any token (its target rank lost) -> the same
    front, t = _front([[Admitted("A"), _tok("r", [], "error", ErrorCode.UNAVAILABLE)],
                       [Admitted("B"), _tok("r", [8], "length")]])
    assert [d.token_ids for d in asyncio.run(go(front))] == [[8]]
    # 3: after a token: the stream ends with UNAVAILABLE, no second replica
    front, t = _front([[Admitted("A"), _tok("r", [1]), ReplicaDied()], [Admitted("B")]])
    deltas = asyncio.run(go(front))
    assert deltas[-1].finish_reason == "error" and deltas[-1].code == ErrorCode.UNAVAILABLE
    assert len(t.opened) == 1 and front.tally["requests_failed"] == 1


def test_cancel_cancels_the_replica_call_and_admission_bounds_hold():
    front, t = _front([[Admitted("A"), _tok("r", [1])], [Admitted("A")]], max_queued=1)

    async def go():
        s = await front.open([1], request_id="r")
        with pytest.raises(DuplicateRequestId):
            await front.open([1], request_id="r")
        with pytest.raises(Overloaded):
            await front.open([1], request_id="other")
        assert await front.cancel("r") and not await front.cancel("r")
        return s

    s = asyncio.run(go())
    assert t.calls[0].cancelled and s.closed
    assert front.counters()["live_requests"] == 0 and front.tally["requests_cancelled"] == 1
    assert len(t.opened) == 1  # the refused opens never reached a replica
