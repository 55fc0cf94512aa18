"""The one thread that touches the engine, and the command queue the event loop feeds it.

While there is work the thread loops: take every queued command (add a request, abort one, a warm-up run), run
them, run one ``engine.step()``, collect each request's new tokens and text as :class:`Delta` objects, and post
them, with a snapshot of the engine's gauges, to the event loop in one ``loop.call_soon_threadsafe`` call. Then it
goes straight on to the next step: the event loop hands deltas to the streams while the next step is already
running, so its latency is off the step's critical path. With no request in the engine and no command queued, the
thread sleeps on a ``threading.Condition`` until a command arrives (no polling). The event loop never calls the
engine; it queues commands (:meth:`EngineThread.submit`, :meth:`EngineThread.call_soon` from any thread), which
run before the next step. So requests join and leave the running batch between steps, and an aborted request frees
its KV slots within one step.

Failures: a step that raises fails only the requests that were in the batch (they get a final
``finish_reason="error"`` delta and their slots are released); waiting requests carry on, and the thread keeps
serving. A failure outside ``engine.step`` (a bug in the coordinator or the engine's bookkeeping) fails every
request the engine holds, and the thread keeps serving. :data:`STEP_FAILURES_NOT_READY` steps failing in a row (a
full disk under ``engine.compile: on``, a broken device) make :attr:`EngineThread.steps_failing` true until a step
succeeds; each change is posted to ``on_availability``.

Death: an error that escapes every handler above (one that is not an ``Exception``, or one raised while failing
the others) ends the thread. It is logged once; the dying thread releases what the engine holds, fails the queued
commands with :class:`~specdist.api.refusals.EngineDown` (as every later one), records why
(:attr:`EngineThread.engine_error`) and posts ``on_death`` with a description of the cause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specdist.api.refusals import (
    INTERNAL_MESSAGE,
    STEP_FAILED_MESSAGE,
    TARGET_FAILED_MESSAGE,
    EngineDown,
    ShuttingDown,
    engine_down,
    target_unavailable_message,
)
from specdist.engine.prompts import EncodedPrompt
from specdist.errors import ErrorCode
from specdist.logprobs import TokenLogprob
from specdist.sampling_params import SamplingParams

if TYPE_CHECKING:  # the thread drives an engine (Engine, RemoteEngine: EngineBase's API)
    from specdist.engine.base import EngineBase
    from specdist.engine.request import Request, RequestMetrics

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # stop(): how long to wait for the thread to exit once it said it would
STEP_FAILURES_NOT_READY = 3  # steps failing in a row after which the server is not ready (until one succeeds)


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
class Snapshot:
    """Engine gauges, taken on the engine thread at the end of every pass."""

    running: int = 0
    waiting: int = 0
    kv: dict[str, int] = field(default_factory=dict)


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


class EngineThread:
    """The engine's own thread, its command queue and its requests (module docstring).

    ``on_deltas(deltas)``: one pass's deltas, on the event loop (:attr:`snapshot` is then that pass's gauges);
    ``on_death(error)``: the thread died (on the event loop, after everything it posted before);
    ``on_availability()``: :attr:`steps_failing` changed (on the event loop).
    """

    def __init__(
        self,
        engine: EngineBase,
        on_deltas: Callable[[list[Delta]], None],
        on_death: Callable[[str], None],
        on_availability: Callable[[], None],
    ):
        self.engine = engine
        self.on_deltas, self.on_death, self.on_availability = on_deltas, on_death, on_availability
        # shared between the event loop and the engine thread, under cond
        self.cond = threading.Condition()
        self.commands: deque[_Command] = deque()
        self.stop_requested = False
        self.engine_error: str | None = None  # set once by the dying thread: why it died ("ExcType: message")
        self.step_failures = 0  # steps failed in a row (written by the engine thread, read anywhere)
        # engine thread only
        self._tracked: dict[str, _Tracked] = {}
        # event loop only: the gauges of the last pass delivered
        self.snapshot = Snapshot(kv=dict.fromkeys(engine.kv_slots_in_use(), 0))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._stopped: asyncio.Future | None = None  # settled by the thread's last post
        self.timing = SchedulingTiming()

    @property
    def steps_failing(self) -> bool:
        """Whether the last :data:`STEP_FAILURES_NOT_READY` steps or more failed, none succeeding since."""
        return self.step_failures >= STEP_FAILURES_NOT_READY

    # ---------------------------------------------------------------- event-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the thread, posting to ``loop``."""
        self.loop = loop
        self._stopped = loop.create_future()
        self.thread = threading.Thread(target=self._main, name="specdist-engine", daemon=True)
        self.thread.start()

    async def stop(self) -> bool:
        """Have the thread abort every request and exit (their final deltas dispatched first), then join it; False
        if it did not exit within :data:`JOIN_TIMEOUT_S`."""
        with self.cond:
            self.stop_requested = True
            self.cond.notify()
        await asyncio.shield(self._stopped)
        self.thread.join(JOIN_TIMEOUT_S)  # it has nothing left to do but return
        if self.thread.is_alive():
            log.error("the specdist engine thread did not exit within %.0fs of close()", JOIN_TIMEOUT_S)
            return False
        return True

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Queue ``fn`` for the engine thread (run before the next step; the thread is started); a future of its
        result on the event loop."""
        fut = self.loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as e:  # handed to the awaiting coroutine
                self.post(_settle, fut, None, e)
            else:
                self.post(_settle, fut, result, None)

        with self.cond:
            if self.stop_requested:
                raise ShuttingDown("the coordinator is closed")
            if self.engine_error is not None:
                raise engine_down()
            self.commands.append(_Command(run, lambda e: self.post(_settle, fut, None, e)))
            self.cond.notify()
        return fut

    def call_soon(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Thread-safe: run ``fn`` on the engine thread before its next step; a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # the outcome goes to the future
                fut.set_exception(e)

        with self.cond:
            if self.engine_error is None:
                self.commands.append(_Command(run, fut.set_exception))
                self.cond.notify()
                return fut
        fut.set_exception(engine_down())
        return fut

    def abort_soon(self, request_id: str) -> None:
        """Fire-and-forget abort (a consumer went away); safe from ``finally`` blocks."""
        if self.loop is not None and not self.loop.is_closed():
            try:
                fut = self.submit(lambda: self.abort(request_id))
            except EngineDown:  # the engine thread died: the request ends with its error delta
                return
            fut.add_done_callback(_retrieved)  # failed with EngineDown if the thread dies first: no warning

    def post(self, fn: Callable[..., None], *args: Any) -> bool:
        """Hand ``fn(*args)`` to the event loop; False if the loop is closed (nobody to tell)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _delivered(self, deltas: list[Delta], snapshot: Snapshot | None) -> None:
        """One pass's results, on the event loop."""
        if snapshot is not None:
            self.snapshot = snapshot
        self.on_deltas(deltas)

    def _died(self, error: str, snapshot: Snapshot | None) -> None:
        if snapshot is not None:
            self.snapshot = snapshot
        self.on_death(error)

    # ---------------------------------------------------------------- engine thread: commands
    def add(self, prompt: EncodedPrompt, params: SamplingParams | None, request_id: str, tenant: str = "") -> None:
        """Add an encoded prompt (the engine takes it as it is: text, ids and arrival)."""
        self._tracked[request_id] = _Tracked(self.engine.add_request(prompt, params, request_id, tenant=tenant))

    def abort(self, request_id: str) -> bool:
        return request_id in self._tracked and self.engine.abort(request_id)

    def fail_all(self, error: str, message: str) -> None:
        """Fail and release every request the engine holds (running and waiting) with ``error``
        (UNAVAILABLE; the client is told ``message``)."""
        tracked = list(self._tracked.values())
        for t in tracked:
            if not t.req.finished:
                t.error, t.message, t.code = error, message, ErrorCode.UNAVAILABLE
                t.req.output.finish("error")
        self.engine.release([t.req for t in tracked])  # one call per worker: a dead one fails it once

    # ---------------------------------------------------------------- engine thread: the loop
    def _main(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug in the loop itself: say so, fail everything
            log.exception(
                "the specdist engine thread died; failing every request, refusing new ones, health NOT_SERVING"
            )
            self._die(e)
        finally:
            self.post(_settle, self._stopped, None, None)  # after _die's posts: stop() returns

    def _die(self, exc: BaseException) -> None:
        """The thread's last act after an unexpected error (module docstring): refuse new commands, fail the
        queued ones, release what the engine holds (best effort), then have the event loop end every live
        stream."""
        with self.cond:
            self.engine_error = _describe(exc)
            queued = list(self.commands)
            self.commands.clear()
        error = engine_down()
        for command in queued:
            try:
                command.fail(error)
            except Exception:  # keep failing the others
                log.exception("failing a queued command after the engine thread died failed")
        snapshot = None
        try:
            self._fail_everyone(exc)  # releases every tracked request's slots; the streams get on_death's deltas
            snapshot = self._snapshot()
        except Exception:  # the engine is in an unknown state: the streams still end
            log.exception("releasing the engine's requests after the engine thread died failed")
        self.post(self._died, f"the engine thread died ({self.engine_error})", snapshot)

    def _serve(self) -> None:
        """The thread's loop: passes while there is work, asleep on ``cond`` otherwise."""
        busy = False
        last_end: float | None = None  # end of the previous pass, while work remained
        while True:
            with self.cond:
                while not (busy or self.commands or self.stop_requested):
                    last_end = None
                    self.cond.wait()
                commands = list(self.commands)
                self.commands.clear()
                stopping = self.stop_requested
            t0 = time.perf_counter()
            if last_end is not None:
                self.timing.gap_s += t0 - last_end
            deltas, snapshot, busy = self._pass(commands, stopping)
            last_end = time.perf_counter()
            self.timing.tick_s += last_end - t0  # before the results are posted: a reader who saw them sees it
            delivered = self.post(self._delivered, deltas, snapshot)
            if stopping:
                return
            if not delivered:  # the event loop is gone without close(): free the engine and stop
                log.error("the event loop closed under a running coordinator; aborting its requests")
                self._abort_all()
                return

    def _pass(self, commands: list[Callable[[], None]], stopping: bool) -> tuple[list[Delta], Snapshot | None, bool]:
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
                    self.step_failures += 1
                    if self.step_failures == STEP_FAILURES_NOT_READY:
                        log.error("%d engine steps failed in a row: not ready until one succeeds", self.step_failures)
                        self.post(self.on_availability)
                else:
                    was_failing, self.step_failures = self.steps_failing, 0
                    if was_failing:
                        log.warning("an engine step succeeded again: ready")
                        self.post(self.on_availability)
                self.timing.step_s += time.perf_counter() - ts
            deltas = [d for rid, t in list(self._tracked.items()) if (d := self._collect(rid, t)) is not None]
            return deltas, self._snapshot(), self.engine.has_unfinished() and not stopping
        except Exception as e:  # a bug outside engine.step(): fail everyone, keep serving
            log.exception("specdist coordinator pass failed")
            return self._fail_everyone(e), None, False

    def _snapshot(self) -> Snapshot:
        eng = self.engine
        return Snapshot(len(eng.running), len(eng.waiting), eng.kv_slots_in_use())

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
