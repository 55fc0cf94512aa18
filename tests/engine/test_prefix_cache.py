"""Prompt K/V reused across requests (specdist.models.kv.prefix.PrefixCache, ``engine.prefix_caching``).

- The cache's bookkeeping on a small SlotKVCache whose K/V are written by hand (each position's
  entries hold its token id, so a reused prefix is checkable entry by entry): a finished
  request's slot is kept and taken over by a prompt that starts the same way, a running
  request's prefix is copied, short prefixes are computed, the oldest kept slot is evicted
  first, and a follower replaying the recorded operations ends in the same state (tensor
  parallelism replays them so). A prompt is compared only with the held token lists that start
  with the same ``min_tokens`` tokens (admitting many requests does not compare each with all).
- The engine on the built-in model's native blocks (batch-invariant kernels): greedy and seeded
  outputs with prefix caching equal those without it token for token, for a shared system
  prompt, a repeated prompt within one call and a multi-turn conversation, and the reuse is real
  (counted tokens); nothing stays held after the requests end.
- A model drafter reuses its own prompt K/V the same way.
"""

from __future__ import annotations

import random

import pytest
import torch
from support.helpers import devices, model_drafter

from specdist import SamplingParams
from specdist.cores.draft import DrafterCore
from specdist.engine.local import Engine
from specdist.models.kernels import cpu_kernels
from specdist.models.kv import prefix as kv_prefix
from specdist.models.kv.paged import PagedKVCache
from specdist.models.kv.prefix import PrefixCache, PrefixIndex, common_prefix
from specdist.models.kv.slots import SlotKVCache
from specdist.transport.protocol import StartItem

MIN = 4  # the min_tokens of the unit tests' PrefixCache


