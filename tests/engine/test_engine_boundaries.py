"""Boundary cases of the speculative step, through the real Engine on tiny models.

Covers docs/exactness.md section 2: greedy equality (against target-only
decoding and against plain HF ``generate``), rejection at the first position, all
drafts accepted (self-draft, ``p == q``), a stop token / EOS / stop string inside an
accepted run, ``max_tokens`` and the context limit reached inside a draft, KV slots
after every kind of finish, continuous batching, per-request seeds, and top-k/top-p
supports that differ between target and draft.

All models are the tiny random Llama checkpoints from ``conftest.py`` (vocabulary of
8 words ``a..g`` + ``<eos>`` = 7). Engines are built once per module.
"""

from __future__ import annotations

import pytest
import torch
from support.helpers import tiny_config

from specdist import Engine, InvalidArgument, SamplingParams
from specdist.cores.sampling import process_logits

EOS = 7

# Prompts of different lengths (ragged batch); token ids in [0, 7).
# Eight prompts: exactly the default max_batch_size of tiny_config, so all run at once.
PROMPTS = [[0], [1, 2], [3, 4, 5], [6, 0, 1, 2], [2, 2], [5], [4, 1], [1, 3, 5, 0, 2, 4, 6]]
MAX_TOKENS = [20, 7, 13, 17, 1, 9, 2, 11]


# --------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def make_engine(tiny_models):
    """Engine factory, memoised per (method, k, self_draft, engine settings)."""
    cache: dict = {}

    def make(method: str = "model", k: int = 3, self_draft: bool = False, **engine) -> Engine:
        key = (method, k, self_draft, tuple(sorted(engine.items())))
        if key in cache and not _is_idle(cache[key]):
            del cache[key]  # left busy by an earlier failing test: start afresh so failures do not cascade
        if key not in cache:
            cfg = tiny_config(tiny_models, method, k, **engine)
            if self_draft:
                cfg["draft"]["model"] = tiny_models["target"]  # p == q: every draft token accepted
            cache[key] = Engine.from_config(cfg)
        eng = cache[key]
        assert_idle(eng)
        return eng

    return make


