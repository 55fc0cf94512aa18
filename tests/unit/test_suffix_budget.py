"""One suffix-index budget for all tenants (specdist.cores.suffix_index.SuffixIndexes).

With one index a tenant, ``suffix_cache_tokens`` and ``suffix_cache_requests`` bound the indexes together, not
each one: 20 tenants hold at most the budget in total. Past it the least recently used tenant's oldest cached
sequence is evicted first, so the tenants in use keep their text.
"""

from __future__ import annotations

import random

from specdist.cores.suffix_index import SuffixIndexes, SuffixSettings

BUDGET = 100  # tokens


def _finish(indexes: SuffixIndexes, tenant: str, tokens: list[int]) -> None:
    index = indexes.for_tenant(tenant)
    indexes.finish(index, index.start(tokens))


def _held(indexes: SuffixIndexes) -> tuple[int, int]:
    s = indexes.stats()
    return s["cached"], s["cached_tokens"]


def test_twenty_tenants_hold_at_most_the_budget_in_total():
    rng = random.Random(0)
    indexes = SuffixIndexes(SuffixSettings(max_depth=4, cache_requests=256, cache_tokens=BUDGET))
    for _ in range(3):
        for t in range(20):
            _finish(indexes, f"tenant-{t}", [rng.randrange(50) for _ in range(10)])
            assert _held(indexes)[1] <= BUDGET
    assert _held(indexes) == (10, BUDGET)  # 60 sequences of 10 tokens were finished
    # each index's counts stay exact after the evictions: a trie of depth <= 4 over 10 tokens has <= 34 nodes
    assert sum(i.num_nodes for i in indexes.indexes.values()) <= 10 * 34
    # the requests bound is one budget too
    few = SuffixIndexes(SuffixSettings(max_depth=4, cache_requests=5, cache_tokens=1 << 20))
    for t in range(20):
        _finish(few, f"tenant-{t}", [1, 2, 3])
    assert _held(few) == (5, 15) and few.stats()["indexes"] == 5


def test_the_least_recently_used_tenants_oldest_text_goes_first():
    indexes = SuffixIndexes(SuffixSettings(max_depth=4, cache_requests=256, cache_tokens=BUDGET))
    for t in range(5):  # tenants 0..4, 20 tokens each: the budget exactly
        _finish(indexes, f"tenant-{t}", [t] * 10)
        _finish(indexes, f"tenant-{t}", [t + 10] * 10)
    assert _held(indexes) == (10, BUDGET)
    indexes.for_tenant("tenant-0")  # tenant 0 is used again (a request starts): 1 is now the least recently used
    _finish(indexes, "tenant-4", [40] * 10)  # 10 tokens over: tenant 1's oldest sequence goes
    held = {k: [list(seq) for seq in i.cached] for k, i in indexes.indexes.items()}
    assert held["tenant-1"] == [[11] * 10]
    assert held["tenant-0"] == [[0] * 10, [10] * 10]
    assert held["tenant-4"] == [[4] * 10, [14] * 10, [40] * 10]
    _finish(indexes, "tenant-4", [41] * 20)  # 20 over: tenant 1's last one, then tenant 2's oldest
    held = {k: [list(seq) for seq in i.cached] for k, i in indexes.indexes.items()}
    assert "tenant-1" not in held and held["tenant-2"] == [[12] * 10]
    assert _held(indexes)[1] == BUDGET
