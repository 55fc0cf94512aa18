"""Speculative groups as Ray Serve replicas (``cluster.replicas``).

Each replica of the Serve deployment :class:`SpecdistReplica` is one whole speculative group: its target ranks
and draft workers are placed in the replica's own placement group (:func:`cluster.placement.replica_bundles`:
the replica's bundle first, then one per rank and per draft), so Serve places, health-checks, restarts, scales
and drains a group as one; the workers are the replica actor's children and die with it. Inside, the group is
today's :class:`~cluster.deployment.Deployment` (with its supervisor: a draft restarted, a target group rebuilt)
behind its own :class:`~specdist.api.coordinator.Coordinator`.

Serve does what it is made for: replicas (``num_replicas``, or ``autoscaling_config`` from
``cluster.replicas: {min, max, ...}``), health checks (:meth:`SpecdistReplica.check_health`: a group that cannot
recover by itself is replaced), graceful shutdown (a replica scaled down or replaced in a rolling update stops
taking requests and finishes its streams first, up to the drain time), and routing through our
:class:`~specdist.api.serve_router.SpecdistRequestRouter` fed by :meth:`SpecdistRequestRouter.record_routing_stats`.

The front doors (gRPC and HTTP, :func:`start_replicas`) run in the ``specdist serve`` process and reach the
replicas through a streaming deployment handle (:class:`ServeReplicas`), not Serve's proxies: our gRPC service
keeps its TLS, tenant tokens, health and reflection, which Serve's gRPC proxy does not offer, and a handle call
skips the proxy's extra hop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any

from specdist.api.coordinator import Coordinator
from specdist.api.replica_set import Admitted, FrontEngine, FrontMetrics, Refused, ReplicaFront, ReplicaReports
from specdist.api.replica_stats import EngineLedger
from specdist.api.router import RouteRequest
from specdist.config import Config, ReplicasConfig, load_config
from specdist.engine.prompts import EncodedPrompt
from specdist.errors import SpecDistError
from specdist.sampling_params import SamplingParams

log = logging.getLogger("specdist.load")

APP_NAME = "specdist"
DEPLOYMENT_NAME = "SpecdistReplica"
STATUS_POLL_S = 0.25  # how often start_replicas asks Serve whether the replicas run


class ReplicasError(SpecDistError):
    """The replicas did not come up (in time), naming what is missing."""


class SpecdistReplica:
    """One Serve replica: one speculative group and its coordinator (module docstring).

    ``config``: the Config as a dict; ``sources``: its models resolved by the ``specdist serve`` process
    (:class:`~specdist.models.metadata.ModelSources`); ``max_queued``: the coordinator's bound (Serve's
    ``max_ongoing_requests`` is the same); ``worker_host``: where the group's workers listen."""

    def __init__(self, config: dict, sources: Any = None, max_queued: int = 256, worker_host: str = "127.0.0.1"):
        import ray
        from ray import serve

        from cluster.deployment import ClusterSpec, Deployment
        from specdist.api.serving import watch_deployment

        cfg = load_config(config)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.to_full_id_str()
        rank = getattr(ctx, "rank", None)
        local = getattr(rank, "local_rank", None)
        spec = ClusterSpec.from_config(
            cfg,
            placement_group=ray.util.get_current_placement_group(),
            replica_index=int(local) if local is not None else 0,
            name=f"specdist-{ctx.replica_id.unique_id}",
        )
        self.deployment = Deployment(spec)
        self.deployment.start(cfg, host=worker_host, timeout_s=cfg.cluster.bringup_timeout_s, sources=sources)
        engine = self.deployment.connect()
        self.coordinator = Coordinator(engine, max_queued=max_queued)
        watch_deployment(self.deployment, self.coordinator)
        ec = cfg.engine
        blocks = (ec.kv_cache_tokens or ec.max_batch_size * ec.max_model_len) // ec.kv_block_size
        self.ledger = EngineLedger(blocks, ec.kv_block_size)
        engine.listeners.append(self.ledger)
        self.tenant_prefixes = ec.prefix_cache_scope == "tenant"
        self.max_batch_size = ec.max_batch_size
        self._warm = False
        self._target_health: Any = None  # rank 0's health() asked for, not yet read (_prefix_reused_tokens)
        self._reused_tokens = 0

    async def _ready(self) -> None:
        """Start the coordinator on the replica's event loop and warm its engine up (once)."""
        self.coordinator.start()
        if not self._warm:
            await self.coordinator.warm_up()
            self._warm = True

    async def check_health(self) -> None:
        """Serve's health check: a group that cannot recover by itself (its target lost for good, its engine
        thread dead) fails it, and Serve replaces the replica. A target being rebuilt is not a failure."""
        await self._ready()
        why = self.coordinator.unrecoverable
        if why is not None:
            raise RuntimeError(why)

    def record_routing_stats(self) -> dict:
        """What the router knows of this replica (:class:`~specdist.api.router.ReplicaStats`), with its counters."""
        d = self.ledger.stats(self.replica_id, time.time(), self.max_batch_size).to_dict()
        d["counters"] = {**self.coordinator.counters(), "prefix_reused_tokens": self._prefix_reused_tokens()}
        d["accepting"] = self.coordinator.accepting  # False: its target is down or it drains; routed around
        return d

    def _prefix_reused_tokens(self) -> int:
        """Prompt tokens rank 0's prefix cache served since it started (its health's ``prefix_reused_tokens``), as
        of the last answer: asked for here and read at the next report, so a report never waits on the target."""
        import ray

        ref = self._target_health
        if ref is not None and ray.wait([ref], timeout=0)[0]:
            try:
                self._reused_tokens = int(ray.get(ref).get("prefix_reused_tokens", self._reused_tokens))
            except Exception:  # noqa: BLE001  (a rank being rebuilt: the last figure stands)
                pass
            ref = None
        d = self.deployment
        if ref is None and d is not None and d.targets:
            ref = d.targets[0].actor.health.remote()
        self._target_health = ref
        return self._reused_tokens

    async def describe(self) -> dict:
        """What the front doors report of the replicas (:class:`~specdist.api.replica_set.FrontEngine`'s fields
        but the config and tokenizer, which the front has)."""
        from specdist.api.admission import draft_replicas

        await self._ready()
        e = self.coordinator.engine
        return dict(
            vocab_size=e.vocab_size,
            max_model_len=e.max_model_len,
            k=e.k,
            pipelined=e.traits.pipelined,
            tensor_parallel_size=getattr(e, "tensor_parallel_size", 1),
            num_draft_replicas=draft_replicas(e),
            cpu_kernels=getattr(e, "cpu_kernels", ""),
            memory_plan=getattr(e, "memory_plan", ""),
            replica_id=self.replica_id,
        )

    async def generate(
        self,
        prompt: EncodedPrompt,
        params: SamplingParams | None,
        request_id: str,
        scope: str,
        tenant: str,
        age_s: float = 0.0,
        specdist_route: dict | None = None,
    ):
        """Stream one request: :class:`Admitted` (or :class:`Refused`), then its deltas. Cancelled by the caller
        (the front's ``close``), the stream closes and the coordinator aborts the request."""
        await self._ready()
        # its time to first token counts from its arrival at the front door
        prompt = EncodedPrompt(prompt.text, prompt.ids, time.perf_counter() - max(0.0, age_s))
        try:
            stream = await self.coordinator.open(prompt, params, request_id, scope=scope, tenant=tenant)
        except Exception as e:  # noqa: BLE001  (a refusal: the front raises it as it is)
            yield Refused(e, self.replica_id)
            return
        route = RouteRequest.from_dict(
            {
                **(specdist_route or {}),
                "request_id": stream.key,
                "prompt_tokens": len(prompt.ids),
                "max_tokens": (params or SamplingParams()).max_tokens,
            }
        )
        self.ledger.admit(
            stream.key,
            prompt.ids,
            route.max_tokens,
            route.session,
            route.kind,
            scope=tenant if self.tenant_prefixes else "",
        )
        yield Admitted(self.replica_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()
            self.ledger.forget(stream.key)

    def __del__(self) -> None:
        """Serve shuts the replica down (after its streams ended or the drain time passed): stop the group."""
        d = getattr(self, "deployment", None)
        if d is not None:
            self.deployment = None
            d.stop()


class ServeReplicas:
    """The front's transport to the replicas: a streaming handle of the deployment (the router runs in this
    process); which replicas run, from Serve's status, refreshed on a thread (never on the event loop)."""

    def __init__(self, handle: Any, period_s: float = 1.0, app_name: str = APP_NAME):
        self.handle = handle.options(stream=True)
        self.app_name = app_name
        self.running = 0
        self._stop = threading.Event()
        self._period = period_s
        self._refresh()
        self._thread = threading.Thread(target=self._loop, name="specdist-replicas", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        from ray import serve

        try:
            app = serve.status().applications.get(self.app_name)
            dep = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
            self.running = int((dep.replica_states or {}).get("RUNNING", 0)) if dep is not None else 0
        except Exception:  # noqa: BLE001  (the controller is busy or gone: keep the last count)
            log.debug("serve.status() failed", exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            self._refresh()

    def close(self) -> None:
        self._stop.set()

    def open(
        self,
        prompt: EncodedPrompt,
        params,
        request_id: str,
        scope: str,
        tenant: str,
        route: RouteRequest,
        age_s: float,
        avoid: str = "",
    ) -> Any:
        from specdist.api.serve_router import ROUTE_KWARG

        return self.handle.generate.remote(
            prompt,
            params,
            request_id,
            scope,
            tenant,
            age_s,
            **{ROUTE_KWARG: {**route.to_dict(), "tenant": tenant, "avoid": avoid}},
        )

    def failure(self, exc: BaseException) -> str | None:
        """A replica that died or became unreachable (Ray's actor errors); None for anything else."""
        import ray

        if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        if type(exc).__name__ in ("DeploymentUnavailableError", "BackPressureError"):
            return type(exc).__name__
        return None


def deployment_options(cfg: Config, max_queued: int, drain_s: float, use_gpu: bool) -> dict:
    """The Serve deployment options of ``cfg``'s replicas (``serve.deployment(...).options(**these)``)."""
    from ray.serve.config import RequestRouterConfig

    from cluster.placement import COORDINATOR_BUNDLE, replica_bundles

    cc, plan = cfg.cluster, cfg.cluster.replica_plan
    bundles, strategy = replica_bundles(
        cc.tensor_parallel_size, cc.num_draft_workers, use_gpu, cc.cpus_per_rank, cc.cpus_per_draft, cc.gpus_per_draft
    )
    router = dataclasses.asdict(cfg.router)
    period = cfg.router.stats_period_s
    opts: dict[str, Any] = dict(
        name=DEPLOYMENT_NAME,
        ray_actor_options={"num_cpus": COORDINATOR_BUNDLE["CPU"]},
        placement_group_bundles=bundles,
        placement_group_strategy=strategy,
        max_ongoing_requests=max_queued,
        health_check_period_s=max(1.0, cc.health_interval_s),
        health_check_timeout_s=max(5.0, cc.health_timeout_s),
        graceful_shutdown_timeout_s=max(0.0, drain_s),
        graceful_shutdown_wait_loop_s=0.5,
        max_constructor_retry_count=3,
        request_router_config=RequestRouterConfig(
            request_router_class="specdist.api.serve_router:SpecdistRequestRouter",
            request_router_kwargs={"router": router, "block_size": cfg.engine.kv_block_size},
            request_routing_stats_period_s=max(0.1, period / 2),
            request_routing_stats_timeout_s=max(0.1, period / 2),
        ),
    )
    if plan.autoscaling:
        opts["autoscaling_config"] = dict(
            min_replicas=plan.min,
            max_replicas=plan.max,
            initial_replicas=plan.min,
            target_ongoing_requests=plan.target_ongoing_requests or cfg.engine.max_batch_size,
            upscale_delay_s=plan.upscale_delay_s,
            downscale_delay_s=plan.downscale_delay_s,
        )
    else:
        opts["num_replicas"] = plan.min
    return opts


def replicas_cannot_fit(bundles: list[dict], n: int, strategy: str, nodes: dict) -> str | None:
    """Why ``n`` replicas of these bundles cannot fit on the live nodes' total resources, or None."""
    from cluster.placement import fmt

    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0.0) + v * n
    have: dict[str, float] = {}
    for res in nodes.values():
        for k, v in res.items():
            have[k] = have.get(k, 0.0) + v
    missing = {k: v - have.get(k, 0.0) for k, v in need.items() if v - have.get(k, 0.0) > 1e-9}
    if missing:
        return (
            f"{n} replica(s) need {fmt(need)} in all, the cluster has {fmt({k: have.get(k, 0) for k in need})}: "
            f"missing {fmt(missing)}"
        )
    if strategy == "STRICT_PACK":
        one = {k: sum(b.get(k, 0.0) for b in bundles) for k in need}
        if not any(all(res.get(k, 0.0) >= v for k, v in one.items()) for res in nodes.values()):
            return f"a replica needs {fmt(one)} on ONE node (tensor parallelism): no node has it"
    return None


def _use_gpu(cfg: Config) -> bool:
    import ray

    gpu = cfg.cluster.gpu
    if gpu is not None:
        return bool(gpu)
    if cfg.engine.device == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return cfg.engine.device.startswith("cuda")


def replica_app(cfg: Config, sources: Any, max_queued: int, drain_s: float, worker_host: str) -> Any:
    """The bound Serve deployment of ``cfg``'s replicas (checked first against the cluster's resources:
    more replicas than it holds fail at once, naming what is missing)."""
    from ray import serve

    from cluster.placement import live_nodes

    opts = deployment_options(cfg, max_queued, drain_s, _use_gpu(cfg))
    why = replicas_cannot_fit(
        opts["placement_group_bundles"], cfg.cluster.replica_plan.min, opts["placement_group_strategy"], live_nodes()
    )
    if why:
        raise ReplicasError(f"cluster.replicas: {why}")
    return serve.deployment(SpecdistReplica).options(**opts).bind(cfg.to_dict(), sources, max_queued, worker_host)


def make_front(
    cfg: Config, tokenizer: Any, handle: Any, info: dict, max_queued: int, app_name: str = APP_NAME
) -> "Replicas":
    """The front over running replicas: ``handle`` the replicas' deployment handle, ``info`` one replica's
    :meth:`SpecdistReplica.describe`."""
    from specdist.api import replica_set

    reports = ReplicaReports(cfg.router.stats_period_s)
    replica_set.REPORT_OBSERVERS.append(reports.take)
    transport = ServeReplicas(handle, app_name=app_name)
    info = {k: v for k, v in info.items() if k != "replica_id"}
    engine = FrontEngine(cfg, tokenizer, replicas=lambda: transport.running, **info)
    front = ReplicaFront(engine, transport, max_queued, counters=reports.counters)
    front.metrics = FrontMetrics(front, reports)
    return Replicas(front, transport, reports, app_name=app_name)


@dataclasses.dataclass
class Replicas:
    """The replicas of a ``specdist serve`` and the front over them; :meth:`close` deletes the application."""

    front: ReplicaFront
    transport: ServeReplicas
    reports: ReplicaReports
    owns_serve: bool = False  # Serve was started here: shut down on close (its controller with it)
    app_name: str = APP_NAME
    owns_app: bool = True  # deployed here (``specdist serve``): deleted on close; not inside Serve's own app

    def close(self) -> None:
        from ray import serve

        from specdist.api import replica_set

        self.transport.close()
        if self.reports.take in replica_set.REPORT_OBSERVERS:
            replica_set.REPORT_OBSERVERS.remove(self.reports.take)
        if not self.owns_app:
            return
        try:
            serve.delete(self.app_name)
            if self.owns_serve:
                serve.shutdown()
        except Exception:  # noqa: BLE001  (Serve or Ray already gone)
            log.debug("serve.delete / shutdown failed", exc_info=True)


def start_replicas(
    cfg: Config,
    sources: Any,
    max_queued: int = 256,
    drain_s: float = 5.0,
    worker_host: str = "127.0.0.1",
    log_line=print,
) -> Replicas:
    """Deploy ``cfg``'s replicas on Serve (Ray initialised) and return the front over them, once every
    replica serves; within ``cluster.bringup_timeout_s``, else :class:`ReplicasError` naming what is missing
    (resources checked first: more replicas than the cluster holds fail at once)."""
    from ray import serve

    plan: ReplicasConfig = cfg.cluster.replica_plan
    app = replica_app(cfg, sources, max_queued, drain_s, worker_host)
    owns_serve = not _serve_running()
    serve.start(proxy_location="Disabled")
    timeout = cfg.cluster.bringup_timeout_s
    log_line(
        f"deploying {plan.min}{f'..{plan.max}' if plan.autoscaling else ''} replica(s) on Ray Serve "
        f"(timeout {timeout:g}s)"
    )
    done: dict[str, Any] = {}

    def run() -> None:  # (a thread: handle calls may not wait on an event loop, which the caller may run)
        try:
            handle = serve.run(app, name=APP_NAME, route_prefix=None)
            done["info"] = handle.describe.remote().result(timeout_s=timeout)  # (starts the handle's router here)
            done["handle"] = handle
        except BaseException as e:  # noqa: BLE001
            done["error"] = e

    t = threading.Thread(target=run, name="specdist-serve-run", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive() or "error" in done:
        status = _describe_status()
        try:
            serve.delete(APP_NAME)
            if owns_serve:
                serve.shutdown()
        except Exception:  # noqa: BLE001
            pass
        if "error" in done:
            raise ReplicasError(f"the replicas failed to start: {done['error']}") from None
        from cluster.placement import free_per_node

        raise ReplicasError(
            f"the replicas did not come up within {timeout:g}s ({status}); free per node: {free_per_node()}"
        )
    try:
        replicas = make_front(cfg, sources.tokenizer(), done["handle"], done["info"], max_queued)
    except BaseException:
        serve.delete(APP_NAME)
        raise
    replicas.owns_serve = owns_serve
    log_line(f"{replicas.transport.running} replica(s) serving; router policy {cfg.router.policy}")
    return replicas


def _serve_running() -> bool:
    """Whether a Serve controller runs on this Ray cluster already (someone else's Serve: not ours to stop)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:  # (serve.status() would start one)
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:  # no such actor
        return False


def _describe_status() -> str:
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
        dep = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
        if dep is None:
            return "no deployment status"
        msg = (dep.message or "").strip().splitlines()
        return f"replicas {dict(dep.replica_states or {})}{': ' + msg[0] if msg else ''}"
    except Exception as e:  # noqa: BLE001
        return f"status unknown: {e}"


def ceil_cpus(cfg: Config) -> int:
    """Logical CPUs a local Ray cluster needs for ``cfg``'s replicas at their most."""
    from cluster.placement import COORDINATOR_BUNDLE

    cc, plan = cfg.cluster, cfg.cluster.replica_plan
    one = (
        COORDINATOR_BUNDLE["CPU"]
        + cc.tensor_parallel_size * cc.cpus_per_rank
        + cc.num_draft_workers * cc.cpus_per_draft
    )
    return math.ceil(one * plan.max)


class SpecdistFront:
    """The front doors as a Serve deployment, for a Serve application of its own (KubeRay's RayService): its
    replica serves ``specdist.v1.SpecDecode`` (gRPC: health, reflection, TLS, tenant tokens, limits) and, with
    ``http_port``, the OpenAI-compatible HTTP API, and with ``metrics_port`` Prometheus ``/metrics``, on fixed ports
    of its node, over the replicas' handle, as ``specdist serve`` does in its own process. One per node at most
    (``max_replicas_per_node``: the ports)."""

    async def __init__(
        self,
        config: dict,
        replicas: Any,
        grpc_port: int = 50051,
        http_port: int | None = None,
        host: str = "0.0.0.0",
        max_queued: int = 256,
        drain_seconds: float = 5.0,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        auth_token_file: str | None = None,
        admin_token_file: str | None = None,
        metrics_port: int | None = None,
    ):
        from ray import serve

        from specdist.api.grpc_server import serve as grpc_serve
        from specdist.models.metadata import resolve_sources
        from specdist.transport.security import ServerSecurity, start_metrics_server

        cfg = load_config(config)
        security = ServerSecurity.from_args(tls_cert, tls_key, tls_client_ca, auth_token_file, admin_token_file)
        sources = resolve_sources(cfg)
        info = await replicas.describe.remote()
        self.replicas = make_front(
            cfg, sources.tokenizer(), replicas, info, max_queued, app_name=serve.get_replica_context().app_name
        )
        self.replicas.owns_app = False  # Serve's own application: Serve removes it
        front = self.replicas.front
        self.server, _ = await grpc_serve(
            front.engine, host, grpc_port, max_queued, drain_seconds, security, coordinator=front
        )
        self.http = None
        if http_port is not None:
            from specdist.api.http_server import start_http

            self.http = await start_http(front, host, http_port, security=security)
        self.metrics_server = None
        if metrics_port is not None:
            self.metrics_server = start_metrics_server(metrics_port, host, front.metrics.registry, security)
        self.drain_seconds = drain_seconds

    async def check_health(self) -> None:
        """Serve's health check: the gRPC server runs (the replicas have their own)."""
        if self.server is None:
            raise RuntimeError("the front's gRPC server is stopped")

    def ports(self) -> dict:
        """The ports it serves on (for a client that asks Serve)."""
        return {"grpc": self.server.port, "http": self.http.port if self.http is not None else None}

    def __del__(self) -> None:
        m = getattr(self, "metrics_server", None)
        if m is not None:
            m.shutdown()
            m.server_close()
        r = getattr(self, "replicas", None)
        if r is not None:
            r.close()


# build_app's args: the config, worker_host and front_resource, and SpecdistFront's own keyword arguments
BUILD_APP_ARGS = frozenset(
    {
        "config",
        "grpc_port",
        "http_port",
        "metrics_port",
        "host",
        "max_queued",
        "drain_seconds",
        "worker_host",
        "front_resource",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "auth_token_file",
        "admin_token_file",
    }
)


def build_app(args: dict) -> Any:
    """Serve's application builder (``import_path: cluster.serve:build_app`` in a Serve config; KubeRay's
    RayService renders one from the chart's values). ``args``: ``config`` (specdist's config, a mapping or a
    path; ``cluster.replicas`` set), and the front doors' ``grpc_port``, ``http_port``, ``metrics_port``, ``host``,
    ``max_queued``, ``drain_seconds``, ``worker_host``, ``tls_cert``, ``tls_key``, ``tls_client_ca``,
    ``auth_token_file``, ``admin_token_file`` (as ``specdist serve``'s flags); ``front_resource``: a custom Ray
    resource that only the node whose ports the clients reach offers (the chart's head: ``specdist_front``), one
    unit of which the front asks for instead of CPU, so it runs there. Checked here, so a bad config fails the
    deploy in one line."""
    from ray import serve

    from specdist.api.preflight import check_config
    from specdist.models.metadata import resolve_sources

    args = dict(args)
    unknown = set(args) - BUILD_APP_ARGS
    if unknown:
        raise ReplicasError(f"build_app: unknown args {sorted(unknown)}")
    cfg = load_config(args.pop("config"))
    check_config(cfg)
    if cfg.cluster.replicas is None:
        raise ReplicasError("cluster.replicas: a Serve application needs it set (a count, or {min, max})")
    max_queued = int(args.get("max_queued", 256))
    drain = float(args.get("drain_seconds", 5.0))
    sources = resolve_sources(cfg)
    replicas = replica_app(cfg, sources, max_queued, drain, args.pop("worker_host", "127.0.0.1"))
    front_resource = args.pop("front_resource", None)
    actor = {"num_cpus": 0, "resources": {front_resource: 1}} if front_resource else {"num_cpus": 0.1}
    return (
        serve.deployment(SpecdistFront)
        .options(
            name="SpecdistFront",
            num_replicas=1,
            max_replicas_per_node=1,
            ray_actor_options=actor,
            max_ongoing_requests=max_queued,
            graceful_shutdown_timeout_s=drain,
        )
        .bind(cfg.to_dict(), replicas, **args)
    )
