"""Pipelined drafting (specdist/cores/draft_pipeline.py): exact law, same tokens, no leaks.

1. Enumeration: the exact law of the first ``m`` tokens under the pipelined algorithm (hit rule
   :func:`prepared_prefix_holds`, guess = mode of q, prepared drafts sampled after the assumed
   prefix, misses redrafted or skipped) is computed over random target / draft tables and
   equals the target's joint law to 1e-12. Two negative controls: reusing prepared drafts after
   any outcome but sending the q rows of the *true* prefix (tokens no longer come from the rows
   sent) changes the law; reusing them with the rows they were sampled from does not (the
   verifier is exact for any proposal law; the hit rule is about acceptance, and keeps the
   drafter's cache on the true prefix).
2. Frequency: N = 4000 sequences through the engine with the pipeline on, G-test against the
   target law at alpha = 1e-4 (false-failure rate 1e-4); the faulty pipeline above, run through
   the same engine (N = 1500), must exceed the threshold, and its exact law (enumerated from the
   tiny models' own tables) is detected with power > 0.99.
3. Greedy (and, with redrafted misses and fixed k, seeded sampled) outputs equal the
   sequential drafter's, in process and over gRPC.
4. Releasing a request while its drafts are being prepared frees everything on the drafter.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import numpy as np
import pytest
from scipy import stats
from support.gtest import (
    ALPHA,
    BATCH,
    MAX_MODEL_LEN,
    VOCAB,
    Case,
    N,
    _hf_logits,
    _prob_table,
    g_statistic,
    joint,
    merge_cells,
    power,
    seq_index,
    transform,
)
from support.helpers import ServedCores, tiny_config

from specdist.cores.draft import LocalDrafter
from specdist.cores.draft_pipeline import DraftPipeline, prepared_prefix_holds
from specdist.cores.sampling import process_logits
from specdist.engine.local import Engine
from specdist.engine.remote import RemoteEngine
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import HIT, ProposeItem, StartItem
from specdist.transport.wire import fp16_exact


# --------------------------------------------------------------------------- 1. the law, enumerated
def any_outcome(proposed: int, num_accepted: int, new: list[int], guess: int) -> bool:
    """A wrong hit rule: prepared drafts are reused whatever the target kept."""
    return len(new) == 1


def pipelined_law(P, Q, vocab: int, k: int, m: int, holds, rows: str = "sampled", miss: str = "redraft"):
    """Exact law {first m tokens: probability} of pipelined speculative decoding.

    ``P`` / ``Q``: target / draft distribution after each prefix (dicts of tuples). State of a step:
    the tokens emitted ``s`` and what the drafter has for it: nothing (its first step), a miss, or a
    preparation ``(y, kp)`` (drafts of length kp sampled after the assumed prefix y). ``rows``:
    "sampled" sends the rows the tokens came from; "rescored" sends q of the true prefix instead.
    Draft length per step: min(k, m - 1 - len(s)), as the engine's fixed schedule.
    """
    memo: dict = {}

    def drafts(src: tuple, n: int):
        out = [((), 1.0)]
        for _ in range(n):
            out = [(x + (t,), w * Q[src + x][t]) for x, w in out for t in range(vocab) if Q[src + x][t] > 0]
        return out

    def dist(s: tuple, state) -> dict:
        if len(s) >= m:
            return {s[:m]: 1.0}
        key = (s, state)
        if key in memo:
            return memo[key]
        out: dict = defaultdict(float)
        kb = max(0, min(k, m - 1 - len(s)))

        def emit(seq: tuple, w: float, x: tuple, n_acc: int) -> None:
            if w <= 0:
                return
            if len(seq) >= m:
                out[seq[:m]] += w
                return
            nxt = None
            if kb > 0:  # a propose call was made: the drafter prepared after x and its guess
                g = int(np.argmax(Q[s + x]))
                nxt = ("hit", s + x + (g,), kb) if holds(len(x), n_acc, [seq[-1]], g) else "miss"
            for y, wy in dist(seq, nxt).items():
                out[y] += w * wy

        if kb == 0:
            cands = [((), 1.0, s)]
        elif isinstance(state, tuple):  # a hit: the prepared drafts, cut to this step's length
            _, y, kp = state
            cands = [(x, w, y) for x, w in drafts(y, min(kp, kb))]
        elif state == "miss" and miss == "skip":
            cands = [((), 1.0, s)]
        else:  # first step, or a redrafted miss
            cands = [(x, w, s) for x, w in drafts(s, kb)]
        for x, wx, src in cands:
            reach = wx
            for j in range(len(x) + 1):
                pre = s + x[:j]
                if len(pre) >= m:
                    emit(pre, reach, x, j)
                    break
                p = P[pre]
                if j == len(x):  # every draft accepted: the bonus token
                    for t in np.nonzero(p)[0]:
                        emit(pre + (int(t),), reach * p[t], x, j)
                    break
                r = Q[(src if rows == "sampled" else s) + x[:j]]  # the row sent with x[j]
                a = min(1.0, p[x[j]] / r[x[j]])
                if a < 1.0:
                    res = np.clip(p - r, 0.0, None)
                    res /= res.sum()
                    for t in np.nonzero(res)[0]:
                        emit(pre + (int(t),), reach * (1 - a) * res[t], x, j)
                reach *= a
                if reach == 0:
                    break
        memo[key] = dict(out)
        return memo[key]

    return dist((), None)


def random_tables(vocab: int, depth: int, seed: int):
    """Random P, Q after every prefix up to ``depth`` tokens; P has zeros (supports differ), Q is positive."""
    rng = np.random.default_rng(seed)
    P, Q = {}, {}
    for n in range(depth + 1):
        for pre in itertools.product(range(vocab), repeat=n):
            p = np.exp(rng.normal(size=vocab) * 1.5)
            if rng.random() < 0.3:
                p[rng.integers(vocab)] = 0.0
            q = np.exp(rng.normal(size=vocab) * 1.5)
            P[pre], Q[pre] = p / p.sum(), q / q.sum()
    return P, Q


def target_law(P, vocab: int, m: int) -> dict:
    out = {}
    for y in itertools.product(range(vocab), repeat=m):
        out[y] = float(np.prod([P[y[:i]][y[i]] for i in range(m)]))
    return out


def max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


@pytest.mark.parametrize("vocab,k,m,seed", [(3, 1, 4, 1), (3, 2, 5, 2), (2, 3, 6, 3)])
def test_pipelined_law_is_the_target_law(vocab: int, k: int, m: int, seed: int) -> None:
    P, Q = random_tables(vocab, m + 2 * k + 1, seed)
    want = target_law(P, vocab, m)
    for miss in ("redraft", "skip"):
        got = pipelined_law(P, Q, vocab, k, m, prepared_prefix_holds, miss=miss)
        assert abs(sum(got.values()) - 1) < 1e-12
        assert max_diff(got, want) < 1e-12, f"pipelined ({miss}) law differs from the target's"
    # reused after any outcome, with the rows the tokens were sampled from: still exact
    assert max_diff(pipelined_law(P, Q, vocab, k, m, any_outcome), want) < 1e-12
    # reused after any outcome, with q of the true prefix: the tokens do not come from the rows sent
    wrong = pipelined_law(P, Q, vocab, k, m, any_outcome, rows="rescored")
    assert max_diff(wrong, want) > 1e-3, "the enumeration does not see the faulty pipeline"


def test_the_hit_rule() -> None:
    assert prepared_prefix_holds(3, 3, [7], 7)
    assert not prepared_prefix_holds(3, 2, [7], 7)  # a partial acceptance
    assert not prepared_prefix_holds(3, 3, [6], 7)  # the bonus token is not the guess
    assert not prepared_prefix_holds(3, 3, [7, 1], 7)  # steps without a proposal in between
    assert prepared_prefix_holds(0, 0, [5], 5)  # a skipped step: only the guess


# --------------------------------------------------------------------------- 2. frequency
PIPE_K = 1  # k = 1 within a 4-token window: steps after a hit still draft, so hits are verified
CASE = Case("model", 4, 4)  # T = 1, the first 4 tokens


class RescoredReuse(DraftPipeline):
    """Negative control: reuses prepared drafts after any outcome (partial acceptances included) and
    sends, with them, q of the true prefix, which they were not sampled from."""

    _holds = staticmethod(any_outcome)

    def _use_prepared(self, rid, r, prep, n_acc, new, k, hidden=None):
        import torch

        core = self.core
        core.commit(r, n_acc, new)  # the true prefix; the cache keeps only its valid part
        toks = prep.tokens[: min(k, len(prep.tokens))]
        inputs = (r.seq + toks[:-1])[core.cache.lengths[r.slot] :]
        logits = core.runner.forward([r.slot], [inputs], [len(toks)])[0]  # [n, V]: q after the true prefix
        n = len(toks)
        sp = r.params
        q = process_logits(
            logits,
            torch.full((n,), sp.temperature),
            torch.full((n,), sp.top_k, dtype=torch.long),
            torch.full((n,), sp.top_p),
        )
        from specdist.transport.protocol import Proposal

        r.proposal = list(toks)  # the cache holds the true prefix and toks[:-1], as after drafting toks
        return Proposal(rid, toks, fp16_exact(q), pipeline=HIT)


def sample_pipelined(
    models: dict, n: int, seed0: int, pipeline_cls=DraftPipeline, coupling: str = "rejection", miss: str = "redraft"
):
    cfg = tiny_config(models, method="model", k=PIPE_K, max_batch_size=BATCH, max_model_len=MAX_MODEL_LEN)
    # rejection: the rule whose argument the pipeline must keep (the prepared drafts' q reaches the
    # verifier); under gumbel the output is the target's Gumbel-max tokens whatever the drafts
    cfg["sampling"] = {"coupling": coupling}
    eng = Engine.from_config(cfg)
    pipe = pipeline_cls(eng.draft_core, miss=miss)
    eng.scheduler.replicas[0].drafter = LocalDrafter(pipe)
    params = [
        SamplingParams(max_tokens=CASE.max_tokens, temperature=CASE.temperature, seed=seed0 + i, ignore_eos=True)
        for i in range(n)
    ]
    try:
        outs = eng.generate([list(CASE.prompt)] * n, params)
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
        return outs, pipe
    finally:
        eng.close()


@pytest.fixture(scope="module")
def laws(models):
    """The target law of the window, and the exact law of the faulty pipeline from the models' tables."""
    ptab, margin = _prob_table(models["target"], CASE)
    raw = _hf_logits(models["draft"], tuple(CASE.prompt), CASE.window + 1)  # prefixes the preparations reach
    qtab = {pre: transform(lg, CASE.temperature, CASE.top_k, CASE.top_p)[0] for pre, lg in raw.items()}
    p = joint(ptab, CASE.window)
    seqs = list(itertools.product(range(VOCAB), repeat=CASE.window))

    def vector(law: dict) -> np.ndarray:
        return np.array([law.get(y, 0.0) for y in seqs])

    exact = vector(pipelined_law(ptab, qtab, VOCAB, PIPE_K, CASE.window, prepared_prefix_holds))
    wrong = vector(pipelined_law(ptab, qtab, VOCAB, PIPE_K, CASE.window, any_outcome, rows="rescored"))
    assert np.abs(exact - p).max() < 1e-9  # the harness: the enumerated pipelined law is the target's
    return p, wrong


