"""Errors as types: every error a server answers with carries an ErrorCode, mapped once to gRPC
(specdist.transport.grpc_status) and once to HTTP (specdist.api.http_server.HTTP_STATUS); a batch failure blames
one item through one parser (specdist.errors.blamed_item), locally and over gRPC alike; the
scheduler decides on codes."""

from __future__ import annotations

import ast
import asyncio
import pickle
from pathlib import Path

import grpc
import pytest

from specdist import errors
from specdist.api import refusals, replica_set
from specdist.api.admission import bare_host, refusal_code
from specdist.config import load_config
from specdist.engine.prompts import EncodedPrompt
from specdist.engine.scheduler import Scheduler
from specdist.errors import ErrorCode, FieldError, blamed_item, code_of
from specdist.sampling_params import SamplingParams
from specdist.transport.grpc_status import error_code, grpc_status, grpc_status_of
from specdist.transport.protocol import CallTiming, Prefilled, TransportError, Verified, call_local, error_for_items

# every error class a server answers with: (its code, the gRPC status, the HTTP status)
EXPECTED = {
    errors.InvalidArgument: (ErrorCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, 400),
    errors.NotFound: (ErrorCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND, 404),
    errors.AlreadyExists: (ErrorCode.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS, 409),
    errors.FailedPrecondition: (ErrorCode.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION, 400),
    errors.NonFiniteLogits: (ErrorCode.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION, 400),
    errors.ResourceExhausted: (ErrorCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    errors.Unavailable: (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
    refusals.DuplicateRequestId: (ErrorCode.ALREADY_EXISTS, grpc.StatusCode.ALREADY_EXISTS, 409),
    refusals.Overloaded: (ErrorCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
    refusals.ShuttingDown: (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
    refusals.TargetDown: (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
    refusals.EngineDown: (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
    refusals.TenantQuotaExceeded: (ErrorCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    replica_set.ReplicasDown: (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
    replica_set.ReplicaRefused: (ErrorCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, 503),
}


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def _instance(cls: type):
    if issubclass(cls, refusals.DuplicateRequestId):
        return cls("req-1")
    if issubclass(cls, errors.Refusal):
        return cls("no room")
    return cls("items[1].seq_len", "is 3")


# ---------------------------------------------------------------- codes
def test_every_field_error_subclass_has_its_own_code() -> None:
    subclasses = _subclasses(FieldError)
    assert subclasses >= {errors.InvalidArgument, errors.NotFound, refusals.DuplicateRequestId}
    for cls in subclasses:
        assert isinstance(cls.code, ErrorCode), cls
        assert cls.code != ErrorCode.INTERNAL, f"{cls.__name__} is answered INTERNAL"
        assert cls in EXPECTED, f"{cls.__name__}: add its expected statuses to EXPECTED"


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_each_error_maps_to_its_grpc_and_http_status(cls) -> None:
    from specdist.api.http_server import HTTP_STATUS

    code, status, http = EXPECTED[cls]
    e = _instance(cls)
    assert code_of(e) == code and cls.code == code
    assert grpc_status(code) == status and grpc_status_of(e) == status
    assert getattr(cls, "http_status", HTTP_STATUS[code]) == http  # a tenant's quota: its own 429


def test_only_the_errors_module_gives_a_class_its_code() -> None:
    """A class's code is set in specdist/errors.py alone: a refusal elsewhere subclasses errors.py's class of its
    code (errors.Refusal), so no second list of classes and codes grows beside it."""
    root = Path(__file__).resolve().parents[2]
    setting = []
    for path in sorted(p for d in ("specdist", "cluster", "workers") for p in (root / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:  # code = ErrorCode.X (a dataclass's field named code is no class's code)
                    value = getattr(stmt, "value", None)
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                    if (
                        any(isinstance(t, ast.Name) and t.id == "code" for t in targets)
                        and isinstance(value, ast.Attribute)
                        and getattr(value.value, "id", None) == "ErrorCode"
                    ):
                        setting.append(f"{path.relative_to(root)}:{node.name}")
    assert setting and all(where.startswith("specdist/errors.py:") for where in setting), setting


def test_a_refusal_is_its_message_and_blames_no_item() -> None:
    e = refusals.TargetDown("target unavailable; retry later")
    assert isinstance(e, errors.Unavailable) and e.field == "" and str(e) == "target unavailable; retry later"
    assert blamed_item(e.field, 3) is None
    back = pickle.loads(pickle.dumps(replica_set.ReplicaRefused("draining", "replica-2")))
    assert (str(back), back.replica_id) == ("draining", "replica-2")


def test_the_grpc_mapping_is_one_to_one_and_the_http_mapping_total() -> None:
    from specdist.api.http_server import HTTP_STATUS

    for code in ErrorCode:
        assert error_code(grpc_status(code)) is code
        assert grpc_status(code).name == code.name
        assert code in HTTP_STATUS
    assert error_code(grpc.StatusCode.OK) is ErrorCode.UNKNOWN  # no failure carries OK
    assert {grpc_status(c) for c in ErrorCode} == set(grpc.StatusCode) - {grpc.StatusCode.OK}


def test_anything_but_a_specdist_error_is_internal() -> None:
    for e in (
        ValueError("x"),
        KeyError("k"),
        RuntimeError(),
        errors.ConfigError("a.b", "bad"),
        errors.ListenError("x"),
    ):
        assert code_of(e) is ErrorCode.INTERNAL and grpc_status_of(e) == grpc.StatusCode.INTERNAL


def test_a_code_reads_as_its_name() -> None:
    code = ErrorCode.RESOURCE_EXHAUSTED
    assert str(code) == f"{code}" == "RESOURCE_EXHAUSTED" and code == "RESOURCE_EXHAUSTED"
    e = TransportError("worker: no room", ["a"], code)
    assert e.describe() == "RESOURCE_EXHAUSTED: worker: no room"
    assert TransportError("x", ["a"], "UNAVAILABLE").code is ErrorCode.UNAVAILABLE  # a name is taken as its code


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_errors_pickle_with_their_fields_and_code(cls) -> None:
    e = _instance(cls)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == str(e) and code_of(back) == code_of(e)
    if isinstance(e, FieldError):
        assert (back.field, back.message) == (e.field, e.message)


def test_a_transport_error_pickles() -> None:
    e = TransportError("target: gone", ["a", "b"], ErrorCode.NOT_FOUND, 1)
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.request_ids, back.code, back.item) == ("target: gone", ["a", "b"], ErrorCode.NOT_FOUND, 1)


# ---------------------------------------------------------------- blame
def test_the_blame_parser() -> None:
    assert blamed_item("items[2].seq_len", 3) == 2
    assert blamed_item("items[0]", 1) == 0
    assert blamed_item("items[1].seq_len: is 3; request 'b' holds 4 tokens", 2) == 1  # a remote status's details
    assert blamed_item("items[3].seq_len", 3) is None  # past the call's items: the whole call
    for field in ("items", "items[x].seq_len", "params.items[0]", "worker", ""):
        assert blamed_item(field, 5) is None, field


def test_a_local_call_blames_one_item() -> None:
    def core(items):
        raise errors.NotFound("items[1].request_id", "unknown request 'b'")

    with pytest.raises(TransportError) as ei:
        call_local(core, [_Item("a"), _Item("b"), _Item("c")])
    e = ei.value
    assert (e.code, e.item, e.request_ids) == (ErrorCode.NOT_FOUND, 1, ["b"])
    assert str(e) == "items[1].request_id: unknown request 'b'"


def test_a_local_call_without_an_item_fails_the_whole_call() -> None:
    def core(items):
        raise errors.ResourceExhausted("items", "3 requests need KV slots; 1 are free")

    with pytest.raises(TransportError) as ei:
        call_local(core, [_Item("a"), _Item("b"), _Item("c")])
    assert (ei.value.code, ei.value.item, ei.value.request_ids) == (ErrorCode.RESOURCE_EXHAUSTED, None, ["a", "b", "c"])


def test_error_for_items_reads_field_and_details_alike() -> None:
    local = error_for_items("items[1].x: m", "items[1].x", ErrorCode.INVALID_ARGUMENT, ["a", "b"])
    remote = error_for_items("host:1: items[1].x: m", "items[1].x: m", ErrorCode.INVALID_ARGUMENT, ["a", "b"])
    assert (local.item, local.request_ids) == (remote.item, remote.request_ids) == (1, ["b"])


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _FailingMethod:
    def __init__(self, error: grpc.RpcError):
        self.error = error

    def with_call(self, request, timeout=None, metadata=None):
        raise self.error


class _FailingStub:
    def __init__(self, error: grpc.RpcError):
        self.error = error

    def __getattr__(self, method: str) -> _FailingMethod:
        return _FailingMethod(self.error)


@pytest.mark.parametrize(
    "status, details, item, ids",
    [
        (grpc.StatusCode.FAILED_PRECONDITION, "items[1].seq_len: is 3", 1, ["b"]),
        (grpc.StatusCode.UNAVAILABLE, "worker: the target group failed", None, ["a", "b"]),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", None, ["a", "b"]),
    ],
)
def test_the_remote_transport_types_the_status_it_receives(status, details, item, ids) -> None:
    from specdist.transport.remote import RemoteVerifier

    verifier = RemoteVerifier("127.0.0.1:1", vocab_size=8, timeout_s=1)  # never dialled: the stub is replaced
    try:
        verifier.stub = _FailingStub(_RpcError(status, details))
        with pytest.raises(TransportError) as ei:
            verifier.release(["a", "b"])
        e = ei.value
        assert isinstance(e.code, ErrorCode) and e.code is error_code(status) and grpc_status(e.code) == status
        assert (e.item, e.request_ids) == (item, ids)
        assert str(e) == f"127.0.0.1:1: {details}"
    finally:
        verifier.close()


# ---------------------------------------------------------------- the servers
class _Context:
    """What BlockingCallRunner needs of a grpc.aio context: abort records and raises."""

    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise asyncio.CancelledError  # grpc.aio's abort raises too: the handler ends there

    def set_trailing_metadata(self, metadata):
        pass


@pytest.mark.parametrize(
    "exc, status",
    [
        (errors.NotFound("items[0].request_id", "unknown request 'a'"), grpc.StatusCode.NOT_FOUND),
        (errors.ResourceExhausted("items", "no KV slot"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unavailable("worker", "the target group failed"), grpc.StatusCode.UNAVAILABLE),
        (ValueError("a bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_a_worker_answers_a_core_error_with_its_status(exc, status) -> None:
    from workers.servicing import BlockingCallRunner

    def fn(request):
        raise exc

    runner = BlockingCallRunner("test-errors")
    context = _Context()
    try:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(runner.call(fn, None, context))
    finally:
        runner.close()
    assert context.aborted[0] == status
    assert str(exc) in context.aborted[1]


class _RefusingCoordinator:
    def __init__(self, error: BaseException):
        self.error = error

    def check_room(self, n=1):  # room enough: the refusal comes at admission
        pass

    async def encode(self, prompt, chat=False):
        return prompt

    async def open(self, prompt, params, request_id, chat=False, **kw):
        raise self.error


@pytest.mark.parametrize(
    "error, status, body",
    [
        (
            refusals.Overloaded("9 requests in the system"),
            503,
            {
                "message": "9 requests in the system",
                "type": "server_error",
                "param": None,
                "code": "resource_exhausted",
            },
        ),
        (
            refusals.ShuttingDown("the server is shutting down"),
            503,
            {"message": "the server is shutting down", "type": "server_error", "param": None, "code": "unavailable"},
        ),
        (
            refusals.DuplicateRequestId("r"),
            409,
            {
                "message": "request_id: 'r' is already in use by a running request",
                "type": "server_error",
                "param": None,
                "code": "already_exists",
            },
        ),
        (
            errors.InvalidArgument("max_tokens", "must be >= 1"),
            400,
            {
                "message": "max_tokens: must be >= 1",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": None,
            },
        ),
        (
            RuntimeError("boom"),
            500,
            {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"},
        ),
    ],
)
def test_the_http_api_answers_a_refusal_with_its_status(error, status, body) -> None:
    from specdist.api.http_server import APIError, _Call, _OpenAIFrontEnd

    front = object.__new__(_OpenAIFrontEnd)  # only open() is exercised: no engine behind it
    front.coordinator = _RefusingCoordinator(error)
    call = _Call(chat=False, prompt="hi", params=[SamplingParams()], stream=False, include_usage=False)
    with pytest.raises(APIError) as ei:
        asyncio.run(front.open(call))
    assert ei.value.status == status and ei.value.body() == {"error": body}


def test_refusals_keep_their_code_and_anything_else_is_internal() -> None:
    assert refusal_code(refusals.TargetDown("rebuilding"), "t") is ErrorCode.UNAVAILABLE
    assert refusal_code(refusals.DuplicateRequestId("r"), "t") is ErrorCode.ALREADY_EXISTS
    assert refusal_code(errors.InvalidArgument("prompt", "is empty"), "t") is ErrorCode.INVALID_ARGUMENT
    assert refusal_code(errors.NotFound("request_id", "gone"), "t") is ErrorCode.INTERNAL  # not a refusal
    assert refusal_code(KeyError("x"), "t") is ErrorCode.INTERNAL


def test_bare_host() -> None:
    assert bare_host("[::1]") == "::1" and bare_host("[::]") == "::"
    assert bare_host("127.0.0.1") == "127.0.0.1" and bare_host("::1") == "::1" and bare_host("") == ""
    assert bare_host("[::1") == "[::1"


# ---------------------------------------------------------------- the scheduler decides on codes
class _Item:
    def __init__(self, request_id: str):
        self.request_id = request_id


class _Target:
    """A verifier core whose calls refuse the items of ``bad`` (blaming them as ``items[i]``)
    with ``error``, or fail whole with ``whole``."""

    vocab_size = 16
    is_remote = False
    name = "target"

    def __init__(self, bad: set[str] = frozenset(), error=errors.FailedPrecondition, whole=None):
        self.bad, self.error, self.whole = set(bad), error, whole
        self.calls: list[list[str]] = []
        self.released: list[str] = []

    def _check(self, items) -> None:
        self.calls.append([it.request_id for it in items])
        if self.whole is not None:
            raise self.whole
        for i, it in enumerate(items):
            if it.request_id in self.bad:
                raise self.error(f"items[{i}].seq_len", f"request {it.request_id!r} is refused")

    def prefill(self, items):
        return call_local(
            lambda its: (self._check(its), ([Prefilled(it.request_id) for it in its], CallTiming()))[1], items
        )

    def verify(self, items):
        def run(its):
            self._check(its)
            return [Verified(it.request_id, 0, 5) for it in its], CallTiming()

        return call_local(run, items)

    def release(self, request_ids):
        self.released += list(request_ids)

    def close(self):
        pass


def _scheduler(target) -> Scheduler:
    cfg = load_config(
        {"draft": {"method": "none"}, "engine": {"max_model_len": 32, "max_batch_size": 4, "device": "cpu"}}
    )
    return Scheduler(cfg, target, tokenizer=None)


def test_a_failing_item_is_dropped_and_the_rest_of_the_batch_verified() -> None:
    target = _Target()
    sched = _scheduler(target)
    reqs = [
        sched.add_request(EncodedPrompt(None, [1, 2, 3]), SamplingParams(max_tokens=2, ignore_eos=True))
        for _ in range(3)
    ]
    sched.step()  # admitted and verified once
    target.bad = {reqs[1].core_id}
    target.calls.clear()
    sched.step()
    assert target.calls == [[r.core_id for r in reqs], [reqs[0].core_id, reqs[2].core_id]]  # retried without it
    assert reqs[1].output.finish_reason == "error"
    assert reqs[1].error == f"target: FAILED_PRECONDITION: items[1].seq_len: request {reqs[1].core_id!r} is refused"
    assert [r.output.finish_reason for r in (reqs[0], reqs[2])] == ["length", "length"]
    assert reqs[0].output.token_ids == [5, 5]


def test_a_whole_call_failure_fails_every_request_with_its_code() -> None:
    target = _Target()
    sched = _scheduler(target)
    diagnosed = []
    sched.target_diagnosis = lambda: diagnosed.append(1) or "target rank 1 died"
    reqs = [
        sched.add_request(EncodedPrompt(None, [1, 2]), SamplingParams(max_tokens=4, ignore_eos=True)) for _ in range(2)
    ]
    sched.step()
    target.whole = errors.Unavailable("worker", "the target group failed")
    sched.step()
    assert diagnosed == [1]  # no item blamed: the target was asked what failed
    for r in reqs:
        assert r.error == "target: target rank 1 died (UNAVAILABLE: worker: the target group failed)"


def test_admission_requeues_on_resource_exhausted_and_fails_refused_items() -> None:
    target = _Target(whole=errors.ResourceExhausted("items", "no KV slot"))
    sched = _scheduler(target)
    req = sched.add_request(EncodedPrompt(None, [1, 2]), SamplingParams(max_tokens=2, ignore_eos=True))
    sched.step()
    assert req.queued and not req.finished and req.error is None  # back in the queue: no room is not a failure
    assert target.released == []  # refused before it changed anything: nothing to release
    target.whole = None
    target.bad = {req.core_id}
    target.error = errors.InvalidArgument
    sched.step()
    assert req.output.finish_reason == "error" and req.error.startswith("target: INVALID_ARGUMENT: items[0].seq_len")
    target.bad, target.whole = set(), errors.Unavailable("worker", "down")
    other = sched.add_request(EncodedPrompt(None, [3, 4]), SamplingParams(max_tokens=2, ignore_eos=True))
    sched.step()
    assert other.output.finish_reason == "error"
    assert other.core_id in target.released  # a failure that is not a refusal may have started it: released
