"""Target and draft workers over real gRPC (grpc.aio servers in a background thread).

The workers are the cores the in-process engine uses (:class:`~specdist.cores.target.VerifierCore`,
:class:`~specdist.cores.draft.DrafterCore`) behind their servicers (``workers/target_worker.py``,
``workers/draft_worker.py``). A small coordinator loop in this file drives Prefill -> Start ->
Propose -> Verify -> Propose ... -> Release with raw protobuf stubs, applying the engine's own
stop rules (OutputState) and draft-length rule, and the greedy output must equal the
single-process Engine's token for token. Other tests call the cores directly with the
dataclasses of :mod:`specdist.transport.protocol`, or the remote transports (:mod:`specdist.transport.remote`).
"""

from __future__ import annotations

import socket

import grpc
import pytest
import support.rank_procs as rank_procs
import torch
from support.helpers import host_servicer, model_drafter, tiny_config

from specdist.cores.draft import DrafterCore
from specdist.cores.proposers.ngram import NgramProposer
from specdist.cores.sampling import process_logits
from specdist.cores.target import VerifierCore
from specdist.engine.output_state import OutputState
from specdist.models.loader import ModelSource, eos_token_ids, load_model
from specdist.models.runner import CausalLMRunner
from specdist.randomness import draft_seed
from specdist.sampling_params import SamplingParams
from specdist.sampling_proto import sampling_params_to_proto
from specdist.transport.wire import DENSE, ONE_HOT, SPARSE, encode_distribution
from specdist.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from workers.draft_worker import DraftServicer
from workers.target_worker import TargetServicer

MAX_LEN, SLOTS, K = 64, 8, 3


# ---------------------------------------------------------------- servers
def _target_model(tiny_models):
    return load_model(ModelSource(tiny_models["target"], None), "float32")


@pytest.fixture(scope="module")
def workers(tiny_models):
    """Target worker + a model draft worker + an n-gram draft worker, all served over gRPC."""
    target = VerifierCore(CausalLMRunner(_target_model(tiny_models), SLOTS, MAX_LEN))
    model_draft = model_drafter(load_model(ModelSource(tiny_models["draft"], None), "float32"), SLOTS, MAX_LEN)
    ngram_draft = DrafterCore(NgramProposer(target.vocab_size), MAX_LEN)
    # the target's own weights as the draft: greedy drafts are then all accepted (the accept path)
    self_draft = model_drafter(_target_model(tiny_models), SLOTS, MAX_LEN)
    ts = TargetServicer(target)
    ds = {name: DraftServicer(w) for name, w in (("model", model_draft), ("ngram", ngram_draft), ("self", self_draft))}
    srv_t = host_servicer(ts)
    srvs = {name: host_servicer(sv) for name, sv in ds.items()}
    chans = [grpc.insecure_channel(f"127.0.0.1:{s.port}") for s in [srv_t, *srvs.values()]]
    out = {
        "target": target,
        "model": model_draft,
        "ngram": ngram_draft,
        "self": self_draft,
        "target_stub": target_pb2_grpc.TargetWorkerStub(chans[0]),
        "eos": eos_token_ids(target.runner.model),
        "target_address": f"127.0.0.1:{srv_t.port}",
    }
    for name, ch in zip(srvs, chans[1:]):
        out[f"{name}_stub"] = draft_pb2_grpc.DraftWorkerStub(ch)
        out[f"{name}_address"] = f"127.0.0.1:{srvs[name].port}"
    yield out
    for c in chans:
        c.close()
    for s in [srv_t, *srvs.values()]:
        s.stop(0)
    for s in [ts, *ds.values()]:
        s.shutdown()


# ---------------------------------------------------------------- a tiny coordinator
_ids = iter(range(10**9))


