"""The parts of the scheduler, driven without a model: the draft pool (specdist/engine/draft_pool.py:
choice, ejection, probing, readmission, release retries), the pending releases of a core
(specdist/engine/calls.py), the output processor (specdist/engine/output_processor.py: stops, stats, events)
and the engine as the holder of a scheduler (specdist/engine/base.py)."""

from __future__ import annotations

import logging

import pytest
from support.helpers import set_scheduler_clock

from specdist.config import load_config
from specdist.engine.base import EngineBase, _OfScheduler
from specdist.engine.calls import RELEASE_RETRY_FIRST_S, PendingReleases, call_isolating
from specdist.engine.draft_pool import PROBE_FIRST_S, DraftPool
from specdist.engine.output_processor import EngineStats, OutputProcessor, RequestFinished
from specdist.engine.request import Request
from specdist.engine.scheduler import Scheduler
from specdist.errors import ErrorCode, InvalidArgument
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import CallTiming, Prefilled, Proposal, TransportError, Verified

EOS = 7


class FakeDrafter:
    """A drafter transport that only releases: every call fails (UNAVAILABLE, as a dead worker's)
    while ``down``; ``held``: the ids it was started with and not yet released."""

    is_remote = False
    hidden_layers = ()

    def __init__(self, name: str = "draft"):
        self.name = name
        self.down = False
        self.held: set[str] = set()
        self.releases: list[list[str]] = []
        self.cuts = 0

    def release(self, request_ids):
        self.releases.append(list(request_ids))
        if self.down:
            raise TransportError("worker unreachable", list(request_ids), ErrorCode.UNAVAILABLE)
        self.held.difference_update(request_ids)

    def cut(self):
        self.cuts += 1

    def close(self):
        pass


def unmeasured(replica: int, requests: int) -> float:
    """The draft-length rule's prediction of a full draft before any measurement: 0 s on every replica."""
    return 0.0


@pytest.fixture
def clock(monkeypatch):
    t = [1000.0]
    set_scheduler_clock(monkeypatch, t)
    return t


def pool_of(*drafters, max_batch_size: int = 2) -> DraftPool:
    return DraftPool(list(drafters), max_batch_size, call_isolating)


def wait_for_probe(pool: DraftPool, i: int) -> None:
    future, _ = pool.probes[i]
    future.exception(timeout=30)


# ---------------------------------------------------------------- the draft pool
def test_unmeasured_replicas_take_new_requests_by_load(clock) -> None:
    pool = pool_of(FakeDrafter("a"), FakeDrafter("b"))
    room = pool.room()
    assert room == [2, 2]
    assert [pool.choose(room, unmeasured) for _ in range(4)] == [0, 1, 0, 1]
    assert room == [0, 0] and pool.waits_for_room(room)  # healthy replicas, none with room: wait
    pool.eject(1, "down")
    assert pool.choose(pool.room(), unmeasured) == 0  # only the healthy one takes requests
    pool.eject(0, "down")
    assert pool.choose(pool.room(), unmeasured) is None and not pool.waits_for_room(pool.room())  # no drafts


def test_an_ejected_replica_is_probed_with_backoff_and_readmitted_when_it_answers(clock) -> None:
    drafter = FakeDrafter()
    pool = pool_of(drafter)
    drafter.down = True
    pool.release(0, ["x", "y"])  # a failed release: kept, and the probe's to release
    pool.eject(0, "whole call failed")
    assert pool.replicas[0].ejected_at == clock[0] and pool.choose(pool.room(), unmeasured) is None
    calls = len(drafter.releases)
    pool.retry_releases()  # an ejected replica's releases are its probe's
    pool.probe()  # not yet due
    assert len(drafter.releases) == calls and not pool.probes
    clock[0] += PROBE_FIRST_S + 0.1
    pool.probe()  # due: a probe (the release of what it still owes) on the probe thread, which fails
    wait_for_probe(pool, 0)
    pool.probe()  # its failure read: the next probe backs off to twice the first
    assert drafter.releases[-1] == ["x", "y"] and not pool.probes
    assert pool.replicas[0].ejected_at is not None and pool.replicas[0].probe_backoff == 2 * PROBE_FIRST_S
    drafter.down = False  # back
    clock[0] += PROBE_FIRST_S + 0.1
    pool.probe()  # not due yet (backed off)
    assert not pool.probes
    clock[0] += PROBE_FIRST_S
    pool.probe()
    wait_for_probe(pool, 0)
    pool.probe()  # answered: re-admitted, nothing owed
    assert pool.replicas[0].ejected_at is None and pool.replicas[0].orphans.ids == set()
    assert pool.choose(pool.room(), unmeasured) == 0
    assert pool.per_replica([len(rep.orphans.ids) for rep in pool.replicas]) == {"draft": 0}
    pool.close()


