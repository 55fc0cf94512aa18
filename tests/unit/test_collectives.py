"""A tensor-parallel target's ranks kept in step (specdist/cores/collectives.py), without a process group.

Two ranks in one process, each a whole copy of the tiny target (no all-reduce), joined by a queue as their
``broadcast``: rank 0 serves prefill / verify / release, rank 1 replays in ``follow()`` on a thread. The
follower's cache must end where rank 0's is, token for token, and see each forward and timeout rank 0 sent.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from specdist.cores.collectives import Replicator
from specdist.cores.target import VerifierCore
from specdist.errors import Unavailable
from specdist.models.loader import ModelSource, load_model
from specdist.models.runner import CausalLMRunner
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import Proposal, StartItem, VerifyItem

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 2, 6, 1, 4, 3, 2]  # long enough to be kept as a shared prefix


class _Link:
    """``broadcast`` of two ranks in one process: rank 0 sends a list of ops, rank 1 receives it."""

    def __init__(self):
        self.sent: list[list[tuple]] = []
        self._q: queue.Queue = queue.Queue()

    def rank0(self, ops):
        self.sent.append(list(ops))
        self._q.put(list(ops))
        return ops

    def rank1(self, _):
        return self._q.get(timeout=60)


def _pair(tiny_models, link: _Link, timeouts: dict[int, list[float]]):
    cores = []
    for rank, send in ((0, link.rank0), (1, link.rank1)):
        model = load_model(ModelSource(tiny_models["target"], None), "float32")
        cores.append(
            VerifierCore(
                CausalLMRunner(model, 4, 64),
                rank,
                2,
                broadcast=send,
                set_timeout=timeouts.setdefault(rank, []).append,
                collective_timeout_s=7.0,
            )
        )
    return cores


def test_follower_replays_rank0_to_the_same_cache(tiny_models):
    link, timeouts = _Link(), {}
    leader, follower = _pair(tiny_models, link, timeouts)
    followed: list[int] = []
    thread = threading.Thread(target=lambda: followed.append(follower.follow()))
    thread.start()
    try:
        prompts = {"a": SYSTEM + [1, 2], "b": SYSTEM + [2, 1, 7]}
        leader.prefill([StartItem(rid, p, GREEDY, 1) for rid, p in prompts.items()])
        for _ in range(2):
            leader.verify([VerifyItem(rid, len(leader.requests[rid].seq), Proposal(rid, [1, 2])) for rid in prompts])
        leader.release(["a"])
        leader.prefill([StartItem("c", SYSTEM + [5], GREEDY, 2)])  # reuses a kept prompt's K/V
        leader.verify([VerifyItem(rid, len(leader.requests[rid].seq), Proposal(rid, [4])) for rid in ("b", "c")])
        leader.release(["b", "c"])  # idle: the queued ops go out without a forward
        assert link.sent[-1] and all(op[0] != "forward" for op in link.sent[-1])
    finally:
        leader.shutdown()
        thread.join(60)
    assert not thread.is_alive()

    forwards = sum(op[0] == "forward" for ops in link.sent for op in ops)
    assert followed == [forwards] and forwards >= 4
    lc, fc = leader.cache, follower.cache
    assert lc.lengths == fc.lengths and lc.num_used == fc.num_used > 0  # the kept prompt slots
    assert set(leader.prefixes.retained) == set(follower.prefixes.retained)
    for slot in leader.prefixes.retained:
        n = lc.lengths[slot]
        for layer in range(len(lc.k)):
            torch.testing.assert_close(fc.k[layer][slot, :, :n], lc.k[layer][slot, :, :n])
    # every timeout rank 0 set went ahead of its forward, so the follower set the same ones
    sent = [op[1] for ops in link.sent for op in ops if op[0] == "timeout"]
    assert sent and timeouts[0] == sent == timeouts[1] and min(sent) >= 7.0


def test_failed_collective_breaks_the_group(tiny_models):
    def broken_link(ops):
        raise RuntimeError("connection closed by rank 1")

    model = load_model(ModelSource(tiny_models["target"], None), "float32")
    core = VerifierCore(CausalLMRunner(model, 2, 64), 0, 2, broadcast=broken_link)
    with pytest.raises(Unavailable, match="rank 1"):
        core.prefill([StartItem("a", [1, 2, 3], GREEDY, 1)])
    health = core.health()
    assert not health["ok"] and "collective failed" in health["broken"]
    with pytest.raises(Unavailable, match="collective failed"):  # at once: the group is not trusted again
        core.release(["a"])


def test_a_call_past_its_bound_is_hung(monkeypatch):
    import specdist.cores.collectives as collectives

    clock = [100.0]
    monkeypatch.setattr(collectives, "now", lambda: clock[0])
    group = Replicator(runner=None, collective_timeout_s=10.0)
    with group.watched("verify", 4):
        clock[0] += 10.0
        assert group.hung() is None  # at its bound: not yet
        clock[0] += 31.0
        assert group.hung() == "hung in verify for 41 s, bound 10 s"
    assert group.hung() is None  # the call returned


def test_one_rank_queues_nothing(tiny_models):
    model = load_model(ModelSource(tiny_models["target"], None), "float32")
    core = VerifierCore(CausalLMRunner(model, 2, 64))
    core.prefill([StartItem("a", [1, 2, 3], GREEDY, 1)])
    core.verify([VerifyItem("a", 3, Proposal("a", [4]))])
    assert core.group.pending == [] and core.group.deadline.overhead > 0  # measured, nothing to send
    with pytest.raises(RuntimeError, match="ranks > 0"):
        core.follow()
