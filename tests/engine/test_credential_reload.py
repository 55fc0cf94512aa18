"""Credentials read again while the server runs: certificate files renewed in place and a token file edited.

One server (``start_serving``: gRPC, the HTTP API and the metrics port over TLS, two tenants' tokens) over the tiny
models. Its certificate and key files are replaced (as cert-manager renews them) by another certificate of the same CA;
a new TLS handshake on each port then presents it (the server certificate a client sees, compared byte for byte).
Its token file is rewritten without one tenant's token and with a new one: the removed token is refused (gRPC
UNAUTHENTICATED, HTTP 401) and the new one accepted, without a restart; so is a replaced admin token (/metrics). A file
that changes into one that cannot be used (a token too short, then no file) keeps the tokens in use and logs one line.
A second server requires client certificates (mutual TLS): its client CA file replaced by another CA's, every port
admits the new CA's clients and refuses the old CA's.
The server checks the files at most every ``RELOAD_CHECK_S``, here 50 ms; the test polls for each outcome
(``wait_until``), never sleeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl

import grpc
import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from support.helpers import LoopThread, tiny_config, wait_until
from test_security import _cert, _name, _write

from specdist import Engine
from specdist.api.serving import Backend, start_serving
from specdist.client import RemoteError, SpecDistClient
from specdist.transport import security
from specdist.transport.security import ServerSecurity

TOKEN_A = "tenant-a-token-0123456789"
TOKEN_B = "tenant-b-token-0123456789"  # revoked by the rewrite
TOKEN_C = "tenant-c-token-0123456789"  # added by the rewrite
ADMIN_1, ADMIN_2 = "admin-token-one-0123456789", "admin-token-two-0123456789"  # the admin token, then its successor
LIMIT_S = 20  # how long a change may take to be seen (a check every 50 ms; the machine may be busy)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A CA, two server certificates it signed ("old" served first, "new" swapped in) and the token file."""
    d = tmp_path_factory.mktemp("reload")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("specdist reload ca", ca_key, _name("specdist reload ca"), ca_key, ca=True)
    paths = {"ca": _write(d / "ca.pem", ca)}
    for which in ("old", "new"):
        key = ec.generate_private_key(ec.SECP256R1())
        paths[which] = _write(d / f"{which}.pem", _cert(f"server {which}", key, ca.subject, ca_key, server=True))
        paths[which + "_key"] = _write(d / f"{which}.key", key=key)
    served = d / "served"  # the paths the server is given
    served.mkdir()
    paths.update(
        cert=str(served / "tls.crt"),
        key=str(served / "tls.key"),
        token=str(served / "token"),
        admin=str(served / "admin"),
    )
    _replace(paths["cert"], open(paths["old"], "rb").read())
    _replace(paths["key"], open(paths["old_key"], "rb").read())
    _replace(paths["token"], f"# tenants\n{TOKEN_A}\n{TOKEN_B}\n".encode())
    _replace(paths["admin"], ADMIN_1.encode())
    return paths


def _replace(path: str, data: bytes) -> None:
    """Write ``path`` whole at once (a new file renamed over it), as a secret volume's update does."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


@contextlib.contextmanager
def _serving(tiny_models, make_security, **ports):
    """``start_serving`` over the tiny models, its files checked every 50 ms; ``make_security`` runs after that
    patch, so the files it reads are watched at that interval."""
    patch = pytest.MonkeyPatch()
    patch.setattr(security, "RELOAD_CHECK_S", 0.05)
    lt = LoopThread()
    engine = Engine.from_config(tiny_config(tiny_models, "none"))
    serving = lt.run(
        start_serving(
            backend=Backend(engine), host="127.0.0.1", port=0, drain_seconds=1, security=make_security(), **ports
        )
    )
    try:
        yield serving
    finally:
        lt.run(serving.stop())
        lt.close()
        patch.undo()


@pytest.fixture(scope="module")
def server(files, tiny_models):
    f = files
    with _serving(
        tiny_models,
        lambda: ServerSecurity.from_args(f["cert"], f["key"], None, f["token"], f["admin"]),
        http_port=0,
        metrics_port=0,
    ) as serving:
        yield serving


def _der(path: str) -> bytes:
    return x509.load_pem_x509_certificate(open(path, "rb").read()).public_bytes(serialization.Encoding.DER)


def _presented(address: str, ca: str, alpn: str) -> bytes:
    """The certificate a new TLS handshake with ``address`` presents (DER), verified against ``ca``."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols([alpn])  # grpc's server wants h2
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        return tls.getpeercert(binary_form=True)


