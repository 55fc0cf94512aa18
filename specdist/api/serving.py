"""Command-line glue for the gRPC server, the backends behind it, and the remote ``generate``.

    specdist serve --config configs/local.yaml --port 50051     # until SIGINT/SIGTERM, then drains
    specdist serve --config configs/local.yaml --http-port 8000 # ... and the OpenAI-compatible HTTP API
    specdist serve --config configs/local.yaml --metrics-port 9400   # ... and Prometheus /metrics on 9400
    specdist serve --config configs/default.yaml                # cluster.enabled: a local Ray deployment
    specdist serve --config configs/default.yaml --ray-address auto   # ... on a running Ray cluster
    specdist generate --server 127.0.0.1:50051 "prompt"         # streams text; stats on stderr

With ``cluster.enabled`` the target ranks and draft workers run as Ray actors
(:mod:`cluster.deployment`, imported lazily) behind a :class:`~specdist.engine.remote.RemoteEngine`,
and the same public server fronts it. ``--http-port`` adds the OpenAI-compatible HTTP API
(:mod:`specdist.api.http_server`) over the same coordinator, on the same event loop. On
SIGINT/SIGTERM: drain, stop the servers, stop the deployment (actors, placement groups),
shut down Ray if this process started it.

Everything that can be checked cheaply is checked before the model loads (which takes
seconds, a deployment a minute or more): that ``--port`` (and ``--http-port``) is free, and
that the optional dependencies needed (Ray: the ``[distributed]`` extra; FastAPI and uvicorn
for ``--http-port``: the ``[http]`` extra) are installed.
Each failure is one line naming the fix.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.util
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specdist import gc_freeze
from specdist.errors import ListenError, SpecDistError

INSTALL_DISTRIBUTED = 'pip install -e ".[distributed]"'
INSTALL_HTTP = 'pip install -e ".[http]"'


class MissingDependency(SpecDistError):
    """An optional dependency the config needs is not installed."""


class RequestFailed(SpecDistError):
    """The server ended the request without finishing it (finish reason abort or error)."""

    exit_status = 1


def default_config_help() -> str:
    """What running without ``--config`` means, read from the config defaults (so it stays true)."""
    from specdist.config import Config

    cfg = Config()
    d = cfg.draft
    if d.enabled:
        draft = f"{d.method} draft, {d.length_policy} draft length up to k={d.num_speculative_tokens}"
    else:
        draft = "no draft (target only)"
    where = "a Ray deployment" if cfg.cluster.enabled else "in process"
    return f"YAML config (default: the built-in {cfg.target.model} {where}, {draft})"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help=default_config_help())
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on this port (0: any free port; "
        "default: off; needs the [http] extra)",
    )
    parser.add_argument("--http-host", default=None, help="address the HTTP API listens on (default: --host)")
    parser.add_argument("--max-queued", type=int, default=256, help="most requests running + waiting at once")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: off)",
    )
    parser.add_argument("--drain-seconds", type=float, default=5.0, help="on shutdown, wait this long for requests")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="cluster.enabled: connect to this Ray cluster (e.g. auto, or ray://host:10001); "
        "default: start a local Ray cluster for the deployment and shut it down on exit",
    )
    parser.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="cluster.enabled: address the target/draft workers listen on (must be reachable from this process); "
        "'node': each worker its own Ray node's address; 0.0.0.0: all interfaces, advertising the node's",
    )
    add_tls_arguments(parser)
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PATH",
        help="require client certificates signed by this CA (PEM; needs --tls-cert)",
    )
    parser.add_argument(
        "--admin-token-file",
        default=None,
        metavar="PATH",
        help="the token that reads /metrics and GetServerInfo's counters (every tenant's traffic); "
        "with several tenants and none, nobody reads them",
    )


def add_tls_arguments(parser: argparse.ArgumentParser, ca: bool = False) -> None:
    """The TLS and token flags ``serve`` (the server's certificate) and ``generate --server`` (the client's) share."""
    who = "client" if ca else "server"
    if ca:
        parser.add_argument(
            "--tls-ca",
            default=None,
            metavar="PATH",
            help="with --server: TLS, trusting this CA (PEM; default: plaintext, or the system's "
            "roots with --tls-cert)",
        )
    parser.add_argument(
        "--tls-cert", default=None, metavar="PATH", help=f"TLS: the {who} certificate chain (PEM; with --tls-key)"
    )
    parser.add_argument("--tls-key", default=None, metavar="PATH", help=f"TLS: the {who} private key (PEM)")
    parser.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help="bearer token file: " + ("sent with every call" if ca else "required on every call except health checks"),
    )


def _log(msg: str) -> None:
    print(f"[specdist] {msg}", file=sys.stderr, flush=True)


def check_listen(host: str, port: int) -> None:
    """Raise ListenError unless ``host:port`` can be bound now.

    Binds (and closes) a socket per address ``host`` resolves to, with SO_REUSEADDR as grpc
    sets it, so a port in TIME_WAIT passes and a port someone listens on does not. (grpc also
    sets SO_REUSEPORT; this check does not, so a second server on the port of a running one is
    refused here instead of silently sharing its port.)
    """
    if not 0 <= port <= 65535:
        raise ListenError(f"cannot listen on {host}:{port}: the port must be in [0, 65535]")
    from specdist.transport.hosts import bare_host

    try:
        infos = socket.getaddrinfo(bare_host(host) or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    errors: list[OSError] = []
    bound = 0
    for family, type_, proto, _, addr in infos:
        try:
            with socket.socket(family, type_, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                bound += 1
        except OSError as e:
            errors.append(e)
    busy = [e for e in errors if e.errno == errno.EADDRINUSE]
    if busy or not bound:
        e = (busy or errors)[0]
        why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise ListenError(f"cannot listen on {host}:{port}: {why}")


def check_config(cfg: Any) -> Any:
    """What a loaded config needs before anything starts, beyond what load_config checks: a draft method that
    serves ``draft.method`` with its settings (:func:`specdist.cores.proposers.resolve_draft`: a ConfigError
    naming the key), and the extras it runs on (MissingDependency naming the extra when one is not installed).
    Returns the draft section resolved (a ResolvedDraft), for :func:`start_backend` to take instead of checking
    it again."""
    from specdist.cores.proposers import resolve_draft
    from specdist.models.backends import backend_class

    draft = resolve_draft(cfg.draft, cfg.target.dtype)
    _check_draft_device(cfg, draft.copy)
    if cfg.engine.attention_backend != "auto":
        backend_class(cfg.engine.attention_backend)  # a ConfigError naming the key and the registered names
    if cfg.cluster.enabled and not _importable("ray"):
        raise MissingDependency(f"cluster.enabled needs Ray: {INSTALL_DISTRIBUTED}")
    return draft


def _check_draft_device(cfg: Any, copy: str | None) -> None:
    """A draft whose target copy (``copy``) cannot run on the device the models will: ``self-w8`` (and hybrid's) on CUDA
    (:func:`specdist.models.quant.refuse_int8_on`), a one-line ConfigError naming ``draft.method``. In process the
    device is ``engine.device`` (auto: CUDA when this machine has it); on Ray ``cluster.use_gpu``, else
    ``engine.device`` when it names one (auto there: the deployment checks it once it knows the cluster's GPUs)."""
    from specdist.models.devices import device_for
    from specdist.models.quant import refuse_int8_on

    if copy is None:
        return
    device = cfg.engine.device
    if cfg.cluster.enabled:
        gpu = cfg.cluster.gpu
        device = ("cuda" if gpu else "cpu") if gpu is not None else device
        if device == "auto":
            return
    refuse_int8_on(copy, device_for(device).type)


def check_http_dependencies() -> None:
    """Raise MissingDependency naming the extra unless FastAPI and uvicorn are installed."""
    missing = [m for m in ("fastapi", "uvicorn") if not _importable(m)]
    if missing:
        raise MissingDependency(f"--http-port needs {' and '.join(missing)}: {INSTALL_HTTP}")


def _importable(module: str) -> bool:
    """Whether ``import module`` would find it (without importing it: Ray takes seconds)."""
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def describe(backend: "Backend") -> str:
    """Where a backend runs, for the command line's stderr."""
    if backend.deployment is None:
        return "in process"
    cfg = backend.engine.config
    return (
        f"on a Ray deployment: TP={cfg.cluster.tensor_parallel_size} target at {backend.target_address}, "
        f"{len(backend.draft_addresses)} draft worker(s)"
    )


@dataclass
class Backend:
    """What serves the requests: the in-process Engine, or a RemoteEngine over a Ray deployment."""

    engine: Any
    deployment: Any = None  # cluster.deployment.Deployment when cluster.enabled
    target_address: str | None = None
    draft_addresses: list = field(default_factory=list)
    owns_ray: bool = False  # ray.init was called here: ray.shutdown() on close
    replicas: Any = None  # cluster.serve.Replicas with cluster.replicas: its front serves instead of a Coordinator
    _closed: bool = False
    _actors_stopped: int = 0

    def close_and_report(self, log: Callable[[str], None] = _log) -> None:
        """close(), then say what was stopped (a deployment's actors and placement groups)."""
        if self.deployment is None:
            self.close()
            return
        if not self._closed:
            log("stopping the deployment")
        t0 = time.perf_counter()
        self.close()
        ray_note = ", Ray shut down" if self.owns_ray else ""
        log(
            f"deployment stopped in {time.perf_counter() - t0:.1f}s "
            f"({self._actors_stopped} actors, placement groups removed{ray_note})"
        )

    def close(self) -> None:
        """Close the engine, stop the deployment (actors + placement groups), shut down Ray if ours. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.replicas is not None:
                self.replicas.close()  # Serve drains and stops each replica (its group with it)
            if self.deployment is not None:
                self._actors_stopped = len(self.deployment.targets) + len(self.deployment.drafts)
                try:
                    self.engine.close()  # RemoteEngine: channels + thread pool
                finally:
                    self.deployment.stop()
        finally:
            if self.owns_ray:
                import ray

                if ray.is_initialized():
                    ray.shutdown()


def start_backend(
    config: Any,
    ray_address: str | None = None,
    worker_host: str = "127.0.0.1",
    log: Callable[[str], None] = _log,
    tokenizer: Any = None,
    sources: Any = None,
    max_queued: int = 256,
    drain_seconds: float = 5.0,
    draft: Any = None,
) -> Backend:
    """Load the engine (cluster.enabled false), or bring a Ray deployment up and connect a RemoteEngine to it.

    The config's model specs are resolved once, here (:func:`specdist.models.metadata.resolve_sources`; a bad
    spec fails before anything starts), unless the caller did (``sources``); the engine, or the deployment, its
    workers and the RemoteEngine, take what they resolved to. A deployment's coordinator reads the target's
    config, vocabulary, EOS ids and tokenizer first (one parse of a GGUF header), which the workers then get.
    ``tokenizer``: the target's, when the caller already loaded it (then not loaded again). ``draft``: what
    :func:`check_config` returned, when the caller checked the config (then not checked again).

    Blocking. On any failure (also KeyboardInterrupt) everything created here is torn down again.
    """
    from specdist.config import load_config
    from specdist.models.metadata import resolve_sources

    cfg = load_config(config)
    draft = check_config(cfg) if draft is None else draft
    sources = resolve_sources(cfg) if sources is None else sources
    if tokenizer is not None:
        sources.use_tokenizer(tokenizer)
    if not cfg.cluster.enabled:
        from specdist.engine.local import Engine

        return Backend(Engine.from_config(cfg, sources=sources, resolved=draft))

    import ray  # lazily: only a deployment needs Ray, cluster/ and workers/

    from cluster.deployment import Deployment
    from cluster.local import LOOPBACK_HOSTS, init_local_ray
    from specdist.transport.hosts import bare_host

    sources.read_target_metadata()  # the coordinator's, and what the workers would otherwise each read again
    cc = cfg.cluster
    backend = Backend(engine=None)
    try:
        if not ray.is_initialized():
            if ray_address:
                log(f"connecting to Ray at {ray_address}")
                backend.owns_ray = True
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
            else:
                need = cc.tensor_parallel_size * cc.cpus_per_rank + cc.num_draft_workers * cc.cpus_per_draft
                if cc.replicas is not None:
                    from cluster.serve import ceil_cpus

                    need = ceil_cpus(cfg)
                num_cpus = max(os.cpu_count() or 1, math.ceil(need))
                log(f"starting a local Ray cluster with {num_cpus} logical CPUs")
                backend.owns_ray = True
                # a cluster of this one machine: on loopback, as are the workers (unless
                # --worker-host says otherwise)
                init_local_ray(num_cpus, loopback=bare_host(worker_host) in LOOPBACK_HOSTS)
        if cc.replicas is not None:  # speculative groups as Serve replicas, chosen per request by the router
            from cluster.serve import start_replicas

            backend.replicas = start_replicas(cfg, sources, max_queued, drain_seconds, worker_host, log)
            backend.engine = backend.replicas.front.engine
            return backend
        log(
            f"bringing up {cc.tensor_parallel_size} target rank(s) + {cc.num_draft_workers} draft worker(s) "
            f"(timeout {cc.bringup_timeout_s:g}s)"
        )
        backend.deployment = Deployment.from_config(cfg)
        target, drafts = backend.deployment.start(
            cfg, host=worker_host, timeout_s=cc.bringup_timeout_s, sources=sources, draft=draft
        )
        backend.target_address, backend.draft_addresses = target, list(drafts)
        log(f"target worker (rank 0) at {target}; draft workers at {', '.join(drafts) or '-'}")
        backend.engine = backend.deployment.connect()
    except BaseException:
        if backend.engine is None and backend.deployment is not None:
            backend.engine = _NoEngine()
        backend.close()
        raise
    return backend


class _NoEngine:
    def close(self) -> None:
        pass


@dataclass
class Serving:
    """A started ``specdist serve``: the gRPC server over its backend; ``await stop()`` tears both down."""

    server: Any  # specdist.api.grpc_server.SpecDistServer
    backend: Backend
    host: str = "127.0.0.1"
    metrics_server: Any = None  # prometheus-client's WSGI server with --metrics-port
    http: Any = None  # specdist.api.http_server.HttpServer, with --http-port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.server.port}"

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_server is None else self.metrics_server.server_port

    async def stop_servers(self, drain_seconds: float | None = None) -> None:
        """Drain the coordinator (gRPC and HTTP refuse new requests; running ones finish, up to the
        drain time, then are aborted), stop the gRPC server, then the HTTP server."""
        try:
            await self.server.stop(drain_seconds)
        finally:
            if self.http is not None:
                await self.http.stop()

    async def stop(self, drain_seconds: float | None = None) -> None:
        """Drain and stop the servers, then the backend (deployment, Ray if ours)."""
        try:
            await self.stop_servers(drain_seconds)
        finally:
            self.stop_metrics()
            await asyncio.to_thread(self.backend.close)

    def stop_metrics(self) -> None:
        """Stop the --metrics-port server (idempotent)."""
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None


async def start_serving(
    config: Any = None,
    host: str = "127.0.0.1",
    port: int = 0,
    max_queued: int = 256,
    drain_seconds: float = 5.0,
    ray_address: str | None = None,
    worker_host: str = "127.0.0.1",
    backend: Backend | None = None,
    metrics_port: int | None = None,
    http_port: int | None = None,
    http_host: str | None = None,
    security: Any = None,
) -> Serving:
    """Everything ``specdist serve`` does before waiting for a signal; returns the handle to stop it.

    Without ``backend`` it is brought up here (:func:`start_backend`, blocking this event loop).
    ``metrics_port``: also serve the coordinator's Prometheus registry there (0: any free port).
    ``http_port``: also serve the OpenAI-compatible HTTP API there (on ``http_host``, default ``host``).
    ``security``: a :class:`specdist.transport.security.ServerSecurity` (TLS, token) for every one of these ports.
    """
    from specdist.api.grpc_server import serve
    from specdist.transport.security import start_metrics_server

    if http_port is not None:
        check_http_dependencies()
    if backend is None:
        backend = start_backend(config, ray_address, worker_host, max_queued=max_queued, drain_seconds=drain_seconds)
    front = backend.replicas.front if backend.replicas is not None else None
    try:
        server, coordinator = await serve(
            backend.engine, host, port, max_queued, drain_seconds, security, coordinator=front
        )
    except BaseException:
        await asyncio.to_thread(backend.close)
        raise
    serving = Serving(server, backend, host)
    if backend.deployment is not None:
        watch_deployment(backend.deployment, coordinator)
    if metrics_port is not None:
        try:
            serving.metrics_server = start_metrics_server(metrics_port, host, coordinator.metrics.registry, security)
        except BaseException as e:
            await serving.stop(0)
            if isinstance(e, OSError):
                raise ListenError(f"cannot listen on {host}:{metrics_port} (--metrics-port): {e.strerror}") from None
            raise
    if http_port is not None:
        try:
            from specdist.api.http_server import start_http

            serving.http = await start_http(coordinator, http_host or host, http_port, security=security)
        except BaseException:
            await serving.stop(0)
            raise
    return serving


def watch_deployment(deployment: Any, coordinator: Any) -> None:
    """Connect a deployment's supervisor (cluster/supervisor.py) to the coordinator serving it.

    ``target_down``: every request fails with the reason and new ones get UNAVAILABLE (health
    NOT_SERVING); ``target_up``: the verifier reconnects to rank 0 and forgets the releases owed to the
    old group (``Scheduler.retarget``), then requests are admitted
    again; ``target_lost`` (every rebuild failed): requests are refused for good and the gRPC
    liveness turns NOT_SERVING (``Coordinator.target_lost``: only a restart helps); ``draft_down``:
    the scheduler ejects that replica at once, cutting its calls in flight (``Scheduler.replica_down``),
    and its requests go on without drafts; ``draft_up``: the scheduler probes that replica and
    re-admits it. A failed target call asks the deployment which rank failed, so the requests'
    error names it.
    """
    engine = coordinator.engine

    def on_event(event: Any) -> None:
        if event.kind == "target_down":
            coordinator.target_down(event.message)
        elif event.kind == "target_up":
            coordinator.target_up(lambda: engine.retarget(event.address))
        elif event.kind == "target_lost":
            coordinator.target_lost(event.message)
        elif event.kind == "draft_up" and event.index < engine.num_draft_replicas:
            coordinator.call_soon(lambda: engine.readmit(event.index, event.address))
        elif event.kind == "draft_down" and event.index < engine.num_draft_replicas:
            engine.replica_down(event.index, f"{event.worker} {event.message}")  # now: cuts its calls in flight

    engine.target_diagnosis = deployment.diagnose_target
    deployment.listeners.append(on_event)


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
    draft = check_config(cfg)
    http_port = getattr(args, "http_port", None)
    if http_port is not None:
        check_http_dependencies()
        if http_port == args.port and http_port != 0:
            raise ListenError(f"--http-port {http_port}: the gRPC server listens on that port (--port)")
    check_listen(args.host, args.port)  # before the minutes of loading, not after them
    if http_port is not None:
        check_listen(getattr(args, "http_host", None) or args.host, http_port)
    if getattr(args, "metrics_port", None) is not None:
        check_listen(args.host, args.metrics_port)
    # bring-up can take minutes: SIGTERM then interrupts it like Ctrl-C, so it tears down what it made
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        backend = start_backend(
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
    _log(f"{gc_freeze.freeze()} start-up objects frozen out of the garbage collector's walks")
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


def shut_down(backend: Backend, log: Callable[[str], None] = _log) -> None:
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
    _log("tearing down; please wait")


async def _serve_until_signalled(backend: Backend, args: argparse.Namespace) -> None:
    serving = await start_serving(
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
    _log(describe_security(sec))
    if isinstance(sec.token, tuple) and len(sec.token) > 1 and sec.admin_token is None:
        _log(
            "several tenants and no --admin-token-file: /metrics and GetServerInfo's counters are refused to every "
            "token"
        )
    _log(
        f"serving {cfg.target.model} (draft={cfg.draft.method} k={engine.k}, {describe(backend)}) on {serving.address}"
    )
    if sec.token is not None and sec.tls is None:
        _log("warning: --auth-token-file without --tls-cert: the token crosses the network in cleartext")
    if serving.http is not None:
        _log(f"OpenAI-compatible HTTP API on {sec.scheme}://{serving.http.address}/v1")
    if serving.metrics_port is not None:
        _log(f"Prometheus metrics on {sec.scheme}://{serving.host}:{serving.metrics_port}/metrics")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    _log(f"draining (up to {args.drain_seconds:g}s)")
    await serving.stop_servers()  # the backend is closed by run_serve, with signals held off
    serving.stop_metrics()
    _log("stopped")


def describe_security(security: Any) -> str:
    """TLS / mutual TLS / plaintext, and whether a token is required, for the serve log line."""
    if security.tls is None:
        tls = "plaintext"
    else:
        tls = "mutual TLS" if security.tls.client_ca is not None else "TLS"
    return "public ports: " + tls + (", bearer token required" if security.token is not None else ", no authentication")


def run_remote_generate(
    server: str,
    prompt: str | list[int],
    params_kwargs: dict[str, Any],
    raw: bool,
    client_kwargs: dict[str, Any] | None = None,
) -> int:
    """Stream one generation from a running server to stdout; stats on stderr.

    ``params_kwargs``: SpecDistClient.generate keywords (max_tokens, temperature, top_p,
    top_k, seed, stop, ...). Without ``raw`` a text prompt is wrapped in the model's
    chat template by the server. Server errors raise RemoteError (a SpecDistError); a request
    the server aborted or failed raises RequestFailed (exit status 1) naming the finish reason.
    ``client_kwargs``: SpecDistClient's TLS and token keywords.
    """
    import grpc

    from specdist.client import RemoteError, SpecDistClient

    t0 = time.perf_counter()
    last = None
    with SpecDistClient(server, **(client_kwargs or {})) as client:
        chat = not raw and isinstance(prompt, str)
        try:
            try:
                last = _stream_to_stdout(client.generate(prompt, apply_chat_template=chat, **params_kwargs))
            except RemoteError as e:  # like the local CLI: a model without a chat template gets the raw prompt
                if not (chat and e.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.message):
                    raise
                last = _stream_to_stdout(client.generate(prompt, **params_kwargs))
        except RemoteError as e:
            if e.code != grpc.StatusCode.INTERNAL:  # bad input, unreachable, overloaded: exit 2 as before
                raise
            sys.stdout.write("\n")
            raise RequestFailed(f"the request failed on the server (finish_reason=error): {e.message}") from None
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - t0
    if last is not None and last.stats is not None:
        s = last.stats
        print(
            f"[specdist] server={server} tokens={s.output_tokens} finish={last.finish_reason} steps={s.steps} "
            f"drafted={s.drafted} accepted={s.accepted} acceptance={s.acceptance_rate:.1%} "
            f"tokens/s={s.output_tokens / max(elapsed, 1e-9):.1f} ttft={s.time_to_first_token_s * 1000:.0f}ms",
            file=sys.stderr,
        )
    reason = last.finish_reason if last is not None else None
    if reason not in ("stop", "length"):
        what = {"abort": "was aborted by the server", "error": "failed on the server"}.get(
            reason, "ended without a finish reason"
        )
        raise RequestFailed(f"the request {what} (finish_reason={reason or 'none'})")
    return 0


def _stream_to_stdout(chunks: Iterator[Any]) -> Any:
    """Write each chunk's text as it arrives; return the last chunk."""
    last = None
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    return last
