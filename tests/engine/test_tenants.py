"""Tenants do not read each other's text through the drafts, the prompt cache or the response counts.

With several tokens in ``--auth-token-file`` each token is a tenant (:func:`specdist.transport.security.tenant_of`).
A suffix drafter keeps one index a tenant (``draft.suffix_scope: tenant``, the default), so a request's
drafts, and hence its acceptance, come from its own tenant's text only; ``engine.prefix_cache_scope: tenant``
keeps prompt K/V reuse (and so time to first token) within a tenant; ``limits.speculative_stats: false`` keeps
the drafted / accepted / steps counts out of every response and streams a token a chunk.

The probe: tenant A's request writes a run of tokens nobody else knows (A's prompt, then A's output copying
it); tenant B then asks with a prompt that ends in A's run's beginning, and B's prompt holds no continuation of
it. What B is drafted is what the index gave away: under the tenant scope nothing; under the shared scope (the
negative control, and the behaviour before tenants) A's continuation.
"""

from __future__ import annotations

import pytest
from support.helpers import LoopThread, save_tiny_llama

from specdist import Engine, SamplingParams
from specdist.client import SpecDistClient
from specdist.transport.security import ServerSecurity, tenant_of

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40
SECRET = [11, 23, 5, 37, 19, 29, 8, 31, 14, 26, 3, 34]  # A's run: twelve distinct tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tenants") / "target"), seed=7, vocab_size=VOCAB)


def _config(path: str, **over) -> dict:
    cfg = {
        "target": {"model": path},
        "draft": {"method": "suffix", "num_speculative_tokens": 6, "length_policy": "fixed"},
        "engine": {"max_model_len": 96, "max_batch_size": 4, "device": "cpu"},
        "limits": {},
    }
    for section, values in over.items():
        cfg[section].update(values)
    return cfg


def _drafted_for_b(eng: Engine) -> tuple[int, list[int]]:
    """(draft tokens B's request was proposed, B's output) after A's request finished."""
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request(SECRET * 2, sp, tenant="tenant-a")  # A: its text, twice, in the index
    while eng.has_unfinished():
        eng.step()
    b = eng.add_request([2, 4, 6] + SECRET[:4], sp, tenant="tenant-b")
    while eng.has_unfinished():
        eng.step()
    return b.metrics.drafted, b.output.token_ids


def test_a_tenant_is_drafted_nothing_from_another_tenants_text(models):
    scoped = Engine.from_config(_config(models))
    drafted, _ = _drafted_for_b(scoped)
    assert drafted == 0  # B's own text holds no continuation of SECRET[:4]
    shared = Engine.from_config(_config(models, draft={"suffix_scope": "shared"}))
    drafted, _ = _drafted_for_b(shared)
    assert drafted >= 3  # the negative control: one shared index gives A's continuation away (3: max_tokens - 1)
    stats = scoped.suffix_index_size()
    assert stats["indexes"] == 2  # one a tenant


def test_prompt_kv_is_reused_within_a_tenant_only(models):
    prompt = SECRET + SECRET[:6] + [1, 2]  # 20 tokens: past the prefix cache's 16
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for scope, reused_by_b in (("tenant", 0), ("shared", 19)):
        eng = Engine.from_config(_config(models, draft={"method": "none"}, engine={"prefix_cache_scope": scope}))
        eng.generate([prompt], sp)  # (tenant "": the first request's K/V kept)
        eng.add_request(prompt, sp, tenant="tenant-a")
        while eng.has_unfinished():
            eng.step()
        before = eng.target_core.prefixes.reused_tokens
        eng.add_request(prompt, sp, tenant="tenant-b")
        while eng.has_unfinished():
            eng.step()
        assert eng.target_core.prefixes.reused_tokens - before == reused_by_b, scope
        eng.add_request(prompt, sp, tenant="tenant-b")  # B again: its own K/V, in either scope
        while eng.has_unfinished():
            eng.step()
        assert eng.target_core.prefixes.reused_tokens - before == reused_by_b + 19, scope


def test_tokens_are_tenants_on_the_grpc_server_and_the_counts_can_be_kept_out(models):
    """Through the public gRPC API: two tokens, two tenants (B is drafted nothing from A's text), and with
    ``limits.speculative_stats: false`` the response counts are 0 and a stream carries a token a chunk."""
    from specdist.api.grpc_server import serve

    assert tenant_of("Bearer x", ("x", "y")) != tenant_of("Bearer y", ("x", "y")) != ""
    assert tenant_of("Bearer x", "x") == "" and tenant_of("Bearer z", ("x", "y")) == ""
    lt = LoopThread()
    try:
        for stats in (True, False):
            eng = Engine.from_config(
                _config(models, limits={"speculative_stats": stats}) if stats is False else _config(models)
            )
            server, _ = lt.run(serve(eng, "127.0.0.1", 0, security=ServerSecurity(token=("tok-a", "tok-b"))))
            address = f"127.0.0.1:{server.port}"
            a, b = SpecDistClient(address, token="tok-a"), SpecDistClient(address, token="tok-b")
            try:
                list(a.generate(SECRET * 2, max_tokens=4, temperature=0, ignore_eos=True))
                chunks = list(a.generate(SECRET * 2, max_tokens=12, temperature=0, ignore_eos=True))  # copies A's run
                last = chunks[-1].stats
                if stats:
                    assert last.drafted > 0 and last.steps < 12  # A drafts its own text
                else:
                    assert (last.drafted, last.accepted, last.steps) == (0, 0, 0)
                    assert all(len(c.token_ids) <= 1 for c in chunks) and len(chunks) >= 12
                b_chunks = list(b.generate([2, 4, 6] + SECRET[:4], max_tokens=4, temperature=0, ignore_eos=True))
                if stats:
                    assert b_chunks[-1].stats.drafted == 0  # nothing of A's text reached B's drafts
            finally:
                a.close()
                b.close()
                lt.run(server.stop())
    finally:
        lt.close()