@pytest.fixture(scope="module")
def hf_target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["target"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_draft(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["draft"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy_ref(make_engine):
    """Target-only greedy output of one prompt run alone: (prompt, max_tokens, ignore_eos) -> RequestOutput."""
    memo: dict = {}

    def ref(prompt, max_tokens: int, ignore_eos: bool = True, **kw):
        pkey = prompt if isinstance(prompt, str) else tuple(prompt)
        key = (pkey, max_tokens, ignore_eos, tuple(sorted(kw.items())))
        if key not in memo:
            eng = make_engine("none", 1)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos, **kw)
            memo[key] = eng.generate([prompt], params)[0]
            assert_idle(eng)
        return memo[key]

    return ref


def _is_idle(eng: Engine) -> bool:
    return not eng.waiting and not eng.running and all(v == 0 for v in eng.kv_slots_in_use().values())


def assert_idle(eng: Engine) -> None:
    """No request queued or running, and no KV slot held in any cache."""
    assert not eng.waiting and not eng.running and not eng.has_unfinished()
    used = eng.kv_slots_in_use()
    assert all(v == 0 for v in used.values()), used


def greedy(max_tokens: int, ignore_eos: bool = True, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos, **kw)


# --------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("ignore_eos", [True, False])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["model", "ngram", "suffix", "hybrid", "none"])
def test_greedy_ragged_batch_equals_target_only(make_engine, greedy_ref, method, k, ignore_eos):
    eng = make_engine(method, k)
    params = [greedy(m, ignore_eos) for m in MAX_TOKENS]
    outs = eng.generate(PROMPTS, params)
    assert_idle(eng)
    for prompt, m, out in zip(PROMPTS, MAX_TOKENS, outs):
        ref = greedy_ref(prompt, m, ignore_eos)
        assert out.token_ids == ref.token_ids, (method, k, prompt)
        assert out.finish_reason == ref.finish_reason and out.stop_reason == ref.stop_reason
        assert out.prompt_token_ids == prompt
        if ignore_eos:
            assert len(out.token_ids) == m and out.finish_reason == "length"
        else:
            assert EOS not in out.token_ids
            assert out.finish_reason in ("length", "stop")
    # The reference must itself hit an EOS somewhere, or ignore_eos=False tests nothing.
    if not ignore_eos:
        assert any(greedy_ref(p, m, False).finish_reason == "stop" for p, m in zip(PROMPTS, MAX_TOKENS))


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_equals_hf_generate(make_engine, hf_target, ignore_eos):
    engines = [make_engine("none", 1), make_engine("model", 3), make_engine("ngram", 5), make_engine("model", 5, True)]
    for prompt, m in zip(PROMPTS, MAX_TOKENS):
        ids = torch.tensor([prompt])
        kw = {"eos_token_id": None} if ignore_eos else {"eos_token_id": EOS}
        with torch.no_grad():
            gen = hf_target.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=m, pad_token_id=0, **kw
            )
        ref = gen[0, len(prompt) :].tolist()
        if not ignore_eos and ref and ref[-1] == EOS:
            ref, reason = ref[:-1], "stop"  # HF keeps the EOS; specdist drops it
        else:
            reason = "length"
        if ignore_eos:
            assert len(ref) == m
        for eng in engines:
            out = eng.generate([prompt], greedy(m, ignore_eos))[0]
            assert out.token_ids == ref, (eng.config.draft, prompt)
            assert out.finish_reason == reason
            assert_idle(eng)


# --------------------------------------------------------------------------- all accepted / first rejected
@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_draft_greedy_accepts_everything(make_engine, greedy_ref, k):
    eng = make_engine("model", k, self_draft=True)
    steps_allowed = 3
    m = steps_allowed * (k + 1)
    eng.stats.reset()
    outs = eng.generate(PROMPTS[:5], greedy(m))
    assert_idle(eng)
    for prompt, out in zip(PROMPTS, outs):
        met = out.metrics
        assert out.token_ids == greedy_ref(prompt, m).token_ids
        assert met.drafted == steps_allowed * k
        assert met.accepted == met.drafted
        assert met.acceptance_rate == 1.0
        assert met.steps == steps_allowed
        assert met.mean_accepted_length == k + 1
    assert eng.stats.accepted == eng.stats.drafted > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_draft_sampling_accepts_everything(make_engine, k):
    """p == q at temperature 1: rejection probability is 0 analytically, so every draft is accepted."""
    eng = make_engine("model", k, self_draft=True)
    m = 4 * (k + 1)
    params = [SamplingParams(max_tokens=m, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]
    prompts = PROMPTS
    outs = eng.generate(prompts, params)
    assert_idle(eng)
    for out in outs:
        met = out.metrics
        assert len(out.token_ids) == m
        assert met.accepted == met.drafted == 4 * k
        assert met.acceptance_rate == 1.0
        assert met.mean_accepted_length == k + 1
    # Sampling really happened (not greedy in disguise): outputs differ across seeds.
    assert len({tuple(o.token_ids) for o in outs}) > 3


def _argmax_next(model, prefix) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([prefix])).logits[0, -1].argmax())


def test_rejection_at_first_position_greedy(make_engine, greedy_ref, hf_target, hf_draft):
    cands = [p for p in PROMPTS if _argmax_next(hf_draft, p) != _argmax_next(hf_target, p)]
    assert cands, "no prompt where the tiny draft and target disagree on the first token"
    eng = make_engine("model", 3)
    for prompt in cands:
        req = eng.add_request(prompt, greedy(10))
        eng.step()
        # First draft token differs from the target's argmax -> rejected at position 0;
        # the emitted token is the residual = target argmax.
        assert req.metrics.drafted == 3 and req.metrics.accepted == 0
        assert req.output.token_ids == [_argmax_next(hf_target, prompt)]
        while not req.finished:
            eng.step()
        out = req.to_output()
        assert out.token_ids == greedy_ref(prompt, 10).token_ids
        assert out.metrics.accepted < out.metrics.drafted
        assert_idle(eng)


