"""An asyncio front end over an :class:`~specdist.engine.Engine`: continuous batching for many streams.

Threading model: the engine is only ever touched by ONE dedicated thread. The event
loop never calls the engine directly; it puts commands (add a request, abort one) on
a thread-safe queue and runs "ticks" on that thread with ``loop.run_in_executor``.
A tick first runs every queued command, then one ``engine.step()``, then collects
each request's new tokens and text as :class:`Delta` objects, which the event loop
hands to the request's stream. So requests join and leave the running batch between
steps, and an aborted request (``cancel()``, or a consumer that went away) frees its
KV slots at the start of the next tick, i.e. within one step.

Admission: at most ``max_queued`` requests are live (running + waiting) at once;
one more raises :class:`Overloaded`. A step that raises fails only the requests that
were in the batch (they get a final ``finish_reason="error"`` delta and their slots
are released); waiting requests carry on, and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from specdist.engine import Engine
from specdist.errors import InvalidArgument, SpecDistError
from specdist.request import Request, RequestMetrics
from specdist.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 256


class Overloaded(SpecDistError):
    """The server already holds ``max_queued`` requests (gRPC: RESOURCE_EXHAUSTED)."""


class ShuttingDown(SpecDistError):
    """The coordinator is draining or closed and takes no new requests (gRPC: UNAVAILABLE)."""


class DuplicateRequestId(InvalidArgument):
    """A live request already has this client-chosen id (gRPC: ALREADY_EXISTS)."""

    def __init__(self, request_id: str):
        super().__init__("request_id", f"{request_id!r} is already in use by a running request")


@dataclass
class Delta:
    """What one tick produced for one request. The last delta has ``finish_reason`` set."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # last delta only
    error: str | None = None  # with finish_reason "error": what went wrong

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request: how many token ids were handed out."""

    req: Request
    sent: int = 0
    error: str | None = None


@dataclass
class _Snapshot:
    """Engine gauges, taken on the engine thread at the end of every tick."""

    running: int = 0
    waiting: int = 0
    kv: dict[str, int] = field(default_factory=dict)


class RequestStream:
    """The live side of one request: an async iterator of its deltas.

    ``close()`` (also run when iteration stops early) aborts the request if it has not
    finished; it is idempotent.
    """

    def __init__(self, coordinator: "Coordinator", request_id: str):
        self.request_id = request_id
        self._coord = coordinator
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False  # the final delta was delivered to this stream
        self.closed = False

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
        self._coord._active_streams -= 1
        if not self.done:
            self._coord._abort_soon(self.request_id)


@dataclass
class SchedulingTiming:
    """Where the coordinator's time goes, besides ``engine.step`` (seconds since the last reset).

    ``tick_s``: engine-thread ticks (queued commands + step + collecting deltas);
    ``step_s``: the ``engine.step`` part of them; ``gap_s``: while requests were running,
    the time between one tick's end and the next one's start (dispatching deltas to the
    streams, event-loop work, the hop to the engine thread). Scheduling overhead =
    ``tick_s - step_s + gap_s``.
    """

    tick_s: float = 0.0
    step_s: float = 0.0
    gap_s: float = 0.0

    @property
    def scheduling_s(self) -> float:
        return self.tick_s - self.step_s + self.gap_s

    def reset(self) -> None:
        self.__init__()


class Coordinator:
    """Serves many concurrent generation streams from one engine (see the module docstring)."""

    def __init__(self, engine: Engine, max_queued: int = 256):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.engine = engine
        self.max_queued = max_queued
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdist-engine")
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._live: dict[str, RequestStream] = {}  # event loop only
        self._snapshot = _Snapshot(kv=dict.fromkeys(engine.kv_slots_in_use(), 0))
        totals = ("requests_total", "requests_finished", "requests_cancelled", "requests_failed")
        self._totals = dict.fromkeys(totals, 0)
        self._active_streams = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._draining = False
        self._stopping = False
        self._closed = False
        self.timing = SchedulingTiming()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._task = self._loop.create_task(self._run(), name="specdist-step-loop")

    async def __aenter__(self) -> "Coordinator":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def warm_up(self) -> None:
        """Run one tiny greedy request on the engine thread (first-call costs), then reset the stats."""

        def run() -> None:
            self.engine.generate([[0]], SamplingParams(max_tokens=2, temperature=0.0, seed=0, ignore_eos=True))
            self.engine.stats.reset()

        await self._call(run)

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
        """Abort every request (their streams end with "abort"), stop the loop, join the thread."""
        if self._closed:
            return
        self._closed = self._draining = True
        if self._task is not None and not self._task.done():
            await self._call(self._abort_all)
            self._stopping = True
            self._wake.set()
            await self._task
        self._executor.shutdown(wait=True)

    # ---------------------------------------------------------------- requests
    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[Delta]:
        """Stream the request's deltas; the last one has ``finish_reason`` set.

        Raises (on the first iteration) :class:`Overloaded`, :class:`ShuttingDown`,
        ``InvalidArgument`` (bad prompt/params; :class:`DuplicateRequestId`). Closing
        the generator early, or cancelling the task consuming it, aborts the request.
        """
        stream = await self.open(prompt, params, request_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def open(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Admit a request and return its stream (the caller must ``close()`` it or read it to the end)."""
        if self._task is None:
            self.start()
        if self._draining:
            raise ShuttingDown("the server is shutting down")
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidArgument("request_id", f"must be a string of 1 to {MAX_REQUEST_ID_LEN} characters")
        if request_id in self._live:
            raise DuplicateRequestId(request_id)
        if len(self._live) >= self.max_queued:
            raise Overloaded(f"{len(self._live)} requests in the system (max_queued={self.max_queued}); retry later")
        stream = RequestStream(self, request_id)
        self._live[request_id] = stream  # reserved before the await: admission and ids stay race-free
        added = self._call(lambda: self._add(prompt, params, request_id))
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:  # the caller went away; undo the add once it has run
            added.add_done_callback(lambda f: self._admitted(stream, f) and stream.close())
            raise
        except Exception:
            del self._live[request_id]
            raise
        self._admitted(stream, added)
        return stream

    async def cancel(self, request_id: str) -> bool:
        """Abort a live request; its stream ends with "abort". False if no live request has that id."""
        if request_id not in self._live:
            return False
        return await self._call(lambda: self._abort(request_id))

    def counters(self) -> dict[str, int]:
        """Gauges (engine: as of the last tick) and totals since start."""
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
        loop = self._loop
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, result, None)

        self._commands.put(run)
        self._wake.set()
        return fut

    def _admitted(self, stream: RequestStream, added: asyncio.Future) -> bool:
        """Book a request whose add command has run; False (and forget it) if the add failed."""
        if added.cancelled() or added.exception() is not None:
            self._live.pop(stream.request_id, None)
            return False
        self._totals["requests_total"] += 1
        self._active_streams += 1
        return True

    def _abort_soon(self, request_id: str) -> None:
        """Fire-and-forget abort (a consumer went away); safe from ``finally`` blocks."""
        if self._loop is not None and not self._loop.is_closed() and not self._stopping:
            self._call(lambda: self._abort(request_id))

    async def _run(self) -> None:
        busy = False
        last_end: float | None = None
        while not self._stopping:
            if not busy and self._commands.empty():
                self._wake.clear()
                await self._wake.wait()
                last_end = None
                continue
            if busy and last_end is not None:
                self.timing.gap_s += time.perf_counter() - last_end
            try:
                deltas, busy = await self._loop.run_in_executor(self._executor, self._tick)
                last_end = time.perf_counter()
            except Exception as e:  # a bug outside engine.step(): fail everyone, keep serving
                log.exception("specdist coordinator tick failed")
                deltas, busy = self._fail_everyone(e), False
            for d in deltas:
                self._dispatch(d)

    def _dispatch(self, delta: Delta) -> None:
        stream = self._live.get(delta.request_id)
        if delta.finished:
            self._live.pop(delta.request_id, None)
            key = {"stop": "requests_finished", "length": "requests_finished", "abort": "requests_cancelled"}
            self._totals[key.get(delta.finish_reason, "requests_failed")] += 1
        if stream is not None:
            stream.done = stream.done or delta.finished
            if not stream.closed:
                stream._queue.put_nowait(delta)

    def _fail_everyone(self, exc: BaseException) -> list[Delta]:
        ids = list(self._live)

        def drop() -> None:  # on the engine thread, before the next step: release them without deltas
            for rid in ids:
                if (t := self._tracked.pop(rid, None)) is not None:
                    t.req.output.finish("error")
                    self.engine.release(t.req)

        self._call(drop)
        return [Delta(rid, [], "", "error", error=f"internal error: {exc!r}") for rid in ids]

    # ---------------------------------------------------------------- engine thread
    def _add(self, prompt: str | Sequence[int], params: SamplingParams | None, request_id: str) -> None:
        req = self.engine.add_request(prompt, params, request_id)
        self._tracked[request_id] = _Tracked(req)

    def _abort(self, request_id: str) -> bool:
        return request_id in self._tracked and self.engine.abort(request_id)

    def _abort_all(self) -> None:
        for rid, t in list(self._tracked.items()):
            if not self.engine.abort(rid):
                t.req.output.finish("abort")
                self.engine.release(t.req)  # idempotent release of whatever it still holds

    def _tick(self) -> tuple[list[Delta], bool]:
        t0 = time.perf_counter()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                break
        if self.engine.has_unfinished():
            ts = time.perf_counter()
            try:
                self.engine.step()
            except Exception as e:
                log.exception("engine step failed")
                self._fail_batch(e)
            self.timing.step_s += time.perf_counter() - ts
        deltas = [d for rid, t in list(self._tracked.items()) if (d := self._collect(rid, t)) is not None]
        eng = self.engine
        self._snapshot = _Snapshot(len(eng.running), len(eng.waiting), eng.kv_slots_in_use())
        self.timing.tick_s += time.perf_counter() - t0
        return deltas, eng.has_unfinished()

    def _fail_batch(self, exc: Exception) -> None:
        """Fail the requests the failed step touched (everything not still waiting) and release them."""
        waiting = {id(r) for r in self.engine.waiting}
        touched = [t for t in self._tracked.values() if id(t.req) not in waiting] or list(self._tracked.values())
        for t in touched:
            if not t.req.finished:
                t.error = f"engine step failed: {exc!r}"
                t.req.output.finish("error")
            self.engine.release(t.req)  # idempotent; frees slots even for a request caught mid-admission

    def _collect(self, rid: str, t: _Tracked) -> Delta | None:
        out = t.req.output
        new_ids = out.token_ids[t.sent :]
        t.sent += len(new_ids)
        text = out.take_delta()
        if not out.finished:
            return Delta(rid, new_ids, text) if new_ids or text else None
        del self._tracked[rid]
        metrics = dataclasses.replace(t.req.metrics, output_tokens=len(out.token_ids))
        error = t.error or getattr(t.req, "error", None)  # a RemoteEngine records worker errors on the request
        return Delta(rid, new_ids, text, out.finish_reason, out.stop_reason, metrics, error)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
