"""Confidence-stopped drafts (``draft.confidence_threshold``): shorter drafts, same distribution.

The stopping rule looks only at the draft's own distribution, so exactness must hold.
Frequency test: N = 4000 sequences of 3 tokens through ``Engine.generate``, G-test
against the exact target law with cells merged to expected count >= 5, significance
1e-4 (false-failure rate 1e-4 for a correct sampler; seeds fixed, so deterministic).
"""

from __future__ import annotations

import numpy as np
from scipy import stats
from support.gtest import (
    ALPHA,
    VOCAB,
    Case,
    N,
    _prob_table,
    g_statistic,
    joint,
    merge_cells,
    seq_index,
)
from support.helpers import tiny_config

from specdist import Engine, SamplingParams

K = 3
THRESHOLD = 0.6


def test_confidence_stop_keeps_target_distribution(models):
    case = Case("model", 3, 3)
    cfg = tiny_config(models, "model", K, max_batch_size=256, max_model_len=32)
    cfg["draft"]["confidence_threshold"] = THRESHOLD
    eng = Engine.from_config(cfg)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=7_000_000 + i, ignore_eos=True) for i in range(N)]
    outs = eng.generate([list(case.prompt)] * N, params)

    steps = sum(o.metrics.steps for o in outs)
    drafted = sum(o.metrics.drafted for o in outs)
    # Without the rule every first step drafts min(K, max_tokens - 1) = 2 tokens; early stops draft fewer.
    assert drafted < 2 * steps, "the confidence rule never shortened a draft"
    assert sum(o.metrics.accepted for o in outs) > 0

    ptab, _ = _prob_table(models["target"], case)
    p = joint(ptab, case.window)
    counts = np.bincount([seq_index(o.token_ids) for o in outs], minlength=VOCAB**3)
    assert not np.any((counts > 0) & (p == 0))
    cells = merge_cells(p, N)
    threshold = stats.chi2.isf(ALPHA, len(cells) - 1)
    g = g_statistic(counts, p, cells)
    assert g <= threshold, f"G = {g:.1f} > {threshold:.1f}"
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_confidence_stop_greedy_equals_target(tiny_models):
    prompts = [[1, 2, 3], [4, 5], [6, 1, 2, 3, 4]]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = Engine.from_config(tiny_config(tiny_models, "none")).generate(prompts, sp)
    cfg = tiny_config(tiny_models, "model", 5)
    cfg["draft"]["confidence_threshold"] = 0.5
    outs = Engine.from_config(cfg).generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_confidence_threshold_is_validated():
    import pytest

    from specdist.config import load_config
    from specdist.errors import ConfigError

    for bad in (1.0, -0.1, "high", True):
        with pytest.raises(ConfigError, match="draft.confidence_threshold"):
            load_config({"draft": {"method": "self-w8", "confidence_threshold": bad}})


def test_cost_fits_see_planned_lengths_when_samples_cut_drafts(tiny_models, monkeypatch):
    """With the confidence threshold, how long a draft came out depends on draft tokens sampled past
    the first rejection, with uniforms of positions the next steps draft again. The cost fits (which
    steer later lengths) must see the lengths the rule chose, never the realised ones."""
    from specdist.engine.draft_length import DraftLengthPolicy

    seen = {"draft": [], "verify": []}
    draft_obs, verify_obs = DraftLengthPolicy.observe_draft, DraftLengthPolicy.observe_verify
    monkeypatch.setattr(
        DraftLengthPolicy,
        "observe_draft",
        lambda self, rep, passes, rows, s: (
            seen["draft"].append((passes, rows)) or draft_obs(self, rep, passes, rows, s)
        ),
    )
    monkeypatch.setattr(
        DraftLengthPolicy,
        "observe_verify",
        lambda self, tokens, s, batch=None: (
            seen["verify"].append((tokens, batch)) or verify_obs(self, tokens, s, batch)
        ),
    )
    cfg = tiny_config(tiny_models, "model", 4)
    cfg["draft"].update(confidence_threshold=0.9, length_policy="fixed")  # fixed: every step plans k = 4
    eng = Engine.from_config(cfg)
    outs = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True))
    assert outs[0].metrics.drafted < 4 * outs[0].metrics.steps  # the threshold did cut drafts
    planned = [(p, r) for p, r in seen["draft"]]
    assert len(planned) > 4 and all(p == r == 4 for p, r in planned[:-4])  # k = 4 planned (bar the last steps: caps)
    assert all(tokens == 5 for tokens, batch in [v for v in seen["verify"] if v[1] is not None][:-4])
