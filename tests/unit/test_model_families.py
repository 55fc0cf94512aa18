"""Every served model family against transformers' own forward and greedy generate.

Per family of ``tests/support/model_zoo.py`` (tiny random checkpoints, fp32):
- the runner's logits over a ragged schedule (one-request prefill, ragged prefill + verify
  chunks with rejected tokens rolled back, one token per request at a common position, a
  single decode; non-contiguous slots; sequences 6x longer than the sliding windows) equal
  transformers' forward of the full sequences;
- greedy speculative decoding through ``Engine`` (a separate draft of the family, and
  ``self-w8``) gives exactly the tokens of transformers' greedy ``generate``;
and an architecture outside the table is refused before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import pytest
import torch
from support.helpers import devices, tiny_config
from support.model_zoo import FAMILIES, LENGTH_DEPENDENT_ROPE, build_tiny, save_tiny
from transformers import AutoModelForCausalLM, DynamicCache

from specdist import Engine, SamplingParams
from specdist.errors import ConfigError
from specdist.models import families as families_module
from specdist.models.backends import slots as slot_backends
from specdist.models.families import SUPPORTED_MODEL_TYPES
from specdist.models.kernels import cpu_kernels
from specdist.models.kv.options import KVOptions
from specdist.models.loader import load_model, resolve_model
from specdist.models.runner import CausalLMRunner

SEQ_LEN = 24  # windows are 4-5 tokens; the original context of llama-dynamic and phi3-longrope is 16
# (request, new tokens, rejected drafts appended then rolled back): every attention form runs
SCHEDULE = [
    [(0, 9, 0)],  # one request from position 0: is_causal (full layers), mask (window layers)
    [(2, 3, 0)],  # one request from position 0, inside every window: is_causal
    [(1, 5, 0), (0, 4, 2), (2, 10, 0)],  # a ragged prefill, a verify chunk, a long chunk: boolean masks
    [(1, 8, 3)],  # one request, 8 tokens from position 5
    [(0, 1, 0), (1, 1, 0), (2, 1, 0)],  # one token each at position 13: no mask, windows slice the keys
    [(2, 1, 0)],  # a single decode
    [(0, 10, 0), (1, 3, 2), (2, 9, 0)],
    [(1, 7, 0)],
]
SLOTS = [1, 2, 4]  # requests 0 and 1 are adjacent (a view of the cache), request 2 is not
JUNK = [3, 5, 1]
MAX_TOKENS = 20


def _reference_logits(model, seq: list[int], family: str) -> torch.Tensor:  # [T, V]
    with torch.inference_mode():
        if family not in LENGTH_DEPENDENT_ROPE:
            return model(torch.tensor([seq], device=model.device)).logits[0].cpu()
        # Dynamic and longrope RoPE depend on the length of each call in transformers; the runner
        # rotates position p as a call ending at p does (see specdist/models/runner.py): token by token.
        cache = DynamicCache(config=model.config)
        return torch.cat(
            [model(torch.tensor([[t]], device=model.device), cache=cache, use_cache=True).logits[0] for t in seq]
        ).cpu()


# (device, attention) pairs. CPU float32 attends through specdist's CPU kernels where they run (x86 with AVX2);
# "sdpa" turns them off to cover the slot cache's SDPA forms; "paged" builds what CUDA builds (the paged cache
# and its backend: the torch reference on the CPU, the Triton kernels on CUDA), so CI runs the CUDA configuration.
PLACES = [
    pytest.param("cpu", "kernels", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels")),
    ("cpu", "sdpa"),
    ("cpu", "paged"),
    pytest.param("cuda", "paged", marks=devices()[1].marks),
]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_is_one_kernel_call_where_its_family_declares_that_shape(family: str, monkeypatch) -> None:
    """The family declares which layers the fused layer kernel computes (``Family.layer_kernel``); the runner reads
    the declaration, then checks the modules (norm types, kinds, activation) before it builds the call. Rotary
    tables the kernel does not compute (scaled ones whose width differs from the head's) keep layers op by op."""
    model = build_tiny(family, seed=1)
    model_type = model.config.model_type
    declared = families_module.FAMILIES[model_type].layer_kernel == families_module.PRENORM_SWIGLU
    runner = CausalLMRunner(model, num_slots=2, max_len=32, kv_cache_dtype="model")
    fused = [k is not None for k in runner.layer_kernels]
    assert fused == [declared and runner.cpu_rope_attention] * len(runner.layers), (family, fused)
    if family in ("llama", "qwen2", "qwen3", "mistral"):
        assert all(fused)  # (the plain rotary of these zoo entries runs in the kernel)
    if declared:  # the same modules in a family that declares nothing run op by op
        monkeypatch.setitem(
            families_module.FAMILIES,
            model_type,
            dataclasses.replace(families_module.FAMILIES[model_type], layer_kernel=None),
        )
        runner = CausalLMRunner(model, num_slots=2, max_len=32, kv_cache_dtype="model")
        assert runner.layer_kernels == [None] * len(runner.layers)


@pytest.mark.parametrize("device,attention", PLACES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str, device: str, attention: str, monkeypatch) -> None:
    forms = set()  # the attention forms the schedule ran: "none" (no mask), "causal", "mask"
    plan = slot_backends.attention_plan

    def spy(*args):
        lo, mask, causal = plan(*args)
        forms.add("causal" if causal else "none" if mask is None else "mask")
        return lo, mask, causal

    monkeypatch.setattr(slot_backends, "attention_plan", spy)
    model = build_tiny(family, seed=1).to(device)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, model.config.vocab_size, (SEQ_LEN,), generator=gen).tolist() for _ in SLOTS]
    refs = [_reference_logits(model, s, family) for s in seqs]
    # the model's own cache dtype: the float64 reference is checked at fp32 rounding (test_cpu_kernels covers float16)
    kv = KVOptions("paged" if attention == "paged" else "slots")
    backend = "sdpa" if attention == "sdpa" else "auto"
    runner = CausalLMRunner(model, num_slots=5, max_len=32, kv_cache_dtype="model", kv=kv, attention_backend=backend)
    assert runner.cpu_attention == (attention == "kernels")
    assert (runner.attention is not None) == (attention == "paged")
    if device == "cuda":  # CUDA's default is the paged cache: this place is what an engine there builds
        assert KVOptions().paged(runner.device) and runner.backend.name == "paged"
    assert [runner.cache.allocate() for _ in range(5)] == [0, 1, 2, 3, 4]
    pos = [0] * len(SLOTS)
    for step in SCHEDULE:
        slots, tokens = [SLOTS[r] for r, _, _ in step], []
        for r, n, j in step:
            tokens.append(seqs[r][pos[r] : pos[r] + n] + JUNK[:j])
        logits = runner.forward(slots, tokens, [len(t) for t in tokens]).cpu()  # [B, T, V]
        for b, (r, n, j) in enumerate(step):
            want = refs[r][pos[r] : pos[r] + n]
            if j:  # the rejected tokens' logits: those of the sequence they were appended to
                junk = _reference_logits(model, seqs[r][: pos[r] + n] + JUNK[:j], family)
                want = torch.cat([want, junk[pos[r] + n :]])
            got = logits[b, : n + j]
            # fp32 throughout: the runner and transformers sum in other orders (fused q/k/v and
            # gate/up matmuls, F.rms_norm, SDPA kernels vs eager attention), about 1e-7 relative
            # per op; observed at most 1.4e-5 on logits up to 9 in size (7x margin). A modelling
            # error (a norm weight, the window, a RoPE table, a soft-cap, the scale) moves them by
            # 0.1 or more.
            err = (got - want).abs()  # [n + j, V]
            torch.testing.assert_close(
                got,
                want,
                rtol=0,
                atol=1e-4,
                msg=lambda _: (
                    f"{family}: step {step}, request {r}: max error {float(err.max()):.3g} at token "
                    f"{int(err.amax(1).argmax())} of {n + j} (positions from {pos[r]})"
                ),
            )
            pos[r] += n
            runner.cache.rollback(SLOTS[r], pos[r])
    assert pos == [SEQ_LEN] * len(SLOTS)
    assert forms == ({"none", "causal", "mask"} if attention == "sdpa" else set()), forms


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """family -> {"target": path, "draft": path}: a 2-layer target and an independent 1-layer draft."""
    root = tmp_path_factory.mktemp("zoo")
    cache: dict[str, dict[str, str]] = {}

    def get(family: str) -> dict[str, str]:
        if family not in cache:
            cache[family] = {
                "target": save_tiny(str(root / family / "target"), family, seed=1),
                "draft": save_tiny(str(root / family / "draft"), family, seed=2, num_hidden_layers=1),
            }
        return cache[family]

    return get


