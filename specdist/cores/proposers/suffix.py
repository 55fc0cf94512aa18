"""SuffixDecoding (``draft.method: suffix``): the most frequent continuation of the longest suffix of the
sequence that occurred before in any sequence of this drafter, live or recently finished
(:class:`specdist.cores.suffix_index.SuffixIndex`); q is one-hot.

The indexes are one a tenant unless ``draft.suffix_scope`` is ``shared``
(:class:`specdist.cores.suffix.SuffixIndexes`). Each token carries the length of the match it was read after
(``Draft.match_lengths``), which the adaptive length rule prices.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdist.config import SCOPES
from specdist.cores.proposers.base import BuildContext, Draft, DraftRequest, Proposer, register
from specdist.cores.suffix_index import SuffixIndex, SuffixIndexes, SuffixSettings, SuffixState
from specdist.errors import ConfigError


@dataclass
class Suffixed:
    """A request's place in its tenant's suffix index."""

    index: SuffixIndex
    state: SuffixState


@dataclass
class SuffixKeys:
    """The suffix index's ``draft.`` keys (methods ``suffix`` and ``hybrid``): :class:`SuffixSettings` as a config
    names them."""

    suffix_max_depth: int = 24
    suffix_min_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    suffix_cache_requests: int = 256
    suffix_cache_tokens: int = 262_144
    suffix_scope: str = "tenant"  # one of config.SCOPES
    suffix_min_score: float = 2.0

    def validate(self, key: str) -> None:
        _in_range(self.suffix_max_depth, f"{key}.suffix_max_depth", 2, 256, integer=True)
        _in_range(self.suffix_cache_requests, f"{key}.suffix_cache_requests", 0, 1 << 20, integer=True)
        _in_range(self.suffix_cache_tokens, f"{key}.suffix_cache_tokens", 0, 1 << 32, integer=True)
        if self.suffix_scope not in SCOPES:
            raise ConfigError(f"{key}.suffix_scope", f"must be one of {', '.join(SCOPES)}, got {self.suffix_scope!r}")
        _in_range(self.suffix_min_prob, f"{key}.suffix_min_prob", 0.0, 1.0)
        if not 0.0 < self.suffix_max_spec_factor <= 256.0:
            raise ConfigError(
                f"{key}.suffix_max_spec_factor", f"must be in (0, 256], got {self.suffix_max_spec_factor!r}"
            )
        _in_range(self.suffix_min_score, f"{key}.suffix_min_score", 0.0, 64.0)

    def index_settings(self) -> SuffixSettings:
        return SuffixSettings(
            self.suffix_max_depth,
            self.suffix_min_prob,
            self.suffix_max_spec_factor,
            self.suffix_cache_requests,
            self.suffix_cache_tokens,
            self.suffix_min_score,
            self.suffix_scope,
        )


def _in_range(value, key: str, lo, hi, integer: bool = False) -> None:
    if not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise ConfigError(key, f"must be {kind} in [{lo}, {hi}], got {value!r}")


@register
class SuffixProposer(Proposer):
    methods = ("suffix",)
    model_free = True
    settings = SuffixKeys

    def __init__(self, vocab_size: int, settings: SuffixSettings | None = None):
        self.vocab_size = int(vocab_size)
        self.settings = settings or SuffixSettings()
        self.indexes = SuffixIndexes(self.settings)

    @classmethod
    def build(cls, dc, ctx: BuildContext) -> "SuffixProposer":
        return cls(ctx.vocab_size, cls.settings_of(dc).index_settings())

    def start(self, r: DraftRequest[Suffixed]) -> None:
        index = self.indexes.for_tenant(r.tenant)
        r.state = Suffixed(index, index.start(r.seq))  # O(len(prompt) * max_depth)

    def commit(self, r: DraftRequest[Suffixed], kept, n_acc, prev, prepared, hidden) -> None:
        r.state.index.extend(r.state.state, kept)

    def lookup(self, r: DraftRequest[Suffixed], k: int):
        """The index's draft of up to ``k`` tokens for ``r`` (tokens, depths, score), None for k = 0."""
        st = self.settings
        return r.state.index.lookup(r.state.state, k, st.min_prob, st.max_spec_factor) if k > 0 else None

    def propose(self, reqs: list[DraftRequest[Suffixed]], ks: list[int]) -> list[Draft]:
        drafts = [self.lookup(r, k) for r, k in zip(reqs, ks)]
        return [Draft(d.tokens, match_lengths=d.depths) if d is not None else Draft([]) for d in drafts]

    def release(self, r: DraftRequest[Suffixed]) -> None:
        self.indexes.finish(r.state.index, r.state.state)  # its sequence stays as a cached one (oldest evicted)

    def forget_finished(self) -> None:
        """What follows drafts from live requests only, as on a fresh worker."""
        self.indexes.forget_finished()

    def index_stats(self) -> dict[str, int]:
        return self.indexes.stats()

    def stats(self) -> dict:
        s = self.indexes.stats()
        return {
            "suffix_nodes": s["nodes"],
            "suffix_cached_requests": s["cached"],
            "suffix_cached_tokens": s["cached_tokens"],
        }
