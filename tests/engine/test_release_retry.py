"""A release that failed is not forgotten (specdist/engine/calls.py): the ids stay pending per core and
are released again (batched, with a bounded backoff) until the core answers, so a target or draft
worker that was briefly unavailable does not keep the KV slots for good, and requests queued behind
them are still admitted (no RESOURCE_EXHAUSTED requeue loop)."""

from __future__ import annotations

import pytest
from support.helpers import healthy_replicas, set_scheduler_clock, tiny_config

from specdist.api.metrics import Metrics
from specdist.engine.calls import RELEASE_RETRY_MAX_S
from specdist.engine.local import Engine
from specdist.errors import ErrorCode
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import TransportError

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2], [3, 3, 3], [2, 6], [5, 1, 4]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MAX_STEPS = 400  # far more than the run needs; the old code requeued forever


class FailingRelease:
    """Wraps a transport's ``release``: the first ``fail`` calls (or every call while ``down``) raise
    TransportError(``code``), as a worker that is briefly unreachable or a call past its deadline does."""

    def __init__(self, release, fail: int = 0, code: ErrorCode = ErrorCode.UNAVAILABLE):
        self.inner = release
        self.fail = fail
        self.code = code
        self.down = False
        self.calls: list[list[str]] = []

    def __call__(self, request_ids):
        self.calls.append(list(request_ids))
        if self.down or len(self.calls) <= self.fail:
            raise TransportError("worker unreachable", request_ids, self.code)
        self.inner(request_ids)


@pytest.fixture
def clock(monkeypatch):
    """The scheduler's clock, advanced by the test (the retry schedule without sleeps)."""
    t = [1000.0]
    set_scheduler_clock(monkeypatch, t)
    return t


def make_engine(tiny_models, method: str = "model", max_batch_size: int = 2) -> Engine:
    return Engine.from_config(tiny_config(tiny_models, method=method, k=3, max_batch_size=max_batch_size))


def run(eng: Engine, clock, reqs, step_s: float = 0.25) -> int:
    """Step until every request finished (at most MAX_STEPS). Returns the steps taken."""
    for n in range(MAX_STEPS):
        if all(r.finished for r in reqs):
            return n
        eng.step()
        clock[0] += step_s
    waiting = sum(r.queued for r in reqs)
    raise AssertionError(
        f"no progress after {MAX_STEPS} steps: {waiting} requests never admitted, "
        f"target core holds {eng.target_core.kv_slots_in_use()} slots "
        f"for {sorted(eng.target_core.requests)}"
    )


def settle(eng: Engine, clock, cond, step_s: float = 1.0) -> None:
    """Step an idle engine (retries are due at the start of a step) until ``cond()``, bounded."""
    for _ in range(200):
        if cond():
            return
        eng.step()
        clock[0] += step_s
    assert cond()


