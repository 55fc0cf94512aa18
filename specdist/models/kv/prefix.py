"""Prompt K/V reused across requests (:class:`PrefixCache`), over either KV cache of this package: the
slot cache (a finished request's slot kept whole) or the paged one (its blocks shared by the next request
with the same prefix, copied on write)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import cast

from specdist.errors import ResourceExhausted
from specdist.models.kv.base import KVCache
from specdist.models.kv.paged import PagedKVCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists (slices compared in C, the
    length found by halving: O(n log n) element compares at C speed)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n - 1  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


MIN_PREFIX_TOKENS = 16  # shorter shared prefixes are computed: reuse would save less than its bookkeeping


class PrefixIndex:
    """Token lists (each under a key: a slot) grouped by their first ``head`` tokens.

    Only lists that share a prompt's first ``head`` tokens can share a prefix of ``head`` tokens
    or more with it, so :meth:`longest` compares a prompt with those alone: admitting a request
    costs the prompts that start like it, not every slot of the cache.
    """

    def __init__(self, head: int, items: Iterable[tuple[int, Sequence[int]]] = ()):
        self.head = max(1, int(head))
        self.groups: dict[tuple, dict[int, Sequence[int]]] = {}
        for key, tokens in items:
            self.add(key, tokens)

    def add(self, key: int, tokens: Sequence[int]) -> None:
        if len(tokens) >= self.head:
            self.groups.setdefault(tuple(tokens[: self.head]), {})[key] = tokens

    def remove(self, key: int, tokens: Sequence[int]) -> None:
        head = tuple(tokens[: self.head])
        group = self.groups.get(head)
        if group is not None and group.pop(key, None) is not None and not group:
            del self.groups[head]

    def longest(self, want: Sequence[int]) -> tuple[int, int]:
        """(length, key) of the longest common prefix of ``want`` with a list held, among those of
        at least ``head`` tokens; (0, -1) when none shares ``head``."""
        best, source = 0, -1
        group = self.groups.get(tuple(want[: self.head])) if len(want) >= self.head else None
        for key, tokens in (group or {}).items():
            n = common_prefix(want, tokens)
            if n > best:
                best, source = n, key
        return best, source


class PrefixCache:
    """Prompt K/V reused across requests, over one KV cache (:class:`~specdist.models.kv.base.KVCache`).

    A released request's slot is kept ("retained") with the tokens whose K/V it holds, until a
    slot is needed and none is free (least recently released first). A new request whose prompt
    starts with at least ``min_tokens`` tokens that a retained slot or a live request holds gets
    their K/V without a forward: a retained slot is taken over and rolled back to the shared
    prefix (nothing copied); a live request's prefix is copied into a new slot. Multi-turn chat
    (each turn's prompt extends the last) and shared system prompts or documents hit it.

    K/V at a position depend only on the tokens up to it, so reused K/V are those a forward
    would compute, bit for bit where the forward is batch-invariant (the CPU kernels,
    :mod:`specdist.models.kernels.cpu_kernels`), else up to the kernels' rounding.

    Every change this makes is also passed to ``record`` as an operation that :meth:`replay`
    applies to a follower's PrefixCache (tensor-parallel ranks > 0), so that its cache and its
    set of kept slots stay rank 0's. ``enabled=False``: released slots are freed at once and
    nothing is reused.

    ``scope`` "tenant": a request reuses only the K/V of its own tenant's requests (its time to
    first token then says nothing of what other tenants sent); "shared": anyone's. The callers
    pass each request's tenant, and build the running requests' index per tenant (:meth:`key`).
    """

    def __init__(
        self,
        cache: KVCache,
        enabled: bool = True,
        min_tokens: int = MIN_PREFIX_TOKENS,
        record: Callable[[tuple], None] | None = None,
        scope: str = "shared",
    ):
        self.cache = cache
        self.enabled = enabled
        self.min_tokens = min_tokens
        self.record = record or (lambda op: None)
        self.scope = scope
        self.retained: OrderedDict[int, list[int]] = OrderedDict()  # slot -> its tokens, oldest first
        # the retained slots' tokens, by their first min_tokens, one index a scope key (key()); each slot's key
        self._indexes: dict[str, PrefixIndex] = {}
        self._key_of: dict[int, str] = {}
        self.reused_tokens = 0  # prompt tokens whose K/V came from here instead of a forward

    def key(self, tenant: str) -> str:
        """The share a request of ``tenant`` reuses K/V within: its tenant's, or everyone's ("")."""
        return tenant if self.scope == "tenant" else ""

    @property
    def available(self) -> int:
        """Slots a new request can get: free ones and retained ones (evicted on demand)."""
        return self.cache.num_free + len(self.retained)

    def _op(self, op: tuple) -> int | None:
        out = self.cache.apply(op)
        self.record(op)
        return out

    def allocate(self, tokens: int | None = None) -> int:
        """A slot with nothing in it that may grow to ``tokens`` (None: the cache length), evicting the
        oldest retained slots while the cache has no room for it."""
        self._make_room(tokens)
        slot = self.cache.allocate(tokens)
        self.record(("allocate", slot, tokens))
        return slot

    def _make_room(self, tokens: int | None) -> None:
        while self.retained and not self.cache.can_allocate(tokens):
            self._op(("free", self._unretain(next(iter(self.retained)))))

    def check_room(self, tokens: list[int | None]) -> None:
        """Refuse a call's new requests (needing ``tokens`` each, None: the cache length) unless all fit now:
        :class:`~specdist.errors.ResourceExhausted` naming the first that does not, so that a caller can admit
        the ones before it and retry that one later. Changes nothing."""
        n = self.fits(tokens)
        if n < len(tokens):
            if not self.cache.paged:
                what = f"{self.cache.num_free + len(self.retained)} KV slots are free"
            else:
                cache = cast(PagedKVCache, self.cache)
                what = (
                    f"{cache.num_blocks - 1 - cache.committed_blocks} KV blocks of {cache.block_size} tokens "
                    f"are unreserved and {len(self.retained)} cached prefixes can be evicted"
                )
            raise ResourceExhausted(f"items[{n}]", f"{len(tokens)} requests need room; {what}")

    def fits(self, tokens: list[int | None]) -> int:
        """How many of new requests needing ``tokens`` each (in order) the cache can take now, counting
        what evicting every retained slot would free. Changes nothing."""
        slots = self.cache.num_free + len(self.retained)
        if not self.cache.paged:  # slots of max_len tokens: the slot count alone decides
            return min(len(tokens), slots)
        cache = cast(PagedKVCache, self.cache)
        room = cache.num_blocks - 1 - cache.committed_blocks + sum(len(cache.tables[s]) for s in self.retained)
        n = 0
        for t in tokens:
            room -= cache.blocks_for(cache.max_len if t is None else min(t, cache.max_len), cache.block_size)
            if n == slots or room < 0:
                break
            n += 1
        return n

    def _unretain(self, slot: int) -> int:
        tokens = self.retained.pop(slot)
        index = self._indexes.get(self._key_of.pop(slot, ""))
        if index is not None:  # (a follower keeps slots, not tokens: no index)
            index.remove(slot, tokens)
        return slot

    def live_index(self, live: Iterable[tuple[int, Sequence[int]]]) -> PrefixIndex:
        """The running requests' (slot, tokens held) indexed for :meth:`match` (build it once per call)."""
        return PrefixIndex(self.min_tokens, live)

    def match(
        self, want: Sequence[int], live: PrefixIndex | Iterable[tuple[int, Sequence[int]]] = (), tenant: str = ""
    ) -> tuple[int, int, bool]:
        """The longest prefix of ``want`` held here of at least ``min_tokens`` tokens: (length, slot,
        whether the slot is retained); (0, -1, False) when there is none or reuse is off.
        ``live``: the running requests' (slot, tokens held), or their :meth:`live_index`."""
        if not self.enabled:
            return 0, -1, False
        live = live if isinstance(live, PrefixIndex) else self.live_index(live)
        index = self._indexes.get(self.key(tenant))
        kept, kept_slot = index.longest(want) if index is not None else (0, -1)
        running, running_slot = live.longest(want)
        if running > kept:
            return running, running_slot, False
        return (kept, kept_slot, True) if kept else (0, -1, False)

    def acquire(
        self,
        want: Sequence[int],
        live: PrefixIndex | Iterable[tuple[int, Sequence[int]]] = (),
        tokens: int | None = None,
        tenant: str = "",
    ) -> tuple[int, int]:
        """A slot for a request whose prompt K/V are to be ``want`` (the prompt but its last
        token), and how many of ``want`` it holds already. ``live``: (slot, tokens held) of the
        running requests, whose prefixes may be copied (or their :meth:`live_index`). ``tokens``:
        the most the request may hold (a paged cache reserves that many; None: the cache length). ``tenant``: whose
        request it is (``live`` must then hold requests of its share only, :meth:`key`)."""
        best, source, retained = self.match(want, live, tenant)
        if best < self.min_tokens:
            return self.allocate(tokens), 0
        self.reused_tokens += best
        if retained:
            self._unretain(source)
            self.cache.rollback(source, best)
            self.record(("adopt", source, best))
            while self.retained and not self.cache.can_reserve(source, tokens):
                self._op(("free", self._unretain(next(iter(self.retained)))))
            self._op(("reserve", source, tokens))
            return source, best
        slot = self.allocate(tokens)
        self._op(("copy", source, slot, best))
        return slot, best

    def release(self, slot: int, tokens: Sequence[int], tenant: str = "") -> None:
        """A request is done with ``slot``; ``tokens`` are the ones whose K/V it holds (at least
        ``cache.lengths[slot]`` of them). Retained if long enough to be reused, else freed."""
        held = self.cache.lengths[slot]
        if self.enabled and held >= self.min_tokens:
            self.retained[slot] = list(tokens[:held])
            key = self._key_of[slot] = self.key(tenant)
            self._indexes.setdefault(key, PrefixIndex(self.min_tokens)).add(slot, self.retained[slot])
            self.record(("retain", slot))
            self._op(("reserve", slot, 0))  # kept for reuse: it holds its blocks and grows no more
        else:
            self._op(("free", slot))

    def replay(self, op: tuple) -> int | None:
        """Apply an operation another rank's PrefixCache recorded: ``("retain", slot)`` and
        ``("adopt", slot, length)`` (a kept slot taken over, rolled back to ``length``) change
        the kept set, the others are :meth:`KVCache.apply`'s. A follower keeps no tokens:
        only rank 0 matches prompts."""
        kind = op[0]
        if kind == "retain":
            self.retained[op[1]] = []
            return None
        if kind == "adopt":
            self._unretain(op[1])
            self.cache.rollback(op[1], op[2])
            return None
        if kind == "free" and op[1] in self.retained:
            self._unretain(op[1])
        return self.cache.apply(op)

    def clear(self) -> None:
        """Free every retained slot."""
        while self.retained:
            self._op(("free", self._unretain(next(iter(self.retained)))))