N_FAULTY = 1500  # the faulty pipeline is far off: fewer sequences keep its power above 0.99


def g_test(outs, p: np.ndarray) -> tuple[float, float, list]:
    counts = np.bincount([seq_index(o.token_ids[: CASE.window]) for o in outs], minlength=VOCAB**CASE.window)
    assert not np.any((counts > 0) & (p == 0)), "a sequence of target probability 0 was drawn"
    cells = merge_cells(p, len(outs))
    threshold = stats.chi2.isf(ALPHA, len(cells) - 1)
    return g_statistic(counts, p, cells), threshold, cells


@pytest.mark.slow
@pytest.mark.parametrize("coupling, miss", [("rejection", "redraft"), ("gumbel", "redraft"), ("rejection", "auto")])
def test_pipelined_engine_samples_target_distribution(models, laws, coupling, miss) -> None:
    """G-test, N = 4000, alpha 1e-4 (the false-failure rate) per case; df and threshold printed. ``auto``
    (misses skipped beside hits, redrafted otherwise: lengths that depend on the other requests' outcomes)
    keeps the law too."""
    p, _ = laws
    seed0 = 900_000_000 + (coupling == "gumbel") * 10_000_000 + (miss == "auto") * 20_000_000
    outs, pipe = sample_pipelined(models, N, seed0=seed0, coupling=coupling, miss=miss)
    c = pipe.counters
    g, threshold, cells = g_test(outs, p)
    print(
        f"\npipelined ({miss}): hits {c.hits}, misses {c.misses} ({c.skipped} skipped); G = {g:.1f}, "
        f"df = {len(cells) - 1}, threshold {threshold:.1f}"
    )
    # a hit needs an accepted draft and the mode of q as the target's next sample, inside a 4-token window
    assert c.hits >= N // 30 and c.misses >= N // 10, "the run must verify both prepared and redrafted drafts"
    if miss == "auto":
        assert N // 100 <= c.skipped <= c.misses - N // 100, "auto must both skip and redraft misses"
    assert sum(o.metrics.pipeline_hits for o in outs) == c.hits
    assert g <= threshold, f"G = {g:.1f} > {threshold:.1f}: the pipelined engine is not sampling the target"


