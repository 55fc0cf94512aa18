"""An asyncio front end over an :class:`~specdist.engine.local.Engine`: continuous batching for many streams.

Threading model: the engine is only ever touched by ONE dedicated thread, which runs
free of the event loop. While there is work it loops: take every queued command (add a
request, abort one, a warm-up run), run them, run one ``engine.step()``, collect each
request's new tokens and text as :class:`Delta` objects, and post them, with a snapshot
of the engine's gauges, to the event loop in one ``loop.call_soon_threadsafe`` call.
Then it goes straight on to the next step: the event loop hands deltas to the streams
while the next step is already running, so its latency is off the step's critical path.
With no request in the engine and no command queued, the thread sleeps on a
``threading.Condition`` until a command arrives (no polling). The event loop never calls
the engine; it queues commands, which run before the next step. So requests join and
leave the running batch between steps, and an aborted request (``cancel()``, or a
consumer that went away) frees its KV slots within one step.

Admission: at most ``max_queued`` requests are live (running + waiting) at once;
one more raises :class:`Overloaded`. With a ``tenant_quota`` one tenant holds at most that many of them;
one more of its requests raises :class:`TenantQuotaExceeded` while other tenants are still admitted. A step that raises fails only the requests that
were in the batch (they get a final ``finish_reason="error"`` delta and their slots
are released); waiting requests carry on, and the thread keeps serving. A failure
outside ``engine.step`` (a bug in the coordinator or the engine's bookkeeping) fails
every request the engine holds, and the thread keeps serving. :data:`STEP_FAILURES_NOT_READY` steps failing in
a row (a full disk under ``engine.compile: on``, a broken device) turn ``accepting`` False, and so readiness
NOT_SERVING (gRPC health, HTTP /health), until a step succeeds; requests are still admitted meanwhile (one that
succeeds makes the server ready again), and liveness is not touched. ``close()`` aborts every
request, stops the thread and joins it.

Engine thread death: an error that escapes every handler above (one that is not an
``Exception``, or one raised while failing the others) ends the engine thread. It is logged
once; the dying thread releases what the engine holds, and from then on the coordinator
serves nothing: every request in flight ends with ``finish_reason="error"`` and
``code=UNAVAILABLE`` naming the cause, queued commands (adds, aborts, :meth:`call_soon`) fail
with :class:`EngineDown`, new requests are refused with :class:`EngineDown` (gRPC UNAVAILABLE,
HTTP 503), ``accepting`` is False for good (:attr:`engine_error` says why), and
``availability_listeners`` hear it (health NOT_SERVING) until the process is restarted.

Target faults: :meth:`target_down` (thread-safe, e.g. from a deployment's supervisor) ends
every request with ``finish_reason="error"`` and the given reason, and refuses new ones with
:class:`TargetDown` (gRPC UNAVAILABLE, HTTP 503) until :meth:`target_up`. Each change is
reported to ``availability_listeners`` on the event loop (the servers' health checks).
:meth:`call_soon` runs any function on the engine thread from any thread.

Target lost: :meth:`target_lost` (the supervisor gave up rebuilding the target group) refuses
new requests for good, like a dead engine thread. Either way :attr:`unrecoverable` then says why
the server cannot recover by itself (the gRPC server turns its liveness NOT_SERVING: restart it).

Prompts: a text prompt is templated (``chat``) and tokenized on a small thread pool of the event
loop's side (:meth:`encode`, ``specdist-tokenize-*`` threads) before its add command is queued,
never on the engine thread: a huge prompt holds up no running stream. A bad prompt is refused
from there with the same ``InvalidArgument`` naming the field; the engine thread only adds the
:class:`~specdist.engine.prompts.EncodedPrompt` (its text, ids and arrival), which is not encoded
or checked again.

Errors told to clients: a failed request's final delta carries ``error`` (everything known, also
logged where it happened: worker addresses, process ids, exception text) and ``message``, what
the servers send to the client: a stable sentence naming the failure's class (``target
unavailable (target rank 1 failed); retry later``, ``internal error: ...``) without addresses,
process ids or exception text. Refusals (:class:`TargetDown`, :class:`EngineDown`) say as little.

``metrics`` (:class:`~specdist.api.metrics.Metrics`): the engine's Prometheus series, from its
step events (the warm-up request is not counted); its gauges read the last pass's snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdist.config import MAX_REQUEST_ID_LEN
from specdist.engine.prompts import EncodedPrompt, encode_prompt
from specdist.errors import ErrorCode, InvalidArgument, SpecDistError
from specdist.logprobs import TokenLogprob
from specdist.api.metrics import Metrics
from specdist.sampling_params import SamplingParams

if TYPE_CHECKING:  # the coordinator drives any object with the engine API (Engine, RemoteEngine)
    from specdist.engine.local import Engine
    from specdist.engine.request import Request, RequestMetrics

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # close(): how long to wait for the engine thread to exit once it said it would
TOKENIZER_THREADS = 2  # prompts templated and tokenized at once, off the engine thread (encode())

# what clients are told (module docstring): stable sentences, no addresses, process ids or exception text
ENGINE_DOWN_MESSAGE = "the engine thread died; this server serves no more requests until it is restarted"
INTERNAL_MESSAGE = "internal error"
STEP_FAILED_MESSAGE = "internal error: the engine step failed"
TARGET_FAILED_MESSAGE = "internal error: the target failed the request"
_TARGET_RANK = re.compile(r"\btarget rank (\d+)\b")  # how a deployment's diagnosis names a rank


STEP_FAILURES_NOT_READY = 3  # steps failing in a row after which the server is not ready (until one succeeds)


class Overloaded(SpecDistError):
    """The server already holds ``max_queued`` requests."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class TenantQuotaExceeded(Overloaded):
    """The request's tenant already holds its quota of live requests (``limits.max_queued_per_tenant``): gRPC
    RESOURCE_EXHAUSTED like a full server, HTTP 429 (the tenant's own quota, not the server's state)."""

    http_status = 429


