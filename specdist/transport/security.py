"""TLS and bearer-token authentication of the public ports (gRPC, the HTTP API, ``--metrics-port``).

Server side (``specdist serve``):
- ``--tls-cert`` / ``--tls-key``: PEM certificate chain and private key; every public port then
  speaks TLS. ``--tls-client-ca``: clients must also present a certificate signed by this CA
  (mutual TLS).
- ``--auth-token-file``: a file holding one token (surrounding whitespace stripped; at least 16
  characters; lines starting with ``#`` are comments), read at start and again when it changes. Every call must carry
  ``authorization: Bearer <token>`` (gRPC metadata or HTTP header; on the HTTP port: /v1/*, /metrics and /openapi.json),
  except the probes: the gRPC health service and ``GET /health``. A missing or wrong token is gRPC UNAUTHENTICATED /
  HTTP 401; the token is never echoed, and it is compared in constant time (``hmac.compare_digest``).
  A file of several lines holds one token a line, one per **tenant** (:func:`tenant_of`): the
  requests of different tenants share no drafting state (the suffix index) and, where the config
  says so, no prompt K/V either, so one tenant cannot read another's text through them.

- ``--admin-token-file``: one token for what shows every tenant's traffic: ``/metrics`` (on the HTTP port
  and ``--metrics-port``) and GetServerInfo's counters (:func:`sees_everything`). The admin token calls nothing
  else (PERMISSION_DENIED). With it, a tenant's token on /metrics is 403 and GetServerInfo answers a tenant without
  counters. Without it a server of several tenants shows those to nobody (a tenant alone on a server would read
  its acceptance from the counters); with one token or none, the token holder (or anyone) sees them, as before.

Client side (:class:`~specdist.client.SpecDistClient`, ``specdist generate --server``): a root
CA to trust, an optional client certificate and key, and the token, sent as metadata on every call.

Worker ports of a Ray deployment (:mod:`cluster.deployment`): the deployment generates a fresh
secret at bring-up (:func:`new_worker_secret`), hands it to every worker actor, and each worker
port requires it as a bearer token (the same interceptor, health open); the coordinator's stubs
(:mod:`specdist.transport.remote`) send it on every call.

Every file is checked when the command starts: a missing, unreadable or empty one, a certificate
or key that does not load, or a key that does not match its certificate is a one-line
:class:`SecurityConfigError` naming its flag.

The files are read again while the server runs (:class:`Reloading`): when one changes (its inode, size or
modification time; checked at most every :data:`RELOAD_CHECK_S`, when a call is authenticated or a TLS handshake
starts), the new certificate serves the next handshakes (gRPC: :func:`grpc.dynamic_ssl_server_credentials`; the
HTTP and metrics ports: :meth:`ServerTLS.server_context`) and the new tokens the next calls, so a certificate
renewed in place (cert-manager) or a token removed from the file (revoked) takes effect without a restart.
Connections already open keep their handshake's certificate. Files that changed but do not load (unreadable, a
token too short, a key that does not match the certificate) leave the credentials in use and log one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from specdist.errors import SpecDistError

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"  # probes: open without a token
ADMIN_METHODS = frozenset({"/specdist.v1.SpecDecode/GetServerInfo"})  # what the admin token may call
RELOAD_CHECK_S = 1.0  # how often (at most) the credential files' stat is compared with the one last loaded
T = TypeVar("T")


class SecurityConfigError(SpecDistError):
    """A TLS or token file (or flag combination) is unusable; the message names the flag."""


def read_file(path: str, flag: str) -> bytes:
    """The bytes of ``path``; SecurityConfigError naming ``flag`` if it cannot be read or is empty."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SecurityConfigError(f"{flag} {path}: {e.strerror or e}") from None
    if not data.strip():
        raise SecurityConfigError(f"{flag} {path}: the file is empty")
    return data


