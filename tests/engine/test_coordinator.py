"""The Coordinator's threading model, on a fake engine (no model, deterministic).

The engine thread runs free: steps follow each other without the event loop taking part
(they go on while the loop is blocked), an idle coordinator makes no engine calls at
all, commands queued during a step run before the next one, close() joins the thread.
The engine is touched by that one thread only. Each test drives its own event loop with
``asyncio.run``; waits are on state (an event the fake engine sets, or a predicate polled
against a deadline), never on a sleep hoping something happened.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from support.helpers import collect

from specdist.api.coordinator import Coordinator
from specdist.api.refusals import DuplicateRequestId, Overloaded, ShuttingDown
from specdist.engine.prompts import EncodedPrompt
from specdist.errors import InvalidArgument
from specdist.sampling_params import SamplingParams

WAIT_S = 10.0


# ---------------------------------------------------------------- a fake engine


@dataclass
class FakeMetrics:
    output_tokens: int = 0


class FakeOutput:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason = None
        self._text_sent = 0

    def take_delta(self) -> str:
        text = "".join(f"t{t} " for t in self.token_ids[self._text_sent :])
        self._text_sent = len(self.token_ids)
        return text

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, reason


class FakeRequest:
    def __init__(self, request_id: str, prompt, max_tokens: int):
        self.request_id, self.prompt = request_id, prompt
        self.logprobs = None  # no request here asks for them
        self.output = FakeOutput(max_tokens)
        self.metrics = FakeMetrics()

    @property
    def finished(self) -> bool:
        return self.output.finished


class FakeTokenizer:
    """Text as its characters' code points; a chat template that wraps each message's content."""

    chat_template = "<chat>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['content']}>" for m in messages)


class FakeEngine:
    """The engine API the coordinator uses. Each step adds one token (its step number) to every
    running request; a request ends with "length" at ``params.max_tokens``. The coordinator
    tokenizes prompts (``tokenizer``, ``vocab_size``, ``max_model_len``) before adding them.

    ``log``: ("add", id, kwargs) / ("abort", id) / ("step", running ids) in call order.
    ``threads``: the ids of the threads that called it. ``calls``: every method call, counted.
    ``gate``: when cleared, a step waits on it (``in_step`` is set meanwhile); ``hold``: when
    set, a step makes no progress (admits nothing, adds no token) but returns after 1 ms, so the
    coordinator keeps running commands between such steps.
    ``fail_step_when`` / ``fail_gauges``: raise once from step / from kv_slots_in_use.
    """

    vocab_size = 1000
    max_model_len = 64

    def __init__(self, max_batch: int = 4):
        self.max_batch = max_batch
        self.tokenizer = FakeTokenizer()
        self.running: list[FakeRequest] = []
        self.waiting: deque[FakeRequest] = deque()
        self.log: list[tuple] = []
        self.prompts: dict[str, list] = {}  # request id -> the prompt it was added with
        self.threads: set[int] = set()
        self.calls = 0
        self.steps = 0
        self.step_reached: dict[int, threading.Event] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()
        self.hold = threading.Event()
        self.fail_step_when = None
        self.fail_gauges = False
        self.stats = SimpleNamespace(reset=lambda: None)

    def _touch(self) -> None:
        self.calls += 1
        self.threads.add(threading.get_ident())

    def add_request(self, prompt, params=None, request_id=None, **kwargs):
        self._touch()
        if isinstance(prompt, EncodedPrompt):  # the coordinator's: tokenized on its threads
            prompt = prompt.ids
        if not prompt:
            raise InvalidArgument("prompt", "is empty")
        params = params or SamplingParams(max_tokens=4)
        req = FakeRequest(request_id, prompt, params.max_tokens)
        self.prompts[request_id] = list(prompt)
        self.waiting.append(req)
        self.log.append(("add", request_id, kwargs))
        return req

    def abort(self, request_id: str) -> bool:
        self._touch()
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                self.log.append(("abort", request_id))
                req.output.finish("abort")
                self.release(req)
                return True
        return False

    def release(self, req: FakeRequest) -> None:
        self._touch()
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)

    def has_unfinished(self) -> bool:
        self._touch()
        return bool(self.running or self.waiting)

    def kv_slots_in_use(self) -> dict[str, int]:
        self._touch()
        if self.fail_gauges:
            self.fail_gauges = False
            raise RuntimeError("injected gauge failure")
        return {"target": len(self.running), "draft": len(self.running)}

    def step(self) -> list[FakeRequest]:
        self._touch()
        if not self.gate.is_set():
            self.in_step.set()
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
            self.in_step.clear()
        if self.hold.is_set():
            time.sleep(0.001)
            return []
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.popleft())
        if self.fail_step_when is not None and self.fail_step_when(self):
            self.fail_step_when = None
            raise RuntimeError("injected step failure")
        self.steps += 1
        self.log.append(("step", [r.request_id for r in self.running]))
        for r in list(self.running):
            r.output.token_ids.append(self.steps)
            if len(r.output.token_ids) >= r.output.max_tokens:
                r.output.finish("length")
                self.release(r)
        if self.steps in self.step_reached:
            self.step_reached[self.steps].set()
        return []

    def generate(self, prompts, params):
        reqs = [self.add_request(p, params, f"gen-{i}") for i, p in enumerate(prompts)]
        while any(not r.finished for r in reqs):
            self.step()
        return reqs

    def when_step(self, n: int) -> threading.Event:
        """An event set when step number ``n`` has run (register it before that step)."""
        return self.step_reached.setdefault(n, threading.Event())


def coordinator(engine: FakeEngine, **kwargs) -> Coordinator:
    """A Coordinator, with the engine's call record cleared of the constructor's gauge read."""
    coord = Coordinator(engine, **kwargs)
    engine.calls = 0
    engine.threads.clear()
    return coord


def run_async(test):
    """Run an ``async def`` test on a fresh event loop (no pytest-asyncio needed)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(test(*args, **kwargs), 60))

    return wrapper


