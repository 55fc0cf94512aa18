"""The draft-length rule learns from the step events alone (specdist.engine.draft_length.DraftLengthPolicy.observe):
each StepEvent carries what its step measured (``costs``), and a fresh rule fed the same events ends where the
engine's own rule ends, with the same predictions of a step without drafts along the way."""

from __future__ import annotations

import dataclasses

import pytest
from support.helpers import tiny_config

from specdist.engine.draft_length import Acceptance, DraftLengthPolicy
from specdist.engine.local import Engine
from specdist.engine.output_processor import StepEvent
from specdist.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "method,extra", [("model", {}), ("model", {"pipeline": True}), ("suffix", {})], ids=["model", "pipelined", "suffix"]
)
def test_a_fresh_rule_fed_the_step_events_learns_what_the_engine_learnt(tiny_models, method, extra) -> None:
    cfg = tiny_config(tiny_models, method, 3, "adaptive")
    cfg["draft"].update(extra)
    eng = Engine.from_config(cfg)
    events: list[StepEvent] = []
    eng.listeners.append(lambda e: events.append(e) if isinstance(e, StepEvent) else None)
    try:
        eng.generate(
            [[1, 2, 3], [4, 5, 6, 1], [2, 2, 7]],
            [SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)],
        )
        own = eng.scheduler.length_policy
        fresh = DraftLengthPolicy(
            own.k, own.mode, num_replicas=len(own.draft_cost), pipelined=own.pipelined, model_free=own.model_free
        )
        accs: dict[int, Acceptance] = {}  # the requests' acceptance, as the fresh rule keeps it
        for e in events:
            costs = dataclasses.replace(
                e.costs,
                acceptance=[
                    (accs.setdefault(b, Acceptance()), *rest) for b, (_, *rest) in enumerate(e.costs.acceptance)
                ],
            )
            replay = dataclasses.replace(e, costs=costs, plain_step_s=-1.0)
            fresh.observe(replay)
            assert replay.plain_step_s == e.plain_step_s  # the same prediction, from the same measurements
        assert events and sum(len(e.costs.draft_runs) for e in events) > 0  # drafts were measured
        assert fresh.snapshot() == own.snapshot()
        assert (fresh.global_accepted, fresh.global_tried) == (own.global_accepted, own.global_tried) != (0, 0)
    finally:
        eng.close()
