"""Transport calls as the scheduler makes them, and the releases it still owes a core.

:func:`call_isolating` makes one call of a batch: a failure that blames one item
(:data:`PER_ITEM_CODES`: a bad or stale item) drops that item and the rest is retried, so one
request cannot fail its batch. :class:`PendingReleases` keeps, for one core, the request ids whose
``release`` failed (a worker briefly down, a call past its deadline: the core may still hold their
slots) and releases them again in one call once due, backing off from ``RELEASE_RETRY_FIRST_S`` to
``RELEASE_RETRY_MAX_S``, until the core answers or refuses them (NOT_FOUND: already gone).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from specdist.clock import now
from specdist.errors import ErrorCode
from specdist.transport.protocol import CallTiming, TransportError

log = logging.getLogger(__name__)

# a failed release is retried after 0.1 s, backing off x2 to 10 s (a down worker is not hammered)
RELEASE_RETRY_FIRST_S, RELEASE_RETRY_MAX_S = 0.1, 10.0
# a core refused the item it blamed (a bad or stale item): the rest of the call can be retried without it
PER_ITEM_CODES = frozenset(
    {ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND, ErrorCode.FAILED_PRECONDITION, ErrorCode.ALREADY_EXISTS}
)
REFUSED_CODES = PER_ITEM_CODES | {ErrorCode.RESOURCE_EXHAUSTED}  # the core refused the call before changing state

# (method, items) -> (results or None, {index: its TransportError}, the core's timing, wall seconds)
Call = Callable[[Callable, list], tuple]


def per_item(failed) -> bool:
    """Whether any of the failures (TransportErrors) was a per-item refusal."""
    return any(e.code in PER_ITEM_CODES for e in failed)


def call_isolating(method, items: list, count: Callable[[], None] = lambda: None):
    """``method(items)``; a failure blaming one item drops that item and retries the rest.

    Returns (results or None, {index: its TransportError}, the core's timing, wall seconds).
    A failure naming no single item fails every remaining item. ``count()`` is called once per
    call made (the scheduler's ``stats.calls``).
    """
    idx = list(range(len(items)))
    failed: dict[int, TransportError] = {}
    t0 = now()
    while idx:
        count()
        try:
            out = method([items[i] for i in idx])
        except TransportError as e:
            if e.item is not None and e.code in PER_ITEM_CODES and e.item < len(idx):
                failed[idx.pop(e.item)] = e
                continue
            if e.item is not None and e.code == ErrorCode.RESOURCE_EXHAUSTED and 0 < e.item < len(idx):
                # out of room from the item it names on (a core's check_room): the ones before it fit, and are
                # retried alone; failing them too would requeue every request of a cache that holds some of them
                for i in idx[e.item :]:
                    failed[i] = e
                idx = idx[: e.item]
                continue
            for i in idx:
                failed[i] = e
            return None, failed, CallTiming(), now() - t0
        results, timing = out if isinstance(out, tuple) else (None, out)
        return results, failed, timing, now() - t0
    return None, failed, CallTiming(), now() - t0


@dataclass
class PendingReleases:
    """The core ids whose release failed on one core, which may still hold their slots: released again
    (one call) once ``due``, backing off from RELEASE_RETRY_FIRST_S to RELEASE_RETRY_MAX_S. Safe from
    any thread (a detach on the propose pool, a probe's answer)."""

    ids: set[str] = field(default_factory=set)
    due: float = 0.0
    backoff: float = 0.0
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def add(self, ids, t: float) -> None:
        with self.lock:
            if not self.ids:  # the first of a run of failures: retry soon
                self.backoff = RELEASE_RETRY_FIRST_S
                self.due = t + self.backoff
            self.ids.update(ids)

    def answered(self, gone, t: float) -> None:
        """The core released (or did not know) ``gone``."""
        with self.lock:
            self.ids.difference_update(gone)
            self.backoff = RELEASE_RETRY_FIRST_S
            self.due = t

    def failed(self, t: float) -> None:
        with self.lock:
            self.backoff = min(RELEASE_RETRY_MAX_S, 2 * max(self.backoff, RELEASE_RETRY_FIRST_S / 2))
            self.due = t + self.backoff

    def clear(self) -> None:
        with self.lock:
            self.ids.clear()
            self.backoff = self.due = 0.0

    def release(self, transport, ids: list[str], call: Call) -> None:
        """Release ``ids`` on the core ``transport`` reaches. Those whose release failed (not refused: a
        worker down, a deadline) are kept here and released again later (:meth:`retry`)."""
        _, failed, _, _ = call(transport.release, ids)
        kept = [ids[j] for j, e in failed.items() if e.code not in PER_ITEM_CODES]
        if kept:
            e = next(e for e in failed.values() if e.code not in PER_ITEM_CODES)
            log.warning(
                "%s: release of %d requests failed (%s); retried later (they may hold slots there)",
                transport.name,
                len(kept),
                e.describe(),
            )
            self.add(kept, now())

    def retry(self, transport, call: Call, force: bool = False) -> None:
        """Release the kept ids again in one call, if due (``force``: now)."""
        if not self.ids or not (force or now() >= self.due):
            return
        sent = sorted(self.ids)
        _, failed, _, _ = call(transport.release, sent)
        t = now()
        down = [e for e in failed.values() if e.code not in PER_ITEM_CODES]
        with self.lock:
            # released, or refused (NOT_FOUND: the core does not hold them): nothing left to free
            gone = [rid for j, rid in enumerate(sent) if j not in failed or failed[j].code in PER_ITEM_CODES]
            if gone:
                self.answered(gone, t)
            if down:
                self.failed(t)
        if down:
            log.info(
                "%s: release of %d requests failed again (%s); next try in %.1f s",
                transport.name,
                len(self.ids),
                down[0].describe(),
                self.backoff,
            )
        else:
            log.info("%s: released %d requests whose release had failed", transport.name, len(sent))
