"""The GPU memory plan (specdist.models.memory_plan) on the CPU, the device's numbers faked.

- :func:`plan`, the numbers alone: the caches get ``total x utilization - weights - graphs - peak - non_torch``,
  every cache the same tokens (bytes in proportion to its bytes per token), none past every slot's full length,
  and a cache that cannot hold one sequence is an error naming the key to change;
- :func:`plan_memory` over real paged caches and a fake :class:`Measure`: the graph profiles add up, the eager
  ones count by their largest, the caches are resized in place;
- the engine on the CPU with ``torch.cuda``'s memory statistics patched (:class:`CudaMeasure` reads them): a
  paged target and draft model planned together from a profile of the engine's real passes, the plan in
  GetServerInfo's fields, requests served on the planned caches; ``engine.kv_cache_tokens`` still sets the size.
"""

from __future__ import annotations

import pytest
import torch
from support.helpers import tiny_config

from specdist import SamplingParams
from specdist.api.admission import server_info
from specdist.config import EngineConfig
from specdist.engine.local import Engine
from specdist.errors import ConfigError
from specdist.models import memory_plan
from specdist.models.kv.options import KVOptions
from specdist.models.kv.paged import PagedKVCache
from specdist.models.memory_plan import CacheNeed, CudaMeasure, Profile, plan, plan_memory
from specdist.v1 import specdist_pb2

GIB = 1 << 30


# --------------------------------------------------------------------------- the numbers
def test_the_caches_share_the_budget_by_bytes_per_token_and_hold_equal_tokens():
    needs = [CacheNeed("target", 128 * 1024, 16, 2048, 256 * 2048), CacheNeed("draft", 32 * 1024, 16, 2048, 256 * 2048)]
    p = plan(80 * GIB, 0.9, weights=16 * GIB, graphs=2 * GIB, peak=3 * GIB, non_torch=GIB, needs=needs)
    assert p.budget == int(80 * GIB * 0.9) - 22 * GIB
    n = p.tokens["target"]
    assert p.tokens == {"target": n, "draft": n} and n % 16 == 0
    per_token = 160 * 1024
    scratch = 16 * per_token  # a block of each cache
    assert n * per_token + scratch <= p.budget < (n + 16) * per_token + scratch  # all of it, to a block
    assert p.bytes == {"target": (n + 16) * 128 * 1024, "draft": (n + 16) * 32 * 1024}
    assert p.line().startswith(
        "memory plan: 80.00 GiB x gpu_memory_utilization 0.9 - weights 16.00 - graphs 2.00 "
        "- peak 3.00 - non-torch 1.00 = 50.00 GiB of KV caches: target "
    )


def test_a_cache_takes_no_more_than_its_slots_hold_and_leaves_the_rest_to_the_others():
    needs = [CacheNeed("target", 1000, 16, 64, 1 << 40), CacheNeed("draft", 1000, 16, 64, 8 * 64)]
    p = plan(10**9, 1.0, 0, 0, 0, 0, needs)
    assert p.tokens["draft"] == 8 * 64  # every slot's full length, no more
    assert p.tokens["target"] == (10**9 - 32 * 1000 - 8 * 64 * 1000) // 1000 // 16 * 16  # the rest
    roomy = plan(10**12, 1.0, 0, 0, 0, 0, [CacheNeed("target", 1000, 16, 64, 8 * 64)])
    assert roomy.tokens == {"target": 8 * 64}


def test_a_cache_that_cannot_hold_one_sequence_is_an_error_naming_the_key():
    needs = [CacheNeed("target", 100_000, 16, 2048, 8 * 2048), CacheNeed("draft", 50_000, 16, 2048, 8 * 2048)]
    fits = (2048 + 16) * 150_000  # one sequence and the scratch block in each
    assert plan(fits, 1.0, 0, 0, 0, 0, needs).tokens == {"target": 2048, "draft": 2048}
    with pytest.raises(ConfigError) as e:
        plan(fits * 2, 0.9, weights=fits, graphs=0, peak=0, non_torch=0, needs=needs)
    assert e.value.key == "engine.gpu_memory_utilization" and "\n" not in str(e.value)
    assert "raise engine.gpu_memory_utilization (now 0.9)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        plan(fits - 1, 1.0, 0, 0, 0, 0, needs)
    assert e.value.key == "engine.max_model_len" and "one sequence of 2,048" in str(e.value)


