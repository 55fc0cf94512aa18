"""RemoteEngine: the Engine interface on one target + two draft workers over real gRPC.

The worker servicers (over VerifierCore / DrafterCore, the cores the in-process Engine uses)
run in-process on the workers' gRPC host (conftest.host_servicer), like tests/distributed/test_workers.py, and
the RemoteEngine (the Engine's scheduler over the gRPC transports) drives them. Fake servicers
can be slowed down or made to fail (test-controlled) to exercise replica choice and errors:
a target error ends the requests it names (finish_reason "error"), a draft error only detaches
them from their drafter (they go on without drafts, exactly).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from scipy import stats
from support.gtest import (
    ALPHA,
    VOCAB,
    Case,
    N,
    _prob_table,
    g_statistic,
    joint,
    merge_cells,
    seq_index,
)
from support.gtest import (
    MAX_MODEL_LEN as FREQ_MAX_LEN,
)
from support.gtest import (
    K as FREQ_K,
)
from support.helpers import collect, host_servicer, model_drafter, tiny_config

from specdist.api.coordinator import Coordinator
from specdist.cores.target import VerifierCore
from specdist.engine.local import Engine
from specdist.engine.remote import RemoteEngine
from specdist.models.loader import ModelSource, load_model
from specdist.models.runner import CausalLMRunner
from specdist.sampling_params import SamplingParams
from workers.draft_worker import DraftServicer
from workers.target_worker import TargetServicer

MAX_LEN, SLOTS, K = 64, 8, 3
PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 6, 5, 6, 5, 6, 5], [2, 3], [6, 6, 6], [0, 1], [3, 4, 5, 6, 0, 1, 2], [7, 2]]
MAX_TOKENS = [20, 9, 30, 14, 5, 25, 11, 17]


# Propose delay of the replica that turns slow (test-controlled, in the fake servicer)
SLOW_DELAY_S = 0.3


def greedy_params():
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=(i % 2 == 0)) for i, m in enumerate(MAX_TOKENS)]


class _FaultInjection:
    """Test-controlled failures of a servicer's calls, answered the way the real servicers answer:
    ``fail_calls``: methods ("Start", "Propose", "Verify", ...) that fail as a whole (UNAVAILABLE,
    no item named); ``fail_ids``: core request ids whose items are blamed
    (INVALID_ARGUMENT ``items[i].request_id: ...``, as a core names the item it rejects)."""

    def _init_faults(self) -> None:
        self.fail_calls: set[str] = set()
        self.fail_ids: set[str] = set()

    def clear_faults(self) -> None:
        self.fail_calls.clear()
        self.fail_ids.clear()

    async def _inject(self, method: str, request, context) -> None:
        if method in self.fail_calls:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"injected: {method} is unavailable")
        for i, it in enumerate(getattr(request, "items", ())):
            if it.request_id in self.fail_ids:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"items[{i}].request_id: injected failure")


class SlowableDraftServicer(_FaultInjection, DraftServicer):
    """A draft servicer whose Propose can be made slower (``delay_s``), counts its calls and
    can be made to fail (see _FaultInjection)."""

    def __init__(self, core):
        super().__init__(core)
        self._init_faults()
        self.delay_s = 0.0
        self.propose_calls = 0

    async def Start(self, request, context):
        await self._inject("Start", request, context)
        return await super().Start(request, context)

    async def Propose(self, request, context):
        self.propose_calls += 1
        await self._inject("Propose", request, context)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await super().Propose(request, context)


class SlowableTargetServicer(_FaultInjection, TargetServicer):
    """A target servicer whose Verify can be made slower (a bigger target, relative to the draft)
    or fail (see _FaultInjection)."""

    def __init__(self, core):
        super().__init__(core)
        self._init_faults()
        self.delay_s = 0.0

    async def Verify(self, request, context):
        await self._inject("Verify", request, context)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return await super().Verify(request, context)


class Cluster:
    """One target and two model drafts, each behind its own gRPC server."""

    def __init__(self, target_path: str, draft_path: str, slots: int, max_len: int):
        self.target = VerifierCore(
            CausalLMRunner(load_model(ModelSource(target_path, None), "float32"), slots, max_len)
        )
        self.drafts = [
            model_drafter(load_model(ModelSource(draft_path, None), "float32"), slots, max_len) for _ in range(2)
        ]
        self.servicers = [SlowableTargetServicer(self.target)] + [SlowableDraftServicer(d) for d in self.drafts]
        self.servers = [host_servicer(sv) for sv in self.servicers]
        self.target_address = f"127.0.0.1:{self.servers[0].port}"
        self.draft_addresses = [f"127.0.0.1:{s.port}" for s in self.servers[1:]]

    def slots_in_use(self) -> list[int]:
        return [self.target.kv_slots_in_use()] + [d.kv_slots_in_use() for d in self.drafts]

    def clear_faults(self) -> None:
        for sv in self.servicers:
            sv.clear_faults()
            sv.delay_s = 0.0

    def stop(self) -> None:
        for s in self.servers:
            s.stop(0)
        for s in self.servicers:
            s.shutdown()


@pytest.fixture(scope="module")
def cluster(tiny_models):
    c = Cluster(tiny_models["target"], tiny_models["draft"], SLOTS, MAX_LEN)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def remote(cluster, tiny_models):
    eng = RemoteEngine.from_addresses(
        tiny_config(tiny_models, method="model", k=K), cluster.target_address, cluster.draft_addresses
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def expected(tiny_models):
    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=K))
    return [o.token_ids for o in eng.generate(PROMPTS, greedy_params())]


def test_greedy_matches_engine_across_two_drafts(remote, cluster, expected):
    assert remote.vocab_size == 8 and remote.scheduler.eos_ids == frozenset({7}) and remote.k == K
    remote.stats.reset()
    t0 = time.perf_counter()
    outs = remote.generate(PROMPTS, greedy_params())
    wall = time.perf_counter() - t0
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert all(rep.proposed_tokens > 0 for rep in remote.scheduler.replicas)  # both drafts served requests
    s = remote.stats
    assert s.steps > 0 and 0 < s.accepted < s.drafted
    per_step = {k: f"{1e3 * v / s.steps:.2f}ms" for k, v in s.phase_s.items() if v}
    print(f"\n8 prompts in {wall:.3f}s, {s.steps} steps, {s.calls} calls; per step: {per_step}")
    # the cores' compute arrives in the trailing metadata (forward -> "verify", "sampling", "draft",
    # "cache"); each call's remaining wall time is network. Without the metadata the first ones stay 0.
    assert all(s.phase_s[p] > 0 for p in ("prefill", "draft", "verify", "sampling", "cache", "output", "network")), (
        s.phase_s
    )
    assert sum(s.phase_s.values()) <= wall
    assert s.calls >= 2 * s.steps  # a Propose (per replica with drafts) and a Verify per step
    assert remote.kv_slots_in_use() == {"target": 0, "draft": 0, "draft/0": 0, "draft/1": 0}
    assert cluster.slots_in_use() == [0, 0, 0]


def test_seeded_sampling_matches_engine(cluster, tiny_models):
    """One seed, one output on either transport: with one draft replica (the in-process engine's
    batches) and fixed draft lengths, seeded sampled requests emit the very tokens the
    in-process Engine emits; the draft's q crosses the wire as fp16 and decodes bit for bit."""
    params = [
        SamplingParams(
            temperature=0.9,
            top_k=(0 if i % 2 else 4),
            top_p=(0.9 if i % 3 == 0 else 1.0),
            max_tokens=m,
            ignore_eos=True,
            seed=100 + i,
        )
        for i, m in enumerate(MAX_TOKENS)
    ]
    cfg = tiny_config(tiny_models, method="model", k=K)
    want = [o.token_ids for o in Engine.from_config(cfg).generate(PROMPTS, params)]
    with RemoteEngine.from_addresses(cfg, cluster.target_address, cluster.draft_addresses[:1]) as eng:
        outs = eng.generate(PROMPTS, params)
        assert eng.stats.drafted > eng.stats.accepted > 0  # drafts were accepted and rejected
    assert [o.token_ids for o in outs] == want
    assert cluster.slots_in_use() == [0, 0, 0]


