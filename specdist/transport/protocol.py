"""What the scheduler and its drafters / verifier exchange: typed batches, results, one error type.

The scheduler (:mod:`specdist.engine.scheduler`) talks to one :class:`Verifier` (the target) and a
list of :class:`Drafter` replicas. Each has two transports: local (direct calls on the cores
of :mod:`specdist.cores.target` and :mod:`specdist.cores.draft`, in this process) and remote (gRPC
stubs to the workers that host the same cores, :mod:`specdist.transport.remote`). Both move these
dataclasses; the gRPC servicers convert them to and from protobuf (:mod:`specdist.transport.wire`).

A request lives on a core under a ``request_id`` chosen by the scheduler. Its life:

    verifier.prefill([StartItem])   drafter.start([StartItem])           (admission) -> [Prefilled]
    drafter.propose([ProposeItem])  -> [Proposal]                         (per step, k > 0)
    verifier.verify([VerifyItem])   -> [Verified]                         (per step)
    verifier.release([id])          drafter.release([id])                (finish / abort)

Every call is all or nothing: the core validates the whole batch before it changes any
state. A failure raises :class:`TransportError` carrying the request ids it concerns (one
item, or the whole call when no item is to blame); the scheduler decides what that means.

A request's seeds and the uniforms they key (the verifier gets the seed, the drafter
:func:`~specdist.randomness.draft_seed` of it) are :mod:`specdist.randomness`; the checks the cores
make on a call's items are :mod:`specdist.transport.checks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from specdist.errors import ErrorCode, FieldError, SpecDistError, blamed_item
from specdist.logprobs import TokenLogprob
from specdist.sampling_params import SamplingParams


# ---------------------------------------------------------------- batches and results
@dataclass
class StartItem:
    """Admit a request: the verifier prefills it, a drafter starts it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: (
        int  # the uniforms' seed on the core that receives it (drafters: specdist.randomness.draft_seed(request seed))
    )
    coupling: str = "rejection"  # how drafts are decided (specdist.config.COUPLINGS); both cores get the same
    # target layers whose input hidden states the verifier returns for this request (an EAGLE-3 drafter
    # reads them, specdist.cores.draft); () none. Must be the layers the target keeps (runner.hidden_layers)
    hidden_layers: tuple[int, ...] = ()
    # who the request belongs to (specdist.transport.security.tenant_of; "" one tenant): the cores share state
    # across requests (the suffix index; the prefix cache where configured) only within a tenant
    tenant: str = ""


@dataclass
class Prefilled:
    """What the verifier's prefill returns per request."""

    request_id: str
    # with StartItem.hidden_layers: [n - 1, len(layers) * D] the hidden states at the prompt's positions
    # 0 .. n-2 (every prompt token but the last, which goes into the first verification), on the target's device
    hidden: torch.Tensor | None = None


@dataclass
class ProposeItem:
    """Draft for one request, after committing what the target emitted since its last proposal."""

    request_id: str
    num_accepted: int  # tokens of the drafter's previous proposal that the target accepted
    new_token_ids: list[int]  # tokens the target emitted after those (one per step since then)
    num_tokens: int  # draft length k_b for this step (0: commit only)
    seq_len: int  # tokens the request holds once that is committed (a consistency check)
    preferred_format: int = 0  # wire encoding the caller prefers for q (DistributionFormat; 0: any)
    # EAGLE-3 drafters: [m, len(layers) * D] the target's hidden states at the positions committed since the
    # last proposal whose states the drafter has not had (the prompt's, then each step's, in order): after this
    # item's tokens are committed the drafter holds states for every position of the sequence but the last
    hidden: torch.Tensor | None = None


@dataclass
class Proposal:
    """The drafted tokens and the exact distributions they were sampled from.

    ``q`` and ``wire`` are two encodings of the same distributions (bit for bit): ``q`` as a
    tensor, ``wire`` as the ``DraftDistribution`` messages a remote drafter sent. Neither set
    means every q row is one-hot on its token (greedy requests, n-gram drafts).
    """

    request_id: str
    token_ids: list[int]  # [n]
    q: torch.Tensor | None = (
        None  # [n, V] float32, fp16-exact rows (specdist.transport.wire.fp16_exact), drafter's device
    )
    wire: list | None = None  # n DraftDistribution messages, forwarded to a remote verifier as they came
    pipeline: str | None = None  # pipelined drafter: HIT (prepared during the last verify) or MISS; None: not prepared
    # [n] per token, the length of the earlier text's context it continues (a suffix draft: the depth of the
    # matched suffix it was read after); the length rule prices positions by it. None: no such measure
    match_lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> "Proposal":
        """The first ``n`` drafts (a prefix of a proposal is one: each draft depends only on those before it)."""
        if n >= len(self.token_ids):
            return self
        return replace(
            self,
            token_ids=self.token_ids[:n],
            q=self.q[:n] if self.q is not None else None,
            wire=self.wire[:n] if self.wire is not None else None,
            match_lengths=self.match_lengths[:n] if self.match_lengths is not None else None,
        )