def run_generation(tstub, dstub, prompts, params, eos, k=K, seed0=1234, formats_seen=None, prefix="g", stats=None):
    """Drive requests to completion over gRPC; returns each request's output token ids."""
    ids = [f"{prefix}{next(_ids)}" for _ in prompts]
    seeds = [seed0 + i for i in range(len(prompts))]
    tstub.Prefill(
        target_pb2.PrefillRequest(
            items=[
                common_pb2.StartItem(request_id=i, prompt_token_ids=p, params=sampling_params_to_proto(sp), seed=s)
                for i, p, sp, s in zip(ids, prompts, params, seeds)
            ]
        )
    )
    dstub.Start(
        draft_pb2.StartRequest(
            items=[
                common_pb2.StartItem(
                    request_id=i, prompt_token_ids=p, params=sampling_params_to_proto(sp), seed=draft_seed(s)
                )
                for i, p, sp, s in zip(ids, prompts, params, seeds)
            ]
        )
    )
    st = {
        i: {"seq": list(p), "out": OutputState(sp, eos), "acc": 0, "new": [], "params": sp}
        for i, p, sp in zip(ids, prompts, params)
    }
    running = list(ids)
    while running:
        ks = {}
        for i in running:
            s = st[i]
            remaining = s["params"].max_tokens - len(s["out"].token_ids)
            ks[i] = max(0, min(k, remaining - 1, MAX_LEN - len(s["seq"]) - 1))
        prop = dstub.Propose(
            draft_pb2.ProposeRequest(
                items=[
                    draft_pb2.ProposeItem(
                        request_id=i,
                        num_accepted=st[i]["acc"],
                        new_token_ids=st[i]["new"],
                        num_tokens=ks[i],
                        seq_len=len(st[i]["seq"]),
                    )
                    for i in running
                ]
            )
        )
        assert [p.request_id for p in prop.proposals] == running
        if formats_seen is not None:
            for p in prop.proposals:
                formats_seen.update(d.format for d in p.probs)
        ver = tstub.Verify(
            target_pb2.VerifyRequest(
                items=[
                    target_pb2.VerifyItem(
                        request_id=i, draft_token_ids=p.token_ids, draft_probs=p.probs, seq_len=len(st[i]["seq"])
                    )
                    for i, p in zip(running, prop.proposals)
                ]
            )
        )
        done = []
        for i, p, res in zip(running, prop.proposals, ver.results):
            assert res.request_id == i and len(p.token_ids) <= ks[i]
            if stats is not None:
                stats.append((res.num_accepted, len(p.token_ids)))
            s = st[i]
            emitted = list(p.token_ids[: res.num_accepted]) + [res.next_token_id]
            s["seq"] += emitted
            s["acc"], s["new"] = res.num_accepted, [res.next_token_id]
            s["out"].append(emitted)
            if not s["out"].finished and len(s["seq"]) >= MAX_LEN:
                s["out"].finish("length")
            if s["out"].finished:
                done.append(i)
        if done:
            tstub.Release(target_pb2.TargetReleaseRequest(request_ids=done))
            dstub.Release(draft_pb2.DraftReleaseRequest(request_ids=done))
            running = [i for i in running if i not in done]
    return [st[i]["out"].token_ids for i in ids], [st[i]["seq"] for i in ids]


PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 6, 5, 6, 5, 6, 5], [2, 3]]
MAX_TOKENS = [20, 9, 30, 14]


@pytest.mark.parametrize("method", ["model", "ngram", "self"])
def test_greedy_matches_engine(workers, tiny_models, method):
    from specdist.engine.local import Engine

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=(i % 2 == 0)) for i, m in enumerate(MAX_TOKENS)]
    cfg = tiny_config(tiny_models, method="ngram" if method == "ngram" else "model", k=K)
    if method == "self":
        cfg["draft"]["model"] = tiny_models["target"]
    engine = Engine.from_config(cfg)
    want = [o.token_ids for o in engine.generate(PROMPTS, params)]
    formats: set[int] = set()
    got, _ = run_generation(
        workers["target_stub"],
        workers[f"{method}_stub"],
        PROMPTS,
        params,
        workers["eos"],
        formats_seen=formats,
        stats=(stats := []),
    )
    assert got == want
    if method == "self":
        assert all(n_acc == k for n_acc, k in stats)  # a draft equal to the target is always accepted
    else:
        assert any(n_acc < k for n_acc, k in stats)  # rejections happened too
    assert formats <= {ONE_HOT}  # greedy and n-gram drafts ship one-hot q
    assert workers["target"].kv_slots_in_use() == 0 and workers[method].kv_slots_in_use() == 0
    assert not workers["target"].requests and not workers[method].requests


