"""The public gRPC service ``specdist.v1.SpecDecode`` (grpc.aio) over a :class:`Coordinator`.

Status codes: a bad field is INVALID_ARGUMENT with the proto field name first in the
details (``params.top_p: must be in (0, 1]``), as is a field beyond the config's
``limits`` (``params.stop[2]: ...``, :func:`specdist.api.admission.check_request`) and a
message that does not parse (``request: ...``); a message over
``limits.max_message_bytes`` is RESOURCE_EXHAUSTED (grpc's own check); a request id
already in use is ALREADY_EXISTS (``request_id: ...``); a full queue RESOURCE_EXHAUSTED; a draining
server UNAVAILABLE, as is one after the engine thread died; Cancel of an id no running request
has NOT_FOUND. Request ids belong to the tenant and the connection that sent them (:func:`caller`): another
client, or another tenant on the same connection (a proxy multiplexing its clients onto one HTTP/2 connection),
neither cancels a request by its id nor gets ALREADY_EXISTS for it. A request that fails inside a step gets a last
message with FINISH_REASON_ERROR and the stream then ends with the delta's ``code``: UNAVAILABLE (a retry may succeed)
when the target failed (a rank died, naming it) or is down, or the engine thread died; INTERNAL for
anything else. The details are the delta's ``message``, the failure's class without worker
addresses, process ids or exception text (those go to the server log); a refusal that is the
server's fault is ``internal error``, its traceback logged.

``serve()`` hosts it on :func:`specdist.transport.grpc_host.start_grpc_host` (the host the workers'
ports use too), with the standard ``grpc.health.v1.Health`` service (SERVING once the engine
has warmed up, NOT_SERVING while draining, while the target is down and for good once the engine
thread has died) and server reflection. Its liveness name (:data:`~specdist.transport.grpc_host.LIVENESS`)
stays SERVING through drains and target rebuilds, and turns NOT_SERVING when the server cannot
recover by itself (:attr:`Coordinator.unrecoverable`: the engine thread died, the target group
is lost): a liveness probe then restarts the process.
With a token (:mod:`specdist.transport.security`) every method except the health service's is
UNAUTHENTICATED without ``authorization: Bearer <token>`` metadata. GetServerInfo's counters (every tenant's
traffic) go only to a caller that may see them (:func:`~specdist.transport.security.sees_everything`: the admin
token of ``--admin-token-file``; without one, nobody on a server of several tenants); anyone else gets the
ServerInfo without its ``counters``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from specdist import logprobs
from specdist.api.admission import (
    Limits,
    ServedEngine,
    check_request,
    check_request_id,
    check_session_id,
    refusal_code,
    request_stats,
    server_info,
)
from specdist.api.codecs import finish_reason_to_proto
from specdist.api.coordinator import Coordinator
from specdist.api.engine_thread import Delta
from specdist.config import tenant_scope_line
from specdist.errors import ErrorCode, InvalidArgument, NotFound
from specdist.sampling_proto import sampling_params_from_proto
from specdist.transport.grpc_host import LIVENESS, GrpcHost, start_grpc_host
from specdist.transport.grpc_status import grpc_status, grpc_status_of
from specdist.transport.security import ServerSecurity, Tokens, sees_everything, tenant_of
from specdist.v1 import common_pb2, specdist_pb2, specdist_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = specdist_pb2.DESCRIPTOR.services_by_name["SpecDecode"].full_name  # "specdist.v1.SpecDecode"
_PARAM_FIELDS = frozenset(f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields)


class SpecDecodeServicer(specdist_pb2_grpc.SpecDecodeServicer):
    """Generate / Cancel / GetServerInfo, each a thin translation onto the coordinator."""

    def __init__(self, coordinator: Coordinator, tokens: Tokens | None = None):
        self.coordinator = coordinator
        self.engine: ServedEngine = coordinator.engine
        self.limits = Limits.of(self.engine)
        # the server's tokens, as of each call: with one a tenant, a request's tenant is its token's; the admin
        # token reads the counters (sees_everything)
        self.tokens = tokens or Tokens()

    async def Generate(
        self, request: specdist_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[specdist_pb2.GenerateResponse]:
        try:
            prompt = self._prompt(request)
            params = sampling_params_from_proto(request.params)
            check_request(self.limits, prompt, params, request.request_id or None)
            if request.session_id:
                check_session_id(self.limits, request.session_id)
            if request.kind:  # (a label as a session id is: visible ASCII, bounded)
                check_session_id(self.limits, request.kind, "kind")
            tenant = tenant_of(_authorization(context), self.tokens.now()[0])
            stream = await self.coordinator.open(
                prompt,
                params,
                request.request_id or None,
                chat=request.apply_chat_template,
                scope=caller(context, tenant),
                tenant=tenant,
                session=request.session_id or None,
                kind=request.kind or None,
            )
        except Exception as e:  # each refusal has its code; INTERNAL: not the client's fault
            code = refusal_code(e, "Generate")  # INTERNAL: logged there, with its traceback
            message = "internal error" if code == ErrorCode.INTERNAL else _wire_message(e)
            await context.abort(grpc_status(code), message)
        try:
            async for delta in stream:
                yield _response(delta, self.limits.speculative_stats)
                if delta.finish_reason == "error":
                    await context.abort(
                        grpc_status(delta.code or ErrorCode.INTERNAL), delta.message or "request failed"
                    )
        finally:  # also on client disconnect (the handler task is cancelled): aborts the request
            stream.close()

    async def Cancel(
        self, request: specdist_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> specdist_pb2.CancelResponse:
        try:
            check_request_id(self.limits, request.request_id)
        except InvalidArgument as e:
            await context.abort(grpc_status_of(e), str(e))
        scope = caller(context, tenant_of(_authorization(context), self.tokens.now()[0]))
        if not await self.coordinator.cancel(request.request_id, scope=scope):
            e = NotFound("request_id", f"no running request has id {request.request_id!r}")
            await context.abort(grpc_status_of(e), str(e))
        return specdist_pb2.CancelResponse()

    async def GetServerInfo(
        self, request: specdist_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> specdist_pb2.ServerInfo:
        if not sees_everything(_authorization(context), *self.tokens.now()):
            return specdist_pb2.ServerInfo(**server_info(self.engine))  # no counters: they show every tenant's
        c = self.coordinator.counters()
        counters = specdist_pb2.ServerInfo.Counters(
            running_requests=c["running"],
            queued_requests=c["queued"],
            target_kv_slots_used=c["target_kv_slots_used"],
            draft_kv_slots_used=c["draft_kv_slots_used"],
            requests_total=c["requests_total"],
            requests_finished=c["requests_finished"],
            requests_cancelled=c["requests_cancelled"],
            requests_failed=c["requests_failed"],
            active_streams=c["active_streams"],
        )
        return specdist_pb2.ServerInfo(**server_info(self.engine), counters=counters)

    @staticmethod
    def _prompt(request: specdist_pb2.GenerateRequest) -> str | Sequence[int]:
        """The prompt as sent: text, or token ids. The engine checks it (specdist.engine.prompts), chat template
        included."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidArgument("prompt", "must be set (text or token_ids)")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        return request.text


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The call's ``authorization`` metadata value (the interceptor checked it already)."""
    value = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    return value.decode("latin-1") if isinstance(value, bytes) else value