@pytest.mark.slow
def test_faulty_pipeline_fails_the_frequency_test(models, laws) -> None:
    """The negative control through the same engine, N = 1500, alpha 1e-4: its exact law is detected
    with power > 0.99 (non-central chi-square over the same cells), and the run exceeds the threshold."""
    p, wrong = laws
    cells = merge_cells(p, N_FAULTY)
    lam, pw = power(wrong, p, cells, N_FAULTY)
    print(f"\nfaulty pipeline: TV {0.5 * np.abs(wrong - p).sum():.3f}, non-centrality {lam:.0f}, power {pw:.6f}")
    assert pw > 0.99
    outs, pipe = sample_pipelined(models, N_FAULTY, seed0=910_000_000, pipeline_cls=RescoredReuse)
    g, threshold, _ = g_test(outs, p)
    print(f"  hits {pipe.counters.hits}; G = {g:.1f} > threshold {threshold:.1f}")
    assert g > threshold


# --------------------------------------------------------------------------- 3. same tokens
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2], [3, 3, 3], [5, 1], [2, 4, 6, 0]]


def run(models, pipeline: bool, miss: str = "redraft", temperature: float = 0.0, remote: bool = False):
    cfg = tiny_config(models, method="model", k=3)
    cfg["draft"].update(pipeline=pipeline, pipeline_miss=miss)
    eng = Engine.from_config(cfg)
    pipe = eng.scheduler.replicas[0].drafter.core if pipeline else None  # the DraftPipeline, local or served
    served = None
    if remote:  # the same cores behind gRPC servicers, driven over the remote transports
        served = ServedCores(eng.target_core, [eng.scheduler.replicas[0].drafter.core])
        eng = RemoteEngine(
            eng.config,
            served.target_address,
            served.draft_addresses,
            tokenizer=eng.tokenizer,
            vocab_size=eng.vocab_size,
            eos_ids=eng.scheduler.eos_ids,
        )
    params = [
        SamplingParams(max_tokens=24, temperature=temperature, seed=i, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    try:
        outs = eng.generate(PROMPTS, params)
        skipped = pipe.counters.skipped if pipe is not None else None
        stats_ = (eng.stats.pipeline_hits, eng.stats.pipeline_misses, eng.stats.draft_hidden_s, skipped)
        assert eng.kv_slots_in_use() == {"target": 0, "draft": 0}
        return [o.token_ids for o in outs], stats_
    finally:
        eng.close()
        if served is not None:
            served.close()


def test_greedy_outputs_equal_sequential(models) -> None:
    """Every miss policy; auto skips some misses (beside hits) and redrafts others (6 requests in the
    batch, fewer as they finish)."""
    want, _ = run(models, pipeline=False)
    for miss in ("redraft", "skip", "auto"):
        for remote in (False, True):
            got, (hits, misses, hidden, skipped) = run(models, True, miss, remote=remote)
            assert got == want, f"pipeline_miss={miss} remote={remote}"
            assert hits > 0 and misses > 0 and hidden > 0
            assert {"redraft": skipped == 0, "skip": skipped == misses, "auto": 0 < skipped < misses}[miss], (
                miss,
                skipped,
                misses,
                remote,
            )


def test_seeded_sampling_equals_sequential_with_redrafted_misses(models) -> None:
    """Position-keyed draft uniforms: a prepared draft is the draft sequential drafting makes after
    the same prefix, and a redrafted miss uses the same uniforms, so fixed-k runs agree token for
    token (a skipped miss changes the draft lengths, hence the target's draws)."""
    want, _ = run(models, pipeline=False, temperature=1.0)
    got, (hits, misses, *_) = run(models, True, "redraft", temperature=1.0)
    assert got == want and hits > 0 and misses > 0


# --------------------------------------------------------------------------- 4. release while preparing
def test_release_during_preparation_frees_everything(tiny_models) -> None:
    """Cancel while a preparation is inside a draft pass: the rows are dropped, nothing stays prepared,
    and the slots, requests and prepared drafts on the drafter are back at 0."""
    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=3))
    core = eng.draft_core
    pipe = DraftPipeline(core)
    inside, go = threading.Event(), threading.Event()
    forward = core.runner.forward

    def blocking_forward(*args, **kwargs):  # the preparation thread waits inside its first pass
        if threading.current_thread().name.startswith("specdist-prepare") and not go.is_set():
            inside.set()
            assert go.wait(30)
        return forward(*args, **kwargs)

    core.runner.forward = blocking_forward
    try:
        sp = SamplingParams(max_tokens=16, temperature=0.0)
        pipe.start([StartItem("a", [1, 2, 3], sp, 1), StartItem("b", [4, 5], sp, 2)])
        proposals, _ = pipe.propose([ProposeItem("a", 0, [], 3, 3), ProposeItem("b", 0, [], 3, 2)])
        assert [len(p) for p in proposals] == [3, 3]
        job = pipe._job
        assert inside.wait(30) and not job.done.is_set()
        releaser = threading.Thread(target=pipe.release, args=(["a", "b"],))
        releaser.start()
        for _ in range(30_000):  # release marks the rows aborted, then waits for the core
            if job.abort >= {"a", "b"}:
                break
            threading.Event().wait(0.001)
        assert job.abort >= {"a", "b"}
        go.set()
        releaser.join(30)
        assert job.done.wait(30) and not releaser.is_alive()
        assert pipe.prepared == {} and pipe.requests == {} and pipe.kv_slots_in_use() == 0
        health = pipe.health()
        assert health["prepared"] == 0 and health["kv_slots_in_use"] == 0 and not health["preparing"]
    finally:
        go.set()
        core.runner.forward = forward
        pipe.close()