def _hf_greedy(path: str, prompt: list[int], n: int, device: str = "cpu") -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            top_k=None,
            top_p=None,
            temperature=None,
        )
    return out[0, len(prompt) :].tolist()


PROMPTS = [[0, 1, 2, 3, 4, 5, 6, 1], [2, 9, 4, 11, 6]]  # both inside the original 16 positions (LENGTH_DEPENDENT_ROPE)


# Phi-3's own generate recomputes the whole sequence with the long RoPE factors once it passes
# the original context (Phi3ForCausalLM.prepare_inputs_for_generation drops its cache there); the
# runner keeps per-position rotations (see its docstring), so past that point the two differ by
# design. Its logits are checked above against transformers' token-by-token forward.
GENERATE_FAMILIES = [f for f in FAMILIES if f != "phi3-longrope"]


@pytest.mark.slow
@pytest.mark.parametrize("device", [devices()[0], "cpu-paged", devices()[1]])  # cpu-paged: CUDA's cache on the CPU
@pytest.mark.parametrize("method", ["model", "self-w8"])  # self-w8: self-w4 on CUDA, which refuses int8 copies
@pytest.mark.parametrize("family", GENERATE_FAMILIES)
def test_greedy_speculative_equals_transformers_generate(zoo, family: str, method: str, device: str) -> None:
    paths = zoo(family)
    device, _, paged = device.partition("-")
    method = "self-w4" if (method, device) == ("self-w8", "cuda") else method
    cfg = tiny_config(paths, method=method, k=3, device=device, **({"kv_cache": "paged"} if paged else {}))
    engine = Engine.from_config(cfg)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == _hf_greedy(paths["target"], prompt, MAX_TOKENS, device), f"{family} / {method}"
    assert sum(o.metrics.drafted for o in outs) > 0  # speculation ran
    assert engine.kv_slots_in_use() == {"target": 0, "draft": 0}