def caller(context: grpc.aio.ServicerContext, tenant: str = "") -> str:
    """The scope of a caller's request ids (:meth:`Coordinator.open`): its tenant (:func:`tenant_of`, "" with one
    token or none) and its connection (the peer address). The clients of one token tell each other apart by their
    connections; the tenants of a proxy that multiplexes them onto one connection, by their tokens: a client
    cancels, and learns of, only the requests its own tenant sent on its own channel."""
    return hashlib.sha256(f"{tenant}\0{context.peer()}".encode()).hexdigest()[:16]


def _wire_message(e: Exception) -> str:
    """The engine names SamplingParams fields bare ("stop"); on the wire they live under ``params.``."""
    if isinstance(e, InvalidArgument) and e.field.split("[", 1)[0] in _PARAM_FIELDS:  # stop[2]: params.stop[2]
        return f"params.{e.field}: {e.message}"
    return str(e)


def _response(d: Delta, speculative: bool = True) -> specdist_pb2.GenerateResponse:
    msg = specdist_pb2.GenerateResponse(
        request_id=d.request_id,
        token_ids=d.token_ids,
        text=d.text,
        finish_reason=finish_reason_to_proto(d.finish_reason),
    )
    if isinstance(d.stop_reason, str):
        msg.stop_reason_text = d.stop_reason
    elif isinstance(d.stop_reason, int):
        msg.stop_reason_token = d.stop_reason
    if d.metrics is not None:
        msg.stats.CopyFrom(common_pb2.RequestStats(**request_stats(d.metrics, speculative)))
    if d.logprobs:
        msg.logprobs.extend(logprobs.to_proto(d.logprobs))
    return msg


