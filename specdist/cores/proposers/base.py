"""What a draft method is to the drafter core: the :class:`Proposer` interface and the registry of methods.

The :class:`~specdist.cores.draft.DrafterCore` keeps every request's bookkeeping (:class:`DraftRequest`: the
committed tokens, sampling settings, seed, KV slot and last proposal), validates calls and hands out KV slots.
A proposer is one draft method (one module of :mod:`specdist.cores.proposers`) and is called at these points:

- ``start(r)``: a new request; the method sets up its own state of it (``r.state``: an n-gram index, a place in
  a suffix index, an EAGLE-3 head's states);
- ``commit(r, kept, ...)``: the target kept ``kept`` (``r.seq`` already holds them); the method updates its
  state and rolls its KV cache back past what was not kept;
- ``propose(reqs, ks)``: up to ``ks[b]`` tokens after each request's committed sequence, one :class:`Draft`
  each (the tokens, the exact q they were sampled from when not one-hot, their match lengths);
- ``release(r)`` and ``stats()``.

A method that drafts with a model owns the KV cache (``cache``) whose slots the core gives its requests, and
``prefill`` computes the prompts' K/V the core asks for. ``load`` loads what the method drafts with (a model,
a head; from the config's models resolved once, :class:`~specdist.models.metadata.ModelSources`) and ``build``
makes the proposer of a ``draft:`` config section: the one factory of a method.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch

from specdist.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdist.config import DraftConfig
    from specdist.models.kv.base import KVCache
    from specdist.models.kv.options import KVOptions
    from specdist.models.metadata import ModelSources
    from specdist.models.runner import CausalLMRunner
    from specdist.transport.protocol import StartItem


S = TypeVar("S")  # a draft method's own state of a request: what its start() sets


@dataclass
class DraftRequest(Generic[S]):
    """One request on a drafter core (its ``requests``): the core's bookkeeping and the method's ``state``.
    A method names its state in its signatures (``DraftRequest[NgramIndex]``); the core knows none of them."""

    seq: list[int]  # committed tokens (prompt + output)
    params: SamplingParams
    seed: int  # draft_uniform(seed, n) samples the token at position n (gumbel: keys the noise)
    coupling: str = "rejection"  # gumbel: tokens are argmax log q + G, and no q goes to the target
    tenant: str = ""  # whose request it is (StartItem.tenant)
    slot: int | None = None  # methods with a KV cache: the slot holding a prefix of seq (+ stale drafts)
    proposal: list[int] = field(default_factory=list)  # tokens of the last proposal
    state: S | None = None  # the proposer's own state of the request (set by its start; None: it keeps none)


@dataclass
class Draft:
    """One request's proposal, as a proposer makes it."""

    tokens: list[int]  # [n]
    q: torch.Tensor | None = None  # [n, V] fp16-exact rows the tokens were sampled from; None: one-hot rows
    match_lengths: list[int] | None = None  # [n] suffix drafts: the depth of the match each token was read after


@dataclass
class BuildContext:
    """What building a proposer may use besides its ``draft:`` section."""

    vocab_size: int  # the target's vocabulary
    max_batch_size: int
    max_model_len: int
    model: object = None  # what the method's ``load`` returned (a draft model, a head); None for model-free methods
    kv_cache_dtype: str = "auto"  # engine.kv_cache_dtype
    kv: KVOptions | None = None  # the KV cache's layout (engine.kv_cache)


# draft.method name -> the proposer class serving it (filled by @register as each method's module is imported)
PROPOSERS: dict[str, type[Proposer]] = {}


def register(cls: type[Proposer]) -> type[Proposer]:
    """Class decorator: ``cls`` serves the ``draft.method`` names in ``cls.methods``."""
    for name in cls.methods:
        if name in PROPOSERS and PROPOSERS[name] is not cls:
            raise ValueError(f"draft method {name!r} is registered twice ({PROPOSERS[name].__name__}, {cls.__name__})")
        PROPOSERS[name] = cls
    return cls


