"""Command-line glue for the gRPC server and the remote ``generate``.

    specdist serve --config configs/local.yaml --port 50051     # until SIGINT/SIGTERM, then drains
    specdist serve --config configs/default.yaml                # cluster.enabled: a local Ray deployment
    specdist serve --config configs/default.yaml --ray-address auto   # ... on a running Ray cluster

With ``cluster.enabled`` the target ranks and draft workers run as Ray actors
(:mod:`cluster.deployment`, imported lazily) behind a :class:`~specdist.remote_engine.RemoteEngine`,
and the same public server fronts it. On SIGINT/SIGTERM: drain, stop the server, stop the
deployment (actors, placement groups), shut down Ray if this process started it.
    specdist generate --server 127.0.0.1:50051 "prompt"         # streams text; stats on stderr
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config (default: built-in model, self-w8 draft)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    parser.add_argument("--max-queued", type=int, default=256, help="most requests running + waiting at once")
    parser.add_argument("--drain-seconds", type=float, default=5.0, help="on shutdown, wait this long for requests")
    parser.add_argument(
        "--ray-address", default=None,
        help="cluster.enabled: connect to this Ray cluster (e.g. auto, or ray://host:10001); "
             "default: start a local Ray cluster for the deployment and shut it down on exit",
    )
    parser.add_argument(
        "--worker-host", default="127.0.0.1",
        help="cluster.enabled: address the target/draft workers listen on (must be reachable from this process)",
    )


def _log(msg: str) -> None:
    print(f"[specdist] {msg}", file=sys.stderr, flush=True)


@dataclass
class Backend:
    """What serves the requests: the in-process Engine, or a RemoteEngine over a Ray deployment."""

    engine: Any
    deployment: Any = None  # cluster.deployment.Deployment when cluster.enabled
    target_address: str | None = None
    draft_addresses: list = field(default_factory=list)
    owns_ray: bool = False  # ray.init was called here: ray.shutdown() on close
    _closed: bool = False

    def close(self) -> None:
        """Close the engine, stop the deployment (actors + placement groups), shut down Ray if ours. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.deployment is not None:
                try:
                    self.engine.close()  # RemoteEngine: channels + thread pool
                finally:
                    self.deployment.stop()
        finally:
            if self.owns_ray:
                import ray

                if ray.is_initialized():
                    ray.shutdown()


def start_backend(config: Any, ray_address: str | None = None, worker_host: str = "127.0.0.1",
                  log: Callable[[str], None] = _log) -> Backend:
    """Load the engine (cluster.enabled false), or bring a Ray deployment up and connect a RemoteEngine to it.

    Blocking. On any failure (also KeyboardInterrupt) everything created here is torn down again.
    """
    from specdist.config import load_config

    cfg = load_config(config)
    if not cfg.cluster.enabled:
        from specdist.engine import Engine

        return Backend(Engine.from_config(cfg))

    import ray  # lazily: only a deployment needs Ray, cluster/ and workers/

    from cluster.deployment import Deployment
    from specdist.remote_engine import RemoteEngine

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
                num_cpus = max(os.cpu_count() or 1, math.ceil(need))
                log(f"starting a local Ray cluster with {num_cpus} logical CPUs")
                backend.owns_ray = True
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        log(f"bringing up {cc.tensor_parallel_size} target rank(s) + {cc.num_draft_workers} draft worker(s) "
            f"(timeout {cc.bringup_timeout_s:g}s)")
        backend.deployment = Deployment.from_config(cfg)
        target, drafts = backend.deployment.start(cfg, host=worker_host, timeout_s=cc.bringup_timeout_s)
        backend.target_address, backend.draft_addresses = target, list(drafts)
        log(f"target worker (rank 0) at {target}; draft workers at {', '.join(drafts) or '-'}")
        engine = RemoteEngine.from_addresses(cfg, target, drafts)
        engine.tensor_parallel_size = cc.tensor_parallel_size  # reported by GetServerInfo
        backend.engine = engine
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

    server: Any  # specdist.server.SpecDistServer
    backend: Backend
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.server.port}"

    async def stop(self, drain_seconds: float | None = None) -> None:
        """Drain and stop the server, then the backend (deployment, Ray if ours)."""
        try:
            await self.server.stop(drain_seconds)
        finally:
            await asyncio.to_thread(self.backend.close)


