"""The front doors' coordinator over several speculative groups: :class:`ReplicaFront`.

With ``cluster.replicas`` each speculative group (target ranks, draft workers, its own :class:`Coordinator`) is
a Ray Serve replica (``cluster/serve.py``); the gRPC and HTTP servers of :mod:`specdist.api.grpc_server` and
:mod:`specdist.api.http_server` stay as they are (TLS, tokens, health, reflection, limits) and serve a
:class:`ReplicaFront` in place of a :class:`Coordinator`: the same methods, each request sent to one replica
through a streaming Serve handle, the replica chosen by ``router.policy``
(:class:`specdist.api.serve_router.SpecdistRequestRouter`, run by the handle in this process).

Here a request is admitted (id unique in its scope, ``max_queued`` live requests at most, ``tenant_quota`` of
them one tenant's: ``limits.max_queued_per_tenant``, as one group's coordinator counts them), its prompt
templated and tokenized (once: the replica takes the ids), its route made (:class:`RouteRequest`: the prompt's
block hashes, its session key) and its stream opened on a replica through a :class:`ReplicaTransport`, whose
first answer says which replica took it (or why none did: the replica's refusal, raised here as the same
error). A stream whose replica fails before it delivered a token is sent once to another replica; after a
token, it ends with UNAVAILABLE. Cancelling a stream cancels its Serve call: the replica's stream closes and
aborts the request there, whose KV slots are freed within a step.

What this module imports of Ray: nothing (the transport is given); ``cluster/serve.py`` supplies Serve's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdist.api.engine_thread import Delta
from specdist.api.live_requests import HoldsLiveRequests, LiveRequests, scoped
from specdist.api.refusals import ShuttingDown
from specdist.api.router import DEFAULT_KIND, RouteRequest, block_hashes, session_key
from specdist.api.tokenizer_pool import TokenizerPool
from specdist.engine.prompts import EncodedPrompt
from specdist.errors import ErrorCode, Refusal, Unavailable, code_of
from specdist.sampling_params import SamplingParams

__all__ = ["Admitted", "FrontEngine", "FrontMetrics", "Refused", "ReplicaFront", "ReplicaTransport", "ReplicasDown"]

log = logging.getLogger(__name__)

# Called with (replica id, report) for each new report a Serve router in this process takes
# (specdist.api.serve_router): the front doors learn which replicas report, and their counters
# (ReplicaReports), without asking them.
REPORT_OBSERVERS: list[Callable[[str, dict], None]] = []


class ReplicasDown(Refusal, Unavailable):
    """No replica could take or finish the request."""


class ReplicaRefused(ReplicasDown):
    """A replica refused a request as unavailable (its target down, draining): another may take it."""

    def __init__(self, message: str, replica_id: str = ""):
        super().__init__(message)
        self.replica_id = replica_id


@dataclass(frozen=True)
class Admitted:
    """A replica's first answer to a stream: it took the request."""

    replica_id: str


@dataclass(frozen=True)
class Refused:
    """A replica's first answer to a stream: its coordinator refused the request with ``error``."""

    error: BaseException
    replica_id: str = ""


class ReplicaTransport(Protocol):
    """How the front reaches the replicas (``cluster.serve.ServeReplicas`` on Ray Serve)."""

    def open(
        self,
        prompt: EncodedPrompt,
        params: SamplingParams | None,
        request_id: str,
        scope: str,
        tenant: str,
        route: RouteRequest,
        age_s: float,
        avoid: str = "",
    ) -> Any:
        """Start a stream on a replica chosen by the router: an async iterator of :class:`Admitted` or
        :class:`Refused` first, then :class:`Delta` s; ``cancel()`` ends it. ``age_s``: seconds since the
        request arrived here (its time to first token counts from then); ``avoid``: a replica that just
        failed it (another is chosen where there is one)."""

    def failure(self, exc: BaseException) -> str | None:
        """Why ``exc`` means the replica (not the request) failed, or None."""


@dataclass
class FrontEngine:
    """What the front doors read of "the engine" (:func:`specdist.api.admission.server_info`, ``Limits.of``,
    the tokenizer): the replicas' common description, from one of them at start."""

    config: Any
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    k: int
    pipelined: bool = False
    tensor_parallel_size: int = 1
    num_draft_replicas: int = 0
    cpu_kernels: str = ""
    memory_plan: str = ""
    replicas: Callable[[], int] = lambda: 0  # Serve replicas running now

    @property
    def traits(self) -> Any:
        return _Traits(self.pipelined)

    @property
    def replica_count(self) -> int:
        return self.replicas()

    @property
    def router_policy(self) -> str:
        return self.config.router.policy


