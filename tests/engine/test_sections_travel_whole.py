"""Config sections travel whole to where the cores are built (specdist.cores.factory), and the draft section is
checked once.

A new ``engine:`` key touches the config (here: a subclass of EngineConfig with one more field) and the code that
reads it (here: the factory, wrapped to read it), nothing between: the in-process engine and the Ray workers, as
the deployment loads them (the actors in this process, their load calls' arguments pickled as Ray ships them),
both hand the factory the section they were given. And ``specdist serve`` checks the draft section once
(``check_draft``, whoever calls it), passing the resolved section on.
"""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import sys
from types import SimpleNamespace

import pytest
from support.helpers import tiny_config

from cluster.deployment import ClusterSpec, Deployment, _Handle
from specdist.api import serve_command
from specdist.api.preflight import check_config
from specdist.config import EngineConfig, load_config
from specdist.cores import factory, proposers
from specdist.engine.local import Engine
from specdist.models.metadata import resolve_sources
from specdist.sampling_params import SamplingParams
from workers.actors import DraftActor, TargetRankActor


@dataclasses.dataclass
class EngineWithANewKey(EngineConfig):
    new_key: str = "its default"  # engine.new_key: a key no code between the config and its reader names


def with_new_key(cfg, value: str):
    """``cfg`` with its engine section carrying the new key set to ``value``."""
    cfg.engine = EngineWithANewKey(**dataclasses.asdict(cfg.engine), new_key=value)
    return cfg


@pytest.fixture
def read_by_the_factory(monkeypatch):
    """The new key's reader: the factory's target and draft builders, recording what they read of it."""
    seen = []
    for name in ("build_target_core", "build_draft_core"):
        original = getattr(factory, name)

        def reading(*args, _name=name, _original=original, **kwargs):
            ec = args[1]  # (model or draft, ec, ...): the engine section as the factory got it
            seen.append((_name, type(ec).__name__, getattr(ec, "new_key", None)))
            return _original(*args, **kwargs)

        monkeypatch.setattr(factory, name, reading)
    return seen


@pytest.fixture
def draft_checks(monkeypatch):
    """Every check of a draft section (``check_draft``, wherever it is imported), by method."""
    original, calls = proposers.check_draft, []

    def counted(dc):
        calls.append(dc.method)
        return original(dc)

    for module in list(sys.modules.values()):
        if getattr(module, "check_draft", None) is original:
            monkeypatch.setattr(module, "check_draft", counted)
    return calls


class AsRay:
    """An actor as the deployment's handle sees it, in this process: ``actor.method.remote(*args)`` pickles the
    arguments as Ray ships them to another process, then runs the method."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, method):
        def remote(*args, **kwargs):
            args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
            return getattr(self.actor, method)(*args, **kwargs)

        return SimpleNamespace(remote=remote)


def test_a_new_engine_key_reaches_the_engines_factory(tiny_models, read_by_the_factory):
    cfg = with_new_key(load_config(tiny_config(tiny_models, method="model")), "in process")
    Engine.from_config(cfg)
    assert read_by_the_factory == [
        ("build_target_core", "EngineWithANewKey", "in process"),
        ("build_draft_core", "EngineWithANewKey", "in process"),
    ]


def test_a_new_engine_key_reaches_the_workers_factory_through_the_deployment(
    tiny_models, read_by_the_factory, draft_checks
):
    """The deployment's loads and its RemoteEngine, as ``specdist serve`` drives them: the serving check resolves
    the draft section (the one check) and the deployment keeps it (Deployment.start), sends it and the engine
    section whole to the workers, and hands it to the RemoteEngine over them."""
    cfg = with_new_key(load_config(tiny_config(tiny_models, method="model", max_batch_size=3)), "on the workers")
    dep = Deployment(ClusterSpec(tensor_parallel_size=1, num_draft_workers=1))
    dep.config, dep.sources, dep.draft = cfg, resolve_sources(cfg), check_config(cfg)
    target, draft = TargetRankActor(0, 1, num_threads=None), DraftActor(0, num_threads=None)
    try:
        dep._load_call(_Handle("target rank 0", AsRay(target), "target"))  # noqa: SLF001 - the deployment's load
        dep._load_call(_Handle("draft 0", AsRay(draft), "draft"))  # noqa: SLF001
        assert read_by_the_factory == [
            ("build_target_core", "EngineWithANewKey", "on the workers"),
            ("build_draft_core", "EngineWithANewKey", "on the workers"),
        ]
        # and the rest of the section with it (engine.max_batch_size, engine.max_model_len)
        assert (target.max_batch_size, target.worker.max_model_len, draft.worker.max_model_len) == (3, 64, 64)
        target.warmup()
        draft.warmup()
        dep.target_address, dep.draft_addresses = target.start_grpc("127.0.0.1", 0), [draft.start_grpc("127.0.0.1", 0)]
        with dep.connect() as remote:
            got = remote.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        assert len(got[0].token_ids) == 6 and remote.stats.drafted > 0
        assert draft_checks == ["model"]  # serving's; the deployment, the draft worker and the RemoteEngine took it
    finally:
        target.shutdown()
        draft.shutdown()


def test_serve_checks_the_draft_section_once(tiny_models, draft_checks, monkeypatch):
    """``specdist serve`` in process, as run_serve runs it up to serving (which is skipped): one check."""
    served = []

    async def serve(backend, args):
        served.append(backend.engine)

    monkeypatch.setattr(serve_command, "_serve_until_signalled", serve)
    args = argparse.Namespace(
        config=tiny_config(tiny_models, method="model"), host="127.0.0.1", port=0, max_queued=4, drain_seconds=0.0
    )
    assert serve_command.run_serve(args) == 0
    assert isinstance(served[0], Engine) and served[0].draft_core.method == "model"
    assert draft_checks == ["model"]