def fault_free(tiny_models) -> list[list[int]]:
    eng = make_engine(tiny_models)
    try:
        return [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    finally:
        eng.close()


def test_failed_target_releases_are_retried_and_later_requests_still_admitted(tiny_models, clock) -> None:
    expected = fault_free(tiny_models)
    eng = make_engine(tiny_models)
    flaky = FailingRelease(eng.scheduler.verifier.release, fail=3)
    eng.scheduler.verifier.release = flaky
    try:
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        run(eng, clock, reqs)  # batch 2 and 3 failed releases: the old code never admitted the third request
        assert [r.output.token_ids for r in reqs] == expected  # greedy: exact
        assert all(r.output.finish_reason == "length" and r.error is None for r in reqs)
        settle(eng, clock, lambda: eng.target_core.kv_slots_in_use() == 0)
        assert eng.target_core.requests == {}
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
        assert eng.releases_pending() == {"target": 0, "draft": 0}
        assert eng.draft_core.kv_slots_in_use() == 0
        calls = len(flaky.calls)
        eng.step()
        clock[0] += 60
        eng.step()
        assert len(flaky.calls) == calls  # nothing owed: no more release calls
    finally:
        eng.close()


def test_failed_draft_releases_on_a_healthy_replica_are_retried(tiny_models, clock) -> None:
    expected = fault_free(tiny_models)
    eng = make_engine(tiny_models)
    drafter = eng.scheduler.replicas[0].drafter
    flaky = FailingRelease(drafter.release, fail=3)
    drafter.release = flaky
    try:
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        run(eng, clock, reqs)
        assert [r.output.token_ids for r in reqs] == expected
        assert healthy_replicas(eng) == 1  # a failed release does not eject
        settle(eng, clock, lambda: eng.draft_core.kv_slots_in_use() == 0)
        assert eng.draft_core.requests == {} and eng.target_core.kv_slots_in_use() == 0
        assert eng.releases_pending() == {"target": 0, "draft": 0}
        assert all(o.metrics.drafted > 0 for o in eng.generate(PROMPTS[:2], GREEDY))  # it still drafts
    finally:
        eng.close()


def test_a_down_target_is_retried_with_backoff_and_the_pending_count_is_exported(tiny_models, clock) -> None:
    eng = make_engine(tiny_models, method="none")
    metrics = Metrics(eng)
    flaky = FailingRelease(eng.scheduler.verifier.release)
    eng.scheduler.verifier.release = flaky
    try:
        flaky.down = True
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS[:2]]
        run(eng, clock, reqs, step_s=0.0)
        assert eng.releases_pending() == {"target": 2}
        assert eng.target_core.kv_slots_in_use() == 2  # the core still holds them
        assert "specdist_target_releases_pending 2.0" in metrics.render()[0].decode()
        first = len(flaky.calls)
        for _ in range(100):  # 100 steps over 10 s: a few retries, each a single batched call
            eng.step()
            clock[0] += 0.1
        retries = flaky.calls[first:]
        assert 2 <= len(retries) <= 8, len(retries)
        assert all(sorted(c) == sorted(r.core_id for r in reqs) for c in retries)
        flaky.down = False  # back
        settle(eng, clock, lambda: eng.releases_pending() == {"target": 0}, step_s=RELEASE_RETRY_MAX_S)
        assert eng.target_core.kv_slots_in_use() == 0 and eng.target_core.requests == {}
        assert "specdist_target_releases_pending 0.0" in metrics.render()[0].decode()
        out = eng.generate(PROMPTS[:4], GREEDY)  # admitted and served as usual
        assert all(o.finish_reason == "length" for o in out)
    finally:
        metrics.close()
        eng.close()


def test_not_found_and_a_rebuilt_target_forget_pending_releases(tiny_models, clock) -> None:
    eng = make_engine(tiny_models, method="none", max_batch_size=4)  # the faked failures keep 4 slots
    flaky = FailingRelease(eng.scheduler.verifier.release)
    eng.scheduler.verifier.release = flaky
    try:
        flaky.down = True
        run(eng, clock, [eng.add_request(p, GREEDY) for p in PROMPTS[:2]], step_s=0.0)
        assert eng.releases_pending() == {"target": 2}
        flaky.code = ErrorCode.NOT_FOUND  # the core does not know them (already gone): nothing to retry
        settle(eng, clock, lambda: eng.releases_pending() == {"target": 0})
        calls = len(flaky.calls)
        clock[0] += 100
        eng.step()
        assert len(flaky.calls) == calls

        flaky.code = ErrorCode.UNAVAILABLE
        run(eng, clock, [eng.add_request(p, GREEDY) for p in PROMPTS[2:4]], step_s=0.0)
        assert eng.releases_pending() == {"target": 2}
        eng.retarget()  # the target group was rebuilt: its new core holds none of them
        assert eng.releases_pending() == {"target": 0}
        calls = len(flaky.calls)
        clock[0] += 100
        eng.step()
        assert len(flaky.calls) == calls
    finally:
        flaky.down = False
        eng.close()


def test_a_requeued_request_is_not_hit_by_the_retried_release_of_its_first_admission(tiny_models, clock) -> None:
    """No room on the drafter requeues a request after its prefill; its target release fails. The
    retry of that release must not free the request's next admission on the target."""
    eng = make_engine(tiny_models)
    flaky = FailingRelease(eng.scheduler.verifier.release, fail=1)
    eng.scheduler.verifier.release = flaky
    drafter = eng.scheduler.replicas[0].drafter
    start, refused = drafter.start, []

    def full_once(items):
        if not refused:
            refused.append([it.request_id for it in items])
            raise TransportError("no free slot", [it.request_id for it in items], ErrorCode.RESOURCE_EXHAUSTED)
        return start(items)

    drafter.start = full_once
    try:
        req = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        eng.step()  # prefilled, refused by the drafter: requeued, and its target release failed
        assert req.queued and eng.releases_pending()["target"] == 1
        run(eng, clock, [req], step_s=1.0)  # the retry goes out while it runs again
        assert len(flaky.calls) >= 2 and flaky.calls[1] == refused[0]
        assert req.output.finish_reason == "length" and req.error is None and len(req.output.token_ids) == 30
        settle(eng, clock, lambda: eng.target_core.kv_slots_in_use() == 0)
        assert eng.releases_pending() == {"target": 0, "draft": 0}
    finally:
        eng.close()