def test_a_replica_reported_down_is_not_called_until_readmitted(clock) -> None:
    drafter = FakeDrafter()
    pool = pool_of(drafter)
    pool.replica_down(0, "the supervisor found it dead")
    assert drafter.cuts == 1 and pool.replicas[0].down and pool.replicas[0].ejected_at is not None
    pool.release(0, ["a"])  # not called: owed, for its probe
    assert drafter.releases == [] and pool.replicas[0].orphans.ids == {"a"}
    drafter.down = True
    assert not pool.readmit(0)  # restarted but not answering: still ejected
    drafter.down = False
    assert pool.readmit(0, "host:1")
    assert drafter.releases[-1] == ["a"] and not pool.replicas[0].down and pool.replicas[0].ejected_at is None
    assert pool.replicas[0].orphans.ids == set()


def test_release_requests_counts_per_replica() -> None:
    pool = pool_of(FakeDrafter("a"), FakeDrafter("b"))

    class Req:
        def __init__(self, core_id, replica):
            self.core_id, self.replica, self.on_drafter = core_id, replica, True

    reqs = [Req("r0", 0), Req("r1", 1), Req("r2", 1)]
    for r in reqs:
        pool.replicas[r.replica].live += 1
    assert pool.per_replica([rep.live for rep in pool.replicas]) == {"draft": 3, "draft/0": 1, "draft/1": 2}
    pool.release_requests(reqs)
    assert [d.drafter.releases for d in pool.replicas] == [[["r0"]], [["r1", "r2"]]]  # one call per replica
    assert [rep.live for rep in pool.replicas] == [0, 0] and not any(r.on_drafter for r in reqs)


# ---------------------------------------------------------------- pending releases
def test_a_failed_release_is_retried_when_due_with_backoff(clock) -> None:
    drafter = FakeDrafter()
    pending = PendingReleases()
    drafter.down = True
    pending.release(drafter, ["a", "b"], call_isolating)
    assert pending.ids == {"a", "b"} and pending.due == clock[0] + RELEASE_RETRY_FIRST_S
    pending.retry(drafter, call_isolating)  # not due
    assert len(drafter.releases) == 1
    clock[0] += RELEASE_RETRY_FIRST_S
    pending.retry(drafter, call_isolating)  # due, fails again: backs off x2
    assert len(drafter.releases) == 2 and pending.backoff == 2 * RELEASE_RETRY_FIRST_S
    drafter.down = False
    clock[0] += 2 * RELEASE_RETRY_FIRST_S
    pending.retry(drafter, call_isolating)  # one call releases them all
    assert drafter.releases[-1] == ["a", "b"] and pending.ids == set()
    pending.retry(drafter, call_isolating, force=True)  # nothing owed: no call
    assert len(drafter.releases) == 3


def test_a_release_the_core_refuses_is_not_retried(clock) -> None:
    class Gone(FakeDrafter):
        def release(self, request_ids):
            self.releases.append(list(request_ids))
            raise TransportError("unknown request", list(request_ids), ErrorCode.NOT_FOUND)

    drafter = Gone()
    pending = PendingReleases()
    pending.release(drafter, ["a"], call_isolating)
    assert pending.ids == set()


# ---------------------------------------------------------------- the output processor
@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from support.model_zoo import save_word_tokenizer
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("words"))
    save_word_tokenizer(path, 16)
    return AutoTokenizer.from_pretrained(path)