# --------------------------------------------------------------------------- measured on a (fake) device
class FakeMeasure:
    """A device of ``total`` bytes: torch holds ``allocated`` (``reserved`` with its cache), ``other`` is used
    outside torch; each profiled pass peaks at the next of ``peaks`` above ``allocated``."""

    def __init__(self, total: int, allocated: int, other: int, peaks: list[int]):
        self.total, self.allocated_bytes, self.other, self.peaks = total, allocated, other, list(peaks)
        self.ran, self.released = [], 0

    def mem_get_info(self):
        return self.total - self.allocated_bytes - self.other, self.total

    def allocated(self):
        return self.allocated_bytes

    def reserved(self):
        return self.allocated_bytes

    def peak_after(self, fn):
        self.ran.append(fn())
        return self.peaks.pop(0)

    def release(self):
        self.released += 1


def test_graph_profiles_add_up_eager_ones_count_by_their_largest_and_the_caches_are_resized_in_place():
    caches = {"target": PagedKVCache(2, 4, 2, 8, 64, 5, 16), "draft": PagedKVCache(1, 4, 2, 8, 64, 5, 16)}
    k0 = caches["target"].k[0]
    minimal = sum(c.num_blocks * 16 * c.bytes_per_token for c in caches.values())
    weights, other = 10_000_000, 3_000_000
    m = FakeMeasure(100_000_000, weights + minimal, other, peaks=[1_000_000, 2_000_000, 500_000, 4_000_000, 700])
    profile = Profile(
        graphs=[lambda: "target buckets", lambda: "draft buckets"],
        eager=[lambda: "prefill", lambda: "sampler", lambda: "draft prefill"],
    )
    lines = []
    p = plan_memory(caches, 0.5, profile, m, log=lines.append)
    assert m.ran == ["target buckets", "draft buckets", "prefill", "sampler", "draft prefill"]
    assert (p.weights, p.graphs, p.peak, p.non_torch) == (weights, 3_000_000, 4_000_000, other)
    assert lines == [p.line()] and m.released == 2
    want = plan(
        100_000_000,
        0.5,
        weights,
        3_000_000,
        4_000_000,
        other,
        [CacheNeed(n, c.bytes_per_token, 16, 64, 4 * 64) for n, c in caches.items()],
    )
    assert p.tokens == want.tokens and p.tokens["target"] == p.tokens["draft"] > 64
    for name, c in caches.items():  # the same objects (runners and cores hold them), now with the planned blocks
        assert c.num_blocks == p.tokens[name] // 16 + 1 and c.k[0].shape[0] == c.num_blocks
        assert c.usage()["blocks_total"] * 16 == p.tokens[name] and c.can_allocate()
    assert caches["target"].k[0] is not k0 and caches["target"].k[0].dtype == k0.dtype


