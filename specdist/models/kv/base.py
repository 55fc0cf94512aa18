"""What the KV caches' callers use of them: the :class:`KVCache` protocol, which both
:class:`~specdist.models.kv.slots.SlotKVCache` and :class:`~specdist.models.kv.paged.PagedKVCache` keep.

A request holds a "slot": its K/V positions ``0 .. lengths[slot]`` (a slot of ``max_len`` positions, or blocks
through a table). The cores, the prefix cache and the tensor-parallel followers touch a cache only through these
members; the attention backends and the memory plan, which read one layout's tensors, take the class itself.
"""

from __future__ import annotations

from typing import Protocol


class KVCache(Protocol):
    paged: bool  # blocks through a table per slot (PagedKVCache), not a slot of max_len positions
    num_slots: int  # requests it can hold at once
    max_len: int  # positions a slot can hold
    lengths: list[int]  # slot -> valid positions (host-side)

    @property
    def num_free(self) -> int: ...

    @property
    def num_used(self) -> int: ...

    def usage(self) -> dict[str, int]:
        """blocks_total, blocks_used, block_size (tokens a block; a slot cache's block is a slot)."""
        ...

    def can_allocate(self, tokens: int | None = None) -> bool: ...

    def allocate(self, tokens: int | None = None) -> int:
        """A free slot that may grow to ``tokens`` positions (None: ``max_len``); KVCacheFull if none fits."""
        ...

    def free(self, slot: int) -> None: ...

    def can_reserve(self, slot: int, tokens: int | None) -> bool: ...

    def reserve(self, slot: int, tokens: int | None) -> None:
        """``slot`` may grow to ``tokens`` positions (0: no more than it holds)."""
        ...

    def ensure(self, slot: int, end: int) -> None:
        """Positions up to ``end`` of ``slot`` are writable (before a forward writes them)."""
        ...

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first ``length`` positions of ``slot``."""
        ...

    def same_layout(self, other: KVCache) -> bool:
        """``other``'s K/V can be copied into this cache (:meth:`copy_prefix`)."""
        ...

    def copy_prefix(self, src: KVCache, src_slot: int, dst_slot: int, length: int) -> None:
        """``dst_slot`` holds the first ``length`` positions of ``src_slot`` of ``src``."""
        ...

    def apply(self, op: tuple) -> int | None:
        """Apply one recorded operation (:func:`~specdist.models.kv.paged.apply_cache_op`): how tensor-parallel
        followers replay rank 0's."""
        ...