def test_sampled_tokens_in_target_support(workers, tiny_models):
    """temperature 1, top_k 3: every emitted token has p > 0 under the target's processed p."""
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=24, ignore_eos=True)] * 3
    prompts = [[1, 2, 3], [4, 5], [6]]
    formats: set[int] = set()
    _, seqs = run_generation(
        workers["target_stub"], workers["model_stub"], prompts, params, workers["eos"], formats_seen=formats, seed0=7
    )
    assert SPARSE in formats  # top-k 3 of 8 is a small support
    model = workers["target"].runner.model
    with torch.inference_mode():
        for prompt, seq in zip(prompts, seqs):
            logits = model(torch.tensor([seq[:-1]])).logits[0]  # [T, V]
            n = len(seq) - len(prompt)
            p = process_logits(logits[-n:], torch.ones(n), torch.full((n,), 3), torch.ones(n))
            emitted = torch.tensor(seq[len(prompt) :])
            assert bool((p.gather(-1, emitted[:, None]) > 0).all())
    # dense q (no top-k/top-p) also verifies: the fp16 path end to end
    formats.clear()
    run_generation(
        workers["target_stub"],
        workers["model_stub"],
        [[1, 2]],
        [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)],
        workers["eos"],
        formats_seen=formats,
    )
    assert DENSE in formats or ONE_HOT in formats
    assert workers["target"].kv_slots_in_use() == 0 and workers["model"].kv_slots_in_use() == 0


def _code(fn, *args):
    with pytest.raises(grpc.RpcError) as ei:
        fn(*args)
    return ei.value.code(), ei.value.details()