def test_replica_assignment_balances(remote, cluster):
    reqs = [remote.add_request([1, 2], SamplingParams(temperature=0.0, max_tokens=2)) for _ in range(5)]
    remote.step()
    counts = [sum(r.replica == i for r in reqs) for i in range(2)]
    assert sorted(counts) == [2, 3]
    assert (
        remote.kv_slots_in_use()["draft/0"] + remote.kv_slots_in_use()["draft/1"]
        == remote.kv_slots_in_use()["target"]
        == 5 - sum(r.finished for r in reqs)
    )
    while remote.has_unfinished():
        remote.step()
    assert cluster.slots_in_use() == [0, 0, 0]


@pytest.mark.slow
def test_survives_a_replica_turning_slow(tiny_models):
    """Replica 1 becomes 300 ms slower per Propose mid-run (about ten times a step, so that one
    measured call outweighs the step overhead however loaded the machine is). With the adaptive
    rule its requests stop drafting (the step no longer waits for it) and still finish with the
    exact greedy output, while the fast replica's requests keep drafting; new requests go to the
    fast replica. The fixed rule, as a control, keeps calling it. So that drafting pays on the
    fast replica, the drafts are copies of the target (greedy drafts always accepted) and the
    target's Verify takes 20 ms more (a tiny target is otherwise as cheap as its draft)."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in PROMPTS]
    expected = [o.token_ids for o in Engine.from_config(tiny_config(tiny_models, k=K)).generate(PROMPTS, params)]
    c = Cluster(tiny_models["target"], tiny_models["target"], SLOTS, MAX_LEN)  # draft = target: drafts pay
    c.servicers[0].delay_s = 0.02
    try:
        calls_after = {}
        for policy in ("adaptive", "fixed"):
            cfg = tiny_config(tiny_models, method="model", k=K)
            cfg["draft"]["length_policy"] = policy
            with RemoteEngine.from_addresses(cfg, c.target_address, c.draft_addresses) as eng:
                slow = c.servicers[2]
                slow.delay_s = 0.0
                reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
                for _ in range(3):
                    eng.step()
                assert {r.replica for r in reqs} == {0, 1}  # unmeasured: spread by load
                slow.delay_s = SLOW_DELAY_S
                before, steps = slow.propose_calls, 0
                marks = {id(r): (r.metrics.drafted, r.metrics.steps) for r in reqs}
                while eng.has_unfinished():
                    eng.step()
                    steps += 1
                calls_after[policy] = slow.propose_calls - before
                mean_k = []  # draft tokens per request-step after the slowdown, per replica
                for i in (0, 1):
                    mine = [r for r in reqs if r.replica == i]
                    drafted = sum(r.metrics.drafted - marks[id(r)][0] for r in mine)
                    mean_k.append(drafted / max(1, sum(r.metrics.steps - marks[id(r)][1] for r in mine)))
                print(
                    f"\n{policy}: {steps} steps after the slowdown, draft tokens per request-step "
                    f"fast {mean_k[0]:.2f} / slow {mean_k[1]:.2f}"
                )
                assert [list(r.output.token_ids) for r in reqs] == expected
                assert c.slots_in_use() == [0, 0, 0]
                if policy == "adaptive":
                    assert steps >= 12
                    assert calls_after[policy] <= 4, f"{calls_after[policy]} calls to the slow replica in {steps} steps"
                    # the slow replica drafts only until its cost is measured (a few calls), the fast one on
                    assert mean_k[0] >= 1.0 and mean_k[1] <= 0.4 * mean_k[0], (
                        f"draft tokens per step, fast / slow: {mean_k}"
                    )
                    late = [eng.add_request([1, 2], SamplingParams(temperature=0.0, max_tokens=3)) for _ in range(4)]
                    eng.step()
                    fits = eng.scheduler.length_policy.draft_cost
                    assert [r.replica for r in late] == [0, 0, 0, 0], (
                        f"predicted draft costs (e, a, b): fast {fits[0].w}, slow {fits[1].w}"
                    )
                    while eng.has_unfinished():
                        eng.step()
        assert calls_after["fixed"] >= calls_after["adaptive"] + 3  # fixed: every step until its requests end
        print(
            f"\nProposes to the slow replica after it slowed: adaptive {calls_after['adaptive']}, "
            f"fixed {calls_after['fixed']}"
        )
    finally:
        c.stop()


@pytest.fixture
def faults(cluster):
    """The module's cluster, its injected faults and delays cleared after the test."""
    yield cluster
    cluster.clear_faults()


