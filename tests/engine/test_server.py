"""The gRPC front end, in process: serve() on a free localhost port over the tiny models.

The server's asyncio loop runs on a background thread; the tests drive it with the
blocking SpecDistClient (and the raw stub where a malformed or abandoned call is needed).
Where a test needs the server in a particular state (requests live, a batch of a given
shape, a request unable to finish before it is cancelled), it holds the engine with the
Gate and waits on that state (counters, the gate's own events), never on a sleep.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support.helpers import LoopThread, collect, tiny_config, wait_until

from specdist import Engine, SamplingParams
from specdist.api.grpc_server import serve
from specdist.client import RemoteError, SpecDistClient
from specdist.v1 import common_pb2, specdist_pb2, specdist_pb2_grpc

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} g{% endfor %}"
GAUGES = ("running_requests", "queued_requests", "target_kv_slots_used", "draft_kv_slots_used", "active_streams")


class Gate:
    """Wraps engine.step (which only the coordinator's engine thread calls).

    ``open_event``: when cleared, a step waits for it (``blocked`` is set meanwhile), and so
    does the whole engine thread: queued commands (adds, aborts) wait too.
    ``hold_when``: callable(engine) -> bool; while it returns True a step does nothing (no
    admission, no token) and returns after 1 ms, so commands still run between such steps:
    requests can be added and aborted, but none advances.
    ``fail_when``: callable(engine) -> bool; the first step for which it returns True raises
    (before the real step), and ``fail_when`` is reset to None.
    """

    def __init__(self, engine: Engine):
        self.engine, self.real_step = engine, engine.step
        self.open_event = threading.Event()
        self.open_event.set()
        self.blocked = threading.Event()
        self.hold_when = None
        self.fail_when = None
        engine.step = self.step

    def step(self):
        if not self.open_event.is_set():
            self.blocked.set()
            self.open_event.wait()
            self.blocked.clear()
        hold = self.hold_when
        if hold is not None and hold(self.engine):
            time.sleep(0.001)
            return []
        if self.fail_when is not None and self.fail_when(self.engine):
            self.fail_when = None
            raise RuntimeError("injected step failure")
        return self.real_step()


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def start_server(loop_thread, tiny_models, chat_template=None, **serve_kwargs) -> SimpleNamespace:
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    if chat_template:
        engine.tokenizer.chat_template = chat_template
    gate = Gate(engine)
    server, coordinator = loop_thread.run(serve(engine, "127.0.0.1", 0, **serve_kwargs))
    address = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(address)
    return SimpleNamespace(
        server=server,
        coordinator=coordinator,
        gate=gate,
        address=address,
        channel=channel,
        stub=specdist_pb2_grpc.SpecDecodeStub(channel),
        client=SpecDistClient(channel),
    )


@pytest.fixture(scope="module")
def srv(loop_thread, tiny_models):
    s = start_server(loop_thread, tiny_models, chat_template=CHAT_TEMPLATE, drain_seconds=2)
    yield s
    s.gate.open_event.set()
    loop_thread.run(s.server.stop())
    s.channel.close()


@pytest.fixture(scope="module")
def ref(tiny_models):
    """Engine.generate on the same config, one prompt at a time."""
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    return lambda prompt, **kw: engine.generate([prompt], SamplingParams(**kw))[0]


def wait_idle(client: SpecDistClient, timeout: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        counters = client.server_info().counters
        if all(counters[g] == 0 for g in GAUGES) or time.monotonic() > deadline:
            assert {g: counters[g] for g in GAUGES} == dict.fromkeys(GAUGES, 0)
            return counters
        time.sleep(0.02)


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def coordinator_counters(loop_thread, coordinator) -> dict[str, int]:
    """Coordinator.counters() read on its event loop (live_requests included, unlike ServerInfo)."""

    async def read() -> dict[str, int]:
        return coordinator.counters()

    return loop_thread.run(read())


def client_id(engine_id: str) -> str:
    """A client's request id from the engine's (the id within its caller's scope: ``scope/id``)."""
    return engine_id.split("/", 1)[-1]


def running_ids(*ids: str):
    """A hold_when predicate: any of these request ids is in the running batch with output already."""
    return lambda eng: any(client_id(r.request_id) in ids and r.output.token_ids for r in eng.running)


def check_against_engine(client, ref, prompt, **kw) -> None:
    chunks = list(client.generate(prompt, **kw))
    want = ref(prompt, **kw)
    last = chunks[-1]
    assert all(c.finish_reason is None for c in chunks[:-1]) and last.finish_reason == want.finish_reason
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert last.stop_reason == want.stop_reason
    s = last.stats
    assert s.output_tokens == len(want.token_ids) and s.prompt_tokens == want.metrics.prompt_tokens
    assert s.steps == want.metrics.steps and 0 <= s.accepted <= s.drafted
    assert 0 < s.time_to_first_token_s <= s.total_time_s


# ---------------------------------------------------------------- service basics


def test_health_reflection_and_server_info(srv):
    assert srv.client.health() == "SERVING"
    assert srv.client.health("specdist.v1.SpecDecode") == "SERVING"
    services = ProtoReflectionDescriptorDatabase(srv.channel).get_services()
    assert "specdist.v1.SpecDecode" in services and "grpc.health.v1.Health" in services
    info = srv.client.server_info()
    assert (info.draft_method, info.num_speculative_tokens, info.max_model_len) == ("model", 3, 64)
    assert (info.tensor_parallel_size, info.draft_replicas) == (1, 1)
    assert info.target_model.endswith("target") and info.draft_model.endswith("draft")
    from specdist.models.kernels import cpu_kernels

    assert info.cpu_kernels == cpu_kernels.backend() != ""  # which kernels run the target (engine.cpu_kernels)


@pytest.mark.parametrize(
    "prompt, kw",
    [
        ("a b c", dict(max_tokens=20)),
        ("g f", dict(max_tokens=40)),
        ("d", dict(max_tokens=12, stop=["c e"])),
        ([1, 2, 3], dict(max_tokens=20)),
        ([5], dict(max_tokens=30, ignore_eos=True)),
        ([0, 6, 6, 2], dict(max_tokens=25, stop_token_ids=[4])),
    ],
)
def test_greedy_matches_engine(srv, ref, prompt, kw):
    check_against_engine(srv.client, ref, prompt, temperature=0, **kw)


def test_chat_template(srv, ref):
    got = srv.client.generate_text("a b", max_tokens=10, temperature=0, apply_chat_template=True)
    want = ref("a b g", max_tokens=10, temperature=0)  # CHAT_TEMPLATE rendered by hand
    assert got[:3] == (want.text, want.token_ids, want.finish_reason) and got[3].prompt_tokens == 3


# ---------------------------------------------------------------- concurrency


def test_sixteen_concurrent_streams(srv, ref):
    rng = random.Random(0)
    jobs = []
    for i in range(16):
        prompt = [rng.randrange(7) for _ in range(rng.randint(1, 5))]
        if i % 3 == 1:
            prompt = " ".join("abcdefg"[t] for t in prompt)  # text prompts too
        n = rng.randint(5, 40)
        if i % 2 == 0:
            kw = dict(max_tokens=n, temperature=0)
            jobs.append((prompt, kw, ref(prompt, **kw)))
        else:
            kw = dict(
                max_tokens=n,
                temperature=rng.choice([0.7, 1.0, 1.3]),
                top_p=rng.choice([0.8, 1.0]),
                top_k=rng.choice([0, 3]),
                seed=i,
                ignore_eos=True,
            )
            jobs.append((prompt, kw, None))
    results: list = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def worker(i: int) -> None:
        prompt, kw, _ = jobs[i]
        barrier.wait()
        results[i] = list(srv.client.generate(prompt, **kw))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (prompt, kw, want), chunks in zip(jobs, results):
        assert chunks, f"no result for {prompt!r}"
        ids = [t for c in chunks for t in c.token_ids]
        if want is not None:
            assert ids == want.token_ids and "".join(c.text for c in chunks) == want.text
            assert chunks[-1].finish_reason == want.finish_reason
        else:
            assert len(ids) == kw["max_tokens"] and chunks[-1].finish_reason == "length"
            assert all(0 <= t < 8 for t in ids)
        assert chunks[-1].stats.output_tokens == len(ids)
    assert max(len(c) for c in results) > 2  # really streamed, step by step
    wait_idle(srv.client)


def test_coordinator_streaming_api(srv, loop_thread, ref):
    """The asyncio API itself (``open`` and its stream): a full stream, an early close (aborts), a duplicate id."""
    from specdist.api.refusals import DuplicateRequestId
    from specdist.errors import InvalidArgument

    coord = srv.coordinator

    async def scenario():
        deltas = await collect(coord, [2, 3], SamplingParams(max_tokens=9, temperature=0))
        early = await coord.open([4], SamplingParams(max_tokens=60, ignore_eos=True), request_id="early")
        await early.__anext__()  # after its first step "early" is held: it is live for the checks below
        with pytest.raises(DuplicateRequestId):
            await coord.open([4], request_id="early")
        early.close()
        with pytest.raises(InvalidArgument, match="^prompt"):
            await coord.open([99])
        return deltas

    srv.gate.hold_when = running_ids("early")
    try:
        deltas = loop_thread.run(scenario())
    finally:
        srv.gate.hold_when = None
    want = ref([2, 3], max_tokens=9, temperature=0)
    assert [t for d in deltas for t in d.token_ids] == want.token_ids and deltas[-1].finish_reason == want.finish_reason
    assert deltas[-1].metrics.output_tokens == len(want.token_ids)
    wait_idle(srv.client)


def test_remote_generate_cli(srv, ref, capsys):
    from specdist.api.remote_generate import run_remote_generate

    assert run_remote_generate(srv.address, "a b", dict(max_tokens=8, temperature=0), raw=False) == 0
    out = capsys.readouterr()
    assert out.out == ref("a b g", max_tokens=8, temperature=0).text + "\n"  # chat template applied
    assert "tokens=" in out.err and "finish=" in out.err


# ---------------------------------------------------------------- cancellation


def test_cancel_and_disconnect_free_everything(srv, ref):
    before = srv.client.server_info().counters
    # A "cancel-" request cannot finish before its client cancels it: once it holds 50 of its
    # 60 tokens (>= 13 steps, so >= 13 chunks: more than its client reads first) the engine
    # stops advancing until the abort has run. Disconnects land wherever they land.
    cancel_ids = [f"cancel-{i}" for i in range(0, 24, 2)]
    srv.gate.hold_when = lambda eng: any(
        client_id(r.request_id) in cancel_ids and len(r.output.token_ids) >= 50 for r in eng.running
    )
    rng = random.Random(1)
    outcomes: list = [None] * 24

    def via_cancel(i: int, after: int) -> None:
        rid = f"cancel-{i}"
        gen = srv.client.generate([i % 7, 3], max_tokens=60, temperature=1.0, seed=i, ignore_eos=True, request_id=rid)
        chunks = [next(gen) for _ in range(after)]
        srv.client.cancel(rid)
        chunks += list(gen)
        outcomes[i] = chunks[-1].finish_reason

    def via_disconnect(i: int, after: int, jitter: float) -> None:
        req = specdist_pb2.GenerateRequest(token_ids=specdist_pb2.TokenIds(ids=[i % 7]), request_id=f"drop-{i}")
        req.params.max_tokens, req.params.ignore_eos = 60, True
        call = srv.stub.Generate(req)
        for _ in range(after):
            next(call)
        time.sleep(jitter)  # where the disconnect lands varies on purpose; any outcome is right
        call.cancel()
        outcomes[i] = "dropped"

    threads = []
    for i in range(24):
        if i % 2 == 0:
            threads.append(threading.Thread(target=via_cancel, args=(i, rng.randint(1, 6))))
        else:
            threads.append(threading.Thread(target=via_disconnect, args=(i, rng.randint(0, 6), rng.random() * 0.01)))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        srv.gate.hold_when = None
    assert outcomes[0::2] == ["abort"] * 12 and outcomes[1::2] == ["dropped"] * 12, outcomes
    after = wait_idle(srv.client)
    assert after["requests_total"] - before["requests_total"] >= 12  # a dropped call may never reach the server
    ended = sum(after[k] - before[k] for k in ("requests_finished", "requests_cancelled", "requests_failed"))
    assert ended == after["requests_total"] - before["requests_total"]
    check_against_engine(srv.client, ref, "b a d", max_tokens=20, temperature=0)


def test_request_ids_belong_to_their_caller(srv):
    """Another client (its own connection) can neither cancel a request by its id nor learn that the id is live
    (ALREADY_EXISTS): ids are scoped to the caller's connection. The owner cancels its own. (Channels of one process
    share gRPC's connection unless told otherwise: the other client's is its own, as another process's is.)"""
    other = SpecDistClient(grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)]))
    live = lambda: srv.coordinator.counters()["live_requests"]  # noqa: E731 - (a racy read of a dict size: fine)
    try:
        # one: the other client cannot cancel it; its owner can
        srv.gate.hold_when = lambda eng: any(len(r.output.token_ids) >= 3 for r in eng.running)
        gen = srv.client.generate([1, 2], max_tokens=40, temperature=0, ignore_eos=True, request_id="mine")
        assert next(gen).request_id == "mine"
        with pytest.raises(RemoteError) as e:
            other.cancel("mine")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        srv.client.cancel("mine")
        assert list(gen)[-1].finish_reason == "abort"
        # two: the same id from the other client is its own request, admitted beside the first's
        gen = srv.client.generate([1, 2], max_tokens=40, temperature=0, ignore_eos=True, request_id="dup")
        next(gen)
        theirs: list = []
        t = threading.Thread(
            target=lambda: theirs.extend(
                _outcome(lambda: list(other.generate([3, 1], max_tokens=2, temperature=0, request_id="dup")))
            )
        )
        t.start()
        wait_until("the other client's request admitted (or refused)", lambda: live() == 2 or theirs, 10)
        srv.gate.hold_when = None
        t.join(30)
        assert theirs and not isinstance(theirs[0], Exception), theirs
        assert theirs[-1].finish_reason == "length" and theirs[-1].request_id == "dup"
        assert list(gen)[-1].finish_reason == "length"
    finally:
        srv.gate.hold_when = None
        other.close()
    wait_idle(srv.client)