# --------------------------------------------------------------------------- stop inside an accepted run
def test_stop_token_inside_accepted_run(make_engine, greedy_ref):
    k = 5
    eng = make_engine("model", k, self_draft=True)
    checked_inside = 0
    for prompt in PROMPTS:
        ref = greedy_ref(prompt, 18).token_ids
        for t in sorted(set(ref) - {EOS}):
            j = ref.index(t)
            out = eng.generate([prompt], greedy(18, stop_token_ids=[t]))[0]
            assert_idle(eng)
            assert out.token_ids == ref[:j], (prompt, t)
            assert t not in out.token_ids
            assert out.finish_reason == "stop" and out.stop_reason == t
            if 0 < j < k:  # t sat strictly inside the first step's accepted run
                assert out.metrics.steps == 1
                checked_inside += 1
    assert checked_inside >= 3


def _prompt_with_eos_inside(greedy_ref, k: int):
    for prompt in PROMPTS + [[i, j] for i in range(7) for j in range(7)]:
        ref = greedy_ref(prompt, 16).token_ids
        if EOS in ref and 0 < ref.index(EOS) < k and ref.count(EOS) < len(ref):
            return prompt, ref
    raise AssertionError("no prompt whose greedy output has EOS inside the first draft run")


@pytest.mark.parametrize("method", ["self", "model", "ngram", "suffix", "hybrid", "none"])
def test_eos_inside_accepted_run(make_engine, greedy_ref, method):
    k = 5
    eng = make_engine("model", k, self_draft=True) if method == "self" else make_engine(method, k)
    prompt, ref = _prompt_with_eos_inside(greedy_ref, k)
    j = ref.index(EOS)
    out = eng.generate([prompt], greedy(16, ignore_eos=False))[0]
    assert_idle(eng)
    assert out.token_ids == ref[:j]
    assert out.finish_reason == "stop" and out.stop_reason == EOS
    if method == "self":
        assert out.metrics.steps == 1
    # ignore_eos=True continues past it, with EOS itself in the output and not in the text
    out = eng.generate([prompt], greedy(16, ignore_eos=True))[0]
    assert_idle(eng)
    assert out.token_ids == ref and out.token_ids[j] == EOS and len(out.token_ids) == 16
    assert out.finish_reason == "length" and out.stop_reason is None
    assert "<eos>" not in out.text
    # an explicit stop_token_ids=[EOS] stops even with ignore_eos=True
    out = eng.generate([prompt], greedy(16, ignore_eos=True, stop_token_ids=[EOS]))[0]
    assert out.token_ids == ref[:j] and out.finish_reason == "stop" and out.stop_reason == EOS
    assert_idle(eng)


@pytest.mark.parametrize("method", ["self", "model", "ngram", "none"])
def test_eos_as_first_token(make_engine, greedy_ref, method):
    """EOS as the very first emitted token (rejection/bonus at position 0): empty output, "stop"."""
    eng = make_engine("model", 3, self_draft=True) if method == "self" else make_engine(method, 3)
    prompts = [[i, j] for i in range(7) for j in range(7) if greedy_ref([i, j], 6).token_ids[0] == EOS]
    assert prompts, "no two-token prompt whose greedy continuation starts with EOS"
    for prompt in prompts[:3]:
        out = eng.generate([prompt], greedy(6, ignore_eos=False))[0]
        assert out.token_ids == [] and out.text == ""
        assert out.finish_reason == "stop" and out.stop_reason == EOS
        assert_idle(eng)
        text_prompt = " ".join("abcdefg"[t] for t in prompt)
        assert list(eng.stream(text_prompt, greedy(6, ignore_eos=False))) == []
        assert eng.last_output.finish_reason == "stop" and eng.last_output.token_ids == []
        assert_idle(eng)


