"""The draft methods as proposers (specdist/cores/proposers/): the registry, and the interface as a new method
sees it.

A method is a Proposer subclass in a module of its own, registered by name; the drafter core keeps the
requests. The smallest method shows what one needs: a proposer that repeats each request's last token, written
here in a few lines, drafts through the unchanged core and scheduler, and greedy output stays plain decoding
whatever it proposes (the target decides every token). Written as a module file and dropped into the package's
folder, it is a ``draft.method`` of the config, with a setting of its own, and nothing else is edited: the
config, the engines, the scheduler and the deployment read its name, traits and settings off the registry.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
from support.helpers import tiny_config

from specdist import Engine, SamplingParams
from specdist.config import load_config
from specdist.cores import proposers
from specdist.cores.proposers import check_draft, draft_dtype, draft_traits, proposer_class, proposer_methods
from specdist.cores.proposers.base import PROPOSERS, Draft, DraftRequest, Proposer
from specdist.errors import ConfigError
from specdist.transport.protocol import DraftTraits

SHIPPED = ("eagle3", "hybrid", "model", "ngram", "self-w4", "self-w8", "suffix")


def test_the_registry_serves_every_shipped_method_and_refuses_others():
    assert proposer_methods() == SHIPPED
    for name in proposer_methods():
        assert name in proposer_class(name).methods
    with pytest.raises(ConfigError, match=r"config draft\.method: no draft method 'lookahead'; there are eagle3, "):
        proposer_class("lookahead")
    cfg = load_config({"draft": {"method": "lookahead"}})  # the config sits below the methods: it takes the name
    with pytest.raises(ConfigError, match=r"draft\.method: no draft method 'lookahead'"):
        check_draft(cfg.draft)  # which everything that serves a config calls first
    with pytest.raises(ConfigError, match=r"draft\.method: no draft method 'lookahead'"):
        Engine.from_config(cfg)


def test_what_the_config_cannot_check_the_methods_do():
    """draft.model exactly with the methods that read one; keys no method has; a method's own values."""

    def refused(draft: dict) -> str:
        with pytest.raises(ConfigError) as e:
            check_draft(load_config({"draft": draft}).draft)
        return str(e.value)

    assert (
        "draft.model: must be a non-empty string, got None (method 'model' drafts with the model named here)"
        in refused({"method": "model"})
    )
    assert "(method 'eagle3' drafts" in refused({"method": "eagle3"})
    assert "draft.model: is only used with methods 'eagle3' and 'model', not 'ngram'" in refused(
        {"method": "ngram", "model": "m"}
    )
    assert "draft.model: is only used with" in refused({"method": "none", "model": "m"})
    assert "draft.ngram_mx: unknown key (expected one of: confidence_threshold, " in refused(
        {"method": "ngram", "ngram_mx": 2}
    )
    assert "draft.ngram_max: must be an integer in [3, 64], got 2" in refused(
        {"method": "ngram", "ngram_min": 3, "ngram_max": 2}
    )
    assert "draft.ngram_min: must be an integer, got 'x'" in refused({"method": "ngram", "ngram_min": "x"})
    # another method's keys are accepted and unused, as a config switched between methods keeps them
    assert check_draft(load_config({"draft": {"method": "ngram", "suffix_max_depth": 6}}).draft) is proposer_class(
        "ngram"
    )
    assert check_draft(load_config({"draft": {"method": "none"}}).draft) is None
    # the config round-trips with the methods' keys where a file has them
    d = load_config({"draft": {"method": "suffix", "suffix_max_depth": 6}}).to_dict()["draft"]
    assert d["suffix_max_depth"] == 6 and "settings" not in d
    assert load_config({"draft": d}).draft.settings == {"suffix_max_depth": 6}


