"""The GPU memory plan: how many tokens the paged KV caches hold, from what a profile of the engine's passes used.

The runners are built with the smallest paged cache (one sequence of ``max_len`` and the scratch block,
``KVOptions.deferred``); with every weight loaded and nothing captured yet, :func:`plan_memory` measures on the
device

- ``weights``: what torch's allocator holds besides those caches (weights, quantized copies, RoPE tables);
- ``graphs``: per runner whose passes become CUDA graphs, every graph bucket's pass run once, largest first, its
  outputs held (what its captured graphs keep: one memory pool holding the largest pass's intermediates and every
  bucket's static outputs), the peak above ``weights``; the pools live on, so the runners' peaks add up;
- ``peak``: the largest eager pass, the highest peak above ``weights`` of: the sampler of a verification at the
  largest batch (k drafts each, q rows, top-k / top-p, log-probabilities), each runner's longest prefill (one
  sequence of ``max_len``: a prompt outside every bucket runs eagerly), and the bucket passes of runners without
  graphs; these run one after another and free what they took, so the largest counts;
- ``non-torch``: device memory torch's allocator does not hold (``total - free - reserved``): the CUDA context,
  cuBLAS and NCCL buffers, other processes;

and gives the caches ``total x gpu_memory_utilization - weights - graphs - peak - non-torch`` bytes (vLLM's rule;
the rest of the device is the headroom for what no profile sees: the allocator's fragmentation, a draft pass that
a pipelined drafter runs beside the target's). Every cache holds the same number of tokens: a request's tokens
sit in each of them (the target verifies them, the draft drafts after them), so tokens one cache held beyond the
others' would never be used; the bytes are therefore shared in proportion to each cache's bytes per token. No cache
takes more than every slot's full length (``num_slots x max_len``); what one leaves goes to the others. A cache
that cannot hold one sequence of ``max_len`` is a :class:`~specdist.errors.ConfigError` naming the key to change,
never a smaller cache (a draft that cannot hold a request would draft nothing).

Everything the plan reads of the device goes through a :class:`Measure` (:class:`CudaMeasure` on GPUs), so the
plan is tested on a CPU with the device's numbers faked.

The in-process engine measures, plans and resizes in one call (:func:`plan_memory`). A Ray deployment's workers
hold their caches in processes of their own, each on its own device: each worker measures
(:func:`measure_memory`, its passes given by :func:`runner_profile` as the engine's are), the deployment plans
them together (:func:`plan_together`: each within its own device, then every cache held to the fewest tokens any
got, so that tensor-parallel ranks hold the same blocks and a draft's cache the target's tokens), and each worker
takes its plan (:func:`apply_plan`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdist.errors import ConfigError
from specdist.models.kv.paged import PagedKVCache

GIB = 1 << 30


class Measure(Protocol):
    """What the plan reads of a device (:class:`CudaMeasure`; tests pass their own)."""

    def mem_get_info(self) -> tuple[int, int]: ...  # (free, total) bytes of the device

    def allocated(self) -> int: ...  # bytes torch's allocator has handed out

    def reserved(self) -> int: ...  # bytes torch's allocator holds from the device (handed out or cached)

    def peak_after(self, fn: Callable[[], object]) -> int: ...  # highest allocated bytes during fn, above before

    def release(self) -> None: ...  # return the allocator's cached, unused memory to the device


class CudaMeasure:
    """:class:`Measure` of one CUDA device, through ``torch.cuda``'s memory statistics."""

    def __init__(self, device: torch.device):
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak_after(self, fn: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def measure_for(device: torch.device) -> Measure | None:
    """The measure of a device whose caches the engine plans (CUDA), or None (elsewhere every cache holds every
    slot's full length)."""
    return CudaMeasure(device) if device.type == "cuda" else None


@dataclass
class CacheNeed:
    """One paged cache to plan: its name (target, draft), bytes a token, tokens a block, and the tokens it needs at
    least (one sequence of ``max_len``) and at most (every slot's full length)."""

    name: str
    bytes_per_token: int
    block_size: int
    min_tokens: int
    max_tokens: int


@dataclass
class MemoryPlan:
    """What :func:`plan` gave each cache (``tokens``: by cache name, whole blocks, the scratch block aside) and the
    measured terms it gave them from (bytes)."""

    total: int
    utilization: float
    weights: int
    graphs: int
    peak: int
    non_torch: int
    tokens: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)  # each cache's bytes, its scratch block included

    @property
    def budget(self) -> int:
        """Bytes the caches may take: ``total x utilization - weights - graphs - peak - non_torch``."""
        return int(self.total * self.utilization) - self.weights - self.graphs - self.peak - self.non_torch

    def line(self) -> str:
        """The plan in one line (stderr at start, GetServerInfo's ``memory_plan``)."""

        def g(n: int) -> str:
            return f"{n / GIB:.2f}"

        caches = ", ".join(f"{name} {self.tokens[name]:,} tokens ({g(self.bytes[name])} GiB)" for name in self.tokens)
        return (
            f"memory plan: {g(self.total)} GiB x gpu_memory_utilization {self.utilization:g} - weights "
            f"{g(self.weights)} - graphs {g(self.graphs)} - peak {g(self.peak)} - non-torch {g(self.non_torch)} "
            f"= {g(self.budget)} GiB of KV caches: {caches}"
        )