class ShuttingDown(SpecDistError):
    """The coordinator is draining or closed and takes no new requests."""

    code = ErrorCode.UNAVAILABLE


class TargetDown(SpecDistError):
    """The target failed and is being rebuilt; no new requests until it is back."""

    code = ErrorCode.UNAVAILABLE


class EngineDown(SpecDistError):
    """The engine thread died of an unexpected error; nothing more is served until a restart."""

    code = ErrorCode.UNAVAILABLE


def failed_ranks(reason: str | None) -> str | None:
    """The target ranks a failure's reason names, for a client: ``"target rank 1"`` /
    ``"target ranks 0, 1"``, or None. Reads the wording of a deployment's diagnosis
    (``cluster.deployment.Deployment.diagnose_target``: each cause starts ``target rank N``) and
    keeps nothing else of it (no process ids, addresses or worker errors)."""
    ranks = sorted({int(r) for r in _TARGET_RANK.findall(reason or "")})
    if not ranks:
        return None
    return f"target rank {ranks[0]}" if len(ranks) == 1 else "target ranks " + ", ".join(map(str, ranks))


def target_unavailable_message(reason: str | None) -> str:
    """What a client is told when the target failed (a rank died or hangs, rank 0 is unreachable):
    the ranks named, if the reason names any; retrying is safe."""
    ranks = failed_ranks(reason)
    return f"target unavailable ({ranks} failed); retry later" if ranks else "target unavailable; retry later"


def target_lost_message(reason: str | None) -> str:
    ranks = failed_ranks(reason)
    why = f"{ranks} failed and every rebuild failed" if ranks else "every rebuild failed"
    return f"target lost ({why}); this server serves no more requests until it is restarted"


class DuplicateRequestId(InvalidArgument):
    """A live request already has this client-chosen id (an InvalidArgument answered ALREADY_EXISTS)."""

    code = ErrorCode.ALREADY_EXISTS

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__("request_id", f"{request_id!r} is already in use by a running request")

    def __reduce__(self):
        return (type(self), (self.request_id,))


def scoped(scope: str, request_id: str) -> str:
    """The coordinator's (and the engine's) key of a caller's request id: the id within its caller's scope."""
    return f"{scope}/{request_id}" if scope else request_id


@dataclass
class Delta:
    """What one engine step produced for one request. The last delta has ``finish_reason`` set."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # last delta only
    error: str | None = None  # with finish_reason "error": what went wrong
    logprobs: list[TokenLogprob] | None = None  # params.logprobs set: one per token_ids entry
    code: ErrorCode | None = None  # with finish_reason "error": the status to answer with (None: INTERNAL)
    # with finish_reason "error": what the client is told (the failure's class; no addresses, pids or
    # exception text: those are in ``error`` and the server log)
    message: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request: how many token ids were handed out."""

    req: Request
    sent: int = 0
    error: str | None = None  # a failure the coordinator decided (else the request's own)
    message: str | None = None  # ... what the client is told of it
    code: ErrorCode | None = None


