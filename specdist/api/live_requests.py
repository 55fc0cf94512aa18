"""The live requests of a coordinator, on the event loop: admission, their streams, and their counts.

Admission: at most ``max_queued`` requests are live (running + waiting, and those still being tokenized) at once;
one more raises :class:`~specdist.api.refusals.Overloaded`. With a ``tenant_quota`` one tenant holds at most that
many of them; one more of its requests raises :class:`~specdist.api.refusals.TenantQuotaExceeded` while other
tenants are still admitted. A request's id is reserved from its admission until its final delta is dispatched
(:class:`~specdist.api.refusals.DuplicateRequestId` meanwhile). The Coordinator and the front over Serve replicas
(:class:`~specdist.api.replica_set.ReplicaFront`) both admit here (:class:`HoldsLiveRequests`).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import uuid
from collections.abc import Callable

from specdist.api.engine_thread import Delta
from specdist.api.refusals import ENGINE_DOWN_MESSAGE, DuplicateRequestId, Overloaded, TenantQuotaExceeded, engine_down
from specdist.config import MAX_REQUEST_ID_LEN
from specdist.errors import ErrorCode, InvalidArgument

# each finish reason's total (any other, "error" included: requests_failed)
_OUTCOMES = {
    "stop": "requests_finished",
    "length": "requests_finished",
    "abort": "requests_cancelled",
    None: "requests_cancelled",
}


def scoped(scope: str, request_id: str) -> str:
    """The coordinator's (and the engine's) key of a caller's request id: the id within its caller's scope."""
    return f"{scope}/{request_id}" if scope else request_id


class RequestStream:
    """The live side of one request: an async iterator of its deltas.

    ``close()`` (also run when iteration stops early) tells ``on_close(key, finished)`` (the coordinator aborts
    the request unless its final delta was delivered); it is idempotent. ``one_token_deltas``: a step's tokens
    reach the consumer one a delta (:meth:`deliver`).
    """

    def __init__(
        self,
        on_close: Callable[[str, bool], None],
        request_id: str,
        key: str | None = None,
        tenant: str = "",
        one_token_deltas: bool = False,
    ):
        self.request_id = request_id  # the caller's id (what its deltas carry)
        self.key = key or request_id  # the coordinator's and the engine's: the id within its caller's scope
        self.tenant = tenant  # whose request it is (the tenant quota counts them)
        self._on_close = on_close
        self._one_token_deltas = one_token_deltas
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False  # the final delta was delivered to this stream
        self.closed = False
        self.admission: asyncio.Future | None = None  # the add command's outcome (Coordinator.open)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if self.closed or (self.done and self._queue.empty()):
            raise StopAsyncIteration
        delta = await self._queue.get()
        if delta.finished:
            self.close()
        return delta

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._on_close(self.key, self.done)

    def deliver(self, delta: Delta) -> None:
        """Queue a delta for the consumer (on the event loop), under the caller's id; dropped once the stream is
        closed. Where the server keeps speculative counts from clients (``limits.speculative_stats`` false), a
        step's tokens go one a delta (its text with the last), so that a chunk's size does not say how many
        drafts were accepted."""
        self.done = self.done or delta.finished
        if self.closed:
            return
        if delta.request_id != self.request_id:
            delta = dataclasses.replace(delta, request_id=self.request_id)
        if self._one_token_deltas and len(delta.token_ids) > 1:
            ids, lps = delta.token_ids, delta.logprobs
            for i in range(len(ids) - 1):
                self._queue.put_nowait(Delta(self.request_id, [ids[i]], "", logprobs=lps[i : i + 1] if lps else None))
            delta = dataclasses.replace(delta, token_ids=ids[-1:], logprobs=lps[-1:] if lps else None)
        self._queue.put_nowait(delta)


# live requests one tenant may hold: a number, None (no quota), or what a function says at each admission (the
# server's default quota follows the tenants its token file holds, which is re-read when it changes)
TenantQuota = int | None | Callable[[], int | None]


class LiveRequests:
    """The streams of the live requests by key (module docstring), and the totals since start."""

    def __init__(self, max_queued: int = 256, tenant_quota: TenantQuota = None):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self.tenant_quota = tenant_quota

    @property
    def tenant_quota(self) -> int | None:
        """Live requests one tenant may hold now (None: no quota)."""
        return self._quota() if callable(self._quota) else self._quota

    @tenant_quota.setter
    def tenant_quota(self, quota: TenantQuota) -> None:
        if isinstance(quota, int) and quota < 1:
            raise ValueError(f"tenant_quota must be >= 1, got {quota}")
        self._quota = quota
        # by key; admission reads only a stream's tenant (the front over Serve replicas keeps its ReplicaStreams)
        self.streams: dict[str, RequestStream] = {}
        totals = ("requests_total", "requests_finished", "requests_cancelled", "requests_failed")
        self.totals = dict.fromkeys(totals, 0)
        self.active_streams = 0  # admitted streams whose consumer has not let go

    def admissible(self, request_id: str | None, scope: str = "", tenant: str = "") -> str:
        """Refuse a request there is no room for (cheap checks); its id (a new one if ``request_id`` is None)."""
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidArgument("request_id", f"must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
        if scoped(scope, request_id) in self.streams:
            raise DuplicateRequestId(request_id)
        self.check_room()
        quota = self.tenant_quota
        if quota is not None and sum(s.tenant == tenant for s in self.streams.values()) >= quota:  # O(live)
            raise TenantQuotaExceeded(
                f"this tenant holds {quota} live requests (limits.max_queued_per_tenant={quota}); retry later"
            )
        return request_id

    def check_room(self, n: int = 1) -> None:
        """Refuse ``n`` new requests unless there is room for them (:class:`~specdist.api.refusals.Overloaded`)."""
        if len(self.streams) + n > self.max_queued:
            raise Overloaded(f"{len(self.streams)} requests in the system (max_queued={self.max_queued}); retry later")

    def admitted(self, stream: RequestStream, added: asyncio.Future) -> bool:
        """Book a request whose add command has run; False (and forget it) if the add failed."""
        if added.cancelled() or added.exception() is not None:
            self.streams.pop(stream.key, None)
            return False
        self.took()
        return True

    def took(self) -> None:
        """Count a request whose stream goes to its caller now (one more active stream)."""
        self.totals["requests_total"] += 1
        self.active_streams += 1

    def ended(self, key: str, finish_reason: str | None) -> None:
        """A request's life ended with ``finish_reason`` (None: cancelled without a final delta): forget its key,
        count its outcome."""
        self.streams.pop(key, None)
        self.totals[_OUTCOMES.get(finish_reason, "requests_failed")] += 1

    def dispatch(self, deltas: list[Delta]) -> None:
        """Hand one pass's deltas to their streams; a final delta ends its request's life here."""
        for delta in deltas:
            stream = self.streams.get(delta.request_id)
            if delta.finished:
                self.ended(delta.request_id, delta.finish_reason)
            if stream is not None:
                stream.deliver(delta)

    def engine_died(self, error: str) -> None:
        """End every admitted stream with an UNAVAILABLE error delta (the engine thread died of ``error``); a
        request still being admitted is refused by its ``open``."""
        deltas = []
        for key, stream in self.streams.items():
            added = stream.admission
            if added is not None and not added.done():  # not expected: its add command was failed
                added.set_exception(engine_down())
            if added is None or added.cancelled() or added.exception() is not None:
                continue  # never admitted (or still tokenized): open() raises its error (and forgets the id)
            deltas.append(
                Delta(key, [], "", "error", error=error, code=ErrorCode.UNAVAILABLE, message=ENGINE_DOWN_MESSAGE)
            )
        self.dispatch(deltas)

    def counts(self) -> dict[str, int]:
        """The totals since start, the active streams and the live requests."""
        return {**self.totals, "active_streams": self.active_streams, "live_requests": len(self.streams)}


class HoldsLiveRequests(abc.ABC):
    """What a front end that keeps its live requests in ``self.live`` (the Coordinator, the front over Serve
    replicas) has of them: its admission bounds, read and set as its own attributes (the gRPC server sets the
    tenant quota), and draining."""

    live: LiveRequests

    @abc.abstractmethod
    def start_draining(self) -> None:
        """Refuse new requests from now on (ShuttingDown); running ones carry on."""

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, then wait up to ``timeout`` seconds for live requests to end."""
        self.start_draining()
        deadline = asyncio.get_running_loop().time() + timeout
        while self.live.streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return not self.live.streams

    @property
    def max_queued(self) -> int:
        """Live requests the server holds at most (admission refuses one more: ``Overloaded``)."""
        return self.live.max_queued

    @max_queued.setter
    def max_queued(self, n: int) -> None:
        self.live.max_queued = n

    @property
    def tenant_quota(self) -> int | None:
        """Live requests one tenant may hold (None: no quota; one more: ``TenantQuotaExceeded``)."""
        return self.live.tenant_quota

    @tenant_quota.setter
    def tenant_quota(self, quota: TenantQuota) -> None:
        self.live.tenant_quota = quota
