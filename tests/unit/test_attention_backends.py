"""Every registered attention backend against one float64 reference (in the spirit of llama.cpp's
``test-backend-ops``): one schedule of steps over a cache of non-adjacent and adjacent slots, at the shapes
the families use: full and sliding-window layers, soft-capped scores, grouped-query heads, partial rotary,
ragged rows with padding, rejected tokens rolled back and overwritten, one token per request at a common
position and at different ones, and each token a row of its own (the CPU kernels' ragged layout).

The reference keeps each request's keys and values by position (pre-rotary, float64) and computes every
valid query's attention over the keys it may see; a backend sees the same rows through its own plan,
cache and forward. A new backend is one module in ``specdist/models/backends`` and runs here unchanged;
one that runs only on another device gets a CPU stand-in below (Triton's interpreter for ``paged``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdist.models.backends import backend_class, backend_names

MAX_LEN = 40
LAYERS = 2  # layer 0 full, layer 1 the case's window
SLOT_OF = [1, 2, 0]  # requests 0 and 1 in adjacent slots (a view of the cache), request 2 apart
# (request, new tokens, rejected of them rolled back after the step), per step; "rows": each token its own row
SCHEDULE = [
    [(0, 7, 0)],  # one request from position 0
    [(1, 5, 0), (0, 3, 2), (2, 9, 0)],  # ragged: a prefill, a verification with 2 rejected, a long chunk
    [(0, 1, 0), (1, 1, 0)],  # one token each, adjacent slots, at positions 8 and 5
    [(1, 4, 1), (2, 2, 0)],
    "rows",  # request 0's next 3 tokens and request 2's next 2, each token a row of its own
    [(0, 1, 0), (1, 1, 0), (2, 1, 0)],
    [(2, 12, 0)],  # past every window
]
ROWS = [(0, 3), (2, 2)]
# (Hq, Hkv, head_dim, rotary dims, window, soft-cap)
CASES = [
    (4, 4, 16, 16, None, None),
    (8, 2, 32, 32, 5, None),
    (4, 2, 16, 8, 6, None),
    (4, 1, 16, 16, 4, 3.0),
    (6, 2, 32, 32, None, 20.0),
]
# a backend that cannot run on this machine's CPU, and the environment under which it can (its stand-in)
STAND_INS = {"paged": {"TRITON_INTERPRET": "1"}}


def _rope_tables(rd: int) -> tuple[torch.Tensor, torch.Tensor]:  # [MAX_LEN + 1, rd] x2, halves equal
    inv = 1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(MAX_LEN + 1, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def _rotate(x, cos, sin):  # [.., hd] float64, [.., rd]
    rd = cos.shape[-1]
    x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
    rot = x[..., :rd] * cos + torch.cat((-x2, x1), -1) * sin
    return torch.cat((rot, x[..., rd:]), -1)


def _reference(q, keys, vals, p, cos, sin, scale, window, softcap):  # q [Hq, hd], keys/vals [S, Hkv, hd]: [Hq, hd]
    """Query at position p over the keys at positions max(0, p - window + 1) .. p, all in float64."""
    hq, hkv = q.shape[0], keys.shape[1]
    lo = 0 if window is None else max(0, p - window + 1)
    qr = _rotate(q, cos[p], sin[p])
    kr = _rotate(keys[lo : p + 1], cos[lo : p + 1, None], sin[lo : p + 1, None])  # [S', Hkv, hd]
    kr, vv = kr.repeat_interleave(hq // hkv, 1), vals[lo : p + 1].repeat_interleave(hq // hkv, 1)  # [S', Hq, hd]
    s = torch.einsum("hd,shd->hs", qr, kr) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("hs,shd->hd", s.softmax(-1), vv)


def _run(name: str, case: tuple, dtype: torch.dtype) -> float:
    """The schedule through backend ``name``; the largest error of a valid row against the reference."""
    hq, hkv, hd, rd, window, softcap = case
    cls = backend_class(name)
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    cache = cls.make_cache(LAYERS, 4, hkv, hd, MAX_LEN, dtype, torch.device("cpu"), block_size=4)
    assert [cache.allocate() for _ in range(4)] == [0, 1, 2, 3]
    cos, sin = _rope_tables(rd)
    windows = [None, window]
    scale = hd**-0.5
    backend = cls(cache, scale, windows, softcap, [(cos.to(dtype), sin.to(dtype))] * LAYERS)
    # the truth: each request's q, k, v by position and layer (pre-rotary, float64); rewritten after a rollback
    qs = torch.randn(LAYERS, 3, MAX_LEN, hq, hd, generator=gen, dtype=torch.float64)
    ks = torch.randn(LAYERS, 3, MAX_LEN, hkv, hd, generator=gen, dtype=torch.float64)
    vs = torch.randn(LAYERS, 3, MAX_LEN, hkv, hd, generator=gen, dtype=torch.float64)
    length = [0, 0, 0]
    worst = 0.0
    for step in SCHEDULE:
        if step == "rows":  # (request, position) per row, one token each
            rows = [(r, length[r] + j) for r, n in ROWS for j in range(n)]
            reqs, n_new, starts, t_pad = [r for r, _ in rows], [1] * len(rows), [p for _, p in rows], 1
            rejected = [0] * len(rows)
        else:
            reqs, n_new, rejected = [r for r, _, _ in step], [n for _, n, _ in step], [j for _, _, j in step]
            starts, t_pad = [length[r] for r in reqs], max(n for _, n, _ in step)
        for r in reqs:  # what this step writes replaces what a rollback left
            pos = [st + j for rr, st, n in zip(reqs, starts, n_new) if rr == r for j in range(n)]
            for layer in range(LAYERS):
                for t in (qs, ks, vs):
                    t[layer, r, pos] = torch.randn(len(pos), *t.shape[3:], generator=gen, dtype=torch.float64)
        bsz = len(reqs)
        slots = [SLOT_OF[r] for r in reqs]
        meta = backend.plan(slots, [[5] * n for n in n_new], starts, [0] * bsz, bsz, t_pad)
        for layer in range(LAYERS):
            junk = lambda h: torch.randn(bsz * t_pad, h, hd, generator=gen, dtype=torch.float64)  # noqa: E731
            q, k, v = junk(hq), junk(hkv), junk(hkv)  # [B * T, H, hd]: padded rows keep the junk
            for b, (r, st, n) in enumerate(zip(reqs, starts, n_new)):
                rows = slice(b * t_pad, b * t_pad + n)
                q[rows], k[rows], v[rows] = (
                    qs[layer, r, st : st + n],
                    ks[layer, r, st : st + n],
                    vs[layer, r, st : st + n],
                )
            out = backend.forward(layer, q.to(dtype), k.to(dtype), v.to(dtype), meta)  # [B * T, Hq, hd]
            for b, (r, st, n) in enumerate(zip(reqs, starts, n_new)):
                for j in range(n):
                    want = _reference(
                        qs[layer, r, st + j],
                        ks[layer, r],
                        vs[layer, r],
                        st + j,
                        cos,
                        sin,
                        scale,
                        windows[layer],
                        softcap,
                    )
                    worst = max(worst, float((out[b * t_pad + j].double() - want).abs().max()))
        ends: dict[int, tuple[int, int]] = {}  # request -> (tokens written, tokens kept), over its rows
        for r, st, n, j in zip(reqs, starts, n_new, rejected):
            written, kept = ends.get(r, (0, 0))
            ends[r] = (max(written, st + n), max(kept, st + n - j))
        for r, (written, kept) in ends.items():  # as the runner leaves it, then the rejected tokens rolled back
            cache.lengths[SLOT_OF[r]] = written
            cache.rollback(SLOT_OF[r], kept)
            length[r] = kept
    return worst


def _runs_here(name: str) -> bool:
    return backend_class(name).unavailable(torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hq{c[0]}-kv{c[1]}-hd{c[2]}-rd{c[3]}-w{c[4]}-cap{c[5]}")
@pytest.mark.parametrize("name", [n for n in backend_names() if _runs_here(n)])
def test_every_backend_equals_the_float64_reference(name: str, case: tuple) -> None:
    """float32 rows within 2e-5 of float64 (summation orders differ: about 1e-7 relative per op; a wrong window,
    rotary, scale, soft-cap, cache row or table moves an output by 0.1 or more)."""
    worst = _run(name, case, torch.float32)
    assert worst <= 2e-5, f"{name}: max error {worst:.3g}"


def test_every_backend_is_checked_here() -> None:
    """Each registered backend runs on this CPU, or has a stand-in that does (checked by the next test)."""
    assert {n for n in backend_names() if not _runs_here(n)} <= set(STAND_INS), backend_names()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STAND_INS))
def test_stand_ins_equal_the_reference(name: str) -> None:
    """A backend made for another device, through its stand-in on the CPU (Triton's kernels under its
    interpreter: the same kernel code, executed by numpy), every case; in a process of its own, since the
    interpreter is chosen before Triton is imported."""
    code = (
        "import sys; sys.path[:0] = " + repr(sys.path) + "\nfrom unit import test_attention_backends as t\n"
        f"print(max(t._run({name!r}, c, t.torch.float32) for c in t.CASES))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **STAND_INS[name]},
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    worst = float(run.stdout.split()[-1])
    assert worst <= 2e-5, f"{name}: max error {worst:.3g}"


def test_the_backend_is_chosen_by_name_from_the_config(tmp_path) -> None:
    """``engine.attention_backend`` reaches the runner (in process and, through KVOptions, the Ray workers); a
    name no backend has, or one that cannot run here, is a one-line ConfigError naming the key."""
    from support.helpers import save_tiny_llama
    from transformers import AutoModelForCausalLM

    from specdist.api.preflight import check_config
    from specdist.config import load_config
    from specdist.errors import ConfigError
    from specdist.models.kv.options import KVOptions
    from specdist.models.runner import CausalLMRunner

    path = save_tiny_llama(str(tmp_path / "m"), seed=1)
    cfg = load_config(
        {
            "target": {"model": path},
            "draft": {"method": "none"},
            "engine": {"device": "cpu", "attention_backend": "sdpa", "max_model_len": 32},
        }
    )
    kv = KVOptions.from_engine(cfg.engine, "cpu")
    assert kv.backend == "sdpa"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert CausalLMRunner(model, 2, 32, kv=kv).backend.name == "sdpa"
    assert CausalLMRunner(model, 2, 32, kv=KVOptions("paged", backend="paged-torch")).backend.name == "paged-torch"
    with pytest.raises(ConfigError, match="engine.attention_backend.*flash.*there are cpu, paged, paged-torch, sdpa"):
        check_config(load_config({"target": {"model": path}, "engine": {"attention_backend": "flash"}}))
    with pytest.raises(ConfigError, match="engine.attention_backend: paged: the Triton kernels need CUDA"):
        CausalLMRunner(model, 2, 32, kv=KVOptions("paged", backend="paged"))
    with pytest.raises(ConfigError, match="engine.attention_backend: paged-torch: it reads a paged cache"):
        CausalLMRunner(model, 2, 32, kv=KVOptions("slots", backend="paged-torch"))
    with pytest.raises(ConfigError, match="engine.attention_backend"):
        load_config({"target": {"model": path}, "engine": {"attention_backend": "Not A Name"}})