def test_bad_inputs_get_status_codes(workers):
    t, d = workers["target_stub"], workers["model_stub"]
    C = grpc.StatusCode
    P = common_pb2.StartItem
    sp = sampling_params_to_proto(SamplingParams(temperature=0.0))

    def prefill(*items):
        return t.Prefill(target_pb2.PrefillRequest(items=list(items)))

    def verify(*items):
        return t.Verify(target_pb2.VerifyRequest(items=list(items)))

    cases = [
        (
            lambda: prefill(
                P(request_id="x", prompt_token_ids=[1], params=sp), P(request_id="x", prompt_token_ids=[2])
            ),
            C.INVALID_ARGUMENT,
            "items[1].request_id",
        ),
        (lambda: prefill(P(request_id="x", prompt_token_ids=[1, 99])), C.INVALID_ARGUMENT, "items[0].prompt_token_ids"),
        (lambda: prefill(P(request_id="x", prompt_token_ids=[])), C.INVALID_ARGUMENT, "items[0].prompt_token_ids"),
        (
            lambda: prefill(P(request_id="x", prompt_token_ids=[1] * MAX_LEN)),
            C.INVALID_ARGUMENT,
            "items[0].prompt_token_ids",
        ),
        (
            lambda: prefill(P(request_id="x", prompt_token_ids=[1], params=common_pb2.SamplingParams(top_p=1.5))),
            C.INVALID_ARGUMENT,
            "items[0].params.top_p",
        ),
        (
            lambda: prefill(*[P(request_id=f"s{i}", prompt_token_ids=[1]) for i in range(SLOTS + 1)]),
            C.RESOURCE_EXHAUSTED,
            f"items[{SLOTS}]",
        ),  # the first request with no room: the ones before it fit
        (lambda: verify(target_pb2.VerifyItem(request_id="nope", seq_len=1)), C.NOT_FOUND, "items[0].request_id"),
    ]
    for fn, code, field in cases:
        got, details = _code(fn)
        assert got == code and details.startswith(field + ":"), (code, field, got, details)
    assert workers["target"].kv_slots_in_use() == 0  # all or nothing: nothing admitted

    prefill(P(request_id="ok", prompt_token_ids=[1, 2, 3], params=sp, seed=1))
    got, details = _code(prefill, P(request_id="ok", prompt_token_ids=[1]))
    assert got == C.ALREADY_EXISTS and details.startswith("items[0].request_id")
    V = target_pb2.VerifyItem
    onehot = common_pb2.DraftDistribution(format=ONE_HOT)
    bad_verify = [
        (V(request_id="ok", seq_len=2), C.FAILED_PRECONDITION, "items[0].seq_len"),
        (
            V(request_id="ok", seq_len=3, draft_token_ids=[8], draft_probs=[onehot]),
            C.INVALID_ARGUMENT,
            "items[0].draft_token_ids",
        ),
        (
            V(request_id="ok", seq_len=3, draft_token_ids=[1, 2], draft_probs=[onehot]),
            C.INVALID_ARGUMENT,
            "items[0].draft_probs",
        ),
        (
            V(request_id="ok", seq_len=3, draft_token_ids=[1], draft_probs=[common_pb2.DraftDistribution()]),
            C.INVALID_ARGUMENT,
            "items[0].draft_probs[0].format",
        ),
        (
            V(
                request_id="ok",
                seq_len=3,
                draft_token_ids=[1],
                draft_probs=[common_pb2.DraftDistribution(format=DENSE, values=b"\x00\x3c")],
            ),
            C.INVALID_ARGUMENT,
            "items[0].draft_probs[0].values",
        ),
        (
            V(
                request_id="ok",
                seq_len=3,
                draft_token_ids=[1],
                draft_probs=[encode_distribution(torch.tensor([0.5, 0, 0.5, 0, 0, 0, 0, 0]), SPARSE)],
            ),
            C.INVALID_ARGUMENT,
            "items[0].draft_probs[0].values",
        ),  # q(drafted token) == 0
        (
            V(request_id="ok", seq_len=3, draft_token_ids=[1] * MAX_LEN, draft_probs=[onehot] * MAX_LEN),
            C.INVALID_ARGUMENT,
            "items[0].draft_token_ids",
        ),
    ]
    for item, code, field in bad_verify:
        got, details = _code(verify, item)
        assert got == code and details.startswith(field), (code, field, got, details)
    # nothing advanced: a correct verify still sees seq_len 3
    res = verify(V(request_id="ok", seq_len=3)).results[0]
    assert res.num_accepted == 0
    t.Release(target_pb2.TargetReleaseRequest(request_ids=["ok", "never-existed"]))  # unknown ids ignored
    got, details = _code(prefill, P(request_id="never-existed", prompt_token_ids=[1], params=sp))
    assert got == C.FAILED_PRECONDITION and details.startswith("items[0].request_id:"), details  # a late prefill

    # draft worker
    S, PI = common_pb2.StartItem, draft_pb2.ProposeItem

    def start(*items):
        return d.Start(draft_pb2.StartRequest(items=list(items)))

    def propose(*items):
        return d.Propose(draft_pb2.ProposeRequest(items=list(items)))

    draft_cases = [
        (
            lambda: start(S(request_id="a", prompt_token_ids=[1]), S(request_id="a", prompt_token_ids=[1])),
            C.INVALID_ARGUMENT,
            "items[1].request_id",
        ),
        (lambda: start(S(request_id="a", prompt_token_ids=[-1])), C.INVALID_ARGUMENT, "items[0].prompt_token_ids"),
        (
            lambda: start(S(request_id="a", prompt_token_ids=[1] * MAX_LEN)),
            C.INVALID_ARGUMENT,
            "items[0].prompt_token_ids",
        ),
        (
            lambda: start(*[S(request_id=f"s{i}", prompt_token_ids=[1]) for i in range(SLOTS + 1)]),
            C.RESOURCE_EXHAUSTED,
            f"items[{SLOTS}]",
        ),
        (lambda: propose(PI(request_id="zz", seq_len=1)), C.NOT_FOUND, "items[0].request_id"),
    ]
    for fn, code, field in draft_cases:
        got, details = _code(fn)
        assert got == code and details.startswith(field + ":"), (code, field, got, details)
    start(S(request_id="b", prompt_token_ids=[1, 2], params=sp, seed=5))
    for item, code, field in [
        (PI(request_id="b", seq_len=3), C.FAILED_PRECONDITION, "items[0].seq_len"),
        (PI(request_id="b", seq_len=3, num_accepted=1), C.INVALID_ARGUMENT, "items[0].num_accepted"),
        (PI(request_id="b", seq_len=3, new_token_ids=[8]), C.INVALID_ARGUMENT, "items[0].new_token_ids"),
        (PI(request_id="b", seq_len=2, num_tokens=MAX_LEN), C.INVALID_ARGUMENT, "items[0].num_tokens"),
    ]:
        got, details = _code(propose, item)
        assert got == code and details.startswith(field), (code, field, got, details)
    got, _ = _code(start, S(request_id="b", prompt_token_ids=[1]))
    assert got == C.ALREADY_EXISTS
    assert len(propose(PI(request_id="b", seq_len=2, num_tokens=2)).proposals[0].token_ids) == 2
    d.Release(draft_pb2.DraftReleaseRequest(request_ids=["b"]))
    assert workers["target"].kv_slots_in_use() == 0 and workers["model"].kv_slots_in_use() == 0
    assert workers["target"].health()["ok"] and workers["model"].health()["requests"] == 0


