"""ReplicaFront (specdist/api/replica_set.py) over a scripted transport: admission, retries once elsewhere before
the first token, never after, cancel reaching the replica, counters and the front's metrics."""

from __future__ import annotations

import asyncio

import pytest

from specdist.api.engine_thread import Delta
from specdist.api.live_requests import LiveRequests
from specdist.api.refusals import DuplicateRequestId, Overloaded, TargetDown, TenantQuotaExceeded
from specdist.api.replica_set import Admitted, FrontEngine, Refused, ReplicaFront
from specdist.api.router import RouteRequest, session_key
from specdist.api.tokenizer_pool import TokenizerPool
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
        self.routes = []  # the RouteRequest of each open
        self.calls: list[Call] = []

    def open(self, prompt, params, request_id, scope, tenant, route, age_s, avoid=""):
        self.opened.append((request_id, avoid))
        self.routes.append(route)
        self.calls.append(Call(self.scripts.pop(0)))
        return self.calls[-1]

    def failure(self, exc):
        return "died" if isinstance(exc, ReplicaDied) else None


def _front(scripts, max_queued=4, tenant_quota=None):
    cfg = load_config({"target": {"model": "unused"}, "router": {"policy": "round-robin"}})
    engine = FrontEngine(cfg, tokenizer=None, vocab_size=100, max_model_len=64, k=3, replicas=lambda: 2)
    t = Transport(scripts)
    return ReplicaFront(engine, t, max_queued=max_queued, tenant_quota=tenant_quota), t


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
        deltas = await _drain(s)
        s.close()  # after its end: nothing more is counted
        return s.replica_id, deltas

    rid, deltas = asyncio.run(go())
    assert rid == "A" and [d.token_ids for d in deltas] == [[1, 2], [3]]
    counts = front.counters()
    assert front.routed == {"A": 1} and counts["live_requests"] == counts["active_streams"] == 0
    assert (counts["requests_total"], counts["requests_finished"], counts["requests_cancelled"]) == (1, 1, 0)
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
    front, t = _front(
        [[Admitted("A"), _tok("r", [], "error", ErrorCode.UNAVAILABLE)], [Admitted("B"), _tok("r", [8], "length")]]
    )
    assert [d.token_ids for d in asyncio.run(go(front))] == [[8]]
    # 3: after a token: the stream ends with UNAVAILABLE, no second replica
    front, t = _front([[Admitted("A"), _tok("r", [1]), ReplicaDied()], [Admitted("B")]])
    deltas = asyncio.run(go(front))
    assert deltas[-1].finish_reason == "error" and deltas[-1].code == ErrorCode.UNAVAILABLE
    assert len(t.opened) == 1 and front.counters()["requests_failed"] == 1


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
    assert front.counters()["live_requests"] == 0 and front.counters()["requests_cancelled"] == 1
    assert len(t.opened) == 1  # the refused opens never reached a replica


def test_a_tenant_holds_at_most_its_quota_of_live_requests_over_all_replicas():
    """limits.max_queued_per_tenant as one group's coordinator enforces it: RESOURCE_EXHAUSTED (HTTP 429) for the
    tenant over its quota, before any replica is asked; other tenants still served; a place freed is its again."""
    front, t = _front(
        [
            [Admitted("A"), _tok("a1", [1])],
            [Admitted("B"), _tok("a2", [1])],
            [Admitted("A"), _tok("b1", [1])],
            [Admitted("B"), _tok("a3", [1])],
        ],
        max_queued=8,
        tenant_quota=2,
    )

    async def go():
        a1 = await front.open([1], request_id="a1", scope="acme", tenant="acme")
        await front.open([1], request_id="a2", scope="acme", tenant="acme")
        with pytest.raises(TenantQuotaExceeded) as e:
            await front.open([1], request_id="a3", scope="acme", tenant="acme")
        assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED and e.value.http_status == 429
        assert len(t.opened) == 2  # refused here: no replica asked
        await front.open([1], request_id="b1", scope="umbrella", tenant="umbrella")  # another tenant's place
        assert await front.cancel("a1", scope="acme") and a1.closed
        await front.open([1], request_id="a3", scope="acme", tenant="acme")  # a1's place is acme's again

    asyncio.run(go())
    assert [rid for rid, _ in t.opened] == ["a1", "a2", "b1", "a3"]
    with pytest.raises(ValueError):
        _front([], tenant_quota=0)


def test_a_request_refused_by_its_replica_frees_its_tenant_s_place():
    front, t = _front(
        [[Refused(InvalidArgument("params.top_p", "bad"), "A")], [Admitted("A"), _tok("r2", [1])]], tenant_quota=1
    )

    async def go():
        with pytest.raises(InvalidArgument):
            await front.open([1], request_id="r1", tenant="acme")
        return await front.open([1], request_id="r2", tenant="acme")

    assert asyncio.run(go()).replica_id == "A"


def test_the_grpc_front_door_gives_the_replica_front_the_tenants_quota():
    """``specdist serve`` with replicas hands its ReplicaFront to the gRPC server, which knows the tenants (one
    token each): the front enforces the same quota a one-group server's coordinator would."""
    from specdist.api.grpc_server import serve
    from specdist.transport.security import ServerSecurity

    front, _ = _front([], max_queued=5)
    front.engine.config.limits.max_queued_per_tenant = None  # the default: half the places with several tenants

    async def go():
        server, coordinator = await serve(
            front.engine, "127.0.0.1", 0, 5, 0.0, ServerSecurity(token=("tok-a", "tok-b")), coordinator=front
        )
        await server.stop(0)
        return coordinator

    assert asyncio.run(go()) is front and front.tenant_quota == 3


def test_the_route_carries_the_request_s_kind_and_session_to_the_router():
    front, t = _front([[Admitted("A"), _tok("e", [1], "length")], [Admitted("A"), _tok("d", [1], "length")]])

    async def go():
        await _drain(await front.open(list(range(40)), request_id="e", tenant="acme", session="s1", kind="edit"))
        await _drain(await front.open(list(range(40)), request_id="d", tenant="acme"))

    asyncio.run(go())
    edit, plain = t.routes
    assert (edit.kind, plain.kind) == ("edit", "default")
    assert edit.session == session_key("acme", "s1", (), 2) and edit.prompt_tokens == 40
    assert plain.session == session_key("acme", None, plain.prompt_blocks, 2)  # no session: its first blocks
    assert RouteRequest.from_dict(edit.to_dict()) == edit  # (what the handle call carries to Serve's router)


def test_the_front_admits_and_tokenizes_with_the_coordinators_parts():
    """One admission and one tokenizer pool for the coordinator and the front: the same refusal, word for word."""
    front, t = _front([], max_queued=3, tenant_quota=2)
    assert isinstance(front.live, LiveRequests) and isinstance(front.tokenizers, TokenizerPool)
    assert (front.max_queued, front.tenant_quota) == (3, 2)
    one_group = LiveRequests()
    for bad in ("", "x" * 1000):
        with pytest.raises(InvalidArgument) as here:
            asyncio.run(front.open([1], request_id=bad))
        with pytest.raises(InvalidArgument) as there:
            one_group.admissible(bad)
        assert str(here.value) == str(there.value)
    prompt = asyncio.run(front.encode([5, 6, 7]))
    assert list(prompt.ids) == [5, 6, 7] and not t.opened
