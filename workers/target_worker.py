"""The target worker's gRPC face: ``TargetWorker`` service over a :class:`~specdist.cores.target.VerifierCore`.

The core (the same class the in-process engine calls) does the work; this servicer only
turns the ``specdist.v1`` target messages into the dataclasses of :mod:`specdist.transport.protocol`
and back (:mod:`specdist.transport.wire`), runs every call on the core's one thread, answers
specdist errors with their status (``items[i].field: ...`` names the item to blame) and
returns the core's timing in the trailing metadata. Only rank 0 of a tensor-parallel target
serves it; the other ranks run :meth:`VerifierCore.follow`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from specdist.cores.target import VerifierCore
from specdist.transport.wire import (
    prefilled_to_proto,
    start_items_from_proto,
    verified_to_proto,
    verify_items_from_proto,
)
from specdist.v1 import target_pb2, target_pb2_grpc
from workers.servicing import BlockingCallRunner, core_message_limit


class TargetServicer(target_pb2_grpc.TargetWorkerServicer):
    """grpc.aio servicer over a rank-0 :class:`VerifierCore`."""

    def __init__(
        self, core: VerifierCore, executor: ThreadPoolExecutor | None = None, message_limit: int | None = None
    ):
        """``message_limit``: the largest message its server must pass
        (:mod:`specdist.transport.grpc_host`); by default the core's :func:`core_message_limit`."""
        self.core = core
        self.message_limit = core_message_limit(core) if message_limit is None else message_limit
        self.runner = BlockingCallRunner("target-worker", executor)

    def _prefill(self, msg: target_pb2.PrefillRequest):
        items = start_items_from_proto(msg)
        results, timing = self.core.prefill(items)
        return prefilled_to_proto(results), timing

    def _verify(self, msg: target_pb2.VerifyRequest):
        results, timing = self.core.verify(verify_items_from_proto(msg))
        return verified_to_proto(results), timing

    def _release(self, msg: target_pb2.TargetReleaseRequest):
        self.core.release(list(msg.request_ids))
        return target_pb2.TargetReleaseResponse(), None

    async def Prefill(self, request, context):
        return await self.runner.call(self._prefill, request, context)

    async def Verify(self, request, context):
        return await self.runner.call(self._verify, request, context)

    async def Release(self, request, context):
        return await self.runner.call(self._release, request, context, always_run=True)

    def shutdown(self) -> None:
        """Shut the core down on its own thread (tensor-parallel followers exit), then stop the pool."""
        self.runner.run(self.core.shutdown)
        self.runner.close()
