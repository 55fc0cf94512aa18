"""The worker actors' base: each role says what it profiles for the memory plan, or the class cannot be made."""

from __future__ import annotations

import inspect

import pytest
import ray

from workers.actors import DraftActor, TargetRankActor, _ActorBase


def test_the_runner_profile_is_abstract_and_each_role_gives_it():
    assert _ActorBase.__abstractmethods__ == frozenset({"_runner_profile"})
    assert not inspect.isabstract(TargetRankActor)
    assert not inspect.isabstract(DraftActor)


def test_a_role_without_a_runner_profile_cannot_be_made():
    class Roleless(_ActorBase):
        role = "roleless"

    with pytest.raises(TypeError, match="_runner_profile"):
        Roleless()


def test_ray_wraps_the_abstract_bases_subclasses_as_actor_classes():
    for cls in (TargetRankActor, DraftActor):  # ray.remote subclasses the class: ABCMeta must let it
        assert isinstance(ray.remote(num_cpus=0)(cls), ray.actor.ActorClass)


def test_the_start_up_objects_are_frozen_by_a_method_named_for_it(monkeypatch):
    """What the deployment calls once an actor serves: gc.freeze of its start-up objects (specdist.gc_freeze), by
    that name (the deployment's phase ``freeze`` calls it on every actor)."""
    from specdist import gc_freeze

    assert not hasattr(_ActorBase, "freeze_heap")
    monkeypatch.setattr(gc_freeze, "freeze", lambda: 1234)  # the real one would freeze this test process
    actor = DraftActor.__new__(DraftActor)  # without __init__: no threads, no pinning
    assert actor.freeze_start_up_objects() == 1234 and actor.frozen_objects == 1234
