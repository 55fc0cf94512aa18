"""Paged KV cache: K/V in fixed-size blocks, a block table per sequence (vLLM's layout).

Layout, per layer: ``k[layer]`` and ``v[layer]`` are ``[num_blocks, block_size, n_kv_heads, head_dim]``.
A sequence ("slot", as in :class:`~specdist.models.kv.slots.SlotKVCache`, whose interface this
keeps) owns the blocks its table lists: position ``p`` lives in block ``table[p // block_size]``
at row ``p % block_size``. Block 0, the scratch block, is never handed out: padded tokens of a batch
write there and padded table entries point there.

Costs:
- Memory is ``num_blocks * block_size * bytes_per_token``, sized by tokens held, not by
  ``num_slots * max_len``: a sequence takes a block when it reaches it.
- Rollback lowers the length and returns the blocks wholly past it: O(blocks freed), nothing copied.
- Prefix sharing (:meth:`copy_prefix` within this cache): the source's full blocks are shared
  (a reference count each), the partial last block is copied. A write into a shared block copies
  it first (copy on write, :meth:`ensure`), so a shared block never changes under a reader.
- Admission reserves a sequence's worst case (``allocate(tokens)``: its prompt and output bound),
  counted in blocks; a reservation never fails later, so a running sequence always has room to
  grow. Shared blocks are counted once per sequence that holds them: the count errs high.

Every change goes through the host-side tables; the device sees them as one ``[B, max_blocks]``
table a step, built by :meth:`table_rows`.
"""

from __future__ import annotations

import torch

from specdist.models.kv.base import KVCache


class KVCacheFull(RuntimeError):
    """No room for a sequence: no free slot, or too few blocks for its reservation."""


def apply_cache_op(cache: KVCache, op: tuple) -> int | None:
    """Apply one recorded cache operation to a KV cache (slot or paged: how tensor-parallel followers replay rank
    0's): ``("allocate", slot[, tokens])`` (must hand out that slot), ``("free", slot)``, ``("rollback", slot,
    length)``, ``("copy", src_slot, dst_slot, length)`` (a prefix within the cache), ``("reserve", slot, tokens)``."""
    kind = op[0]
    if kind == "allocate":
        slot = cache.allocate(op[2] if len(op) > 2 else None)
        if slot != op[1]:
            raise RuntimeError(f"tensor-parallel ranks diverged: allocated slot {slot}, rank 0 got {op[1]}")
        return slot
    if kind == "free":
        cache.free(op[1])
    elif kind == "rollback":
        cache.rollback(op[1], op[2])
    elif kind == "copy":
        cache.copy_prefix(cache, op[1], op[2], op[3])
    elif kind == "reserve":
        cache.reserve(op[1], op[2])
    else:
        raise ValueError(f"unknown cache operation {kind!r}")
    return None


