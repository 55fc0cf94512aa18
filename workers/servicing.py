"""What the target and draft servicers share: one thread for the core, errors as gRPC statuses,
and the message limit of the server a worker serves them on (:mod:`specdist.transport.grpc_host`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdist.errors import SpecDistError
from specdist.transport.grpc_status import grpc_status_of
from specdist.transport.protocol import CallTiming
from specdist.transport.remote import timing_metadata
from specdist.transport.wire import MAX_DRAFT_TOKENS, message_limit_bytes


def core_message_limit(core, max_draft_tokens: int = MAX_DRAFT_TOKENS) -> int:
    """:func:`~specdist.transport.wire.message_limit_bytes` for a core's vocabulary and batch (its KV slots).

    ``max_draft_tokens``: the deployment's ``draft.num_speculative_tokens`` where the host knows
    it, else the most a config allows. A core without a KV cache (n-gram and suffix drafts) ships
    one-hot q only, so one item's worth bounds its messages. Cores that send or take the target's
    hidden states (EAGLE-3) add a whole context's worth of them per item."""
    cache = core.cache
    return message_limit_bytes(
        core.vocab_size,
        cache.num_slots if cache is not None else 1,
        max_draft_tokens,
        core.hidden_width,
        core.max_model_len,
    )


class BlockingCallRunner:
    """Runs a core's blocking calls on ONE thread (models and collectives are not thread-safe).

    ``fn(request)`` returns ``(response, CallTiming or None)``; the timing goes back in the
    trailing metadata. specdist errors become their code's status (:mod:`specdist.transport.grpc_status`),
    anything else INTERNAL.
    """

    def __init__(self, name: str, executor: ThreadPoolExecutor | None = None):
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable, request, context, always_run: bool = False):
        """``always_run``: the call runs even when its caller is gone (cancelled or past its
        deadline) before its turn on the core's thread: a Release must free what it names. Other
        calls still waiting for the thread are dropped with their caller (they have not changed
        anything yet)."""
        loop = asyncio.get_running_loop()
        try:
            if always_run:
                job = asyncio.wrap_future(self.executor.submit(fn, request))
                response, timing = await asyncio.shield(job)
            else:
                response, timing = await loop.run_in_executor(self.executor, fn, request)
        except SpecDistError as e:
            await context.abort(grpc_status_of(e), str(e))
        except Exception as e:  # a bug or a broken model: say so instead of hanging the caller
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        if isinstance(timing, CallTiming) and timing.phases:
            context.set_trailing_metadata(timing_metadata(timing))
        return response

    def run(self, fn: Callable, *args):
        """Run ``fn`` on the core's thread from outside gRPC (warm-up, shutdown) and wait."""
        return self.executor.submit(fn, *args).result()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