@dataclass(frozen=True)
class _Traits:
    pipelined: bool


class ReplicaStream:
    """One request's deltas from its replica (an async iterator, like ``RequestStream``); ``close()`` cancels it
    there unless it ended. Made at admission (its id, room and tenant's place held while a replica is found);
    ``call`` is the Serve call once a replica took it, ``reopen`` (until used) opens it on another one."""

    def __init__(self, front: "ReplicaFront", request_id: str, key: str, tenant: str = ""):
        self.request_id, self.key, self.tenant = request_id, key, tenant  # tenant: the quota counts it
        self._front = front
        self.call: Any = None
        self.replica_id = ""
        self.reopen: Callable[[], Any] | None = None
        self._delivered = False  # a token reached the caller: no second replica
        self.done = self.closed = False
        self._released = False  # the front was told it ended (once, whichever way it ends)

    def __aiter__(self) -> "ReplicaStream":
        return self

    async def __anext__(self) -> Delta:
        if self.done or self.closed:
            raise StopAsyncIteration
        while True:
            try:
                item = await self.call.__anext__()
            except StopAsyncIteration:
                return self._fail("the replica's stream ended early", "the replica went away")
            except Exception as e:  # noqa: BLE001  (the replica, or the call to it, failed)
                why = self._front.transport.failure(e)
                if why is None:
                    raise
                if not self._delivered and self.reopen is not None:
                    await self._send_elsewhere("failed", why)
                    continue
                return self._fail(f"replica failed: {why}", "the replica serving it failed")
            if not isinstance(item, Delta):
                continue  # (a second Admitted after a reopen is consumed by reopen itself)
            if (
                item.finish_reason == "error"
                and item.code == ErrorCode.UNAVAILABLE
                and not item.token_ids
                and not self._delivered
                and self.reopen is not None
            ):  # its replica's group went down before its first token (a target rank lost): once elsewhere
                await self._send_elsewhere("unavailable", item.error)
                continue
            if item.token_ids:
                self._delivered = True
            if item.finished:
                return self._end(item)
            return item

    async def _send_elsewhere(self, what: str, why: str | None) -> None:
        """Open the request once more on another replica: this one ``what`` (failed, unavailable) before its
        first token."""
        log.warning(
            "request %s: replica %s %s before its first token (%s); sent to another",
            self.request_id,
            self.replica_id,
            what,
            why,
        )
        self._front.tally["retried"] += 1
        reopen, self.reopen = self.reopen, None
        self.call, self.replica_id = await reopen()

    def _fail(self, error: str, message: str) -> Delta:
        """End the stream UNAVAILABLE: ``error`` for the logs, ``message`` for the client."""
        return self._end(
            Delta(
                self.request_id, [], "", finish_reason="error", code=ErrorCode.UNAVAILABLE, error=error, message=message
            )
        )

    def _end(self, d: Delta) -> Delta:
        self.done = True
        self._release(d)
        return d

    def _release(self, final: Delta | None) -> None:
        if not self._released:
            self._released = True
            self._front.stream_closed(self.key, final)

    def close(self) -> None:
        """End the stream; a request still running is cancelled on its replica (its stream there closes and
        aborts it)."""
        if self.closed:
            return
        self.closed = True
        if not self.done:
            try:
                self.call.cancel()
            except Exception:  # noqa: BLE001  (already finished)
                pass
            self._release(None)


