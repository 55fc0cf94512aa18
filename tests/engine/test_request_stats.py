"""Per-request stats agree with the output: draft positions past a stop do not count."""

from __future__ import annotations

from support.helpers import tiny_config

from specdist import Engine, SamplingParams


def test_a_request_that_stops_at_once_reports_no_phantom_drafts(tiny_models) -> None:
    eng = Engine.from_config(tiny_config(tiny_models, method="self-w8", k=3))
    prompt = [1, 2, 3]
    first = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    # The first step drafts k = 3 tokens (fixed rule); the int8 self-draft agrees with the
    # target, so the drafts after the stop token would be accepted too: they must not count.
    out = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first]))[0]
    m = out.metrics
    assert out.token_ids == [] and out.finish_reason == "stop" and out.stop_reason == first
    assert m.steps == 1 and m.drafted == 1 and m.accepted == 1  # only the position that held the stop token
    assert m.emitted == 1 and m.mean_accepted_length == 1.0


def test_steps_and_emitted_tokens_agree_without_drafts(tiny_models) -> None:
    eng = Engine.from_config(tiny_config(tiny_models, method="none"))
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=40, temperature=0))[0]
    m = out.metrics
    stopped_by_token = out.finish_reason == "stop"
    assert m.emitted == len(out.token_ids) + (1 if stopped_by_token else 0)
    assert m.steps == m.emitted and m.mean_accepted_length == 1.0  # one token per step, the stop token included