async def wait_until(predicate, timeout: float = WAIT_S) -> None:
    """Poll ``predicate`` (cheap state) on the event loop until it holds; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for a state"
        await asyncio.sleep(0.002)


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "specdist-engine"]


# ---------------------------------------------------------------- the free-running thread


@run_async
async def test_steps_run_back_to_back_while_the_event_loop_is_blocked():
    engine = FakeEngine()
    async with coordinator(engine) as coord:
        loop_thread = threading.get_ident()
        thirty = engine.when_step(30)
        engine.gate.clear()
        stream = await coord.open([1], params(30))  # added; the first step waits at the gate
        engine.gate.set()
        # block the event loop: a ping-pong design would run one step, then wait for the loop forever
        assert thirty.wait(WAIT_S), f"only {engine.steps} steps ran while the event loop was blocked"
        assert stream._queue.empty()  # nothing was dispatched: the loop did not run
        deltas = [d async for d in stream]  # ...and everything arrives once it does
    assert [t for d in deltas for t in d.token_ids] == list(range(1, 31))
    assert len(deltas) == 30 and deltas[-1].finish_reason == "length" and deltas[-1].metrics.output_tokens == 30
    assert "".join(d.text for d in deltas) == "".join(f"t{i} " for i in range(1, 31))
    assert len(engine.threads) == 1 and loop_thread not in engine.threads  # one thread touches the engine


@run_async
async def test_idle_coordinator_makes_no_engine_calls():
    engine = FakeEngine()
    async with coordinator(engine) as coord:
        await asyncio.sleep(0.1)  # a window to observe: the thread started and must not poll
        assert engine.calls == 0
        deltas = await collect(coord, [1], params(3))
        assert deltas[-1].finish_reason == "length"
        await wait_until(lambda: coord.counters()["running"] == 0)  # the last pass was delivered
        calls, steps, timing = engine.calls, engine.steps, (coord.timing.tick_s, coord.timing.gap_s)
        await asyncio.sleep(0.2)  # idle: the thread sleeps on its condition, touching nothing
        assert (engine.calls, engine.steps) == (calls, steps) == (calls, 3)
        assert (coord.timing.tick_s, coord.timing.gap_s) == timing
        # and wakes for the next command
        assert [d.finish_reason for d in await collect(coord, [2], params(1))] == ["length"]


@run_async
async def test_commands_queued_during_a_step_run_before_the_next_step():
    engine = FakeEngine()
    async with coordinator(engine) as coord:
        engine.gate.clear()
        a = await coord.open([1], params(50), request_id="a")
        await wait_until(engine.in_step.is_set)  # the engine thread is inside the step that admits "a"
        prompt = await coord.encode([2])  # tokenized first: its add is then queued at once, before the abort
        opening = asyncio.create_task(coord.open(prompt, params(2), request_id="b"))
        cancelling = asyncio.create_task(coord.cancel("a"))
        await wait_until(lambda: len(coord.engine_thread.commands) == 2)  # both queued behind the running step
        mark = len(engine.log)
        engine.gate.set()
        b, cancelled = await opening, await cancelling
        assert cancelled
        rest_a = [d async for d in a]
        deltas_b = [d async for d in b]
    after = engine.log[mark:]
    assert after[0][0] == "step" and after[0][1] == ["a"]  # the step that was running
    assert after[1] == ("add", "b", {"tenant": ""}) and after[2] == ("abort", "a")  # then the commands, in order
    assert after[3] == ("step", ["b"])  # and only then the next step, without "a"
    assert rest_a[-1].finish_reason == "abort" and deltas_b[-1].finish_reason == "length"
    assert coord.counters()["requests_cancelled"] == 1


@run_async
async def test_close_aborts_everything_and_joins_the_thread():
    before = set(engine_threads())
    engine = FakeEngine()
    coord = Coordinator(engine)
    await coord.close()  # never started: nothing to join
    assert coord.engine_thread.thread is None
    with pytest.raises(ShuttingDown):
        await coord.open([1])
    assert coord.engine_thread.thread is None  # a refused request starts no thread

    engine = FakeEngine(max_batch=1)
    coord = Coordinator(engine)
    streams = [await coord.open([i + 1], params(10**9)) for i in range(3)]
    await streams[0].__anext__()
    engine.hold.set()  # one running, two waiting, for as long as it takes
    thread = coord.engine_thread.thread
    assert thread.is_alive() and thread in engine_threads()
    await coord.close()
    assert not thread.is_alive() and set(engine_threads()) == before
    for s in streams:
        assert [d.finish_reason async for d in s][-1] == "abort"
    c = coord.counters()
    assert (c["running"], c["queued"], c["target_kv_slots_used"], c["live_requests"]) == (0, 0, 0, 0)
    assert c["requests_cancelled"] == 3 and not engine.running and not engine.waiting
    with pytest.raises(ShuttingDown):
        await coord.open([1])
    assert not await coord.cancel("nope")
    await coord.close()  # idempotent


def test_a_closed_event_loop_stops_a_busy_engine_thread():
    """The loop goes away without close(): the thread's next post fails, it aborts its requests and exits."""
    engine = FakeEngine()
    holder = {}

    async def start():
        holder["coord"] = coord = Coordinator(engine)
        holder["stream"] = await coord.open([1], params(10**9))  # never ends on its own

    asyncio.run(start())  # closes the loop
    thread = holder["coord"].engine_thread.thread
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert not engine.running and not engine.waiting and engine.log[-1] == ("abort", holder["stream"].request_id)


