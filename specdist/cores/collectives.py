"""A tensor-parallel target's rank 0 and its followers kept in step, and the bounds on its collectives.

:class:`VerifierCore` (:mod:`specdist.cores.target`) verifies; a :class:`Replicator` beside it carries
what tensor parallelism adds (``world_size > 1``). Only rank 0 is called. Cache operations that need
no collective (allocate, free, rollback) are applied on rank 0 at once and queued (:meth:`~Replicator.local`,
:meth:`~Replicator.record`); right before every forward rank 0 broadcasts ``queued ops + the forward``
with the ``broadcast`` function it was given (and the queued ops alone when its last request is
released, :meth:`~Replicator.flush`, so an idle group holds no slot), and ranks > 0, inside
:meth:`~Replicator.follow`, replay them in the same order on their shard. At every forward (where the
all-reduces happen) every rank's cache bookkeeping is therefore identical. :meth:`~Replicator.shutdown`
flushes the queue and ends the followers' loops. With ``world_size == 1`` nothing is queued or sent.

Collective timeouts: a rank that died makes the others' collectives fail at once (the connection
closes); a rank that hangs would hold them until the process group's timeout. :class:`CollectiveDeadline`
sizes that timeout to the measured forwards (at least ``collective_timeout_s``, else ``COLLECTIVE_FACTOR``
times the time the coming forward is expected to take). Rank 0 sets it with the ``set_timeout`` function
it was given and sends it ahead of the forward (op ``("timeout", seconds)``), so every rank waits the
same. A collective that fails on rank 0 marks the group broken (:attr:`Replicator.broken`): later calls
fail at once (UNAVAILABLE), since the group cannot be trusted after a failed collective; the deployment
rebuilds it.

Hangs outside a collective (rank 0's own thread stuck in a call, while the process still answers Ray's
health call on another thread): every call records when it began and the bound it gets from the same
measurements (``deadline.timeout_for`` its tokens, so at least ``collective_timeout_s``,
:meth:`~Replicator.watched`); :meth:`~Replicator.hung` names a call past its bound (``hung in verify for
41 s, bound 10 s``), which the core's health reports as broken, and the deployment's supervisor rebuilds
the group as for any broken rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from specdist.clock import now
from specdist.errors import Unavailable
from specdist.models.runner import CausalLMRunner

COLLECTIVE_FACTOR = 20.0  # a collective may wait this many times its forward's expected time
SMALL_FORWARD_TOKENS = 8  # forwards of at most this many tokens cost about their fixed overhead


class CollectiveDeadline:
    """The timeout a tensor-parallel forward's collectives get, from the forwards measured so far
    (and the bound of a call's time on rank 0, past which the call is reported hung).

    Expected seconds of a forward of ``n`` tokens: ``overhead + rate * n``, where ``overhead`` is
    the slowest forward of at most ``SMALL_FORWARD_TOKENS`` tokens and ``rate`` the highest seconds
    per token of a larger one (before any: ``overhead / SMALL_FORWARD_TOKENS``). Both only grow,
    so the timeout errs long. Timeout: ``max(floor_s, COLLECTIVE_FACTOR * expected)``.
    """

    def __init__(self, floor_s: float):
        self.floor_s = float(floor_s)
        self.overhead = 0.0
        self.rate = 0.0

    def timeout_for(self, n_tokens: int) -> float:
        rate = self.rate or self.overhead / SMALL_FORWARD_TOKENS
        return max(self.floor_s, COLLECTIVE_FACTOR * (self.overhead + rate * n_tokens))

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= SMALL_FORWARD_TOKENS:
            self.overhead = max(self.overhead, seconds)
        else:
            self.rate = max(self.rate, seconds / n_tokens)


def apply_op(runner: CausalLMRunner, op: tuple, extra=None) -> Any:
    """Apply one forward or cache operation (:meth:`KVCache.apply`); the same code on every
    tensor-parallel rank. ``extra``: rank 0's sampling inputs for the forward's copy (runner.forward)."""
    if op[0] == "forward":  # ("forward", slots, tokens, num_logits[, packed])
        return runner.forward(op[1], op[2], op[3], packed=len(op) > 4 and op[4], extra=extra)
    if op[0] == "shutdown":
        return None
    return runner.cache.apply(op)


class Replicator:
    """One rank's side of a tensor-parallel target (or of a target alone, ``world_size == 1``): the ops
    it applies and sends its followers (rank 0) or replays (ranks > 0), the collective timeout, the
    failed group, the call running. Not thread-safe, except :meth:`hung`."""

    def __init__(
        self,
        runner: CausalLMRunner,
        rank: int = 0,
        world_size: int = 1,
        broadcast: Callable[[Any], Any] | None = None,
        set_timeout: Callable[[float], None] | None = None,
        collective_timeout_s: float = 10.0,
    ):
        if world_size > 1 and broadcast is None:
            raise ValueError("a tensor-parallel verifier needs a broadcast function")
        self.runner = runner
        self.rank, self.world_size = rank, world_size
        self._broadcast = broadcast
        self._set_timeout = set_timeout  # (seconds) -> None: this rank's collective timeout
        self.pending: list[tuple] = []  # ops applied on rank 0, not yet sent to the followers
        self.deadline = CollectiveDeadline(collective_timeout_s)
        self.timeout_s = 0.0  # the collective timeout in force (0: the process group's own)
        self.broken: str | None = None  # why the tensor-parallel group failed (rank 0)
        self._running: tuple[str, float, float] | None = None  # the call running: (name, began at, bound in s)

    # ------------------------------------------------------------ rank 0
    def local(self, op: tuple) -> Any:
        """A collective-free op: apply now, replay on the followers before the next forward."""
        out = apply_op(self.runner, op)
        self.record(op)
        return out

    def record(self, op: tuple) -> None:
        """An op applied on rank 0: the followers replay it before the next forward."""
        if self.world_size > 1:
            self.pending.append(op)

    def forward(
        self, slots: list[int], tokens: list[list[int]], num_logits: list[int], packed: bool = False, extra=None
    ) -> torch.Tensor:
        """``runner.forward`` on every rank (the queued ops first), timed for the deadline."""
        op = ("forward", slots, tokens, num_logits, packed)
        n = sum(len(t) for t in tokens)
        if self.world_size == 1:
            t0 = now()
            out = apply_op(self.runner, op, extra)
            self.deadline.observe(n, now() - t0)
            return out
        ops = self.pending + [op]
        timeout = self.deadline.timeout_for(n)
        # raise it for a larger forward; lower it only when it is over twice what is needed
        if self._set_timeout is not None and not timeout <= self.timeout_s <= 2 * timeout:
            self._set_timeout(timeout)
            self.timeout_s = timeout
            ops.insert(0, ("timeout", timeout))
        t0 = now()
        self.pending = []
        out = self._collective(lambda: (self._broadcast(ops), apply_op(self.runner, op, extra))[1])
        self.deadline.observe(n, now() - t0)
        return out

    def flush(self) -> None:
        """Send the queued ops alone (rank 0 going idle: the followers free their slots now too)."""
        if self.pending:
            ops, self.pending = self.pending, []
            self._collective(lambda: self._broadcast(ops))

    def shutdown(self) -> None:
        """Flush the queued ops and release the followers from :meth:`follow`."""
        if self.world_size > 1:
            self._broadcast(self.pending + [("shutdown",)])
            self.pending = []

    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (broadcasts, a forward); a failed or timed-out collective breaks the group."""
        try:
            return fn()
        except RuntimeError as e:  # the group cannot be trusted after a failed collective
            self.broken = f"tensor-parallel collective failed: {e}"
            raise Unavailable("worker", self.broken) from None

    @contextmanager
    def watched(self, name: str, n_tokens: int) -> Iterator[None]:
        """Record the call running (for :meth:`hung`) and its bound: that of a forward of ``n_tokens``."""
        self._running = (name, now(), self.deadline.timeout_for(n_tokens))
        try:
            yield
        finally:
            self._running = None

    def hung(self) -> str | None:
        """Why the call running is taken for hung (it has run past its bound), or None. Safe from any thread."""
        running = self._running
        if running is None:
            return None
        name, began, bound = running
        busy = now() - began
        return f"hung in {name} for {busy:.0f} s, bound {bound:.0f} s" if busy > bound else None

    # ------------------------------------------------------------ ranks > 0
    def follow(self, replay: Callable[[tuple], Any]) -> int:
        """Replay rank 0's operations until it shuts down: forwards here, cache operations through
        ``replay`` (the core's kept prefixes see them too). Returns the forwards run."""
        if self.rank == 0:
            raise RuntimeError("follow() is for ranks > 0")
        forwards = 0
        while True:
            for op in self._broadcast(None):
                if op[0] == "timeout":
                    if self._set_timeout is not None:
                        self._set_timeout(op[1])
                    continue
                if op[0] in ("forward", "shutdown"):
                    apply_op(self.runner, op)
                else:  # a cache operation, the kept prefixes' too
                    replay(op)
                if op[0] == "forward":
                    forwards += 1
                elif op[0] == "shutdown":
                    return forwards
