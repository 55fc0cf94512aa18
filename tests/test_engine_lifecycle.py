"""Nothing a request held outlives it when generate() is interrupted mid-run."""

from __future__ import annotations

import pytest

from conftest import tiny_config
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