def test_worker_error_fails_only_that_request(cluster, tiny_models):
    """The engine allows a longer context than the workers: the target rejects that one prompt
    at Prefill; it ends with finish_reason "error" and the target's message in ``r.error``."""
    eng = RemoteEngine.from_addresses(
        tiny_config(tiny_models, method="model", k=K, max_model_len=2 * MAX_LEN),
        cluster.target_address,
        cluster.draft_addresses,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        reqs = [eng.add_request(p, params) for p in ([1, 2], [1] * (MAX_LEN + 1), [3])]
        while eng.has_unfinished():
            eng.step()
        outs = [r.to_output() for r in reqs]
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert [len(o.token_ids) for o in outs] == [4, 0, 4]
        assert reqs[0].error is None and reqs[2].error is None
        err = reqs[1].error
        assert (
            err.startswith("target: INVALID_ARGUMENT") and "prompt_token_ids" in err and cluster.target_address in err
        )
        assert cluster.slots_in_use() == [0, 0, 0]
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0, "draft/0": 0, "draft/1": 0}
    finally:
        eng.close()


@pytest.mark.parametrize("fault", ["verify-item", "verify-call"])
def test_target_error_mid_run_ends_the_requests_it_names(faults, tiny_models, expected, fault):
    """The target fails Verify mid-run: for one blamed item (the call is retried without it) only
    that request ends with "error", the others finish exactly; a failure naming no item ends every
    request of the call. Everything the failed requests held is released on every worker."""
    cluster = faults
    with RemoteEngine.from_addresses(
        tiny_config(tiny_models, method="model", k=K), cluster.target_address, cluster.draft_addresses
    ) as eng:
        reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, greedy_params())]
        eng.step()
        eng.step()
        victim = reqs[2]  # max_tokens 30: still running
        assert not victim.finished
        if fault == "verify-item":
            cluster.servicers[0].fail_ids.add(victim.core_id)
        else:
            cluster.servicers[0].fail_calls.add("Verify")
        running = [r for r in reqs if not r.finished]
        before = {id(r): list(r.output.token_ids) for r in running}
        eng.step()
        failed = [victim] if fault == "verify-item" else running
        for r in failed:
            assert r.finished and r.to_output().finish_reason == "error", r.request_id
            assert r.error.startswith("target: ") and "injected" in r.error
            assert r.output.token_ids == before[id(r)]  # nothing emitted by the failed step
        cluster.clear_faults()
        while eng.has_unfinished():
            eng.step()
        for r, want in zip(reqs, expected):
            if r in failed:
                assert want[: len(r.output.token_ids)] == r.output.token_ids  # a prefix of the exact output
            else:
                assert r.output.token_ids == want and r.error is None
                assert r.to_output().finish_reason in ("stop", "length")
        assert cluster.slots_in_use() == [0, 0, 0]
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0, "draft/0": 0, "draft/1": 0}


