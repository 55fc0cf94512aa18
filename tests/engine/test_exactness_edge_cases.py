"""Four exactness holes (issue 19), each pinned by a test that fails without its fix.

1. The target's uniforms are counter-based, keyed by (request seed, sequence position, role):
   64-bit seeds that agree in their low 32 bits give different streams, and the uniform of a
   position does not depend on the draft lengths or the steps before it.
2. top-p is applied per row: a top_p = 1 row keeps its probabilities bit for bit whatever rows
   share its batch.
3. NaN logits (or a processed row without positive finite mass) fail that request with an
   error instead of sampling an arbitrary token; the other requests of the call are unaffected.
4. A proposed token to which its own q gives probability 0 is refused on the in-process path
   (the check the wire path runs, at the one place both go through).

Tiny models (tests/conftest.py), one torch thread; every seed is fixed.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.helpers import tiny_config

from specdist import Engine, SamplingParams
from specdist.cores.sampling import process_logits
from specdist.cores.target import LocalVerifier, VerifierCore
from specdist.errors import FailedPrecondition, FieldError, InvalidArgument
from specdist.models.loader import ModelSource, load_model
from specdist.models.runner import CausalLMRunner
from specdist.randomness import draft_seed, draft_uniform
from specdist.transport.protocol import (
    Proposal,
    StartItem,
    TransportError,
    VerifyItem,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 12345
T1 = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def target_model(tiny_models):
    return load_model(ModelSource(tiny_models["target"], None), "float32")


@pytest.fixture
def core(target_model):
    return VerifierCore(CausalLMRunner(target_model, 4, 64))


def _prefill(core, rid: str, prompt: list[int], seed: int, params: SamplingParams = T1) -> None:
    core.prefill([StartItem(rid, prompt, params, seed)])


def _item(core, rid: str, drafts: list[int] | None = None, q: torch.Tensor | None = None) -> VerifyItem:
    seq_len = len(core.requests[rid].seq)
    return VerifyItem(rid, seq_len, Proposal(rid, drafts, q) if drafts is not None else None)


class _Recorder:
    """Wraps the verifier's rejection sampler and the final-token sampler it calls: records the
    acceptance uniforms [B, K] of each call and the uniform each final token was sampled with."""

    def __init__(self, monkeypatch):
        import specdist.cores.rejection as verification
        import specdist.cores.verify_batch as verifying

        self.accept: list[torch.Tensor] = []
        self.final: list[torch.Tensor] = []
        real_rs, real_sf = verifying.rejection_sample, verification.sample_from

        def rejection_sample(*args, **kw):
            self.accept.append(args[4].double().cpu().clone())  # accept_uniforms [B, K]
            return real_rs(*args, **kw)

        def sample_from(probs, uniforms):
            self.final.append(uniforms.double().cpu().clone())  # [B]
            return real_sf(probs, uniforms)

        monkeypatch.setattr(verifying, "rejection_sample", rejection_sample)
        monkeypatch.setattr(verification, "sample_from", sample_from)


# --------------------------------------------------------------------------- 1. target uniforms
def test_target_uniform_key_uses_all_64_seed_bits_and_separates_roles() -> None:
    from specdist.randomness import ACCEPT_ROLE, SAMPLE_ROLE, target_uniforms

    for s in (0, SEED, 2**40 + 7):
        for role in (ACCEPT_ROLE, SAMPLE_ROLE):
            a = target_uniforms(s, role, range(20))
            b = target_uniforms(s + 2**32, role, range(20))
            assert all(0.0 <= u < 1.0 for u in a + b)
            assert all(x != y for x, y in zip(a, b)), (s, role)
        # the three streams of one request (draft, accept, sample) are distinct at every position
        acc, smp = target_uniforms(s, ACCEPT_ROLE, range(20)), target_uniforms(s, SAMPLE_ROLE, range(20))
        drf = [draft_uniform(draft_seed(s), n) for n in range(20)]
        assert len(set(acc) | set(smp) | set(drf)) == 60
    # a pure function of (seed, position, role): any subset of positions, in any order
    full = target_uniforms(SEED, ACCEPT_ROLE, range(10))
    assert target_uniforms(SEED, ACCEPT_ROLE, [7, 3]) == [full[7], full[3]]


def test_seeds_equal_in_their_low_32_bits_sample_different_streams(core, monkeypatch) -> None:
    """T = 1, no drafts, 24 steps from the same prompt: seeds s and s + 2**32 must not share the
    target's randomness (a 32-bit generator seed gives both the same uniforms and tokens)."""
    rec = _Recorder(monkeypatch)
    prompt = [1, 2, 3]
    _prefill(core, "lo", prompt, SEED)
    _prefill(core, "hi", prompt, SEED + 2**32)
    for _ in range(24):
        core.verify([_item(core, "lo"), _item(core, "hi")])
    u = torch.stack(rec.final)  # [24, 2]
    assert bool((u[:, 0] != u[:, 1]).all()), "the target's uniforms ignore the seed's high 32 bits"
    assert core.requests["lo"].seq != core.requests["hi"].seq


