"""Nothing a request held outlives it when generate() is interrupted mid-run."""

from __future__ import annotations

import pytest
from support.helpers import tiny_config

from specdist import Engine, SamplingParams


def test_interrupted_generate_releases_everything(tiny_models):
    eng = Engine.from_config(tiny_config(tiny_models, "model", 3, max_batch_size=2))
    real_step, calls = eng.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    eng.step = failing_step
    with pytest.raises(KeyboardInterrupt):
        eng.generate([[1, 2], [3], [4, 5, 6]], SamplingParams(max_tokens=20, ignore_eos=True))
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
    assert not eng.running and not eng.waiting
    eng.step = real_step
    out = eng.generate([[1, 2]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_admission_stops_at_max_prefill_tokens(tiny_models):
    """engine.max_prefill_tokens bounds the prompt tokens one step admits (the first request is
    always admitted, however long); the rest wait for later steps and finish the same."""
    prompts = [[1] * 10, [2] * 10, [3] * 10, [4] * 30]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # > 3 steps of k + 1 = 4 tokens
    want = [o.token_ids for o in Engine.from_config(tiny_config(tiny_models)).generate(prompts, params)]
    eng = Engine.from_config(tiny_config(tiny_models, max_prefill_tokens=20))
    reqs = [eng.add_request(p, params) for p in prompts]
    eng.step()
    assert eng.running == reqs[:2] and list(eng.waiting) == reqs[2:]  # 10 + 10 fit; a third would make 30
    eng.step()
    assert eng.running == reqs[:3] and list(eng.waiting) == reqs[3:]  # 10 + 30 would not fit
    eng.step()
    assert eng.running == reqs and not eng.waiting  # 30 > 20, but alone it is admitted
    while eng.has_unfinished():
        eng.step()
    assert [r.output.token_ids for r in reqs] == want
