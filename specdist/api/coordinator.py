"""An asyncio front end over an engine (an :class:`~specdist.engine.base.EngineBase`: an in-process
:class:`~specdist.engine.local.Engine` or a :class:`~specdist.engine.remote.RemoteEngine`): continuous batching for
many streams.

:class:`Coordinator` is the facade the servers (gRPC, HTTP, a Serve replica) call; its parts, one module each:

- :mod:`specdist.api.engine_thread`: the one thread that touches the engine. The event loop never calls the
  engine; it queues commands (add, abort, a warm-up run) that run between steps, and receives each step's
  :class:`~specdist.api.engine_thread.Delta` objects and gauges. So requests join and leave the running batch
  between steps, and an aborted request (``cancel()``, or a consumer that went away) frees its KV slots within one
  step. A failed step fails its batch; an engine thread that dies ends every stream UNAVAILABLE and refuses new
  requests for good.
- :mod:`specdist.api.live_requests`: admission (``max_queued``, the tenant quota, unique ids within a caller's
  scope) and the streams (:class:`RequestStream`) of the live requests, with their totals.
- :mod:`specdist.api.availability`: draining, the target's faults and the engine thread's health: what is
  refused, whether the server is ready (``accepting``) and whether it can recover by itself (``unrecoverable``).
- :mod:`specdist.api.tokenizer_pool`: prompts templated and tokenized off the engine thread
  (:meth:`Coordinator.encode`).
- :mod:`specdist.api.refusals`: the refusals and what a client is told of a failure.

Target faults: :meth:`Coordinator.target_down` (thread-safe, e.g. from a deployment's supervisor) ends every
request with ``finish_reason="error"`` and the given reason, and refuses new ones with
:class:`~specdist.api.refusals.TargetDown` (gRPC UNAVAILABLE, HTTP 503) until :meth:`Coordinator.target_up`;
:meth:`Coordinator.target_lost` (the supervisor gave up rebuilding the target group) refuses new requests for good.
:meth:`Coordinator.call_soon` runs any function on the engine thread from any thread. ``close()`` aborts every
request, stops the thread and joins it.

``metrics`` (:class:`~specdist.api.metrics.Metrics`): the engine's Prometheus series, from its
step events (the warm-up request is not counted); its gauges read the last pass's snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

from specdist.api.availability import Availability
from specdist.api.engine_thread import EngineThread
from specdist.api.live_requests import HoldsLiveRequests, LiveRequests, RequestStream, TenantQuota, scoped
from specdist.api.metrics import Metrics
from specdist.api.refusals import EngineDown, ShuttingDown, target_unavailable_message
from specdist.api.tokenizer_pool import TokenizerPool
from specdist.engine.base import EngineBase
from specdist.engine.prompts import EncodedPrompt
from specdist.sampling_params import SamplingParams


class Coordinator(HoldsLiveRequests):
    """Serves many concurrent generation streams from one engine (see the module docstring)."""

    def __init__(self, engine: EngineBase, max_queued: int = 256, tenant_quota: TenantQuota = None):
        self.live = LiveRequests(max_queued, tenant_quota)
        self.engine = engine
        # limits.speculative_stats false: a step's tokens reach a stream one a delta (RequestStream.deliver)
        limits = getattr(getattr(engine, "config", None), "limits", None)  # (a stand-in engine may have no config)
        self.one_token_deltas = not getattr(limits, "speculative_stats", True)
        self.engine_thread = EngineThread(
            engine, self.live.dispatch, self._engine_died, lambda: self.availability.changed()
        )
        self.availability = Availability(self.engine_thread)
        self.availability_listeners = self.availability.listeners  # (accepting), on the event loop
        self.tokenizers = TokenizerPool(engine)
        self.timing = self.engine_thread.timing
        self.metrics = Metrics(engine, lambda: self.engine_thread.snapshot)  # Prometheus series of this engine

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread, posting to the running event loop (idempotent)."""
        if self.engine_thread.thread is not None:
            return
        if self.availability.closed:
            raise ShuttingDown("the coordinator is closed")
        self.engine_thread.start(asyncio.get_running_loop())

    async def __aenter__(self) -> "Coordinator":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def warm_up(self) -> None:
        """Run one tiny greedy request on the engine thread (first-call costs), then reset the stats."""

        def run() -> None:
            with self.metrics.paused():
                self.engine.generate([[0]], SamplingParams(max_tokens=2, temperature=0.0, seed=0, ignore_eos=True))
            self.engine.stats.reset()

        self.start()
        await self.engine_thread.submit(run)

    def start_draining(self) -> None:
        """Refuse new requests from now on (ShuttingDown); running ones carry on."""
        self.availability.draining = True

    async def close(self) -> None:
        """Abort every request (their streams end with "abort"), stop the engine thread, join it."""
        if self.availability.closed:
            return
        self.availability.closed = self.availability.draining = True
        self.tokenizers.shutdown()
        if self.engine_thread.thread is None or await self.engine_thread.stop():
            self.metrics.close()

    # ---------------------------------------------------------------- availability
    @property
    def accepting(self) -> bool:
        """Whether the server is ready (health SERVING): False once draining or closed, while the target is down,
        while steps keep failing (:attr:`steps_failing`), and for good once the engine thread has died. New
        requests are refused in each of those cases but the failing steps."""
        return self.availability.accepting

    @property
    def steps_failing(self) -> bool:
        """Whether the last :data:`~specdist.api.engine_thread.STEP_FAILURES_NOT_READY` steps or more failed, none
        succeeding since."""
        return self.engine_thread.steps_failing

    @property
    def engine_error(self) -> str | None:
        """Why the engine thread died (``"ExcType: message"``); None while it serves."""
        return self.engine_thread.engine_error

    @property
    def target_is_down(self) -> bool:
        return self.availability.target_down is not None

    @property
    def unrecoverable(self) -> str | None:
        """Why this server cannot recover by itself, or None (:attr:`Availability.unrecoverable`)."""
        return self.availability.unrecoverable

    # ---------------------------------------------------------------- target faults (any thread)
    def target_down(self, reason: str) -> None:
        """The target failed: fail every request (UNAVAILABLE, naming the failed ranks of ``reason``),
        refuse new ones until :meth:`target_up`."""
        self.availability.target_down = reason
        self.call_soon(
            lambda: self.engine_thread.fail_all(f"target unavailable: {reason}", target_unavailable_message(reason))
        )
        self.engine_thread.post(self.availability.changed)

    def target_lost(self, reason: str) -> None:
        """The target group is lost for good (every rebuild failed): fail every request, refuse new
        ones until the process is restarted; :attr:`unrecoverable` says why."""
        self.availability.target_lost = reason
        self.target_down(reason)

    def target_up(self, prepare: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """The target is back: run ``prepare`` on the engine thread (e.g. reconnect), then admit again."""

        def run() -> None:
            if prepare is not None:
                prepare()
            self.availability.target_down = None
            self.engine_thread.post(self.availability.changed)

        return self.call_soon(run)

    def call_soon(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Thread-safe: run ``fn`` on the engine thread before its next step; a future of its result."""
        return self.engine_thread.call_soon(fn)

    def _engine_died(self, error: str) -> None:
        """The engine thread died (on the event loop, after everything it posted before): end every
        live stream with an UNAVAILABLE error delta, tell the availability listeners."""
        self.live.engine_died(error)
        self.availability.changed()

    # ---------------------------------------------------------------- requests
    async def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> EncodedPrompt:
        """Template (``chat``) and tokenize a prompt on the tokenizer threads, off the engine thread
        (:func:`specdist.engine.prompts.encode_prompt`: ``InvalidArgument`` naming the field)."""
        self.availability.check_serving()  # no tokenizing for a request that would be refused anyway
        return await self.tokenizers.encode(prompt, chat)

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
    ) -> RequestStream:
        """Admit a request and return its stream (the caller must ``close()`` it or read it to the end).

        ``prompt``: text, token ids or (``chat``) a conversation, templated and tokenized here off
        the engine thread, or an :class:`EncodedPrompt` (:meth:`encode`: one prompt for several
        requests). Raises the refusals of :mod:`specdist.api.refusals` (``Overloaded``, ``ShuttingDown``,
        ``TargetDown``, ``EngineDown``), ``InvalidArgument`` (bad prompt, params or id; ``DuplicateRequestId``).
        ``scope``: whose id it is (the caller, :func:`scoped`): ids are unique, and cancelled, within a scope, so
        a caller neither sees nor touches another's requests by their ids. ``tenant``: who the request belongs to
        (:func:`specdist.transport.security.tenant_of`): the cores share state only within a tenant. ``session``:
        the client's session id, and ``kind``, what sort of request it is: only a router over several groups reads
        them (ReplicaFront.open); one group holds every session already and has no replicas to choose by kind.
        """
        self.availability.check_serving()
        self.start()
        request_id = self.live.admissible(request_id, scope, tenant)
        key = scoped(scope, request_id)
        stream = RequestStream(self.stream_closed, request_id, key, tenant, self.one_token_deltas)
        self.live.streams[key] = stream  # reserved now: its id and its room hold while the prompt is tokenized
        try:
            if not isinstance(prompt, EncodedPrompt):
                prompt = await self.tokenizers.encode(prompt, chat)
                self.availability.check_serving()  # the server may have stopped taking requests meanwhile
            added = self.engine_thread.submit(lambda: self.engine_thread.add(prompt, params, key, tenant))
        except BaseException:  # a bad prompt, the caller gone, or closed / the engine thread died since the checks
            self.live.streams.pop(key, None)
            raise
        stream.admission = added
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:  # the caller went away; undo the add once it has run
            added.add_done_callback(lambda f: self.live.admitted(stream, f) and stream.close())
            raise
        except Exception:
            self.live.streams.pop(key, None)
            raise
        self.live.admitted(stream, added)
        return stream

    def check_room(self, n: int = 1) -> None:
        """Refuse ``n`` new requests now unless the server takes requests and has room for them (cheap, on the event
        loop): what a front end asks before it reads, renders or tokenizes anything. Admission checks again."""
        self.availability.check_serving()
        self.live.check_room(n)

    async def cancel(self, request_id: str, scope: str = "") -> bool:
        """Abort a live request of ``scope``; its stream ends with "abort". False if no live request of that scope
        has that id."""
        key = scoped(scope, request_id)
        if key not in self.live.streams:
            return False
        if self.availability.closed or self.engine_error is not None:  # each live request is being ended already
            return True
        try:
            return await self.engine_thread.submit(lambda: self.engine_thread.abort(key))
        except EngineDown:  # the engine thread died meanwhile: its requests end with an error
            return True

    def stream_closed(self, key: str, finished: bool) -> None:
        """A stream's consumer let go of it (on the event loop): one active stream fewer, and the
        request is aborted unless its final delta was delivered (``finished``)."""
        self.live.active_streams -= 1
        if not finished and not self.availability.closed:
            self.engine_thread.abort_soon(key)

    def counters(self) -> dict[str, int]:
        """Gauges (engine: as of the last delivered pass) and totals since start."""
        snap = self.engine_thread.snapshot
        return {
            "running": snap.running,
            "queued": snap.waiting,
            "target_kv_slots_used": snap.kv.get("target", 0),
            "draft_kv_slots_used": snap.kv.get("draft", 0),
            **self.live.counts(),
        }
