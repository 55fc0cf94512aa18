"""The draft worker's gRPC face: ``DraftWorker`` service over a :class:`~specdist.cores.draft.DrafterCore`.

The core (the same class the in-process engine calls) does the work; this servicer only
turns the ``specdist.v1`` draft messages into the dataclasses of :mod:`specdist.transport.protocol`
and back (:mod:`specdist.transport.wire`), runs every call on the core's one thread, answers specdist
errors with their status and returns the core's timing in the trailing metadata.

Distribution formats (``DraftDistribution`` in common.proto), chosen per draft token by
:func:`specdist.transport.wire.proposal_to_proto`: one-hot q (n-gram drafts, greedy requests, a
sampled q of one point) as ONE_HOT with no payload; otherwise the fp16-exact q the draft
sampled from, as SPARSE_FP16 when under ``SPARSE_MAX_FRACTION`` of the vocabulary is
nonzero, else DENSE_FP16, or the caller's ``preferred_format``. Each represents that q
exactly, so the target verifies against the very distribution the token came from.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from specdist.cores.draft import DrafterCore
from specdist.transport.wire import proposal_to_proto, propose_items_from_proto, start_items_from_proto
from specdist.v1 import draft_pb2, draft_pb2_grpc
from workers.servicing import BlockingCallRunner, core_message_limit


class DraftServicer(draft_pb2_grpc.DraftWorkerServicer):
    """grpc.aio servicer over a :class:`DrafterCore`; blocking calls run on one thread."""

    def __init__(self, core: DrafterCore, executor: ThreadPoolExecutor | None = None, message_limit: int | None = None):
        """``message_limit``: the largest message its server must pass
        (:mod:`specdist.transport.grpc_host`); by default the core's :func:`core_message_limit`."""
        self.core = core
        self.message_limit = core_message_limit(core) if message_limit is None else message_limit
        self.runner = BlockingCallRunner("draft-worker", executor)

    def _start(self, msg: draft_pb2.StartRequest):
        items = start_items_from_proto(msg)
        timing = self.core.start(items)
        return draft_pb2.StartResponse(request_ids=[it.request_id for it in items]), timing

    def _propose(self, msg: draft_pb2.ProposeRequest):
        items = propose_items_from_proto(msg)
        proposals, timing = self.core.propose(items)
        vocab = self.core.vocab_size
        out = draft_pb2.ProposeResponse(
            proposals=[proposal_to_proto(p, vocab, it.preferred_format) for p, it in zip(proposals, items)]
        )
        return out, timing

    def _release(self, msg: draft_pb2.DraftReleaseRequest):
        self.core.release(list(msg.request_ids))
        return draft_pb2.DraftReleaseResponse(), None

    async def Start(self, request, context):
        return await self.runner.call(self._start, request, context)

    async def Propose(self, request, context):
        return await self.runner.call(self._propose, request, context)

    async def Release(self, request, context):
        return await self.runner.call(self._release, request, context, always_run=True)

    def shutdown(self) -> None:
        self.runner.close()