def test_shipped_q_is_the_sampled_q(workers):
    """A sampled model draft ships fp16_exact(processed q), which decodes bit for bit on the target side.

    Over gRPC with the caller's preferred format (DENSE, SPARSE); the same core called directly
    with the same seed drafts the same token from a q (``Proposal.q``) that the shipped message
    decodes to exactly, bit for bit.
    """
    from specdist.transport.protocol import ProposeItem, StartItem
    from specdist.transport.wire import decode_distribution, fp16_exact

    stub, core = workers["model_stub"], workers["model"]
    prompt = [3, 1, 4]
    for top_k, fmt in ((0, DENSE), (2, SPARSE)):
        params = SamplingParams(temperature=0.7, top_k=top_k)
        stub.Start(
            draft_pb2.StartRequest(
                items=[
                    common_pb2.StartItem(
                        request_id="q", prompt_token_ids=prompt, params=sampling_params_to_proto(params), seed=3
                    )
                ]
            )
        )
        prop = stub.Propose(
            draft_pb2.ProposeRequest(
                items=[draft_pb2.ProposeItem(request_id="q", num_tokens=1, seq_len=len(prompt), preferred_format=fmt)]
            )
        ).proposals[0]
        stub.Release(draft_pb2.DraftReleaseRequest(request_ids=["q"]))
        with torch.inference_mode():
            logits = core.runner.model(torch.tensor([prompt])).logits[0, -1:]
        q = process_logits(logits, torch.tensor([0.7]), torch.tensor([top_k]), torch.ones(1))[0]
        got = decode_distribution(prop.probs[0], core.vocab_size, prop.token_ids[0])
        assert prop.probs[0].format == fmt
        assert torch.allclose(got, fp16_exact(q), atol=2e-3)  # batched vs HF forward: rounding only
        assert got[prop.token_ids[0]] > 0

        # the core itself, same seed: same token, and the q it sampled from is what the wire decodes to
        core.start([StartItem("q-direct", prompt, params, 3)])
        try:
            [direct], timing = core.propose([ProposeItem("q-direct", 0, [], 1, len(prompt))])
        finally:
            core.release(["q-direct"])
        assert direct.token_ids == list(prop.token_ids) and direct.wire is None
        assert (
            direct.q is not None and direct.q.dtype == torch.float32 and tuple(direct.q.shape) == (1, core.vocab_size)
        )
        assert torch.equal(got, direct.q[0])  # bit for bit
        assert torch.equal(direct.q, fp16_exact(direct.q))  # already fp16-exact: the wire carries it unchanged
        assert timing.phases.get("draft", 0) > 0
    assert core.kv_slots_in_use() == 0 and not core.requests


def _timing_metadata(call) -> dict[str, float]:
    """The core's per-phase seconds a servicer sent in the ``specdist-timing`` trailing metadata."""
    from specdist.transport.remote import TIMING_METADATA_KEY

    values = [v for k, v in (call.trailing_metadata() or ()) if k == TIMING_METADATA_KEY]
    if not values:
        return {}
    assert len(values) == 1
    return {k: float(v) for k, v in (kv.split("=") for kv in values[0].split(","))}


