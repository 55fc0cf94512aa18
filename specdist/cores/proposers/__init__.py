"""Draft methods, one module each, registered by the ``draft.method`` names they serve.

Each module defines a :class:`~specdist.cores.proposers.base.Proposer` subclass decorated with
:func:`~specdist.cores.proposers.base.register`: ``model`` (a draft model and the target's own low-precision
copies, ``self-w8`` / ``self-w4``), ``ngram`` (prompt lookup), ``suffix`` (SuffixDecoding), ``hybrid`` (the
suffix index or the target's int8 copy, per request and step) and ``eagle3`` (an EAGLE-3 head). A new method is
a new module here: :func:`proposer_class` imports every module of this package the first time it is asked.
"""

from __future__ import annotations

import importlib
import pkgutil

from specdist.cores.proposers.base import PROPOSERS, Proposer
from specdist.errors import ConfigError

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


def _discover() -> None:
    global _discovered
    if not _discovered:
        for info in pkgutil.iter_modules(__path__):
            if info.name != "base":
                importlib.import_module(f"{__name__}.{info.name}")
        _discovered = True
