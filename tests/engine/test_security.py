"""TLS, client certificates and bearer tokens on the public ports (gRPC, HTTP API, --metrics-port).

Certificates are made here with ``cryptography`` (EC P-256: fast): a CA, a server certificate
for 127.0.0.1 / localhost, a client certificate from the same CA, and a second, unrelated CA
whose clients must be refused. Two servers run on loopback over the tiny models: one with
TLS + token + HTTP API + metrics port, one with mutual TLS (a client certificate required).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
from types import SimpleNamespace

import grpc
import openai
import pytest

try:  # the HTTP library the openai client is built on (httpx2 in recent releases)
    import httpx2 as httpx
except ImportError:
    import httpx

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from support.helpers import LoopThread, tiny_config

from specdist import Engine, SamplingParams
from specdist.api.serving import Backend, start_serving
from specdist.cli import main
from specdist.client import RemoteError, SpecDistClient
from specdist.transport.security import ServerSecurity, bearer_ok

TOKEN = "s3cret-token-0123456789"
WRONG = "not-the-token-xyz"
PROMPT = [1, 2, 3]
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------- certificates
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str, key, issuer_name: x509.Name, issuer_key, ca: bool = False, server: bool = False, client: bool = False
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    if server or client:
        usage = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path, cert: x509.Certificate | None = None, key=None) -> str:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> SimpleNamespace:
    d = tmp_path_factory.mktemp("pki")
    paths = {}
    cas = {}
    for ca in ("ca", "other_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"specdist test {ca}", key, _name(f"specdist test {ca}"), key, ca=True)
        cas[ca] = (cert, key)
        paths[ca] = _write(d / f"{ca}.pem", cert)
    for who, ca in (("server", "ca"), ("client", "ca"), ("other_client", "other_ca")):
        key = ec.generate_private_key(ec.SECP256R1())
        ca_cert, ca_key = cas[ca]
        cert = _cert(who, key, ca_cert.subject, ca_key, server=who == "server", client=who != "server")
        paths[who] = _write(d / f"{who}.pem", cert)
        paths[f"{who}_key"] = _write(d / f"{who}.key", key=key)
    (d / "token").write_text(f"  {TOKEN}\n")  # surrounding whitespace is stripped
    (d / "wrong_token").write_text(WRONG)
    (d / "empty").write_text(" \n")
    (d / "garbage.pem").write_text("not a certificate\n")
    paths.update(
        token=str(d / "token"),
        wrong_token=str(d / "wrong_token"),
        empty=str(d / "empty"),
        missing=str(d / "missing.pem"),
        garbage=str(d / "garbage.pem"),
    )
    paths = SimpleNamespace(**paths)
    paths.read = lambda p: open(p, "rb").read()
    return paths


# ---------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def _serve(loop_thread, tiny_models, security: ServerSecurity, **kwargs):
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    return loop_thread.run(
        start_serving(backend=Backend(engine), host="127.0.0.1", port=0, drain_seconds=1, security=security, **kwargs)
    )


@pytest.fixture(scope="module")
def secured(loop_thread, tiny_models, pki):
    """TLS + token on gRPC, the HTTP API and the metrics port."""
    sec = ServerSecurity.from_args(pki.server, pki.server_key, None, pki.token)
    serving = _serve(loop_thread, tiny_models, sec, http_port=0, metrics_port=0)
    yield serving
    loop_thread.run(serving.stop())


@pytest.fixture(scope="module")
def mutual(loop_thread, tiny_models, pki):
    """Mutual TLS, no token, gRPC and the HTTP API."""
    sec = ServerSecurity.from_args(pki.server, pki.server_key, pki.ca)
    serving = _serve(loop_thread, tiny_models, sec, http_port=0)
    yield serving
    loop_thread.run(serving.stop())


@pytest.fixture(scope="module")
def reference(tiny_models) -> list[int]:
    engine = Engine.from_config(tiny_config(tiny_models, "model", 3))
    return engine.generate([PROMPT], SamplingParams(**GREEDY))[0].token_ids


def _client(serving, pki, token=None, ca="ca", cert=None, timeout=10) -> SpecDistClient:
    kw = (
        {}
        if cert is None
        else dict(certificate_chain=pki.read(getattr(pki, cert)), private_key=pki.read(getattr(pki, cert + "_key")))
    )
    return SpecDistClient(
        serving.address, timeout=timeout, root_certificates=pki.read(getattr(pki, ca)), token=token, **kw
    )


# ---------------------------------------------------------------- gRPC: tokens
def test_bearer_ok() -> None:
    assert bearer_ok(f"Bearer {TOKEN}", TOKEN) and bearer_ok(f"bearer {TOKEN}", TOKEN)
    assert not bearer_ok(None, TOKEN) and not bearer_ok("", TOKEN) and not bearer_ok(TOKEN, TOKEN)
    assert not bearer_ok(f"Basic {TOKEN}", TOKEN) and not bearer_ok(f"Bearer {TOKEN}x", TOKEN)
    assert not bearer_ok("Bearer ", TOKEN)


def test_grpc_without_or_with_a_wrong_token_is_unauthenticated(secured, pki) -> None:
    for token in (None, WRONG):
        with _client(secured, pki, token=token) as client:
            for call in (
                lambda: client.generate_text(PROMPT, **GREEDY),
                client.server_info,
                lambda: client.cancel("some-id"),
            ):
                with pytest.raises(RemoteError) as e:
                    call()
                assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert "\n" not in e.value.message and WRONG not in e.value.message
                assert ("missing" if token is None else "invalid") in e.value.message
    assert secured.server.coordinator.counters()["requests_total"] == 0  # nothing reached the coordinator


def test_grpc_reflection_needs_the_token(secured, pki) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with _client(secured, pki) as client:
        stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_with_the_token_generates(secured, pki, reference) -> None:
    with _client(secured, pki, token=TOKEN) as client:
        text, ids, finish, stats = client.generate_text(PROMPT, **GREEDY)
        assert ids == reference and finish == "length" and stats.output_tokens == len(reference)
        assert client.server_info().counters["requests_finished"] >= 1


def test_health_is_open_without_a_token(secured, pki) -> None:
    with _client(secured, pki) as client:
        assert client.health() == "SERVING"
        assert client.health("specdist.v1.SpecDecode") == "SERVING"


# ---------------------------------------------------------------- gRPC: TLS
def test_tls_handshake_fails_with_the_wrong_ca_or_plaintext(secured, pki) -> None:
    with _client(secured, pki, token=TOKEN, ca="other_ca", timeout=5) as client:
        with pytest.raises(RemoteError) as e:
            client.server_info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with SpecDistClient(secured.address, timeout=5, token=TOKEN) as plain:  # plaintext to a TLS port
        with pytest.raises(RemoteError) as e:
            plain.server_info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_client_certificate_required_with_a_client_ca(mutual, pki, reference) -> None:
    for cert in (None, "other_client"):  # none, or one the client CA did not sign
        with _client(mutual, pki, cert=cert, timeout=5) as client:
            with pytest.raises(RemoteError) as e:
                client.health()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with _client(mutual, pki, cert="client") as client:
        assert client.generate_text(PROMPT, **GREEDY)[1] == reference


# ---------------------------------------------------------------- HTTP API and metrics port
@pytest.fixture(scope="module")
def https(pki):
    ctx = ssl.create_default_context(cafile=pki.ca)
    http = httpx.Client(verify=ctx, trust_env=False, timeout=30)
    yield http
    http.close()


def test_http_api_needs_the_token(secured, https) -> None:
    base = f"https://{secured.http.address}"
    model = secured.backend.engine.config.target.model
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key=WRONG, max_retries=0, http_client=https)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=model, prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 401
    assert e.value.body == {
        "message": "invalid bearer token",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    for path in ("/v1/models", "/metrics"):
        r = https.get(base + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert https.get(base + "/health").status_code == 200  # probes stay open

    good = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, http_client=https)
    out = good.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    assert https.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_metrics_port_is_https_with_the_token(secured, https) -> None:
    url = f"https://127.0.0.1:{secured.metrics_port}/metrics"
    assert https.get(url).status_code == 401
    assert https.get(url, headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401
    r = https.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and "specdist_request_success_total" in r.text


def test_http_api_requires_a_client_certificate_with_a_client_ca(mutual, pki) -> None:
    url = f"https://{mutual.http.address}/v1/models"
    for cert in (None, "other_client"):  # none, or one the client CA did not sign
        ctx = ssl.create_default_context(cafile=pki.ca)
        if cert is not None:
            ctx.load_cert_chain(getattr(pki, cert), getattr(pki, cert + "_key"))
        with httpx.Client(verify=ctx, trust_env=False, timeout=10) as http:
            with pytest.raises(httpx.TransportError):  # the TLS handshake (or its first read) fails
                http.get(url)
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.load_cert_chain(pki.client, pki.client_key)
    with httpx.Client(verify=ctx, trust_env=False, timeout=10) as http:
        assert http.get(url).status_code == 200  # no token configured: the certificate is the authentication


# ---------------------------------------------------------------- command line
def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specdist: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tls-cert", "{missing}", "--tls-key", "{server_key}"], "--tls-cert"),
        (["--tls-cert", "{server}", "--tls-key", "{missing}"], "--tls-key"),
        (["--tls-cert", "{server}"], "--tls-cert needs --tls-key"),
        (["--tls-client-ca", "{ca}"], "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", "{server}", "--tls-key", "{server_key}", "--tls-client-ca", "{missing}"], "--tls-client-ca"),
        (["--auth-token-file", "{empty}"], "--auth-token-file"),
        (["--tls-cert", "{garbage}", "--tls-key", "{server_key}"], "--tls-cert"),
        (["--tls-cert", "{server}", "--tls-key", "{client_key}"], "not the private key of --tls-cert"),
        (["--tls-cert", "{server}", "--tls-key", "{server_key}", "--tls-client-ca", "{garbage}"], "--tls-client-ca"),
    ],
)
def test_serve_refuses_unusable_files_in_one_line(pki, capsys, monkeypatch, flags, named) -> None:
    import specdist.api.serving as serve_cli

    monkeypatch.setattr(serve_cli, "start_backend", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0"] + [f.format(**vars(pki)) if "{" in f else f for f in flags])
    assert e.value.code == 2
    line = _one_line_error(capsys)
    assert named in line, line


def test_generate_server_flags(secured, pki, capsys, reference) -> None:
    base = ["generate", "--server", secured.address, "--raw", "--max-tokens", "4", "--temperature", "0", "a b"]
    for extra, code in (
        (["--tls-ca", pki.ca], "UNAUTHENTICATED"),
        (["--tls-ca", pki.ca, "--auth-token-file", pki.wrong_token], "UNAUTHENTICATED"),
        (["--tls-ca", pki.other_ca, "--auth-token-file", pki.token], "UNAVAILABLE"),
    ):
        with pytest.raises(SystemExit) as e:
            main(base + extra)
        assert e.value.code == 2
        line = _one_line_error(capsys)
        assert code in line and WRONG not in line and TOKEN not in line, line
    assert main(base + ["--tls-ca", pki.ca, "--auth-token-file", pki.token]) == 0
    out = capsys.readouterr()
    assert f"server={secured.address} tokens=" in out.err
    with pytest.raises(SystemExit):
        main(["generate", "--tls-ca", pki.ca, "a"])  # TLS flags without --server
    assert "--tls-ca only applies with --server" in _one_line_error(capsys)


def test_generate_server_handshake_failure_is_one_line_on_stderr(secured, pki) -> None:
    """In a fresh process: gRPC's C core must not add its own log line about the failed handshake."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdist.cli",
            "generate",
            "--server",
            secured.address,
            "--tls-ca",
            pki.other_ca,
            "--auth-token-file",
            pki.token,
            "a",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdist: error: UNAVAILABLE:"), proc.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in lines[0]