class Reloading(Generic[T]):
    """A value loaded from files, loaded again once one of them has changed: :meth:`current` compares the files'
    stat (device, inode, size, modification time: a rewrite, a rename over the file or a symlink swapped, as a
    Kubernetes volume's update does) with the one of the last load, at most every :data:`RELOAD_CHECK_S`. A change
    whose files do not load (``load`` raises :class:`SecurityConfigError`) keeps the value in use and logs one line.

    Thread-safe: the HTTP API's event loop, grpc's handshake threads and the metrics port's threads all call it;
    while one thread loads, the others get the value in use."""

    def __init__(self, paths: Sequence[str | None], load: Callable[[], T], what: str):
        self.paths = tuple(p for p in paths if p is not None)
        self.what = what  # the flags, for the log line
        self._load = load
        self._lock = threading.Lock()
        self._stat = self._stats()  # before the read: a change while reading is seen at the next check
        self.value = load()
        self._checked = time.monotonic()

    def current(self) -> T:
        if time.monotonic() - self._checked >= RELOAD_CHECK_S and self._lock.acquire(blocking=False):
            try:
                self._check()
            finally:
                self._lock.release()
        return self.value

    def _check(self) -> None:
        self._checked = time.monotonic()
        stat = self._stats()
        if stat == self._stat:
            return
        self._stat = stat  # a change that does not load is logged once, and tried again at the next change
        try:
            value = self._load()
        except SecurityConfigError as e:
            log.warning(
                "%s changed, but the new files cannot be used; the credentials in use are kept: %s", self.what, e
            )
            return
        self.value = value
        log.info("%s: reloaded (the files changed)", self.what)

    def _stats(self) -> tuple:
        out = []
        for path in self.paths:
            try:
                st = os.stat(path)
                out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError as e:  # gone or unreadable: a change too (loading then fails, and the old value stays)
                out.append(e.errno)
        return tuple(out)


MIN_TOKEN_CHARS = 16  # a shorter token is a guessable one


def read_token(path: str, flag: str = "--auth-token-file") -> str | tuple[str, ...]:
    """The token in ``path``, surrounding whitespace stripped; it must be one printable ASCII word of at least
    :data:`MIN_TOKEN_CHARS` characters. Blank lines and lines starting with ``#`` (comments) are skipped. A file of
    several tokens holds one a line, one per tenant (:func:`tenant_of`): returned as a tuple."""
    try:
        lines = [line.strip() for line in read_file(path, flag).decode("ascii").splitlines()]
    except UnicodeDecodeError:
        raise SecurityConfigError(f"{flag} {path}: the token must be ASCII") from None
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        raise SecurityConfigError(f"{flag} {path}: no token in the file (only comments or blank lines)")
    for n, token in enumerate(lines, 1):
        if not token.isprintable() or any(c.isspace() for c in token):
            raise SecurityConfigError(f"{flag} {path}: a token must be one word of printable characters")
        if len(token) < MIN_TOKEN_CHARS:
            raise SecurityConfigError(
                f"{flag} {path}: token {n} has {len(token)} characters; a token needs at least {MIN_TOKEN_CHARS}"
            )
    if len(set(lines)) != len(lines):
        raise SecurityConfigError(f"{flag} {path}: a token appears twice")
    return lines[0] if len(lines) == 1 else tuple(lines)


def _check_pair(tls_cert: str | None, tls_key: str | None) -> None:
    """A certificate and its key come together."""
    if (tls_cert is None) != (tls_key is None):
        given, missing = ("--tls-cert", "--tls-key") if tls_key is None else ("--tls-key", "--tls-cert")
        raise SecurityConfigError(f"{given} needs {missing}")


def bearer_ok(header: str | None, token: str | tuple[str, ...]) -> bool:
    """Whether an ``authorization`` value is ``Bearer <token>`` (scheme case-insensitive, constant-time compare);
    ``token`` may be several (one a tenant): any of them."""
    return _matched(header, token) is not None