def _plain_common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_equals_a_plain_loop():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(0, 40)
        a = [rng.randint(0, 3) for _ in range(n)]
        b = a[: rng.randint(0, n)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        assert common_prefix(a, b) == common_prefix(b, a) == _plain_common_prefix(a, b)


def _cache(slots: int = 3, device: str = "cpu", kind: str = "slots"):
    if kind == "paged":  # blocks of 4 tokens, room for every slot's 64
        return PagedKVCache(
            num_layers=2,
            num_slots=slots,
            num_kv_heads=1,
            head_dim=2,
            max_len=64,
            num_blocks=slots * 16 + 1,
            block_size=4,
            device=device,
        )
    return SlotKVCache(num_layers=2, num_slots=slots, num_kv_heads=1, max_len=64, head_dim=2, device=device)


def _positions(cache, slot: int, start: int, stop: int) -> list[tuple[int, int]]:
    """(first index, second index) of positions start..stop-1 of ``slot`` in a layer's K: a slot cache's
    [slot, head, position], a paged cache's [block, row]."""
    if cache.paged:
        bs = cache.block_size
        return [(cache.tables[slot][p // bs], p % bs) for p in range(start, stop)]
    return [(slot, p) for p in range(start, stop)]


def _compute(cache, slot: int, tokens: list[int]) -> None:
    """Stand-in for a forward: append K/V for ``tokens`` after what ``slot`` holds (entry = token id)."""
    start = cache.lengths[slot]
    cache.ensure(slot, start + len(tokens))
    for i in range(len(cache.k)):
        for (a, b), t in zip(_positions(cache, slot, start, start + len(tokens)), tokens):
            if cache.paged:  # [blocks, block_size, heads, head_dim]
                cache.k[i][a, b, :, 0], cache.v[i][a, b, :, 0] = t, -t
            else:  # [slots, heads, length, head_dim]
                cache.k[i][a, :, b, 0], cache.v[i][a, :, b, 0] = t, -t
    cache.lengths[slot] = start + len(tokens)


def _held(cache, slot: int) -> list[int]:
    """The token ids a slot's K/V stand for (checks K and V of every layer agree)."""
    out = []
    for a, b in _positions(cache, slot, 0, cache.lengths[slot]):
        ks = [(cache.k[i][a, b, 0, 0] if cache.paged else cache.k[i][a, 0, b, 0]) for i in range(len(cache.k))]
        vs = [(cache.v[i][a, b, 0, 0] if cache.paged else cache.v[i][a, 0, b, 0]) for i in range(len(cache.k))]
        assert all(k == ks[0] for k in ks) and all(v == -k for v, k in zip(vs, ks))
        out.append(int(ks[0]))
    return out


def _admit(store: PrefixCache, want: list[int], live=()) -> tuple[int, int]:
    slot, held = store.acquire(want, live)
    _compute(store.cache, slot, want[held:])
    assert _held(store.cache, slot) == want
    return slot, held


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_released_slots_are_taken_over_live_prefixes_copied_and_oldest_evicted(kind):
    ops = []
    cache = _cache(kind=kind)
    store = PrefixCache(cache, min_tokens=MIN, record=ops.append)
    a = list(range(1, 11))  # 10 tokens
    slot_a, held = _admit(store, a)
    assert held == 0 and store.available == 2

    store.release(slot_a, a)  # finished: kept, its slot still counted as available
    assert store.retained == {slot_a: a} and cache.num_free == 2 and store.available == 3

    turn2 = a + [50, 51, 52]  # the next turn of a conversation starts with the whole last one
    slot, held = _admit(store, turn2)
    assert (slot, held) == (slot_a, 10) and not store.retained  # taken over: nothing computed again

    b = a[:6] + [60, 61]  # shares 6 tokens with the running request: copied into a new slot
    slot_b, held = _admit(store, b, live=[(slot_a, turn2)])
    assert slot_b != slot_a and held == 6
    assert _held(cache, slot_a) == turn2  # the source is untouched

    c = a[:3] + [70, 71, 72, 73]  # 3 shared tokens < min_tokens: computed
    slot_c, held = _admit(store, c, live=[(slot_a, turn2), (slot_b, b)])
    assert held == 0 and cache.num_free == 0

    store.release(slot_b, b)
    store.release(slot_c, c)
    store.release(slot_a, turn2)
    assert list(store.retained) == [slot_b, slot_c, slot_a] and store.available == 3
    slot_d, held = _admit(store, [90] * 8)  # nothing matches: the oldest kept slot (b's) is evicted
    assert (slot_d, held) == (slot_b, 0) and list(store.retained) == [slot_c, slot_a]
    assert store.reused_tokens == 16
    assert {op[0] for op in ops} == {"allocate", "free", "retain", "adopt", "copy", "reserve"}


@pytest.mark.parametrize("kind", ["slots", "paged"])
@pytest.mark.parametrize("device", devices())
def test_a_follower_replaying_the_operations_ends_in_the_same_state(device, kind):
    """A tensor-parallel follower's PrefixCache replays rank 0's recorded operations: the same
    K/V, lengths, free slots and kept slots (so both report the same slots in use)."""
    ops = []
    cache = _cache(device=device, kind=kind)
    store = PrefixCache(cache, min_tokens=MIN, record=ops.append)
    follower = PrefixCache(_cache(device=device, kind=kind), min_tokens=MIN)
    seen = 0

    def sync(slot: int | None = None, tokens: list[int] = ()):
        """Replay new operations, then compute ``tokens`` into ``slot`` on both ranks (a forward)."""
        nonlocal seen
        for op in ops[seen:]:
            follower.replay(op)
        seen = len(ops)
        if slot is not None:
            _compute(cache, slot, list(tokens))
            _compute(follower.cache, slot, list(tokens))

    a = list(range(1, 13))
    slot_a, _ = store.acquire(a)
    sync(slot_a, a)
    slot_b, held_b = store.acquire(a[:8] + [99], live=[(slot_a, a)])  # copied from a running request
    sync(slot_b, [99])
    store.release(slot_a, a)
    sync()
    assert list(follower.retained) == [slot_a]
    slot_c, held_c = store.acquire(a[:10] + [7, 7])  # takes over the kept slot
    sync(slot_c, [7, 7])
    store.release(slot_b, a[:8] + [99])
    store.release(slot_c, a[:10] + [7, 7])
    slot_d, _ = store.acquire([5] * 9)  # a free slot: nothing evicted
    slot_e, _ = store.acquire([6] * 9)  # none free: the oldest kept slot evicted
    sync()
    assert held_b == 8 and (slot_c, held_c) == (slot_a, 10) and slot_e == slot_b
    assert {op[0] for op in ops} == {"allocate", "copy", "retain", "adopt", "free", "reserve"}
    assert list(follower.retained) == list(store.retained) == [slot_c]
    for i in range(2):
        assert torch.equal(cache.k[i], follower.cache.k[i]) and torch.equal(cache.v[i], follower.cache.v[i])
    assert cache.lengths == follower.cache.lengths and cache.num_free == follower.cache.num_free


def test_off_frees_at_once_and_reuses_nothing():
    cache = _cache()
    store = PrefixCache(cache, enabled=False, min_tokens=MIN)
    a = list(range(1, 11))
    slot, _ = _admit(store, a)
    store.release(slot, a)
    assert not store.retained and cache.num_free == 3
    _, held = _admit(store, a, live=[])
    assert held == 0 and store.reused_tokens == 0


def test_a_prompt_is_compared_only_with_lists_that_start_like_it(monkeypatch):
    """256 held lists, 16 of them sharing the first MIN tokens with the prompt: 16 comparisons,
    the longest found; a prompt shorter than MIN or starting like none: no comparison at all."""
    rng = random.Random(7)
    held = [[rng.randrange(1000, 2000) for _ in range(40)] for _ in range(240)]
    want = [1, 2, 3, 4] + [rng.randrange(50) for _ in range(36)]
    held += [want[: MIN + i] + [999] for i in range(16)]  # share MIN .. MIN + 15 tokens with want
    index = PrefixIndex(MIN, enumerate(held))
    calls = []
    monkeypatch.setattr(kv_prefix, "common_prefix", lambda a, b: calls.append(1) or common_prefix(a, b))
    assert index.longest(want) == (MIN + 15, 255) and len(calls) == 16
    calls.clear()
    assert index.longest(want[: MIN - 1]) == (0, -1) and index.longest([7] * 40) == (0, -1) and not calls
    index.remove(255, held[255])
    assert index.longest(want) == (MIN + 14, 254)


# ---------------------------------------------------------------- the engine, exact on native blocks

SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one short sentence, name the aisle "
    "when you can, and never invent prices."
)
QUESTIONS = ["Where are the hammers?", "Do you sell paint rollers?", "Where are the hammers?"]


def _engine(native, tokenizer, prefix_caching: bool) -> Engine:
    cfg = {
        "target": {"model": "smollm2-135m-instruct", "weights": "native"},
        "draft": {"method": "suffix", "num_speculative_tokens": 3},
        "engine": {"max_model_len": 512, "max_batch_size": 3, "device": "cpu", "prefix_caching": prefix_caching},
    }
    return Engine.from_config(cfg, tokenizer=tokenizer, target=native)


def _chat(system: str, turns: list[tuple[str, str]], question: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": question}]


@pytest.mark.skipif(not cpu_kernels.available(), reason="exact equality needs the batch-invariant CPU kernels")
def test_engine_outputs_equal_without_prefix_caching(smollm2_native_model, smollm2_tokenizer):
    """Greedy and seeded sampling, one call with a repeated prompt, then a second turn of each
    conversation: the same tokens with and without prefix caching; with it, the shared system
    prompt, the repeated prompt and the earlier turns are not computed again."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=8),
        SamplingParams(temperature=0.8, seed=7, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=8),
    ]
    runs = {}
    for on in (True, False):
        engine = _engine(smollm2_native_model, smollm2_tokenizer, on)
        try:
            first = [
                smollm2_tokenizer.apply_chat_template(_chat(SYSTEM, [], q), tokenize=False, add_generation_prompt=True)
                for q in QUESTIONS
            ]
            out1 = engine.generate(first, params)
            second = [
                smollm2_tokenizer.apply_chat_template(
                    _chat(SYSTEM, [(q, o.text)], "And what else?"), tokenize=False, add_generation_prompt=True
                )
                for q, o in zip(QUESTIONS, out1)
            ]
            out2 = engine.generate(second, params)
            health = engine.target_core.health()
            runs[on] = ([o.token_ids for o in out1 + out2], health)
            assert health["kv_slots_in_use"] == 0  # kept prefixes are not held by anyone
        finally:
            engine.close()
    assert runs[True][0] == runs[False][0]
    on, off = runs[True][1], runs[False][1]
    assert off["prefix_reused_tokens"] == 0 and off["kv_slots_cached"] == 0
    system_tokens = len(smollm2_tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}]))
    # the first call: the system prompt twice and the repeated prompt once; the second: each earlier turn
    assert on["prefix_reused_tokens"] > 3 * system_tokens + 3 * 20
    assert 0 < on["kv_slots_cached"] <= 3


def test_model_drafter_reuses_its_own_prompt_kv(tiny_models):
    """A drafter over its own model keeps a finished request's prompt K/V and a new request that
    starts the same way takes them; its drafts equal a fresh drafter's."""
    from specdist.models.loader import load_model, resolve_model

    model = load_model(resolve_model(tiny_models["draft"], "draft.model"), "float32")
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]  # 21 tokens
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def drafts(core: DrafterCore, rid: str) -> list[int]:
        from specdist.transport.protocol import ProposeItem

        core.start([StartItem(rid, prompt, params, 1)])
        (proposal,), _ = core.propose([ProposeItem(rid, 0, [], 3, len(prompt))])
        return proposal.token_ids

    reused = model_drafter(model, 2, 64)
    first = drafts(reused, "a")
    reused.release(["a"])
    assert reused.kv_slots_in_use() == 0 and len(reused.prefixes.retained) == 1
    again = drafts(reused, "b")
    assert reused.prefixes.reused_tokens == len(prompt) - 1
    fresh = drafts(model_drafter(model, 2, 64), "c")
    assert first == again == fresh


@pytest.mark.skipif(not cpu_kernels.available(), reason="exact equality needs the batch-invariant CPU kernels")
def test_one_call_shares_nested_prefixes_in_waves(tiny_models):
    """One prefill call of S+A, S+B, S+A, S+B (S a 20-token system prompt): the second S+A copies the
    first, S+B takes S from it, and the second S+B waits for the first S+B (a third wave) and copies it
    instead of computing its own; the outputs equal those without prefix caching."""
    from support.helpers import tiny_config

    system, a, b = [1, 2, 3, 4, 5, 6, 7, 0] * 2 + [1, 2, 3, 4], [5, 5, 6, 6, 7, 7], [7, 6, 5, 4, 3, 2]
    prompts = [system + a, system + b, system + a, system + b]
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs, reused, forwards = {}, {}, {}
    for on in (True, False):
        eng = Engine.from_config(tiny_config(tiny_models, "none", 1, prefix_caching=on))
        calls = []
        forward = eng.target_core.runner.forward
        eng.target_core.runner.forward = lambda slots, *a, **k: calls.append(len(slots)) or forward(slots, *a, **k)
        outs[on] = [o.token_ids for o in eng.generate(prompts, greedy)]
        reused[on], forwards[on] = eng.target_core.prefixes.reused_tokens, calls[:3]
    assert outs[True] == outs[False]
    # held K/V: all but a prompt's last token (25 of 26); S is 20 tokens
    assert (reused[True], reused[False]) == (25 + 20 + 25, 0)
    # prefill forwards: S+A; then S+B's last 6 (the copy of S+A computes nothing); the copy of S+B nothing
    # either; then the first verification of all 4. Without caching: one forward of the 4 prompts
    assert forwards[True] == [1, 1, 4] and forwards[False][:2] == [4, 4]
