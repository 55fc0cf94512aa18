"""Ray actors hosting the target ranks and the draft workers, with an explicit lifecycle.

Both classes are plain Python classes; wrap them with ``ray.remote(...)``, e.g.
``ray.remote(num_cpus=0.5, max_concurrency=4)(TargetRankActor)``. ``max_concurrency > 1``
is required for tensor-parallel followers: ``run_follower()`` blocks for the life of the
deployment, and ``health()`` / ``shutdown()`` must still be answered meanwhile.

Lifecycle (Ray Serve style), driven by :class:`cluster.deployment.Deployment`::

    TargetRankActor:  address() [rank 0] -> init_distributed() [all ranks] -> load() [all ranks,
                      in parallel: sharding is collective] -> measure_memory() -> apply_memory_plan()
                      [all ranks, GPUs] -> run_follower() [ranks > 0, kept as a background ObjectRef]
                      -> warmup() [rank 0; followers replay it] -> start_grpc() [rank 0] -> ... -> drain()
                      -> shutdown()
    DraftActor:       load() -> measure_memory() -> apply_memory_plan() [GPUs] -> warmup() -> start_grpc()
                      -> ... -> drain() -> shutdown()

Memory (GPUs): a paged cache the deployment asks to defer starts at one sequence; ``measure_memory`` profiles
the engine's passes beside it (:mod:`specdist.models.memory_plan`) and ``apply_memory_plan`` gives it what the
deployment planned for every worker together (CUDA graphs are captured after that); elsewhere both are no-ops.

Every call into a worker (warm-up, RPCs, shutdown) runs on ONE executor thread per actor
(models and collectives are not thread-safe); the gRPC server runs on the actor's own asyncio
loop thread (:class:`specdist.transport.grpc_host.GrpcHostThread`, the host the public server uses too).
The gRPC server also serves ``grpc.health.v1.Health``: SERVING once started, NOT_SERVING while
draining or shut down. With a ``secret`` (the deployment's worker secret, given to
``start_grpc``) every call but the health service's needs ``authorization: Bearer <secret>``
metadata, else UNAUTHENTICATED (:func:`specdist.transport.security.auth_interceptors`). With ``tls``
(the deployment's :class:`~specdist.transport.worker_tls.WorkerTLS`, given beside the secret) the port speaks
mutual TLS only: a plaintext client, or one without a certificate of the deployment's CA, fails its handshake.
"""

from __future__ import annotations

import abc
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from specdist import gc_freeze
from specdist.cores.draft import WARMUP_ID
from specdist.sampling_params import SamplingParams
from specdist.transport.grpc_host import GrpcHostThread
from specdist.transport.hosts import bare_host
from specdist.transport.protocol import Proposal, StartItem, VerifyItem
from specdist.transport.wire import MAX_DRAFT_TOKENS
from specdist.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from workers.servicing import core_message_limit


class ActorError(RuntimeError):
    """An actor-side failure re-raised in a form Ray can ship back (specdist's FieldError and
    ConfigError take two constructor arguments and do not unpickle)."""


def _shippable_errors(fn):
    """Re-raise exceptions that would not survive pickling as ActorError with the same message."""
    import functools
    import pickle

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            try:
                pickle.loads(pickle.dumps(e))
            except Exception:  # noqa: BLE001
                raise ActorError(f"{type(e).__name__}: {e}") from None
            raise

    return wrapper


def _section(cls: type, value, key: str):
    """A config section as a worker receives it: an instance of ``cls`` as is, else built from a mapping (None:
    the defaults) as ``load_config`` builds it, and validated."""
    from specdist.config import build_section

    section = value if isinstance(value, cls) else build_section(cls, value or {}, key)
    section.validate(key)
    return section


def pin_process(cpu: int) -> int:
    """Pin every thread of this process (threads started later inherit it) to one core:
    ``cpu`` modulo the cores this process may use. Returns the core."""
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[int(cpu) % len(allowed)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that ended meanwhile
            pass
    return core


def _node_ip() -> str:
    """This node's IP as Ray knows it; 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # noqa: BLE001 - no Ray here
        return "127.0.0.1"


NODE_HOST = "node"  # a worker host meaning "the IP of the node this worker runs on"


def _bind_host(host: str) -> str:
    """Where a worker listens: ``node`` (:data:`NODE_HOST`) is its own node's IP (as Ray knows it:
    the interface the cluster uses, on every node its own), anything else as given."""
    return _node_ip() if host == NODE_HOST else host


def _node_id() -> str | None:
    """The Ray node this process runs on (hex id), or None outside Ray."""
    try:
        import ray

        # (the runtime context would start a local Ray instance in a process not connected to one)
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not inside Ray
        return None


def _reachable_host(bind_host: str) -> str:
    """The host others dial: the node's IP when listening on a wildcard (0.0.0.0 / ::), else as bound."""
    if bare_host(bind_host) in ("0.0.0.0", "::", ""):
        return _node_ip()
    return bind_host