# --------------------------------------------------------------------------- max_tokens inside a draft
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6])
def test_max_tokens_inside_draft(make_engine, greedy_ref, max_tokens, temperature):
    eng = make_engine("model", 5, self_draft=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7, ignore_eos=True)
    outs = eng.generate(PROMPTS, params)
    assert_idle(eng)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.metrics.drafted <= max_tokens - 1
        assert out.metrics.drafted == out.metrics.accepted == max_tokens - 1  # self-draft: one step
        assert out.metrics.steps == 1
        if temperature == 0:
            assert out.token_ids == greedy_ref(prompt, max_tokens).token_ids


@pytest.mark.parametrize("max_tokens", [1, 2, 4, 6])
@pytest.mark.parametrize("method", ["model", "ngram", "suffix", "hybrid"])
def test_max_tokens_inside_draft_with_rejections(make_engine, greedy_ref, method, max_tokens):
    eng = make_engine(method, 5)
    outs = eng.generate(PROMPTS, greedy(max_tokens))
    assert_idle(eng)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_ref(prompt, max_tokens).token_ids
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
        # every verification emits >= 1 token and drafts at most (remaining - 1)
        assert out.metrics.drafted <= out.metrics.steps * (max_tokens - 1)


# --------------------------------------------------------------------------- context limit
@pytest.mark.parametrize("plen", [9, 10, 11])
@pytest.mark.parametrize("method", ["self", "model", "ngram", "suffix", "hybrid", "none"])
def test_context_limit_inside_draft(make_engine, method, plen):
    limit = 12
    if method == "self":
        eng = make_engine("model", 5, True, max_model_len=limit)
    else:
        eng = make_engine(method, 5, max_model_len=limit)
    prompts = [[(i * 3 + j) % 7 for i in range(plen)] for j in range(3)] + [[1, 2, 3]]
    ref_eng = make_engine("none", 1)
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=100, temperature=temperature, seed=3, ignore_eos=True)
        outs = eng.generate(prompts, params)
        assert_idle(eng)
        for prompt, out in zip(prompts, outs):
            assert len(prompt) + len(out.token_ids) == limit
            assert out.finish_reason == "length"
            if temperature == 0:
                assert out.token_ids == ref_eng.generate([prompt], greedy(limit - len(prompt)))[0].token_ids
    if method == "self":  # all drafts accepted: the last verification is capped by the room left
        out = eng.generate([prompts[0]], greedy(100))[0]
        assert out.metrics.drafted == limit - plen - 1 and out.metrics.steps == 1


# --------------------------------------------------------------------------- stop strings and streaming
def _stop_cases(greedy_ref, prompt: str):
    ref = greedy_ref(prompt, 14)
    text, ids = ref.text, ref.token_ids
    words = text.split(" ")
    cands = {words[0], words[3], " ".join(words[2:4]), " ".join(words[4:7]), words[5][:1] + " " + words[6]}
    cands.add(text[3:6])  # a stop string that straddles word boundaries
    return ref, text, ids, sorted(c for c in cands if c.strip())


@pytest.mark.parametrize("method", ["self", "model", "ngram", "none"])
def test_stop_strings_and_streaming(make_engine, greedy_ref, method):
    eng = make_engine("model", 5, self_draft=True) if method == "self" else make_engine(method, 3)
    tok = eng.tokenizer
    n_cases = 0
    for prompt in ["a b c", "g a", "d e f g a b", "c"]:
        ref, text, ids, stops = _stop_cases(greedy_ref, prompt)
        for s in stops:
            cut = text.find(s)
            assert cut >= 0
            # token_ids end at the token that completed the stop string
            n_tok = next(i for i in range(1, len(ids) + 1) if s in tok.decode(ids[:i], skip_special_tokens=True))
            params = greedy(14, stop=[s])
            out = eng.generate([prompt], params)[0]
            assert_idle(eng)
            assert out.text == text[:cut], (prompt, s)
            assert s not in out.text
            assert out.finish_reason == "stop" and out.stop_reason == s
            assert out.token_ids == ids[:n_tok]

            pieces = list(eng.stream(prompt, params))
            assert_idle(eng)
            assert "".join(pieces) == eng.last_output.text == text[:cut]
            assert all(s not in p for p in pieces)
            assert eng.last_output.finish_reason == "stop" and eng.last_output.stop_reason == s
            n_cases += 1
    assert n_cases >= 12

    # A stop string that never appears: stream still concatenates to the full text.
    params = greedy(14, stop=["zzz"])
    pieces = list(eng.stream("a b c", params))
    assert "".join(pieces) == eng.last_output.text == greedy_ref("a b c", 14).text
    assert eng.last_output.finish_reason == "length"
    # Without stop strings too.
    pieces = list(eng.stream("a b c", greedy(14)))
    assert "".join(pieces) == eng.last_output.text == greedy_ref("a b c", 14).text
    assert_idle(eng)