@pytest.mark.parametrize("fault", ["start-call", "propose-call", "propose-item"])
def test_draft_error_detaches_the_request_which_continues_without_drafts(faults, tiny_models, expected, fault):
    """A draft worker's error does not fail a request: it is detached from its drafter (released
    there), drafts nothing from then on (k = 0) and finishes normally with the exact greedy output.

    start-call: replica 1's Start fails as a whole at admission (its requests never draft);
    propose-call: replica 1's Propose fails as a whole mid-run (all its requests detach);
    propose-item: replica 0 blames one item mid-run; only that request detaches, the call is
    retried without it and the replica's other requests keep drafting.
    """
    cluster = faults
    with RemoteEngine.from_addresses(
        tiny_config(tiny_models, method="model", k=K), cluster.target_address, cluster.draft_addresses
    ) as eng:
        if fault == "start-call":
            cluster.servicers[2].fail_calls.add("Start")
        reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, greedy_params())]
        eng.step()
        if fault == "start-call":
            detached = [r for r in reqs if r.replica is None]
            assert len(detached) == len(reqs) // 2  # the ones assigned to replica 1 (spread by load)
            assert cluster.drafts[1].kv_slots_in_use() == 0 and eng.kv_slots_in_use()["draft/1"] == 0
            cluster.clear_faults()
            kept = [r for r in reqs if r.replica == 0]
            marks = {id(r): 0 for r in reqs}
        else:
            eng.step()
            if fault == "propose-call":
                rep, svc = 1, cluster.servicers[2]
                detached = [r for r in reqs if r.replica == 1 and not r.finished]
                svc.fail_calls.add("Propose")
            else:
                rep, svc = 0, cluster.servicers[1]
                detached = [r for r in reqs if r.replica == 0 and not r.finished][:1]
                svc.fail_ids.add(detached[0].core_id)
            kept = [r for r in reqs if r.replica is not None and r not in detached and not r.finished]
            assert detached and all(r.metrics.drafted > 0 for r in detached)  # they were drafting
            marks = {id(r): r.metrics.drafted for r in reqs}
            calls = svc.propose_calls
            eng.step()
            # failed call (+ the retry without the blamed item)
            assert svc.propose_calls - calls == (1 if fault == "propose-call" else 2)
            assert all(r.replica is None and not r.on_drafter for r in detached)
            assert cluster.drafts[rep].kv_slots_in_use() == sum(r.replica == rep and not r.finished for r in reqs)
            assert eng.kv_slots_in_use()[f"draft/{rep}"] == cluster.drafts[rep].kv_slots_in_use()
            assert cluster.target.kv_slots_in_use() == sum(not r.finished for r in reqs)  # still on the target
        assert kept and all(r.replica is not None for r in kept)
        while eng.has_unfinished():
            eng.step()
        assert [r.output.token_ids for r in reqs] == expected
        assert all(r.error is None and r.to_output().finish_reason in ("stop", "length") for r in reqs)
        for r in detached:
            assert r.replica is None and r.metrics.drafted == marks[id(r)], r.request_id  # no drafts once detached
        assert any(r.metrics.drafted > marks[id(r)] for r in kept)  # the others kept drafting
        assert cluster.slots_in_use() == [0, 0, 0]
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0, "draft/0": 0, "draft/1": 0}