def _grpc_code(server, files, token: str) -> grpc.StatusCode:
    with SpecDistClient(
        server.address, timeout=10, root_certificates=open(files["ca"], "rb").read(), token=token
    ) as client:
        try:
            client.server_info()
        except RemoteError as e:
            return e.code
    return grpc.StatusCode.OK


def _http_status(server, files, token: str, path: str = "/v1/models") -> int:
    with httpx.Client(verify=ssl.create_default_context(cafile=files["ca"]), trust_env=False, timeout=10) as http:
        return http.get(
            f"https://{server.http.address}{path}", headers={"Authorization": f"Bearer {token}"}
        ).status_code


def test_renewed_certificate_files_serve_the_next_handshakes(server, files):
    old, new = _der(files["old"]), _der(files["new"])
    ports = (
        (server.address, "h2"),
        (server.http.address, "http/1.1"),
        (f"127.0.0.1:{server.metrics_port}", "http/1.1"),
    )
    for address, alpn in ports:
        assert _presented(address, files["ca"], alpn) == old
    _replace(files["key"], open(files["new_key"], "rb").read())  # the key first: a moment of a pair that
    _replace(files["cert"], open(files["new"], "rb").read())  # does not match (kept out, the old pair served)
    for address, alpn in ports:
        wait_until(
            f"{address} to present the renewed certificate",
            lambda: _presented(address, files["ca"], alpn) == new,
            LIMIT_S,
        )
    assert _grpc_code(server, files, TOKEN_A) == grpc.StatusCode.OK  # calls go on over the new certificate
    assert _http_status(server, files, TOKEN_A) == 200


def test_a_token_removed_from_the_file_is_refused_and_a_new_one_accepted(server, files, caplog):
    for token in (TOKEN_A, TOKEN_B):
        assert _grpc_code(server, files, token) == grpc.StatusCode.OK and _http_status(server, files, token) == 200
    assert _grpc_code(server, files, TOKEN_C) == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _http_status(server, files, ADMIN_1, "/metrics") == 200
        and _http_status(server, files, ADMIN_2, "/metrics") == 401
    )
    _replace(files["token"], f"{TOKEN_A}\n{TOKEN_C}\n".encode())
    _replace(files["admin"], ADMIN_2.encode())
    wait_until(
        "the gRPC port to refuse the revoked token",
        lambda: _grpc_code(server, files, TOKEN_B) == grpc.StatusCode.UNAUTHENTICATED,
        LIMIT_S,
    )
    wait_until("the HTTP API to refuse the revoked token", lambda: _http_status(server, files, TOKEN_B) == 401, LIMIT_S)
    for token in (TOKEN_A, TOKEN_C):
        assert _grpc_code(server, files, token) == grpc.StatusCode.OK and _http_status(server, files, token) == 200
    wait_until(
        "/metrics to refuse the old admin token",
        lambda: _http_status(server, files, ADMIN_1, "/metrics") == 401,
        LIMIT_S,
    )
    assert _http_status(server, files, ADMIN_2, "/metrics") == 200

    # files that cannot be used keep the tokens in use, with one line each change
    caplog.set_level(logging.WARNING, logger=security.__name__)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == security.__name__ and r.levelno == logging.WARNING]

    _replace(files["token"], b"short\n")
    wait_until(
        "a line about the unusable token file",
        lambda: _http_status(server, files, TOKEN_C) == 200 and warnings(),
        LIMIT_S,
    )
    os.remove(files["token"])
    wait_until(
        "a line about the missing token file",
        lambda: _http_status(server, files, TOKEN_C) == 200 and len(warnings()) == 2,
        LIMIT_S,
    )
    for _ in range(3):  # checks past the interval: the same unusable state logs nothing more
        assert _grpc_code(server, files, TOKEN_C) == grpc.StatusCode.OK and _http_status(server, files, TOKEN_C) == 200
        assert _grpc_code(server, files, TOKEN_B) == grpc.StatusCode.UNAUTHENTICATED
        assert _http_status(server, files, "short") == 401
    lines = warnings()
    assert len(lines) == 2, lines
    assert "token 1 has 5 characters" in lines[0] and "No such file" in lines[1], lines
    assert all("\n" not in line and "--auth-token-file" in line for line in lines)
    assert not any(t in line for line in lines for t in (TOKEN_A, TOKEN_C, ADMIN_2))