def plan(
    total: int,
    utilization: float,
    weights: int,
    graphs: int,
    peak: int,
    non_torch: int,
    needs: list[CacheNeed],
    key: str = "engine",
) -> MemoryPlan:
    """The tokens each cache of ``needs`` holds within ``total x utilization - weights - graphs - peak -
    non_torch`` bytes (the module doc says why these terms and this split). ConfigError (``key``'s
    ``gpu_memory_utilization``, or its ``max_model_len`` at utilization 1) where a cache cannot hold its
    ``min_tokens``."""
    out = MemoryPlan(total, utilization, weights, graphs, peak, non_torch)
    left = out.budget - sum(n.bytes_per_token * n.block_size for n in needs)  # the scratch blocks come first
    tokens: dict[str, int] = {}
    open_needs = sorted(needs, key=lambda n: n.max_tokens)
    while open_needs:  # every cache the same tokens, but none past its max: those capped leave the rest to the others
        share = max(0, left) // sum(n.bytes_per_token for n in open_needs)
        capped = [n for n in open_needs if n.max_tokens <= share]
        for n in capped or open_needs:
            tokens[n.name] = min(share, n.max_tokens) // n.block_size * n.block_size
            left -= tokens[n.name] * n.bytes_per_token
        open_needs = [n for n in open_needs if n not in capped] if capped else []
    for n in needs:
        if tokens[n.name] < n.min_tokens:
            need = sum(-(-x.min_tokens // x.block_size + 1) * x.block_size * x.bytes_per_token for x in needs)
            fix = (
                f"raise {key}.gpu_memory_utilization (now {utilization:g})"
                if utilization < 1
                else f"lower {key}.max_model_len"
            )
            raise ConfigError(
                f"{key}.gpu_memory_utilization" if utilization < 1 else f"{key}.max_model_len",
                f"the KV caches get {out.budget / GIB:.2f} GiB ({out.line()}); the {n.name} cache "
                f"holds {tokens[n.name]:,} tokens, less than one sequence of {n.min_tokens:,} "
                f"(one in every cache needs {need / GIB:.2f} GiB): {fix}",
            )
    out.tokens = {n.name: tokens[n.name] for n in needs}
    out.bytes = {n.name: (tokens[n.name] + n.block_size) * n.bytes_per_token for n in needs}
    return out


@dataclass
class Measured:
    """What one process measured of its device and its caches: :func:`plan`'s arguments (bytes). Shipped from a
    deployment's worker to the process that plans (:func:`plan_together`)."""

    total: int
    utilization: float
    weights: int
    graphs: int
    peak: int
    non_torch: int
    needs: list[CacheNeed]

    def plan(self, key: str = "engine") -> MemoryPlan:
        """:func:`plan` of these terms."""
        return plan(self.total, self.utilization, self.weights, self.graphs, self.peak, self.non_torch, self.needs, key)


def plan_together(measured: dict[str, Measured], key: str = "engine", cap: int | None = None) -> dict[str, MemoryPlan]:
    """The plans of processes that each hold paged caches on a device of their own (a deployment's target ranks and
    draft workers, by name): each planned by :func:`plan` within its own device (a ConfigError naming ``key``'s
    setting where one cannot hold a sequence), then every cache of every process held to the fewest tokens any
    got, and to ``cap`` (what the processes already serving hold, for one that joins later): the ranks of a
    tensor-parallel target replay rank 0's block operations, so they need the same blocks, and a request's tokens
    sit in the target's cache and a draft's alike."""
    plans = {who: m.plan(key) for who, m in measured.items()}
    fewest = min([t for p in plans.values() for t in p.tokens.values()] + ([cap] if cap is not None else []))
    for who, p in plans.items():
        needs = measured[who].needs
        p.tokens = {n.name: fewest // n.block_size * n.block_size for n in needs}
        p.bytes = {n.name: (p.tokens[n.name] + n.block_size) * n.bytes_per_token for n in needs}
    return plans


@dataclass
class Profile:
    """The passes :func:`plan_memory` measures: ``graphs``, one a runner whose passes become CUDA graphs (their
    memory is held for good: the peaks add up); ``eager``, passes run eagerly one at a time (the largest peak
    counts)."""

    graphs: list[Callable[[], object]] = field(default_factory=list)
    eager: list[Callable[[], object]] = field(default_factory=list)


def bucket_passes(runner, max_tokens: int) -> Callable[[], None]:
    """Every graph bucket's pass of ``runner`` (drafting or verifying up to ``max_tokens`` tokens a request), run
    once without capture, largest first, each one's outputs held until the last ran: what capturing keeps."""

    def run() -> None:
        try:
            runner.capture_graphs(max_tokens=max_tokens, log=lambda line: None, eager_replay=True)
        finally:
            runner.graphs = None

    return run


def longest_prefill(runner) -> Callable[[], None]:
    """One prompt of ``max_len`` tokens through ``runner``'s eager pass, on a slot released afterwards."""

    def run() -> None:
        cache = runner.cache
        slot = cache.allocate()
        try:
            runner.forward([slot], [[0] * cache.max_len], [1])
        finally:
            cache.free(slot)

    return run


def runner_profile(runners: dict[str, tuple[object, int]], graphed: bool) -> Profile:
    """The passes of runners (by name: the runner and the tokens a request of its graph buckets carries at most:
    ``k + 1`` verifying, two drafting): each one's graph buckets (a graph profile where they become CUDA graphs,
    else an eager one) and its longest prefill."""
    profile = Profile()
    for runner, tokens in runners.values():
        (profile.graphs if graphed else profile.eager).append(bucket_passes(runner, tokens))
        profile.eager.append(longest_prefill(runner))
    return profile


def measure_memory(caches: dict[str, PagedKVCache], utilization: float, profile: Profile, measure: Measure) -> Measured:
    """Measure ``profile`` on the device beside the ``caches`` (by name; each empty, as a deferred runner built
    it): the terms :func:`plan` gives them from."""
    weights = measure.allocated() - sum(c.num_blocks * c.block_size * c.bytes_per_token for c in caches.values())
    graphs = sum(measure.peak_after(fn) for fn in profile.graphs)
    peak = max((measure.peak_after(fn) for fn in profile.eager), default=0)
    measure.release()
    free, total = measure.mem_get_info()
    non_torch = max(0, total - free - measure.reserved())
    needs = [
        CacheNeed(
            name,
            c.bytes_per_token,
            c.block_size,
            c.max_blocks * c.block_size,
            c.num_slots * c.max_blocks * c.block_size,
        )
        for name, c in caches.items()
    ]
    return Measured(total, utilization, weights, graphs, peak, non_torch, needs)


def apply_plan(caches: dict[str, PagedKVCache], tokens: dict[str, int], measure: Measure) -> None:
    """Give each of the ``caches`` (by name, empty) the blocks of its planned ``tokens`` and the scratch block
    (:func:`resize`), every minimal cache freed first."""
    layouts = {name: _layout(c) for name, c in caches.items()}
    for c in caches.values():  # every minimal cache freed before the planned ones are taken
        c.k, c.v = [], []
    measure.release()
    for name, c in caches.items():
        resize(c, PagedKVCache.blocks_for(tokens[name], c.block_size) + 1, layouts[name])


def plan_memory(
    caches: dict[str, PagedKVCache],
    utilization: float,
    profile: Profile,
    measure: Measure,
    key: str = "engine",
    log: Callable[[str], None] | None = None,
) -> MemoryPlan:
    """Measure ``profile`` on the device, plan the ``caches`` (by name; each empty, as a deferred runner built it)
    and give each its planned blocks (:func:`resize`). ``log``: told the plan's line (default: stderr)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    out = measure_memory(caches, utilization, profile, measure).plan(key)
    apply_plan(caches, out.tokens, measure)
    log(out.line())
    return out


def _layout(cache: PagedKVCache) -> tuple:  # (layers, kv heads, head size, dtype, device) of its K/V
    k = cache.k[0]
    return len(cache.k), k.shape[2], k.shape[3], k.dtype, k.device


def resize(cache: PagedKVCache, num_blocks: int, layout: tuple | None = None) -> None:
    """Rebuild an empty paged cache with ``num_blocks`` blocks as the same object (the runner, its attention
    backend and the cores' prefix caches hold it). ``layout``: :func:`_layout` of it, where its K/V were cleared
    already (else read from them)."""
    if cache.num_used:
        raise RuntimeError("a paged cache is resized only while it holds no sequence")
    layers, heads, head_dim, dtype, device = layout or _layout(cache)
    cache.k, cache.v = [], []  # the old K/V freed before the new ones are taken
    PagedKVCache.__init__(
        cache, layers, cache.num_slots, heads, head_dim, cache.max_len, num_blocks, cache.block_size, dtype, device
    )
