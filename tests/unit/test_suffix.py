"""The suffix index (specdist/cores/suffix_index.py) and the ``suffix`` / ``hybrid`` draft methods.

1. The index against a reference built from scratch (every substring of length <= D of the
   held sequences, counted): incremental insertion, eviction (counts restored exactly, empty
   nodes pruned, the cache bound held), lookups (longest suffix with a continuation, greedy
   most frequent child, ``min_prob``, the ``max_spec_factor`` cap) and the rule that a live
   sequence never matches itself at its end.
2. The drafter core: per-request state freed on release, the sequence kept in the index.
3. Through the engine on the tiny models: greedy output with ``suffix`` and ``hybrid`` equals
   target-only greedy decoding; a repeated prompt is drafted from the first request's
   sequence and almost every draft token is accepted; a draft worker actor hosts both
   methods behind gRPC with the engine's greedy output.
The frequency (G) tests of both methods are in test_exactness_frequency.py.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from support.helpers import ServedCores, frozen_adaptive_policy, tiny_config

from specdist.config import load_config
from specdist.cores.draft import DrafterCore, build_drafter_core
from specdist.cores.proposers import check_draft, draft_dtype
from specdist.cores.proposers.suffix import SuffixProposer
from specdist.cores.suffix_index import SuffixIndex, SuffixSettings
from specdist.engine.local import Engine
from specdist.errors import ConfigError
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import ProposeItem, StartItem

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)


# ---------------------------------------------------------------- reference
def substring_counts(seqs, depth: int) -> Counter:
    """Occurrences of every substring of length 1..depth over ``seqs``."""
    c: Counter = Counter()
    for s in seqs:
        s = list(s)
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return c


def dump(index: SuffixIndex) -> Counter:
    """The trie as {string: count}, checking csum, the edge map, the cached argmax and the node count
    on the way."""
    out: Counter = Counter()
    stack = [((), index.root)]
    seen = 0
    while stack:
        path, node = stack.pop()
        kids = index.children(node)
        assert index.csum[node] == sum(index.count[c] for c in kids), path
        assert all(index.child(node, index.token[c]) == c for c in kids)
        assert len({index.token[c] for c in kids}) == len(kids)
        if len(kids) >= 2 and index.best[node] >= 0:  # a cached argmax is a true argmax (ties: smaller token)
            assert index.best[node] == min(kids, key=lambda c: (-index.count[c], index.token[c]))
        for c in kids:
            assert 0 < index.count[c] <= index.count[node] or not path, (path, index.token[c])
            out[path + (index.token[c],)] = index.count[c]
            stack.append((path + (index.token[c],), c))
        seen += len(kids)
    assert index.num_nodes == len(out) == seen
    # every id is a live node or free for reuse, once
    assert len(index.token) - 1 == index.num_nodes + len(index.free) and len(set(index.free)) == len(index.free)
    return out


def reference_lookup(seqs, query, depth, k, min_prob, factor):
    """The documented rule, from substring counts."""
    cnt = substring_counts(seqs, depth)

    def conts(s):  # continuation counts of string s
        if len(s) >= depth:
            return {}
        return {t: cnt[s + (t,)] for t in range(64) if cnt.get(s + (t,), 0) > 0}

    def anchor(ctx):  # deepest suffix (1 <= len <= depth) occurring with a continuation
        for m in range(min(len(ctx), depth), 0, -1):
            s = tuple(ctx[len(ctx) - m :])
            if cnt.get(s, 0) > 0 and conts(s):
                return m, s
        return 0, None

    m, s = anchor(list(query))
    if m == 0 or k <= 0:
        return [], 0.0, m
    cap = min(k, int(factor * m + 1e-9))
    ctx, toks, prob, score = list(query), [], 1.0, 0.0
    while len(toks) < cap:
        cs = conts(s)
        t = min(cs, key=lambda x: (-cs[x], x))
        prob *= cs[t] / sum(cs.values())
        if prob < min_prob:
            break
        toks.append(t)
        score += prob
        ctx.append(t)
        if len(toks) == cap:
            break
        # the suffixes of ctx that occur (contiguous from length 0), then the deepest with a continuation
        d, s = anchor(ctx[len(ctx) - _occurring(cnt, ctx, depth) :])
        if d == 0:
            break
    return toks, score, m


def _occurring(cnt, ctx, depth) -> int:
    n = 0
    while n < min(len(ctx), depth) and cnt.get(tuple(ctx[len(ctx) - n - 1 :]), 0) > 0:
        n += 1
    return n


# ---------------------------------------------------------------- 1. the index
@pytest.mark.parametrize("depth", [2, 3, 5, 8])
def test_incremental_insertion_equals_counts_from_scratch(depth):
    rng = random.Random(depth)
    idx = SuffixIndex(depth, cache_requests=100)
    live = [(idx.start([]), []) for _ in range(3)]
    done = []
    for step in range(60):
        b = rng.randrange(len(live))
        st, toks = live[b]
        chunk = [rng.randrange(4) for _ in range(rng.randrange(0, 4))]  # small vocabulary: many repeats
        idx.extend(st, chunk)
        toks += chunk
        if step % 13 == 12:  # one finishes; a new one starts with a prompt
            idx.finish(st)
            idx.finish(st)  # idempotent
            done.append(toks)
            prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            live[b] = (idx.start(prompt), list(prompt))
        held = done + [t for _, t in live]
        assert dump(idx) == substring_counts(held, depth), step
        for st, toks in live:
            assert list(st.tokens) == toks
            assert len(st.active) == min(len(toks), depth) + 1 and st.active[0] == idx.root
            assert all(idx.count[n] > 0 for n in st.active[1:])
    assert idx.live == 3 and len(idx.cached) == len(done)


def test_eviction_restores_counts_exactly_and_holds_the_bound():
    rng = random.Random(7)
    n_cache, depth = 5, 6
    idx = SuffixIndex(depth, cache_requests=n_cache)
    fresh_prompt = [0, 1, 2, 0, 1]
    live = idx.start(fresh_prompt)  # a live sequence through all evictions: never pruned
    seqs = []
    for i in range(40):
        s = [rng.randrange(3) for _ in range(rng.randrange(1, 15))]
        if i % 4 == 0:
            s = seqs[-1] if seqs else s  # duplicates share nodes
        seqs.append(s)
        idx.add(s)
        assert len(idx.cached) == min(i + 1, n_cache)
        assert dump(idx) == substring_counts(seqs[-n_cache:] + [fresh_prompt], depth), i
        assert idx.num_nodes <= sum(len(x) * depth for x in seqs[-n_cache:] + [fresh_prompt])
    ref = SuffixIndex(depth, n_cache)  # the same content built from scratch
    for s in seqs[-n_cache:]:
        ref.add(s)
    ref_live = ref.start(fresh_prompt)
    assert dump(idx) == dump(ref) and idx.num_nodes == ref.num_nodes
    # the live sequence's active nodes survived every eviction: it goes on growing and drafting
    assert idx.lookup(live, 4, 0.0, 4.0) == ref.lookup(ref_live, 4, 0.0, 4.0)
    idx.extend(live, [2])
    assert dump(idx) == substring_counts(seqs[-n_cache:] + [fresh_prompt + [2]], depth)
    # forgetting the finished sequences leaves the live one's counts, and its lookups go on
    forgot = SuffixIndex(depth, n_cache)
    for s in seqs[-n_cache:]:
        forgot.add(s)
    kept = forgot.start(fresh_prompt)
    forgot.forget_finished()
    assert not forgot.cached and dump(forgot) == substring_counts([fresh_prompt], depth)
    alone = SuffixIndex(depth, n_cache)
    assert forgot.lookup(kept, 4, 0.0, 4.0) == alone.lookup(alone.start(fresh_prompt), 4, 0.0, 4.0)
    forgot.extend(kept, [2])
    assert dump(forgot) == substring_counts([fresh_prompt + [2]], depth)
    # everything evicted: an empty trie
    idx.finish(live)
    empty = SuffixIndex(depth, 0)
    for s in seqs:
        empty.add(s)
    assert empty.num_nodes == 0 and empty.csum[empty.root] == 0 and not empty.children(empty.root)
    assert not empty.cached


def test_a_conversations_next_turn_supersedes_its_last_turn():
    """A prompt that begins with a cached sequence (the last turn's prompt and answer, then a new question)
    evicts it: the session's text is counted once, as the live sequence holds it, so an earlier answer does not
    outweigh the latest one; a cached sequence the prompt does not begin with, or one shorter than HEAD, stays;
    ``add`` supersedes nothing (two equal finished requests are a recurrence)."""
    from specdist.cores.suffix_index import HEAD

    rng = random.Random(11)
    depth, marker = 6, 99
    other = [rng.randrange(8) for _ in range(40)]  # another session's turn: begins differently
    short = [3, 1, 4]  # shorter than HEAD: never looked up again
    idx = SuffixIndex(depth, cache_requests=50)
    for s in (other, short):
        idx.add(s)
    # turn 0: a question and the answer [5, 6, 7]; turn 1: that, a new question and the answer [5, 6, 1]
    turn0 = [rng.randrange(8) for _ in range(HEAD + 4)] + [marker] + [5, 6, 7]
    st = idx.start(turn0)
    idx.finish(st)
    turn1 = turn0 + [rng.randrange(8) for _ in range(10)] + [marker] + [5, 6, 1]
    st = idx.start(iter(turn1))  # (any iterable)
    assert [list(c) for c in idx.cached] == [other, short]  # turn 0 superseded; the others kept
    idx.finish(st)
    assert dump(idx) == substring_counts([other, short, turn1], depth)
    # turn 2 asks again: after the marker, 5 6 continues with 7 once and with 1 once (kept, turn 0 would make it
    # 7 twice against 1 once), a tie, read as the smaller token
    turn2 = turn1 + [rng.randrange(8) for _ in range(10)] + [marker, 5, 6]
    st = idx.start(turn2)
    assert [list(c) for c in idx.cached] == [other, short]
    assert idx.lookup(st, 1, 0.0, 4.0).tokens == [1]
    # a prompt that differs from a cached sequence in one token does not supersede it
    idx.finish(st)
    near = list(turn2)
    near[HEAD + 2] = 7 - near[HEAD + 2]
    idx.finish(idx.start(near + [0]))
    assert len(idx.cached) == 4 and dump(idx) == substring_counts([other, short, turn2, near + [0]], depth)
    # add(): an equal finished sequence counts twice
    idx.add(turn2)
    assert len(idx.cached) == 5 and dump(idx) == substring_counts([other, short, turn2, near + [0], turn2], depth)
    # eviction of the oldest keeps the lookup table in step: superseding after it finds what is left
    idx.evict_oldest()
    idx.start(turn2 + [2])
    assert [list(c) for c in idx.cached] == [short, near + [0]] and sum(len(v) for v in idx.by_head.values()) == 1


def test_nodes_are_not_objects_the_garbage_collector_walks():
    """Nodes are ids into lists of ints: inserting tens of thousands of nodes adds no tracked object
    (a full collection in a serving process would otherwise walk every node)."""
    import gc

    rng = random.Random(3)
    idx = SuffixIndex(24, cache_requests=4)
    idx.add([rng.randrange(1000) for _ in range(50)])  # the lists and a few dicts exist
    before = len(gc.get_objects())
    for _ in range(8):  # some evicted on the way: freed ids are reused
        idx.add([rng.randrange(1000) for _ in range(500)])
    st = idx.start([rng.randrange(1000) for _ in range(100)])
    assert idx.num_nodes > 40_000
    assert len(gc.get_objects()) - before < 50
    assert len(idx.token) - 1 < 5 * 600 * 24  # reused ids: about the held sequences' nodes, not all ever made
    idx.finish(st)


def test_lookup_longest_match_with_a_continuation():
    idx = SuffixIndex(max_depth=8, cache_requests=10)
    for s in ([1, 2, 3, 4, 5], [7, 2, 3, 4, 6], [9, 9, 3, 8]):
        idx.add(s)
    live = idx.start([5, 2, 3])
    # "5 2 3" only occurs as the live sequence's own end; "2 3" occurs twice, followed by 4 both times
    d = idx.lookup(live, 1, min_prob=0.0, max_spec_factor=1.0)
    assert (d.tokens, d.score, d.match_len) == ([4], 1.0, 2)
    # then "2 3 4" is followed by 5 and 6 once each: the tie goes to the smaller token, probability 1/2
    d = idx.lookup(live, 5, min_prob=0.0, max_spec_factor=1.0)
    assert (d.tokens, d.score) == ([4, 5], 1.5)  # capped at factor x match length = 2
    d = idx.lookup(live, 5, min_prob=0.6, max_spec_factor=1.0)
    assert (d.tokens, d.score) == ([4], 1.0)  # the path probability would fall to 0.5 < 0.6
    # past "2 3 4 5" (the end of its text) the walk falls back to the deepest suffix with a
    # continuation: "5" -> 2 (the live sequence's own earlier text), then "5 2" -> 3
    d = idx.lookup(live, 4, min_prob=0.0, max_spec_factor=3.0)
    assert d.tokens == [4, 5, 2, 3] and d.score == pytest.approx(1 + 0.5 * 3)
    assert d.depths == [2, 3, 1, 2]  # each token's match: "2 3", "2 3 4", then "5", "5 2"
    for k in range(6):
        for factor in (0.5, 1.0, 2.5):
            for mp in (0.0, 0.3, 0.6):
                got = idx.lookup(live, k, mp, factor)
                want = reference_lookup(
                    [[1, 2, 3, 4, 5], [7, 2, 3, 4, 6], [9, 9, 3, 8], [5, 2, 3]], [5, 2, 3], 8, k, mp, factor
                )
                assert (got.tokens, got.match_len) == (want[0], want[2]) and got.score == pytest.approx(want[1])


def test_lookup_matches_the_reference_rule_on_random_sequences():
    rng = random.Random(3)
    for trial in range(30):
        depth = rng.choice([2, 3, 4, 6])
        idx = SuffixIndex(depth, cache_requests=3)
        seqs = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(rng.randrange(0, 6))]
        for s in seqs:
            idx.add(s)
        query = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
        live = idx.start(query)
        k, mp, factor = rng.randrange(0, 7), rng.choice([0.0, 0.2, 0.5]), rng.choice([0.5, 1.0, 3.0])
        got = idx.lookup(live, k, mp, factor)
        want = reference_lookup(seqs[-3:] + [query], query, depth, k, mp, factor)
        assert (got.tokens, got.match_len) == (want[0], want[2]), (trial, seqs, query, k, mp, factor)
        assert len(got.depths) == len(got.tokens) and got.depths[:1] == [got.match_len][: len(got.tokens)]
        assert all(1 <= d <= depth - 1 for d in got.depths)  # a match has a continuation within the depth
        assert got.score == pytest.approx(want[1])


def test_live_sequence_never_matches_itself_at_its_end():
    idx = SuffixIndex(max_depth=6, cache_requests=4)
    a = idx.start([1, 2, 3])
    assert idx.lookup(a, 4).tokens == []  # every suffix of it occurs only at its own end
    b = idx.start([1, 2, 3])  # another live request with the same prompt: no continuation either
    assert idx.lookup(a, 4).tokens == [] and idx.lookup(b, 4).tokens == []
    idx.extend(b, [6])  # b's committed token is a continuation of "1 2 3" for a
    d = idx.lookup(a, 4, max_spec_factor=1.0)
    assert (d.tokens, d.match_len) == ([6], 3)  # capped by b's text ending
    assert idx.lookup(b, 4).tokens == []  # b: "1 2 3 6" and its suffixes occur only at its own end
    idx.extend(a, [1, 2])  # a's own earlier text: "1 2" -> 3 (and -> 3 in b)
    assert idx.lookup(a, 1).tokens == [3]
    c = idx.start([4])
    idx.extend(c, [4])
    assert idx.lookup(c, 3, max_spec_factor=1.0).tokens == [4]  # "4 4": "4" was followed by 4 once
    assert idx.lookup(c, 3, max_spec_factor=3.0).tokens == [4, 4, 4]  # and again from "4" (like prompt lookup)


def test_settings_validation_and_constructor_errors():
    with pytest.raises(ValueError):
        SuffixIndex(max_depth=1)
    with pytest.raises(ValueError):
        SuffixIndex(cache_requests=-1)
    for key, bad in (
        ("suffix_max_depth", 1),
        ("suffix_max_depth", 1000),
        ("suffix_min_prob", 1.5),
        ("suffix_min_prob", -0.1),
        ("suffix_max_spec_factor", 0.0),
        ("suffix_cache_requests", -1),
        ("suffix_min_score", -1.0),
        ("suffix_max_depth", 2.5),
        ("suffix_min_prob", "x"),
    ):
        with pytest.raises(ConfigError) as e:
            check_draft(load_config({"draft": {"method": "suffix", key: bad}}).draft)
        assert e.value.key == f"draft.{key}" and "\n" not in str(e.value), (key, bad)
    cfg = load_config(
        {
            "draft": {
                "method": "hybrid",
                "suffix_max_depth": 2,
                "suffix_min_prob": 0,
                "suffix_cache_requests": 0,
                "suffix_min_score": 0,
            }
        }
    )
    assert SuffixProposer.settings_of(cfg.draft).suffix_min_prob == 0.0 and draft_dtype(cfg) == cfg.target.dtype
    with pytest.raises(ConfigError, match="needs a draft model"):
        build_drafter_core(cfg.draft, 8, 2, 32)
    assert build_drafter_core(load_config({"draft": {"method": "none"}}).draft, 8, 2, 32) is None


# ---------------------------------------------------------------- 2. the drafter core
def test_core_keeps_released_sequences_and_frees_live_state():
    core = DrafterCore(SuffixProposer(8, SuffixSettings(max_depth=6, cache_requests=2)), 64)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    core.start([StartItem("a", [1, 2, 3, 4, 5, 6], sp, 1)])
    core.propose([ProposeItem("a", 0, [1, 2], 0, 8)])  # commits 1, 2 (no drafts asked)
    core.release(["a"])
    index = core.proposer.indexes.for_tenant("")  # every request here is the one tenant's
    assert core.requests == {} and index.live == 0 and len(index.cached) == 1
    core.start([StartItem("b", [0, 1, 2], sp, 2)])
    (p,), _ = core.propose([ProposeItem("b", 0, [], 4, 3)])
    assert p.token_ids == [3, 4] and p.q is None  # "1 2" -> 3 -> 4, capped at 1.0 x match length 2
    (p,), _ = core.propose([ProposeItem("b", 2, [5], 3, 6)])  # both accepted, then 5
    assert p.token_ids == [6, 1, 2]  # "1 2 3 4 5" -> 6 -> 1 -> 2: the rest of a's sequence
    h = core.health()
    assert h["method"] == "suffix" and h["requests"] == 1 and h["suffix_cached_requests"] == 1
    core.release(["b", "b"])
    core.start([StartItem("c", [7], sp, 3)])
    core.release(["c"])  # three finished with room for 2: a's sequence is evicted
    assert len(index.cached) == 2 and index.live == 0
    assert dump(index) == substring_counts([[0, 1, 2, 3, 4, 5], [7]], 6)  # b's last drafts never committed
    # forgetting the finished requests: a new request drafts nothing from them, as on a fresh core
    core.forget_finished()
    core.start([StartItem("d", [0, 1, 2], sp, 4)])
    (p,), _ = core.propose([ProposeItem("d", 0, [], 4, 3)])
    index = core.proposer.indexes.for_tenant("")
    assert len(p) == 0 and not index.cached and dump(index) == substring_counts([[0, 1, 2]], 6)
    core.release(["d"])


# ---------------------------------------------------------------- 3. through the engine
PROMPTS = [[0], [1, 2], [3, 4, 5], [6, 0, 1, 2], [2, 2], [5], [4, 1], [1, 3, 5, 0, 2, 4, 6]]
MAX_TOKENS = [20, 7, 13, 17, 1, 9, 2, 11]


@pytest.fixture(scope="module")
def reference(tiny_models):
    eng = Engine.from_config(tiny_config(tiny_models, "none", 1))
    memo = {}

    def ref(prompt, m):
        key = (tuple(prompt), m)
        if key not in memo:
            sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
            memo[key] = eng.generate([prompt], sp)[0].token_ids
        return memo[key]

    return ref


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_greedy_equals_target_only(tiny_models, reference, method):
    cfg = tiny_config(tiny_models, method, 4)
    cfg["draft"].update(suffix_max_depth=6, suffix_min_score=1.0)  # hybrid: both sources in use
    eng = Engine.from_config(cfg)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    for _ in range(2):  # the second round drafts from the first round's sequences
        outs = eng.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [reference(p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
    h = eng.draft_core.health()
    assert h["method"] == method and h["requests"] == 0
    assert sum(o.metrics.accepted for o in outs) > 0
    if method == "hybrid":
        assert h["hybrid_suffix_drafts"] > 0 and h["hybrid_model_drafts"] > 0, h


def test_repeated_prompt_is_drafted_from_the_index(tiny_models, reference):
    """A prompt seen before (a retry, an agent re-asking, an edit that rewrites the same text):
    the second request's drafts come from the first one's sequence and are accepted."""
    prompt, m = [3, 1, 4, 1, 5, 2, 6], 40
    rates = {}
    for method in ("ngram", "suffix"):
        eng = Engine.from_config(tiny_config(tiny_models, method, 4))
        sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        first = eng.generate([prompt], sp)[0]
        again = eng.generate([prompt], sp)[0]
        assert first.token_ids == again.token_ids == reference(prompt, m)
        rates[method] = again.metrics.accepted / max(1, again.metrics.drafted)
        print(
            f"{method}: second request drafted {again.metrics.drafted}, accepted {again.metrics.accepted}, "
            f"steps {again.metrics.steps}"
        )
        if method == "suffix":
            assert again.metrics.drafted >= m - 10 and rates[method] >= 0.95, rates
            assert again.metrics.steps <= m // 4 + 2  # k = 4: nearly every step emits 5 tokens
    assert rates["suffix"] > rates["ngram"], rates


def test_adaptive_rule_cuts_suffix_proposals_to_its_choice(tiny_models, reference):
    """Under the adaptive rule a suffix drafter proposes as far as each request may draft, with each
    token's match length; the rule prices those positions and the verifier sees each proposal cut to the
    chosen length (here a rule that keeps at most 2). Greedy output stays plain decoding, and the cut
    tails are not committed: the drafter continues from what the target kept."""
    prompt, m = [3, 1, 4, 1, 5, 2, 6], 40
    eng = Engine.from_config(tiny_config(tiny_models, "suffix", 6, length_policy="adaptive"))
    sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
    assert eng.generate([prompt], sp)[0].token_ids == reference(prompt, m)
    # the rule's choices from acceptances, not from this moment's timing
    eng.scheduler.length_policy = frozen_adaptive_policy(6)
    seen, proposed = [], []
    sched = eng.scheduler
    choose, verify, propose = sched.length_policy.choose, sched.verifier.verify, sched.replicas[0].drafter.propose

    def cut_at_two(caps, accs, replicas=None, first=None, match_lengths=None):
        seen.append((list(caps), match_lengths))
        return [min(2, k) for k in choose(caps, accs, replicas, first, match_lengths)]

    def record_proposals(items):
        out = propose(items)
        proposed.extend(len(p) for p in out[0])
        return out

    def check_verify(items):
        assert all(len(it.proposal) <= 2 for it in items if it.proposal is not None)
        return verify(items)

    eng.scheduler.length_policy.choose, eng.scheduler.verifier.verify = cut_at_two, check_verify
    eng.scheduler.replicas[0].drafter.propose = record_proposals
    again = eng.generate([prompt], sp)[0]
    assert again.token_ids == reference(prompt, m)
    assert max(proposed) == 6 and max(c[0] for c, _ in seen) == 6  # proposed in full, then priced
    assert all(len(ms[0]) == c[0] for c, ms in seen if ms is not None and ms[0] is not None)  # one per token
    assert again.metrics.drafted >= m // 3 and again.metrics.accepted >= 0.9 * again.metrics.drafted
    assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}


def test_draft_worker_actor_hosts_suffix_and_hybrid(tiny_models, reference):
    """The deployment's draft actor (in process, no Ray) loads both methods through the same
    factory, warms up, and serves them over gRPC: the remote engine's greedy output is the target's.
    The adaptive rule: suffix proposals come in full with their match lengths and are cut before the
    remote verification."""
    from specdist.engine.remote import RemoteEngine
    from workers.actors import DraftActor

    cfg = tiny_config(tiny_models, "suffix", 3, length_policy="adaptive")
    for method in ("suffix", "hybrid"):
        cfg["draft"]["method"] = method
        eng = Engine.from_config(cfg)
        actor = DraftActor(0, num_threads=None)
        try:
            info = actor.load(
                {**cfg["draft"], "suffix_max_depth": 5, "suffix_min_score": 0.5},
                tiny_models["target"],
                {"max_batch_size": 8, "max_model_len": 64},
                device="cpu",
            )
            assert info["method"] == method and info["vocab_size"] == 8
            actor.warmup()
            suffix = getattr(actor.worker.proposer, "suffix", actor.worker.proposer)  # hybrid: its suffix part
            assert actor.worker.method == method and suffix.settings.max_depth == 5
            assert actor.worker.requests == {}
            with ServedCores(eng.target_core, [actor.worker]) as served:
                remote = RemoteEngine(
                    eng.config,
                    served.target_address,
                    served.draft_addresses,
                    tokenizer=eng.tokenizer,
                    vocab_size=eng.vocab_size,
                    eos_ids=eng.scheduler.eos_ids,
                )
                drafter, lengths = remote.scheduler.replicas[0].drafter, []
                propose = drafter.propose

                def record(items):  # the match lengths of suffix proposals come over the wire
                    out = propose(items)
                    lengths.extend((len(p), p.match_lengths) for p in out[0] if len(p))
                    return out

                drafter.propose = record
                try:
                    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
                    outs = remote.generate(PROMPTS, params)
                    assert [o.token_ids for o in outs] == [reference(p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
                    assert sum(o.metrics.accepted for o in outs) > 0
                    with_lengths = [n for n, ms in lengths if ms is not None and len(ms) == n and min(ms) >= 1]
                    assert with_lengths if method == "suffix" else lengths, lengths
                finally:
                    remote.close()
            assert actor.worker.requests == {}
        finally:
            actor.executor.shutdown()


def test_the_index_is_bounded_in_tokens_not_only_in_requests() -> None:
    """A client sending long random requests cannot fill the index: finished sequences beyond ``cache_tokens``
    tokens are evicted, oldest first, whatever ``cache_requests`` allows; the live ones stay. The index reports
    its size (nodes, cached tokens)."""
    import random

    rng = random.Random(5)
    idx = SuffixIndex(max_depth=8, cache_requests=256, cache_tokens=500)
    for _ in range(40):
        idx.add([rng.randrange(1000) for _ in range(120)])  # 40 x 120 tokens: 4,800 finished
    st = idx.stats()
    assert st["cached_tokens"] <= 500 and st["cached"] == 4  # the newest four fit; 4 x 120 = 480
    live = idx.start([rng.randrange(1000) for _ in range(900)])  # a live sequence counts, and is never evicted
    assert idx.stats()["cached_tokens"] <= 500 and len(live) == 900
    idx.add([1] * 800)  # one finished sequence over the bound: not kept at all
    assert idx.stats()["cached_tokens"] <= 500
    assert idx.stats()["nodes"] <= (500 + 900) * 8  # nodes bounded by the tokens held times the depth