async def start_serving(config: Any = None, host: str = "127.0.0.1", port: int = 0, max_queued: int = 256,
                        drain_seconds: float = 5.0, ray_address: str | None = None, worker_host: str = "127.0.0.1",
                        backend: Backend | None = None) -> Serving:
    """Everything ``specdist serve`` does before waiting for a signal; returns the handle to stop it.

    Without ``backend`` it is brought up here (:func:`start_backend`, blocking this event loop).
    """
    from specdist.server import serve

    if backend is None:
        backend = start_backend(config, ray_address, worker_host)
    try:
        server, _ = await serve(backend.engine, host, port, max_queued, drain_seconds)
    except BaseException:
        await asyncio.to_thread(backend.close)
        raise
    return Serving(server, backend, host)


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine (or bring the Ray deployment up), serve until SIGINT/SIGTERM, drain, tear down, exit 0."""
    if args.max_queued < 1:
        raise ValueError(f"--max-queued must be >= 1, got {args.max_queued}")
    if args.drain_seconds < 0:
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    # bring-up can take minutes: SIGTERM then interrupts it like Ctrl-C, so it tears down what it made
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        backend = start_backend(args.config, getattr(args, "ray_address", None), getattr(args, "worker_host", "127.0.0.1"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        asyncio.run(_serve_until_signalled(backend, args))
    finally:
        # a second signal must not cut the tear-down short (it is bounded by the deployment's timeouts)
        old = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if backend.deployment is not None:
                _log("stopping the deployment")
            backend.close()
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _ignore(signum: int, frame: Any) -> None:
    _log("tearing down; please wait")


async def _serve_until_signalled(backend: Backend, args: argparse.Namespace) -> None:
    serving = await start_serving(host=args.host, port=args.port, max_queued=args.max_queued,
                                  drain_seconds=args.drain_seconds, backend=backend)
    engine = backend.engine
    cfg = engine.config
    where = (f"Ray deployment: TP={cfg.cluster.tensor_parallel_size} target at {backend.target_address}, "
             f"{len(backend.draft_addresses)} draft worker(s)" if backend.deployment is not None else "in process")
    _log(f"serving {cfg.target.model} (draft={cfg.draft.method} k={engine.k}, {where}) on {serving.address}")
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
    await serving.server.stop()  # the backend is closed by run_serve, with signals held off
    _log("stopped")


def run_remote_generate(server: str, prompt: str | list[int], params_kwargs: dict[str, Any], raw: bool) -> int:
    """Stream one generation from a running server to stdout; stats on stderr.

    ``params_kwargs``: SpecDistClient.generate keywords (max_tokens, temperature, top_p,
    top_k, seed, stop, ...). Without ``raw`` a text prompt is wrapped in the model's
    chat template by the server. Server errors raise RemoteError (a SpecDistError).
    """
    import grpc

    from specdist.client import RemoteError, SpecDistClient

    t0 = time.perf_counter()
    last = None
    with SpecDistClient(server) as client:
        chat = not raw and isinstance(prompt, str)
        try:
            last = _stream_to_stdout(client.generate(prompt, apply_chat_template=chat, **params_kwargs))
        except RemoteError as e:  # like the local CLI: a model without a chat template gets the raw prompt
            if not (chat and e.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.message):
                raise
            last = _stream_to_stdout(client.generate(prompt, **params_kwargs))
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
    return 0


def _stream_to_stdout(chunks: Iterator[Any]) -> Any:
    """Write each chunk's text as it arrives; return the last chunk."""
    last = None
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    return last
