"""SuffixDecoding (``draft.method: suffix``): the most frequent continuation of the longest suffix of the
sequence that occurred before in any sequence of this drafter, live or recently finished
(:class:`specdist.cores.suffix.SuffixIndex`); q is one-hot.

The indexes are one a tenant unless ``draft.suffix_scope`` is ``shared``
(:class:`specdist.cores.suffix.SuffixIndexes`). Each token carries the length of the match it was read after
(``Draft.match_lengths``), which the adaptive length rule prices.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdist.cores.proposers.base import BuildContext, Draft, DraftRequest, Proposer, register
from specdist.cores.suffix import SuffixIndex, SuffixIndexes, SuffixSettings, SuffixState


@dataclass
class Suffixed:
    """A request's place in its tenant's suffix index."""

    index: SuffixIndex
    state: SuffixState


def suffix_settings(dc) -> SuffixSettings:
    """The ``draft.suffix_*`` keys of a config's draft section."""
    return SuffixSettings(dc.suffix_max_depth, dc.suffix_min_prob, dc.suffix_max_spec_factor,
                          dc.suffix_cache_requests, dc.suffix_cache_tokens, dc.suffix_min_score, dc.suffix_scope)


@register
class SuffixProposer(Proposer):
    methods = ("suffix",)

    def __init__(self, vocab_size: int, settings: SuffixSettings | None = None):
        self.vocab_size = int(vocab_size)
        self.settings = settings or SuffixSettings()
        self.indexes = SuffixIndexes(self.settings)

    @classmethod
    def build(cls, dc, ctx: BuildContext) -> "SuffixProposer":
        return cls(ctx.vocab_size, suffix_settings(dc))

    def start(self, r: DraftRequest) -> None:
        index = self.indexes.for_tenant(r.tenant)
        r.state = Suffixed(index, index.start(r.seq))  # O(len(prompt) * max_depth)

    def commit(self, r: DraftRequest, kept, n_acc, prev, prepared, hidden) -> None:
        r.state.index.extend(r.state.state, kept)

    def lookup(self, r: DraftRequest, k: int):
        """The index's draft of up to ``k`` tokens for ``r`` (tokens, depths, score), None for k = 0."""
        st = self.settings
        return r.state.index.lookup(r.state.state, k, st.min_prob, st.max_spec_factor) if k > 0 else None

    def propose(self, reqs: list[DraftRequest], ks: list[int]) -> list[Draft]:
        drafts = [self.lookup(r, k) for r, k in zip(reqs, ks)]
        return [Draft(d.tokens, match_lengths=d.depths) if d is not None else Draft([]) for d in drafts]

    def release(self, r: DraftRequest) -> None:
        self.indexes.finish(r.state.index, r.state.state)  # its sequence stays as a cached one (oldest evicted)

    def forget_finished(self) -> None:
        """What follows drafts from live requests only, as on a fresh worker."""
        self.indexes.forget_finished()

    def index_stats(self) -> dict[str, int]:
        return self.indexes.stats()

    def stats(self) -> dict:
        s = self.indexes.stats()
        return {"suffix_nodes": s["nodes"], "suffix_cached_requests": s["cached"],
                "suffix_cached_tokens": s["cached_tokens"]}
