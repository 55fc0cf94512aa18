"""Frequency tests of exactness through the real engine (docs/exactness.md sections 2-3).

For a fixed prompt, the exact law of the first ``W`` generated tokens is computed from
the *target model alone*: the target checkpoint is loaded with plain
``transformers.AutoModelForCausalLM`` (no specdist code), every continuation of length
``W`` is scored in float64, and the sampling transform (temperature, top-k, top-p) is
re-implemented here in numpy. ``N`` sequences are then drawn through
``Engine.from_config(...).generate(...)`` with speculative decoding (k = 3, a model
draft or n-gram prompt lookup) and compared with that law by a G-test.

Statistics (every test): cells are the ``8**W`` sequences of positive target
probability, sorted by expected count; cells with expected count < 5 are pooled (and
the pool merged into the smallest kept cell if it is itself below 5); df = cells - 1;
the threshold is the chi-square upper quantile at ``ALPHA = 1e-4``, so a correct sampler
fails a given test with probability about 1e-4 (seeds are fixed, so each run is
deterministic). Sequences of target probability 0 must never be drawn (checked
separately: a single one fails the test). N, df, G and the threshold are printed.

Power: the draft (a copy of the target with Gaussian noise on its weights, so that
0.4-0.75 of draft tokens are accepted) is far enough from the target that a sampler
returning draft samples would exceed the threshold almost surely (non-central
chi-square power with the Pearson non-centrality ``N * sum (d - p)^2 / p`` over the
same cells, asserted > 0.9999, and total variation asserted > 0.2). For every case the
exact law of a *wrong* speculative sampler (resampling from ``p`` instead of the
residual after a rejection), computed with the engine's own draft-length schedule and
proposals, is also asserted to be detected with power > 0.99.
The acceptance rate read from the outputs' metrics shows that the speculative path
really rejected and resampled (and sometimes accepted everything and drew the bonus).

Suffix and hybrid drafts (end of the file) depend on every earlier request's output, so no
closed-form law of their speculative chain exists: the same G-test against the target's law,
and as negative control a deliberately wrong verifier that the same harness must reject.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from scipy import stats
from support.gtest import (  # noqa: F401  (constants used below)
    ALPHA,
    BATCH,
    MAX_MODEL_LEN,
    MIN_POWER_WRONG_RULE,
    NGRAM_MAX,
    NGRAM_MIN,
    VOCAB,
    Case,
    K,
    N,
    _prob_table,
    draft_stats,
    g_statistic,
    g_test_outputs,
    joint,
    merge_cells,
    power,
    seq_index,
    speculative_law,
)
from support.helpers import case_params, frozen_adaptive_policy, sample_engine, tiny_config

from specdist.engine.local import Engine
from specdist.sampling_params import SamplingParams

# Every case: N = 4000, alpha = 1e-4 (false-failure rate 1e-4). df and threshold depend on the
# merged cells; with the session's tiny target (conftest, seed 1) they are, per case:
# Both couplings (sampling.coupling): gumbel, the default, and rejection, the seed documents' rule.
CASES = [
    Case("model", 2, 2),  # df 33, threshold 72.0
    Case("model", 2, 2, temperature=0.9, top_p=0.8, coupling="rejection"),  # df 8, threshold 31.8
    Case("model", 3, 3),  # df 88, threshold 146.1; drafts of 2, bonus at position 3
    # max_tokens 4: the first step drafts all k = 3 tokens; the first 3 tokens are compared.
    Case("model", 4, 3, temperature=1.2, top_k=5),  # df 78, threshold 133.2
    Case("ngram", 2, 2, coupling="rejection"),  # df 27, threshold 63.2
    Case("ngram", 2, 2, temperature=0.9, top_p=0.8),  # df 3, threshold 21.1 (a peaked target)
    Case("ngram", 3, 3),  # df 79, threshold 134.5
]


def check_outputs_and_acceptance(outs, case: Case) -> float:
    assert len(outs) == N
    assert all(len(o.token_ids) == case.max_tokens for o in outs), "an output does not have max_tokens tokens"
    assert all(o.finish_reason == "length" for o in outs)
    drafted = np.array([o.metrics.drafted for o in outs])
    accepted = np.array([o.metrics.accepted for o in outs])
    rate = accepted.sum() / max(1, drafted.sum())
    all_accepted = int(((drafted > 0) & (accepted == drafted)).sum())  # bonus token drawn
    none_accepted = int(((drafted > 0) & (accepted == 0)).sum())  # rejection at the first position
    print(
        f"  acceptance {rate:.3f} over {drafted.sum()} draft tokens; "
        f"requests with every draft accepted {all_accepted}, with none accepted {none_accepted}"
    )
    assert 0.2 <= rate <= 0.85, f"acceptance rate {rate:.3f}: the test would not exercise both paths"
    assert all_accepted >= N // 50 and none_accepted >= N // 50
    return rate


def run_frequency_case(
    models: dict, case: Case, seed0: int, setup=None, transport: str = "local", kv: str = "slots"
) -> None:
    ptab, margin = _prob_table(models["target"], case)
    assert margin > 1e-5, f"top-k/top-p decision margin {margin:.2e} too small for float32 vs float64"
    p = joint(ptab, case.window)
    assert abs(p.sum() - 1) < 1e-9

    t0 = time.perf_counter()
    outs = sample_engine(models, case, N, seed0, setup=setup, transport=transport, kv=kv)
    elapsed = time.perf_counter() - t0
    print(f"\n{case.id} ({transport}, {kv}): N={N} sequences in {elapsed:.2f}s")
    check_outputs_and_acceptance(outs, case)

    counts = np.bincount([seq_index(o.token_ids[: case.window]) for o in outs], minlength=VOCAB**case.window)
    impossible = np.nonzero((counts > 0) & (p == 0))[0]
    assert impossible.size == 0, f"sequences of target probability 0 were drawn: {impossible[:5]}"
    cells = merge_cells(p, N)
    df = len(cells) - 1
    assert df >= 3
    threshold = stats.chi2.isf(ALPHA, df)
    g = g_statistic(counts, p, cells)
    print(f"  G = {g:.1f}, df = {df}, threshold (alpha {ALPHA:g}) = {threshold:.1f}")

    # Power. The analytic law of the algorithm must be the target's (checks this harness)...
    qtab = _prob_table(models["draft"], case)[0] if case.method == "model" else None
    exact = speculative_law(ptab, qtab, case, "exact")
    assert np.abs(exact - p).max() < 1e-9
    # ...a sampler returning draft samples would fail...
    if qtab is not None:
        d = joint(qtab, case.window)
        tv = 0.5 * np.abs(d - p).sum()
        lam, pw = power(d, p, cells, N)
        print(f"  draft-only sampler: TV {tv:.3f}, non-centrality {lam:.0f}, power {pw:.6f}")
        assert tv > 0.2 and pw > 0.9999
    # ...and so would resampling from p instead of the residual.
    wrong = speculative_law(ptab, qtab, case, "resample_from_p")
    lam, pw = power(wrong, p, cells, N)
    tv = 0.5 * np.abs(wrong - p).sum()
    print(f"  resample-from-p sampler: TV {tv:.3f}, non-centrality {lam:.0f}, power {pw:.4f}")
    assert pw >= MIN_POWER_WRONG_RULE

    assert g <= threshold, f"{case.id}: G = {g:.1f} > {threshold:.1f} (df {df}, N {N}): not the target distribution"


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["slots", "paged"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_engine_samples_target_distribution(models, case: Case, kv: str) -> None:
    """G-test, N = 4000, alpha 1e-4 = false-failure rate; df / threshold per case next to CASES (and printed).
    Through either KV cache (the paged one with other seeds: independent samples)."""
    run_frequency_case(
        models, case, seed0=1_000_000 * (CASES.index(case) + 1) + (700_000_000 if kv == "paged" else 0), kv=kv
    )


REMOTE_CASES = [CASES[1], CASES[0]]  # model drafts: q on the wire (rejection), token ids only (gumbel)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.replicas
@pytest.mark.parametrize("case", REMOTE_CASES, ids=[c.id for c in REMOTE_CASES])
def test_serve_replicas_sample_target_distribution(local_ray, models, case: Case) -> None:
    """The same G-test through two Ray Serve replicas behind the router (cluster/serve.py; round-robin, so each
    replica draws about half): N = 4000, alpha 1e-4 per case, other seeds than the other runs; the analytic
    negative controls as every case."""
    run_frequency_case(models, case, seed0=900_000_000 + 1_000_000 * CASES.index(case), transport="serve")


@pytest.mark.slow
@pytest.mark.parametrize("case", REMOTE_CASES, ids=[c.id for c in REMOTE_CASES])
def test_remote_transport_samples_target_distribution(models, case: Case) -> None:
    """The same G-test through the gRPC transports (q encoded, sent, decoded; seeds derived on the
    workers): N = 4000, alpha 1e-4 per case, other seeds than the local run."""
    run_frequency_case(models, case, seed0=500_000_000 + 1_000_000 * CASES.index(case), transport="remote")


def test_generate_with_more_prompts_than_slots(tiny_models) -> None:
    """generate() must queue prompts beyond max_batch_size, not crash (continuous batching).

    Regression: Engine._admit once popped every waiting request while ``num_free > 0``
    without counting the ones already taken, so 10 prompts on 4 slots raised
    ``RuntimeError: KV cache has no free slot``.
    """
    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=3, max_batch_size=4))
    params = SamplingParams(max_tokens=3, seed=0, ignore_eos=True)
    outs = eng.generate([[1, 2, 3]] * 10, params)
    assert len(outs) == 10
    assert all(len(o.token_ids) == 3 and o.finish_reason == "length" for o in outs)
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_adaptive_draft_length_samples_target_distribution(models) -> None:
    """The adaptive rule picks k per request from its past acceptances; the output law must not
    change. Costs frozen (:func:`frozen_adaptive_policy`), chosen so that k ranges over 0..K with the observed
    acceptance. G-test as above: N = 4000, alpha 1e-4, case model-4-3 T=1.2 top-k 5 (df 78, threshold 133.2)."""
    chosen: list[int] = []

    def setup(eng) -> None:
        eng.scheduler.length_policy = frozen_adaptive_policy(K, chosen)

    case = CASES[3]  # 4 tokens, so a first step may draft up to K = 3
    run_frequency_case(models, case, seed0=77_000_000, setup=setup)
    counts = np.bincount(chosen, minlength=K + 1)
    print(f"  draft lengths chosen (k = 0..{K}): {counts.tolist()}")
    assert (counts > len(chosen) // 100).sum() >= 3, f"the rule should use several draft lengths: {counts}"


# ----------------------------------------------------------------------------- suffix and hybrid drafts
# The suffix index is shared by every request of the drafter, so a request's drafts depend on what the
# requests before it emitted (4000 requests, one prompt: the drafts follow the most frequent earlier
# continuations, with ``suffix_cache_requests`` of them held, the older ones evicted as the run goes).
# No closed-form law of the speculative chain exists for that (speculative_law does not apply); the
# output law must still be the target's. Same G-test: N = 4000, alpha 1e-4 (false-failure rate).
SUFFIX_CASES = [
    # df 79, threshold 134.5 (the cells of ngram-T1.0-L3: same prompt, same window)
    (Case("suffix", 3, 3), {"suffix_cache_requests": 64}),
    # the adaptive rule: proposals made in full, then cut by the price of each position's match length
    (Case("suffix", 3, 3), {"suffix_cache_requests": 64, "length_policy": "adaptive"}),
    # hybrid (df 73, threshold 126.7): the target's int8 copy drafts unless the suffix draft's score reaches 1.0; both
    # are used
    (Case("hybrid", 4, 3, temperature=1.2, top_k=5), {"suffix_min_score": 1.0, "suffix_cache_requests": 64}),
]


def sample_suffix_engine(models: dict, case: Case, n: int, seed0: int, draft: dict, kv: str = "slots"):
    cfg = tiny_config(
        models, method=case.method, k=K, max_batch_size=BATCH, max_model_len=MAX_MODEL_LEN, kv_cache=kv, kv_block_size=4
    )
    cfg["draft"].update(draft)
    cfg["sampling"] = {"coupling": case.coupling}
    eng = Engine.from_config(cfg)
    if draft.get("length_policy") == "adaptive":
        # deterministic choices: how much is drafted must not vary
        eng.scheduler.length_policy = frozen_adaptive_policy(K)
    params = case_params(case, n, seed0)
    return eng.generate([list(case.prompt)] * n, params), eng


def suffix_g_test(models, case: Case, n: int, seed0: int, draft: dict, kv: str = "slots") -> tuple[float, float, dict]:
    """(G, threshold, stats) of n engine samples against the target's exact law of the window."""
    ptab, margin = _prob_table(models["target"], case)
    assert margin > 1e-5
    p = joint(ptab, case.window)
    t0 = time.perf_counter()
    outs, eng = sample_suffix_engine(models, case, n, seed0, draft, kv)
    assert all(len(o.token_ids) == case.max_tokens and o.finish_reason == "length" for o in outs)
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
    h = eng.draft_core.health()
    st = draft_stats(outs) | h
    g, threshold, df = g_test_outputs(outs, p, case.window)
    print(
        f"\n{case.id}: N={n} in {time.perf_counter() - t0:.1f}s; acceptance {st['acceptance']:.3f} over "
        f"{st['drafted']} draft tokens, every draft accepted {st['all']}, none {st['none']}; "
        f"G = {g:.1f}, df = {df}, threshold {threshold:.1f}; drafter {h}"
    )
    return g, threshold, st


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,draft", SUFFIX_CASES, ids=[c.id + ("-adaptive" if d.get("length_policy") else "") for c, d in SUFFIX_CASES]
)
@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_suffix_drafts_sample_target_distribution(models, case: Case, draft: dict, kv: str) -> None:
    """G-test, N = 4000, alpha 1e-4 (false-failure rate); df and threshold next to SUFFIX_CASES (and printed).
    Through either KV cache (the paged one with other seeds)."""
    seed0 = 300_000_000 + 1_000_000 * SUFFIX_CASES.index((case, draft)) + (700_000_000 if kv == "paged" else 0)
    g, threshold, st = suffix_g_test(models, case, N, seed0, draft, kv)
    # the speculative path really ran: drafts proposed, rejected at the first position and accepted whole
    assert st["drafted"] >= N and st["all"] >= N // 50 and st["none"] >= N // 50, st
    if case.method == "hybrid":
        assert st["hybrid_suffix_drafts"] >= N // 20 and st["hybrid_model_drafts"] >= N // 20, st
    assert st["suffix_cached_requests"] == 64  # the index evicted as it went
    assert g <= threshold, f"{case.id}: G = {g:.1f} > {threshold:.1f}: not the target distribution"