def test_multiple_stop_strings_earliest_wins(make_engine, greedy_ref):
    eng = make_engine("model", 5, self_draft=True)
    ref = greedy_ref("a b c", 14)
    words = ref.text.split(" ")
    late, early = " ".join(words[6:8]), words[2]
    cut = min(ref.text.find(late), ref.text.find(early))
    out = eng.generate(["a b c"], greedy(14, stop=[late, early]))[0]
    assert out.text == ref.text[:cut]
    assert out.stop_reason == (early if ref.text.find(early) <= ref.text.find(late) else late)
    assert_idle(eng)


# --------------------------------------------------------------------------- KV slots and batching
@pytest.mark.parametrize("method", ["self", "model", "ngram", "suffix", "hybrid", "none"])
def test_kv_slots_free_after_every_finish_and_abort(make_engine, method):
    eng = make_engine("model" if method == "self" else method, 3, method == "self", max_batch_size=4)
    assert eng.kv_slots_in_use()["target"] == 0
    if method in ("self", "model", "hybrid"):
        assert set(eng.kv_slots_in_use()) == {"target", "draft"}

    # Every finish reason in one batch: length, EOS stop, stop token, stop string.
    params = [greedy(5), greedy(16, ignore_eos=False), greedy(16, stop_token_ids=[3]), greedy(16, stop=["c"])]
    outs = eng.generate(["a b c", [6, 0, 1, 2], [0], "d e"], params)
    assert_idle(eng)
    assert [(o.finish_reason, o.stop_reason) for o in outs[:3]] == [("length", None), ("stop", EOS), ("stop", 3)]

    # Abort mid-run (all 4 slots busy); the others go on and finish normally.
    reqs = [eng.add_request(p, greedy(30)) for p in PROMPTS[:4]]
    eng.step()
    eng.step()
    assert len(eng.running) == 4 and not eng.waiting
    assert all(v == 4 for v in eng.kv_slots_in_use().values())
    assert eng.abort(reqs[1].request_id)
    assert not eng.abort(reqs[1].request_id)  # already gone
    assert not eng.abort("no-such-id")
    out1 = reqs[1].to_output()
    assert out1.finish_reason == "abort" and 0 < len(out1.token_ids) < 30
    assert all(v == 3 for v in eng.kv_slots_in_use().values())
    eng.step()
    assert eng.abort(reqs[2].request_id)
    while eng.has_unfinished():
        eng.step()
    assert_idle(eng)
    assert [r.to_output().finish_reason for r in reqs] == ["length", "abort", "abort", "length"]
    assert len(reqs[0].output.token_ids) == 30

    # Abort everything mid-run.
    reqs = [eng.add_request(p, greedy(30)) for p in PROMPTS[4:8]]
    eng.step()
    for r in reqs:
        assert eng.abort(r.request_id)
    assert_idle(eng)
    assert all(r.finished for r in reqs)

    # Abort before the request was ever admitted (still waiting).
    r = eng.add_request([1, 2, 3], greedy(5))
    assert eng.waiting and eng.abort(r.request_id)
    assert_idle(eng)

    # Abandoning a stream aborts its request.
    gen = eng.stream("a b c", greedy(30))
    next(gen)
    assert eng.kv_slots_in_use()["target"] == 1
    gen.close()
    assert_idle(eng)

    # The engine still serves normally afterwards.
    out = eng.generate([[0]], greedy(6))[0]
    assert len(out.token_ids) == 6
    assert_idle(eng)
    if method in ("suffix", "hybrid"):  # every finished or aborted request's live index state is gone
        assert not eng.draft_core.requests and eng.draft_core.proposer.index_stats()["live"] == 0


