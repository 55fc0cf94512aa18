"""Steps that keep failing turn readiness NOT_SERVING until one succeeds.

A core that fails every step (here: the engine's step raising, as a full disk under ``engine.compile: on``
would) fails each batch; after ``STEP_FAILURES_NOT_READY`` failures in a row the gRPC health service and HTTP
/health say the server is not ready, while liveness stays SERVING and requests are still admitted. The first
step that succeeds makes it ready again.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

try:  # the [http] extra's client (as tests/engine/test_security.py)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, tiny_config, wait_until

from specdist import Engine
from specdist.api.serving import Backend, start_serving
from specdist.client import RemoteError, SpecDistClient
from specdist.transport.grpc_host import LIVENESS

pytestmark = pytest.mark.usefixtures("one_thread")
FAILURES = 3  # specdist.api.engine_thread.STEP_FAILURES_NOT_READY


def test_repeated_step_failures_turn_readiness_off_until_a_step_succeeds(tiny_models):
    lt = LoopThread()
    engine = Engine.from_config(tiny_config(tiny_models, "none"))
    real_step, failing = engine.step, [False]

    def step():
        if failing[0]:
            raise OSError(28, "No space left on device")
        return real_step()

    engine.step = step
    serving = lt.run(start_serving(backend=Backend(engine), host="127.0.0.1", port=0, drain_seconds=0, http_port=0))
    channel = grpc.insecure_channel(serving.address)
    health = health_pb2_grpc.HealthStub(channel)
    client = SpecDistClient(channel)
    http = httpx.Client(base_url=f"http://{serving.http.address}", trust_env=False, timeout=30)

    def status(service: str = "") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    try:
        assert status() == health_pb2.HealthCheckResponse.SERVING and http.get("/health").status_code == 200
        failing[0] = True
        for i in range(FAILURES):
            assert status() == health_pb2.HealthCheckResponse.SERVING, i  # fewer failures: still ready
            with pytest.raises(RemoteError) as e:  # each failing request is still admitted, and fails
                client.generate_text([1, 2], max_tokens=2)
            assert e.value.code == grpc.StatusCode.INTERNAL
        wait_until("health NOT_SERVING", lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        assert status("specdist.v1.SpecDecode") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert status(LIVENESS) == health_pb2.HealthCheckResponse.SERVING  # no restart: it may recover
        r = http.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "steps failing"}
        failing[0] = False
        assert client.generate_text([1, 2], max_tokens=2)[2] in ("length", "stop")  # admitted, and now served
        wait_until("health SERVING again", lambda: status() == health_pb2.HealthCheckResponse.SERVING, 10)
        assert http.get("/health").status_code == 200
    finally:
        http.close()
        channel.close()
        lt.run(serving.stop())
        lt.close()
