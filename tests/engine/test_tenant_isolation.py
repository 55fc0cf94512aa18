"""Tenants behind one proxy connection, and what the server shares between tenants by default.

- Request ids: a proxy that multiplexes its clients onto one HTTP/2 connection sends every tenant's calls from
  one peer address; ids are scoped by tenant as well as by connection, so tenant B neither learns that A's id is
  live (ALREADY_EXISTS) nor cancels A's request by it.
- The prompt K/V cache: ``engine.prefix_cache_scope`` is ``tenant`` unless ``shared`` is asked for, and a server
  with several tenants says on stderr at start which one it runs.
- What shows every tenant's traffic (/metrics on the HTTP port and the metrics port, GetServerInfo's counters)
  needs the admin token (``--admin-token-file``); a tenant's token is refused it.
- Places: ``limits.max_queued_per_tenant`` (by default half of ``max_queued`` with several tenants): a tenant at its
  quota is refused (gRPC RESOURCE_EXHAUSTED, HTTP 429) while another tenant is still admitted.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

try:  # the [http] extra's client (as tests/engine/test_security.py)
    import httpx2 as httpx
except ImportError:
    import httpx

from support.helpers import LoopThread, tiny_config, wait_until

from specdist import Engine
from specdist.api.grpc_server import serve
from specdist.api.serving import Backend, start_serving
from specdist.client import RemoteError, SpecDistClient
from specdist.transport.security import ServerSecurity
from specdist.v1 import common_pb2, specdist_pb2, specdist_pb2_grpc

pytestmark = pytest.mark.usefixtures("one_thread")

TOKEN_A, TOKEN_B = "tenant-a-token-0123456789", "tenant-b-token-0123456789"
ADMIN = "admin-token-0123456789abcdef"


class Hold:
    """Wraps engine.step (called on the coordinator's engine thread only): while ``when(engine)`` is true a step
    does nothing (commands such as adds and aborts still run between steps)."""

    def __init__(self, engine: Engine):
        self.engine, self.real_step, self.when = engine, engine.step, None
        engine.step = self.step

    def step(self):
        when = self.when
        if when is not None and when(self.engine):
            time.sleep(0.001)
            return []
        return self.real_step()


class Served:
    """A started server, its coordinator and Hold, and the one channel the tests share."""

    def __init__(self, lt, server, coordinator, hold, channel):
        self.lt, self.server, self.coordinator, self.hold, self.channel = lt, server, coordinator, hold, channel

    def live(self) -> int:
        return self.coordinator.counters()["live_requests"]  # (a racy read of a dict's size: fine)


@pytest.fixture(scope="module")
def two_tenants(tiny_models):
    """A gRPC server with two tenant tokens, its engine held by a Hold, and one channel both tenants use."""
    lt = LoopThread()
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    hold = Hold(engine)
    server, coordinator = lt.run(serve(engine, "127.0.0.1", 0, security=ServerSecurity(token=(TOKEN_A, TOKEN_B))))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")  # one connection: what a multiplexing proxy has
    try:
        yield Served(lt, server, coordinator, hold, channel)
    finally:
        hold.when = None
        channel.close()
        lt.run(server.stop(0))
        lt.close()


def test_a_tenant_on_the_same_connection_neither_sees_nor_cancels_anothers_request_id(two_tenants):
    s = two_tenants
    a, b = SpecDistClient(s.channel, token=TOKEN_A), SpecDistClient(s.channel, token=TOKEN_B)
    s.hold.when = lambda eng: any(len(r.output.token_ids) >= 2 for r in eng.running)
    try:
        gen = a.generate([1, 2], max_tokens=20, temperature=0, ignore_eos=True, request_id="x")
        assert next(gen).request_id == "x"
        with pytest.raises(RemoteError) as e:  # B's Cancel(x) does not reach A's request
            b.cancel("x")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        theirs: list = []

        def b_generates() -> None:
            try:
                theirs.extend(b.generate([3, 1], max_tokens=2, temperature=0, request_id="x"))
            except RemoteError as err:  # ALREADY_EXISTS would tell B that A's id is live
                theirs.append(err)

        t = threading.Thread(target=b_generates)
        t.start()
        wait_until("B's request admitted beside A's (or refused)", lambda: s.live() == 2 or theirs, 10)
        s.hold.when = None
        t.join(30)
        assert theirs and not isinstance(theirs[-1], Exception), theirs
        assert theirs[-1].finish_reason == "length" and theirs[-1].request_id == "x"
        assert list(gen)[-1].finish_reason == "length"  # A's request ran to its end: not aborted by B
        # A cancels its own id on the shared connection
        s.hold.when = lambda eng: any(len(r.output.token_ids) >= 2 for r in eng.running)
        gen = a.generate([1, 2], max_tokens=20, temperature=0, ignore_eos=True, request_id="y")
        next(gen)
        a.cancel("y")
        assert list(gen)[-1].finish_reason == "abort"
    finally:
        s.hold.when = None


def test_the_prefix_cache_is_per_tenant_unless_shared_is_asked_for():
    from specdist.config import load_config, tenant_scope_line

    assert load_config({}).engine.prefix_cache_scope == "tenant"
    shared = load_config({"engine": {"prefix_cache_scope": "shared"}})
    assert shared.engine.prefix_cache_scope == "shared"
    # one tenant (one token or none): nothing to say; several: the scope in one line, a warning when shared
    assert tenant_scope_line(load_config({}), 1) is None
    line = tenant_scope_line(load_config({}), 3)
    assert "3 tenants" in line and "engine.prefix_cache_scope: tenant" in line and "\n" not in line
    line = tenant_scope_line(shared, 2)
    assert line.startswith("warning: ") and "engine.prefix_cache_scope: shared" in line and "\n" not in line
    line = tenant_scope_line(load_config({"draft": {"method": "suffix", "suffix_scope": "shared"}}), 2)
    assert line.startswith("warning: ") and "draft.suffix_scope: shared" in line


def test_a_server_with_several_tenants_says_its_scopes_at_start(tiny_models, capfd):
    lt = LoopThread()
    try:
        for tokens, want in (((TOKEN_A, TOKEN_B), "2 tenants"), (TOKEN_A, None)):
            engine = Engine.from_config(tiny_config(tiny_models, "none"))
            capfd.readouterr()
            server, _ = lt.run(serve(engine, "127.0.0.1", 0, security=ServerSecurity(token=tokens)))
            lt.run(server.stop(0))
            lines = [ln for ln in capfd.readouterr().err.splitlines() if "prefix_cache_scope" in ln]
            if want is None:
                assert lines == []
            else:
                assert len(lines) == 1 and want in lines[0] and "engine.prefix_cache_scope: tenant" in lines[0]
    finally:
        lt.close()


QUOTA, MAX_QUEUED = 2, 8


@pytest.fixture(scope="module")
def front_doors(tiny_models):
    """``specdist serve``'s ports in process (gRPC, HTTP API, metrics) with two tenant tokens and an admin token, a
    tenant quota of QUOTA of MAX_QUEUED places, and the engine held by a Hold."""
    lt = LoopThread()
    engine = Engine.from_config(dict(tiny_config(tiny_models, "model", 3), limits={"max_queued_per_tenant": QUOTA}))
    hold = Hold(engine)
    serving = lt.run(
        start_serving(
            backend=Backend(engine),
            host="127.0.0.1",
            port=0,
            drain_seconds=1,
            max_queued=MAX_QUEUED,
            http_port=0,
            metrics_port=0,
            security=ServerSecurity(token=(TOKEN_A, TOKEN_B), admin_token=ADMIN),
        )
    )
    channel = grpc.insecure_channel(serving.address)
    try:
        yield Served(lt, serving, serving.server.coordinator, hold, channel)
    finally:
        hold.when = None
        channel.close()
        lt.run(serving.stop())
        lt.close()


def test_a_tenant_at_its_quota_is_refused_while_another_is_admitted(front_doors):
    from specdist.config import load_config
    from specdist.errors import ConfigError

    limits = load_config({}).limits
    assert limits.tenant_quota(8, 2) == 4 and limits.tenant_quota(7, 3) == 4 and limits.tenant_quota(8, 1) is None
    assert load_config({"limits": {"max_queued_per_tenant": 3}}).limits.tenant_quota(8, 1) == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="limits.max_queued_per_tenant"):
            load_config({"limits": {"max_queued_per_tenant": bad}})

    s = front_doors
    stub = specdist_pb2_grpc.SpecDecodeStub(s.channel)
    http = httpx.Client(base_url=f"http://{s.server.http.address}", trust_env=False, timeout=60)
    auth = {k: {"authorization": f"Bearer {t}"} for k, t in (("a", TOKEN_A), ("b", TOKEN_B))}

    def call(token: str, n: int, timeout: float | None = None):
        request = specdist_pb2.GenerateRequest(
            token_ids=specdist_pb2.TokenIds(ids=[1, 2]),
            params=common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        )
        return stub.Generate(
            request,
            metadata=(("authorization", f"Bearer {token}"),),  # started: not read yet
            timeout=timeout,
        )

    s.hold.when = lambda eng: True  # nothing advances: every request stays live
    outcomes: dict = {}
    threads = []
    try:
        held = [call(TOKEN_A, 3) for _ in range(QUOTA)]
        wait_until("tenant A's requests live", lambda: s.live() == QUOTA, 10)
        with pytest.raises(grpc.RpcError) as e:  # (admitted, it would wait for the hold: DEADLINE_EXCEEDED)
            list(call(TOKEN_A, 3, timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_per_tenant" in e.value.details()
        r = http.post(
            "/v1/completions",
            json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True},
            headers=auth["a"],
            timeout=10,
        )
        assert r.status_code == 429 and "max_queued_per_tenant" in r.json()["error"]["message"], r.text
        # tenant B is admitted, on gRPC and HTTP, though A holds its quota
        threads = [
            threading.Thread(target=lambda: outcomes.__setitem__("grpc", list(call(TOKEN_B, 3))[-1])),
            threading.Thread(
                target=lambda: outcomes.__setitem__(
                    "http",
                    http.post(
                        "/v1/completions",
                        json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True},
                        headers=auth["b"],
                    ),
                )
            ),
        ]
        for t in threads:
            t.start()
        wait_until("tenant B's requests live beside A's", lambda: s.live() == QUOTA + 2, 10)
    finally:
        s.hold.when = None
        for t in threads:
            t.join(60)
    assert outcomes["grpc"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert outcomes["http"].status_code == 200 and outcomes["http"].json()["choices"][0]["finish_reason"] == "length"
    assert all(list(c)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH for c in held)
    http.close()


def test_only_the_admin_token_reads_every_tenants_traffic(front_doors, tmp_path):
    from specdist.transport.security import SecurityConfigError, sees_everything

    s = front_doors
    stub = specdist_pb2_grpc.SpecDecodeStub(s.channel)
    SpecDistClient(s.channel, token=TOKEN_A).generate_text([1, 2], max_tokens=2)  # traffic the counters count

    def info(token: str) -> specdist_pb2.ServerInfo:
        return stub.GetServerInfo(specdist_pb2.GetServerInfoRequest(), metadata=(("authorization", f"Bearer {token}"),))

    tenant_view, admin_view = info(TOKEN_A), info(ADMIN)
    assert not tenant_view.HasField("counters") and tenant_view.target_model == admin_view.target_model
    assert admin_view.HasField("counters") and admin_view.counters.requests_total >= 1
    with pytest.raises(RemoteError) as e:  # the admin token reads; it does not generate
        list(SpecDistClient(s.channel, token=ADMIN).generate([1, 2], max_tokens=2))
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    for url in (f"http://{s.server.http.address}/metrics", f"http://127.0.0.1:{s.server.metrics_port}/metrics"):
        with httpx.Client(trust_env=False, timeout=30) as http:
            assert http.get(url, headers={"authorization": f"Bearer {TOKEN_A}"}).status_code == 403, url
            assert http.get(url).status_code == 401, url
            r = http.get(url, headers={"authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200 and "specdist_request_success_total" in r.text, url
    # without an admin token: nobody on a server of several tenants; the token holder with one token, as before
    assert not sees_everything(f"Bearer {TOKEN_A}", (TOKEN_A, TOKEN_B), None)
    assert sees_everything(f"Bearer {TOKEN_A}", TOKEN_A, None) and sees_everything(None, None, None)
    assert not sees_everything(f"Bearer {TOKEN_A}", TOKEN_A, ADMIN)
    # --admin-token-file: one token, not a tenant's
    tokens, admin = tmp_path / "tokens", tmp_path / "admin"
    tokens.write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    for bad in (f"{TOKEN_B}\n", f"{ADMIN}\n{ADMIN}x\n"):
        admin.write_text(bad)
        with pytest.raises(SecurityConfigError, match="--admin-token-file"):
            ServerSecurity.from_args(auth_token_file=str(tokens), admin_token_file=str(admin))
    admin.write_text(ADMIN + "\n")
    assert ServerSecurity.from_args(auth_token_file=str(tokens), admin_token_file=str(admin)).admin_token == ADMIN