@pytest.mark.parametrize("method", ["self", "model", "ngram", "none"])
def test_continuous_batching_matches_alone(make_engine, greedy_ref, method):
    eng = make_engine("model" if method == "self" else method, 3, method == "self", max_batch_size=4)
    g = torch.Generator().manual_seed(0)
    lengths = [int(torch.randint(1, 8, (1,), generator=g)) for _ in range(20)]
    prompts = [torch.randint(0, 7, (n,), generator=g).tolist() for n in lengths]
    max_toks = [int(torch.randint(1, 16, (1,), generator=g)) for _ in range(20)]
    eos_flags = [i % 3 != 0 for i in range(20)]
    params = [greedy(m, e) for m, e in zip(max_toks, eos_flags)]
    outs = eng.generate(prompts, params)
    assert_idle(eng)
    assert len(outs) == 20
    for p, m, e, out in zip(prompts, max_toks, eos_flags, outs):
        assert out.finished
        assert out.token_ids == greedy_ref(p, m, e).token_ids, (p, m, e)
        assert out.finish_reason == greedy_ref(p, m, e).finish_reason


def test_abort_waiting_request_when_slots_are_full(make_engine):
    """More requests than KV slots: the extra ones wait; aborting a waiting one frees nothing it never held."""
    eng = make_engine("model", 3, max_batch_size=4)
    reqs = [eng.add_request(p, greedy(30)) for p in PROMPTS[:6]]
    eng.step()
    assert len(eng.running) == 4 and len(eng.waiting) == 2
    assert all(v == 4 for v in eng.kv_slots_in_use().values())
    assert eng.abort(reqs[5].request_id)  # waiting
    assert eng.abort(reqs[1].request_id)  # running
    eng.step()  # request 4 takes the freed slot
    assert reqs[4] in eng.running and not eng.waiting
    for r in list(eng.running):
        assert eng.abort(r.request_id)
    assert_idle(eng)
    assert all(r.finished for r in reqs)


def test_more_requests_than_slots_minimal(make_engine):
    """Minimal continuous-batching case: 3 prompts, 2 slots."""
    eng = make_engine("none", 1, max_batch_size=2)
    outs = eng.generate([[0], [1], [2]], greedy(3))
    assert [len(o.token_ids) for o in outs] == [3, 3, 3]
    assert_idle(eng)


# --------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("method", ["model", "ngram", "none"])
def test_seeded_request_independent_of_batch(make_engine, method):
    eng = make_engine(method, 3)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = [1, 2, 3]
    alone = eng.generate([prompt], seeded)[0].token_ids
    again = eng.generate([prompt], seeded)[0].token_ids
    assert alone == again and len(alone) == 16

    settings = [(5, 1.0, None), (20, 0.7, 9), (3, 0.0, None), (12, 1.3, None), (8, 1.0, 1234), (30, 1.0, 5)]
    others = [SamplingParams(max_tokens=m, temperature=t, seed=s) for m, t, s in settings]
    batch_prompts = [[0], [4, 5, 6, 0, 1], [2], prompt, [3, 3], [6, 5, 4, 3, 2, 1, 0]]
    for pos in (0, 3, 6):  # first, middle, last
        ps = batch_prompts[:pos] + [prompt] + batch_prompts[pos:]
        sp = others[:pos] + [seeded] + others[pos:]
        outs = eng.generate(ps, sp)
        assert outs[pos].token_ids == alone, pos
        assert_idle(eng)
    # A different seed gives a different output (the seed is really used).
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True)
    assert eng.generate([prompt], other_seed)[0].token_ids != alone


