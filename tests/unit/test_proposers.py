"""The draft methods as proposers (specdist/cores/proposers/): the registry, and the interface as a new method
sees it.

A method is a Proposer subclass in a module of its own, registered by name; the drafter core keeps the
requests. The smallest method shows what one needs: a proposer that repeats each request's last token, written
here in a few lines, drafts through the unchanged core and scheduler, and greedy output stays plain decoding
whatever it proposes (the target decides every token).
"""

from __future__ import annotations

import pytest

from support.helpers import tiny_config
from specdist import Engine, SamplingParams
from specdist.config import DRAFT_METHODS
from specdist.cores.proposers import proposer_class, proposer_methods
from specdist.cores.proposers.base import PROPOSERS, Draft, DraftRequest, Proposer
from specdist.errors import ConfigError


def test_every_config_method_has_its_proposer_and_no_other():
    assert set(proposer_methods()) == set(DRAFT_METHODS) - {"none"}
    for name in proposer_methods():
        assert name in proposer_class(name).methods
    with pytest.raises(ConfigError, match=r"config draft\.method: no draft method 'lookahead'; there are eagle3, "):
        proposer_class("lookahead")


class RepeatLast(Proposer):
    """Proposes its request's last committed token k times; its state is how many steps it drafted."""

    methods = ("repeat-last",)

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    @classmethod
    def build(cls, dc, ctx) -> "RepeatLast":
        return cls(ctx.vocab_size)

    def start(self, r: DraftRequest) -> None:
        r.state = 0

    def commit(self, r: DraftRequest, kept, n_acc, prev, prepared, hidden) -> None:
        assert r.seq[prev:] == kept  # the core appended what the target kept before calling
        r.state += 1

    def propose(self, reqs: list[DraftRequest], ks: list[int]) -> list[Draft]:
        return [Draft([r.seq[-1]] * k) for r, k in zip(reqs, ks)]


def test_a_new_method_is_a_proposer_the_core_and_scheduler_drive_unchanged(tiny_models):
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 3, 3], [4, 5, 4, 5, 4]]
    plain = [o.token_ids for o in Engine.from_config(tiny_config(tiny_models, "none", 1)).generate(prompts, sp)]
    eng = Engine.from_config(tiny_config(tiny_models, "ngram", 3))
    eng.draft_core.proposer = RepeatLast(eng.vocab_size)  # a model-free method in place of prompt lookup
    assert [o.token_ids for o in eng.generate(prompts, sp)] == plain
    assert eng.stats.drafted > 0 and eng.draft_core.requests == {}
    assert "repeat-last" not in PROPOSERS  # not registered: @register is what makes it a draft.method
