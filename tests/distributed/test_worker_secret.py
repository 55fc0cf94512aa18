"""Worker ports require the deployment's worker secret (issue 11: a process on the network
cannot call Verify or Propose).

The target and draft actors run in this process (no Ray): the same ``start_grpc`` a deployment
calls, with a secret. Every worker method refuses a call without it or with a wrong one
(UNAUTHENTICATED, the core untouched, nothing echoed), health stays open, and the
RemoteEngine holding the secret generates the in-process Engine's tokens. The conftest's
ServedCores takes the same secret. The Ray deployment's own ports are checked in
tests/distributed/test_deployment.py.
"""

from __future__ import annotations

import grpc
import pytest
from support.helpers import remote_engine_like, tiny_config

from specdist.engine.local import Engine
from specdist.engine.remote import RemoteEngine
from specdist.sampling_params import SamplingParams
from specdist.sampling_proto import sampling_params_to_proto
from specdist.transport.protocol import StartItem, TransportError
from specdist.transport.remote import RemoteDrafter, RemoteVerifier
from specdist.transport.security import bearer_metadata, new_worker_secret
from specdist.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

K, MAX_LEN = 3, 64
PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 6, 5, 6, 5, 6, 5]]
MAX_TOKENS = [12, 6, 15]
SECRET = new_worker_secret()


@pytest.fixture(scope="module")
def actors(tiny_models):
    """A target rank and a model draft actor, in process, serving on 127.0.0.1 with SECRET."""
    from workers.actors import DraftActor, TargetRankActor

    target = TargetRankActor(0, 1, num_threads=None)  # None: leave this process's torch threads alone
    draft = DraftActor(0, num_threads=None)
    try:
        target.load(tiny_models["target"], engine={"max_batch_size": 8, "max_model_len": MAX_LEN})
        draft.load(
            {"method": "model", "model": tiny_models["draft"], "num_speculative_tokens": K},
            tiny_models["target"],
            {"max_batch_size": 8, "max_model_len": MAX_LEN},
            device="cpu",
        )
        target_address = target.start_grpc("127.0.0.1", 0, SECRET)
        draft_address = draft.start_grpc("127.0.0.1", 0, SECRET)
        yield target, draft, target_address, draft_address
    finally:
        target.shutdown()
        draft.shutdown()


def _calls(target_address: str, draft_address: str):
    """(name, channel, stub method, a valid request) for every worker method."""
    sp = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=4))
    t_chan, d_chan = grpc.insecure_channel(target_address), grpc.insecure_channel(draft_address)
    t, d = target_pb2_grpc.TargetWorkerStub(t_chan), draft_pb2_grpc.DraftWorkerStub(d_chan)
    calls = [
        (
            "Prefill",
            t.Prefill,
            target_pb2.PrefillRequest(
                items=[common_pb2.StartItem(request_id="intruder", prompt_token_ids=[1, 2], params=sp, seed=1)]
            ),
        ),
        (
            "Verify",
            t.Verify,
            target_pb2.VerifyRequest(
                items=[target_pb2.VerifyItem(request_id="intruder", draft_token_ids=[3], seq_len=2)]
            ),
        ),
        ("target Release", t.Release, target_pb2.TargetReleaseRequest(request_ids=["intruder"])),
        (
            "Start",
            d.Start,
            draft_pb2.StartRequest(
                items=[common_pb2.StartItem(request_id="intruder", prompt_token_ids=[1, 2], params=sp, seed=1)]
            ),
        ),
        (
            "Propose",
            d.Propose,
            draft_pb2.ProposeRequest(items=[draft_pb2.ProposeItem(request_id="intruder", num_tokens=2, seq_len=2)]),
        ),
        ("draft Release", d.Release, draft_pb2.DraftReleaseRequest(request_ids=["intruder"])),
    ]
    return (t_chan, d_chan), calls


def test_worker_methods_refuse_calls_without_the_secret(actors):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target, draft, target_address, draft_address = actors
    wrong = new_worker_secret()
    refusals = {
        "no metadata": None,
        "wrong secret": bearer_metadata(wrong),
        "secret without the Bearer scheme": (("authorization", SECRET),),
        "secret in another header": (("x-specdist-secret", SECRET),),
    }
    chans, calls = _calls(target_address, draft_address)
    try:
        for name, method, request in calls:
            for how, metadata in refusals.items():
                with pytest.raises(grpc.RpcError) as ei:
                    method(request, timeout=30, metadata=metadata)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, how, ei.value.details())
                details = ei.value.details() or ""
                assert SECRET not in details and wrong not in details, (name, how)
        # nothing reached the cores: a Prefill / Start that ran would hold the request
        assert target.worker.requests == {} and draft.worker.requests == {}
        for chan in chans:  # health stays open for probes
            status = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        # with the secret the same calls reach the cores (Verify before any Prefill: the core's error)
        t_stub = target_pb2_grpc.TargetWorkerStub(chans[0])
        with pytest.raises(grpc.RpcError) as ei:
            t_stub.Verify(calls[1][2], timeout=30, metadata=bearer_metadata(SECRET))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND and "intruder" in ei.value.details()
    finally:
        for chan in chans:
            chan.close()


def test_remote_stubs_without_the_secret_get_unauthenticated(actors):
    _, _, target_address, draft_address = actors
    item = StartItem("no-secret", [1, 2], SamplingParams(temperature=0.0, max_tokens=4), 1)
    verifier, drafter = RemoteVerifier(target_address, 8, timeout_s=30), RemoteDrafter(draft_address, timeout_s=30)
    try:
        for call in (lambda: verifier.prefill([item]), lambda: drafter.start([item])):
            with pytest.raises(TransportError) as ei:
                call()
            assert ei.value.code == "UNAUTHENTICATED" and ei.value.request_ids == ["no-secret"]
    finally:
        verifier.close()
        drafter.close()


def test_remote_engine_with_the_secret_generates_like_the_engine(actors, tiny_models):
    target, draft, target_address, draft_address = actors
    cfg = tiny_config(tiny_models, method="model", k=K)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    want = [o.token_ids for o in Engine.from_config(cfg).generate(PROMPTS, params)]
    with RemoteEngine.from_addresses(cfg, target_address, [draft_address], worker_secret=SECRET) as remote:
        outs = remote.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.drafted for o in outs) > 0  # the draft worker took part
    assert target.worker.requests == {} and draft.worker.requests == {}


def test_served_cores_with_a_secret(tiny_models):
    """The test helper's servers require the secret too; remote_engine_like hands it to both sides."""
    engine = Engine.from_config(tiny_config(tiny_models, method="model", k=K))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    want = [o.token_ids for o in engine.generate(PROMPTS, params)]
    remote, served = remote_engine_like(engine, secret=SECRET)
    try:
        assert [o.token_ids for o in remote.generate(PROMPTS, params)] == want
        chans, calls = _calls(served.target_address, served.draft_addresses[0])
        try:
            for name, method, request in calls:
                with pytest.raises(grpc.RpcError) as ei:
                    method(request, timeout=30)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        finally:
            for chan in chans:
                chan.close()
    finally:
        remote.close()
        served.close()


def test_deployment_secret_is_fresh_and_not_in_its_repr():
    from cluster.deployment import Deployment

    a, b = new_worker_secret(), new_worker_secret()
    assert len(a) == 64 and int(a, 16) >= 0 and a != b  # 32 random bytes, hex
    assert a not in repr(Deployment(worker_secret=a))