def test_target_uniforms_depend_only_on_seed_position_and_role(core, monkeypatch) -> None:
    """Same seed, different prompt lengths and draft lengths in one call: the acceptance uniform of a
    position is the same whichever request and draft length reach it, and each final token is sampled
    with the sample-role uniform of its own position."""
    from specdist.randomness import ACCEPT_ROLE, SAMPLE_ROLE, target_uniforms

    rec = _Recorder(monkeypatch)
    _prefill(core, "a", [1, 2, 3, 4, 5], SEED)  # drafts at positions 5, 6, 7
    _prefill(core, "b", [6, 5, 4, 3, 2, 1], SEED)  # one draft at position 6
    out, _ = core.verify([_item(core, "a", [1, 2, 3]), _item(core, "b", [4])])
    acc = rec.accept[-1]  # [2, 3]
    assert acc[0, 1] == acc[1, 0], "the acceptance uniform of position 6 depends on the draft length"
    assert acc[0, :3].tolist() == target_uniforms(SEED, ACCEPT_ROLE, range(5, 8))
    assert acc[1, :1].tolist() == target_uniforms(SEED, ACCEPT_ROLE, [6])
    final_pos = [5 + out[0].num_accepted, 6 + out[1].num_accepted]
    assert rec.final[-1].tolist() == [target_uniforms(SEED, SAMPLE_ROLE, [n])[0] for n in final_pos]


# --------------------------------------------------------------------------- 2. top-p per row
def test_top_p_one_row_is_unchanged_by_a_top_p_row_in_its_batch() -> None:
    vocab = 50_000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 3  # [2, V]
    temp, top_k = torch.ones(2), torch.zeros(2, dtype=torch.long)
    mixed = process_logits(logits, temp, top_k, torch.tensor([1.0, 0.9]))  # [2, V]
    alone = process_logits(logits[:1], temp[:1], top_k[:1], torch.tensor([1.0]))  # [1, V]
    assert torch.equal(mixed[0], alone[0]), "a top_p = 1 row changed because another row uses top-p"
    lost = int(((alone[0] > 0) & (mixed[0] == 0)).sum())
    assert lost == 0, f"{lost} tokens of positive probability were cut from a top_p = 1 row"
    # the top_p = 0.9 row is cut as when alone
    cut = process_logits(logits[1:], temp[:1], top_k[:1], torch.tensor([0.9]))
    assert torch.equal(mixed[1], cut[0])
    assert 0 < int((cut[0] > 0).sum()) < vocab


def test_an_all_greedy_batch_gives_the_rows_of_a_mixed_batch() -> None:
    """A batch of greedy rows only skips the softmax: each row is the same one-hot as when a sampled row
    (with top-k and top-p) shares its batch."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 4  # [3, V]
    top_k, top_p = torch.tensor([5, 0, 0]), torch.tensor([1.0, 1.0, 0.8])
    greedy = process_logits(logits[:2], torch.zeros(2), top_k[:2], top_p[:2])  # [2, V]
    mixed = process_logits(logits, torch.tensor([0.0, 0.0, 0.7]), top_k, top_p)  # [3, V]
    assert torch.equal(greedy, mixed[:2])
    assert torch.equal(greedy.argmax(-1), logits[:2].argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(2))


def test_top_p_cut_among_ties_is_deterministic() -> None:
    """Equal probabilities straddling the cut-off: the lowest token ids are kept (a stable sort)."""
    logits = torch.zeros(1, 64)
    p = process_logits(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.tensor([0.25]))
    assert (p[0] > 0).nonzero().squeeze(-1).tolist() == list(range(16))


# --------------------------------------------------------------------------- 3. NaN logits
def _poison(core, monkeypatch, rid: str, pos: int = 0) -> None:
    """The runner's logits for request ``rid`` get one NaN entry (at its row ``pos``)."""
    runner = core.runner
    real = runner.forward

    def forward(slots, tokens, num_logits, packed=False, **kw):
        out = real(slots, tokens, num_logits, packed=packed, **kw).clone()  # the runner returns inference tensors
        slot = core.requests[rid].slot
        if slot in slots and num_logits[slots.index(slot)] > 0:
            i = slots.index(slot)
            row = min(pos, num_logits[i] - 1)
            if packed:  # [N, V]: each request's rows one after another
                out[sum(num_logits[:i]) + row, 3] = float("nan")
            else:  # [B, K+1, V]
                out[i, row, 3] = float("nan")
        return out

    monkeypatch.setattr(runner, "forward", forward)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_fail_that_request_not_the_call(core, target_model, monkeypatch, temperature) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
    for rid, prompt in (("good", [1, 2, 3]), ("bad", [4, 5])):
        _prefill(core, rid, prompt, SEED, params)
    before = {rid: (list(r.seq), core.cache.lengths[r.slot]) for rid, r in core.requests.items()}
    _poison(core, monkeypatch, "bad", pos=1)
    with pytest.raises(FailedPrecondition) as err:
        core.verify([_item(core, "good", [1, 2]), _item(core, "bad", [6, 6])])
    assert err.value.field.startswith("items[1]") and "'bad'" in str(err.value) and "NaN" in str(err.value)
    # nothing changed: the call can be retried without the blamed request
    assert {rid: (list(r.seq), core.cache.lengths[r.slot]) for rid, r in core.requests.items()} == before
    out, _ = core.verify([_item(core, "good", [1, 2])])
    ref = VerifierCore(CausalLMRunner(target_model, 1, 64))
    _prefill(ref, "good", [1, 2, 3], SEED, params)
    assert out == ref.verify([_item(ref, "good", [1, 2])])[0]
    # through the local transport the failure blames that item, as over gRPC
    with pytest.raises(TransportError) as terr:
        LocalVerifier(core).verify([_item(core, "good"), _item(core, "bad")])
    assert terr.value.item == 1 and terr.value.request_ids == ["bad"] and terr.value.code == "FAILED_PRECONDITION"


