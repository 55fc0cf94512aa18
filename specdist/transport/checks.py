"""The checks both cores make on a call's items before they change any state.

A core (:mod:`specdist.cores.target`, :mod:`specdist.cores.draft`, in this process or in a worker)
validates the whole batch of a call first, so that every call is all or nothing
(:mod:`specdist.transport.protocol`). Each error is a :class:`~specdist.errors.FieldError` naming the
item's field (``items[i].request_id``), which the transports turn into a TransportError blaming that
item.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence

from specdist.errors import FailedPrecondition, InvalidArgument


def check_request_ids(ids: Sequence[str], field: str = "items") -> None:
    """Non-empty and distinct within one call."""
    seen: set[str] = set()
    for i, rid in enumerate(ids):
        if not rid:
            raise InvalidArgument(f"{field}[{i}].request_id", "must be non-empty")
        if rid in seen:
            raise InvalidArgument(f"{field}[{i}].request_id", f"duplicate request id {rid!r} in one call")
        seen.add(rid)


class ReleasedUnknown:
    """Ids a core was told to release while it did not hold them (the newest ``capacity``).

    A start or prefill can reach a core after its caller gave up on it: the worker was stopped or
    slow, the call's deadline passed, and the scheduler released the id (its release may overtake
    the call: another connection, another server thread). Started then, the request would hold a
    KV slot that nothing releases again. The scheduler gives every admission a fresh id, so a start
    of an id released before is always such a late call, and the core refuses it.
    """

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def refuse(self, ids: Sequence[str], field: str = "items") -> None:
        """FailedPrecondition naming the first of ``ids`` that was released before it started."""
        for i, rid in enumerate(ids):
            if rid in self._ids:
                raise FailedPrecondition(
                    f"{field}[{i}].request_id", f"request {rid!r} was released before it started (a late call)"
                )


def check_token_ids(ids, vocab_size: int, field: str) -> list[int]:
    """``ids`` as ints, each inside the vocabulary [0, vocab_size)."""
    out = [operator.index(t) for t in ids]
    for t in out:
        if not 0 <= t < vocab_size:
            raise InvalidArgument(field, f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return out


def check_prompt(ids, vocab_size: int, max_model_len: int, field: str) -> list[int]:
    """:func:`check_token_ids`, non-empty, and leaving room for one generated token in ``max_model_len``."""
    out = check_token_ids(ids, vocab_size, field)
    if not out:
        raise InvalidArgument(field, "is empty")
    if len(out) >= max_model_len:
        raise InvalidArgument(field, f"has {len(out)} tokens; the context limit is {max_model_len} (prompt + output)")
    return out