class PagedKVCache:
    paged = True

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots and max_len must be >= 1, got {num_slots}, {max_len}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)  # table width: blocks of the longest sequence
        if num_blocks < self.max_blocks + 1:
            raise ValueError(
                f"{num_blocks} blocks of {block_size} tokens cannot hold one sequence of {max_len} "
                f"tokens and the scratch block: at least {self.max_blocks + 1} are needed"
            )
        self.num_slots, self.max_len, self.num_blocks = num_slots, max_len, num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.k[0].element_size()
        self.lengths = [0] * num_slots  # valid tokens per slot (host-side ints)
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]  # slot -> its blocks, in position order
        self.reserved = [0] * num_slots  # slot -> blocks its reservation may grow to
        self.refs = [0] * num_blocks  # block -> tables holding it
        self._free_slots = list(range(num_slots - 1, -1, -1))  # stack: lowest slot id handed out first
        self._free_blocks = list(range(num_blocks - 1, 0, -1))  # stack; block 0 is the scratch block
        self.copies = 0  # blocks copied on write or by a partial-block share (tests read it)

    @staticmethod
    def blocks_for(num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)

    # ------------------------------------------------------------ the SlotKVCache surface
    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - 1 - len(self._free_blocks)

    def usage(self) -> dict[str, int]:
        """Blocks the sequences can take (the scratch block aside), blocks they hold, tokens a block."""
        return {"blocks_total": self.num_blocks - 1, "blocks_used": self.blocks_in_use, "block_size": self.block_size}

    @property
    def committed_blocks(self) -> int:
        """Blocks the live slots hold or may still take (their reservations)."""
        return sum(max(r, len(t)) for r, t in zip(self.reserved, self.tables))

    def can_allocate(self, tokens: int | None = None) -> bool:
        """A new slot reserving ``tokens`` (None: ``max_len``) fits now."""
        return bool(self._free_slots) and self.committed_blocks + self._blocks_of(tokens) <= self.num_blocks - 1

    def allocate(self, tokens: int | None = None) -> int:
        """A slot with nothing in it, its reservation ``tokens`` (None: ``max_len``)."""
        if not self._free_slots:
            raise KVCacheFull("KV cache has no free slot")
        if not self.can_allocate(tokens):
            raise KVCacheFull(
                f"KV cache has {self.num_blocks - 1 - self.committed_blocks} unreserved blocks of "
                f"{self.block_size} tokens; a sequence of {tokens} tokens needs more"
            )
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        self.reserved[slot] = self._blocks_of(tokens)
        return slot

    def _blocks_of(self, tokens: int | None) -> int:
        return self.blocks_for(self.max_len if tokens is None else min(tokens, self.max_len), self.block_size)

    def can_reserve(self, slot: int, tokens: int | None) -> bool:
        """``slot``'s reservation can become ``tokens`` (None: ``max_len``) now."""
        table = len(self.tables[slot])
        grow = max(self._blocks_of(tokens), table) - max(self.reserved[slot], table)
        return self.committed_blocks + grow <= self.num_blocks - 1

    def reserve(self, slot: int, tokens: int | None) -> None:
        """Set ``slot``'s reservation to ``tokens`` (None: ``max_len``; 0 once a finished request's slot is
        only kept for reuse)."""
        if not self.can_reserve(slot, tokens):
            raise KVCacheFull(f"KV cache cannot reserve {tokens} tokens for slot {slot}")
        self.reserved[slot] = self._blocks_of(tokens)

    def free(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"slot {slot} is not allocated")
        self._drop_blocks(slot, 0)
        self.lengths[slot] = 0
        self.reserved[slot] = 0
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)

    def rollback(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` tokens of ``slot``; blocks wholly past them go back."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self.lengths[slot]}")
        self.lengths[slot] = length
        self._drop_blocks(slot, self.blocks_for(length, self.block_size))

    def same_layout(self, other) -> bool:
        """Same layers, kv heads, head_dim, block size and length (slot counts, block counts and dtypes may differ)."""
        return (
            isinstance(other, PagedKVCache)
            and len(other.k) == len(self.k)
            and other.block_size == self.block_size
            and other.k[0].shape[2:] == self.k[0].shape[2:]
            and other.max_len == self.max_len
        )

    def copy_prefix(self, src: "PagedKVCache", src_slot: int, dst_slot: int, length: int) -> None:
        """Fill empty ``dst_slot`` with the first ``length`` tokens of ``src_slot``. Within this cache the full
        blocks are shared and the last partial one copied; from another cache (a self draft taking its target's
        prompt K/V) every block is copied, converted to this cache's dtype."""
        if not self.same_layout(src):
            raise ValueError(
                "copy_prefix needs paged caches of the same layout (layers, kv heads, head_dim, block size, length)"
            )
        if not 0 <= length <= src.lengths[src_slot]:
            raise ValueError(f"slot {src_slot} holds {src.lengths[src_slot]} tokens, cannot copy {length}")
        if self.tables[dst_slot]:
            raise ValueError(f"slot {dst_slot} already holds blocks")
        n_full, rest = divmod(length, self.block_size)
        src_blocks = src.tables[src_slot][: n_full + (rest > 0)]
        if src is self:
            for b in src_blocks[:n_full]:
                self.refs[b] += 1
            self.tables[dst_slot] = list(src_blocks[:n_full])
            if rest:
                self.tables[dst_slot].append(self._copy_block(src_blocks[n_full]))
        else:
            new = [self._take_block() for _ in src_blocks]
            self.tables[dst_slot] = new
            if new:
                index_src = torch.tensor(src_blocks, device=src.k[0].device)
                index_dst = torch.tensor(new, device=self.k[0].device)
                for i in range(len(self.k)):
                    self.k[i].index_copy_(0, index_dst, src.k[i].index_select(0, index_src).to(self.k[i]))
                    self.v[i].index_copy_(0, index_dst, src.v[i].index_select(0, index_src).to(self.v[i]))
        self.lengths[dst_slot] = length

    def apply(self, op: tuple) -> int | None:
        return apply_cache_op(self, op)

    # ------------------------------------------------------------ what a forward needs
    def ensure(self, slot: int, end: int) -> None:
        """Make positions ``[lengths[slot], end)`` of ``slot`` writable: blocks taken up to ``end``, and a
        shared block in that range copied first (copy on write). Within the slot's reservation this never fails."""
        if end > self.max_len:
            raise ValueError(f"slot {slot}: {end} tokens exceed the cache length {self.max_len}")
        table, bs = self.tables[slot], self.block_size
        for j in range(self.lengths[slot] // bs, min(len(table), self.blocks_for(end, bs))):
            if self.refs[table[j]] > 1:  # shared: this sequence writes its own copy
                self.refs[table[j]] -= 1
                table[j] = self._copy_block(table[j])
        while len(table) < self.blocks_for(end, bs):
            table.append(self._take_block())

    def table_rows(self, slots: list[int], width: int | None = None) -> list[int]:
        """The block tables of ``slots``, each padded with the scratch block to ``width`` (default
        :attr:`max_blocks`), flattened: ``[len(slots) * width]`` ints for the step's one host-to-device copy."""
        width = self.max_blocks if width is None else width
        out: list[int] = []
        for s in slots:
            t = self.tables[s]
            out += t + [0] * (width - len(t))
        return out

    # ------------------------------------------------------------ blocks
    def _take_block(self) -> int:
        if not self._free_blocks:
            raise KVCacheFull("KV cache has no free block (a reservation was exceeded)")
        b = self._free_blocks.pop()
        self.refs[b] = 1
        return b

    def _release_block(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._free_blocks.append(b)

    def _drop_blocks(self, slot: int, keep: int) -> None:
        table = self.tables[slot]
        while len(table) > keep:
            self._release_block(table.pop())

    def _copy_block(self, b: int) -> int:
        """A new block holding block ``b``'s K/V (every layer)."""
        new = self._take_block()
        for i in range(len(self.k)):
            self.k[i][new] = self.k[i][b]
            self.v[i][new] = self.v[i][b]
        self.copies += 1
        return new
