"""A Ray deployment's workers plan their GPU memory with the engine's planner (specdist.models.memory_plan), on the
CPU with torch.cuda's memory statistics faked, each worker on a device of its own.

The deployment's own path (Deployment._load_call, then phase ``memory``: Deployment._plan_memory) drives worker
actors that live in this process (the same classes Ray hosts; a handle's ``.remote`` calls the method at once):
two target ranks and a model draft, whose devices report different free memory, each measure the engine's passes
beside their deferred paged caches, the deployment plans them with the shared planner, and every cache ends with
the same block count: the fewest any device holds. The plans are reported (the deployment's line for
GetServerInfo, each worker's health). The two ranks are one-process stand-ins (a two-rank group's forwards need a
process group; what is planned, and how, is the same).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from support.helpers import tiny_config

from cluster.deployment import ClusterSpec, Deployment, _Handle
from specdist.config import load_config
from specdist.models import memory_plan
from specdist.models.memory_plan import CacheNeed, CudaMeasure, plan
from specdist.models.metadata import ModelSources
from workers.actors import DraftActor, TargetRankActor


class Devices:
    """torch.cuda's memory statistics of the device of the worker being called (``current``): ``total`` bytes,
    torch holding ``allocated``, ``other`` used outside torch; every profiled pass peaks ``peak`` above."""

    def __init__(self, monkeypatch):
        self.devices, self.current = {}, None
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
        monkeypatch.setattr(memory_plan, "measure_for", CudaMeasure)  # the CPU workers plan as on GPUs

    def mem_get_info(self, device=None):
        d = self.devices[self.current]
        return d["total"] - d["allocated"] - d["other"], d["total"]

    def memory_allocated(self, device=None):
        return self.devices[self.current]["allocated"]

    def memory_reserved(self, device=None):
        return self.devices[self.current]["allocated"]

    def max_memory_allocated(self, device=None):
        return self.devices[self.current]["allocated"] + self.devices[self.current]["peak"]

    def reset_peak_memory_stats(self, device=None):
        pass

    def synchronize(self, device=None):
        pass

    def empty_cache(self):
        pass


class InProcess:
    """A worker actor as the deployment's handle sees it: ``actor.method.remote(...)`` runs the method now, on
    the worker's own (fake) device, and returns its result."""

    def __init__(self, name: str, actor, devices: Devices):
        self.name, self.actor, self.devices = name, actor, devices

    def __getattr__(self, method):
        def remote(*args, **kwargs):
            self.devices.current = self.name
            return getattr(self.actor, method)(*args, **kwargs)

        return SimpleNamespace(remote=remote)


def test_the_deployment_plans_every_workers_cache_with_the_shared_planner_to_the_fewest_blocks(
    tiny_models, monkeypatch
):
    devices = Devices(monkeypatch)
    cfg = load_config(tiny_config(tiny_models, method="model", k=3, kv_cache="paged"))
    dep = Deployment(ClusterSpec(tensor_parallel_size=2, num_draft_workers=1))
    dep.config, dep.sources = cfg, ModelSources.of(cfg)
    actors = {
        "target rank 0": TargetRankActor(0, 1, num_threads=None),
        "target rank 1": TargetRankActor(0, 1, None),
        "draft 0": DraftActor(0, num_threads=None),
    }
    handles = [
        _Handle(name, InProcess(name, a, devices), "draft" if name.startswith("draft") else "target")
        for name, a in actors.items()
    ]
    try:
        for h in handles:
            devices.current = h.name
            dep._load_call(h)  # the deployment's load: a deferred paged cache of one sequence (64) and a scratch block
        caches = {name: a.worker.runner.cache for name, a in actors.items()}
        assert {c.num_blocks for c in caches.values()} == {64 // 16 + 1}
        weights, peak, u = 4_000_000, 50_000, cfg.engine.gpu_memory_utilization
        room = {"target rank 0": 300, "target rank 1": 150, "draft 0": 1000}  # tokens each device has room for
        for name, c in caches.items():  # free memory differs from worker to worker
            minimal = c.num_blocks * 16 * c.bytes_per_token
            total = int((weights + peak + 100_000 + (room[name] + 16) * c.bytes_per_token) / u)
            devices.devices[name] = dict(total=total, allocated=weights + minimal, other=100_000, peak=peak)
        planned = []
        real_plan = memory_plan.plan
        monkeypatch.setattr(memory_plan, "plan", lambda *a, **k: planned.append(a) or real_plan(*a, **k))

        dep._plan_memory(handles, lambda phase, calls: calls)

        assert len(planned) == 3  # the shared planner, once a worker, on what each measured of its own device
        alone = {
            name: plan(
                d["total"],
                u,
                weights,
                0,
                peak,
                d["other"],
                [
                    CacheNeed(n, caches[name].bytes_per_token, 16, 64, 8 * 64)
                    for n in (("draft",) if name == "draft 0" else ("target",))
                ],
            )
            for name, d in devices.devices.items()
        }
        assert {name: p.tokens.popitem()[1] for name, p in alone.items()} == {
            "target rank 0": 288,
            "target rank 1": 144,
            "draft 0": 8 * 64,
        }
        # every cache the fewest tokens: the ranks replay rank 0's blocks, the draft holds the target's tokens
        assert dep.kv_tokens == 144
        assert {name: (c.num_blocks, c.usage()["blocks_total"]) for name, c in caches.items()} == {
            name: (144 // 16 + 1, 144 // 16) for name in caches
        }
        for name, a in actors.items():  # reported: each worker's health, the deployment's line (GetServerInfo)
            line = a.health()["memory_plan"]
            assert line.startswith("memory plan: ") and f"{name}: {line}" in dep.memory_plan.split("; ")
            assert "144 tokens" in line
        monkeypatch.setattr("specdist.engine.remote.RemoteEngine.from_addresses", lambda *a, **k: SimpleNamespace())
        dep.target_address = "127.0.0.1:1"
        assert dep.connect().memory_plan == dep.memory_plan
        # the planned caches serve: rank 0's warm-up prefills, verifies and releases on them
        actors["target rank 0"].warmup()
        actors["draft 0"].warmup()
        assert all(c.num_used == 0 for c in caches.values())
    finally:
        for a in actors.values():
            a.shutdown()


def test_on_the_cpu_nothing_is_measured_as_in_the_engine(tiny_models):
    cfg = load_config(tiny_config(tiny_models, method="model", k=3, kv_cache="paged"))
    dep = Deployment(ClusterSpec(tensor_parallel_size=1, num_draft_workers=1))
    dep.config, dep.sources = cfg, ModelSources.of(cfg)
    actor = TargetRankActor(0, 1, num_threads=None)
    h = _Handle("target rank 0", InProcess("target rank 0", actor, SimpleNamespace(current=None)), "target")
    try:
        dep._load_call(h)
        assert actor.measure_memory(0.9) is None
        dep._plan_memory([h], lambda phase, calls: calls)
        assert dep.memory_plan == "" and dep.kv_tokens is None and actor.health()["memory_plan"] == ""
        assert actor.worker.runner.cache.num_blocks == 8 * 64 // 16 + 1  # every slot's full length
    finally:
        actor.shutdown()
