"""The draft pool owns a replica's calls (specdist.engine.draft_pool): it starts and proposes on a replica,
the replicas in parallel, and ejects a replica whose call failed as a whole, returning each call's
results without calling anything of the scheduler."""

from __future__ import annotations

import threading

from specdist.engine.calls import call_isolating
from specdist.engine.draft_pool import DraftPool
from specdist.errors import ErrorCode
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import CallTiming, Proposal, ProposeItem, StartItem, TransportError


class FakeDrafter:
    """A drafter that proposes ``[7] * k``; ``fail``: the TransportError each call raises (None: none)."""

    is_remote = False
    hidden_layers = ()

    def __init__(self, name: str):
        self.name = name
        self.fail: TransportError | None = None
        self.barrier: threading.Barrier | None = None  # set: each propose waits there for the other replicas'
        self.calls: list[tuple[str, list[str]]] = []

    def _called(self, method: str, items) -> None:
        self.calls.append((method, [it.request_id for it in items]))
        if self.fail is not None:
            raise self.fail

    def start(self, items: list[StartItem]):
        self._called("start", items)
        return CallTiming()

    def propose(self, items: list[ProposeItem]):
        self._called("propose", items)
        if self.barrier is not None:
            self.barrier.wait()  # broken (an error) unless the other replica's call runs at the same time
        return [Proposal(it.request_id, [7] * it.num_tokens) for it in items], CallTiming()

    def release(self, ids: list[str]) -> None:
        self.calls.append(("release", list(ids)))

    def close(self) -> None:
        pass


def _pool(n: int) -> tuple[DraftPool, list[FakeDrafter]]:
    drafters = [FakeDrafter(f"draft/{i}") for i in range(n)]
    return DraftPool(drafters, max_batch_size=4, call=call_isolating), drafters


def _items(*ids: str, k: int = 2) -> list[ProposeItem]:
    return [ProposeItem(rid, 0, [1], k, 3) for rid in ids]


def test_propose_calls_each_replica_once_and_returns_its_results_by_replica() -> None:
    pool, drafters = _pool(2)
    drafters[0].barrier = drafters[1].barrier = threading.Barrier(2, timeout=30)
    out = pool.propose({0: _items("a", "b"), 1: _items("c", k=3)})
    assert sorted(out) == [0, 1]
    proposals, failed, _, wall = out[1]
    assert [p.token_ids for p in proposals] == [[7, 7, 7]] and failed == {} and wall >= 0
    assert [p.request_id for p in out[0][0]] == ["a", "b"]
    assert [d.calls for d in drafters] == [[("propose", ["a", "b"])], [("propose", ["c"])]]
    assert not drafters[0].barrier.broken  # the replicas worked in parallel
    pool.close()


def test_a_call_failed_as_a_whole_ejects_its_replica() -> None:
    pool, drafters = _pool(2)
    drafters[1].fail = TransportError("worker down", ["c"], ErrorCode.UNAVAILABLE)
    out = pool.propose({0: _items("a"), 1: _items("c")})
    assert out[1][0] is None and out[1][1][0].code == ErrorCode.UNAVAILABLE  # the failure comes back
    assert pool.replicas[0].ejected_at is None and pool.replicas[1].ejected_at is not None
    assert pool.choose(pool.room(), lambda replica, requests: 0.0) == 0  # new requests go to the healthy one
    drafters[0].fail = TransportError("worker down", ["a"], ErrorCode.DEADLINE_EXCEEDED)
    pool.call(0, "start", [StartItem("a", [1, 2], SamplingParams(), 0)])  # a start too
    assert pool.replicas[0].ejected_at is not None
    pool.close()


def test_an_item_refused_leaves_its_replica_in_the_pool() -> None:
    pool, drafters = _pool(1)
    drafters[0].fail = TransportError("stale", ["a"], ErrorCode.FAILED_PRECONDITION, item=0)
    proposals, failed, _, _ = pool.call(0, "propose", _items("a"))
    assert list(failed) == [0] and pool.replicas[0].ejected_at is None  # one bad item: not the replica's fault
    pool.close()
