"""Draft methods, one module each, registered by the ``draft.method`` names they serve.

Each module defines a :class:`~specdist.cores.proposers.base.Proposer` subclass decorated with
:func:`~specdist.cores.proposers.base.register`: ``model`` (a draft model and the target's own low-precision
copies, ``self-w8`` / ``self-w4``), ``ngram`` (prompt lookup), ``suffix`` (SuffixDecoding), ``hybrid`` (the
suffix index or the target's int8 copy, per request and step) and ``eagle3`` (an EAGLE-3 head). A new method is
a new module here: :func:`proposer_class` imports every module of this package the first time it is asked.

What the rest of the system needs of a method it reads off the method's class, never off a list of names:
:func:`check_draft` (the ``draft:`` section against the registry: the config sits below the methods),
:func:`draft_traits` (what the scheduler plans by), :func:`draft_dtype` and :func:`target_copy`. A process that
serves a config checks its section once, :func:`resolve_draft`, and passes the :class:`ResolvedDraft` on.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdist.cores.proposers.base import PROPOSERS, Proposer
from specdist.errors import ConfigError
from specdist.transport.protocol import DraftTraits

if TYPE_CHECKING:
    from specdist.config import Config, DraftConfig

_discovered = False


def proposer_class(method: str) -> type[Proposer]:
    """The proposer serving ``draft.method`` ``method`` (ConfigError naming draft.method if none does)."""
    _discover()
    cls = PROPOSERS.get(method)
    if cls is None:
        raise ConfigError("draft.method", f"no draft method {method!r}; there are {', '.join(sorted(PROPOSERS))}")
    return cls


def proposer_methods() -> tuple[str, ...]:
    """Every registered ``draft.method`` name, sorted."""
    _discover()
    return tuple(sorted(PROPOSERS))


def check_draft(dc: DraftConfig) -> type[Proposer] | None:
    """What :func:`~specdist.config.load_config` cannot check of a ``draft:`` section (the methods sit above the
    config): that a registered method serves ``draft.method``, that ``draft.model`` is given exactly when the
    method drafts with it, that every other key is some method's own setting, and the method's settings' values.
    One-line ConfigErrors naming the key. The proposer class, None for method ``none``. Everything that serves
    a config calls it before anything loads (the engines, the serving assembly, the deployment, a draft actor)."""
    _discover()
    own = {f.name for cls in PROPOSERS.values() if cls.settings is not None for f in dataclasses.fields(cls.settings)}
    for key in dc.settings:
        if key not in own:
            shared = {f.name for f in dataclasses.fields(dc)} - {dc.EXTRA_KEYS}
            raise ConfigError(f"draft.{key}", f"unknown key (expected one of: {', '.join(sorted(shared | own))})")
    readers = sorted(m for m, cls in PROPOSERS.items() if cls.reads_draft_model)
    if not dc.enabled:
        cls = None
    else:
        cls = proposer_class(dc.method)
        if cls.reads_draft_model and dc.model is None:
            raise ConfigError(
                "draft.model",
                f"must be a non-empty string, got None (method {dc.method!r} drafts with the model named here)",
            )
    if dc.model is not None and (cls is None or not cls.reads_draft_model):
        raise ConfigError(
            "draft.model", f"is only used with methods {' and '.join(map(repr, readers))}, not {dc.method!r}"
        )
    if cls is not None:
        cls.settings_of(dc)
    return cls


@dataclass(frozen=True)
class ResolvedDraft:
    """A ``draft:`` section checked once (:func:`check_draft`) and what the system reads of its method: serving,
    the engines, the deployment and a draft worker take it instead of checking the section again."""

    section: DraftConfig
    proposer: type[Proposer] | None  # the method's class; None for method none
    traits: DraftTraits  # what the scheduler plans by
    copy: str | None  # the copy of the target it drafts with (self-w8, self-w4), else None
    dtype: str  # the dtype its model runs in

    @property
    def enabled(self) -> bool:
        return self.proposer is not None


def resolve_draft(dc: DraftConfig, target_dtype: str) -> ResolvedDraft:
    """``dc`` checked (:func:`check_draft`, its ConfigErrors) and resolved: ``target_dtype`` (``target.dtype``) is
    the dtype of a model that runs in the target's (:func:`draft_dtype`)."""
    cls = check_draft(dc)
    return ResolvedDraft(
        dc,
        cls,
        _traits(cls, dc),
        None if cls is None else cls.target_copy(dc.method),
        target_dtype if cls is not None and cls.runs_in_target_dtype else dc.dtype,
    )


def draft_traits(dc: DraftConfig) -> DraftTraits:
    """What the scheduler plans by, of ``dc``'s method (all False for ``none``)."""
    return _traits(check_draft(dc), dc)


def _traits(cls: type[Proposer] | None, dc: DraftConfig) -> DraftTraits:
    if cls is None:
        return DraftTraits()
    return DraftTraits(
        model_free=cls.model_free,
        pipelined=dc.pipeline and cls.drafts_ahead,
        sampled_lengths=dc.confidence_threshold > 0 and not cls.model_free,
    )


def draft_dtype(cfg: Config) -> str:
    """The dtype the draft's model runs in: ``draft.dtype`` for a model of its own; the target's for a copy of
    the target and for a head reading its hidden states (:attr:`Proposer.runs_in_target_dtype`)."""
    return resolve_draft(cfg.draft, cfg.target.dtype).dtype


def target_copy(dc: DraftConfig) -> str | None:
    """The copy of the target ``dc``'s method drafts with (``self-w8``, ``self-w4``), None if none."""
    cls = check_draft(dc)
    return None if cls is None else cls.target_copy(dc.method)


def _discover() -> None:
    global _discovered
    if not _discovered:
        for info in pkgutil.iter_modules(__path__):
            if info.name != "base":
                importlib.import_module(f"{__name__}.{info.name}")
        _discovered = True