def test_servicers_report_core_timing_in_trailing_metadata(workers):
    """Each call's core seconds travel back as ``specdist-timing`` (the engine books the rest of
    the wall time as network); Release does no timed work and sends none."""
    t, d = workers["target_stub"], workers["model_stub"]
    sp = sampling_params_to_proto(SamplingParams(temperature=0.0))
    _, call = t.Prefill.with_call(
        target_pb2.PrefillRequest(
            items=[common_pb2.StartItem(request_id="tm", prompt_token_ids=[1, 2, 3], params=sp, seed=1)]
        )
    )
    assert set(_timing_metadata(call)) == {"prefill"}
    _, call = d.Start.with_call(
        draft_pb2.StartRequest(
            items=[common_pb2.StartItem(request_id="tm", prompt_token_ids=[1, 2, 3], params=sp, seed=draft_seed(1))]
        )
    )
    assert set(_timing_metadata(call)) == {"prefill"}
    prop, call = d.Propose.with_call(
        draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(request_id="tm", num_tokens=2, seq_len=3)])
    )
    assert set(_timing_metadata(call)) == {"draft"} and _timing_metadata(call)["draft"] > 0
    p = prop.proposals[0]
    _, call = t.Verify.with_call(
        target_pb2.VerifyRequest(
            items=[target_pb2.VerifyItem(request_id="tm", seq_len=3, draft_token_ids=p.token_ids, draft_probs=p.probs)]
        )
    )
    phases = _timing_metadata(call)
    assert set(phases) == {"forward", "sampling", "cache"} and phases["forward"] > 0
    assert all(v >= 0 for v in phases.values())
    _, call = t.Release.with_call(target_pb2.TargetReleaseRequest(request_ids=["tm"]))
    assert _timing_metadata(call) == {}
    _, call = d.Release.with_call(draft_pb2.DraftReleaseRequest(request_ids=["tm"]))
    assert _timing_metadata(call) == {}
    assert workers["target"].kv_slots_in_use() == 0 and workers["model"].kv_slots_in_use() == 0


