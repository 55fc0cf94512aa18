"""The one gRPC host: the public SpecDecode server (:mod:`specdist.api.grpc_server`) and every worker port
(``workers/actors.py``) are built and started here.

:func:`start_grpc_host` creates a grpc.aio server on the running event loop and starts it:

- the services: ``{full service name: add(server)}``, each registering its servicer;
- ``host:port`` (port 0: the OS picks a free one; :attr:`GrpcHost.port` is the one bound), over
  TLS with a :class:`~specdist.transport.security.ServerTLS`, else plaintext; a port that cannot be bound
  raises OSError (or grpc's RuntimeError) before the server starts;
- with a ``token``, every method but the health service's needs ``authorization: Bearer <token>``
  (:func:`specdist.transport.security.auth_interceptors`), else UNAUTHENTICATED;
- messages up to ``message_limit`` bytes either way; grpc refuses a larger one with
  RESOURCE_EXHAUSTED (:func:`specdist.transport.wire.grpc_message_options`);
- the standard ``grpc.health.v1.Health`` service, one status for the server (``""``) and each
  service name, set before the server starts (``serving``) and by :meth:`GrpcHost.set_serving`,
  and :data:`LIVENESS`, SERVING from the start until :meth:`GrpcHost.stop` whatever the others
  say (a liveness probe asks it: it answers while the process and its event loop do, also while
  the engine is rebuilding); at most :data:`MAX_HEALTH_WATCHES` ``Watch`` streams at once (the
  health service needs no token), more are refused RESOURCE_EXHAUSTED;
- optionally server reflection over the services, the health service and reflection itself.

:class:`GrpcHostThread` is the same host on an event loop thread of its own, with blocking
methods, for a process that runs no event loop (a Ray actor).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from specdist.transport.security import ServerTLS, Tokens, auth_interceptors
from specdist.transport.wire import grpc_message_options

AddService = Callable[[grpc.aio.Server], None]  # registers one servicer on a server
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"
LIVENESS = "specdist.v1.Liveness"  # health name for liveness probes: SERVING until the host stops
MAX_HEALTH_WATCHES = 64  # Watch streams open at once, over all health names


class CappedHealthServicer(health_aio.HealthServicer):
    """grpc's asyncio health servicer with at most ``max_watches`` ``Watch`` streams open at once.

    Health is served without the token (probes carry none), so without a cap anyone who reaches
    the port could hold open streams, each a task and a condition, without bound."""

    def __init__(self, max_watches: int = MAX_HEALTH_WATCHES):
        super().__init__()
        self.max_watches = max_watches
        self.watches = 0  # Watch streams open now

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:  # grpc's method name (CamelCase)
        if self.watches >= self.max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_watches} health Watch streams may be open at once",
            )
        self.watches += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watches -= 1


class GrpcHost:
    """A started grpc.aio server and its health service. Use it on the loop that started it."""

    def __init__(
        self, server: grpc.aio.Server, health: CappedHealthServicer, port: int, service_names: tuple[str, ...]
    ):
        self.server = server
        self.health = health
        self.port = port
        self.health_names = ("",) + tuple(service_names)  # "": the server as a whole

    async def set_serving(self, serving: bool) -> None:
        """SERVING or NOT_SERVING for the server and each of its services."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.health_names:
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 1.0) -> None:
        """NOT_SERVING (liveness too), then stop: calls still running get ``grace`` seconds, new
        ones are refused."""
        await self.set_serving(False)
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_grpc_host(
    services: Mapping[str, AddService],
    host: str,
    port: int,
    message_limit: int,
    *,
    token: str | Tokens | None = None,
    tls: ServerTLS | None = None,
    reflection: bool = False,
    serving: bool = False,
    admin_token: str | None = None,
) -> GrpcHost:
    """Build the server (module docstring), bind ``host:port``, set every health status to
    ``serving`` and start it. Call it on the event loop that is to run the server."""
    server = grpc.aio.server(
        options=grpc_message_options(message_limit), interceptors=auth_interceptors(token, admin_token)
    )
    for add in services.values():
        add(server)
    health = CappedHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if reflection:
        from grpc_reflection.v1alpha import reflection as grpc_reflection

        grpc_reflection.enable_server_reflection((*services, HEALTH_SERVICE, grpc_reflection.SERVICE_NAME), server)
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.grpc_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    hosted = GrpcHost(server, health, bound, tuple(services))
    await hosted.set_serving(serving)
    await health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    return hosted


class GrpcHostThread:
    """:func:`start_grpc_host` on an event loop thread of its own; the methods block until done.

    Arguments as for :func:`start_grpc_host`; ``serving`` defaults to True here (a host without a
    loop of its own starts once its servicer is ready)."""

    def __init__(
        self,
        services: Mapping[str, AddService],
        host: str,
        port: int,
        message_limit: int,
        *,
        token: str | None = None,
        tls: ServerTLS | None = None,
        reflection: bool = False,
        serving: bool = True,
        start_timeout_s: float = 30.0,
    ):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-loop", daemon=True)
        self.thread.start()
        try:
            self.host = self._run(
                start_grpc_host(
                    services, host, port, message_limit, token=token, tls=tls, reflection=reflection, serving=serving
                ),
                start_timeout_s,
            )
        except BaseException:
            self._stop_loop()
            raise
        self.port = self.host.port

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def set_serving(self, serving: bool) -> None:
        self._run(self.host.set_serving(serving), 10)

    def stop(self, grace: float = 1.0) -> None:
        """NOT_SERVING, stop the server (``grace`` seconds for running calls), end the loop thread."""
        try:
            self._run(self.host.stop(grace), grace + 30)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()