def processor(tokenizer=None, max_model_len: int = 32) -> tuple[OutputProcessor, list]:
    events: list = []
    return OutputProcessor(EngineStats(), [events.append], tokenizer, frozenset({EOS}), max_model_len), events


def request(proc: OutputProcessor, params: SamplingParams, prompt=(1, 2)) -> Request:
    return Request("r", None, list(prompt), params, proc.output_state(params))


def test_a_stop_string_ends_the_request_and_the_stats_count_what_it_kept(word_tokenizer) -> None:
    proc, events = processor(word_tokenizer)
    r = request(proc, SamplingParams(max_tokens=20, stop=["c d"]))
    step = proc.apply(r, Proposal("r", [0, 1]), 2, 2)  # "a b" accepted, then "c"
    assert not r.finished and step.drafted == 2 and step.accepted == 2 and step.kept == 3
    step = proc.apply(r, Proposal("r", [3, 4, 5]), 1, 6)  # "d" completes the stop string: the rest is not kept
    assert r.finished and r.output.finish_reason == "stop" and r.output.stop_reason == "c d"
    assert r.output.text == "a b " and r.output.token_ids == [0, 1, 2, 3]
    assert (step.drafted, step.accepted, step.kept) == (1, 1, 1)  # the draft past the stop did not count
    s = proc.stats
    assert (s.drafted, s.accepted, s.emitted) == (3, 3, 4)
    assert (r.metrics.steps, r.metrics.drafted, r.metrics.accepted, r.metrics.emitted) == (2, 3, 3, 4)
    assert r.metrics.first_token_time is not None
    proc.report_finished(proc.stamp_finish([r]))
    [finished] = events
    assert isinstance(finished, RequestFinished) and finished.finish_reason == "stop"
    assert finished.metrics.output_tokens == 4 and finished.metrics.finish_time is not None
    assert proc.stamp_finish([r]) == []  # once


def test_a_stop_token_ends_the_request_and_counts_as_emitted() -> None:
    proc, _ = processor()
    r = request(proc, SamplingParams(max_tokens=20))
    step = proc.apply(r, None, 0, EOS)  # no drafts; the target's token is EOS
    assert r.output.finish_reason == "stop" and r.output.token_ids == []
    assert (step.drafted, step.emitted, step.kept) == (0, 1, 0) and proc.stats.emitted == 0


def test_the_context_limit_ends_the_request() -> None:
    proc, _ = processor(max_model_len=5)
    r = request(proc, SamplingParams(max_tokens=20, ignore_eos=True), prompt=(1, 2, 3))
    proc.apply(r, Proposal("r", [4]), 1, 5)
    assert r.output.finish_reason == "length" and r.seq_len == 5


def test_stop_strings_need_a_tokenizer_and_errors_end_requests() -> None:
    proc, _ = processor()
    with pytest.raises(InvalidArgument, match="stop strings need a model with a tokenizer"):
        proc.output_state(SamplingParams(stop=["x"]))
    r = request(proc, SamplingParams())
    proc.fail(r, "target: down", ErrorCode.UNAVAILABLE)
    assert r.output.finish_reason == "error" and r.error == "target: down" and r.error_code == ErrorCode.UNAVAILABLE


def test_a_listener_that_raises_is_logged_and_the_others_still_hear(caplog) -> None:
    proc, events = processor()

    def broken(event):
        raise RuntimeError("listener bug")

    proc.listeners.insert(0, broken)
    with caplog.at_level(logging.ERROR, logger="specdist.engine.output_processor"):
        proc.emit(RequestFinished("r", "stop", None))
    assert len(events) == 1 and "listener bug" in caplog.text


# ---------------------------------------------------------------- the engine holds a scheduler
class FakeTarget:
    """A verifier that accepts no drafts and emits token 5."""

    vocab_size = 16
    is_remote = False
    name = "target"

    def prefill(self, items):
        return [Prefilled(it.request_id) for it in items], CallTiming()

    def verify(self, items):
        return [Verified(it.request_id, 0, 5) for it in items], CallTiming()

    def release(self, request_ids):
        pass

    def close(self):
        pass