@pytest.mark.parametrize("kv", ["slots", "paged"])
def test_suffix_harness_detects_a_wrong_verifier(models, monkeypatch, kv: str) -> None:
    """Negative control through the same harness: the verifier resamples from p instead of the
    residual after a rejection (tests/engine/test_exactness_enumeration.py's wrong rule). With suffix
    drafts (mostly the target's likely tokens) that over-weights them; N = 1500 sequences,
    alpha 1e-4: G must exceed the threshold (seeds fixed: deterministic)."""
    from test_exactness_enumeration import _wrong_verifier

    monkeypatch.setattr("specdist.cores.verify_batch.rejection_sample", _wrong_verifier("resample_from_p"))
    case, draft = SUFFIX_CASES[0]
    case = dataclasses.replace(case, coupling="rejection")  # the rule this control breaks
    g, threshold, st = suffix_g_test(models, case, 1500, 310_000_000, draft, kv)
    assert st["none"] >= 1500 // 50, st  # rejections happened: the wrong rule was exercised
    assert g > threshold, f"the wrong verifier was not detected: G = {g:.1f} <= {threshold:.1f}"


# ----------------------------------------------------------------------------- Gumbel noise controls
def _wrong_noise(kind: str):
    """row_starts that break what Gumbel-max coupling needs (specdist/cores/coupling.py): the same noise
    row at every position of a request, or the same rows for every request (the key ignored)."""
    from specdist.cores.coupling import row_starts

    if kind == "position":
        return lambda key, positions: row_starts(key, [0 for _ in positions])
    return lambda key, positions: row_starts(0, positions)


