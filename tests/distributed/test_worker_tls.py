"""Worker links are mutual TLS under a CA each deployment makes (specdist.transport.worker_tls), issue 53's
plaintext worker links.

The target and draft actors run in this process (no Ray), served by the same ``start_grpc`` a deployment calls,
with its secret and a fresh :class:`WorkerTLS`. A plaintext client fails its handshake (the health service too,
which needs no token: the refusal is the transport's), so does a client showing a certificate of another CA (or
none), and a client trusting another CA refuses the worker; the coordinator's transports over the deployment's
TLS give the in-process Engine's tokens. The Ray deployment's own ports: tests/distributed/test_worker_faults.py.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.helpers import tiny_config

from specdist.engine.local import Engine
from specdist.engine.remote import RemoteEngine
from specdist.sampling_params import SamplingParams
from specdist.transport.security import new_worker_secret
from specdist.transport.worker_tls import WORKER_NAME, WorkerTLS

K, MAX_LEN = 3, 64
SECRET = new_worker_secret()
TLS = WorkerTLS.generate()


@pytest.fixture(scope="module")
def served(tiny_models):
    """A target rank and a model draft actor, in process, serving on 127.0.0.1 with SECRET over TLS."""
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
        yield target.start_grpc("127.0.0.1", 0, SECRET, TLS), draft.start_grpc("127.0.0.1", 0, SECRET, TLS)
    finally:
        target.shutdown()
        draft.shutdown()


def _health(channel: grpc.Channel):
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def _refused(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _health(channel)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()


def test_the_deployments_certificate_gets_in_anything_else_fails_the_handshake(served):
    other = WorkerTLS.generate()  # another deployment's CA and certificate
    override = [("grpc.ssl_target_name_override", WORKER_NAME)]
    for address in served:
        assert _health(TLS.channel(address)) == health_pb2.HealthCheckResponse.SERVING
        _refused(grpc.insecure_channel(address))  # plaintext
        # trusting the worker, showing another CA's certificate, or none
        _refused(grpc.secure_channel(address, grpc.ssl_channel_credentials(TLS.ca, other.key, other.cert), override))
        _refused(grpc.secure_channel(address, grpc.ssl_channel_credentials(TLS.ca), override))
        _refused(other.channel(address))  # a client of another deployment does not trust this worker either


def test_the_coordinator_over_the_deployments_tls_gives_the_engines_tokens(served, tiny_models):
    cfg = tiny_config(tiny_models, method="model", k=K)
    prompts, params = [[1, 2, 3, 1, 2], [4]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in Engine.from_config(cfg).generate(prompts, params)]
    target_address, draft_address = served
    with RemoteEngine.from_addresses(
        cfg, target_address, [draft_address], worker_secret=SECRET, worker_tls=TLS
    ) as remote:
        assert [o.token_ids for o in remote.generate(prompts, params)] == want


def test_each_generate_makes_a_fresh_ca_and_the_key_stays_out_of_repr():
    a, b = WorkerTLS.generate(), WorkerTLS.generate()
    assert len({a.ca, b.ca}) == 2 and len({a.key, b.key}) == 2
    assert a.key.decode() not in repr(a) and b"PRIVATE KEY" in a.key
