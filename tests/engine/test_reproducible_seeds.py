"""Under ``sampling.coupling: gumbel`` a seeded request's tokens depend on the model, the prompt,
the parameters and the seed only (specdist/cores/coupling.py, the README's reproducibility contract).

The matrix: a seeded request at T = 0.8, top-p 0.9 (and a batch of three seeded requests) gives
the same tokens with no draft, n-gram, suffix, self-w8 and model drafts; k = 1..4; fixed and
adaptive lengths; pipelined drafting; over the gRPC transports; with the draft replica failing
mid-request (the requests go on without drafts). The negative control: under ``rejection`` the
same matrix does give different tokens (so the comparison can fail).
"""

from __future__ import annotations

import pytest
from support.helpers import remote_engine_like, tiny_config
from test_draft_faults import Flaky

from specdist.engine.local import Engine
from specdist.sampling_params import SamplingParams

PROMPTS = [[1, 2, 3], [4, 5, 6, 1], [2, 2, 7]]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11 + 1000 * i, ignore_eos=True)
    for i in range(len(PROMPTS))
]

VARIANTS = [  # (draft method, k, length policy, extra draft keys)
    ("model", 1, "fixed", {}),
    ("model", 2, "fixed", {}),
    ("model", 3, "adaptive", {}),
    ("model", 4, "fixed", {}),
    ("model", 2, "fixed", {"pipeline": True}),
    ("self-w8", 3, "fixed", {}),
    ("ngram", 2, "fixed", {}),
    ("suffix", 4, "adaptive", {}),
]


def _config(models, method: str, k: int, policy: str, extra: dict, coupling: str) -> dict:
    cfg = tiny_config(models, method, k, policy)
    cfg["draft"].update(extra)
    cfg["sampling"] = {"coupling": coupling}
    return cfg


def _outputs(eng) -> list[list[int]]:
    try:
        return [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]
    finally:
        eng.close()


def _matrix(models, coupling: str) -> dict[str, list[list[int]]]:
    outs = {"none": _outputs(Engine.from_config(_config(models, "none", 1, "fixed", {}, coupling)))}
    for method, k, policy, extra in VARIANTS:
        name = f"{method} k={k} {policy}{' pipelined' if extra else ''}"
        outs[name] = _outputs(Engine.from_config(_config(models, method, k, policy, extra, coupling)))
    return outs


def test_seeded_tokens_do_not_depend_on_the_draft(models) -> None:
    outs = _matrix(models, "gumbel")
    want = outs["none"]
    for name, got in outs.items():
        assert got == want, f"{name}: {got} != {want} (no draft)"


def test_seeded_tokens_do_not_depend_on_the_transport_or_a_failing_draft(models) -> None:
    want = _outputs(Engine.from_config(_config(models, "none", 1, "fixed", {}, "gumbel")))
    local = Engine.from_config(_config(models, "model", 3, "fixed", {}, "gumbel"))
    remote, served = remote_engine_like(local)
    try:
        assert [o.token_ids for o in remote.generate(PROMPTS, PARAMS)] == want  # drafts cross as token ids
    finally:
        remote.close()
        served.close()

    eng = Engine.from_config(_config(models, "model", 3, "fixed", {}, "gumbel"))
    flaky = eng.scheduler.replicas[0].drafter = Flaky(eng.scheduler.replicas[0].drafter)
    try:
        reqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        for _ in range(3):
            eng.step()
        assert eng.stats.drafted > 0
        flaky.down = True  # the draft replica dies mid-request: the rest is decoded without drafts
        while any(not r.finished for r in reqs):
            eng.step()
        assert [r.output.token_ids for r in reqs] == want
    finally:
        eng.close()


def test_rejection_coupling_tokens_do_depend_on_the_draft(models) -> None:
    """The control: the seed documents' rule keeps the distribution, not the tokens."""
    outs = _matrix(models, "rejection")
    assert len({tuple(map(tuple, o)) for o in outs.values()}) > 1


@pytest.mark.parametrize("coupling", ["gumbel", "rejection"])
def test_greedy_is_the_same_under_both_couplings(tiny_models, coupling) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = _outputs_of(Engine.from_config(tiny_config(tiny_models, "none")), greedy)
    cfg = tiny_config(tiny_models, "model", 3)
    cfg["sampling"] = {"coupling": coupling}
    assert _outputs_of(Engine.from_config(cfg), greedy) == ref


def _outputs_of(eng, sp) -> list[list[int]]:
    try:
        return [o.token_ids for o in eng.generate(PROMPTS, sp)]
    finally:
        eng.close()


def test_unseeded_requests_draw_64_bit_seeds_from_the_os_unless_the_config_seeds_them(tiny_models) -> None:
    """Without ``engine.seed`` every unseeded request's seed comes from the operating system's randomness: two
    engines (a restart, another replica) give the same request different seeds, and the seeds use all 64 bits
    (of 64 draws, P(none >= 2**63) = 2**-64). With ``engine.seed`` set they repeat, still over 64 bits."""

    def seeds(**engine) -> list[int]:
        cfg = tiny_config(tiny_models, "none")
        cfg["engine"].update(engine)
        eng = Engine.from_config(cfg)
        try:
            return [eng.add_request([1, 2, 3], SamplingParams(max_tokens=1)).seed for _ in range(64)]
        finally:
            eng.close()

    a, b = seeds(), seeds()
    assert a[0] != b[0] and len(set(a) | set(b)) == 128
    assert max(a) >= 2**63 and all(0 <= s < 2**64 for s in a)
    assert seeds(seed=5) == seeds(seed=5) and max(seeds(seed=5)) >= 2**63
