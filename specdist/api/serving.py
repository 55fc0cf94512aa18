"""The serving assembly: the backend that serves the requests and the servers in front of it.

:func:`start_backend` loads the in-process :class:`~specdist.engine.local.Engine` or, with ``cluster.enabled``,
brings the target ranks and draft workers up as Ray actors (:mod:`cluster.deployment`, imported lazily) behind a
:class:`~specdist.engine.remote.RemoteEngine` (and, with ``cluster.replicas``, Ray Serve replicas:
:mod:`cluster.serve`). :func:`start_serving` puts the public gRPC server on it, and optionally the OpenAI-compatible
HTTP API (:mod:`specdist.api.http_server`, same coordinator, same event loop) and Prometheus metrics;
:meth:`Serving.stop` drains, stops the servers, then the deployment (actors, placement groups) and Ray if this
process started it. :func:`watch_deployment` connects a deployment's supervisor to the coordinator.

``specdist serve`` itself (its flags, its checks, its signals) is :mod:`specdist.api.serve_command`.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdist.api import preflight  # its checks through the module: a test replaces one where it lives
from specdist.errors import ListenError


def log_stderr(msg: str) -> None:
    """One line of the serving process's log, on stderr."""
    print(f"[specdist] {msg}", file=sys.stderr, flush=True)


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

    def close_and_report(self, log: Callable[[str], None] = log_stderr) -> None:
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
    log: Callable[[str], None] = log_stderr,
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
    :func:`~specdist.api.preflight.check_config` returned, when the caller checked the config (then not checked again).

    Blocking. On any failure (also KeyboardInterrupt) everything created here is torn down again.
    """
    from specdist.config import load_config
    from specdist.models.metadata import resolve_sources

    cfg = load_config(config)
    draft = preflight.check_config(cfg) if draft is None else draft
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
        preflight.check_http_dependencies()
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
