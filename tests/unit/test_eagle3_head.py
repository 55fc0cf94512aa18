"""The EAGLE-3 draft head (specdist.models.eagle3) in the published checkpoint layout.

Random heads are written by specdist.bench.checkpoints.write_random_eagle3_head for tiny targets
(vocabulary 16, hidden size 32, 2 layers, 4 query heads over 2 key/value heads). The forward is
checked against a recompute written here from the layout's definition: no cache, plain causal
attention over the whole sequence, one row at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.model_zoo import build_tiny

from specdist.bench.checkpoints import write_random_eagle3_head
from specdist.errors import ConfigError
from specdist.models.eagle3 import (
    DEFAULT_AUX_LAYERS,
    check_eagle3_target,
    load_eagle3_head,
    read_eagle3_spec,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def target():
    return build_tiny("llama")


@pytest.fixture(scope="module")
def target_llama3():  # llama3 RoPE scaling: the head's config carries rope_scaling
    return build_tiny("llama3-rope")


def _edit_config(path: str, **changes) -> None:
    name = os.path.join(path, "config.json")
    with open(name) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(name, "w") as f:
        json.dump(cfg, f)


def _refusal(path, target, *needles):
    with pytest.raises(ConfigError) as e:
        load_eagle3_head(str(path), target.config, target.get_input_embeddings(), torch.float32, "cpu")
    assert e.value.key == "draft.model"
    for needle in needles:
        assert needle in e.value.message, e.value.message
    return e.value.message


# -- loading: shapes, aux layers, the draft-to-target map --------------------------------------


def test_default_aux_layers_clamped_for_tiny_targets():
    assert DEFAULT_AUX_LAYERS(32) == (2, 16, 29)
    assert DEFAULT_AUX_LAYERS(5) == (2, 2, 2)
    assert DEFAULT_AUX_LAYERS(2) == (1, 1, 0)
    assert DEFAULT_AUX_LAYERS(1) == (0, 0, 0)


def test_load_shapes_aux_layers_and_d2t(tmp_path, target):
    path = str(tmp_path / "head")
    write_random_eagle3_head(path, target.config, draft_vocab_size=10, seed=1, std=0.3)
    head = load_eagle3_head(path, target.config, target.get_input_embeddings(), torch.float32, "cpu")
    spec = head.spec
    assert (spec.hidden_size, spec.target_hidden_size, spec.vocab_size, spec.draft_vocab_size) == (32, 32, 16, 10)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 8)
    assert spec.aux_layers == DEFAULT_AUX_LAYERS(2) == (1, 1, 0)
    assert not spec.own_embed and head.embed_tokens is None
    assert head.fc.weight.shape == (32, 96)
    assert head.q_proj.weight.shape == (32, 64) and head.k_proj.weight.shape == (16, 64)
    assert head.lm_head.weight.shape == (10, 32)
    assert head.fuse(torch.randn(2, 3, 96)).shape == (2, 3, 32)
    cache = head.new_cache(num_slots=2, max_len=8)
    assert len(cache.k) == 1 and cache.k[0].shape == (2, 2, 9, 8)

    # d2t: draft id i is target id i + d2t[i]; the other target ids get -inf
    d2t = load_file(os.path.join(path, "model.safetensors"))["d2t"]
    targets = torch.arange(10) + d2t
    assert torch.equal(head.draft_to_target, targets)
    slot = cache.allocate()
    with torch.no_grad():
        logits, prenorm = head(cache, [slot], [[3, 5, 1]], [torch.randn(3, 32)])
        draft_logits = head.lm_head(head.norm(prenorm[0][-1]))
    assert logits.shape == (1, 16) and logits.dtype == torch.float32
    assert torch.equal(logits[0, targets], draft_logits)
    others = torch.ones(16, dtype=torch.bool)
    others[targets] = False
    assert torch.isneginf(logits[0, others]).all() and int(others.sum()) == 6

    # aux layer ids from config.json, at the top level or under eagle_config
    write_random_eagle3_head(path, target.config, aux_layers=[0, 1, 1])
    assert read_eagle3_spec(path, target.config).aux_layers == (0, 1, 1)
    _edit_config(
        path, eagle_aux_hidden_state_layer_ids=None, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0, 1]}
    )
    assert read_eagle3_spec(path, target.config).aux_layers == (1, 0, 1)

    # no draft_vocab_size: the draft vocabulary is the target's, no d2t needed
    write_random_eagle3_head(path, target.config)
    _edit_config(path, draft_vocab_size=None)
    head = load_eagle3_head(path, target.config, target.get_input_embeddings(), torch.float32, "cpu")
    assert head.spec.draft_vocab_size == 16 and torch.equal(head.draft_to_target, torch.arange(16))


def test_cast_leaves_the_targets_embedding_and_rope_alone(tmp_path, target):
    path = str(tmp_path / "head")
    write_random_eagle3_head(path, target.config, draft_vocab_size=12)
    head = load_eagle3_head(path, target.config, target.get_input_embeddings(), torch.bfloat16, "cpu")
    assert head.q_proj.weight.dtype == torch.bfloat16 and head.draft_to_target.dtype == torch.int64
    assert target.get_input_embeddings().weight.dtype == torch.float32
    cache = head.new_cache(1, 4)
    assert cache.k[0].dtype == torch.bfloat16
    with torch.no_grad():
        logits, prenorm = head(cache, [cache.allocate()], [[1, 2]], [torch.randn(2, 32)])
    assert logits.dtype == torch.float32 and prenorm[0].dtype == torch.bfloat16
    assert head.rope_cos.dtype == torch.float32


# -- refusals ------------------------------------------------------------------------------------


def test_refusals_name_what_differs(tmp_path, target):
    cfg = target.config.to_dict()
    path = tmp_path / "head"

    write_random_eagle3_head(str(path), dict(cfg, hidden_size=64), with_embed=True)
    _refusal(path, target, "hidden size 64 of the head's fc input (3 x 64) differs from the target's 32")

    write_random_eagle3_head(str(path), dict(cfg, vocab_size=20), with_embed=True)
    _refusal(path, target, "vocabulary size 20", "target's 16")

    write_random_eagle3_head(str(path), cfg, aux_layers=[0, 1, 3])
    _refusal(path, target, "aux layer id(s) [3]", "[0, 2]")
    with pytest.raises(ConfigError, match="outside"):  # the target side's check, before any weight
        check_eagle3_target(read_eagle3_spec(str(path), target.config), target.config)

    write_random_eagle3_head(str(path), cfg, hidden_size=64)  # no embed_tokens, wider than the target
    _refusal(path, target, "no embed_tokens.weight", "width 32", "hidden size 64")
    write_random_eagle3_head(str(path), cfg, hidden_size=64, with_embed=True)  # its own embedding: fine
    assert (
        load_eagle3_head(str(path), target.config, target.get_input_embeddings(), torch.float32, "cpu").spec.hidden_size
        == 64
    )

    write_random_eagle3_head(str(path), cfg)
    _edit_config(str(path), num_hidden_layers=2)
    _refusal(path, target, "num_hidden_layers = 2")

    write_random_eagle3_head(str(path), cfg)
    _edit_config(str(path), architectures=["LlamaForCausalLM"])
    _refusal(path, target, "not an EAGLE-3 head")
    _edit_config(str(path), architectures=["LlamaForCausalLMEagle3"], intermediate_size=None)
    _refusal(path, target, "lacks intermediate_size")

    # a tensor of the wrong shape, named
    write_random_eagle3_head(str(path), cfg, draft_vocab_size=10)
    weights = str(path / "model.safetensors")
    tensors = load_file(weights)
    save_file(dict(tensors, **{"midlayer.mlp.up_proj.weight": torch.zeros(65, 32)}), weights)
    _refusal(path, target, "midlayer.mlp.up_proj.weight", "[65, 32]", "[64, 32]")
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, weights)
    _refusal(path, target, "lacks", "norm.weight")
    save_file(dict(tensors, **{"midlayer.self_attn.q_proj.bias": torch.zeros(32)}), weights)
    _refusal(path, target, "midlayer.self_attn.q_proj.bias")

    # d2t leaving the target vocabulary, or not injective
    d2t = tensors["d2t"].clone()
    d2t[-1] = 16 - 9  # draft id 9 -> target id 16
    save_file(dict(tensors, d2t=d2t), weights)
    _refusal(path, target, "draft id 9 to target id 16", "[0, 16)")
    d2t = tensors["d2t"].clone()
    d2t[1] = int(d2t[0]) - 1  # draft ids 0 and 1 -> one target id
    save_file(dict(tensors, d2t=d2t), weights)
    _refusal(path, target, "not injective")


# -- the forward against a full recompute --------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference(path, target, tokens, feats, norm_before_residual):
    """The head's prenorm outputs [n, H] and target-vocabulary logits [n, V] at every position of
    one sequence, straight from the checkpoint's tensors: no cache, causal attention over all."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    t = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    eps, nh, nkv, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(tokens)
    ids = torch.tensor(tokens)
    emb = target.get_input_embeddings()(ids) if "embed_tokens.weight" not in t else t["embed_tokens.weight"][ids]
    e = _rms(emb, t["midlayer.input_layernorm.weight"], eps)
    if norm_before_residual:
        g = residual = _rms(feats, t["midlayer.hidden_norm.weight"], eps)
    else:
        residual, g = feats, _rms(feats, t["midlayer.hidden_norm.weight"], eps)
    x = torch.cat([e, g], -1)  # [n, 2H]
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, nh, hd).transpose(0, 1)[None]  # [1, nh, n, hd]
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)[None]
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)[None]
    cos, sin = LlamaRotaryEmbedding(target.config)(x, torch.arange(n)[None])  # the target's RoPE: same settings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    a = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(n, nh * hd) @ t["midlayer.self_attn.o_proj.weight"].T
    h = residual + a
    m = _rms(h, t["midlayer.post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)
    out = h + mlp @ t["midlayer.mlp.down_proj.weight"].T
    draft = _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T  # [n, Vd]
    logits = torch.full((n, cfg["vocab_size"]), -math.inf)
    logits[:, torch.arange(draft.shape[1]) + t["d2t"]] = draft
    return out, logits


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_incremental_ragged_forward_equals_full_recompute(tmp_path, target_llama3, norm_before_residual):
    target = target_llama3
    path = str(tmp_path / "head")
    write_random_eagle3_head(path, target.config, draft_vocab_size=12, seed=3, std=0.3)
    _edit_config(path, norm_before_residual=norm_before_residual)
    head = load_eagle3_head(path, target.config, target.get_input_embeddings(), torch.float32, "cpu")
    assert head.spec.rope_parameters["rope_type"] == "llama3"

    gen = torch.Generator().manual_seed(0)
    seqs = {2: [3, 1, 4, 1, 5, 9, 2], 0: [6, 5, 3, 5, 8]}  # slot -> tokens
    feats = {s: torch.randn(len(toks), 32, generator=gen) for s, toks in seqs.items()}
    refs = {s: _reference(path, target, seqs[s], feats[s], norm_before_residual) for s in seqs}
    cache = head.new_cache(num_slots=3, max_len=12)
    for _ in range(3):
        cache.allocate()

    def step(pieces: dict[int, tuple[int, int]], refs=refs, seqs=seqs, feats=feats):
        """Feed positions [a, b) of each slot's sequence in one call; compare with the recompute."""
        slots = list(pieces)
        with torch.no_grad():
            logits, prenorm = head(
                cache,
                slots,
                [seqs[s][a:b] for s, (a, b) in pieces.items()],
                [feats[s][a:b] for s, (a, b) in pieces.items()],
            )
        for row, (s, (a, b)) in enumerate(pieces.items()):
            out, ref_logits = refs[s]
            assert cache.lengths[s] == b
            torch.testing.assert_close(prenorm[row], out[a:b], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[row], ref_logits[b - 1], atol=1e-5, rtol=1e-5)

    step({2: (0, 4), 0: (0, 2)})  # prompts of different lengths in one ragged call
    step({2: (4, 5), 0: (2, 3)})  # then one token at a time
    step({0: (3, 4)})
    step({2: (5, 6), 0: (4, 5)})
    step({2: (6, 7)})

    # roll back, then feed different continuations: the stale K/V beyond the length are unseen
    cache.rollback(2, 3)
    cache.rollback(0, 1)
    seqs2 = {2: seqs[2][:3] + [7, 0, 11], 0: seqs[0][:1] + [2, 2]}
    feats2 = {
        2: torch.cat([feats[2][:3], torch.randn(3, 32, generator=gen)]),
        0: torch.cat([feats[0][:1], torch.randn(2, 32, generator=gen)]),
    }
    refs2 = {s: _reference(path, target, seqs2[s], feats2[s], norm_before_residual) for s in seqs2}
    step({0: (1, 3), 2: (3, 4)}, refs2, seqs2, feats2)
    step({2: (4, 6)}, refs2, seqs2, feats2)
    # and re-feeding the original tokens after a rollback gives the original outputs
    cache.rollback(2, 3)
    step({2: (3, 7)})


# -- other file layouts --------------------------------------------------------------------------


def test_pytorch_bin_and_model_prefixed_names_load_the_same(tmp_path, target):
    path = str(tmp_path / "head")
    write_random_eagle3_head(path, target.config, draft_vocab_size=11, seed=5, std=0.3, with_embed=True)
    other = str(tmp_path / "bin")
    os.makedirs(other)
    shutil.copy(os.path.join(path, "config.json"), other)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    torch.save(
        {(k if k == "lm_head.weight" else "model." + k): v for k, v in tensors.items()},
        os.path.join(other, "pytorch_model.bin"),
    )

    a = load_eagle3_head(path, target.config, target.get_input_embeddings(), torch.float32, "cpu")
    b = load_eagle3_head(other, target.config, target.get_input_embeddings(), torch.float32, "cpu")
    assert b.spec.own_embed and b.spec.draft_vocab_size == 11
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.draft_to_target, b.draft_to_target)
    feats = [torch.randn(4, 32)]
    with torch.no_grad():
        ca, cb = a.new_cache(1, 8), b.new_cache(1, 8)
        la, pa = a(ca, [ca.allocate()], [[1, 2, 3, 4]], feats)
        lb, pb = b(cb, [cb.allocate()], [[1, 2, 3, 4]], feats)
    assert torch.equal(la, lb) and torch.equal(pa[0], pb[0])
