"""specdist/bench/router_drafting.py: a session's turns held on one engine against round robin, in process."""

from __future__ import annotations

import pytest
from support.helpers import tiny_config

from specdist.bench.router_drafting import PLACEMENTS, placement, run
from specdist.bench.router_live import LiveTurn, Plan
from specdist.engine.local import Engine


def test_placements_choose_as_documented():
    held = placement("held", 3)
    assert [held(s) for s in ("a", "b", "a", None, "c", "b", "a", None)] == [0, 1, 0, 2, 0, 1, 0, 1]
    rr = placement("round-robin", 3)
    assert [rr(s) for s in ("a", "a", "a", "a")] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="unknown placement"):
        placement("random", 3)


@pytest.mark.parametrize("retokenize", [False, True])
def test_both_placements_emit_the_same_tokens_and_count_every_step(tiny_models, retokenize):
    """With the Gumbel coupling the tokens do not depend on the drafts: held and round robin give every request
    the same output, so their tokens a step differ by the drafting alone (answers sent back as ids or as text
    encoded again); every session's turns stay on one engine when held and move when not; the steps counted are
    the requests' own."""
    cfg = tiny_config(tiny_models, method="suffix", k=3, max_model_len=128)
    first = Engine.from_config(cfg)
    engines = [first, Engine.from_config(cfg, tokenizer=first.tokenizer, target=first.target_core.runner.model)]
    words = "a b c d e f".split()
    groups = [
        [LiveTurn(f"s{s}-t{t}", f"s{s}", "chat", " ".join(words[(s + t) % 6 :] + words[:2]), 6) for t in range(3)]
        for s in range(3)
    ]
    p = Plan(groups)
    held, rr = (run(engines, p, 2, 0.8, "x", n, retokenize) for n in PLACEMENTS)
    assert sorted(held.tokens) == sorted(rr.tokens) == sorted(t.rid for g in groups for t in g)
    assert held.tokens == rr.tokens and all(len(v) == 6 for v in held.tokens.values())
    for g in groups:
        assert len({held.engine_of[t.rid] for t in g}) == 1
    assert any(len({rr.engine_of[t.rid] for t in g}) > 1 for g in groups)
    for d in (held, rr):
        assert d.emitted == 9 * 6 and 9 <= d.steps <= d.emitted and d.accepted <= d.drafted
        assert d.tokens_per_step == d.emitted / d.steps


def test_bad_arguments_are_one_line_errors(tmp_path):
    from specdist.bench.router_drafting import main

    with pytest.raises(SystemExit, match="--engines must be >= 1, got 0"):
        main(["--config", "configs/replicas.yaml", "--engines", "0"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("draft:\n  method: ngram\n")
    with pytest.raises(SystemExit, match="draft.method is 'ngram'; this compares suffix drafting"):
        main(["--config", str(cfg)])