# --------------------------------------------------------------------------- 5. reported
def test_pipeline_counts_reach_stats_metrics_and_server_info(models) -> None:
    """Per-request hits / misses, the engine's totals, the Prometheus counters and the wire's
    RequestStats / ServerInfo fields all count the same proposals."""
    from specdist.api.admission import request_stats, server_info
    from specdist.api.metrics import Metrics
    from specdist.v1 import common_pb2

    cfg = tiny_config(models, method="model", k=3)
    cfg["draft"].update(pipeline=True, pipeline_miss="skip")
    eng = Engine.from_config(cfg)
    metrics = Metrics(eng)
    try:
        outs = eng.generate(PROMPTS, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(PROMPTS))
        hits = sum(o.metrics.pipeline_hits for o in outs)
        misses = sum(o.metrics.pipeline_misses for o in outs)
        assert hits > 0 and misses > 0
        assert (hits, misses) == (eng.stats.pipeline_hits, eng.stats.pipeline_misses)
        c = eng.scheduler.replicas[0].drafter.core.counters
        assert (hits, misses) == (c.hits, c.misses)
        reg = metrics.registry
        assert reg.get_sample_value("specdist_spec_decode_pipeline_total", {"replica": "0", "outcome": "hit"}) == hits
        assert (
            reg.get_sample_value("specdist_spec_decode_pipeline_total", {"replica": "0", "outcome": "miss"}) == misses
        )
        hidden = reg.get_sample_value("specdist_spec_decode_draft_hidden_seconds_total")
        assert hidden == pytest.approx(eng.stats.draft_hidden_s) and hidden > 0
        wire = common_pb2.RequestStats(**request_stats(outs[0].metrics))
        assert (wire.pipeline_hits, wire.pipeline_misses) == (
            outs[0].metrics.pipeline_hits,
            outs[0].metrics.pipeline_misses,
        )
        info = server_info(eng)
        assert info["draft_pipeline"] is True and info["draft_pipeline_miss"] == "skip"
    finally:
        metrics.close()
        eng.close()
    cfg["draft"]["pipeline"] = False
    off = Engine.from_config(cfg)
    try:
        assert server_info(off)["draft_pipeline"] is False and server_info(off)["draft_pipeline_miss"] == ""
    finally:
        off.close()