def add_servicer(servicer: SpecDecodeServicer, server: grpc.aio.Server) -> None:
    """Register SpecDecode on ``server`` with each request parsed inside its handler: bytes that
    are not a valid message (corrupt wire format, bad UTF-8 in a string) are INVALID_ARGUMENT
    naming ``request``, where grpc's own deserializer would answer UNKNOWN."""
    handlers = {}
    for method in specdist_pb2.DESCRIPTOR.services_by_name["SpecDecode"].methods:
        request_cls = getattr(specdist_pb2, method.input_type.name)
        response_cls = getattr(specdist_pb2, method.output_type.name)
        behavior = _parsing(getattr(servicer, method.name), request_cls, method.server_streaming)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(behavior, response_serializer=response_cls.SerializeToString)  # bytes in
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _parsing(method, request_cls, streaming: bool):
    """``method`` (a servicer method) taking the request's bytes, parsed first."""

    async def parse(data: bytes, context: grpc.aio.ServicerContext):
        try:
            return request_cls.FromString(data)
        except DecodeError as e:
            why = str(e).rsplit(": ", 1)[-1]  # "Wire format was corrupt", "String field had bad UTF-8"
            message = f"request: not a valid {request_cls.DESCRIPTOR.full_name} ({why})"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    if streaming:

        async def handler(data: bytes, context: grpc.aio.ServicerContext):
            async for response in method(await parse(data, context), context):
                yield response
    else:

        async def handler(data: bytes, context: grpc.aio.ServicerContext):
            return await method(await parse(data, context), context)

    return handler


class SpecDistServer:
    """A started gRPC server with its coordinator; ``stop()`` drains, then shuts down."""

    def __init__(self, host: GrpcHost, coordinator: Coordinator, drain_seconds: float):
        self.host = host
        self.coordinator = coordinator
        self.drain_seconds = drain_seconds

    @property
    def port(self) -> int:
        return self.host.port

    async def set_serving(self, serving: bool) -> None:
        """The health status of the server ("") and of SpecDecode."""
        await self.host.set_serving(serving)

    async def availability_changed(self, accepting: bool) -> None:
        """The coordinator admits requests again or no more: health follows; liveness turns
        NOT_SERVING (for good) once the server cannot recover by itself."""
        await self.set_serving(accepting)
        why = self.coordinator.unrecoverable
        if why is not None:
            log.error("liveness NOT_SERVING: %s; this server must be restarted", why)
            await self.host.health.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, drain_seconds: float | None = None) -> None:
        """NOT_SERVING, refuse new requests, let running ones finish (up to the drain time),
        abort the rest (their streams end with ABORT), then stop the gRPC server."""
        await self.set_serving(False)
        wait = self.drain_seconds if drain_seconds is None else drain_seconds
        if not await self.coordinator.drain(wait):
            live = self.coordinator.counters()["live_requests"]
            log.warning("drain time (%.1fs) over; aborting %d requests", wait, live)
        await self.coordinator.close()
        await self.host.stop(grace=1.0)

    async def wait_for_termination(self) -> None:
        await self.host.wait_for_termination()


async def serve(
    engine: ServedEngine,
    host: str = "127.0.0.1",
    port: int = 50051,
    max_queued: int = 256,
    drain_seconds: float = 5.0,
    security: ServerSecurity | None = None,
    coordinator: "Coordinator | None" = None,
) -> tuple[SpecDistServer, Coordinator]:
    """Start SpecDecode + health + reflection on ``host:port`` (0 picks a free port: see ``.port``).

    Health is NOT_SERVING until the engine has warmed up, then SERVING. ``security``: TLS
    credentials for the port, and a token every method but the health service requires
    (:mod:`specdist.transport.security`: both read again when their files change); with several tokens
    (tenants) one line on stderr says what the tenants share (:func:`specdist.config.tenant_scope_line`).
    Messages over ``limits.max_message_bytes`` are refused.
    """
    security = security or ServerSecurity()
    token = security.token
    line = tenant_scope_line(engine.config, len(token) if isinstance(token, tuple) else 1)
    if line is not None:
        print(f"[specdist] {line}", file=sys.stderr, flush=True)
    tokens = security.tokens

    def quota() -> int | None:  # by the tenants the token file holds now (re-read when it changes)
        token = tokens.now()[0]
        return engine.config.limits.tenant_quota(max_queued, len(token) if isinstance(token, tuple) else 1)

    if coordinator is None:
        coordinator = Coordinator(engine, max_queued=max_queued, tenant_quota=quota)
    else:  # the front over Serve replicas (specdist.api.replica_set.ReplicaFront): the same quota, over them all
        coordinator.tenant_quota = quota
    coordinator.start()
    servicer = SpecDecodeServicer(coordinator, security.tokens)
    hosted = await start_grpc_host(
        {SERVICE_NAME: lambda server: add_servicer(servicer, server)},
        host,
        port,
        servicer.limits.max_message_bytes,
        token=security.tokens,
        tls=security.tls,
        reflection=True,
        serving=False,
    )
    wrapped = SpecDistServer(hosted, coordinator, drain_seconds)
    try:
        await coordinator.warm_up()
    except BaseException:
        await wrapped.stop(0)
        raise
    await wrapped.set_serving(True)
    # NOT_SERVING while the target is down (Coordinator.target_down), SERVING again once it is back;
    # NOT_SERVING for good, liveness too, once the engine thread has died or the target is lost
    coordinator.availability_listeners.append(
        lambda accepting: asyncio.ensure_future(wrapped.availability_changed(accepting))
    )
    return wrapped, coordinator