class FakeEngine(EngineBase):
    def __init__(self):
        cfg = load_config({"draft": {"method": "none"}, "engine": {"max_model_len": 32, "device": "cpu"}})
        self.scheduler = Scheduler(cfg, FakeTarget(), eos_ids=[EOS])


def test_an_engine_is_its_schedulers_api() -> None:
    seen: list = []
    with FakeEngine() as eng:
        assert isinstance(eng, FakeEngine) and not isinstance(eng, Scheduler)
        eng.listeners.append(seen.append)
        eng.target_diagnosis = lambda: "rank 1 died"  # written through to the scheduler
        assert eng.scheduler.target_diagnosis() == "rank 1 died"
        [out] = eng.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert out.token_ids == [5, 5, 5] and eng.stats.steps == 3 and eng.kv_slots_in_use() == {"target": 0}
        assert len(seen) == 4  # three StepEvents, one RequestFinished
        assert "".join(eng.stream([1], SamplingParams(max_tokens=2, ignore_eos=True))) == ""
        assert eng.last_output.token_ids == [5, 5]


def test_the_engine_forwards_what_the_layers_above_use() -> None:
    """The engine forwards the scheduler's names that the coordinator, the servers, a deployment's watcher and
    the metrics use (each still a name of the scheduler); its parts, its transports and the settings only the
    step reads are reached through ``engine.scheduler``."""
    sched = FakeEngine().scheduler
    public = {n for n in dir(sched) if not n.startswith("_")}
    forwarded = {n for n, v in vars(EngineBase).items() if isinstance(v, _OfScheduler)}
    assert forwarded <= public
    assert public - set(dir(EngineBase)) == {
        "pool",
        "output",
        "admit",
        "abort_requests",
        "verifier",
        "replicas",
        "eos_ids",
        "max_batch_size",
        "max_prefill_tokens",
        "length_policy",
        "coupling",
    }


def test_a_core_out_of_room_from_an_item_on_takes_the_ones_before_it() -> None:
    """check_room's contract (``items[n]``: the first n fit): those are retried alone and start; the rest fail
    RESOURCE_EXHAUSTED (requeued by the scheduler). Item 0 out of room fails the whole call, as before."""
    calls = []

    def start(items):
        calls.append(list(items))
        if len(items) > 2:
            raise TransportError("items[2]: no room", [], ErrorCode.RESOURCE_EXHAUSTED, item=2)
        return [f"ok {it}" for it in items], CallTiming()

    results, failed, _, _ = call_isolating(start, ["a", "b", "c", "d"])
    assert results == ["ok a", "ok b"] and sorted(failed) == [2, 3]
    assert all(e.code == ErrorCode.RESOURCE_EXHAUSTED for e in failed.values())
    assert calls == [["a", "b", "c", "d"], ["a", "b"]]

    def full(items):
        raise TransportError("items[0]: no room", [], ErrorCode.RESOURCE_EXHAUSTED, item=0)

    results, failed, _, _ = call_isolating(full, ["a", "b"])
    assert results is None and sorted(failed) == [0, 1]


def test_a_draft_cache_holding_fewer_sequences_than_the_batch_still_admits(tiny_models) -> None:
    """A paged draft cache with room for two requests' reservations out of four: two start, the others wait for
    their room, and every request ends with the tokens a roomy engine gives (before: all four requeued every
    step, none ever started)."""
    from support.helpers import tiny_config

    from specdist import Engine, SamplingParams

    def run(**engine):
        eng = Engine.from_config(
            tiny_config(tiny_models, k=3, max_batch_size=4, max_model_len=64, kv_cache="paged", **engine)
        )
        reqs = [
            eng.add_request([1, 2, 3, 4, 5 + i % 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            for i in range(4)
        ]
        for _ in range(200):  # bounded: a livelock fails below instead of hanging
            if not (eng.running or eng.waiting):
                break
            eng.step()
        assert not eng.running and not eng.waiting, (len(eng.running), len(eng.waiting))
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
        return [r.output.token_ids for r in reqs]

    assert run(kv_cache_tokens=144) == run()