@pytest.mark.slow
def test_network_time_is_wall_minus_core_compute(faults, tiny_models):
    """Network time is each call's wall time minus the compute its core reports (trailing
    metadata): a delay the target's servicer adds outside its core counts as network, not as
    the target forward."""
    cluster = faults
    delay = 0.05
    cluster.servicers[0].delay_s = delay
    with RemoteEngine.from_addresses(
        tiny_config(tiny_models, method="model", k=K), cluster.target_address, cluster.draft_addresses
    ) as eng:
        outs = eng.generate(PROMPTS[:4], greedy_params()[:4])
        s = eng.stats
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        assert s.phase_s["network"] >= s.steps * delay  # every Verify waited outside the core
        assert 0 < s.phase_s["verify"] < s.steps * delay, s.phase_s  # the core's forward, without the delay
        assert s.phase_s["sampling"] > 0 and s.phase_s["draft"] > 0
    assert cluster.slots_in_use() == [0, 0, 0]


def test_coordinator_runs_on_remote_engine(remote, cluster, expected):
    async def run():
        async with Coordinator(remote) as coord:
            deltas = await collect(coord, PROMPTS[2], greedy_params()[2])
            return deltas, coord.counters()

    deltas, counters = asyncio.run(run())
    assert deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == expected[2]
    assert counters["target_kv_slots_used"] == 0 and counters["draft_kv_slots_used"] == 0
    assert cluster.slots_in_use() == [0, 0, 0]