@dataclass
class VerifyItem:
    request_id: str
    seq_len: int  # tokens the request holds (prompt + output) before this step
    proposal: Proposal | None = None  # None: no drafts this step (the target emits one token)


@dataclass
class Verified:
    request_id: str
    num_accepted: int  # leading draft tokens accepted
    next_token: int  # the residual or bonus token sampled after them
    # params.logprobs set: one per emitted token (the accepted drafts, then next_token); else None
    logprobs: list[TokenLogprob] | None = None
    # StartItem.hidden_layers set: [num_accepted + 1, len(layers) * D] the hidden states at the positions this
    # step fed and kept (the sequence's last token before it, then the accepted drafts); else None
    hidden: torch.Tensor | None = None


HIT, MISS = "hit", "miss"  # Proposal.pipeline


@dataclass
class CallTiming:
    """Seconds a core spent on one call, by phase ("forward", "sampling", "draft", ...).

    ``hidden_s``: seconds of background drafting (:mod:`specdist.cores.draft_pipeline`) for this call's
    requests that ran before the call arrived, i.e. under the previous verification; not part
    of the call's wall time. ``runs``: the draft compute behind the call, run by run.
    """

    phases: dict[str, float] = field(default_factory=dict)
    hidden_s: float = 0.0
    # pipelined drafting: (passes, rows, seconds) of each draft run the core finished for this call
    # (the preparation it used, drafting inside the call), for the draft-cost fits
    runs: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.phases.values())


class TransportError(SpecDistError):
    """A drafter or verifier call failed for ``request_ids`` (all of the call's when none is named).

    ``code`` is the failure's :class:`~specdist.errors.ErrorCode` (a core's error code, or the
    status a remote call received); ``item`` is the index of the one item the core blamed, or None.
    """

    def __init__(
        self,
        message: str,
        request_ids: Sequence[str],
        code: ErrorCode | str = ErrorCode.INTERNAL,
        item: int | None = None,
    ):
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.code = ErrorCode(code)
        self.item = item

    def describe(self) -> str:
        """``"CODE: message"``, as requests that failed with it report it."""
        return f"{self.code}: {self}"

    def __reduce__(self):
        return (type(self), (str(self), self.request_ids, self.code, self.item))


# ---------------------------------------------------------------- the interfaces
class Verifier(Protocol):
    vocab_size: int
    is_remote: bool

    def prefill(self, items: list[StartItem]) -> tuple[list[Prefilled], CallTiming]: ...

    def verify(self, items: list[VerifyItem]) -> tuple[list[Verified], CallTiming]: ...

    def release(self, request_ids: list[str]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DraftTraits:
    """What the scheduler plans by, of the draft method its drafters serve
    (:func:`specdist.cores.proposers.draft_traits` reads them off the method's proposer)."""

    model_free: bool = False  # drafts are lookups without a model pass: proposed before the length choice
    pipelined: bool = False  # drafters prepare each request's next drafts while the target verifies
    sampled_lengths: bool = False  # a draft's length depends on its own samples (a confidence threshold)


class Drafter(Protocol):
    name: str
    is_remote: bool
    hidden_layers: tuple[int, ...]  # target layers whose hidden states it drafts from (EAGLE-3); () none

    def start(self, items: list[StartItem]) -> CallTiming: ...

    def propose(self, items: list[ProposeItem]) -> tuple[list[Proposal], CallTiming]: ...

    def release(self, request_ids: list[str]) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- errors, and cores in this process
def error_for_items(message: str, blame: str, code: ErrorCode, request_ids: Sequence[str]) -> TransportError:
    """A failed call as a TransportError: the item ``blame`` names (:func:`~specdist.errors.blamed_item`:
    a core's field, or the details a remote core sent), or the whole call."""
    item = blamed_item(blame, len(request_ids))
    return TransportError(message, [request_ids[item]] if item is not None else request_ids, code, item)


def call_local(fn, items: list):
    """Call a core in this process; its field errors become TransportErrors, as over gRPC."""
    try:
        return fn(items)
    except FieldError as e:
        raise error_for_items(str(e), e.field, e.code, [it.request_id for it in items]) from None


class LocalTransport:
    """A core in this process behind the transport interface: direct calls, errors as over gRPC."""

    is_remote = False

    def __init__(self, core, name: str):
        self.core = core
        self.name = name

    def release(self, request_ids: list[str]) -> None:
        self.core.release(request_ids)

    def close(self) -> None:
        pass
