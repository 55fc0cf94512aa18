"""A synchronous Python client of the ``specdist.v1.SpecDecode`` service.

    with SpecDistClient("127.0.0.1:50051") as client:
        for chunk in client.generate("Explain gravity.", max_tokens=64, temperature=0):
            print(chunk.text, end="")
        text, ids, finish_reason, stats = client.generate_text([1, 2, 3], max_tokens=8)

Every gRPC error becomes a :class:`RemoteError` carrying the status code and the
server's message. Closing a ``generate()`` iterator early (``break``, ``.close()``)
cancels the call, which aborts the request on the server.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from specdist import logprobs as _logprobs
from specdist.errors import SpecDistError
from specdist.logprobs import TokenLogprob
from specdist.transport.security import bearer_metadata, client_channel
from specdist.v1 import common_pb2, specdist_pb2, specdist_pb2_grpc

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


class RemoteError(SpecDistError):
    """A call failed on the server (or could not reach it). ``code`` is a ``grpc.StatusCode``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> "RemoteError":
        return cls(err.code(), err.details() or "")


@dataclass
class RequestStats:
    prompt_tokens: int
    output_tokens: int
    drafted: int
    accepted: int
    steps: int
    time_to_first_token_s: float
    total_time_s: float
    pipeline_hits: int = 0  # steps whose drafts were prepared during the previous verification
    pipeline_misses: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class GenerateChunk:
    """One GenerateResponse; the last one of a stream has ``finish_reason`` and ``stats``."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    stats: RequestStats | None = None
    # asked with logprobs=N: one per token_ids entry (the target's processed log-probabilities,
    # specdist.logprobs.TokenLogprob); None when the message carries none
    logprobs: list[TokenLogprob] | None = None


@dataclass
class ServerInfo:
    target_model: str
    draft_method: str
    draft_model: str
    tensor_parallel_size: int
    draft_replicas: int
    num_speculative_tokens: int
    max_model_len: int
    counters: dict[str, int] = field(default_factory=dict)
    draft_pipeline: bool = False  # drafts prepared while the target verifies (draft.pipeline)
    draft_pipeline_miss: str = ""  # with draft_pipeline: "redraft" | "skip" | "auto"
    cpu_kernels: str = ""  # which kernels run the target on the CPU (engine.cpu_kernels); "" if unknown
    memory_plan: str = ""  # how the GPU's memory was planned at load (specdist.models.memory_plan); "" if not
    replicas: int = 1  # speculative groups serving (Serve replicas with cluster.replicas)
    router_policy: str = ""  # router.policy with several replicas


class SpecDistClient:
    """Blocking client; ``target`` is ``"host:port"`` or an existing ``grpc.Channel``.

    TLS (with ``"host:port"``): ``root_certificates`` (PEM bytes of the CA to trust; None: the
    system's roots), ``certificate_chain`` and ``private_key`` (a client certificate, for servers
    that require one), or ``tls=True`` alone. ``token``: sent as ``authorization: Bearer <token>``
    metadata on every call (:mod:`specdist.transport.security`).
    """

    def __init__(
        self,
        target: str | grpc.Channel,
        timeout: float | None = None,
        *,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        tls: bool = False,
        token: str | None = None,
    ):
        self._own = isinstance(target, str)
        if isinstance(target, str):
            self.channel = client_channel(target, root_certificates, certificate_chain, private_key, tls)
        else:
            self.channel = target
        self.timeout = timeout
        self._metadata = bearer_metadata(token)
        self._stub = specdist_pb2_grpc.SpecDecodeStub(self.channel)

    def __enter__(self) -> "SpecDistClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.channel.close()

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str | None = None,
        apply_chat_template: bool = False,
        logprobs: int | None = None,
        session_id: str | None = None,
    ) -> Iterator[GenerateChunk]:
        """Stream a generation. Unset (None) sampling fields take the server's defaults. ``logprobs``:
        each chunk's ``logprobs`` gives its tokens' log-probabilities with that many top entries."""
        return self._stream(
            generate_request(
                prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos,
                request_id=request_id,
                apply_chat_template=apply_chat_template,
                logprobs=logprobs,
                session_id=session_id,
            )
        )

    def _stream(self, req: specdist_pb2.GenerateRequest) -> Iterator[GenerateChunk]:
        call = self._stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
        try:
            for msg in call:
                yield _chunk(msg)
        except grpc.RpcError as e:
            raise RemoteError.from_rpc(e) from None
        finally:
            call.cancel()  # a no-op once the stream is complete; otherwise aborts the request

    def generate_text(
        self, prompt: str | Sequence[int], **kwargs
    ) -> tuple[str, list[int], str | None, RequestStats | None]:
        """Run to completion: (text, token_ids, finish_reason, stats)."""
        text, ids, last = [], [], None
        for chunk in self.generate(prompt, **kwargs):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        return "".join(text), ids, last and last.finish_reason, last and last.stats

    def cancel(self, request_id: str) -> None:
        """Abort a running request; RemoteError NOT_FOUND if no running request has that id."""
        try:
            self._stub.Cancel(
                specdist_pb2.CancelRequest(request_id=request_id), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise RemoteError.from_rpc(e) from None

    def server_info(self) -> ServerInfo:
        try:
            msg = self._stub.GetServerInfo(
                specdist_pb2.GetServerInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise RemoteError.from_rpc(e) from None
        counters = {f.name: getattr(msg.counters, f.name) for f in msg.counters.DESCRIPTOR.fields}
        return ServerInfo(
            msg.target_model,
            msg.draft_method,
            msg.draft_model,
            msg.tensor_parallel_size,
            msg.draft_replicas,
            msg.num_speculative_tokens,
            msg.max_model_len,
            counters,
            msg.draft_pipeline,
            msg.draft_pipeline_miss,
            msg.cpu_kernels,
            msg.memory_plan,
            msg.replicas,
            msg.router_policy,
        )

    def health(self, service: str = "") -> str:
        """The health service's status name: "SERVING", "NOT_SERVING", ... (needs grpcio-health-checking)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            stub = health_pb2_grpc.HealthStub(self.channel)
            resp = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise RemoteError.from_rpc(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def generate_request(
    prompt: str | Sequence[int],
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str | None = None,
    apply_chat_template: bool = False,
    logprobs: int | None = None,
    session_id: str | None = None,
) -> specdist_pb2.GenerateRequest:
    """The ``GenerateRequest`` that :meth:`SpecDistClient.generate` sends (for callers of the stub itself)."""
    params = common_pb2.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("logprobs", logprobs),
    ):
        if value is not None:
            setattr(params, name, value)
    req = specdist_pb2.GenerateRequest(
        params=params,
        request_id=request_id or "",
        apply_chat_template=apply_chat_template,
        session_id=session_id or "",
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _chunk(msg: specdist_pb2.GenerateResponse) -> GenerateChunk:
    kind = msg.WhichOneof("stop_reason")
    stats = None
    if msg.HasField("stats"):
        s = msg.stats
        stats = RequestStats(
            s.prompt_tokens,
            s.output_tokens,
            s.drafted,
            s.accepted,
            s.steps,
            s.time_to_first_token_s,
            s.total_time_s,
            s.pipeline_hits,
            s.pipeline_misses,
        )
    return GenerateChunk(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=_FINISH.get(msg.finish_reason),
        stop_reason=getattr(msg, kind) if kind else None,
        stats=stats,
        logprobs=_logprobs.from_proto(msg.logprobs) or None,
    )
