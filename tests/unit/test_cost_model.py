"""Tests for the idealised cost model (docs/exactness.md, section 7) and its plot."""

from __future__ import annotations

import dataclasses
import math

import pytest

from specdist.bench.cost_plot import plot_speedup
from specdist.engine.cost_model import (
    CostReport,
    acceptance_rate_from_distributions,
    best_k,
    expected_tokens,
    predicted_tokens_per_second,
    report,
    speedup,
    step_cost,
)


def test_worked_numbers_from_spec() -> None:
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616, abs=1e-12)
    assert step_cost(4, 0.1) == pytest.approx(1.4)
    assert round(speedup(0.8, 4, 0.1), 3) == 2.401
    assert round(speedup(0.2, 4, 0.1), 3) == 0.893
    assert speedup(0.2, 4, 0.1) < 1.0  # speculation makes it slower


def test_expected_tokens_matches_series() -> None:
    for alpha in (0.0, 0.1, 0.5, 0.9, 0.999999):
        for k in (0, 1, 3, 10):
            assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_alpha_one_limit() -> None:
    for k in (0, 1, 4, 32):
        assert expected_tokens(1.0, k) == k + 1
        assert expected_tokens(1 - 1e-12, k) == pytest.approx(k + 1, rel=1e-9)
    assert speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)


def test_k_zero_is_plain_decoding() -> None:
    for alpha in (0.0, 0.3, 1.0):
        assert expected_tokens(alpha, 0) == 1.0
        assert speedup(alpha, 0, 0.5) == 1.0


def test_alpha_above_c_guarantees_speedup() -> None:
    grid = [i / 20 for i in range(21)]
    for alpha in grid:
        for c in grid:
            if alpha > c:
                k, s = best_k(alpha, c)
                assert k >= 1
                assert s >= (1 + alpha) / (1 + c) - 1e-12
                assert s == pytest.approx(speedup(alpha, k, c))


def test_best_k_no_gain_returns_zero() -> None:
    assert best_k(0.0, 0.1) == (0, 1.0)
    assert best_k(0.5, 1.0, k_max=0) == (0, 1.0)


def test_acceptance_rate_from_distributions() -> None:
    p = [0.5, 0.3, 0.2, 0.0]
    assert acceptance_rate_from_distributions(p, p) == pytest.approx(1.0)
    assert acceptance_rate_from_distributions([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.4, 0.6]) == 0.0
    # sum min = 0.4 + 0.3 + 0.1 = 0.8, i.e. 1 - TV with TV = 0.2
    assert acceptance_rate_from_distributions([0.6, 0.3, 0.1], [0.4, 0.4, 0.2]) == pytest.approx(0.8)


def test_predicted_tokens_per_second() -> None:
    # 3.3616 tokens per step, step takes 20 ms + 4 * 2 ms + 2 ms = 30 ms.
    tps = predicted_tokens_per_second(0.8, 4, 0.020, 0.002, 0.002)
    assert tps == pytest.approx(3.3616 / 0.030)
    assert predicted_tokens_per_second(0.5, 0, 0.01, 0.5) == pytest.approx(100.0)


def test_report_and_format() -> None:
    r = report(0.8, 4, 0.1)
    assert isinstance(r, CostReport)
    assert (r.alpha, r.k, r.draft_cost) == (0.8, 4, 0.1)
    assert r.speedup == pytest.approx(speedup(0.8, 4, 0.1))
    text = r.format()
    assert "3.3616" in text and "1.400" in text and "2.401" in text
    assert "faster" in text and "not a measured speedup" in text
    assert "slower" in report(0.2, 4, 0.1).format()
    with pytest.raises(AttributeError):
        r.k = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: expected_tokens(1.5, 4), "alpha"),
        (lambda: expected_tokens(-0.1, 4), "alpha"),
        (lambda: expected_tokens(math.nan, 4), "alpha"),
        (lambda: expected_tokens(0.5, -1), "k"),
        (lambda: expected_tokens(0.5, 2.0), "k"),
        (lambda: step_cost(2, -0.1), "draft_cost"),
        (lambda: speedup(0.5, 2, math.inf), "draft_cost"),
        (lambda: best_k(0.5, 0.1, k_max=-1), "k_max"),
        (lambda: acceptance_rate_from_distributions([1.0, 0.0], [0.5]), "same length"),
        (lambda: acceptance_rate_from_distributions([-0.5, 1.5], [0.5, 0.5]), "^p must"),
        (lambda: acceptance_rate_from_distributions([0.5, 0.5], [0.5, 0.2]), "^q must sum to 1"),
        (lambda: predicted_tokens_per_second(0.5, 2, -1.0, 0.1), "t_verify"),
        (lambda: predicted_tokens_per_second(0.5, 2, 0.1, -1.0), "t_draft_token"),
        (lambda: predicted_tokens_per_second(0.5, 2, 0.1, 0.1, -1.0), "t_overhead"),
        (lambda: predicted_tokens_per_second(0.5, 2, 0.0, 0.0), "> 0"),
    ],
)
def test_invalid_arguments_raise(call, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


def test_alpha_error_message() -> None:
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\], got 1.5"):
        expected_tokens(1.5, 4)