# ---------------------------------------------------------------- unchanged behaviour on the new thread


@run_async
async def test_prompts_reach_the_engine_as_token_ids_templated_only_for_chat():
    engine = FakeEngine()
    async with coordinator(engine) as coord:
        await collect(coord, "hi", params(1), request_id="plain")
        await collect(coord, "hi", params(1), request_id="chat", chat=True)
        await collect(
            coord,
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            params(1),
            request_id="conversation",
            chat=True,
        )
    adds = {e[1]: e[2] for e in engine.log if e[0] == "add"}
    assert adds == {k: {"tenant": ""} for k in ("plain", "chat", "conversation")}  # no chat flag: the engine gets ids
    assert engine.prompts == {
        "plain": [ord("h"), ord("i")],
        "chat": [ord(c) for c in "<hi>"],
        "conversation": [ord(c) for c in "<a><b>"],
    }


@run_async
async def test_admission_ids_and_bad_input():
    engine = FakeEngine()
    async with coordinator(engine, max_queued=2) as coord:
        engine.hold.set()  # nothing finishes until the checks are done
        s1 = await coord.open([1], params(5), request_id="x")
        with pytest.raises(DuplicateRequestId):
            await coord.open([1], request_id="x")
        with pytest.raises(InvalidArgument, match="^prompt"):
            await coord.open([])
        s2 = await coord.open([2], params(5))
        with pytest.raises(Overloaded):
            await coord.open([3])
        with pytest.raises(InvalidArgument, match="^request_id"):
            await coord.open([3], request_id="")
        engine.hold.clear()
        for s in (s1, s2):
            assert [d async for d in s][-1].finish_reason == "length"
        coord.start_draining()
        with pytest.raises(ShuttingDown):
            await coord.open([1])
        assert await coord.drain(5)
    c = coord.counters()
    assert (c["requests_total"], c["requests_finished"], c["requests_failed"]) == (2, 2, 0)