def _gguf_header(path: str, architecture: str) -> str:
    """A GGUF file holding nothing but its key/value header (no tensors)."""

    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 2))
        f.write(s("general.name") + struct.pack("<I", 8) + s("tiny"))
        f.write(s("general.architecture") + struct.pack("<I", 8) + s(architecture))
    return path


def test_unsupported_architecture_is_refused_before_weights(tmp_path, monkeypatch) -> None:
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=16).save_pretrained(gpt2)  # config.json only
    assert os.listdir(gpt2) == ["config.json"]

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    with pytest.raises(ConfigError) as err:
        Engine.from_config(
            {
                "target": {"model": str(gpt2)},
                "draft": {"method": "none"},
                "engine": {"device": "cpu", "max_model_len": 32},
            }
        )
    assert str(err.value) == f"config target.model: model type 'gpt2' is not supported; supported: {supported}"
    # a GGUF file: the architecture comes from its header (this one holds nothing else)
    gguf = resolve_model(_gguf_header(str(tmp_path / "tiny.gguf"), "falcon"), "draft.model")
    with pytest.raises(ConfigError) as err:
        load_model(gguf, "float32")
    assert str(err.value) == f"config draft.model: model type 'falcon' is not supported; supported: {supported}"


def test_runner_refuses_an_unsupported_model_object() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=16))
    with pytest.raises(
        ConfigError, match=r"^config model: model type 'gpt2' is not supported; supported: llama, mistral, "
    ):
        CausalLMRunner(model, num_slots=1, max_len=8)


def test_zoo_configs_are_what_the_tests_claim(zoo) -> None:
    """The zoo's windows are shorter than the sequences and the families are the served ones."""
    seen = set()
    for family in FAMILIES:
        with open(os.path.join(zoo(family)["target"], "config.json")) as f:
            cfg = json.load(f)
        seen.add(cfg["model_type"])
        assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2  # 2 TP ranks divide them
        window = cfg.get("sliding_window")
        assert window is None or window <= 5 < SEQ_LEN
    assert seen == set(SUPPORTED_MODEL_TYPES)