def test_plot_writes_png(tmp_path) -> None:
    out = tmp_path / "speedup.png"
    assert plot_speedup(out, draft_cost=0.1, ks=(1, 2, 4, 8), points=51) == out
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 1000


# ----------------------------------------------------------------------------- pipelined drafting
def test_pipelined_report_by_hand() -> None:
    from specdist.engine.cost_model import pipelined_report

    # alpha 0.9, k 3, c 0.25, guess 0.9: h = 0.729 * 0.9 = 0.6561; the k + 1 = 4 prepared passes
    # take exactly one verification; a miss adds 3 * 0.25
    r = pipelined_report(0.9, 3, 0.25, 0.9)
    assert r.hit_rate == pytest.approx(0.6561)
    assert r.sequential_time == pytest.approx(1.75) and r.sequential_tokens == pytest.approx(3.439)
    assert r.pipelined_time == pytest.approx(1.0 + (1 - 0.6561) * 0.75)
    assert r.pipelined_tokens == pytest.approx(3.439)
    assert r.gain == pytest.approx(1.75 / (1.0 + 0.3439 * 0.75))
    # preparation longer than verification: the step waits for it
    assert pipelined_report(0.9, 3, 0.5, 0.9).pipelined_time == pytest.approx(2.0 + 0.3439 * 1.5)
    # auto, for one request alone in its steps: every miss redrafted
    assert pipelined_report(0.9, 3, 0.25, 0.9, miss="auto") == dataclasses.replace(r, miss="auto")
    # skip: pi = b / (b + 1 - h) of the steps have drafts, the others emit one token
    s = pipelined_report(0.9, 3, 0.25, 0.9, miss="skip")
    pi = 0.9 / (0.9 + 1 - 0.6561)
    assert s.pipelined_time == pytest.approx(1.0) and s.pipelined_tokens == pytest.approx(pi * 3.439 + 1 - pi)
    # nothing to hide (free drafts) or nothing ever hit: no gain from pipelining with redraft, and a
    # loss when the preparation outlasts the verification
    assert pipelined_report(0.9, 3, 0.0, 0.9).gain == pytest.approx(1.0)
    assert pipelined_report(0.9, 3, 0.25, 0.0).gain == pytest.approx(1.0)
    assert pipelined_report(0.9, 3, 0.5, 0.0).gain < 1.0


def test_pipelined_report_rejects_bad_input() -> None:
    from specdist.engine.cost_model import pipelined_report

    with pytest.raises(ValueError, match="guess_hit"):
        pipelined_report(0.9, 3, 0.25, 1.5)
    with pytest.raises(ValueError, match="miss"):
        pipelined_report(0.9, 3, 0.25, 0.5, miss="later")


def test_cost_model_cli_pipeline(capsys) -> None:
    from specdist.cli import main

    assert main(["cost-model", "--alpha", "0.9", "--k", "3", "--draft-cost", "0.25", "--pipeline"]) == 0
    out = capsys.readouterr().out
    assert "pipelined / sequential tokens per time = 1.391" in out
    with pytest.raises(SystemExit) as e:
        main(["cost-model", "--alpha", "0.9", "--k", "3", "--pipeline", "--guess-hit", "2"])
    assert e.value.code == 2 and "guess_hit must be in [0, 1]" in capsys.readouterr().err
