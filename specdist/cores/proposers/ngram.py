"""Prompt lookup (``draft.method: ngram``): the continuation of the latest earlier occurrence of the sequence's
last n tokens, n from ``ngram_max`` down to ``ngram_min``; q is one-hot.

Each request keeps an :class:`NgramIndex` of its own sequence (its ``state``). The index keeps, for every
n-gram, the latest start at which it occurs *with at least one token after it*, so a lookup is
O(ngram_max + k) dictionary work instead of a scan of the sequence, and appending a token is O(ngram_max^2).
An n-gram ending at position i is recorded only once the token at i + 1 exists, so the sequence's own suffix
never matches itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdist.cores.proposers.base import BuildContext, Draft, DraftRequest, Proposer, register
from specdist.errors import ConfigError


@dataclass
class NgramKeys:
    """The method's ``draft.`` keys: the n-gram lengths tried, longest first."""

    ngram_min: int = 1
    ngram_max: int = 3

    def validate(self, key: str) -> None:
        if not 1 <= self.ngram_min <= 64:
            raise ConfigError(f"{key}.ngram_min", f"must be an integer in [1, 64], got {self.ngram_min!r}")
        if not self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError(
                f"{key}.ngram_max", f"must be an integer in [{self.ngram_min}, 64], got {self.ngram_max!r}"
            )


@register
class NgramProposer(Proposer):
    methods = ("ngram",)
    model_free = True
    settings = NgramKeys

    def __init__(self, vocab_size: int, ngram_min: int = 1, ngram_max: int = 3):
        NgramIndex(ngram_min, ngram_max)  # refuses a bad range now
        self.vocab_size = int(vocab_size)
        self.ngram = (ngram_min, ngram_max)

    @classmethod
    def build(cls, dc, ctx: BuildContext) -> "NgramProposer":
        keys = cls.settings_of(dc)
        return cls(ctx.vocab_size, keys.ngram_min, keys.ngram_max)

    def start(self, r: DraftRequest[NgramIndex]) -> None:
        r.state = NgramIndex(*self.ngram)
        r.state.extend(r.seq)

    def commit(self, r: DraftRequest[NgramIndex], kept, n_acc, prev, prepared, hidden) -> None:
        r.state.extend(kept)

    def propose(self, reqs: list[DraftRequest[NgramIndex]], ks: list[int]) -> list[Draft]:
        return [Draft(r.state.lookup(k) if k > 0 else []) for r, k in zip(reqs, ks)]


class NgramIndex:
    """The tokens of one sequence, with the latest start of each n-gram (n in ngram_min..ngram_max)."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.seq: list[int] = []  # read-only for callers
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> latest start with a token after it

    def __len__(self) -> int:
        return len(self.seq)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens. O(len(tokens) * ngram_max²)."""
        seq, latest = self.seq, self._latest
        for tok in tokens:
            end = len(seq)  # n-grams ending just before position `end` now have a token after them
            seq.append(tok)
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                latest[tuple(seq[end - n : end])] = end - n

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram.

        Same answer as scanning the sequence backwards for each n, longest first, in
        O(ngram_max + k).
        """
        seq, length = self.seq, len(self.seq)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            start = self._latest.get(tuple(seq[length - n :]))
            if start is not None:
                return seq[start + n : start + n + k]
        return []