# ---------------------------------------------------------------- the client CA (mutual TLS) replaced
@pytest.fixture(scope="module")
def mtls_files(tmp_path_factory):
    """Two CAs; the server's certificate from the first; a client certificate from each. The server is given
    ``client_ca`` (the first CA's certificate, then the second's: a CA rotated under running servers)."""
    d = tmp_path_factory.mktemp("mtls")
    paths, cas = {}, {}
    for name in ("ca1", "ca2"):
        key = ec.generate_private_key(ec.SECP256R1())
        cas[name] = (_cert(f"specdist {name}", key, _name(f"specdist {name}"), key, ca=True), key)
        paths[name] = _write(d / f"{name}.pem", cas[name][0])
    for who, ca in (("server", "ca1"), ("client1", "ca1"), ("client2", "ca2")):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(who, key, cas[ca][0].subject, cas[ca][1], server=who == "server", client=who != "server")
        paths[who] = _write(d / f"{who}.pem", cert)
        paths[who + "_key"] = _write(d / f"{who}.key", key=key)
    paths["client_ca"] = str(d / "client_ca.pem")
    _replace(paths["client_ca"], open(paths["ca1"], "rb").read())
    return paths


@pytest.fixture(scope="module")
def mtls_server(mtls_files, tiny_models):
    f = mtls_files
    with _serving(
        tiny_models,
        lambda: ServerSecurity.from_args(f["server"], f["server_key"], f["client_ca"]),
        http_port=0,
        metrics_port=0,
    ) as serving:
        yield serving


def _grpc_admits(server, files, client: str) -> bool:
    """Whether a gRPC call with ``client``'s certificate gets through the handshake."""
    with SpecDistClient(
        server.address,
        timeout=10,
        root_certificates=open(files["ca1"], "rb").read(),
        certificate_chain=open(files[client], "rb").read(),
        private_key=open(files[client + "_key"], "rb").read(),
    ) as c:
        try:
            c.server_info()
        except RemoteError as e:
            assert e.code == grpc.StatusCode.UNAVAILABLE, e  # refused in the handshake, nothing else
            return False
    return True


def _https_admits(address: str, files, client: str, path: str) -> bool:
    """Whether an HTTPS GET of ``path`` with ``client``'s certificate is answered 200."""
    ctx = ssl.create_default_context(cafile=files["ca1"])
    ctx.load_cert_chain(files[client], files[client + "_key"])
    try:
        with httpx.Client(verify=ctx, trust_env=False, timeout=10) as http:
            return http.get(f"https://{address}{path}").status_code == 200
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):  # the handshake refused
        return False


def test_a_replaced_client_ca_admits_its_clients_and_refuses_the_old_ones(mtls_server, mtls_files):
    s, f = mtls_server, mtls_files
    https = ((s.http.address, "/v1/models"), (f"127.0.0.1:{s.metrics_port}", "/metrics"))

    def admitted(client: str) -> tuple[bool, ...]:
        return (_grpc_admits(s, f, client), *(_https_admits(a, f, client, p) for a, p in https))

    assert admitted("client1") == (True, True, True)
    assert admitted("client2") == (False, False, False)
    _replace(f["client_ca"], open(f["ca2"], "rb").read())
    wait_until("every port to admit the new CA's client", lambda: admitted("client2") == (True, True, True), LIMIT_S)
    assert admitted("client1") == (False, False, False)  # the old CA's clients refused on every port


# ---------------------------------------------------------------- the default tenant quota follows the token file
def test_the_default_tenant_quota_follows_the_tenants_the_token_file_holds(tmp_path, tiny_models):
    """With ``limits.max_queued_per_tenant`` unset, one tenant has no quota and several have half the places each
    (``LimitsConfig.tenant_quota``): a second tenant's token added to the file gives the quota without a restart,
    and taking it out again removes it."""
    token_file = str(tmp_path / "token")
    _replace(token_file, f"{TOKEN_A}\n".encode())
    with _serving(tiny_models, lambda: ServerSecurity.from_args(auth_token_file=token_file), max_queued=8) as serving:
        coordinator = serving.server.coordinator
        assert coordinator.tenant_quota is None  # one tenant: every place is its own
        _replace(token_file, f"{TOKEN_A}\n{TOKEN_C}\n".encode())
        wait_until("two tenants' quota (half of 8 places)", lambda: coordinator.tenant_quota == 4, LIMIT_S)
        _replace(token_file, f"{TOKEN_C}\n".encode())
        wait_until("one tenant again: no quota", lambda: coordinator.tenant_quota is None, LIMIT_S)