@pytest.mark.parametrize("kv", ["slots", "paged"])
@pytest.mark.parametrize("kind", ["position", "request"])
def test_gumbel_harness_detects_wrong_noise(models, monkeypatch, kind: str, kv: str) -> None:
    """Negative controls of the Gumbel G-tests: noise not keyed by position (tokens of a request
    correlated), noise shared across requests (every request the same tokens). Case model-L2 at
    T = 1 (df 37), N = 1500 sequences, alpha 1e-4: G must exceed the threshold (seeds fixed:
    deterministic); the same harness passes the correct noise in test_engine_samples_target_distribution."""
    wrong = _wrong_noise(kind)
    monkeypatch.setattr("specdist.cores.verify_batch.row_starts", wrong)
    monkeypatch.setattr("specdist.cores.proposers.model.row_starts", wrong)
    case, n = CASES[0], 1500
    p = joint(_prob_table(models["target"], case)[0], case.window)
    outs = sample_engine(models, case, n, seed0=330_000_000, kv=kv)
    counts = np.bincount([seq_index(o.token_ids[: case.window]) for o in outs], minlength=VOCAB**case.window)
    cells = merge_cells(p, n)
    g, threshold = g_statistic(counts, p, cells), stats.chi2.isf(ALPHA, len(cells) - 1)
    print(f"\nwrong noise ({kind}): G = {g:.1f}, threshold {threshold:.1f}")
    assert g > threshold, f"noise {kind}-independent was not detected: G = {g:.1f} <= {threshold:.1f}"


def test_truncated_q_samples_target_distribution(models) -> None:
    """draft.q_top_k = 3 of the 8 tokens under the rejection coupling: the draft samples from its q's
    top 3, renormalised, and sends exactly that (bounded bytes whatever the vocabulary); the output
    law stays the target's. G-test as above, case model-L3 at T = 1 (df 88), N = 4000, alpha 1e-4."""
    support: list[int] = []

    def setup(eng) -> None:
        eng.draft_core.proposer.q_top_k = 3
        drafter = eng.scheduler.replicas[0].drafter
        propose = drafter.propose

        def recording(items):
            proposals, timing = propose(items)
            for p in proposals:
                if p.q is not None:
                    support.extend((p.q > 0).sum(-1).tolist())
                    assert all(float(p.q[j, t]) > 0 for j, t in enumerate(p.token_ids))
            return proposals, timing

        drafter.propose = recording

    run_frequency_case(models, dataclasses.replace(CASES[2], coupling="rejection"), seed0=340_000_000, setup=setup)
    assert support and max(support) == 3  # every q row sent kept 3 tokens