def _matched(header: str | None, token: str | tuple[str, ...]) -> str | None:
    """The token an ``authorization`` value carries, if it is one of ``token``; every token is compared (in
    constant time each), so the time does not say which one matched or how far a guess got."""
    if not header:
        return None
    scheme, _, given = header.partition(" ")
    given_bytes = given.strip().encode()
    found = None
    for t in (token,) if isinstance(token, str) else token:
        if hmac.compare_digest(given_bytes, t.encode()):
            found = t
    return found if scheme.lower() == "bearer" else None


def tenant_of(header: str | None, token: str | tuple[str, ...] | None) -> str:
    """The tenant a request belongs to: with several tokens (one a tenant), a name derived from the one it carries
    (a hash: the token itself is never kept or logged); with one token or none, "" (every client one tenant).
    The cores scope what requests share across each other (the suffix index, optionally the prefix cache) by it."""
    if token is None or isinstance(token, str) or len(token) < 2:
        return ""
    matched = _matched(header, token)
    return "" if matched is None else "tenant-" + hashlib.sha256(matched.encode()).hexdigest()[:16]


def sees_everything(header: str | None, token: str | tuple[str, ...] | None, admin_token: str | None) -> bool:
    """Whether a call carrying ``header`` may read what shows every tenant's traffic (/metrics, GetServerInfo's
    counters): with an admin token, only that token; without one, nobody on a server of several tenants, and
    otherwise whoever passed the token check (the one token, or anyone without a token)."""
    if admin_token is not None:
        return bearer_ok(header, admin_token)
    if isinstance(token, tuple) and len(token) > 1:
        return False
    return token is None or bearer_ok(header, token)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying ``token`` (None without one)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def new_worker_secret() -> str:
    """A fresh shared secret for a deployment's worker ports: 32 random bytes, hex."""
    return secrets.token_hex(32)