class ReplicaFront(HoldsLiveRequests):
    """A :class:`~specdist.api.coordinator.Coordinator`'s surface over replicas (module docstring): its admission
    (:class:`~specdist.api.live_requests.LiveRequests`) and tokenizer threads
    (:class:`~specdist.api.tokenizer_pool.TokenizerPool`) are the coordinator's."""

    def __init__(
        self,
        engine: FrontEngine,
        transport: ReplicaTransport,
        max_queued: int = 256,
        counters: Callable[[], dict[str, int]] | None = None,
        metrics: Any = None,
        tenant_quota: int | None = None,
    ):
        self.live = LiveRequests(max_queued, tenant_quota)  # the tenant quota counts over all replicas
        self.engine, self.transport = engine, transport
        cfg = engine.config
        self.block_size = cfg.engine.kv_block_size
        self.session_blocks = cfg.router.session_blocks
        self.tenant_prefixes = cfg.engine.prefix_cache_scope == "tenant"
        self._replica_counters = counters or (lambda: {})
        self.metrics = metrics if metrics is not None else FrontMetrics(self)
        self.availability_listeners: list[Callable[[bool], None]] = []
        self._draining = self._closed = False
        self.tokenizers = TokenizerPool(engine)
        self.tally: Tally[str] = Tally()  # retried: requests sent to a second replica
        self.routed: Tally[str] = Tally()  # replica id -> requests it took

    # ------------------------------------------------------------ the Coordinator's surface
    def start(self) -> None:
        pass

    async def warm_up(self) -> None:
        pass  # every replica warmed its own engine before Serve marked it healthy

    @property
    def accepting(self) -> bool:
        return not self._draining and self.engine.replicas() > 0

    @property
    def target_is_down(self) -> bool:
        return not self._draining and self.engine.replicas() == 0

    @property
    def unrecoverable(self) -> str | None:
        return None  # Serve replaces a replica that fails its health check

    def start_draining(self) -> None:
        self._draining = True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = self._draining = True
        for s in list(self.live.streams.values()):
            if s.call is not None:  # (None: a request still being opened)
                s.close()
        self.tokenizers.shutdown()

    def check_room(self, n: int = 1) -> None:
        self._check_serving()
        self.live.check_room(n)

    def _check_serving(self) -> None:
        if self._draining:
            raise ShuttingDown("the server is shutting down")

    async def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> EncodedPrompt:
        self._check_serving()
        return await self.tokenizers.encode(prompt, chat)

    def route(
        self,
        prompt: EncodedPrompt,
        params: SamplingParams | None,
        key: str,
        tenant: str,
        session: str | None = None,
        kind: str | None = None,
    ) -> RouteRequest:
        """The router's view of a request: its prompt's block hashes (in its tenant's scope when prefixes are
        cached per tenant), its session key (its session id, else its first blocks; always with its tenant) and
        its kind (the replicas measure acceptance per kind: ``default`` when the caller names none)."""
        blocks = block_hashes(prompt.ids, self.block_size, tenant if self.tenant_prefixes else "")
        max_tokens = (params or SamplingParams()).max_tokens
        return RouteRequest(
            key,
            len(prompt.ids),
            max_tokens,
            blocks,
            kind or DEFAULT_KIND,
            session_key(tenant, session or None, blocks, self.session_blocks),
        )

    async def open(
        self,
        prompt: str | Sequence[int] | EncodedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        scope: str = "",
        tenant: str = "",
        session: str | None = None,
        kind: str | None = None,
    ) -> ReplicaStream:
        """Admit a request and open its stream on a replica (``Coordinator.open``'s contract; ``session``: the
        client's session id, for affinity; ``kind``: what sort of request it is (``edit``, ``chat``, ...), whose
        measured acceptance on each replica the ``speculative`` policy reads)."""
        request_id = self._admissible(request_id, scope, tenant)
        if not isinstance(prompt, EncodedPrompt):
            prompt = await self.encode(prompt, chat)
            request_id = self._admissible(request_id, scope, tenant)
        key = scoped(scope, request_id)
        route = self.route(prompt, params, key, tenant, session, kind)
        stream = ReplicaStream(self, request_id, key, tenant)
        self.live.streams[key] = stream  # type: ignore[assignment]  (reserved across the awaits below)

        async def on_a_replica(avoid: str = "") -> tuple[Any, str]:
            """(call, replica id) of the request opened on a replica the router chooses, ``avoid`` if it can."""
            age_s = time.perf_counter() - prompt.arrival
            call = self.transport.open(prompt, params, request_id, scope, tenant, route, age_s, avoid)
            return call, await self._first_answer(call)

        try:
            try:
                stream.call, stream.replica_id = await on_a_replica()
                stream.reopen = lambda: on_a_replica(avoid=stream.replica_id)
            except (ReplicaRefused, ReplicasDown) as e:
                # that replica's group is down or draining (the router learns it at its next report): once more,
                # elsewhere
                self.tally["retried"] += 1
                stream.call, stream.replica_id = await on_a_replica(avoid=getattr(e, "replica_id", ""))
        except BaseException:
            self.live.streams.pop(key, None)
            raise
        self.live.took()
        return stream

    async def _first_answer(self, call: Any) -> str:
        """Read a stream's first answer: the id of the replica that took it; its refusal raised (an UNAVAILABLE one
        as :class:`ReplicaRefused`, naming the replica)."""
        try:
            first = await call.__anext__()
        except StopAsyncIteration:
            raise ReplicasDown("the replica closed the stream before answering") from None
        except Exception as e:  # noqa: BLE001
            why = self.transport.failure(e)
            if why is None:
                raise
            raise ReplicasDown(f"no replica could take the request: {why}") from None
        if isinstance(first, Refused):
            if code_of(first.error) == ErrorCode.UNAVAILABLE:
                raise ReplicaRefused(str(first.error), getattr(first, "replica_id", "")) from first.error
            raise first.error
        assert isinstance(first, Admitted), first
        self.routed[first.replica_id] += 1
        return first.replica_id

    def _admissible(self, request_id: str | None, scope: str = "", tenant: str = "") -> str:
        self._check_serving()
        return self.live.admissible(request_id, scope, tenant)

    async def cancel(self, request_id: str, scope: str = "") -> bool:
        """Cancel a live request of ``scope`` on its replica; its stream ends with "abort"."""
        s = self.live.streams.get(scoped(scope, request_id))
        if s is None or s.call is None:  # (None: a request still being opened)
            return False
        s.close()
        return True

    def stream_closed(self, key: str, final: Delta | None) -> None:
        """A stream ended (``final``: its last delta; None: cancelled): its request's life ends, counted."""
        self.live.ended(key, final.finish_reason if final is not None else None)
        self.live.active_streams -= 1

    def counters(self) -> dict[str, int]:
        """The replicas' gauges summed (as of their last reports) and this front's totals."""
        summed: Tally[str] = Tally()
        for name, v in self._replica_counters().items():
            summed[name] += v
        return {
            "running": summed["running"],
            "queued": summed["queued"],
            "target_kv_slots_used": summed["target_kv_slots_used"],
            "draft_kv_slots_used": summed["draft_kv_slots_used"],
            **self.live.counts(),
        }