def test_nan_logits_fail_the_request_in_the_engine(tiny_models, monkeypatch) -> None:
    """Engine over the tiny models: the request whose target logits are NaN finishes with an error;
    the one sharing its batch produces what it produces alone."""
    eng = Engine.from_config(tiny_config(tiny_models, k=3))
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=SEED, ignore_eos=True)
    alone = eng.generate([[1, 2]], params)[0].token_ids
    good = eng.add_request([1, 2], params)
    bad = eng.add_request([3, 4], params)
    runner, core = eng.target_core.runner, eng.target_core
    real = runner.forward

    def forward(slots, tokens, num_logits, packed=False, **kw):  # NaN everywhere in the bad request's logits
        out = real(slots, tokens, num_logits, packed=packed, **kw).clone()  # the runner returns inference tensors
        r = core.requests.get(bad.core_id)
        if r is not None and r.slot in slots:
            i = slots.index(r.slot)
            if packed:  # [N, V]: each request's rows one after another
                out[sum(num_logits[:i]) : sum(num_logits[: i + 1])] = float("nan")
            else:  # [B, K+1, V]
                out[i] = float("nan")
        return out

    monkeypatch.setattr(runner, "forward", forward)
    while not (good.finished and bad.finished):
        eng.step()
    assert bad.output.finish_reason == "error" and "NaN" in bad.error and bad.output.token_ids == []
    assert good.output.finish_reason == "length" and good.output.token_ids == alone
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}


# --------------------------------------------------------------------------- 4. q(x) = 0
def test_in_process_draft_with_zero_q_for_its_token_is_refused(core) -> None:
    _prefill(core, "ok", [1, 2, 3], SEED)
    _prefill(core, "zero", [4, 5], SEED)
    before = {rid: (list(r.seq), core.cache.lengths[r.slot]) for rid, r in core.requests.items()}
    vocab = core.vocab_size
    q_ok = torch.full((2, vocab), 1.0 / vocab)  # [2, V]
    q_zero = q_ok.clone()
    q_zero[1] = 1.0 / (vocab - 1)
    q_zero[1, 6] = 0.0  # the second draft token, 6, has q = 0: it cannot have been sampled from this q
    items = [_item(core, "ok", [1, 2], q_ok), _item(core, "zero", [5, 6], q_zero)]
    with pytest.raises(InvalidArgument) as err:
        core.verify(items)
    assert err.value.field.startswith("items[1].draft_probs[1]") and "probability 0" in str(err.value)
    assert {rid: (list(r.seq), core.cache.lengths[r.slot]) for rid, r in core.requests.items()} == before
    with pytest.raises(TransportError) as terr:
        LocalVerifier(core).verify(items)
    assert terr.value.item == 1 and terr.value.code == "INVALID_ARGUMENT"
    core.verify(items[:1])  # the other item alone is verified


def test_in_process_draft_with_nan_q_for_its_token_is_refused(core) -> None:
    _prefill(core, "nan", [4, 5], SEED)
    q = torch.full((1, core.vocab_size), 1.0 / core.vocab_size)
    q[0, 2] = math.nan
    with pytest.raises(FieldError) as err:
        core.verify([_item(core, "nan", [2], q)])
    assert err.value.field.startswith("items[0].draft_probs[0]")