def test_cores_take_dataclasses_and_validate_whole_batches(workers):
    """The cores themselves, called with the transport dataclasses: field errors name
    ``items[i]...`` and the status the servicers answer with; a failed call changes nothing."""
    from specdist.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
    from specdist.transport.protocol import Proposal, ProposeItem, StartItem, Verified, VerifyItem

    target, draft = workers["target"], workers["model"]
    sp = SamplingParams(temperature=0.0)

    def raises(exc, field, fn, *args):
        with pytest.raises(exc) as ei:
            fn(*args)
        assert ei.value.field == field, (field, str(ei.value))

    for core in (target, draft):
        start = core.prefill if core is target else core.start
        raises(InvalidArgument, "items[1].request_id", start, [StartItem("c", [1], sp, 1), StartItem("c", [2], sp, 1)])
        raises(
            InvalidArgument,
            "items[1].prompt_token_ids",
            start,
            [StartItem("c", [1], sp, 1), StartItem("c2", [1, 8], sp, 1)],
        )
        raises(ResourceExhausted, f"items[{SLOTS}]", start, [StartItem(f"c{i}", [1], sp, 1) for i in range(SLOTS + 1)])
        assert core.kv_slots_in_use() == 0 and not core.requests  # all or nothing: "c" was not admitted

    target.prefill([StartItem("c", [1, 2, 3], sp, 1)])
    draft.start([StartItem("c", [1, 2, 3], sp, draft_seed(1))])
    raises(AlreadyExists, "items[0].request_id", target.prefill, [StartItem("c", [1], sp, 1)])
    raises(AlreadyExists, "items[0].request_id", draft.start, [StartItem("c", [1], sp, 1)])
    raises(
        NotFound, "items[1].request_id", draft.propose, [ProposeItem("c", 0, [], 1, 3), ProposeItem("x", 0, [], 1, 1)]
    )
    raises(FailedPrecondition, "items[0].seq_len", draft.propose, [ProposeItem("c", 0, [], 1, 4)])
    raises(InvalidArgument, "items[0].num_accepted", draft.propose, [ProposeItem("c", 1, [], 1, 3)])
    [p], _ = draft.propose([ProposeItem("c", 0, [], 2, 3)])
    assert len(p) == 2 and p.q is None  # greedy: one-hot q, no tensor
    raises(NotFound, "items[1].request_id", target.verify, [VerifyItem("c", 3, p), VerifyItem("x", 1)])
    raises(FailedPrecondition, "items[0].seq_len", target.verify, [VerifyItem("c", 2, p)])
    raises(InvalidArgument, "items[0].draft_token_ids", target.verify, [VerifyItem("c", 3, Proposal("c", [1, 8]))])
    raises(
        InvalidArgument,
        "items[0].draft_probs",
        target.verify,
        [VerifyItem("c", 3, Proposal("c", [1, 2], q=torch.full((1, target.vocab_size), 0.125)))],
    )
    # nothing advanced: the valid call still sees seq_len 3 on both sides
    [v], timing = target.verify([VerifyItem("c", 3, p)])
    assert isinstance(v, Verified) and v.request_id == "c" and 0 <= v.num_accepted <= 2
    assert set(timing.phases) == {"forward", "sampling", "cache"} and timing.total > 0
    seq_len = 3 + v.num_accepted + 1
    [p2], _ = draft.propose([ProposeItem("c", v.num_accepted, [v.next_token], 0, seq_len)])  # commit only
    assert len(p2) == 0
    assert target.requests["c"].seq == draft.requests["c"].seq and len(draft.requests["c"].seq) == seq_len
    target.release(["c", "never-existed"])
    draft.release(["c", "never-existed"])
    target.release(["c"])  # idempotent
    assert target.kv_slots_in_use() == 0 and draft.kv_slots_in_use() == 0
    # a start that arrives after its release (its caller gave up on it) is refused, the whole call
    # with it, and holds nothing; an id released while held may start again
    raises(
        FailedPrecondition,
        "items[1].request_id",
        target.prefill,
        [StartItem("late-ok", [1], sp, 1), StartItem("never-existed", [1, 2], sp, 1)],
    )
    raises(FailedPrecondition, "items[0].request_id", draft.start, [StartItem("never-existed", [1, 2], sp, 1)])
    assert not target.requests and not draft.requests
    assert target.kv_slots_in_use() == 0 and draft.kv_slots_in_use() == 0
    for _ in range(2):
        target.prefill([StartItem("again", [1, 2], sp, 1)])
        draft.start([StartItem("again", [1, 2], sp, draft_seed(1))])
        target.release(["again"])
        draft.release(["again"])
    assert target.kv_slots_in_use() == 0 and draft.kv_slots_in_use() == 0