class FakeCuda:
    """torch.cuda's memory statistics of a device of ``total`` bytes where torch holds ``allocated`` (and
    caches ``cached`` more) and ``other`` is used outside torch; a pass profiled after the n-th
    ``reset_peak_memory_stats`` peaks at ``peaks[n]`` above ``allocated``."""

    def __init__(self, monkeypatch, total: int, allocated: int, cached: int, other: int, peaks: list[int]):
        self.total, self.allocated, self.cached, self.other, self.peaks = total, allocated, cached, other, peaks
        self.resets = 0
        for name in (
            "mem_get_info",
            "memory_allocated",
            "memory_reserved",
            "max_memory_allocated",
            "reset_peak_memory_stats",
            "synchronize",
            "empty_cache",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(memory_plan, "measure_for", CudaMeasure)  # the CPU engine plans as on a GPU

    def mem_get_info(self, device=None):
        return self.total - self.allocated - self.cached - self.other, self.total

    def memory_allocated(self, device=None):
        return self.allocated

    def memory_reserved(self, device=None):
        return self.allocated + self.cached

    def max_memory_allocated(self, device=None):
        return self.allocated + self.peaks[self.resets - 1]

    def reset_peak_memory_stats(self, device=None):
        self.resets += 1

    def synchronize(self, device=None):
        pass

    def empty_cache(self):
        pass


def _minimal_bytes(max_len: int, per_token: list[int], block: int = 16) -> int:
    """What the deferred caches take before the plan: one sequence of max_len and the scratch block each."""
    return sum((PagedKVCache.blocks_for(max_len, block) + 1) * block * b for b in per_token)


def test_the_engine_plans_its_target_and_draft_caches_together_from_its_passes(tiny_models, monkeypatch):
    cfg = tiny_config(tiny_models, method="model", k=3, kv_cache="paged", max_batch_size=4)
    probe = Engine.from_config(tiny_config(tiny_models, method="model", k=3, kv_cache="paged"))
    per_token = [probe.target_core.cache.bytes_per_token, probe.draft_core.cache.bytes_per_token]
    weights, other, cached = 5_000_000, 700_000, 300_000
    peaks = [40_000, 90_000, 30_000, 20_000, 60_000, 50_000]  # target buckets, prefill; draft's; 2 samplers
    # a device with room for 150 tokens in each cache (its 4 slots of 64 would take 256) and their scratch blocks
    total = int((weights + other + 90_000 + (150 + 16) * sum(per_token)) / 0.9)
    cuda = FakeCuda(monkeypatch, total, weights + _minimal_bytes(64, per_token), cached, other, peaks)
    eng = Engine.from_config(cfg)
    assert cuda.resets == 6  # every pass profiled: each runner's buckets and longest prefill, two samplers
    want = plan(
        total,
        0.9,
        weights,
        0,
        90_000,
        other,  # what torch caches is not memory outside torch
        [CacheNeed(n, b, 16, 64, 4 * 64) for n, b in zip(("target", "draft"), per_token)],
    )
    target, draft = eng.target_core.cache, eng.draft_core.cache
    assert target.usage()["blocks_total"] * 16 == draft.usage()["blocks_total"] * 16 == want.tokens["target"] == 144
    assert eng.memory_plan == want.line() and specdist_pb2.ServerInfo(**server_info(eng)).memory_plan == want.line()
    # the planned caches serve (two requests at once: each reserves 64 of the 144 tokens), the tokens of an engine
    # whose caches were configured
    prompts = [[1 + i, 2, 3, 4, 5] for i in range(2)]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in probe.generate(prompts, sp)]
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_a_starved_draft_cache_is_an_error_not_drafting_off(tiny_models, monkeypatch):
    probe = Engine.from_config(tiny_config(tiny_models, method="model", k=3, kv_cache="paged"))
    per_token = [probe.target_core.cache.bytes_per_token, probe.draft_core.cache.bytes_per_token]
    minimal = _minimal_bytes(64, per_token)
    # room for the target's one sequence, not for the draft's as well
    total = int((1_000_000 + minimal - per_token[1] * 16) / 0.9) + 1
    FakeCuda(monkeypatch, total, 1_000_000 + minimal, 0, 0, [0] * 6)
    with pytest.raises(ConfigError) as e:
        Engine.from_config(tiny_config(tiny_models, method="model", k=3, kv_cache="paged"))
    assert e.value.key == "engine.gpu_memory_utilization" and "less than one sequence of 64" in str(e.value)


def test_kv_cache_tokens_still_sets_the_size_without_a_plan(tiny_models, monkeypatch):
    cuda = FakeCuda(monkeypatch, 1 << 40, 0, 0, 0, [])
    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=3, kv_cache="paged", kv_cache_tokens=160))
    assert cuda.resets == 0 and eng.memory_plan == "" and server_info(eng)["memory_plan"] == ""
    assert eng.target_core.cache.usage()["blocks_total"] == eng.draft_core.cache.usage()["blocks_total"] == 10


def test_deferred_options_start_at_one_sequence_without_reading_the_device(monkeypatch):
    def no_device(*a):
        raise AssertionError("the device was read")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_device)
    ec = EngineConfig(max_model_len=64, kv_cache="paged")
    kv = KVOptions.from_engine(ec, "cuda", deferred=True)
    assert kv.deferred and kv.tokens(torch.device("cuda"), 8, 64, 1000) == 64
    assert not KVOptions.from_engine(EngineConfig(kv_cache="paged", kv_cache_tokens=4096), "cuda", True).deferred
    assert not KVOptions.from_engine(EngineConfig(kv_cache="slots"), "cuda", True).deferred
