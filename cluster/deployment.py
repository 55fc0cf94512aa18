"""Bring a whole specdist deployment up on Ray, and take it down again.

:class:`Deployment` places ``tensor_parallel_size`` :class:`~workers.actors.TargetRankActor`
ranks in one STRICT_PACK placement group and each :class:`~workers.actors.DraftActor` in its
own group (:func:`cluster.placement.create_placement`), then runs the bring-up phases, each
in parallel over the actors and each bounded by what is left of ``timeout_s``:

1. ``start``: every actor process answers ``ping``;
2. ``rendezvous`` (TP > 1): rank 0's ``address()``, then ``init_distributed`` on every rank;
3. ``load``: every rank loads and shards the target, every draft loads its model; then ``memory`` (GPUs):
   every worker with a paged cache measures its passes beside it, the caches are planned together
   (:func:`specdist.models.memory_plan.plan_together`: each worker's device as the engine plans its own, every
   cache then held to the fewest tokens any got) and resized; the plans are logged and reported;
4. ``follow``: ranks > 0 enter ``run_follower()`` (kept as background ObjectRefs);
5. ``warmup``: rank 0 (followers replay it) and every draft;
6. ``serve``: gRPC on rank 0 and on every draft, each requiring the deployment's worker secret;
7. ``freeze``: every actor moves its start-up objects out of the garbage collector's walks
   (:mod:`specdist.gc_freeze`), so that a full collection of them does not stall a step.

The worker secret (:attr:`Deployment.worker_secret`, 32 random bytes in hex, fresh at every
bring-up, never logged) is handed to the actors with ``start_grpc``; every worker call but the
health service's must carry it as ``authorization: Bearer <secret>``, so a process that can
reach a worker port cannot call ``Verify`` or ``Propose``. The coordinator's
:class:`~specdist.engine.remote.RemoteEngine` sends it (``worker_secret=``). Beside it the deployment makes its
worker TLS (:attr:`Deployment.worker_tls`, :class:`~specdist.transport.worker_tls.WorkerTLS`: a CA of its own,
made in memory, and one certificate it signed), handed to the actors the same way: every worker link is mutual TLS,
so the secret, prompts and tokens do not cross the network in the clear, and only a holder of the deployment's
certificate completes a handshake with a worker.

A phase that does not finish in time raises :class:`DeploymentError` naming the actors that
did not come up (and the phase); any failure tears down everything created so far. Each
phase that completes is logged (``specdist.load`` logger, INFO) with the time since ``start``:
bring-up takes a minute on a small machine, and the log says where it is.
:meth:`Deployment.stop` shuts every actor down (rank 0's shutdown broadcast releases the
followers), ``ray.kill``s them, waits until they are gone and removes the placement groups.

Faults: once up, a :class:`~cluster.supervisor.Supervisor` (a thread for the target group, one
per draft) checks the workers every ``health_interval_s`` and tells ``listeners`` what it found
(:class:`~cluster.supervisor.WorkerEvent`). Draft actors are created with ``max_restarts``: Ray
restarts a dead one (on another node when its node was lost: Ray places its placement group again
where there is room) and :meth:`Deployment.recover_draft` brings it up again (the same phases, on
its old port). Target ranks are never restarted alone: :meth:`Deployment.diagnose_target` names a
rank that died or hangs, and :meth:`Deployment.rebuild_target` replaces the whole group in its
placement group, once that is placed (:meth:`Deployment.target_unplaced` says what a group whose
node was lost waits for).

Its shape comes from the config's ``cluster:`` section (:class:`specdist.config.ClusterConfig`):
``Deployment().start(config)`` or ``Deployment.from_config(config, target_port=...)``;
an explicit :class:`ClusterSpec` still overrides it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field

from specdist.config import Config, load_config
from specdist.errors import SpecDistError
from specdist.transport.security import new_worker_secret
from specdist.transport.worker_tls import WorkerTLS

log = logging.getLogger("specdist.load")


class DeploymentError(SpecDistError):
    """The deployment did not come up (in time), or an actor failed during bring-up."""


@dataclass
class ClusterSpec:
    """Resolved deployment settings.

    The shape of the deployment (TP size, draft workers, CPUs/GPUs, use_gpu) comes from the
    config's ``cluster:`` section (:class:`specdist.config.ClusterConfig`, see
    :meth:`from_config`); ports, the name, actor threads/concurrency and the shutdown timeout
    are deployment arguments (they depend on where and how it is started, not on the model).
    """

    tensor_parallel_size: int = 1
    num_draft_workers: int = 1
    cpus_per_rank: float = 1.0  # logical CPUs per target rank (its bundle and its actor)
    cpus_per_draft: float = 1.0
    gpus_per_draft: float = 1.0  # used only when the deployment runs on GPUs
    use_gpu: bool | None = None  # None: from config.engine.device (auto: whether the cluster has GPUs)
    pin_cpus: bool = False  # rank r on core r, draft i on core tensor_parallel_size + i (modulo the node's cores)
    target_port: int = 0  # rank 0's gRPC port; 0 = a free port
    draft_ports: tuple[int, ...] = ()  # one per draft; missing or 0 = a free port
    num_threads: int | None = 1  # torch intra-op threads per actor (None: torch's default)
    max_concurrency: int = 4  # per actor: followers block in run_follower() and still answer health()
    name: str = "specdist"  # placement-group name prefix
    shutdown_timeout_s: float = 30.0
    max_restarts: int = 3  # Ray restarts of a dead draft actor (-1: unlimited); the supervisor reloads it
    health_interval_s: float = 1.0  # the supervisor's period (0: no supervisor)
    health_timeout_s: float = 5.0  # a worker not answering health() within this is hung
    rebuild_attempts: int = 3  # target group rebuilds in a row before giving up
    collective_timeout_s: float = 10.0  # floor of the target ranks' collective timeout
    # A Serve replica's placement group (cluster/placement.replica_bundles) to place the workers in, and the
    # replica's rank: with pin_cpus its processes share the cores of its own slice of the node
    placement_group: object = None
    replica_index: int | None = None

    def core_of(self, slot: int) -> int | None:
        """The core a worker is pinned to (``slot``: rank r is r, draft i is tensor_parallel_size + i), or None
        without ``pin_cpus``. One group: a core each (modulo the node's cores, in the actor). Replica k of a
        Serve deployment: its processes round-robin over its own w cores, k x w ... k x w + w - 1, w = the
        logical CPUs its workers ask for (at least 1), so replicas never share a core."""
        if not self.pin_cpus:
            return None
        if self.replica_index is None:
            return slot
        w = max(
            1, int(self.tensor_parallel_size * self.cpus_per_rank + self.num_draft_workers * self.cpus_per_draft + 1e-9)
        )
        return self.replica_index * w + slot % w

    @classmethod
    def from_config(cls, config, **deployment) -> "ClusterSpec":
        """From a Config's (or a ClusterConfig's) ``cluster:`` section plus deployment arguments
        (``target_port``, ``draft_ports``, ``num_threads``, ``max_concurrency``, ``name``,
        ``shutdown_timeout_s``)."""
        from specdist.config import ClusterConfig

        cc = config if isinstance(config, ClusterConfig) else load_config(config).cluster
        allowed = {
            "target_port",
            "draft_ports",
            "num_threads",
            "max_concurrency",
            "name",
            "shutdown_timeout_s",
            "placement_group",
            "replica_index",
        }
        unknown = set(deployment) - allowed
        if unknown:
            raise TypeError(f"not deployment arguments: {sorted(unknown)} (the cluster: config section sets those)")
        return cls(
            tensor_parallel_size=cc.tensor_parallel_size,
            num_draft_workers=cc.num_draft_workers,
            cpus_per_rank=cc.cpus_per_rank,
            cpus_per_draft=cc.cpus_per_draft,
            gpus_per_draft=cc.gpus_per_draft,
            use_gpu=cc.gpu,
            pin_cpus=cc.pin_cpus,
            max_restarts=cc.max_restarts,
            health_interval_s=cc.health_interval_s,
            health_timeout_s=cc.health_timeout_s,
            rebuild_attempts=cc.rebuild_attempts,
            collective_timeout_s=cc.collective_timeout_s,
            **deployment,
        ).validate()

    def validate(self) -> "ClusterSpec":
        if int(self.tensor_parallel_size) < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if int(self.num_draft_workers) < 0:
            raise ValueError(f"num_draft_workers must be >= 0, got {self.num_draft_workers}")
        if self.cpus_per_rank <= 0 or self.cpus_per_draft <= 0:
            raise ValueError("cpus_per_rank and cpus_per_draft must be > 0")
        if self.max_concurrency < 2:
            raise ValueError("max_concurrency must be >= 2 (followers block in run_follower())")
        if len(self.draft_ports) > self.num_draft_workers:
            raise ValueError(f"{len(self.draft_ports)} draft ports for {self.num_draft_workers} draft workers")
        return self


@dataclass
class _Handle:
    name: str  # "target rank 1", "draft 0"
    actor: object
    kind: str  # "target" | "draft"
    rank: int = 0  # a target's rank, a draft's index
    address: str | None = None
    pid: int | None = None  # of its process, as last seen by a health check

    @property
    def port(self) -> int:
        """Its gRPC port (0 before it serves): a restarted worker asks for the same one."""
        return int(self.address.rsplit(":", 1)[1]) if self.address else 0


@dataclass
class Deployment:
    spec: ClusterSpec | None = None  # None: ClusterSpec.from_config(config passed to start())
    config: Config | None = None
    placement: object = None
    targets: list = field(default_factory=list)  # _Handle per rank, rank order
    drafts: list = field(default_factory=list)  # _Handle per draft
    follower_refs: dict = field(default_factory=dict)  # rank -> ObjectRef of run_follower()
    target_address: str | None = None
    draft_addresses: list = field(default_factory=list)
    worker_secret: str | None = field(default=None, repr=False)  # every worker port requires it
    worker_tls: WorkerTLS | None = field(default=None, repr=False)  # every worker link's mutual TLS
    cpu_kernels: str = ""  # the CPU backend target rank 0 loaded with (engine.cpu_kernels), for GetServerInfo
    # GPUs: each worker's memory plan (worker name -> its line) and the tokens every paged cache holds (phase memory)
    memory_plans: dict = field(default_factory=dict)
    kv_tokens: int | None = None
    # the config's models (specdist.models.metadata.ModelSources), as start() was given them or made them: sent
    # to every actor's load (each spec resolved once, by whoever first needs it), kept for rebuilds and restarts
    sources: object = None
    # the config's draft section checked once (specdist.cores.proposers.ResolvedDraft), as start() was given it or
    # made it: sent whole to every draft actor's load (which checks it no more)
    draft: object = None
    listeners: list = field(default_factory=list)  # callables given each WorkerEvent (supervisor thread)
    supervisor: object = None  # cluster.supervisor.Supervisor, while started
    _owns_ray: bool = False
    _t0: float = 0.0  # monotonic time start() began: the bring-up log's clock
    _host: str = "127.0.0.1"  # where the workers listen
    _gpu: bool = False
    _stopping: threading.Event = field(default_factory=threading.Event)  # stop() began: bring-up waits end

    @classmethod
    def from_config(cls, config, **deployment) -> "Deployment":
        """A Deployment shaped by ``config``'s ``cluster:`` section; ``deployment``: see ClusterSpec.from_config."""
        return cls(ClusterSpec.from_config(config, **deployment))

    # ------------------------------------------------------------ bring-up
    def start(
        self,
        config,
        ray_address: str | None = None,
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        sources=None,
        draft=None,
    ) -> tuple[str, list[str]]:
        """Bring the deployment up; returns (target "host:port", [draft "host:port", ...]).

        ``sources``: the config's models as :func:`specdist.models.metadata.resolve_sources` resolved them
        (``specdist serve`` does, at start, and reads the target's config there): the actors load the resolved
        files and resolve nothing. None: each spec is resolved by whoever first needs it: this process (the
        head counts of a tensor-parallel target, an EAGLE-3 head's layers) or, failing in phase ``load``, the
        actor that loads it. ``draft``: the config's draft section as
        :func:`specdist.cores.proposers.resolve_draft` checked it, if the caller did (else checked here)."""
        import ray

        from cluster.local import LOOPBACK_HOSTS, init_local_ray
        from cluster.placement import create_placement, place_within
        from specdist.cores.proposers import resolve_draft
        from specdist.models.metadata import ModelSources
        from specdist.models.quant import refuse_int8_on
        from specdist.transport.hosts import bare_host

        if self.targets or self.drafts:
            raise RuntimeError("this Deployment is already started; stop() it first")
        cfg = self.config = load_config(config)
        # before any actor is placed (the one check of the draft section)
        self.draft = resolve_draft(cfg.draft, cfg.target.dtype) if draft is None else draft
        self.sources = ModelSources.of(cfg) if sources is None else sources
        if self.spec is None:
            self.spec = ClusterSpec.from_config(cfg.cluster)
        spec = self.spec.validate()
        if spec.num_draft_workers and not cfg.draft.enabled:
            raise DeploymentError(f"draft.method is {cfg.draft.method!r}: draft workers need a draft method")
        if not ray.is_initialized():
            if ray_address:
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
            else:  # a cluster of this machine, on loopback when the workers are
                init_local_ray(loopback=bare_host(host) in LOOPBACK_HOSTS)
            self._owns_ray = True
        deadline = time.monotonic() + timeout_s
        self._t0 = time.monotonic()
        self._stopping.clear()
        self.worker_secret = new_worker_secret()
        self.worker_tls = WorkerTLS.generate()
        self._host = host
        self._gpu = use_gpu = self._use_gpu(cfg)
        device = "cuda" if use_gpu else "cpu"
        try:
            refuse_int8_on(self.draft.copy, device)  # self-w8 on GPUs: refused before any actor is placed
            if spec.placement_group is not None:  # a Serve replica's group (cluster/serve.py): placed already
                self.placement = place_within(spec.placement_group, spec.tensor_parallel_size, spec.num_draft_workers)
                self._done("placement", f"within the replica's placement group on {device}")
            else:
                self.placement = create_placement(
                    spec.tensor_parallel_size,
                    spec.num_draft_workers,
                    use_gpu,
                    cpus_per_rank=spec.cpus_per_rank,
                    cpus_per_draft=spec.cpus_per_draft,
                    gpus_per_draft=spec.gpus_per_draft,
                    timeout_s=max(1.0, deadline - time.monotonic()),
                    name=spec.name,
                )
                self._done("placement", f"{1 + len(self.placement.drafts)} placement group(s) on {device}")
            if spec.tensor_parallel_size > 1:  # before any actor exists: a target that cannot shard fails at once
                _check_shardable(self.sources, spec.tensor_parallel_size)
            self._create_targets()
            self._create_drafts()
            ports = {h.name: p for h, p in zip(self.drafts, spec.draft_ports)}
            ports[self.targets[0].name] = spec.target_port
            self._bring_up(self.targets + self.drafts, ports, deadline, timeout_s)
            if spec.health_interval_s > 0:
                from cluster.supervisor import Supervisor

                self.supervisor = Supervisor(self)
                self.supervisor.start()
        except BaseException as e:
            self.stop()
            if isinstance(e, DeploymentError):
                raise
            if isinstance(e, SpecDistError):  # PlacementError: already a clear message
                raise
            raise DeploymentError(f"deployment bring-up failed: {type(e).__name__}: {e}") from e
        return self.target_address, list(self.draft_addresses)

    def _use_gpu(self, cfg: Config) -> bool:
        import ray

        if self.spec.use_gpu is not None:
            return bool(self.spec.use_gpu)
        dev = cfg.engine.device
        if dev == "auto":
            return ray.cluster_resources().get("GPU", 0) > 0
        return dev.startswith("cuda")

    def _create_targets(self) -> None:
        """One TargetRankActor per rank in the target placement group (not restarted by Ray: a
        lost rank breaks the group, which the supervisor rebuilds whole)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.actors import TargetRankActor

        spec = self.spec
        tp = spec.tensor_parallel_size
        for r in range(tp):
            pg, index = self.placement.target_slot(r)
            cls = ray.remote(TargetRankActor).options(
                num_cpus=spec.cpus_per_rank,
                num_gpus=1 if self._gpu else 0,
                max_concurrency=spec.max_concurrency,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
            )
            cpu = spec.core_of(r)
            self.targets.append(_Handle(f"target rank {r}", cls.remote(r, tp, spec.num_threads, cpu), "target", r))

    def _create_drafts(self) -> None:
        """One DraftActor per draft placement group; Ray restarts a dead one (``max_restarts``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.actors import DraftActor

        spec = self.spec
        for i in range(spec.num_draft_workers):
            pg, index = self.placement.draft_slot(i)
            cls = ray.remote(DraftActor).options(
                num_cpus=spec.cpus_per_draft,
                num_gpus=spec.gpus_per_draft if self._gpu else 0,
                max_concurrency=spec.max_concurrency,
                max_restarts=spec.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
            )
            cpu = spec.core_of(spec.tensor_parallel_size + i)
            self.drafts.append(_Handle(f"draft {i}", cls.remote(i, spec.num_threads, cpu), "draft", i))

    def _load_call(self, h: _Handle):
        """An actor's load: the config's sections whole (``target:``, ``engine:``, the draft resolved once), which
        the worker's factory reads (:mod:`specdist.cores.factory`); the device and the rank's collectives are the
        deployment's."""
        from specdist.cores.draft import draft_hidden_layers  # (torch and the models: only where a deployment is)
        from specdist.cores.proposers import resolve_draft

        cfg = self.config
        if self.draft is None:  # (a deployment driven without start(): its config's, checked once, here)
            self.draft = resolve_draft(cfg.draft, cfg.target.dtype)
        sources = self.sources  # (resolved, or resolved by the actor: each receives a copy)
        k = cfg.draft.num_speculative_tokens
        if h.kind == "target":
            hidden_layers = draft_hidden_layers(cfg.draft, sources)[0]
            return h.actor.load.remote(
                sources, cfg.target, cfg.engine, k, hidden_layers, self.spec.collective_timeout_s
            )
        return h.actor.load.remote(self.draft, sources, cfg.engine, "cuda" if self._gpu else "cpu")

    def _bring_up(self, handles: list, ports: dict, deadline: float, timeout_s: float) -> None:
        """Bring freshly created actors (``handles``: the whole target group and/or drafts) up to
        serving, phase by phase, each phase in parallel over them. ``ports``: name -> gRPC port
        (missing or 0: a free one)."""
        targets = [h for h in handles if h.kind == "target"]
        drafts = [h for h in handles if h.kind == "draft"]
        device = "cuda" if self._gpu else "cpu"
        wait = lambda phase, calls: self._wait(phase, calls, deadline, timeout_s)  # noqa: E731

        wait("start", {h.name: h.actor.ping.remote() for h in handles})
        self._done("start", f"{len(handles)} actor(s) up")
        if targets:
            if len(targets) > 1:
                ((ip, port),) = wait("rendezvous", {targets[0].name: targets[0].actor.address.remote()}).values()
            else:
                ip, port = "127.0.0.1", 0
            wait("rendezvous", {h.name: h.actor.init_distributed.remote(ip, port, device) for h in targets})
            self._done("rendezvous", f"{len(targets)} target rank(s) joined")
        loaded = wait("load", {h.name: self._load_call(h) for h in handles})
        if targets and targets[0].rank == 0:  # what GetServerInfo reports: the CPU backend of target rank 0
            self.cpu_kernels = loaded[targets[0].name].get("cpu_kernels", "")
        cfg = self.config
        self._done("load", f"{cfg.target.model} on {len(targets)} rank(s), {len(drafts)} {cfg.draft.method} draft(s)")
        self._plan_memory(handles, wait)
        for h in targets[1:]:
            self.follower_refs[h.rank] = h.actor.run_follower.remote()
        if targets:
            self._done("follow", f"{len(targets) - 1} follower rank(s)")
        warm = targets[:1] + drafts
        self._wait(
            "warmup",
            {h.name: h.actor.warmup.remote() for h in warm},
            deadline,
            timeout_s,
            watch_followers=bool(targets),
        )
        self._done("warmup", f"{len(warm)} actor(s)")
        calls = {
            h.name: h.actor.start_grpc.remote(self._host, ports.get(h.name) or 0, self.worker_secret, self.worker_tls)
            for h in warm
        }
        addrs = self._wait("serve", calls, deadline, timeout_s, watch_followers=bool(targets))
        for h in warm:
            h.address = addrs[h.name]
        # only what this bring-up brought: a draft's recovery may run while the target group is rebuilt
        if targets:
            self.target_address = targets[0].address
        if drafts:
            self.draft_addresses = [h.address for h in self.drafts]
        self._done("serve", f"target at {self.target_address}, drafts at {', '.join(self.draft_addresses) or '-'}")
        # every actor of this bring-up (followers too: they answer calls while following) keeps its start-up
        # objects out of the garbage collector's walks, so that a full collection does not stall a step
        frozen = self._wait(
            "freeze",
            {h.name: h.actor.freeze_start_up_objects.remote() for h in handles},
            deadline,
            timeout_s,
            watch_followers=bool(targets),
        )
        self._done("freeze", ", ".join(f"{name} {n}" for name, n in frozen.items()) + " objects frozen")

    def _plan_memory(self, handles: list, wait) -> None:
        """Phase ``memory`` (GPUs; nothing to do elsewhere, as in the engine): every worker with a deferred paged
        cache measures its passes beside it (all ranks at once: their profiled forwards meet in the collectives),
        this process plans them together (:func:`specdist.models.memory_plan.plan_together`: each within its own
        device, then every cache held to the fewest tokens any got, and a worker brought up again to what the
        others hold), and each takes its plan. The plans are logged on stderr, one line a worker, kept in
        ``memory_plans`` (GetServerInfo's ``memory_plan``, :meth:`connect`) and in each worker's health. A
        worker whose cache cannot hold one ``max_model_len`` sequence fails the bring-up (a ConfigError naming
        ``engine.gpu_memory_utilization``)."""
        from specdist.models.memory_plan import plan_together

        u = self.config.engine.gpu_memory_utilization
        share = {h.name: min(1.0, self.spec.gpus_per_draft) if h.kind == "draft" else 1.0 for h in handles}
        measured = wait("memory", {h.name: h.actor.measure_memory.remote(u * share[h.name]) for h in handles})
        measured = {name: m for name, m in measured.items() if m is not None}
        if not measured:
            return
        plans = plan_together(measured, cap=self.kv_tokens)
        lines = wait(
            "memory", {h.name: h.actor.apply_memory_plan.remote(plans[h.name]) for h in handles if h.name in plans}
        )
        self.kv_tokens = min(t for p in plans.values() for t in p.tokens.values())
        for name, line in lines.items():
            self.memory_plans[name] = line
            print(f"{name}: {line}", file=sys.stderr, flush=True)
        self._done("memory", f"{self.kv_tokens:,} tokens a KV cache on {len(lines)} worker(s)")

    @property
    def memory_plan(self) -> str:
        """Every worker's memory plan (by worker name, ``; `` between), or "" where none was planned."""
        return "; ".join(f"{name}: {line}" for name, line in self.memory_plans.items())

    def _done(self, phase: str, what: str) -> None:
        log.info("bring-up: %s done after %.1f s (%s)", phase, time.monotonic() - self._t0, what)

    def _wait(self, phase: str, calls: dict, deadline: float, timeout_s: float, watch_followers: bool = False) -> dict:
        """ray.get every call by the deadline; raise DeploymentError naming what did not come up."""
        import ray

        pending = {ref: name for name, ref in calls.items()}
        followers = (
            {ref: f"target rank {r} (run_follower)" for r, ref in self.follower_refs.items()} if watch_followers else {}
        )
        while pending:
            left = deadline - time.monotonic()
            if self._stopping.is_set():
                raise DeploymentError(f"deployment stopped during phase {phase!r}")
            if left <= 0:
                names = ", ".join(sorted(pending.values()))
                raise DeploymentError(
                    f"deployment did not come up within {timeout_s:g}s: phase {phase!r} still waiting for {names}"
                )
            done, _ = ray.wait(list(pending) + list(followers), num_returns=1, timeout=min(left, 1.0))
            for ref in done:
                if ref in followers:  # a follower must block until shutdown; returning now is a failure
                    try:
                        ray.get(ref)
                        why = "returned early"
                    except Exception as e:  # noqa: BLE001
                        why = f"failed: {e}"
                    raise DeploymentError(f"{followers[ref]} {why} during phase {phase!r}")
                name = pending.pop(ref)
                try:
                    calls[name] = ray.get(ref)
                except Exception as e:  # noqa: BLE001  (RayTaskError / RayActorError)
                    cause = getattr(e, "cause", None) or e  # the actor-side exception, without Ray's traceback
                    raise DeploymentError(f"{name} failed in phase {phase!r}: {cause}") from e
        return calls

    def connect(self):
        """A :class:`~specdist.engine.remote.RemoteEngine` over this started deployment (its coordinator's
        engine): the target's rank 0 and the drafts, with the worker secret; what GetServerInfo reports of the
        workers (tensor-parallel size, rank 0's CPU kernels) set on it."""
        from specdist.engine.remote import RemoteEngine

        engine = RemoteEngine.from_addresses(
            self.config,
            self.target_address,
            self.draft_addresses,
            sources=self.sources,
            worker_secret=self.worker_secret,
            worker_tls=self.worker_tls,
            resolved=self.draft,
        )
        engine.tensor_parallel_size = self.spec.tensor_parallel_size
        engine.cpu_kernels = self.cpu_kernels
        engine.memory_plan = self.memory_plan
        return engine

    # ------------------------------------------------------------ operations
    def actors(self) -> list:
        return [h.actor for h in self.targets + self.drafts]

    def health(self, timeout_s: float = 30.0) -> dict:
        """{actor name: its health() dict}; an actor that does not answer gets {"ok": False, "error": ...}."""
        import ray

        refs = {h.name: h.actor.health.remote() for h in self.targets + self.drafts}
        out = {}
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=timeout_s)
            except Exception as e:  # noqa: BLE001
                out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return out

    def diagnose_target(self, timeout_s: float | None = None) -> str | None:
        """What is wrong with the target group, naming the rank, or None when none is.

        A rank is wrong when its process died, when it does not answer ``health()`` within
        ``timeout_s`` (default: the spec's ``health_timeout_s``; it hangs), when a follower's
        ``run_follower()`` returned, or when it reports itself not ok (rank 0 after a failed
        collective). Dead and hung ranks are named before ranks that only report the failure.
        While the supervisor rebuilds the group, the failure the rebuild is for: the rebuild kills
        every rank, and a killed rank says nothing of the cause.
        """
        import ray

        rebuilding = self._rebuilding_for()
        if rebuilding:
            return rebuilding
        timeout_s = self.spec.health_timeout_s if timeout_s is None else timeout_s
        targets, followers = list(self.targets), dict(self.follower_refs)
        refs = {h.rank: h.actor.health.remote() for h in targets}
        deadline = time.monotonic() + timeout_s
        causes, symptoms = [], []
        for h in targets:
            pid = f" (pid {h.pid})" if h.pid else ""
            try:
                health = ray.get(refs[h.rank], timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                causes.append(f"target rank {h.rank}{pid} does not answer its health check within {timeout_s:g}s")
                continue
            except ray.exceptions.RayActorError:
                causes.append(f"target rank {h.rank}{pid} died")
                continue
            h.pid = health.get("pid", h.pid)
            if not health.get("ok"):
                symptoms.append(f"target rank {h.rank} is {health.get('broken') or health.get('state')}")
        done, _ = ray.wait(list(followers.values()), num_returns=len(followers), timeout=0) if followers else ([], [])
        for rank, ref in followers.items():
            if ref in done and not any(c.startswith(f"target rank {rank} ") for c in causes):
                causes.append(f"target rank {rank} stopped following rank 0 ({_outcome(ref)})")
        return self._rebuilding_for() or "; ".join(causes or symptoms) or None

    def _rebuilding_for(self) -> str | None:
        """Why the supervisor is rebuilding the target group (None: it is not)."""
        return self.supervisor.target_reason if self.supervisor is not None else None

    def target_unplaced(self) -> str | None:
        """Why the target group cannot be rebuilt yet: its placement group lost its node and Ray
        waits for one where the whole group fits (naming what it needs and what is missing); None
        when it is placed."""
        from cluster.placement import unplaced

        return unplaced(self.placement.target, "the target group")

    def draft_unplaced(self, index: int) -> str | None:
        """Why draft ``index`` cannot run: its placement group lost its node and Ray waits for one
        with room (then restarts the actor there); None when it is placed."""
        from cluster.placement import unplaced

        return unplaced(self.placement.draft_slot(index)[0], f"draft {index}")

    def rebuild_target(self, timeout_s: float | None = None, same_port: bool = True) -> str:
        """Replace the whole target group: kill every rank, create them anew in the same placement
        group, bring them up (rank 0 on its old port when ``same_port``). Returns rank 0's address."""
        import ray

        timeout_s = self.config.cluster.bringup_timeout_s if timeout_s is None else timeout_s
        old = self.targets[0] if self.targets else None
        port = old.port if old is not None and same_port else self.spec.target_port
        for h in self.targets:
            try:
                ray.kill(h.actor, no_restart=True)
            except Exception:  # noqa: BLE001  (already dead)
                pass
        _wait_dead([h.actor for h in self.targets], timeout_s=self.spec.shutdown_timeout_s)
        self.targets, self.follower_refs = [], {}
        self._t0 = time.monotonic()
        self._create_targets()
        self._bring_up(self.targets, {self.targets[0].name: port}, time.monotonic() + timeout_s, timeout_s)
        return self.target_address

    def recover_draft(self, index: int, timeout_s: float | None = None) -> str:
        """Bring draft ``index`` up again after Ray restarted its actor (load, warm up, serve on its
        old port if it can have it, else a free one). Returns its address."""
        timeout_s = self.config.cluster.bringup_timeout_s if timeout_s is None else timeout_s
        h = self.drafts[index]
        self._t0 = time.monotonic()
        try:
            self._bring_up([h], {h.name: h.port}, time.monotonic() + timeout_s, timeout_s)
        except DeploymentError as e:
            if "phase 'serve'" not in str(e) or not h.port:
                raise
            log.warning("%s: its old port is taken (%s); serving on a free one", h.name, e)
            call = {h.name: h.actor.start_grpc.remote(self._host, 0, self.worker_secret, self.worker_tls)}
            h.address = self._wait("serve", call, time.monotonic() + timeout_s, timeout_s)[h.name]
            self.draft_addresses = [d.address for d in self.drafts]
        return h.address

    def drain(self, timeout_s: float = 30.0) -> dict:
        """Every gRPC-serving actor stops admitting requests and waits for its in-flight ones."""
        import ray

        hs = self.targets[:1] + self.drafts
        refs = {h.name: h.actor.drain.remote(timeout_s) for h in hs}
        return {name: ray.get(ref, timeout=timeout_s + 30) for name, ref in refs.items()}

    # ------------------------------------------------------------ tear-down
    def stop(self) -> None:
        """Shut every actor down, kill it, wait until it is gone, remove the placement groups. Idempotent."""
        import ray

        from cluster.placement import remove_placement

        self._stopping.set()  # a rebuild or recovery under way ends at its next wait
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        handles = self.targets + self.drafts
        if handles and ray.is_initialized():
            t = self.spec.shutdown_timeout_s if self.spec is not None else 30.0
            # in parallel: rank 0's shutdown broadcast is what releases the followers' shutdown
            release = bool(self.follower_refs)
            refs = [
                h.actor.shutdown.remote(release_followers=release)
                if h.kind == "target" and h.rank == 0
                else h.actor.shutdown.remote()
                for h in handles
            ]
            ray.wait(refs, num_returns=len(refs), timeout=t)
            if self.follower_refs:
                ray.wait(list(self.follower_refs.values()), num_returns=len(self.follower_refs), timeout=t)
            for h in handles:
                try:
                    ray.kill(h.actor, no_restart=True)
                except Exception:  # noqa: BLE001  (already dead)
                    pass
            _wait_dead([h.actor for h in handles], timeout_s=t)
        if self.placement is not None and ray.is_initialized():
            remove_placement(self.placement)
        self.targets, self.drafts, self.follower_refs = [], [], {}
        self.placement, self.target_address, self.draft_addresses = None, None, []
        self.worker_secret = self.worker_tls = None
        self.memory_plans, self.kv_tokens = {}, None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def _check_shardable(sources, world_size: int) -> None:
    """DeploymentError unless the target's head counts split over ``world_size`` ranks (read from
    its config (``sources.config()``, kept for the actors) on the driver, before any rank loads weights)."""
    from specdist.models.sharding import check_shardable

    try:
        check_shardable(sources.config(), world_size)
    except ValueError as e:
        raise DeploymentError(f"target.model: {e}") from None


def _outcome(ref) -> str:
    """How a finished task ended, in one line: its error's last line, or "returned"."""
    import ray

    try:
        ray.get(ref, timeout=0)
        return "returned"
    except Exception as e:  # noqa: BLE001
        cause = getattr(e, "cause", None) or e
        lines = [x for x in str(cause).splitlines() if x.strip()]
        return f"{type(cause).__name__}: {lines[-1] if lines else ''}"[:300]


def _wait_dead(actors: list, timeout_s: float) -> None:
    """Until every actor refuses calls (killed actors answer RayActorError)."""
    import ray

    deadline = time.monotonic() + timeout_s
    for a in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(a.ping.remote(), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception:  # noqa: BLE001  (RayActorError: dead)
                break
            time.sleep(0.05)