def test_local_and_remote_transports_raise_the_same_errors(workers):
    """LocalVerifier / LocalDrafter (direct calls) and RemoteVerifier / RemoteDrafter (gRPC to the
    servicers of the same cores) turn a core's field error into one TransportError: the gRPC
    code, the blamed item and its request id; errors naming no item blame the whole call."""
    from specdist.cores.draft import LocalDrafter
    from specdist.cores.target import LocalVerifier
    from specdist.transport.protocol import ProposeItem, StartItem, TransportError
    from specdist.transport.remote import RemoteDrafter, RemoteVerifier

    sp = SamplingParams(temperature=0.0)
    target, draft = workers["target"], workers["model"]
    remote_v = RemoteVerifier(workers["target_address"], target.vocab_size, timeout_s=30)
    remote_d = RemoteDrafter(workers["model_address"], timeout_s=30)
    pairs = [(LocalVerifier(target), remote_v, "prefill"), (LocalDrafter(draft), remote_d, "start")]
    try:
        for local, remote, start in pairs:
            cases = [
                ([StartItem("e0", [1], sp, 1), StartItem("e1", [1, 99], sp, 1)], "INVALID_ARGUMENT", 1, ["e1"]),
                (
                    [StartItem(f"e{i}", [1], sp, 1) for i in range(SLOTS + 1)],
                    "RESOURCE_EXHAUSTED",
                    SLOTS,
                    [f"e{SLOTS}"],
                ),  # the first request with no room: the ones before it fit
            ]
            for items, code, item, ids in cases:
                errs = []
                for transport in (local, remote):
                    with pytest.raises(TransportError) as ei:
                        getattr(transport, start)(items)
                    errs.append(ei.value)
                for e in errs:
                    assert (e.code, e.item, e.request_ids) == (code, item, ids), (e.code, e.item, e.request_ids, str(e))
                assert str(errs[0]) in str(errs[1])  # the remote message is the core's, after the address
        # a remote call that succeeds returns the core's timing from the trailing metadata
        assert set(remote_v.prefill([StartItem("ok", [1, 2], sp, 1)])[1].phases) == {"prefill"}
        assert set(remote_d.start([StartItem("ok", [1, 2], sp, draft_seed(1))]).phases) == {"prefill"}
        for transport in (LocalDrafter(draft), remote_d):
            with pytest.raises(TransportError) as ei:
                transport.propose([ProposeItem("ok", 0, [], 1, 2), ProposeItem("gone", 0, [], 1, 2)])
            assert (ei.value.code, ei.value.item, ei.value.request_ids) == ("NOT_FOUND", 1, ["gone"])
        [p], timing = remote_d.propose([ProposeItem("ok", 0, [], 1, 2)])
        assert len(p) == 1 and p.wire is not None and set(timing.phases) == {"draft"}
    finally:
        remote_v.release(["ok"])
        remote_d.release(["ok"])
        remote_v.close()
        remote_d.close()
    assert target.kv_slots_in_use() == 0 and draft.kv_slots_in_use() == 0


# ---------------------------------------------------------------- tensor parallel (2 ranks)
TP_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tensor_parallel_target_over_grpc(workers, tiny_models, tmp_path):
    from specdist.engine.local import Engine

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    want = [
        o.token_ids for o in Engine.from_config(tiny_config(tiny_models, method="model", k=K)).generate(PROMPTS, params)
    ]

    dist_port, grpc_port = _free_port(), _free_port()
    logs = [str(tmp_path / f"tp_rank{r}.log") for r in range(2)]
    stop = rank_procs.event()
    procs = rank_procs.start_ranks(
        _tp_rank, lambda r: (r, 2, dist_port, grpc_port, tiny_models["target"], stop), 2, logs
    )
    chan = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        grpc.channel_ready_future(chan).result(timeout=TP_TIMEOUT_S)
        got, _ = run_generation(
            target_pb2_grpc.TargetWorkerStub(chan), workers["model_stub"], PROMPTS, params, workers["eos"], prefix="tp"
        )
        assert got == want
        stop.set()  # rank 0 shuts down and releases rank 1
        rank_procs.join_ranks(procs, 30)
        assert [p.exitcode for p in procs] == [0, 0]
    except BaseException:
        print("\n".join(f"--- rank {r} ---\n{open(f).read()[-3000:]}" for r, f in enumerate(logs)))
        raise
    finally:
        chan.close()
        rank_procs.join_ranks(procs, 0)  # kills what is still running
    assert workers["model"].kv_slots_in_use() == 0


def _tp_rank(rank: int, world_size: int, dist_port: int, grpc_port: int, ckpt: str, stop) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from specdist.models.sharding import load_sharded
    from workers.tensor_parallel import broadcast_object, init_process_group

    init_process_group(rank, world_size, "127.0.0.1", dist_port, "cpu")
    model = load_sharded(ModelSource(ckpt, None), "float32", "cpu", rank, world_size)

    core = VerifierCore(CausalLMRunner(model, SLOTS, MAX_LEN), rank, world_size, broadcast=broadcast_object)
    if rank == 0:
        servicer = TargetServicer(core)
        server = host_servicer(servicer, grpc_port)
        stop.wait()  # serve until the test sets it
        server.stop(0)
        servicer.shutdown()
        assert core.kv_slots_in_use() == 0 and core.closed
    else:
        forwards = core.follow()
        assert forwards > 0  # it replayed rank 0's forwards (the all-reduces need every rank)
        assert core.kv_slots_in_use() == 0  # releases reached the follower before shutdown
    dist.barrier()
    dist.destroy_process_group()