def unauthenticated_message(header: str | None) -> str:
    """One line saying what was wrong, without repeating what was sent."""
    if not header:
        return "missing bearer token: send 'authorization: Bearer <token>'"
    return "invalid bearer token"


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key (and, for mutual TLS, the client CA), as paths and bytes.

    Made by :meth:`load`, it watches its files (``watch``): :meth:`current` is what they hold now, and the
    credentials it makes (:meth:`grpc_credentials`, :meth:`server_context`) present it at each new handshake."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    cert: bytes = b""
    key: bytes = b""
    client_ca: bytes | None = None
    context: ssl.SSLContext | None = field(default=None, compare=False, repr=False)  # these files' (ssl_context)
    watch: "Reloading[ServerTLS] | None" = field(default=None, compare=False, repr=False)

    @classmethod
    def load(cls, cert_file: str, key_file: str, client_ca_file: str | None = None) -> "ServerTLS":
        """Read the files and check their contents (grpc would only fail to bind, after the model loaded);
        the result reads them again when they change."""
        watch = Reloading(
            (cert_file, key_file, client_ca_file),
            lambda: cls._read(cert_file, key_file, client_ca_file),
            "--tls-cert / --tls-key" + (" / --tls-client-ca" if client_ca_file else ""),
        )
        return dataclasses.replace(watch.value, watch=watch)

    @classmethod
    def _read(cls, cert_file: str, key_file: str, client_ca_file: str | None) -> "ServerTLS":
        tls = cls(
            cert_file,
            key_file,
            client_ca_file,
            read_file(cert_file, "--tls-cert"),
            read_file(key_file, "--tls-key"),
            None if client_ca_file is None else read_file(client_ca_file, "--tls-client-ca"),
        )
        return dataclasses.replace(tls, context=tls.ssl_context())

    def current(self) -> "ServerTLS":
        """What the files hold now (checked at most every RELOAD_CHECK_S); itself when it watches no files."""
        return self.watch.current() if self.watch is not None else self

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC port's credentials; with files watched, each new connection's handshake uses what they hold
        then (:func:`grpc.dynamic_ssl_server_credentials`; a client CA, when given at start, stays required)."""
        if self.watch is None:
            return grpc.ssl_server_credentials(
                [(self.key, self.cert)],
                root_certificates=self.client_ca,
                require_client_auth=self.client_ca is not None,
            )
        served = [self.current()]  # the configuration grpc has now

        def fetch() -> grpc.ServerCertificateConfiguration | None:  # on grpc's thread, before each handshake
            now = self.current()
            if now is served[0]:
                return None
            served[0] = now
            return now.certificate_configuration()

        return grpc.dynamic_ssl_server_credentials(
            served[0].certificate_configuration(), fetch, require_client_authentication=self.client_ca is not None
        )

    def certificate_configuration(self) -> grpc.ServerCertificateConfiguration:
        """These files' certificate (and client CA) for grpc's dynamic credentials."""
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.client_ca)

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's TLS arguments: the same files; with a client CA a client certificate is required.
        (The HTTP API replaces the context uvicorn makes from them by :meth:`server_context`.)"""
        kw = dict(ssl_certfile=self.cert_file, ssl_keyfile=self.key_file)
        if self.client_ca_file is not None:
            kw.update(ssl_ca_certs=self.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return kw

    def server_context(self) -> ssl.SSLContext:
        """A server-side context whose handshakes use what the files hold when each starts: its SNI callback
        (which OpenSSL calls for every client hello, with a server name or without) moves the connection onto
        the newest files' context."""
        first = self.current()
        ctx = first.context or first.ssl_context()

        def newest(conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, context: ssl.SSLContext) -> None:
            now = self.current()
            if now.context is not None and now.context is not context:
                conn.context = now.context

        ctx.sni_callback = newest
        return ctx

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side ``ssl.SSLContext`` with these files, as they are now;
        SecurityConfigError naming the flag when a file is not what it should be."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # password b"": an encrypted key fails here instead of prompting on the terminal
            ctx.load_cert_chain(self.cert_file, self.key_file, password=b"")
        except (ssl.SSLError, OSError) as e:
            if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH":
                raise SecurityConfigError(
                    f"--tls-key {self.key_file}: not the private key of --tls-cert {self.cert_file}"
                ) from None
            raise SecurityConfigError(
                f"--tls-cert {self.cert_file} / --tls-key {self.key_file}: cannot load a PEM "
                "certificate chain and its unencrypted private key"
            ) from None
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(self.client_ca_file)
            except (ssl.SSLError, OSError):
                raise SecurityConfigError(
                    f"--tls-client-ca {self.client_ca_file}: no PEM CA certificate in it"
                ) from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


TokenValue = str | tuple[str, ...] | None  # one token, one a tenant (several), or none


class Tokens:
    """The bearer tokens calls are checked against, as of now: ``(token, admin_token)`` from :meth:`now`. Fixed
    values, or (:meth:`from_files`) the token files' contents, read again when they change (:class:`Reloading`)."""

    def __init__(
        self,
        token: TokenValue = None,
        admin_token: str | None = None,
        watch: Reloading[tuple[TokenValue, str | None]] | None = None,
    ):
        self._fixed = (token, admin_token)
        self._watch = watch

    @classmethod
    def from_files(cls, auth_token_file: str | None, admin_token_file: str | None) -> "Tokens":
        """The files' tokens (read now: SecurityConfigError naming the flag), read again when a file changes."""
        what = " / ".join(
            flag
            for flag, path in (("--auth-token-file", auth_token_file), ("--admin-token-file", admin_token_file))
            if path is not None
        )
        return cls(
            watch=Reloading(
                (auth_token_file, admin_token_file), lambda: _read_tokens(auth_token_file, admin_token_file), what
            )
        )

    def now(self) -> tuple[TokenValue, str | None]:
        """(the tenants' token or tokens, the admin token), each None when not set."""
        return self._watch.current() if self._watch is not None else self._fixed

    def __bool__(self) -> bool:  # whether any token is set (a file given at start always holds one)
        token, admin = self.now()
        return token is not None or admin is not None


def _read_tokens(auth_token_file: str | None, admin_token_file: str | None) -> tuple[TokenValue, str | None]:
    """The tokens of ``--auth-token-file`` and ``--admin-token-file`` (either may be None), checked together."""
    token = None if auth_token_file is None else read_token(auth_token_file)
    admin = None if admin_token_file is None else read_token(admin_token_file, "--admin-token-file")
    if isinstance(admin, tuple):
        raise SecurityConfigError(f"--admin-token-file {admin_token_file}: one token, not one a line")
    if admin is not None and admin in ((token,) if isinstance(token, str) else token or ()):
        raise SecurityConfigError(
            f"--admin-token-file {admin_token_file}: the admin token is a tenant's token too (--auth-token-file)"
        )
    return token, admin


@dataclass(frozen=True)
class ServerSecurity:
    """What ``specdist serve`` was given: TLS (or None) and the token (or None; a tuple: one token a tenant).

    ``token`` and ``admin_token`` are the tokens at start (what the start lines and the tenants' quota count); each
    call is checked against ``tokens.now()``, which :meth:`from_args` makes read the files again when they change."""

    tls: ServerTLS | None = None
    token: TokenValue = None
    admin_token: str | None = None  # /metrics and GetServerInfo's counters (sees_everything)
    watched: Tokens | None = field(default=None, compare=False, repr=False)  # the token files (from_args)

    @property
    def tokens(self) -> Tokens:
        """The tokens each call is checked against: the files' as they are now, or the fixed ones."""
        return self.watched if self.watched is not None else Tokens(self.token, self.admin_token)

    @classmethod
    def from_args(
        cls,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        auth_token_file: str | None = None,
        admin_token_file: str | None = None,
    ) -> "ServerSecurity":
        """Check the flag combination and read every file (before any model loads); they are read again when
        they change (module docstring)."""
        _check_pair(tls_cert, tls_key)
        if tls_client_ca is not None and tls_cert is None:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key (client certificates need TLS)")
        tls = None if tls_cert is None else ServerTLS.load(tls_cert, tls_key, tls_client_ca)
        if auth_token_file is None and admin_token_file is None:
            return cls(tls)
        tokens = Tokens.from_files(auth_token_file, admin_token_file)
        return cls(tls, *tokens.now(), watched=tokens)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def auth_interceptors(
    token: TokenValue | Tokens, admin_token: str | None = None
) -> list[grpc.aio.ServerInterceptor] | None:
    """``grpc.aio.server(interceptors=...)``: the token check when a token (or an admin token) is set, else none.
    ``token`` may be a server's :class:`Tokens` (then it holds the admin token too), checked as they are at each
    call."""
    tokens = token if isinstance(token, Tokens) else Tokens(token, admin_token)
    return [TokenAuthInterceptor(tokens)] if tokens else None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>`` (UNAUTHENTICATED), except the health service;
    the admin token passes for :data:`ADMIN_METHODS` only (PERMISSION_DENIED elsewhere). No tenants' token with an
    admin token: the other methods need no token. The tokens are ``tokens.now()`` at each call."""

    def __init__(self, tokens: Tokens):
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        token, admin = self._tokens.now()
        if token is None or bearer_ok(header, token):
            return await continuation(details)
        if admin is not None and bearer_ok(header, admin):
            if details.method in ADMIN_METHODS:
                return await continuation(details)
            handler = await continuation(details)
            return _refusal(
                handler, "the admin token reads server info and metrics only", grpc.StatusCode.PERMISSION_DENIED
            )
        handler = await continuation(details)  # only for its kind (streaming or not); it is not run
        return _refusal(handler, unauthenticated_message(header))


def _refusal(
    handler: grpc.RpcMethodHandler | None, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``, reading nothing."""

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    streaming = (handler.request_streaming, handler.response_streaming) if handler is not None else (False, False)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[streaming]
    return make(refuse)


def client_channel(
    target: str,
    root_certificates: bytes | None = None,
    certificate_chain: bytes | None = None,
    private_key: bytes | None = None,
    tls: bool = False,
) -> grpc.Channel:
    """A blocking channel: TLS when ``tls`` or any PEM is given (no root CA: the system's roots), else plaintext."""
    if (certificate_chain is None) != (private_key is None):
        raise SecurityConfigError("certificate_chain and private_key: a client certificate needs its key")
    if not (tls or root_certificates or certificate_chain):
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
    return grpc.secure_channel(target, creds)


def client_kwargs_from_files(
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    auth_token_file: str | None = None,
) -> dict:
    """SpecDistClient keywords read from the ``generate --server`` flags' files."""
    _check_pair(tls_cert, tls_key)
    kw: dict = {}
    if tls_ca is not None:
        kw["root_certificates"] = read_file(tls_ca, "--tls-ca")
    if tls_cert is not None:
        kw["certificate_chain"] = read_file(tls_cert, "--tls-cert")
        kw["private_key"] = read_file(tls_key, "--tls-key")
    if auth_token_file is not None:
        kw["token"] = read_token(auth_token_file)
    return kw


METRICS_FORBIDDEN = "the metrics show every tenant's traffic: they need the admin token (--admin-token-file)"
METRICS_CONNECTION_TIMEOUT_S = 10.0  # --metrics-port: a connection's TLS handshake, then each read or write


def start_metrics_server(port: int, addr: str, registry, security: ServerSecurity | None = None):
    """Prometheus ``/metrics`` (any path, as prometheus-client serves it) on a thread: HTTPS with
    the server's TLS, and the token required when one is set. Returns the WSGI server
    (``server_port``, ``shutdown()``, ``server_close()``).

    Each connection is served on a thread of its own, its TLS handshake included (not in the
    accepting thread, where one client that sends nothing would stop every scrape), and may
    stall at most ``METRICS_CONNECTION_TIMEOUT_S`` at a time."""
    import socket
    import sys
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    security = security or ServerSecurity()
    app = make_wsgi_app(registry)
    if security.tokens:
        app = _wsgi_bearer(app, security.tokens)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

        def finish_request(self, request, client_address):  # on the connection's own thread
            if isinstance(request, ssl.SSLSocket):
                request.settimeout(METRICS_CONNECTION_TIMEOUT_S)
                try:
                    request.do_handshake()
                except OSError:  # a failed handshake (ssl.SSLError), a client gone or too slow
                    return
            super().finish_request(request, client_address)

        def handle_error(self, request, client_address):  # a client gone or past the timeout: no traceback
            if not isinstance(sys.exc_info()[1], OSError):
                super().handle_error(request, client_address)

    class QuietHandler(WSGIRequestHandler):
        timeout = METRICS_CONNECTION_TIMEOUT_S  # a client that stalls mid-request frees its thread

        def log_message(self, format, *args):  # no access log on stderr
            pass

    httpd = make_server(addr.strip("[]"), port, app, Server, handler_class=QuietHandler)
    if security.tls is not None:  # accept() only accepts; finish_request does the handshake
        httpd.socket = security.tls.server_context().wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=httpd.serve_forever, name=f"specdist-metrics-{httpd.server_port}", daemon=True).start()
    return httpd


def _wsgi_bearer(app, tokens: Tokens):
    """A WSGI app answering unless the request may see every tenant's traffic (:func:`sees_everything`): 403 to
    a tenant's token, 401 to anything else (the tokens as they are at each request)."""

    def guarded(environ, start_response):
        header = environ.get("HTTP_AUTHORIZATION")
        token, admin = tokens.now()
        if sees_everything(header, token, admin):
            return app(environ, start_response)
        if token is not None and bearer_ok(header, token):
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [METRICS_FORBIDDEN.encode() + b"\n"]
        start_response(
            "401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"), ("WWW-Authenticate", "Bearer")]
        )
        return [unauthenticated_message(header).encode() + b"\n"]

    return guarded