@dataclass
class _Snapshot:
    """Engine gauges, taken on the engine thread at the end of every pass."""

    running: int = 0
    waiting: int = 0
    kv: dict[str, int] = field(default_factory=dict)


class RequestStream:
    """The live side of one request: an async iterator of its deltas.

    ``close()`` (also run when iteration stops early) aborts the request if it has not
    finished; it is idempotent.
    """

    def __init__(self, coordinator: "Coordinator", request_id: str, key: str | None = None, tenant: str = ""):
        self.request_id = request_id  # the caller's id (what its deltas carry)
        self.key = key or request_id  # the coordinator's and the engine's: the id within its caller's scope
        self.tenant = tenant  # whose request it is (the tenant quota counts them)
        self._coord = coordinator
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
        self._coord.stream_closed(self.key, self.done)

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
        if self._coord.one_token_deltas and len(delta.token_ids) > 1:
            ids, lps = delta.token_ids, delta.logprobs
            for i in range(len(ids) - 1):
                self._queue.put_nowait(Delta(self.request_id, [ids[i]], "", logprobs=lps[i:i + 1] if lps else None))
            delta = dataclasses.replace(delta, token_ids=ids[-1:], logprobs=lps[-1:] if lps else None)
        self._queue.put_nowait(delta)


@dataclass
class SchedulingTiming:
    """Where the engine thread's time goes, besides ``engine.step`` (seconds since the last reset).

    A *pass* is one turn of the engine thread's loop while it has work: run the queued
    commands, ``engine.step()``, collect the deltas, snapshot the gauges, post them to
    the event loop. ``tick_s``: the passes; ``step_s``: the ``engine.step`` part of them;
    ``gap_s``: while work remained, the time between one pass's end and the next one's
    start (taking the command queue's lock, waiting for the GIL). ``tick_s + gap_s`` is
    the thread's busy wall time, and ``scheduling_s = tick_s - step_s + gap_s`` is the
    coordinator's own time per step besides ``engine.step``: everything on the step's
    critical path that is not the engine. Dispatching deltas to the streams runs on the
    event loop concurrently with the next step and is not counted, except as the GIL
    contention it causes (which lands in ``gap_s``, or inside ``step_s``).
    """

    tick_s: float = 0.0
    step_s: float = 0.0
    gap_s: float = 0.0

    @property
    def scheduling_s(self) -> float:
        return self.tick_s - self.step_s + self.gap_s

    def reset(self) -> None:
        self.__init__()


class _Command:
    """A command queued for the engine thread: ``run()`` there, or ``fail(exc)`` if it never will."""

    __slots__ = ("run", "fail")

    def __init__(self, run: Callable[[], None], fail: Callable[[BaseException], None]):
        self.run, self.fail = run, fail

    def __call__(self) -> None:
        self.run()


