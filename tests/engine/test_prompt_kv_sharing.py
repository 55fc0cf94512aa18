"""self-w8 in process: the draft takes the target's prompt K/V instead of running its own prefill."""

from __future__ import annotations

import pytest
import torch
from support.helpers import tiny_config

from specdist.engine.local import Engine
from specdist.models.kv.slots import SlotKVCache
from specdist.sampling_params import SamplingParams


def test_copy_prefix_copies_exactly_and_checks_layout() -> None:
    src = SlotKVCache(2, 3, 2, 4, 16)
    dst = SlotKVCache(2, 3, 2, 4, 16)
    torch.manual_seed(0)
    for t in src.k + src.v:
        t.normal_()
    src.lengths[1] = 9
    dst.copy_prefix(src, 1, 2, 7)
    assert dst.lengths[2] == 7
    for a, b in zip(src.k + src.v, dst.k + dst.v):
        assert torch.equal(a[1, :, :7], b[2, :, :7])
        assert not b[2, :, 7:].any()  # nothing past the prefix
    with pytest.raises(ValueError, match="holds 9 tokens"):
        dst.copy_prefix(src, 1, 0, 10)
    with pytest.raises(ValueError, match="same layout"):
        SlotKVCache(2, 3, 1, 4, 16).copy_prefix(src, 1, 0, 3)
    half = SlotKVCache(2, 3, 2, 4, 16, dtype=torch.float16)  # a self draft's float16 cache from a float32 target's
    half.copy_prefix(src, 1, 0, 7)
    for a, b in zip(src.k + src.v, half.k + half.v):
        assert torch.equal(a[1, :, :7].half(), b[0, :, :7])


def _self_w8_engine(tiny_models) -> Engine:
    return Engine.from_config(tiny_config(tiny_models, method="self-w8", k=3))


def test_self_w8_draft_reuses_the_target_prompt_kv(tiny_models) -> None:
    eng = _self_w8_engine(tiny_models)
    assert eng.draft_core.prefix_source is not None
    calls = []
    runner = eng.draft_core.runner
    inner = runner.forward

    def forward(slots, tokens, num_logits, **kwargs):
        calls.append([len(t) for t in tokens])
        return inner(slots, tokens, num_logits, **kwargs)

    runner.forward = forward
    prompts = [[1, 2, 3, 4, 5, 6], [3], [2, 2, 2, 2]]
    reqs = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in prompts]
    eng.scheduler.admit()
    assert calls == []  # no draft prefill
    for r in reqs:
        n = len(r.prompt_ids) - 1
        tslot, dslot = eng.target_core.requests[r.core_id].slot, eng.draft_core.requests[r.core_id].slot
        assert eng.draft_core.cache.lengths[dslot] == n
        for a, b in zip(eng.target_core.cache.k, eng.draft_core.cache.k):  # a float32 target, a draft on blocks:
            assert torch.equal(a[tslot, :, :n].to(b.dtype), b[dslot, :, :n])  # float16 K/V (kv_cache_dtype auto)
    while eng.has_unfinished():
        eng.step()
    assert calls and all(max(c) <= 2 for c in calls)  # only decode-sized draft passes
    # greedy output is the target's own, whatever the draft's cache holds
    ref = Engine.from_config(tiny_config(tiny_models, method="none", k=3))
    want = ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [r.output.token_ids for r in reqs] == [o.token_ids for o in want]
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_model_draft_still_runs_its_own_prefill(tiny_models) -> None:
    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=3))
    assert eng.draft_core.prefix_source is None  # a different model: its K/V are its own


def test_model_draft_prefills_at_its_first_draft_only(tiny_models) -> None:
    """A separate draft model computes a prompt's K/V at the request's first draft pass, in a forward
    of its own (the pass itself stays decode-sized); a request that never drafts costs it no forward."""
    from specdist.transport.protocol import ProposeItem, StartItem

    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=3))
    core = eng.draft_core
    calls = []
    inner = core.runner.forward

    def forward(slots, tokens, num_logits, **kwargs):
        calls.append(([len(t) for t in tokens], list(num_logits)))
        return inner(slots, tokens, num_logits, **kwargs)

    core.runner.forward = forward
    # max_tokens 1: the length rule's cap is 0, so the request never drafts
    eng.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert calls == [] and eng.kv_slots_in_use() == {"target": 0, "draft": 0}

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    core.start([StartItem("a", [1, 2, 3, 4, 5, 6], sp, 1), StartItem("b", [3], sp, 2)])
    assert calls == []  # start computes nothing
    _, timing = core.propose([ProposeItem("a", 0, [], 2, 6), ProposeItem("b", 0, [], 2, 1)])
    # the prompt's first 4 tokens in a forward of their own, then every pass feeds at most 2 tokens a row
    assert calls[0] == ([4], [0]) and all(max(n) <= 2 for n, _ in calls[1:])
    assert timing.phases["prefill"] > 0 and timing.phases["draft"] > 0
    assert core.cache.lengths[core.requests["a"].slot] == 6 + 1  # the prompt and the first draft token fed
    core.release(["a", "b"])

    ref = Engine.from_config(tiny_config(tiny_models, method="none", k=3))
    prompts = [[1, 2, 3, 4, 5, 6], [3], [2, 2, 2, 2]]
    want = [o.token_ids for o in ref.generate(prompts, sp)]
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    assert eng.stats.accepted > 0