class FrontMetrics:
    """The front's Prometheus series (``/metrics``, ``--metrics-port``): the replicas running, the router's
    choices per replica and its retries, this front's request totals, and each replica's gauges as of its last
    routing report. Read at scrape time; nothing is timed here (each replica's engine times its own steps)."""

    def __init__(self, front: "ReplicaFront", reports: "ReplicaReports | None" = None):
        from prometheus_client import CollectorRegistry

        self.front, self.reports = front, reports
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        f = self.front
        yield GaugeMetricFamily(
            "specdist_replicas", "Speculative groups (Serve replicas) running", value=f.engine.replica_count
        )
        routed = CounterMetricFamily(
            "specdist_router_requests", "Requests the router sent to each replica", labels=["replica", "policy"]
        )
        for rid, n in sorted(f.routed.items()):
            routed.add_metric([rid, f.engine.router_policy], n)
        yield routed
        yield CounterMetricFamily(
            "specdist_router_retries",
            "Requests sent to a second replica after theirs failed before their first token",
            value=f.tally["retried"],
        )
        totals = CounterMetricFamily(
            "specdist_front_requests", "Requests through this front, by outcome", labels=["outcome"]
        )
        for k, n in f.live.totals.items():
            totals.add_metric([k.removeprefix("requests_")], n)
        yield totals
        if self.reports is not None:
            gauges = {
                name: GaugeMetricFamily(
                    f"specdist_replica_{name}", f"{name} on each replica (its last report)", labels=["replica"]
                )
                for name in ("running", "queued", "live_requests")
            }
            for rid, r in sorted(self.reports.fresh().items()):
                for name, g in gauges.items():
                    g.add_metric([rid], (r.get("counters") or {}).get(name, 0))
            yield from gauges.values()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        pass


@dataclass
class ReplicaReports:
    """The latest routing report of each replica (``record_routing_stats``), as the router in this process took
    them: which replicas report, and their counters."""

    period_s: float
    reports: dict[str, tuple[float, dict]] = field(default_factory=dict)  # replica id -> (taken at, report)

    def take(self, replica_id: str, report: dict) -> None:
        self.reports[replica_id] = (time.monotonic(), report)

    def fresh(self) -> dict[str, dict]:
        """Reports taken within 2 periods (Serve asks every period; a replica that stops answering drops out)."""
        now = time.monotonic()
        return {rid: r for rid, (t, r) in self.reports.items() if now - t <= 2 * self.period_s + 1.0}

    def counters(self) -> dict[str, int]:
        out: Tally[str] = Tally()
        for r in self.fresh().values():
            for name, v in (r.get("counters") or {}).items():
                out[name] += int(v)
        return dict(out)
