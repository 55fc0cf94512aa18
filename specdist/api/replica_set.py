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

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdist.api.coordinator import (
    MAX_REQUEST_ID_LEN,
    TOKENIZER_THREADS,
    Delta,
    DuplicateRequestId,
    EncodedPrompt,
    Overloaded,
    ShuttingDown,
    TenantQuotaExceeded,
    scoped,
)
from specdist.api.router import DEFAULT_KIND, RouteRequest, block_hashes, session_key
from specdist.engine.prompts import encode_prompt
from specdist.errors import ErrorCode, InvalidArgument, Refusal, Unavailable, code_of
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
    there unless it ended."""

    def __init__(
        self,
        front: "ReplicaFront",
        request_id: str,
        key: str,
        call: Any,
        replica_id: str,
        reopen: Callable[[], Any] | None,
    ):
        self.request_id, self.key, self.replica_id = request_id, key, replica_id
        self._front, self._call, self._reopen = front, call, reopen
        self._delivered = False  # a token reached the caller: no second replica
        self.done = self.closed = False

    def __aiter__(self) -> "ReplicaStream":
        return self

    async def __anext__(self) -> Delta:
        if self.done or self.closed:
            raise StopAsyncIteration
        while True:
            try:
                item = await self._call.__anext__()
            except StopAsyncIteration:
                return self._end(
                    Delta(
                        self.request_id,
                        [],
                        "",
                        finish_reason="error",
                        code=ErrorCode.UNAVAILABLE,
                        error="the replica's stream ended early",
                        message="the replica went away",
                    )
                )
            except Exception as e:  # noqa: BLE001  (the replica, or the call to it, failed)
                why = self._front.transport.failure(e)
                if why is None:
                    raise
                if not self._delivered and self._reopen is not None:
                    log.warning(
                        "request %s: replica %s failed before its first token (%s); sent to another",
                        self.request_id,
                        self.replica_id,
                        why,
                    )
                    self._front.tally["retried"] += 1
                    reopen, self._reopen = self._reopen, None
                    self._call, self.replica_id = await reopen()
                    continue
                return self._end(
                    Delta(
                        self.request_id,
                        [],
                        "",
                        finish_reason="error",
                        code=ErrorCode.UNAVAILABLE,
                        error=f"replica failed: {why}",
                        message="the replica serving it failed",
                    )
                )
            if not isinstance(item, Delta):
                continue  # (a second Admitted after a reopen is consumed by reopen itself)
            if (
                item.finish_reason == "error"
                and item.code == ErrorCode.UNAVAILABLE
                and not item.token_ids
                and not self._delivered
                and self._reopen is not None
            ):
                # its replica's group went down before its first token (a target rank lost): once elsewhere
                log.warning(
                    "request %s: replica %s unavailable before its first token (%s); sent to another",
                    self.request_id,
                    self.replica_id,
                    item.error,
                )
                self._front.tally["retried"] += 1
                reopen, self._reopen = self._reopen, None
                self._call, self.replica_id = await reopen()
                continue
            if item.token_ids:
                self._delivered = True
            if item.finished:
                return self._end(item)
            return item

    def _end(self, d: Delta) -> Delta:
        self.done = True
        self._front.stream_closed(self.key, d)
        return d

    def close(self) -> None:
        """End the stream; a request still running is cancelled on its replica (its stream there closes and
        aborts it)."""
        if self.closed:
            return
        self.closed = True
        if not self.done:
            try:
                self._call.cancel()
            except Exception:  # noqa: BLE001  (already finished)
                pass
            self._front.stream_closed(self.key, None)


class ReplicaFront:
    """A :class:`~specdist.api.coordinator.Coordinator`'s surface over replicas (module docstring)."""

    def __init__(
        self,
        engine: FrontEngine,
        transport: ReplicaTransport,
        max_queued: int = 256,
        counters: Callable[[], dict[str, int]] | None = None,
        metrics: Any = None,
        tenant_quota: int | None = None,
    ):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        if tenant_quota is not None and tenant_quota < 1:
            raise ValueError(f"tenant_quota must be >= 1, got {tenant_quota}")
        self.engine, self.transport, self.max_queued = engine, transport, max_queued
        self.tenant_quota = tenant_quota  # live requests one tenant may hold over all replicas (None: no quota)
        cfg = engine.config
        self.block_size = cfg.engine.kv_block_size
        self.session_blocks = cfg.router.session_blocks
        self.tenant_prefixes = cfg.engine.prefix_cache_scope == "tenant"
        self._replica_counters = counters or (lambda: {})
        self.metrics = metrics if metrics is not None else FrontMetrics(self)
        self.availability_listeners: list[Callable[[bool], None]] = []
        self._live: dict[str, ReplicaStream] = {}
        self._tenant_of: dict[str, str] = {}  # live request key -> its tenant (the quota counts them)
        self._draining = self._closed = False
        self._encoder = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "specdist-tokenize")
        self.tally: Tally[str] = Tally()  # requests_total / finished / cancelled / failed / retried
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

    async def drain(self, timeout: float) -> bool:
        self.start_draining()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._live and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return not self._live

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = self._draining = True
        for s in list(self._live.values()):
            if s is not None:  # (None: a request still being opened)
                s.close()
        self._encoder.shutdown(wait=False, cancel_futures=True)

    def check_room(self, n: int = 1) -> None:
        self._check_serving()
        if len(self._live) + n > self.max_queued:
            raise Overloaded(f"{len(self._live)} requests in the system (max_queued={self.max_queued}); retry later")

    def _check_serving(self) -> None:
        if self._draining:
            raise ShuttingDown("the server is shutting down")

    async def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> EncodedPrompt:
        arrival = time.perf_counter()
        self._check_serving()
        eng = self.engine
        text, ids = await asyncio.get_running_loop().run_in_executor(
            self._encoder,
            lambda: encode_prompt(
                eng.tokenizer, prompt, vocab_size=eng.vocab_size, max_model_len=eng.max_model_len, chat=chat
            ),
        )
        return EncodedPrompt(text, ids, arrival)

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
        self._live[key] = None  # type: ignore[assignment]  (reserved across the awaits below)
        self._tenant_of[key] = tenant
        retried = False
        try:
            try:
                call, replica = await self._open_on_replica(prompt, params, request_id, scope, tenant, route)
            except (ReplicaRefused, ReplicasDown) as e:
                # that replica's group is down or draining (the router learns it at its next report): once more,
                # elsewhere
                retried = True
                self.tally["retried"] += 1
                call, replica = await self._open_on_replica(
                    prompt, params, request_id, scope, tenant, route, avoid=getattr(e, "replica_id", "")
                )
        except BaseException:
            self._live.pop(key, None)
            self._tenant_of.pop(key, None)
            raise

        async def reopen() -> tuple[Any, str]:
            return await self._open_on_replica(
                prompt, params, request_id, scope, tenant, route, avoid=stream.replica_id
            )

        stream = ReplicaStream(self, request_id, key, call, replica, None if retried else reopen)
        self._live[key] = stream
        self.tally["requests_total"] += 1
        return stream

    async def _open_on_replica(
        self,
        prompt: EncodedPrompt,
        params,
        request_id: str,
        scope: str,
        tenant: str,
        route: RouteRequest,
        avoid: str = "",
    ) -> tuple[Any, str]:
        """Open the stream and read the replica's first answer: (call, replica id); its refusal raised (an
        UNAVAILABLE one as :class:`ReplicaRefused`, naming the replica)."""
        call = self.transport.open(
            prompt, params, request_id, scope, tenant, route, time.perf_counter() - prompt.arrival, avoid
        )
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
        return call, first.replica_id

    def _admissible(self, request_id: str | None, scope: str = "", tenant: str = "") -> str:
        self._check_serving()
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidArgument("request_id", f"must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
        if scoped(scope, request_id) in self._live:
            raise DuplicateRequestId(request_id)
        if len(self._live) >= self.max_queued:
            raise Overloaded(f"{len(self._live)} requests in the system (max_queued={self.max_queued}); retry later")
        quota = self.tenant_quota
        if quota is not None and sum(t == tenant for t in self._tenant_of.values()) >= quota:  # O(live)
            raise TenantQuotaExceeded(
                f"this tenant holds {quota} live requests (limits.max_queued_per_tenant={quota}); retry later"
            )
        return request_id

    async def cancel(self, request_id: str, scope: str = "") -> bool:
        """Cancel a live request of ``scope`` on its replica; its stream ends with "abort"."""
        s = self._live.get(scoped(scope, request_id))
        if s is None:
            return False
        s.close()
        return True

    def stream_closed(self, key: str, final: Delta | None) -> None:
        self._tenant_of.pop(key, None)
        if self._live.pop(key, None) is None:
            return
        if final is None:
            self.tally["requests_cancelled"] += 1
        elif final.finish_reason == "error":
            self.tally["requests_failed"] += 1
        elif final.finish_reason == "abort":
            self.tally["requests_cancelled"] += 1
        else:
            self.tally["requests_finished"] += 1

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
            **{
                k: self.tally[k]
                for k in ("requests_total", "requests_finished", "requests_cancelled", "requests_failed")
            },
            "active_streams": len(self._live),
            "live_requests": len(self._live),
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
        for k in ("requests_total", "requests_finished", "requests_cancelled", "requests_failed"):
            totals.add_metric([k.removeprefix("requests_")], f.tally[k])
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