def test_abort_mid_run_releases_remote_slots(remote, cluster):
    r = remote.add_request([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=3))
    remote.step()
    remote.step()
    assert not r.finished and len(r.output.token_ids) >= 2
    rep = r.replica
    assert cluster.target.kv_slots_in_use() == 1 and cluster.drafts[rep].kv_slots_in_use() == 1
    assert remote.kv_slots_in_use()["target"] == 1 and remote.kv_slots_in_use()[f"draft/{rep}"] == 1
    assert remote.abort(r.request_id)
    assert r.to_output().finish_reason == "abort"
    assert cluster.slots_in_use() == [0, 0, 0]
    assert remote.kv_slots_in_use() == {"target": 0, "draft": 0, "draft/0": 0, "draft/1": 0}
    assert not remote.has_unfinished() and not remote.abort(r.request_id)


def test_remote_samples_target_distribution(models):
    """G-test through the distributed path: N = 4000 sequences of 2 tokens, temperature 1.

    alpha = 1e-4 (false-failure rate of a correct sampler); with the session's tiny target
    the merged cells give df = 33, threshold = 72.0 (as for Case("model", 2, 2) in
    test_exactness_frequency.py, whose power checks cover this same law).
    """
    case = Case("model", 2, 2)
    ptab, _ = _prob_table(models["target"], case)
    p = joint(ptab, case.window)
    batch = 256
    c = Cluster(models["target"], models["draft"], batch, FREQ_MAX_LEN)
    try:
        eng = RemoteEngine.from_addresses(
            tiny_config(models, method="model", k=FREQ_K, max_batch_size=batch, max_model_len=FREQ_MAX_LEN),
            c.target_address,
            c.draft_addresses,
        )
        params = [
            SamplingParams(max_tokens=case.max_tokens, temperature=1.0, seed=7_000_000 + i, ignore_eos=True)
            for i in range(N)
        ]
        t0 = time.perf_counter()
        outs = eng.generate([list(case.prompt)] * N, params)
        elapsed = time.perf_counter() - t0
        assert all(len(o.token_ids) == case.max_tokens and o.finish_reason == "length" for o in outs)
        drafted = sum(o.metrics.drafted for o in outs)
        rate = sum(o.metrics.accepted for o in outs) / drafted
        assert 0.2 <= rate <= 0.85  # both the accept and the reject/residual paths ran
        assert all(rep.proposed_tokens > 0 for rep in eng.scheduler.replicas)
        assert c.slots_in_use() == [0, 0, 0]
        eng.close()
    finally:
        c.stop()
    counts = np.bincount([seq_index(o.token_ids[: case.window]) for o in outs], minlength=VOCAB**case.window)
    assert not np.any((counts > 0) & (p == 0)), "a sequence of target probability 0 was drawn"
    cells = merge_cells(p, N)
    df = len(cells) - 1
    threshold = stats.chi2.isf(ALPHA, df)
    g = g_statistic(counts, p, cells)
    print(
        f"\nremote: N={N} in {elapsed:.2f}s, acceptance {rate:.3f}, G = {g:.1f}, df = {df}, threshold = {threshold:.1f}"
    )
    assert g <= threshold, f"G = {g:.1f} > {threshold:.1f} (df {df}, N {N}): not the target distribution"