def test_traits_come_from_the_method():
    def traits(**draft) -> DraftTraits:
        return draft_traits(load_config({"draft": draft}).draft)

    assert traits(method="ngram") == DraftTraits(model_free=True)
    assert traits(method="suffix", confidence_threshold=0.5) == DraftTraits(model_free=True)
    assert traits(method="self-w8", pipeline=True, confidence_threshold=0.5) == DraftTraits(
        pipelined=True, sampled_lengths=True
    )
    assert traits(method="hybrid", pipeline=True) == DraftTraits()  # its suffix drafts are not prepared ahead
    assert traits(method="eagle3", model="h", pipeline=True) == DraftTraits(pipelined=True)
    assert traits(method="none", pipeline=True) == DraftTraits()
    mixed = {"target": {"dtype": "bfloat16"}, "draft": {"dtype": "float16"}}
    for method, dtype in (("self-w4", "bfloat16"), ("hybrid", "bfloat16"), ("ngram", "float16")):
        assert draft_dtype(load_config({**mixed, "draft": {"method": method, "dtype": "float16"}})) == dtype
    assert (
        draft_dtype(load_config({**mixed, "draft": {"method": "model", "model": "m", "dtype": "float16"}})) == "float16"
    )


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


# The whole of a new method: one module in specdist/cores/proposers/ (here written to a folder the package
# searches), with a setting of its own.
REPEAT_MODULE = """
from dataclasses import dataclass

from specdist.cores.proposers.base import Draft, Proposer, register
from specdist.errors import ConfigError


@dataclass
class RepeatKeys:
    repeat_cap: int = 64  # draft.repeat_cap: at most this many tokens a draft

    def validate(self, key):
        if not 1 <= self.repeat_cap <= 64:
            raise ConfigError(f"{key}.repeat_cap", f"must be in [1, 64], got {self.repeat_cap!r}")


@register
class RepeatLastProposer(Proposer):
    methods = ("repeat-last",)
    model_free = True  # a lookup: the adaptive rule has it proposed first
    settings = RepeatKeys

    def __init__(self, vocab_size, cap):
        self.vocab_size, self.cap, self.longest = vocab_size, cap, 0

    @classmethod
    def build(cls, dc, ctx):
        return cls(ctx.vocab_size, cls.settings_of(dc).repeat_cap)

    def propose(self, reqs, ks):
        drafts = [Draft([r.seq[-1]] * min(k, self.cap)) for r, k in zip(reqs, ks)]
        self.longest = max([self.longest, *(len(d.tokens) for d in drafts)])
        return drafts
"""


@pytest.fixture
def repeat_last_module(tmp_path, monkeypatch):
    """``repeat_last.py`` in a folder of the proposers package, the registry discovering anew; removed after."""
    (tmp_path / "repeat_last.py").write_text(textwrap.dedent(REPEAT_MODULE))
    monkeypatch.setattr(proposers, "__path__", [*proposers.__path__, str(tmp_path)])
    monkeypatch.setattr(proposers, "_discovered", False)
    yield
    PROPOSERS.pop("repeat-last", None)
    sys.modules.pop("specdist.cores.proposers.repeat_last", None)


def test_a_new_method_is_one_module(tiny_models, repeat_last_module):
    assert proposer_methods() == tuple(sorted((*SHIPPED, "repeat-last")))
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 3, 3], [4, 5, 4, 5, 4]]
    plain = [o.token_ids for o in Engine.from_config(tiny_config(tiny_models, "none", 1)).generate(prompts, sp)]
    cfg = tiny_config(tiny_models, "repeat-last", 4)
    cfg["draft"]["repeat_cap"] = 2
    eng = Engine.from_config(cfg)
    assert eng.traits == DraftTraits(model_free=True)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == plain
    assert eng.stats.drafted > 0 and eng.draft_core.proposer.longest == 2
    assert eng.draft_core.method == "repeat-last"
    for bad, message in (
        (0, "draft.repeat_cap: must be in [1, 64], got 0"),
        ("2", "draft.repeat_cap: must be an integer, got '2'"),
    ):
        cfg["draft"]["repeat_cap"] = bad
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            Engine.from_config(cfg)