@run_async
async def test_failed_step_fails_only_the_batch():
    engine = FakeEngine(max_batch=2)
    engine.fail_step_when = lambda eng: len(eng.running) == 2 and len(eng.waiting) == 1
    async with coordinator(engine) as coord:
        engine.gate.clear()
        first = await coord.open([1], params(5), request_id="r0")
        await wait_until(engine.in_step.is_set)
        opening = [asyncio.create_task(coord.open([i], params(5), request_id=f"r{i}")) for i in (1, 2)]
        await wait_until(lambda: len(coord.engine_thread.commands) == 2)  # all three in the engine before the next step
        engine.gate.set()
        streams = [first] + [await t for t in opening]
        last = {}
        for s in streams:
            last[s.request_id] = [d async for d in s][-1]
        assert engine.fail_step_when is None  # the failure was injected
        assert [last[r].finish_reason for r in ("r0", "r1", "r2")] == ["error", "error", "length"]
        assert "injected step failure" in last["r0"].error
        c = coord.counters()
        assert (c["requests_failed"], c["requests_finished"], c["running"], c["target_kv_slots_used"]) == (2, 1, 0, 0)


@run_async
async def test_a_bug_outside_step_fails_everyone_and_serving_goes_on():
    engine = FakeEngine()
    async with coordinator(engine) as coord:
        streams = [await coord.open([i + 1], params(10**9)) for i in range(2)]
        for s in streams:
            await s.__anext__()
        engine.hold.set()
        engine.fail_gauges = True
        for s in streams:
            last = [d async for d in s][-1]
            assert last.finish_reason == "error" and "injected gauge failure" in last.error
        assert not engine.running and not engine.waiting
        engine.hold.clear()
        assert [d.finish_reason for d in await collect(coord, [3], params(2))][-1] == "length"
        assert coord.counters()["requests_failed"] == 2


@run_async
async def test_warm_up_and_timing():
    engine = FakeEngine()
    async with coordinator(engine) as coord:
        await coord.warm_up()  # engine.generate, on the engine thread
        assert engine.steps == 2 and len(engine.threads) == 1
        coord.timing.reset()
        await collect(coord, [1], params(20))
        t = coord.timing
        assert t.step_s > 0 and t.tick_s >= t.step_s and t.gap_s >= 0
        assert t.scheduling_s == pytest.approx(t.tick_s - t.step_s + t.gap_s) and t.scheduling_s >= 0
    assert len(engine.threads) == 1
