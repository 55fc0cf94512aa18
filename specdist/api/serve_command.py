"""``specdist serve``: check, bring the backend up, serve until SIGINT/SIGTERM, drain, tear down.

    specdist serve --config configs/local.yaml --port 50051     # until SIGINT/SIGTERM, then drains
    specdist serve --config configs/local.yaml --http-port 8000 # ... and the OpenAI-compatible HTTP API
    specdist serve --config configs/local.yaml --metrics-port 9400   # ... and Prometheus /metrics on 9400
    specdist serve --config configs/default.yaml                # cluster.enabled: a local Ray deployment
    specdist serve --config configs/default.yaml --ray-address auto   # ... on a running Ray cluster

Everything :mod:`specdist.api.preflight` can check cheaply is checked before the model loads. Signals: during
bring-up SIGTERM interrupts it like Ctrl-C (what was made is torn down); while serving, SIGINT/SIGTERM drain and
stop the servers; during tear-down they are held off (a second Ctrl-C must not cut a deployment's stop short).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
from collections.abc import Callable
from typing import Any

from specdist import gc_freeze

# called through their modules: a test replaces a check or the bring-up where it lives, and serve sees it
from specdist.api import preflight, serving
from specdist.api.serving import log_stderr
from specdist.errors import ListenError


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine (or bring the Ray deployment up), serve until SIGINT/SIGTERM, drain, tear down, exit 0."""
    if args.max_queued < 1:
        raise ValueError(f"--max-queued must be >= 1, got {args.max_queued}")
    if args.drain_seconds < 0:
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    from specdist.config import load_config
    from specdist.transport.security import ServerSecurity

    args.security = ServerSecurity.from_args(
        getattr(args, "tls_cert", None),
        getattr(args, "tls_key", None),
        getattr(args, "tls_client_ca", None),
        getattr(args, "auth_token_file", None),
        getattr(args, "admin_token_file", None),
    )
    cfg = load_config(args.config)
    draft = preflight.check_config(cfg)
    http_port = getattr(args, "http_port", None)
    if http_port is not None:
        preflight.check_http_dependencies()
        if http_port == args.port and http_port != 0:
            raise ListenError(f"--http-port {http_port}: the gRPC server listens on that port (--port)")
    preflight.check_listen(args.host, args.port)  # before the minutes of loading, not after them
    if http_port is not None:
        preflight.check_listen(getattr(args, "http_host", None) or args.host, http_port)
    if getattr(args, "metrics_port", None) is not None:
        preflight.check_listen(args.host, args.metrics_port)
    # bring-up can take minutes: SIGTERM then interrupts it like Ctrl-C, so it tears down what it made
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        backend = serving.start_backend(
            cfg,
            getattr(args, "ray_address", None),
            getattr(args, "worker_host", "127.0.0.1"),
            max_queued=args.max_queued,
            drain_seconds=args.drain_seconds,
            draft=draft,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    # this process serves from here on: its start-up objects leave the garbage collector's walks
    log_stderr(f"{gc_freeze.freeze()} start-up objects frozen out of the garbage collector's walks")
    try:
        asyncio.run(_serve_until_signalled(backend, args))
    except (RuntimeError, OSError) as e:
        if not _is_bind_error(e):
            raise
        raise ListenError(f"cannot listen on {args.host}:{args.port}: {_first_line(e)}") from None
    finally:
        shut_down(backend)
        gc_freeze.unfreeze()
    return 0


def shut_down(backend: serving.Backend, log: Callable[[str], None] = log_stderr) -> None:
    """``backend.close_and_report()`` with SIGINT/SIGTERM held off (main thread only): a second
    Ctrl-C must not cut a deployment's tear-down short (it is bounded by the deployment's timeouts)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        backend.close_and_report(log)
        return
    old = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        backend.close_and_report(log)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _is_bind_error(e: BaseException) -> bool:
    """grpc's add_insecure_port failure (RuntimeError "Failed to bind to address ...") or the server's OSError."""
    text = str(e)
    return "Failed to bind" in text or "cannot listen on" in text or getattr(e, "errno", None) == errno.EADDRINUSE


def _first_line(e: BaseException) -> str:
    text = str(e).split(";")[0].strip()
    return text.splitlines()[0] if text else type(e).__name__


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _ignore(signum: int, frame: Any) -> None:
    log_stderr("tearing down; please wait")


async def _serve_until_signalled(backend: serving.Backend, args: argparse.Namespace) -> None:
    started = await serving.start_serving(
        host=args.host,
        port=args.port,
        max_queued=args.max_queued,
        drain_seconds=args.drain_seconds,
        backend=backend,
        metrics_port=getattr(args, "metrics_port", None),
        http_port=getattr(args, "http_port", None),
        http_host=getattr(args, "http_host", None),
        security=args.security,
    )
    engine = backend.engine
    cfg = engine.config
    sec = args.security
    log_stderr(describe_security(sec))
    if isinstance(sec.token, tuple) and len(sec.token) > 1 and sec.admin_token is None:
        log_stderr(
            "several tenants and no --admin-token-file: /metrics and GetServerInfo's counters are refused to every "
            "token"
        )
    where = serving.describe(backend)
    log_stderr(f"serving {cfg.target.model} (draft={cfg.draft.method} k={engine.k}, {where}) on {started.address}")
    if sec.token is not None and sec.tls is None:
        log_stderr("warning: --auth-token-file without --tls-cert: the token crosses the network in cleartext")
    if started.http is not None:
        log_stderr(f"OpenAI-compatible HTTP API on {sec.scheme}://{started.http.address}/v1")
    if started.metrics_port is not None:
        log_stderr(f"Prometheus metrics on {sec.scheme}://{started.host}:{started.metrics_port}/metrics")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    log_stderr(f"draining (up to {args.drain_seconds:g}s)")
    await started.stop_servers()  # the backend is closed by run_serve, with signals held off
    started.stop_metrics()
    log_stderr("stopped")


def describe_security(security: Any) -> str:
    """TLS / mutual TLS / plaintext, and whether a token is required, for the serve log line."""
    if security.tls is None:
        tls = "plaintext"
    else:
        tls = "mutual TLS" if security.tls.client_ca is not None else "TLS"
    return "public ports: " + tls + (", bearer token required" if security.token is not None else ", no authentication")