def _outcome(fn) -> list:
    """fn()'s result, or [the exception it raised]."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return [e]


def test_cancel_unknown_id(srv):
    with pytest.raises(RemoteError) as e:
        srv.client.cancel("no-such-request")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(RemoteError) as e:
        srv.client.cancel("")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.message


# ---------------------------------------------------------------- bad input


def _req(**kw) -> specdist_pb2.GenerateRequest:
    params = kw.pop("params", {})
    return specdist_pb2.GenerateRequest(params=common_pb2.SamplingParams(**params), **kw)


def _ids(*ids: int) -> specdist_pb2.TokenIds:
    return specdist_pb2.TokenIds(ids=list(ids))


BAD_REQUESTS = [
    ("prompt", _req()),
    ("prompt", _req(text="")),
    ("prompt", _req(token_ids=_ids())),
    ("prompt", _req(token_ids=_ids(1, 8))),
    ("prompt", _req(token_ids=_ids(-1))),
    ("prompt", _req(token_ids=_ids(*[1] * 64))),
    ("prompt", _req(text=" ".join(["a"] * 70))),
    ("params.temperature", _req(text="a", params=dict(temperature=-1))),
    ("params.temperature", _req(text="a", params=dict(temperature=math.nan))),
    ("params.temperature", _req(text="a", params=dict(temperature=math.inf))),
    ("params.top_p", _req(text="a", params=dict(top_p=0))),
    ("params.top_p", _req(text="a", params=dict(top_p=1.5))),
    ("params.top_p", _req(text="a", params=dict(top_p=math.nan))),
    ("params.top_k", _req(text="a", params=dict(top_k=-1))),
    ("params.max_tokens", _req(text="a", params=dict(max_tokens=0))),
    ("params.max_tokens", _req(text="a", params=dict(max_tokens=-5))),
    ("params.stop", _req(text="a", params=dict(stop=["c", ""]))),
    ("params.stop_token_ids", _req(text="a", params=dict(stop_token_ids=[3, -1]))),
    ("apply_chat_template", _req(token_ids=_ids(1, 2), apply_chat_template=True)),
    ("request_id", _req(text="a", request_id="x" * 300)),
]


def test_bad_input_matrix(srv, ref):
    before = srv.client.server_info().counters
    for field, request in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError) as e:
            list(srv.stub.Generate(request))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, request)
        assert e.value.details().startswith(f"{field}: "), (field, e.value.details())

    # a request id in use by a live request: ALREADY_EXISTS (specdist.proto), naming request_id
    srv.gate.open_event.clear()  # hold the first request live
    try:
        first = srv.client.generate([1], max_tokens=5, temperature=0, request_id="dup")
        holder = threading.Thread(target=lambda: list(first))
        holder.start()
        wait_for(lambda: srv.client.server_info().counters["requests_total"] > before["requests_total"])
        with pytest.raises(RemoteError) as e:
            srv.client.generate_text([2], request_id="dup")
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and e.value.message.startswith("request_id: ")
    finally:
        srv.gate.open_event.set()
    holder.join(10)

    after = wait_idle(srv.client)
    assert after["requests_total"] == before["requests_total"] + 1  # refused requests are never admitted
    assert after["requests_failed"] == before["requests_failed"]
    for prompt in ("c c", [4, 1]):
        check_against_engine(srv.client, ref, prompt, max_tokens=15, temperature=0)


# ---------------------------------------------------------------- failures, admission, drain


def test_failed_step_fails_only_the_batch(srv, loop_thread, ref):
    """A step fails with 8 requests running (max_batch_size) and 2 waiting: the 8 end with
    FINISH_REASON_ERROR and INTERNAL, the 2 waiting ones run to the end.

    The shape is made certain: the gate is closed, request 0 is added and the engine thread
    waits at the gate in the step that admits it; the other 9 are then queued behind that
    step (live_requests == 10). Opening the gate runs that step (0 running, 1 waiting), the
    9 adds, the step that admits 7 more (1 running, 9 waiting), and then the first step with
    8 running and 2 waiting: the one that fails. The requests need 50 tokens (>= 13 steps)
    and none finishes before.
    """
    results: list = [None] * 10

    def worker(i: int) -> None:
        chunks = []
        try:
            for c in srv.client.generate([i % 7], max_tokens=50, ignore_eos=True, seed=i):
                chunks.append(c)
            results[i] = chunks[-1].finish_reason
        except RemoteError as e:
            results[i] = (e.code, chunks[-1].finish_reason if chunks else None)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    srv.gate.open_event.clear()
    try:
        threads[0].start()
        wait_for(srv.gate.blocked.is_set)
        for t in threads[1:]:
            t.start()
        wait_for(lambda: coordinator_counters(loop_thread, srv.coordinator)["live_requests"] == 10)
        srv.gate.fail_when = lambda eng: len(eng.running) == 8 and len(eng.waiting) == 2
        srv.gate.open_event.set()
        for t in threads:
            t.join(60)
        assert srv.gate.fail_when is None, "no step ran with 8 running and 2 waiting"
    finally:
        srv.gate.fail_when = None
        srv.gate.open_event.set()
    assert results.count((grpc.StatusCode.INTERNAL, "error")) == 8, results
    assert results.count("length") == 2, results
    wait_idle(srv.client)
    check_against_engine(srv.client, ref, "e f", max_tokens=10, temperature=0)


def test_admission_and_graceful_stop(loop_thread, tiny_models, ref, capsys):
    from specdist.api.remote_generate import run_remote_generate

    s = start_server(loop_thread, tiny_models, max_queued=2, drain_seconds=60)  # a deadline, not a wait
    try:
        with pytest.raises(RemoteError) as e:  # no chat template on this model
            s.client.generate_text("a", apply_chat_template=True)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("apply_chat_template")
        assert run_remote_generate(s.address, "a", dict(max_tokens=5, temperature=0), raw=False) == 0
        assert capsys.readouterr().out == ref("a", max_tokens=5, temperature=0).text + "\n"  # raw, like local

        s.gate.hold_when = lambda eng: True  # the two requests below stay live until cancelled

        outcomes = {}

        def run(rid: str, n: int) -> None:
            try:
                outcomes[rid] = s.client.generate_text([1], max_tokens=n, ignore_eos=True, request_id=rid)[2]
            except RemoteError as err:
                outcomes[rid] = err.code

        slow = [threading.Thread(target=run, args=(f"slow-{i}", 60)) for i in range(2)]
        for t in slow:
            t.start()

        def both_live() -> bool:  # requests_total also counts the earlier request, so watch the gauges
            c = s.client.server_info().counters
            return c["running_requests"] + c["queued_requests"] == 2

        wait_for(both_live)
        with pytest.raises(RemoteError) as e:
            s.client.generate_text([2], max_tokens=2)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        for rid in ("slow-0", "slow-1"):
            s.client.cancel(rid)
        for t in slow:
            t.join(10)
        assert outcomes == {"slow-0": "abort", "slow-1": "abort"}
        s.gate.hold_when = None
        wait_idle(s.client)

        # graceful stop: NOT_SERVING, new requests refused, the running one finishes normally.
        # "short" runs one step (at most 4 of its 6 tokens), then is held until the checks are done.
        s.gate.hold_when = running_ids("short")
        short = threading.Thread(target=run, args=("short", 6))
        short.start()
        wait_for(lambda: s.client.server_info().counters["running_requests"] == 1)
        stopping = asyncio.run_coroutine_threadsafe(s.server.stop(), loop_thread.loop)
        wait_for(lambda: s.client.health() == "NOT_SERVING")
        with pytest.raises(RemoteError) as e:
            s.client.generate_text([2], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert "short" not in outcomes  # still running, held
        s.gate.hold_when = None
        stopping.result(30)
        short.join(10)
        assert outcomes["short"] == "length"
    finally:
        s.gate.hold_when = None
        loop_thread.run(s.server.stop())
        s.channel.close()