# --------------------------------------------------------------------------- 6. deployment settings
def test_every_shipped_config_loads_and_pipelined_yaml_pins_and_pipelines() -> None:
    from pathlib import Path

    from specdist.config import load_config
    from specdist.cores.proposers import draft_traits

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert len(configs) >= 3
    for path in configs:
        draft_traits(load_config(str(path)).draft)  # raises ConfigError naming the key
    cfg = load_config(str(configs[0].parent / "pipelined.yaml"))
    assert draft_traits(cfg.draft).pipelined and cfg.cluster.pin_cpus and cfg.cluster.enabled


@pytest.mark.slow
def test_pin_process_pins_every_thread_to_one_core() -> None:
    """workers.actors.pin_process (cluster.pin_cpus), in a child process so this one stays unpinned."""
    import os
    import subprocess
    import sys

    code = (
        "import os, threading, time; from workers.actors import pin_process; "
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start(); "  # a thread started before
        "core = pin_process(7); tids = os.listdir('/proc/self/task'); "
        "print(core, len(tids), all(os.sched_getaffinity(int(i)) == {core} for i in tids)); stop.set()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    core, threads, all_pinned = out.stdout.split()
    allowed = sorted(os.sched_getaffinity(0))
    assert int(core) == allowed[7 % len(allowed)] and int(threads) >= 2 and all_pinned == "True", out.stdout