def test_seeded_request_waiting_for_a_slot(make_engine):
    """A seeded request that has to wait for a free slot still gives the same output as alone."""
    eng = make_engine("model", 3, max_batch_size=2)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = eng.generate([[1, 2, 3]], seeded)[0].token_ids
    sp = [SamplingParams(max_tokens=9, seed=1), SamplingParams(max_tokens=4, temperature=0.5), seeded]
    outs = eng.generate([[0], [4, 5, 6], [1, 2, 3]], sp)
    assert outs[2].token_ids == alone
    assert_idle(eng)


def test_seeded_request_same_across_engines(make_engine):
    """Two engines with the same config give the same seeded output (no hidden engine-level state)."""
    a = make_engine("model", 3)
    b = make_engine("model", 3, max_batch_size=4)
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=77)
    assert a.generate([[5, 6]], sp)[0].token_ids == b.generate([[5, 6]], sp)[0].token_ids


# --------------------------------------------------------------------------- tiny temperatures
@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 1e-40, 1e-45])
@pytest.mark.parametrize("method", ["model", "none"])
def test_tiny_positive_temperature_is_greedy(make_engine, greedy_ref, method, temperature):
    """As temperature -> 0+ the processed distribution tends to the argmax one-hot; a tiny
    (even float32-subnormal) temperature must never turn the logits into inf/NaN and emit junk."""
    eng = make_engine(method, 3)
    try:
        params = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True)
    except InvalidArgument as e:  # rejecting an unusable temperature up front is fine too
        assert e.field == "temperature"
        return
    outs = eng.generate(PROMPTS, params)
    assert_idle(eng)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_ref(prompt, 10).token_ids, (temperature, prompt)


# --------------------------------------------------------------------------- top-k / top-p supports
@pytest.mark.slow
@pytest.mark.parametrize("top_k,top_p", [(2, 0.5), (2, 1.0), (0, 0.5), (3, 0.8)], ids=["k2p05", "k2", "p05", "k3p08"])
@pytest.mark.parametrize("method", ["model", "ngram", "suffix", "hybrid"])
def test_emitted_tokens_inside_target_support(make_engine, hf_target, greedy_ref, method, top_k, top_p):
    eng = make_engine(method, 3)
    prompts = [PROMPTS[s % len(PROMPTS)] for s in range(40)]
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, top_k=top_k, top_p=top_p, seed=1000 + s, ignore_eos=True)
        for s in range(40)
    ]
    outs = []
    for i in range(0, 40, 8):  # batches of max_batch_size
        outs += eng.generate(prompts[i : i + 8], params[i : i + 8])
    assert_idle(eng)
    n_checked = rejected = 0
    outputs = set()
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.token_ids
        with torch.no_grad():
            logits = hf_target(torch.tensor([seq])).logits[0]  # [T, V]
        pos = torch.arange(len(prompt) - 1, len(seq) - 1)  # logits that predicted each output token
        n = len(pos)
        probs = process_logits(
            logits[pos], torch.ones(n), torch.full((n,), top_k, dtype=torch.long), torch.full((n,), float(top_p))
        )
        emitted = torch.tensor(out.token_ids)
        p_emitted = probs[torch.arange(n), emitted]
        assert bool((p_emitted > 0).all()), (prompt, out.token_ids, p_emitted)
        n_checked += n
        rejected += out.metrics.drafted - out.metrics.accepted
        outputs.add(tuple(out.token_ids))
        if (top_k, top_p) == (2, 0.5):
            # top-2 then top-p 0.5 keeps only the argmax: sampling is greedy in disguise
            assert out.token_ids == greedy_ref(prompt, 12).token_ids
    assert n_checked == 40 * 12
    assert rejected > 0  # the supports did differ somewhere, so rejections were exercised
    if (top_k, top_p) != (2, 0.5):
        assert len(outputs) > len(PROMPTS)  # genuine sampling happened
