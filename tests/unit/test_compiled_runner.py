"""The compiled static-shape pass (engine.compile) computes what the eager forward computes.

One sequence of calls (prefill, ragged verifications, rollback, growth past the first keys
bucket) runs on two runners over the same model, one eager and one compiled, and every call's
logits and the cache contents it leaves are compared. Every call but the long prefill pads to
one bucket (2 requests, 4 tokens, 4 logits rows) with the key length dynamic, so the compiled
side builds exactly one graph. Padding must change nothing but the float rounding of the kernels.
"""

from __future__ import annotations

import pytest
import torch
from support.helpers import devices
from support.model_zoo import build_tiny

from specdist.models.kv.options import KVOptions
from specdist.models.runner import STATIC_MIN_KEYS, CausalLMRunner


def _replay(runner: CausalLMRunner) -> list[torch.Tensor]:
    c = runner.cache
    a, b = c.allocate(), c.allocate()
    out = [
        runner.forward([a, b], [list(range(1, 21)), [2, 4]], [1, 2]),  # prefills (20 tokens: eager on both sides)
        runner.forward([a, b], [[1, 2, 3], [6]], [3, 1]),  # ragged verification, logits rows left-aligned
        runner.forward([b, a], [[4, 4, 1], [9, 8, 7, 6]], [1, 4]),  # slots in reverse order
    ]
    c.rollback(a, 21)  # rejected drafts: the next call overwrites them
    out.append(runner.forward([a, b], [[5], [5, 6, 7, 8]], [1, 4]))
    for i in range(16):  # slot a grows past the first keys bucket (64): the same graph serves every length
        out.append(runner.forward([a, b], [[i % 13, 1, 2], [(i + 5) % 17]], [3, 1]))
    assert c.lengths[a] > STATIC_MIN_KEYS
    return out


# CPU: inductor's generated C++ (about a minute of compiling here) and dynamo's graphs alone
# (aot_eager: the same capture, guards and dynamic key length, no code generation); CUDA: CUDA graphs
CASES = [("cpu", "inductor"), ("cpu", "aot_eager"), pytest.param("cuda", "inductor", marks=devices()[1].marks)]


@pytest.mark.slow
@pytest.mark.parametrize("device,backend", CASES)
def test_compiled_pass_matches_eager(device, backend, one_thread) -> None:
    # qwen2: q/k/v biases and sliding-window layers next to full ones (two masks per call)
    model = build_tiny("qwen2", seed=3, vocab_size=32, num_hidden_layers=2).to(device)
    eager = CausalLMRunner(model, 2, 100, kv=KVOptions("slots"))
    compiled = CausalLMRunner(model, 2, 100, kv=KVOptions("slots"))  # the compiled pass reads a slot cache
    compiled.compile(backend)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls = 0
    static = compiled._forward_static

    def counting(*args):
        nonlocal calls
        calls += 1
        return static(*args)

    compiled._forward_static = counting
    want, got = _replay(eager), _replay(compiled)
    assert calls == len(got) - 1  # all but the prefill went through the compiled pass
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1  # one bucket, every key length
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.shape == w.shape, i
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"call {i}: {m}")
    assert compiled.cache.lengths == eager.cache.lengths
    for layer in range(len(eager.cache.k)):
        for s, n in enumerate(eager.cache.lengths):  # what each slot holds up to its length
            for kv in ("k", "v"):
                torch.testing.assert_close(
                    getattr(compiled.cache, kv)[layer][s, :, :n],
                    getattr(eager.cache, kv)[layer][s, :, :n],
                    rtol=1e-4,
                    atol=1e-5,
                )


def test_compile_setting_resolves_per_device() -> None:
    from specdist.config import EngineConfig

    # auto is off everywhere: on GPUs the paged cache's CUDA graphs replace the compiled pass
    for setting, cpu, cuda in (
        ("auto", False, False),
        ("on", True, True),
        ("off", False, False),
        (True, True, True),
        (False, False, False),
    ):
        ec = EngineConfig(compile=setting)
        assert (ec.compiled("cpu"), ec.compiled("cuda")) == (cpu, cuda), setting
    # the paged cache and its graphs: auto on CUDA unless the compiled pass (which reads slots) is on
    assert (EngineConfig().paged("cuda"), EngineConfig().paged("cpu"), EngineConfig(compile="on").paged("cuda")) == (
        True,
        False,
        False,
    )
    assert (
        EngineConfig().graphs("cuda"),
        EngineConfig().graphs("cpu"),
        EngineConfig(cuda_graphs="off").graphs("cuda"),
    ) == (True, False, False)


@pytest.mark.parametrize("setting", ["on", "auto"])
def test_engine_compiles_target_and_draft_runners(tiny_models, monkeypatch, setting) -> None:
    """engine.compile reaches both runners of the in-process engine, each warmed for its role
    (the compile itself is the first test's; here it is recorded, not run)."""
    from support.helpers import tiny_config

    from specdist import Engine

    calls = []
    monkeypatch.setattr(
        "specdist.cores.factory.compile_runner",
        lambda runner, role, k, cache_dir: calls.append((role, k, cache_dir)) or 0.5,
    )
    cfg = tiny_config(tiny_models, "model", 3)
    cfg["engine"].update(compile=setting, compile_cache_dir="/tmp/specdist-inductor-test")
    eng = Engine.from_config(cfg)
    if setting == "auto":  # a CPU engine: auto leaves the passes eager
        assert calls == [] and eng.compile_s == 0.0
    else:
        assert calls == [("target", 3, "/tmp/specdist-inductor-test"), ("draft", 3, "/tmp/specdist-inductor-test")]
        assert eng.compile_s == 1.0


def test_compile_cache_dir_is_set_once(monkeypatch, tmp_path) -> None:
    from specdist.models.runner import use_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so the test's own setting is undone after it
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert use_compile_cache(str(tmp_path / "a")) == str(tmp_path / "a")
    assert use_compile_cache(str(tmp_path / "b")) == str(tmp_path / "a")  # an explicit setting stays
