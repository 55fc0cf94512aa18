"""The KV caches: :class:`~specdist.models.kv.slots.SlotKVCache` (a slot of ``max_len`` positions a request,
what the CPU kernels read), :class:`~specdist.models.kv.paged.PagedKVCache` (blocks through a table per
request, what the paged kernels read) and :class:`~specdist.models.kv.prefix.PrefixCache` (prompt K/V reused
across requests, over either). The slot and paged caches keep one interface, :class:`~specdist.models.kv.base.KVCache`
(what their callers use). Which one a runner gets is its attention backend's ``kv_layout``."""