def _serve(servicer, service_name: str, add, host: str, port: int, secret: str | None, tls) -> GrpcHostThread:
    """Host ``servicer`` (registered by ``add(servicer, server)``) with the health service on
    ``host:port`` on a loop thread of its own: messages up to the servicer's limit, ``secret``
    required of every caller but the health service's, mutual TLS with ``tls`` (a
    :class:`~specdist.transport.worker_tls.WorkerTLS`: only its CA's certificates get in), SERVING from the start."""
    return GrpcHostThread(
        {service_name: lambda server: add(servicer, server)},
        host,
        port,
        servicer.message_limit,
        token=secret,
        tls=tls,
        serving=True,
    )


def _draining_servicer(base: type, admit_rpc: str, what: str) -> type:
    """A subclass of ``base`` whose ``admit_rpc`` answers UNAVAILABLE while ``draining`` is set."""

    async def admit(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{what} is draining: no new requests")
        return await getattr(base, admit_rpc)(self, request, context)

    return type(f"Draining{base.__name__}", (base,), {"draining": False, admit_rpc: admit})


class _ActorBase(abc.ABC):
    role = "actor"

    def __init__(self, num_threads: int | None = 1, cpu: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cpu = pin_process(cpu) if cpu is not None else None
        self.worker = None
        self.cpu_kernels = ""  # the CPU backend engine.cpu_kernels chose at load (cpu_kernels.backend)
        self.servicer = None
        self.grpc: GrpcHostThread | None = None
        self.grpc_address: str | None = None  # "host:port" others dial while the gRPC server is up
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.role}-worker")
        self.state = "created"  # created -> loaded -> warm -> serving -> draining -> shut down
        self.draining = False
        self.warmup_s: float | None = None
        self.load_s: float | None = None
        # objects freeze_start_up_objects() froze (0 before): counted once there (gc.get_freeze_count() walks them)
        self.frozen_objects = 0
        self.memory_plan = ""  # its paged caches' plan, one line (GPUs: measure_memory / apply_memory_plan)
        self._planned: tuple | None = None  # (caches by name, measure, capture the graphs after) while deferred

    def _on_worker_thread(self, fn, *args):
        return self.executor.submit(fn, *args).result()

    def _require(self, *states: str) -> None:
        if self.state not in states:
            raise RuntimeError(f"{self.role}: called in state {self.state!r}; expected one of {states}")

    def _use_cpu_kernels(self, mode: str) -> None:
        """Apply engine.cpu_kernels in this process before a model loads (ConfigError for required without them)."""
        from specdist.models.kernels import cpu_kernels

        self.cpu_kernels = cpu_kernels.configure(mode)

    def _base_health(self) -> dict:
        out = {
            "role": self.role,
            "state": self.state,
            "pid": os.getpid(),
            "cpu": self.cpu,  # the core it is pinned to (cluster.pin_cpus), else None
            "node_ip": _node_ip(),
            "node_id": _node_id(),  # which Ray node (one machine may hold several)
            "address": self.grpc_address if self.grpc else None,
            "draining": self.draining,
            "load_s": self.load_s,
            "warmup_s": self.warmup_s,
            "frozen_objects": self.frozen_objects,  # start-up objects kept out of the collector's walks
            "cpu_kernels": self.cpu_kernels,  # which kernels run this process's CPU matmuls (engine.cpu_kernels)
            "memory_plan": self.memory_plan,  # how its GPU's memory was planned ("" where nothing was)
        }
        if self.worker is not None:
            out.update(self.worker.health())
        out["ok"] = self.state in ("loaded", "warm", "serving", "following", "draining") and out.get("ok", True)
        return out

    def _drain(self, timeout_s: float) -> dict:
        """Refuse new requests; wait (up to ``timeout_s``) for the in-flight ones to be released."""
        self.draining = True
        if self.servicer is not None:
            self.servicer.draining = True
        if self.grpc is not None:
            self.grpc.set_serving(False)
        if self.state != "shut down":
            self.state = "draining"
        deadline = time.monotonic() + timeout_s
        while self.worker is not None and self.worker.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        left = len(self.worker.requests) if self.worker is not None else 0
        return {"drained": left == 0, "in_flight": left}

    @abc.abstractmethod
    def _runner_profile(self):
        """The :class:`~specdist.models.memory_plan.Profile` of the passes this process serves (its role's)."""

    @_shippable_errors
    def measure_memory(self, utilization: float):
        """Measure this process's passes beside its deferred paged caches (:func:`specdist.models.memory_plan.
        measure_memory`, the engine's terms); None where nothing is deferred (the CPU, ``engine.kv_cache_tokens``,
        a drafter without a model cache). The deployment plans every worker's together and sends each its plan."""
        self._require("loaded")
        if self._planned is None:
            return None
        from specdist.models.memory_plan import measure_memory

        caches, measure, _ = self._planned
        return measure_memory(caches, float(utilization), self._runner_profile(), measure)

    @_shippable_errors
    def apply_memory_plan(self, plan) -> str:
        """Resize the deferred caches to ``plan`` (a :class:`~specdist.models.memory_plan.MemoryPlan` from the
        deployment), then capture the CUDA graphs load left for after it; returns the plan's line."""
        self._require("loaded")
        from specdist.models.memory_plan import apply_plan

        caches, measure, capture = self._planned
        apply_plan(caches, plan.tokens, measure)
        self._planned = None
        if capture is not None:
            capture()
        self.memory_plan = plan.line()
        return self.memory_plan

    def _start_grpc(
        self, servicer: type, admit_rpc: str, draft_tokens: int, pb2, pb2_grpc, host, port, secret, tls
    ) -> str:
        """Serve ``servicer`` (its ``admit_rpc`` answers UNAVAILABLE while draining; messages sized for
        ``draft_tokens`` drafts) + health on ``host:port`` (0 = a free port; host ``node``: this node's IP); returns
        the "host:port" others dial. ``secret``: required of every caller (the deployment's worker secret);
        ``tls``: the deployment's mutual TLS (a WorkerTLS), else plaintext. ``pb2`` / ``pb2_grpc``: the service's
        generated modules (its one service is the one served)."""
        self._require("loaded", "warm")
        cls = _draining_servicer(servicer, admit_rpc, self.role)
        self.servicer = cls(self.worker, self.executor, core_message_limit(self.worker, draft_tokens))
        (service,) = pb2.DESCRIPTOR.services_by_name
        add = getattr(pb2_grpc, f"add_{service}Servicer_to_server")
        host = _bind_host(host)
        self.grpc = _serve(
            self.servicer, pb2.DESCRIPTOR.services_by_name[service].full_name, add, host, port, secret, tls
        )
        self.grpc_address = f"{_reachable_host(host)}:{self.grpc.port}"
        self.state = "serving"
        return self.grpc_address

    def _stop_grpc(self) -> None:
        if self.grpc is not None:
            self.grpc.stop()
            self.grpc = None

    def freeze_start_up_objects(self) -> int:
        """Keep the objects alive after bring-up out of the garbage collector's walks (:mod:`specdist.gc_freeze`);
        the deployment calls it once the actor serves. Returns how many objects are frozen."""
        self.frozen_objects = gc_freeze.freeze()
        return self.frozen_objects

    def ping(self) -> bool:
        return True


# ---------------------------------------------------------------- target
class TargetRankActor(_ActorBase):
    """One rank of the (possibly tensor-parallel) target. Rank 0 serves gRPC; ranks > 0 follow it."""

    role = "target"

    def __init__(self, rank: int, world_size: int, num_threads: int | None = 1, cpu: int | None = None):
        self.rank, self.world_size = int(rank), int(world_size)
        super().__init__(num_threads, cpu)
        self.device = torch.device("cpu")
        self.dist_ready = False
        self._follow_done = threading.Event()
        self.forwards_followed: int | None = None
        self._rendezvous: socket.socket | None = None  # rank 0: the store's listening socket, until init_distributed

    # ------------------------------------------------------------ process group
    def address(self) -> tuple[str, int]:
        """(this node's ip, a free port) for the process-group rendezvous (call on rank 0): the port
        is held, listening on the node's address only, until init_distributed() hands it to the store."""
        from workers.tensor_parallel import rendezvous_socket

        if self._rendezvous is not None:
            self._rendezvous.close()
        self._rendezvous = rendezvous_socket(_node_ip())
        return self._rendezvous.getsockname()[:2]

    @_shippable_errors
    def init_distributed(self, master_addr: str, master_port: int, device: str = "auto") -> None:
        from specdist.models.devices import device_for

        self.device = device_for(device)
        if self.world_size == 1:
            return
        from workers.tensor_parallel import init_process_group

        listen, self._rendezvous = self._rendezvous, None
        init_process_group(
            self.rank, self.world_size, master_addr, int(master_port), self.device, listen=listen, node_addr=_node_ip()
        )
        self.dist_ready = True

    # ------------------------------------------------------------ model
    @_shippable_errors
    def load(
        self,
        model,
        target=None,
        engine=None,
        max_draft_tokens: int = MAX_DRAFT_TOKENS,
        hidden_layers: tuple[int, ...] = (),
        collective_timeout_s: float = 10.0,
    ) -> dict:
        """Load this rank's model and build its core through the engine's factory (:mod:`specdist.cores.factory`).
        ``model``: the config's models as the driver resolved them (:class:`~specdist.models.metadata.ModelSources`,
        what a deployment passes: this rank loads the resolved target's files and resolves no spec), or the
        target's spec (resolved here). ``target``, ``engine``: the config's ``target:`` and ``engine:`` sections
        whole (:class:`~specdist.config.TargetConfig`, :class:`~specdist.config.EngineConfig`, or mappings as a
        config file holds them; None: the defaults), read by the factory; the device is this rank's
        (:meth:`init_distributed`). ``max_draft_tokens``: draft.num_speculative_tokens (the passes compiled and
        captured, the gRPC message limit). ``hidden_layers``: the layers whose hidden states rank 0 keeps for an
        EAGLE-3 draft head."""
        self._require("created")
        t0 = time.perf_counter()
        from specdist.config import EngineConfig, TargetConfig
        from specdist.cores import factory
        from specdist.models.metadata import ModelSources
        from specdist.models.sharding import load_sharded

        if self.world_size > 1 and not self.dist_ready:
            raise RuntimeError("init_distributed() must come before load() when world_size > 1")
        tc, ec = _section(TargetConfig, target, "target"), _section(EngineConfig, engine, "engine")
        self._use_cpu_kernels(ec.cpu_kernels)
        # world_size 1: the whole model; otherwise only this rank's slices (head counts checked first)
        sources = model if isinstance(model, ModelSources) else ModelSources(model)
        model = load_sharded(sources.target, tc.dtype, self.device, self.rank, self.world_size, weights=tc.weights)
        broadcast = set_timeout = None
        if self.world_size > 1:
            from workers.tensor_parallel import broadcast_object, set_collective_timeout

            broadcast, set_timeout = broadcast_object, set_collective_timeout
        # on a GPU a deferred paged cache starts at one sequence; the deployment plans it (measure_memory)
        kv, measure = factory.kv_options(ec, self.device)
        self.worker = factory.build_target_core(
            model, ec, kv, hidden_layers, self.rank, self.world_size, broadcast, set_timeout, collective_timeout_s
        )
        # compiled passes and CUDA graphs on one rank only (collectives stay out of them)
        _, capture = factory.prepare_passes(self.worker.runner, "target", int(max_draft_tokens), ec, self.world_size)
        self.graphed = capture is not None
        if measure is not None:  # the graphs once the cache has its planned size
            self._planned = ({"target": self.worker.runner.cache}, measure, capture)
        elif capture is not None:
            capture()
        self.max_batch_size = ec.max_batch_size
        self.max_draft_tokens = int(max_draft_tokens)
        self.load_s = time.perf_counter() - t0
        self.state = "loaded"
        return {
            "rank": self.rank,
            "vocab_size": self.worker.vocab_size,
            "load_s": self.load_s,
            "cpu_kernels": self.cpu_kernels,
        }

    def _runner_profile(self):
        """What the engine profiles of its target (:meth:`specdist.engine.local.Engine._plan_memory`): the graph
        buckets verifying up to k drafts and the longest prefill, on every rank in the same order (their
        collectives meet); on rank 0, which samples, also the verification sampler at the largest batch."""
        from specdist.engine.local import sampler_passes
        from specdist.models.memory_plan import runner_profile

        runner, k = self.worker.runner, self.max_draft_tokens
        profile = runner_profile({"target": (runner, k + 1)}, self.graphed)
        if self.rank == 0:
            profile.eager += sampler_passes(self.worker.vocab_size, self.max_batch_size, max(k, 1), runner.device)
        return profile

    @_shippable_errors
    def warmup(self) -> float:
        """Rank 0: one short prefill / verify / release (followers replay it). Ranks > 0: no-op."""
        self._require("loaded", "following", "warm")
        if self.rank != 0:
            return 0.0
        t0 = time.perf_counter()
        self._on_worker_thread(self._warmup_calls)
        self.warmup_s = time.perf_counter() - t0
        self.state = "warm"
        return self.warmup_s

    def _warmup_calls(self) -> None:
        w = self.worker
        sp = SamplingParams(temperature=0.0, max_tokens=2)
        prompt = [0, 1 % w.vocab_size] if w.max_model_len > 4 else [0]
        try:
            w.prefill([StartItem(WARMUP_ID, prompt, sp, 0)])
            w.verify([VerifyItem(WARMUP_ID, len(prompt), Proposal(WARMUP_ID, [0]))])
        finally:
            w.release([WARMUP_ID])

    # ------------------------------------------------------------ serving
    @_shippable_errors
    def start_grpc(self, host: str = "127.0.0.1", port: int = 0, secret: str | None = None, tls=None) -> str:
        """Rank 0: serve TargetWorker + health (:meth:`_start_grpc`); ranks > 0 run :meth:`run_follower`."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 serves gRPC; ranks > 0 run run_follower()")
        from workers.target_worker import TargetServicer

        return self._start_grpc(
            TargetServicer, "Prefill", self.max_draft_tokens, target_pb2, target_pb2_grpc, host, port, secret, tls
        )

    @_shippable_errors
    def run_follower(self) -> int:
        """Ranks > 0: replay rank 0's operations until it shuts down (blocks). Returns the forwards run."""
        if self.rank == 0:
            raise RuntimeError("run_follower() is for ranks > 0")
        self._require("loaded")
        self.state = "following"
        try:
            self.forwards_followed = self._on_worker_thread(self.worker.follow)
            return self.forwards_followed
        finally:
            self._follow_done.set()
            if self.state == "following":
                self.state = "stopped"

    def health(self) -> dict:
        out = self._base_health()
        out.update(
            rank=self.rank, world_size=self.world_size, device=str(self.device), following=self.state == "following"
        )
        if self.forwards_followed is not None:
            out["forwards_followed"] = self.forwards_followed
        return out

    @_shippable_errors
    def drain(self, timeout_s: float = 30.0) -> dict:
        if self.rank != 0:
            return {"drained": True, "in_flight": 0}
        return self._drain(timeout_s)

    def shutdown(self, timeout_s: float = 30.0, release_followers: bool = True) -> dict:
        """Rank 0: stop gRPC, release the followers (shutdown broadcast), destroy the process group.
        Ranks > 0: wait for run_follower() to return, then destroy the process group. Idempotent.
        ``release_followers=False`` (bring-up failed before the followers started) skips the broadcast."""
        if self.state == "shut down":
            return {"rank": self.rank, "ok": True}
        ok = True
        if self.rank == 0:
            self._stop_grpc()
            if self.worker is not None and (release_followers or self.world_size == 1):
                self._on_worker_thread(self.worker.shutdown)  # broadcasts ("shutdown",) to the followers
            elif self.worker is not None:  # followers never started: a broadcast would wait for them forever
                self.worker.closed = True
        elif self.state in ("following", "stopped") or self._follow_done.is_set():
            ok = self._follow_done.wait(timeout_s)
        self.executor.shutdown(wait=ok)
        if self.dist_ready and ok:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.dist_ready = False
        self.state = "shut down"
        return {"rank": self.rank, "ok": ok, "forwards_followed": self.forwards_followed}


# ---------------------------------------------------------------- draft
class DraftActor(_ActorBase):
    """One draft worker (method ``model`` / ``self-w8`` / ``self-w4`` / ``ngram`` / ``suffix`` / ``hybrid``)
    served over gRPC."""

    role = "draft"

    def __init__(self, index: int = 0, num_threads: int | None = 1, cpu: int | None = None):
        self.index = int(index)
        super().__init__(num_threads, cpu)
        self.method: str | None = None
        self.k = 0

    @_shippable_errors
    def load(self, draft, target, engine=None, device: str = "auto", dtype: str | None = None) -> dict:
        """Load the draft and build its side through the engine's factory (:mod:`specdist.cores.factory`): what
        the method drafts with (a draft model checked against the target's vocabulary, the target's own copy, a
        head, or nothing), the core, its compiled passes and CUDA graphs, and the pipeline (``draft.pipeline``).
        ``draft``: the draft section as the driver resolved it (:class:`~specdist.cores.proposers.ResolvedDraft`,
        what a deployment passes: checked once, there), or a ``DraftConfig`` or a mapping as a config file's
        ``draft:`` holds it (checked here). ``target``: the :class:`~specdist.models.metadata.ModelSources` a
        deployment passes (resolved, with what the driver read of the target: nothing is resolved or read again
        here), or the target's spec (then ``draft.model`` is resolved here as first used). ``engine``: the
        config's ``engine:`` section whole (an EngineConfig or a mapping; None: the defaults), read by the
        factory. ``device``: where the draft runs (the deployment's choice). ``dtype``: its model's dtype (None:
        the resolved draft's, :func:`~specdist.cores.proposers.draft_dtype`)."""
        self._require("created")
        t0 = time.perf_counter()
        from specdist.config import DraftConfig, EngineConfig
        from specdist.cores import factory
        from specdist.cores.draft import load_draft_model
        from specdist.cores.proposers import ResolvedDraft, resolve_draft
        from specdist.errors import ConfigError
        from specdist.models.devices import device_for
        from specdist.models.metadata import ModelSources

        if not isinstance(draft, ResolvedDraft):
            dc = _section(DraftConfig, draft, "draft")
            draft = resolve_draft(dc, dtype or dc.dtype)
        dc = draft.section
        if not draft.enabled:
            raise ConfigError("draft.method", "a draft actor needs a draft method, not 'none'")
        ec = _section(EngineConfig, engine, "engine")
        self._use_cpu_kernels(ec.cpu_kernels)
        where = device_for(device)
        sources = target if isinstance(target, ModelSources) else ModelSources(target, dc.model)
        model = load_draft_model(dc, sources, dtype or draft.dtype, where)
        vocab = sources.vocab_size()  # the target's: what the method drafts with was checked to share it
        # prefill in Start (not deferred): the transport's Start deadline scales with the prompt, Propose's does not
        # on a GPU a model draft's deferred paged cache starts at one sequence; the deployment plans it
        kv, measure = factory.kv_options(ec, where)
        core = factory.build_draft_core(draft, ec, kv, vocab, model)
        runner = core.runner
        capture = None
        if runner is not None:
            _, capture = factory.prepare_passes(runner, "draft", dc.num_speculative_tokens, ec)
        self.graphed = capture is not None
        if measure is not None and runner is not None and runner.attention is not None:  # the graphs after the plan
            self._planned = ({"draft": runner.cache}, measure, capture)
        elif capture is not None:
            capture()
        self.draft_runner = runner
        self.worker = factory.hosted_drafter(core, draft)
        self.method, self.k = dc.method, dc.num_speculative_tokens
        self.load_s = time.perf_counter() - t0
        self.state = "loaded"
        return {"index": self.index, "method": dc.method, "vocab_size": self.worker.vocab_size, "load_s": self.load_s}

    def _runner_profile(self):
        """What the engine profiles of a model draft: its graph buckets (one token a pass, two when it catches up)
        and its longest prefill."""
        from specdist.models.memory_plan import runner_profile

        return runner_profile({"draft": (self.draft_runner, 2)}, self.graphed)

    @_shippable_errors
    def warmup(self) -> float:
        self._require("loaded", "warm")
        from specdist.cores.draft import warm_up_drafter

        t0 = time.perf_counter()
        self._on_worker_thread(warm_up_drafter, self.worker, self.k)
        self.warmup_s = time.perf_counter() - t0
        self.state = "warm"
        return self.warmup_s

    @_shippable_errors
    def start_grpc(self, host: str = "127.0.0.1", port: int = 0, secret: str | None = None, tls=None) -> str:
        """Serve DraftWorker + health (:meth:`_start_grpc`)."""
        from workers.draft_worker import DraftServicer

        return self._start_grpc(DraftServicer, "Start", self.k, draft_pb2, draft_pb2_grpc, host, port, secret, tls)

    def health(self) -> dict:
        out = self._base_health()
        out.update(index=self.index, draft_method=self.method, k=self.k)
        return out

    @_shippable_errors
    def drain(self, timeout_s: float = 30.0) -> dict:
        return self._drain(timeout_s)

    def shutdown(self) -> dict:
        if self.state != "shut down":
            self._stop_grpc()
            self.executor.shutdown(wait=True)
            close = getattr(self.worker, "close", None)  # a DraftPipeline stops its preparation thread
            if close is not None:
                close()
            self.state = "shut down"
        return {"index": self.index, "ok": True}
