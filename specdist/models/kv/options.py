"""How a runner keeps its K/V: :class:`KVOptions`, the ``engine.kv_cache*`` keys as the runner takes them
(which cache, :mod:`specdist.models.kv.slots` or :mod:`specdist.models.kv.paged`, and its size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATION_MARGIN = 0.9  # share of the free device memory a cache that sizes itself may take (KVOptions.tokens)


@dataclass
class KVOptions:
    """How a runner keeps K/V (``engine.kv_cache*``): ``kind`` auto (paged on GPUs, where the paged kernels run;
    a slot per request on the CPU, which the CPU attention kernels read) | slots | paged; ``block_size`` tokens a
    block; ``max_tokens`` tokens the paged cache holds (``engine.kv_cache_tokens``; None: see :meth:`tokens`);
    ``memory_fraction``: ``engine.gpu_memory_utilization``; ``deferred``: the caller plans the cache's size after
    profiling (:mod:`specdist.models.memory_plan`, what the engine and the workers do on GPUs): the runner starts
    with one sequence's blocks."""

    kind: str = "auto"
    block_size: int = 16
    max_tokens: int | None = None
    memory_fraction: float = ACTIVATION_MARGIN
    deferred: bool = False
    backend: str = "auto"  # engine.attention_backend: a registered backend's name, or auto

    @classmethod
    def from_engine(cls, ec, device: torch.device | str, deferred: bool = False) -> "KVOptions":
        """The options of an ``engine:`` config section (:class:`specdist.config.EngineConfig`) for a runner on
        ``device``; ``deferred``: a paged cache the caller plans, unless ``kv_cache_tokens`` sets its size."""
        paged = ec.paged(torch.device(device).type)
        return cls(
            "paged" if paged else "slots",
            ec.kv_block_size,
            ec.kv_cache_tokens,
            ec.gpu_memory_utilization,
            deferred and paged and ec.kv_cache_tokens is None,
            ec.attention_backend,
        )

    def paged(self, device: torch.device) -> bool:
        return self.kind == "paged" or (self.kind == "auto" and device.type == "cuda")

    def tokens(self, device: torch.device, num_slots: int, max_len: int, bytes_per_token: int) -> int:
        """Tokens the paged cache holds at construction: the configured number; one sequence of ``max_len`` when
        deferred (the plan sizes it later); else every slot's full length, capped on a GPU by ``memory_fraction``
        of the free memory (a runner used on its own: tests, benchmarks), never below one sequence."""
        if self.max_tokens is not None:
            return max(self.max_tokens, max_len)
        if self.deferred:
            return max_len
        want = num_slots * max_len
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            want = min(want, int(free * self.memory_fraction) // bytes_per_token)
        return max(want, max_len)
