"""Slot-based KV cache with O(1) rollback.

Layout, per layer: ``k[layer]`` and ``v[layer]`` are ``[num_slots, n_kv_heads,
max_len + 1, head_dim]``. A request owns one slot for its lifetime; the slot's
valid prefix is ``lengths[slot]`` tokens. Column ``max_len`` is a scratch column:
padded positions of a ragged batch write there and are never attended to.

Costs:
- Memory is bounded and fixed at start-up: ``num_slots * (max_len + 1) *
  bytes_per_token``, where ``bytes_per_token = 2 * num_layers * n_kv_heads *
  head_dim * dtype_bytes`` (SmolLM2-135M in fp32: 2*30*3*64*4 = 46,080 B/token).
- Appending T tokens writes ``T * bytes_per_token`` (one indexed copy per layer).
- Rollback to the accepted prefix only lowers ``lengths[slot]``: O(1), nothing is
  copied or zeroed; stale entries beyond the length are masked and later overwritten.
- Join / leave (continuous batching) is ``allocate`` / ``free`` of a slot: O(1).
- Reading: a batch whose slots are contiguous attends through a view (no copy);
  otherwise the attended prefix of each slot is gathered, ``S * bytes_per_token``
  per request per step, S being the longest sequence in the batch.
"""

from __future__ import annotations

import torch

from specdist.models.kv.paged import KVCacheFull, apply_cache_op


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots}, {max_len}")
        self.num_slots, self.max_len = num_slots, max_len
        shape = (num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots  # valid tokens per slot (host-side ints)
        self._free = list(range(num_slots - 1, -1, -1))  # stack: lowest slot id handed out first
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.k[0].element_size()

    @property
    def scratch(self) -> int:
        """Position index padded tokens write to; never attended."""
        return self.max_len

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self, tokens: int | None = None) -> bool:
        """A new slot fits now (every slot holds ``max_len`` tokens: ``tokens`` does not matter)."""
        return bool(self._free)

    def allocate(self, tokens: int | None = None) -> int:
        """A free slot (of ``max_len`` tokens whatever ``tokens`` a paged cache would reserve)."""
        if not self._free:
            raise KVCacheFull("KV cache has no free slot")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)  # keep low slots first so running batches stay contiguous

    paged = False  # a slot per request holds max_len tokens (specdist.models.kv.paged: blocks)

    def usage(self) -> dict[str, int]:
        """What the cache holds, in its allocation units (a slot of ``max_len`` tokens here): blocks_total,
        blocks_used and block_size (tokens a unit), as the paged cache reports them."""
        return {"blocks_total": self.num_slots, "blocks_used": self.num_used, "block_size": self.max_len}

    def can_reserve(self, slot: int, tokens: int | None) -> bool:
        return True

    def reserve(self, slot: int, tokens: int | None) -> None:
        """A paged cache's reservation; a slot holds ``max_len`` tokens regardless."""

    def ensure(self, slot: int, end: int) -> None:
        """Positions up to ``end`` of ``slot`` are writable (always, up to ``max_len``)."""
        if end > self.max_len:
            raise ValueError(f"slot {slot}: {end} tokens exceed the cache length {self.max_len}")

    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` tokens of ``slot``. O(1)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self.lengths[slot]}")
        self.lengths[slot] = length

    def same_layout(self, other: "SlotKVCache") -> bool:
        """Same layers, kv heads, length and head_dim (slot counts and dtypes may differ)."""
        return (
            isinstance(other, SlotKVCache)
            and len(other.k) == len(self.k)
            and other.k[0].shape[1:] == self.k[0].shape[1:]
        )

    def copy_prefix(self, src: "SlotKVCache", src_slot: int, dst_slot: int, length: int) -> None:
        """Fill ``dst_slot`` with the first ``length`` tokens of ``src_slot`` in ``src`` (same layout; converted
        to this cache's dtype, e.g. a float32 target's prompt K/V into its self draft's float16 cache)."""
        if not self.same_layout(src):
            raise ValueError("copy_prefix needs caches of the same layout (layers, kv heads, length, head_dim)")
        if not 0 <= length <= src.lengths[src_slot]:
            raise ValueError(f"slot {src_slot} holds {src.lengths[src_slot]} tokens, cannot copy {length}")
        for i in range(len(self.k)):
            self.k[i][dst_slot, :, :length] = src.k[i][src_slot, :, :length]
            self.v[i][dst_slot, :, :length] = src.v[i][src_slot, :, :length]
        self.lengths[dst_slot] = length

    def apply(self, op: tuple) -> int | None:
        """Apply one recorded cache operation (:func:`~specdist.models.kv.paged.apply_cache_op`)."""
        return apply_cache_op(self, op)