class Proposer(ABC):
    """One draft method. Not thread-safe: the core calls it one call at a time."""

    # What the method is, read before anything loads (specdist.cores.proposers: check_draft, draft_traits):
    methods: ClassVar[tuple[str, ...]] = ()  # the draft.method names it serves; the first names it in health
    reads_draft_model: ClassVar[bool] = False  # draft.model names what it drafts with (given exactly then)
    model_free: ClassVar[bool] = False  # drafts are lookups without a model pass (proposed before the length choice)
    drafts_ahead: ClassVar[bool] = False  # has draft_ahead (pipelined drafting, specdist.cores.draft_pipeline)
    runs_in_target_dtype: ClassVar[bool] = False  # its model runs in target.dtype (not draft.dtype)
    # its own draft.<key> settings: a dataclass of them with their defaults and a validate(key) (None: none)
    settings: ClassVar[type | None] = None
    shares_prefixes: ClassVar[bool] = True  # requests may share prompt K/V (the core's prefix cache over `cache`)
    vocab_size: int
    cache: KVCache | None = None  # the K/V the core hands out slots of; None: model-free
    runner: CausalLMRunner | None = None  # the model it drafts with, where it is a causal LM
    hidden_layers: tuple[int, ...] = ()  # the target layers whose hidden states it drafts from
    catch_up_s: float = 0.0  # seconds of prompt K/V computed inside the current propose (not draft time)

    @property
    def method(self) -> str:
        return self.methods[0]

    @property
    def hidden_width(self) -> int:
        """Values per position of the target's hidden states it drafts from (0: none)."""
        return 0

    # ------------------------------------------------------------ making one
    @classmethod
    def settings_of(cls, dc: DraftConfig):
        """The method's :attr:`settings` as ``dc`` sets them (the rest at their defaults), validated (ConfigError
        naming the ``draft.`` key); None for a method without settings."""
        if cls.settings is None:
            return None
        from specdist.config import build_section

        names = {f.name for f in dataclasses.fields(cls.settings)}
        own = build_section(cls.settings, {k: v for k, v in dc.settings.items() if k in names}, "draft")
        own.validate("draft")
        return own

    @classmethod
    def target_copy(cls, method: str) -> str | None:
        """The copy of the target (``self-w8``, ``self-w4``: :func:`specdist.models.native.self_draft`) the method
        drafts with, whose prompt K/V are the target's; None: it drafts with no copy of the target."""
        return None

    @classmethod
    def load(
        cls,
        dc: DraftConfig,
        sources: ModelSources,
        dtype: str,
        device,
        target: torch.nn.Module | None = None,
        target_tokenizer=None,
    ) -> object:
        """What the method drafts with, loaded from ``sources`` (the config's models, resolved once) for their
        target (``target``: it loaded, if the caller has it); None: nothing to load."""
        return None

    @classmethod
    def hidden_layers_of(cls, dc: DraftConfig, sources: ModelSources) -> tuple[tuple[int, ...], int]:
        """The target layers whose states the method reads and the values per position, without loading it
        (``sources``: the config's models; a method that reads no states uses nothing of them)."""
        return (), 0

    @classmethod
    @abstractmethod
    def build(cls, dc: DraftConfig, ctx: BuildContext) -> Proposer:
        """The method's proposer for a drafter core (``ctx``: the model ``load`` gave, the sizes, the KV layout)."""

    # ------------------------------------------------------------ calls
    def check_start(self, item: StartItem, field: str) -> None:
        """Refuse a start item this method cannot serve (``field``: the item's name in errors)."""

    def start(self, r: DraftRequest) -> None:
        """Set up the method's state of a new request (``r.seq``: its prompt; ``r.slot``: its K/V slot)."""

    def prefill(self, reqs: list[DraftRequest]) -> None:
        """Compute the K/V of each request's prompt but its last token from what its slot holds."""

    def check_propose(self, r: DraftRequest, hidden: torch.Tensor | None, seq_len: int, field: str) -> None:
        """Refuse what a propose item brings for ``r`` (``hidden``: the target's states) before anything changes."""

    def commit(
        self,
        r: DraftRequest,
        kept: list[int],
        n_acc: int,
        prev: int,
        prepared: list[int] | None,
        hidden: torch.Tensor | None,
    ) -> None:
        """The target kept ``n_acc`` tokens of the last proposal and then its own: ``kept``, appended to
        ``r.seq`` after its first ``prev`` tokens. ``prepared``: drafts after that sequence the cache already
        holds (a pipelined preparation that held). ``hidden``: the target's states of the committed positions."""

    @abstractmethod
    def propose(self, reqs: list[DraftRequest], ks: list[int]) -> list[Draft]:
        """At most ``ks[b]`` tokens after each request's committed sequence (k = 0: none)."""

    def release(self, r: DraftRequest) -> None:
        """The request ended (its slot is the core's to free)."""

    def forget_finished(self) -> None:
        """Forget what finished requests left (a suffix index's cached sequences); most methods keep nothing."""

    def index_stats(self) -> dict[str, int] | None:
        """A draft index's size (suffix drafts), None without one."""
        return None

    def stats(self) -> dict:
        """What the method adds to the core's health."""
        return {}