class Coordinator:
    """Serves many concurrent generation streams from one engine (see the module docstring)."""

    def __init__(self, engine: Engine, max_queued: int = 256, tenant_quota: int | None = None):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        if tenant_quota is not None and tenant_quota < 1:
            raise ValueError(f"tenant_quota must be >= 1, got {tenant_quota}")
        self.engine = engine
        self.max_queued = max_queued
        self.tenant_quota = tenant_quota  # live requests one tenant may hold (None: no quota)
        # limits.speculative_stats false: a step's tokens reach a stream one a delta (RequestStream.deliver)
        limits = getattr(getattr(engine, "config", None), "limits", None)  # (a stand-in engine may have no config)
        self.one_token_deltas = not getattr(limits, "speculative_stats", True)
        # shared between the event loop and the engine thread, under _cond
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._stop_requested = False
        self._engine_error: str | None = None  # set once by the dying engine thread: why it died
        self._step_failures = 0  # steps failed in a row (written by the engine thread, read anywhere)
        # engine thread only
        self._tracked: dict[str, _Tracked] = {}
        # event loop only
        self._live: dict[str, RequestStream] = {}
        self._snapshot = _Snapshot(kv=dict.fromkeys(engine.kv_slots_in_use(), 0))
        totals = ("requests_total", "requests_finished", "requests_cancelled", "requests_failed")
        self._totals = dict.fromkeys(totals, 0)
        self._active_streams = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future | None = None  # settled by the engine thread's last post
        self._draining = False
        self._closed = False
        self._target_down: str | None = None  # why the target is down (target_down), until target_up
        self._target_lost: str | None = None  # why the target is lost for good (target_lost)
        self._encoder = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "specdist-tokenize")
        self.availability_listeners: list[Callable[[bool], None]] = []  # (accepting), on the event loop
        self.timing = SchedulingTiming()
        self.metrics = Metrics(engine, lambda: self._snapshot)  # Prometheus series of this engine

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread, posting to the running event loop (idempotent)."""
        if self._thread is not None:
            return
        if self._closed:
            raise ShuttingDown("the coordinator is closed")
        self._loop = asyncio.get_running_loop()
        self._stopped = self._loop.create_future()
        self._thread = threading.Thread(target=self._engine_main, name="specdist-engine", daemon=True)
        self._thread.start()

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

        await self._call(run)

    @property
    def accepting(self) -> bool:
        """Whether the server is ready (health SERVING): False once draining or closed, while the target is down,
        while steps keep failing (:attr:`steps_failing`), and for good once the engine thread has died. New
        requests are refused in each of those cases but the failing steps."""
        return not self._draining and self._target_down is None and self._engine_error is None \
            and not self.steps_failing

    @property
    def steps_failing(self) -> bool:
        """Whether the last :data:`STEP_FAILURES_NOT_READY` steps or more failed, none succeeding since."""
        return self._step_failures >= STEP_FAILURES_NOT_READY

    @property
    def engine_error(self) -> str | None:
        """Why the engine thread died (``"ExcType: message"``); None while it serves."""
        return self._engine_error

    @property
    def target_is_down(self) -> bool:
        return self._target_down is not None

    @property
    def unrecoverable(self) -> str | None:
        """Why this server cannot recover by itself (the engine thread died, the target group is lost
        for good), or None: a restart is the only way back (liveness NOT_SERVING)."""
        if self._engine_error is not None:
            return f"the engine thread died ({self._engine_error})"
        if self._target_lost is not None:
            return f"the target group is lost ({self._target_lost})"
        return None

    # ---------------------------------------------------------------- target faults (any thread)
    def target_down(self, reason: str) -> None:
        """The target failed: fail every request (UNAVAILABLE, naming the failed ranks of ``reason``),
        refuse new ones until :meth:`target_up`."""
        self._target_down = reason
        self.call_soon(lambda: self._fail_all(f"target unavailable: {reason}", target_unavailable_message(reason)))
        self._post(self._availability_changed)

    def target_lost(self, reason: str) -> None:
        """The target group is lost for good (every rebuild failed): fail every request, refuse new
        ones until the process is restarted; :attr:`unrecoverable` says why."""
        self._target_lost = reason
        self.target_down(reason)

    def target_up(self, prepare: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """The target is back: run ``prepare`` on the engine thread (e.g. reconnect), then admit again."""

        def run() -> None:
            if prepare is not None:
                prepare()
            self._target_down = None
            self._post(self._availability_changed)

        return self.call_soon(run)

    def call_soon(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Thread-safe: run ``fn`` on the engine thread before its next step; a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # the outcome goes to the future
                fut.set_exception(e)

        with self._cond:
            if self._engine_error is None:
                self._commands.append(_Command(run, fut.set_exception))
                self._cond.notify()
                return fut
        fut.set_exception(self._engine_down())
        return fut

    def _availability_changed(self) -> None:
        for listener in list(self.availability_listeners):
            try:
                listener(self.accepting)
            except Exception:  # a listener must not break the loop
                log.exception("availability listener failed")

    def start_draining(self) -> None:
        """Refuse new requests from now on (ShuttingDown); running ones carry on."""
        self._draining = True

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, then wait up to ``timeout`` seconds for live requests to end."""
        self.start_draining()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._live and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return not self._live

    async def close(self) -> None:
        """Abort every request (their streams end with "abort"), stop the engine thread, join it."""
        if self._closed:
            return
        self._closed = self._draining = True
        self._encoder.shutdown(wait=False, cancel_futures=True)
        if self._thread is None:
            self.metrics.close()
            return
        with self._cond:
            self._stop_requested = True
            self._cond.notify()
        await asyncio.shield(self._stopped)  # after the thread's final deltas were dispatched
        self._thread.join(JOIN_TIMEOUT_S)  # it has nothing left to do but return
        if self._thread.is_alive():
            log.error("the specdist engine thread did not exit within %.0fs of close()", JOIN_TIMEOUT_S)
        else:
            self.metrics.close()

    # ---------------------------------------------------------------- requests
    async def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> EncodedPrompt:
        """Template (``chat``) and tokenize a prompt on the tokenizer threads, off the engine thread
        (:func:`specdist.engine.prompts.encode_prompt`: ``InvalidArgument`` naming the field)."""
        self._check_serving()  # no tokenizing for a request that would be refused anyway
        return await self._encode(prompt, chat)

    async def _encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool) -> EncodedPrompt:
        arrival = time.perf_counter()
        eng = self.engine
        text, ids = await asyncio.get_running_loop().run_in_executor(
            self._encoder, lambda: encode_prompt(eng.tokenizer, prompt, vocab_size=eng.vocab_size,
                                                 max_model_len=eng.max_model_len, chat=chat))
        return EncodedPrompt(text, ids, arrival)

    async def open(
        self,
        prompt: str | Sequence[int] | EncodedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        scope: str = "",
        tenant: str = "",
        session: str | None = None,
    ) -> RequestStream:
        """Admit a request and return its stream (the caller must ``close()`` it or read it to the end).

        ``prompt``: text, token ids or (``chat``) a conversation, templated and tokenized here off
        the engine thread, or an :class:`EncodedPrompt` (:meth:`encode`: one prompt for several
        requests). Raises :class:`Overloaded`, :class:`ShuttingDown`, :class:`TargetDown`,
        :class:`EngineDown`, ``InvalidArgument`` (bad prompt, params or id; :class:`DuplicateRequestId`).
        ``scope``: whose id it is (the caller, :func:`scoped`): ids are unique, and cancelled, within a scope, so
        a caller neither sees nor touches another's requests by their ids. ``tenant``: who the request belongs to
        (:func:`specdist.transport.security.tenant_of`): the cores share state only within a tenant. ``session``:
        the client's session id, which only a router over several groups uses (ReplicaFront.open): one group
        holds every session already.
        """
        request_id = self._admissible(request_id, scope, tenant)
        key = scoped(scope, request_id)
        stream = RequestStream(self, request_id, key, tenant)
        self._live[key] = stream  # reserved now: its id and its room hold while the prompt is tokenized
        try:
            if not isinstance(prompt, EncodedPrompt):
                prompt = await self._encode(prompt, chat)
                self._check_serving()  # the server may have stopped taking requests meanwhile
            added = self._call(lambda: self._add(prompt, params, key, tenant))
        except BaseException:  # a bad prompt, the caller gone, or closed / the engine thread died since the checks
            self._live.pop(key, None)
            raise
        stream.admission = added
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:  # the caller went away; undo the add once it has run
            added.add_done_callback(lambda f: self._admitted(stream, f) and stream.close())
            raise
        except Exception:
            self._live.pop(key, None)
            raise
        self._admitted(stream, added)
        return stream

    def _admissible(self, request_id: str | None, scope: str = "", tenant: str = "") -> str:
        """Refuse a request the server cannot take now (cheap checks, on the event loop); its id."""
        self._check_serving()
        self.start()
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidArgument("request_id", f"must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
        if scoped(scope, request_id) in self._live:
            raise DuplicateRequestId(request_id)
        if len(self._live) >= self.max_queued:
            raise Overloaded(f"{len(self._live)} requests in the system (max_queued={self.max_queued}); retry later")
        quota = self.tenant_quota
        if quota is not None and sum(s.tenant == tenant for s in self._live.values()) >= quota:  # O(live)
            raise TenantQuotaExceeded(f"this tenant holds {quota} live requests (limits.max_queued_per_tenant="
                                      f"{quota}); retry later")
        return request_id

    def check_room(self, n: int = 1) -> None:
        """Refuse ``n`` new requests now unless the server takes requests and has room for them (cheap, on the event
        loop): what a front end asks before it reads, renders or tokenizes anything. Admission checks again."""
        self._check_serving()
        if len(self._live) + n > self.max_queued:
            raise Overloaded(f"{len(self._live)} requests in the system (max_queued={self.max_queued}); retry later")

    def _check_serving(self) -> None:
        """Refuse any request while draining or closed, the target down or lost, the engine thread dead."""
        if self._draining:
            raise ShuttingDown("the server is shutting down")
        if self._target_lost is not None:
            raise TargetDown(target_lost_message(self._target_lost))
        if self._target_down is not None:
            raise TargetDown(f"the target is down ({failed_ranks(self._target_down) or 'a target worker'} failed); "
                             "it is being rebuilt, retry later")
        if self._engine_error is not None:
            raise self._engine_down()

    async def cancel(self, request_id: str, scope: str = "") -> bool:
        """Abort a live request of ``scope``; its stream ends with "abort". False if no live request of that scope
        has that id."""
        request_id = scoped(scope, request_id)
        if request_id not in self._live:
            return False
        if self._closed or self._engine_error is not None:  # each live request is being ended already
            return True
        try:
            return await self._call(lambda: self._abort(request_id))
        except EngineDown:  # the engine thread died meanwhile: its requests end with an error
            return True

    def counters(self) -> dict[str, int]:
        """Gauges (engine: as of the last delivered pass) and totals since start."""
        snap = self._snapshot
        return {
            "running": snap.running,
            "queued": snap.waiting,
            "target_kv_slots_used": snap.kv.get("target", 0),
            "draft_kv_slots_used": snap.kv.get("draft", 0),
            **self._totals,
            "active_streams": self._active_streams,
            "live_requests": len(self._live),
        }

    # ---------------------------------------------------------------- event-loop side
    def _call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Queue ``fn`` for the engine thread (run before the next step); a future of its result."""
        self.start()
        loop = self._loop
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting coroutine
                self._post(_settle, fut, None, e)
            else:
                self._post(_settle, fut, result, None)

        with self._cond:
            if self._stop_requested:
                raise ShuttingDown("the coordinator is closed")
            if self._engine_error is not None:
                raise self._engine_down()
            self._commands.append(_Command(run, lambda e: self._post(_settle, fut, None, e)))
            self._cond.notify()
        return fut

    def _engine_down(self) -> EngineDown:
        """The refusal once the engine thread died: a stable message (the cause is logged, and is
        :attr:`engine_error`)."""
        return EngineDown(ENGINE_DOWN_MESSAGE)

    def _admitted(self, stream: RequestStream, added: asyncio.Future) -> bool:
        """Book a request whose add command has run; False (and forget it) if the add failed."""
        if added.cancelled() or added.exception() is not None:
            self._live.pop(stream.key, None)
            return False
        self._totals["requests_total"] += 1
        self._active_streams += 1
        return True

    def stream_closed(self, request_id: str, finished: bool) -> None:
        """A stream's consumer let go of it (on the event loop): one active stream fewer, and the
        request is aborted unless its final delta was delivered (``finished``)."""
        self._active_streams -= 1
        if not finished:
            self._abort_soon(request_id)

    def _abort_soon(self, request_id: str) -> None:
        """Fire-and-forget abort (a consumer went away); safe from ``finally`` blocks."""
        if self._loop is not None and not self._loop.is_closed() and not self._closed:
            try:
                fut = self._call(lambda: self._abort(request_id))
            except EngineDown:  # the engine thread died: the request ends with its error delta
                return
            fut.add_done_callback(_retrieved)  # failed with EngineDown if the thread dies first: no warning

    def _deliver(self, deltas: list[Delta], snapshot: _Snapshot | None) -> None:
        """One engine pass's results, on the event loop."""
        if snapshot is not None:
            self._snapshot = snapshot
        for d in deltas:
            self._dispatch(d)

    def _engine_died(self, message: str, snapshot: _Snapshot | None) -> None:
        """The engine thread died (on the event loop, after everything it posted before): end every
        live stream with an UNAVAILABLE error delta, tell the availability listeners."""
        if snapshot is not None:
            self._snapshot = snapshot
        for rid, stream in list(self._live.items()):
            added = stream.admission
            if added is not None and not added.done():  # not expected: its add command was failed
                added.set_exception(self._engine_down())
            if added is None or added.cancelled() or added.exception() is not None:
                continue  # never admitted (or still tokenized): open() raises its error (and forgets the id)
            self._dispatch(Delta(rid, [], "", "error", error=message, code=ErrorCode.UNAVAILABLE,
                                 message=ENGINE_DOWN_MESSAGE))
        self._availability_changed()

    def _dispatch(self, delta: Delta) -> None:
        stream = self._live.get(delta.request_id)
        if delta.finished:
            self._live.pop(delta.request_id, None)
            key = {"stop": "requests_finished", "length": "requests_finished", "abort": "requests_cancelled"}
            self._totals[key.get(delta.finish_reason, "requests_failed")] += 1
        if stream is not None:
            stream.deliver(delta)

    # ---------------------------------------------------------------- engine thread
    def _post(self, fn: Callable[..., None], *args: Any) -> bool:
        """Hand ``fn(*args)`` to the event loop; False if the loop is closed (nobody to tell)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _engine_main(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug in the loop itself: say so, fail everything
            log.exception("the specdist engine thread died; failing every request, refusing new ones, "
                          "health NOT_SERVING")
            self._die(e)
        finally:
            self._post(_settle, self._stopped, None, None)  # after _die's posts: close() returns

    def _die(self, exc: BaseException) -> None:
        """The engine thread's last act after an unexpected error (module docstring): refuse new
        commands, fail the queued ones, release what the engine holds (best effort), then have the
        event loop end every live stream."""
        with self._cond:
            self._engine_error = _describe(exc)
            queued = list(self._commands)
            self._commands.clear()
        error = self._engine_down()
        for command in queued:
            try:
                command.fail(error)
            except Exception:  # keep failing the others
                log.exception("failing a queued command after the engine thread died failed")
        snapshot = None
        try:
            self._fail_everyone(exc)  # releases every tracked request's slots; the streams get _engine_died's deltas
            eng = self.engine
            snapshot = _Snapshot(len(eng.running), len(eng.waiting), eng.kv_slots_in_use())
        except Exception:  # the engine is in an unknown state: the streams still end
            log.exception("releasing the engine's requests after the engine thread died failed")
        self._post(self._engine_died, f"the engine thread died ({self._engine_error})", snapshot)

    def _serve(self) -> None:
        """The engine thread's loop: passes while there is work, asleep on ``_cond`` otherwise."""
        busy = False
        last_end: float | None = None  # end of the previous pass, while work remained
        while True:
            with self._cond:
                while not (busy or self._commands or self._stop_requested):
                    last_end = None
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stop_requested
            t0 = time.perf_counter()
            if last_end is not None:
                self.timing.gap_s += t0 - last_end
            deltas, snapshot, busy = self._pass(commands, stopping)
            last_end = time.perf_counter()
            self.timing.tick_s += last_end - t0  # before the results are posted: a reader who saw them sees it
            delivered = self._post(self._deliver, deltas, snapshot)
            if stopping:
                return
            if not delivered:  # the event loop is gone without close(): free the engine and stop
                log.error("the event loop closed under a running coordinator; aborting its requests")
                self._abort_all()
                return

    def _pass(self, commands: list[Callable[[], None]], stopping: bool) -> tuple[list[Delta], _Snapshot | None, bool]:
        """Queued commands, then one step (or, when stopping, abort everything); (deltas, gauges, busy)."""
        for run in commands:
            run()  # never raises: the outcome goes to the command's future
        try:
            if stopping:
                self._abort_all()
            elif self.engine.has_unfinished():
                ts = time.perf_counter()
                try:
                    self.engine.step()
                except Exception as e:
                    log.exception("engine step failed")
                    self._fail_batch(e)
                    self._step_failures += 1
                    if self._step_failures == STEP_FAILURES_NOT_READY:
                        log.error("%d engine steps failed in a row: not ready until one succeeds", self._step_failures)
                        self._post(self._availability_changed)
                else:
                    was_failing, self._step_failures = self.steps_failing, 0
                    if was_failing:
                        log.warning("an engine step succeeded again: ready")
                        self._post(self._availability_changed)
                self.timing.step_s += time.perf_counter() - ts
            deltas = [d for rid, t in list(self._tracked.items()) if (d := self._collect(rid, t)) is not None]
            eng = self.engine
            snapshot = _Snapshot(len(eng.running), len(eng.waiting), eng.kv_slots_in_use())
            return deltas, snapshot, eng.has_unfinished() and not stopping
        except Exception as e:  # a bug outside engine.step(): fail everyone, keep serving
            log.exception("specdist coordinator pass failed")
            return self._fail_everyone(e), None, False

    def _add(self, prompt: EncodedPrompt, params: SamplingParams | None, request_id: str, tenant: str = "") -> None:
        """Add an encoded prompt (the engine takes it as it is: text, ids and arrival)."""
        self._tracked[request_id] = _Tracked(self.engine.add_request(prompt, params, request_id, tenant=tenant))

    def _abort(self, request_id: str) -> bool:
        return request_id in self._tracked and self.engine.abort(request_id)

    def _abort_all(self) -> None:
        for rid, t in list(self._tracked.items()):
            if not self.engine.abort(rid):
                t.req.output.finish("abort")
                self.engine.release(t.req)  # idempotent release of whatever it still holds

    def _fail_batch(self, exc: Exception) -> None:
        """Fail the requests the failed step touched (everything not still waiting) and release them."""
        waiting = {id(r) for r in self.engine.waiting}
        touched = [t for t in self._tracked.values() if id(t.req) not in waiting] or list(self._tracked.values())
        for t in touched:
            if not t.req.finished:
                t.error, t.message = f"engine step failed: {exc!r}", STEP_FAILED_MESSAGE
                t.req.output.finish("error")
            self.engine.release(t.req)  # idempotent; frees slots even for a request caught mid-admission

    def _fail_all(self, error: str, message: str) -> None:
        """Fail and release every request the engine holds (running and waiting) with ``error``
        (UNAVAILABLE; the client is told ``message``)."""
        tracked = list(self._tracked.values())
        for t in tracked:
            if not t.req.finished:
                t.error, t.message, t.code = error, message, ErrorCode.UNAVAILABLE
                t.req.output.finish("error")
        self.engine.release([t.req for t in tracked])  # one call per worker: a dead one fails it once

    def _fail_everyone(self, exc: BaseException) -> list[Delta]:
        """Fail and release every request the engine holds; their final error deltas."""
        deltas = []
        for rid, t in list(self._tracked.items()):
            del self._tracked[rid]
            try:
                if not t.req.finished:
                    t.req.output.finish("error")
                self.engine.release(t.req)
            except Exception:  # keep failing the others
                log.exception("releasing request %r after an internal error failed", rid)
            deltas.append(Delta(rid, [], "", "error", error=f"internal error: {exc!r}", message=INTERNAL_MESSAGE))
        return deltas

    def _collect(self, rid: str, t: _Tracked) -> Delta | None:
        out = t.req.output
        new_ids = out.token_ids[t.sent :]
        logprobs = t.req.logprobs[t.sent : t.sent + len(new_ids)] if t.req.logprobs is not None else None
        t.sent += len(new_ids)
        text = out.take_delta()
        if not out.finished:
            return Delta(rid, new_ids, text, logprobs=logprobs) if new_ids or text else None
        del self._tracked[rid]
        metrics = dataclasses.replace(t.req.metrics, output_tokens=len(out.token_ids))
        delta = Delta(rid, new_ids, text, out.finish_reason, out.stop_reason, metrics, logprobs=logprobs)
        if out.finish_reason == "error":
            delta.error, delta.message, delta.code = _failure(t)
        return delta


def _failure(t: _Tracked) -> tuple[str, str, ErrorCode]:
    """(error, client message, code) of a failed request: the coordinator's own decision, or what
    the engine recorded on the request (``error``, ``error_code``: a target that failed it)."""
    if t.error is not None:
        return t.error, t.message or INTERNAL_MESSAGE, t.code or ErrorCode.INTERNAL
    error = getattr(t.req, "error", None) or "the request failed"
    code = getattr(t.req, "error_code", None) or ErrorCode.INTERNAL
    if code == ErrorCode.UNAVAILABLE:  # the target failed as a whole (a rank died, rank 0 unreachable)
        return error, target_unavailable_message(error), code
    return error, TARGET_FAILED_MESSAGE, code


def _describe(exc: BaseException) -> str:
    """``"ExcType: message"``, even for an exception whose ``str()`` fails."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not stop the dying thread
        text = "<unprintable>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _retrieved(fut: asyncio.Future) -> None:
    """A done callback that reads a fire-and-forget future's outcome (no "never retrieved" warning)."""
    if not fut.cancelled():
        fut.exception()


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
