"""A draft replica that fails is ejected, its requests go on without drafts (exact output), new
requests avoid it, and it is re-admitted once it answers a probe (specdist/engine/draft_pool.py)."""

from __future__ import annotations

import pytest
from support.helpers import healthy_replicas, set_scheduler_clock, tiny_config

from specdist.engine.local import Engine
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import TransportError

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2], [3, 3, 3]]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


class Flaky:
    """A drafter transport that fails every call (as a dead or hung worker does) while ``down``."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.is_remote, self.hidden_layers = inner.name, inner.is_remote, inner.hidden_layers
        self.down = False
        self.calls = {"start": 0, "propose": 0, "release": 0}

    def _check(self, method: str, ids: list[str]) -> None:
        self.calls[method] += 1
        if self.down:
            raise TransportError("UNAVAILABLE: draft worker unreachable", ids, "UNAVAILABLE")

    def start(self, items):
        self._check("start", [it.request_id for it in items])
        return self.inner.start(items)

    def propose(self, items):
        self._check("propose", [it.request_id for it in items])
        return self.inner.propose(items)

    def release(self, request_ids):
        self._check("release", request_ids)
        self.inner.release(request_ids)

    def close(self):
        self.inner.close()


def engine(models, flaky: bool):
    eng = Engine.from_config(tiny_config(models, method="model", k=3))
    if flaky:
        eng.scheduler.replicas[0].drafter = Flaky(eng.scheduler.replicas[0].drafter)
    return eng


def fault_free(models) -> list[list[int]]:
    """The greedy outputs of PROMPTS without faults."""
    want = engine(models, False)
    try:
        return [o.token_ids for o in want.generate(PROMPTS, GREEDY)]
    finally:
        want.close()


def test_a_failing_replica_is_ejected_and_readmitted(models, monkeypatch) -> None:
    expected = fault_free(models)

    eng = engine(models, True)
    flaky = eng.scheduler.replicas[0].drafter
    t = [1000.0]
    set_scheduler_clock(monkeypatch, t)  # the probe schedule on a clock of our own
    try:
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        eng.step()
        eng.step()
        assert eng.stats.drafted > 0
        flaky.down = True  # the worker dies mid-generation
        while any(not r.finished for r in reqs):
            eng.step()
        assert [r.output.token_ids for r in reqs] == expected  # greedy: exact, without drafts after the fault
        assert all(r.finished and r.output.finish_reason == "length" and r.error is None for r in reqs)
        assert healthy_replicas(eng) == 0
        # new requests decode without drafts while it is down; the probe before 0.5 s is not sent
        probes = flaky.calls["release"]
        late = eng.add_request(PROMPTS[0], GREEDY)
        eng.step()
        assert late.replica is None and flaky.calls["release"] == probes
        t[0] += 0.6
        eng.step()  # due: a probe goes out (on the probe thread) and fails
        eng.scheduler.pool.probes[0][0].exception(timeout=30)  # wait for the probe itself
        eng.step()  # its failure is read: backoff to 1 s
        assert flaky.calls["release"] == probes + 1 and healthy_replicas(eng) == 0 and not eng.scheduler.pool.probes
        flaky.down = False  # restarted
        t[0] += 0.5
        eng.step()  # not yet due
        assert healthy_replicas(eng) == 0 and not eng.scheduler.pool.probes
        t[0] += 0.6
        eng.step()  # due: probed
        eng.scheduler.pool.probes[0][0].exception(timeout=30)
        eng.step()  # answered: re-admitted
        assert healthy_replicas(eng) == 1
        while not late.finished:
            eng.step()
        assert late.output.token_ids == expected[0]
        again = eng.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in again] == expected[:2]
        assert all(o.metrics.drafted > 0 and o.metrics.accepted > 0 for o in again)  # it drafts again
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
        # what the failed releases left on the worker was released by the probe that re-admitted it
        assert eng.draft_core.requests == {} and eng.draft_core.kv_slots_in_use() == 0
    finally:
        eng.close()


@pytest.mark.slow
def test_a_hung_draft_worker_is_left_behind_after_its_deadline(models, monkeypatch) -> None:
    """Over gRPC: the draft worker stops answering (its Propose blocks, as a SIGSTOPped process
    would); the call fails at its deadline (DEADLINE_FLOOR_S, set to 0.5 s here), the replica is
    ejected and the requests finish without drafts, exactly; once it answers again, a probe
    re-admits it and new requests draft."""
    import threading

    from support.helpers import remote_engine_like

    from specdist.transport import remote

    monkeypatch.setattr(remote, "DEADLINE_FLOOR_S", 0.5)
    expected = fault_free(models)
    local = engine(models, False)
    core = local.draft_core
    hang, entered = threading.Event(), threading.Event()
    propose = core.propose

    def stuck_propose(items):
        if hang.is_set():
            entered.set()
            for _ in range(6000):  # held until the test clears hang (at most 60 s)
                if not hang.is_set():
                    break
                threading.Event().wait(0.01)
        return propose(items)

    core.propose = stuck_propose
    eng, served = remote_engine_like(local)
    try:
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        for _ in range(3):
            eng.step()
        assert eng.stats.drafted > 0
        assert eng.scheduler.replicas[0].drafter.deadline("Propose") == 0.5
        hang.set()
        while any(not r.finished for r in reqs):
            eng.step()
        assert entered.is_set() and healthy_replicas(eng) == 0
        assert [r.output.token_ids for r in reqs] == expected and all(r.error is None for r in reqs)
        hang.clear()  # it answers again (the blocked call returns to nobody)
        for _ in range(300):  # the probe is due 0.5 s after the ejection: poll on the state
            if healthy_replicas(eng) == 1:
                break
            eng.step()
            threading.Event().wait(0.01)
        assert healthy_replicas(eng) == 1
        again = eng.generate(PROMPTS[:2], GREEDY)
        assert [o.token_ids for o in again] == expected[:2] and all(o.metrics.drafted > 0 for o in again)
        assert core.requests == {} and core.kv_slots_in_use() == 0  # the probe released what moved on
    finally:
        hang.clear()
        eng.close()
        served.close()
