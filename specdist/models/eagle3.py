"""An EAGLE-3 draft head in the published checkpoint layout (Li et al. 2025, arXiv:2503.01840).

An EAGLE-3 head is one Llama decoder layer that drafts from the target's own hidden states. At
each position it reads two things: the embedding of the token there, and a *feature*. For
positions the target has computed, the feature is :meth:`Eagle3Head.fuse` (the ``fc`` layer) of
three of the target's hidden states (low, middle and high layers) concatenated; for positions
the head itself drafts, it is the head's own previous output before its final norm (the
"prenorm" output). The head predicts the next token over its own, smaller draft vocabulary;
``d2t`` maps each draft id to a target id, so its logits are returned over the target vocabulary.

Layout (as vLLM's and SGLang's ``llama_eagle3.py`` read it): a directory with ``config.json``
and ``model.safetensors`` (or ``model.safetensors.index.json`` with its shards, or
``pytorch_model.bin``). Tensor names are those of :func:`expected_shapes`; some checkpoints put
``model.`` in front of them, which is stripped. ``embed_tokens.weight`` is optional: without it
the head embeds tokens with the target's input embedding.

Aux layer ids: in this module, id ``i`` is the hidden state *entering* target decoder layer
``i`` (Hugging Face's ``output_hidden_states[i]``); ``i`` in ``[0, L]``, where ``L`` (past the last
layer) is the last layer's output before the final norm. The default ids and
vLLM's reading of ``eagle_aux_hidden_state_layer_ids`` use that convention, and the config's ids
are read that way here. SGLang instead adds 1 to config ids whose first entry is 1 (trainers
such as SpecForge record "output of layer k", which is the state entering layer k + 1): the two
servers disagree there, so a checkpoint's ids are worth checking against how it was trained.

The forward runs over a :class:`~specdist.models.kv.slots.SlotKVCache` of one layer, for ragged
batches (rows right-padded; padded positions write the cache's scratch column).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specdist.errors import ConfigError
from specdist.models.kv.slots import SlotKVCache

FIELD = "draft.model"  # the config setting every refusal here names

# RoPE types whose frequencies depend on the sequence length (transformers recomputes them per
# call); the head keeps one table per cache, so these are refused.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")

# tensors a checkpoint may carry that the head does not use: the target-to-draft membership mask
# (the inverse of d2t) and RoPE frequencies that some exporters save
_IGNORED_SUFFIXES = ("t2d", "rotary_emb.inv_freq")


def DEFAULT_AUX_LAYERS(num_target_layers: int) -> tuple[int, int, int]:  # upper case: the name callers use
    """The aux layer ids of a target of ``num_target_layers`` (L) decoder layers when the head's
    config names none: ``(2, L // 2, L - 3)``, the states entering layers 2, L/2 and L - 3.

    Each id is clamped into ``[0, L - 1]`` so that tiny targets (L < 5, test models) still get
    three valid ids: L = 2 gives (1, 1, 0), L = 1 gives (0, 0, 0). Real targets (L >= 5) are
    unaffected. The order (low, middle, high as given) is kept: it is the order of ``fc``'s input.
    """
    if num_target_layers < 1:
        raise ValueError(f"a target needs at least one layer, got {num_target_layers}")
    top = num_target_layers - 1
    ids = (2, num_target_layers // 2, num_target_layers - 3)
    return tuple(min(max(i, 0), top) for i in ids)  # type: ignore[return-value]


@dataclass(frozen=True)
class Eagle3Spec:
    """What an EAGLE-3 head is, read from its ``config.json`` (and its tensor names), and what
    the target must provide: hidden states of width ``target_hidden_size`` at the ``aux_layers``
    ids, over a vocabulary of ``vocab_size``."""

    hidden_size: int  # H: the head's width
    target_hidden_size: int  # Ht: the width of each target hidden state fc reads (3 of them)
    vocab_size: int  # V: the target's vocabulary; logits come back over it
    draft_vocab_size: int  # Vd: the head's lm_head rows
    aux_layers: tuple[int, ...]  # ids of the target hidden states fc concatenates, in order
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    norm_before_residual: bool  # hidden_norm applied before the residual branch is taken
    own_embed: bool  # the checkpoint has embed_tokens.weight (else the target's embedding is used)
    has_fc_bias: bool
    has_d2t: bool  # else draft id i is target id i (Vd == V)
    max_position_embeddings: int
    rope_parameters: dict = field(hash=False, compare=False)  # transformers 5.x form, rope_theta included
    path: str = ""


# -- reading a head's directory ---------------------------------------------------------------


def _read_config(path: str) -> dict:
    name = os.path.join(path, "config.json")
    if not os.path.isfile(name):
        raise ConfigError(
            FIELD, f"{path} has no config.json (an EAGLE-3 head directory holds config.json and model.safetensors)"
        )
    with open(name) as f:
        return json.load(f)


def _require(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ConfigError(
            FIELD,
            f"the head's config.json lacks {key} (the published EAGLE-3 layout: a Llama "
            "config with hidden_size, intermediate_size, num_attention_heads, vocab_size)",
        )
    return cfg[key]


def _weight_files(path: str) -> tuple[str, list[str]]:
    """("safetensors" | "bin", the files holding the tensors)."""
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return "safetensors", [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return "safetensors", [os.path.join(path, n) for n in dict.fromkeys(weight_map.values())]
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        return "bin", [binary]
    raise ConfigError(FIELD, f"{path} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _clean_name(name: str) -> str:
    """A tensor name without the ``model.`` some exporters put in front (lm_head never has it)."""
    return name.removeprefix("model.")


def _tensor_names(path: str) -> set[str]:
    """The checkpoint's tensor names (cleaned), read without loading the tensors."""
    kind, files = _weight_files(path)
    if kind == "safetensors":
        from safetensors import safe_open

        names: set[str] = set()
        for name in files:
            with safe_open(name, framework="pt") as f:
                names.update(f.keys())
    else:  # memory-mapped: the keys without reading the data
        names = set(torch.load(files[0], map_location="cpu", weights_only=True, mmap=True))
    return {_clean_name(n) for n in names}


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    kind, files = _weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if kind == "safetensors":
            from safetensors.torch import load_file

            part = load_file(name)
        else:
            part = torch.load(name, map_location="cpu", weights_only=True)
        tensors.update({_clean_name(k): v for k, v in part.items()})
    return tensors


def _text_config(target_config):
    """The language model's config of a (possibly multimodal) target config."""
    get = getattr(target_config, "get_text_config", None)
    return get() if callable(get) else target_config


def _rope_parameters(cfg: dict) -> dict:
    """The head's RoPE settings in transformers 5.x form: ``{"rope_type": ..., "rope_theta": ...,
    and the type's own keys}``. Published heads write ``rope_theta`` and ``rope_scaling`` (whose
    type key may be the old ``type``); heads saved by transformers 5.x write ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" in params:
        out = dict(params)
    else:
        out = dict(cfg.get("rope_scaling") or {})
        rope_type = out.pop("rope_type", None) or out.pop("type", None) or "default"
        out["rope_type"] = rope_type
        out.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
    if out["rope_type"] in _LENGTH_DEPENDENT_ROPE:
        raise ConfigError(
            FIELD,
            f"the head's rope type {out['rope_type']!r} depends on the sequence length, "
            "which this head does not support (default, linear, llama3, yarn and "
            "proportional are supported)",
        )
    return out


def _aux_layer_ids(cfg: dict) -> list[int] | None:
    """``eagle_aux_hidden_state_layer_ids`` at the top level or under ``eagle_config``."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(cfg.get("eagle_config"), dict):
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def read_eagle3_spec(path: str, target_config) -> Eagle3Spec:
    """The head at ``path`` as an :class:`Eagle3Spec`, from its ``config.json`` and its tensor
    names (no tensor is loaded): the target side needs ``aux_layers`` before any weight is read.

    ``target_config``: the target's transformers config; its layer count gives the default aux
    layers. Whether the spec fits the target is :func:`check_eagle3_target`'s question.
    """
    cfg = _read_config(path)
    archs = cfg.get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        raise ConfigError(
            FIELD,
            f"{path} is not an EAGLE-3 head: config.json's architectures {archs} "
            "name no Eagle3 architecture (e.g. LlamaForCausalLMEagle3)",
        )
    layers = int(cfg.get("num_hidden_layers", 1))
    if layers != 1:
        raise ConfigError(
            FIELD, f"the head has num_hidden_layers = {layers}; EAGLE-3 heads with one decoder layer are supported"
        )
    if cfg.get("tie_word_embeddings"):
        raise ConfigError(
            FIELD,
            "the head has tie_word_embeddings = true; EAGLE-3 heads have their own "
            "lm_head over the draft vocabulary (tie_word_embeddings = false)",
        )
    hidden_size = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    vocab = int(_require(cfg, "vocab_size"))
    draft_vocab = cfg.get("draft_vocab_size")
    aux = _aux_layer_ids(cfg)
    if aux is None:
        aux = DEFAULT_AUX_LAYERS(int(_text_config(target_config).num_hidden_layers))
    names = _tensor_names(path)
    return Eagle3Spec(
        hidden_size=hidden_size,
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden_size),
        vocab_size=vocab,
        draft_vocab_size=vocab if draft_vocab is None else int(draft_vocab),
        aux_layers=tuple(aux),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden_size // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        own_embed="embed_tokens.weight" in names,
        has_fc_bias="fc.bias" in names,
        has_d2t="d2t" in names,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope_parameters=_rope_parameters(cfg),
        path=path,
    )


def check_eagle3_target(spec: Eagle3Spec, target_config) -> None:
    """Refuse (:class:`ConfigError` on ``draft.model``) a head that does not fit the target whose
    transformers config is ``target_config``; the message names what differs."""
    tc = _text_config(target_config)
    t_hidden, t_vocab, t_layers = int(tc.hidden_size), int(tc.vocab_size), int(tc.num_hidden_layers)
    if spec.target_hidden_size != t_hidden:
        raise ConfigError(
            FIELD,
            f"hidden size {spec.target_hidden_size} of the head's fc input "
            f"(3 x {spec.target_hidden_size}) differs from the target's {t_hidden}",
        )
    if spec.vocab_size != t_vocab:
        raise ConfigError(
            FIELD,
            f"vocabulary size {spec.vocab_size} of the head (config vocab_size) differs from the target's {t_vocab}",
        )
    if len(spec.aux_layers) != 3:
        raise ConfigError(
            FIELD,
            f"the head names {len(spec.aux_layers)} aux layer ids {list(spec.aux_layers)}; "
            "its fc reads exactly 3 target hidden states",
        )
    bad = [i for i in spec.aux_layers if not 0 <= i <= t_layers]
    if bad:
        raise ConfigError(
            FIELD,
            f"aux layer id(s) {bad} of the head (of {list(spec.aux_layers)}) lie outside "
            f"[0, {t_layers}] for a target of {t_layers} decoder layers",
        )
    if not spec.own_embed and spec.hidden_size != t_hidden:
        raise ConfigError(
            FIELD,
            f"the head has no embed_tokens.weight, so it embeds tokens with the target's "
            f"input embedding of width {t_hidden}, which differs from the head's hidden "
            f"size {spec.hidden_size}",
        )


def expected_shapes(spec: Eagle3Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor the head reads: name (as published, without ``model.``) -> shape."""
    h, hd = spec.hidden_size, spec.head_dim
    inter = spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, 3 * spec.target_hidden_size)}
    if spec.has_fc_bias:
        shapes["fc.bias"] = (h,)
    shapes.update(
        {
            "midlayer.self_attn.q_proj.weight": (spec.num_heads * hd, 2 * h),
            "midlayer.self_attn.k_proj.weight": (spec.num_kv_heads * hd, 2 * h),
            "midlayer.self_attn.v_proj.weight": (spec.num_kv_heads * hd, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, spec.num_heads * hd),
            "midlayer.mlp.gate_proj.weight": (inter, h),
            "midlayer.mlp.up_proj.weight": (inter, h),
            "midlayer.mlp.down_proj.weight": (h, inter),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,),
            "norm.weight": (h,),
            "lm_head.weight": (spec.draft_vocab_size, h),
        }
    )
    if spec.has_d2t:
        shapes["d2t"] = (spec.draft_vocab_size,)
    if spec.own_embed:
        shapes["embed_tokens.weight"] = (spec.vocab_size, h)
    return shapes


def draft_to_target_ids(spec: Eagle3Spec, d2t: torch.Tensor | None) -> torch.Tensor:
    """The target id of each draft id, ``i + d2t[i]`` ([Vd] int64); identity without ``d2t``.
    Refuses a map that leaves ``[0, V)`` or sends two draft ids to one target id."""
    base = torch.arange(spec.draft_vocab_size, dtype=torch.int64)
    if d2t is None:
        if spec.draft_vocab_size != spec.vocab_size:
            raise ConfigError(
                FIELD,
                f"the head has no d2t tensor, so draft ids are target ids, but its draft "
                f"vocabulary ({spec.draft_vocab_size}) differs from its vocab_size "
                f"({spec.vocab_size})",
            )
        return base
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ConfigError(
            FIELD, f"the head's d2t tensor has dtype {d2t.dtype}; an integer offset per draft id is expected"
        )
    ids = base + d2t.to(torch.int64)
    outside = ((ids < 0) | (ids >= spec.vocab_size)).nonzero().flatten()
    if len(outside):
        i = int(outside[0])
        raise ConfigError(
            FIELD,
            f"the head's d2t maps draft id {i} to target id {int(ids[i])}, outside the "
            f"target vocabulary [0, {spec.vocab_size}) ({len(outside)} such ids)",
        )
    if len(torch.unique(ids)) != len(ids):
        raise ConfigError(
            FIELD,
            f"the head's d2t is not injective: {len(ids)} draft ids map to "
            f"{len(torch.unique(ids))} distinct target ids",
        )
    return ids


# -- the head ---------------------------------------------------------------------------------


class RMSNorm(torch.nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * w``, computed in float32 and cast back (as transformers'
    LlamaRMSNorm: the weight multiplies after the cast)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Eagle3Head(torch.nn.Module):
    """One EAGLE-3 decoder layer with its fc, final norm, lm_head and draft-to-target id map.

    Module names follow the checkpoint's tensor names with ``midlayer`` flattened (``q_proj``
    for ``midlayer.self_attn.q_proj``); :meth:`load_checkpoint_tensors` does the renaming.
    ``embed``: the target's input embedding when the checkpoint has none (``spec.own_embed``
    false); it is held by reference, not as a submodule, so moving or casting the head leaves
    the target's embedding alone.
    """

    def __init__(self, spec: Eagle3Spec, embed: torch.nn.Module | None = None):
        super().__init__()
        self.spec = spec
        h, hd, nh, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
        linear = torch.nn.Linear
        self.fc = linear(3 * spec.target_hidden_size, h, bias=spec.has_fc_bias)
        self.q_proj = linear(2 * h, nh * hd, bias=False)
        self.k_proj = linear(2 * h, nkv * hd, bias=False)
        self.v_proj = linear(2 * h, nkv * hd, bias=False)
        self.o_proj = linear(nh * hd, h, bias=False)
        self.gate_proj = linear(h, spec.intermediate_size, bias=False)
        self.up_proj = linear(h, spec.intermediate_size, bias=False)
        self.down_proj = linear(spec.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)  # norms the token embedding
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)  # norms the feature
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = linear(h, spec.draft_vocab_size, bias=False)
        if spec.own_embed:
            self.embed_tokens = torch.nn.Embedding(spec.vocab_size, h)
            self.shared_embed = None
        else:
            if embed is None:
                raise ValueError("a head without embed_tokens needs the target's input embedding (embed=)")
            self.embed_tokens = None
            self.shared_embed = (embed,)  # a tuple: not registered as a submodule
        # target id of each draft id: [Vd] int64
        self.register_buffer("draft_to_target", torch.arange(spec.draft_vocab_size), persistent=False)
        # held in a tuple, not as a submodule: casting the head must leave its float32
        # frequencies alone (the tables are computed on the CPU, then moved)
        self.rotary = (self._rotary(spec),)
        self.rope_cos: torch.Tensor | None = None  # [n, hd] float32 tables over positions 0..n-1
        self.rope_sin: torch.Tensor | None = None
        self.last_extra: torch.Tensor | None = None  # [W] int32: the caller's words of the last forward (extra=)

    @staticmethod
    def _rotary(spec: Eagle3Spec):
        """transformers' LlamaRotaryEmbedding over a LlamaConfig made of the head's settings, so
        that every static RoPE scaling type computes its frequencies as transformers does."""
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cfg = LlamaConfig(
            hidden_size=spec.num_heads * spec.head_dim,  # only head_dim matters to RoPE; keeps the config valid
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
            rope_parameters=dict(spec.rope_parameters),
        )
        return LlamaRotaryEmbedding(cfg)

    # -- checkpoint tensors

    @staticmethod
    def module_name(name: str) -> str:
        """The parameter name of the checkpoint tensor ``name`` (``midlayer.self_attn.q_proj.weight``
        -> ``q_proj.weight``)."""
        for prefix in ("midlayer.self_attn.", "midlayer.mlp.", "midlayer."):
            if name.startswith(prefix):
                return name[len(prefix) :]
        return name

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors (names of :func:`expected_shapes`, shapes checked by the
        loader) into the head; ``d2t`` becomes :attr:`draft_to_target`."""
        with torch.no_grad():
            params = dict(self.named_parameters())
            for name, t in tensors.items():
                if name == "d2t":
                    continue
                params[self.module_name(name)].copy_(t)
            self.draft_to_target.copy_(draft_to_target_ids(self.spec, tensors.get("d2t")))

    # -- the forward

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [..., H] in the head's dtype on its device, from its own table or the
        target's; ``ids`` may sit on another device (they are moved to the table's)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(ids.to(self.embed_tokens.weight.device))
        table = self.shared_embed[0]
        dev = table.weight.device if hasattr(table, "weight") else ids.device
        w = self.norm.weight  # (a norm's weight: the linears may hold int8 codes, see quantize_linears)
        return table(ids.to(dev)).to(device=w.device, dtype=w.dtype)

    @torch.no_grad()
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The feature of target-computed positions: fc of the 3 aux hidden states concatenated in
        ``spec.aux_layers`` order. [..., 3 * Ht] -> [..., H], on the head's device in its dtype.
        ``aux`` may sit on another device (a draft worker decodes the states from the wire on
        the CPU); it is moved to the head's device and dtype in one copy."""
        w = self.norm.weight  # (a norm's weight: the linears may hold int8 codes, see quantize_linears)
        return self.fc(to_device(aux, w.device).to(w.dtype))

    def new_cache(self, num_slots: int, max_len: int) -> SlotKVCache:
        """A one-layer K/V cache for this head, in its dtype and on its device."""
        w = self.norm.weight
        self._rope_tables(max_len + 1)  # made and moved here, not in a pass
        return SlotKVCache(
            1, num_slots, self.spec.num_kv_heads, self.spec.head_dim, max_len, dtype=w.dtype, device=w.device
        )

    def _rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n', hd] float32 (n' >= n) for positions 0..n'-1, computed once per size."""
        dev = self.norm.weight.device
        if self.rope_cos is None or self.rope_cos.shape[0] < n or self.rope_cos.device != dev:
            probe = torch.zeros(1, dtype=torch.float32)  # gives the tables' dtype: float32
            cos, sin = self.rotary[0](probe, torch.arange(n)[None])  # [1, n, hd]
            self.rope_cos, self.rope_sin = cos[0].to(dev), sin[0].to(dev)
        return self.rope_cos, self.rope_sin

    @torch.no_grad()  # inference only: the cache is written in place
    def forward(
        self,
        cache: SlotKVCache,
        slots: list[int],
        tokens: list[list[int]],
        features: list[torch.Tensor],
        extra: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Append ``tokens[b]`` (n_b >= 1 ids) to ``slots[b]`` at its current length, with the
        features ``features[b]`` [n_b, H] of those positions (fused target states or the head's
        own prenorm outputs); write their K/V into ``cache`` and advance ``cache.lengths``.

        Returns the logits of each row's last token over the target vocabulary, [B, V] float32
        (-inf at target ids no draft id maps to), and per row the prenorm outputs [n_b, H] of
        all its tokens (the features of the next positions when the head drafts on).

        What the pass needs from the host (ids, positions, slots) goes to the device in one copy that does not
        block the host (:func:`to_device`), and nothing comes back: no pass waits for the device. ``extra``: int32
        words ([W] numpy) the caller needs on the device too (a draft pass's sampling inputs,
        :class:`specdist.cores.device_inputs.HostInputs`); they ride in that copy, starting on an even word, and
        are :attr:`last_extra` ([W] int32 on the device) after the call (None without).
        """
        spec = self.spec
        w = self.norm.weight  # the head's dtype and device (its linears may be int8)
        dev, dtype = w.device, w.dtype
        n_rows = len(slots)
        if not (n_rows == len(tokens) == len(features)) or n_rows == 0:
            raise ValueError(
                f"slots, tokens and features need one entry per row, got {len(slots)}, {len(tokens)}, {len(features)}"
            )
        if len(set(slots)) != n_rows:
            raise ValueError(f"a slot appears twice in one call: {slots}")
        lens = [len(t) for t in tokens]
        starts = [cache.lengths[s] for s in slots]
        for b in range(n_rows):
            if lens[b] < 1:
                raise ValueError(f"row {b} has no tokens")
            if tuple(features[b].shape) != (lens[b], spec.hidden_size):
                raise ValueError(
                    f"row {b}: features of shape {tuple(features[b].shape)}, expected ({lens[b]}, {spec.hidden_size})"
                )
            if starts[b] + lens[b] > cache.max_len:
                raise ValueError(
                    f"slot {slots[b]} holds {starts[b]} tokens; {lens[b]} more exceed the cache's "
                    f"max_len {cache.max_len}"
                )
        t_max = max(lens)
        bt = n_rows * t_max

        # Right-padded batch, made on the host. Row b's token j sits at position starts[b] + j; a padded entry
        # (j >= n_b) writes the scratch column and queries as if it were the row's last token, so that its
        # attention row is never empty (its outputs are dropped).
        j = np.arange(t_max)[None]  # [1, T]
        len_a, start_a = np.asarray(lens)[:, None], np.asarray(starts)[:, None]  # [B, 1]
        valid = j < len_a  # [B, T]
        query_pos = start_a + np.minimum(j, len_a - 1)  # [B, T]
        write_pos = np.where(valid, query_pos, cache.scratch)  # [B, T]
        ids = np.zeros((n_rows, t_max), dtype=np.int64)
        for b in range(n_rows):
            ids[b, : lens[b]] = tokens[b]
        flat = np.arange(bt).reshape(n_rows, t_max)  # [B, T] each entry's row of the flattened batch
        # one int64 array: ids, query and write positions [B * T] each, slots [B], each row's last entry [B],
        # the entries that hold tokens [sum n_b]
        host = np.concatenate(
            [ids.ravel(), query_pos.ravel(), write_pos.ravel(), slots, flat[:, 0] + len_a[:, 0] - 1, flat[valid]]
        ).astype(np.int64)
        words = host.view(np.int32)  # an even count: the caller's words start 8-byte aligned
        buf = to_device(torch.from_numpy(words if extra is None else np.concatenate([words, extra])), dev)
        meta = buf[: words.size].view(torch.int64)
        ids_d, qp, wp = (meta[i * bt : (i + 1) * bt].view(n_rows, t_max) for i in range(3))  # [B, T] each
        slot_t = meta[3 * bt : 3 * bt + n_rows]  # [B]
        last_rows = meta[3 * bt + n_rows : 3 * bt + 2 * n_rows]  # [B]
        token_rows = meta[3 * bt + 2 * n_rows :]  # [sum n_b]
        self.last_extra = buf[words.size :] if extra is not None else None
        fed = torch.cat([f.to(device=dev, dtype=dtype) for f in features])  # [sum n_b, H]
        if sum(lens) == bt:  # no padding
            feat = fed.view(n_rows, t_max, spec.hidden_size)
        else:
            feat = fed.new_zeros(bt, spec.hidden_size).index_copy_(0, token_rows, fed).view(n_rows, t_max, -1)

        # Inputs of the layer: the normed embedding beside the normed feature.
        e = self.input_layernorm(self.embed(ids_d))  # [B, T, H]
        if spec.norm_before_residual:
            g = self.hidden_norm(feat)
            residual = g
        else:
            residual = feat
            g = self.hidden_norm(feat)
        x = torch.cat([e, g], dim=-1)  # [B, T, 2H]

        # Attention over the row's cached keys and the new ones, with RoPE at each position.
        hd, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
        q = self.q_proj(x).view(n_rows, t_max, nh, hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(n_rows, t_max, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(n_rows, t_max, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
        cos_table, sin_table = self._rope_tables(cache.max_len + 1)
        cos = cos_table[qp].to(dtype)[:, None]  # [B, 1, T, hd]
        sin = sin_table[qp].to(dtype)[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin

        # cache.k[0][slot, :, pos] indexed by [B, 1] slots and [B, T] positions: [B, T, nkv, hd]
        cache.k[0][slot_t[:, None], :, wp] = k.transpose(1, 2)
        cache.v[0][slot_t[:, None], :, wp] = v.transpose(1, 2)
        span = max(s + n for s, n in zip(starts, lens))  # keys 0..span-1 cover every row
        keys = cache.k[0][slot_t, :, :span]  # [B, nkv, S, hd]
        values = cache.v[0][slot_t, :, :span]
        # query t of row b sees the row's keys at positions <= its own
        mask = torch.arange(span, device=dev)[None, None] <= qp[:, :, None]  # [B, T, S]
        attn = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], enable_gqa=nh != nkv
        )  # [B, nh, T, hd]
        a = self.o_proj(attn.transpose(1, 2).reshape(n_rows, t_max, nh * hd))  # [B, T, H]

        # Residual, SiLU-gated MLP, residual.
        hidden = residual + a
        m = self.post_attention_layernorm(hidden)
        out = hidden + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))  # [B, T, H]: prenorm

        for b, s in enumerate(slots):
            cache.lengths[s] = starts[b] + lens[b]
        last = out.reshape(bt, -1).index_select(0, last_rows)  # [B, H]
        return self.target_logits(self.lm_head(self.norm(last))), [out[b, : lens[b]] for b in range(n_rows)]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] placed at their target ids in a [..., V] float32 tensor, -inf
        elsewhere (target tokens outside the draft vocabulary get no draft probability)."""
        out = torch.full(
            (*draft_logits.shape[:-1], self.spec.vocab_size), -math.inf, dtype=torch.float32, device=draft_logits.device
        )
        out[..., self.draft_to_target.to(out.device)] = draft_logits.float()  # (a no-op on the head's device)
        return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the host without waiting for the device: a non-blocking copy, through pinned
    memory on CUDA (torch's pinned allocator keeps the staging memory until the copy ran; a blocking copy waits
    for everything queued on the device first). Other moves as ``Tensor.to``."""
    if t.device == device:
        return t
    if t.device.type != "cpu" or device.type == "cpu":
        return t.to(device)
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def quantize_linears(head: Eagle3Head) -> Eagle3Head:
    """The head's linears (fc, attention, MLP, lm_head) on int8 weights per output row, in place, where
    the CPU's Q8 block kernel runs them (:class:`specdist.models.quant.Int8WeightOnlyLinear`): a pass at
    batch 1 reads a quarter of the bytes (its figures: docs/performance.md).
    The draft's numerics are its own: exactness does not depend on them. Elsewhere nothing changes."""
    from specdist.models.kernels import cpu_kernels
    from specdist.models.quant import quantize_model_int8

    if head.norm.weight.device.type == "cpu" and cpu_kernels.available():
        quantize_model_int8(head)
    return head


def load_eagle3_head(
    path: str, target_config, embedding: torch.nn.Module | None, dtype: torch.dtype, device
) -> Eagle3Head:
    """The EAGLE-3 head at ``path`` for the target whose transformers config is ``target_config``, in
    ``dtype`` on ``device``, in eval mode. ``embedding``: the target's input embedding, which a head
    without its own embeds tokens with (unused, and may be None, for a head that has one: see
    :func:`read_eagle3_spec`'s ``own_embed``). Refuses (:class:`ConfigError` on ``draft.model``) a
    head that does not fit the target, a tensor missing, of the wrong shape or unknown (each
    named), and a bad ``d2t``."""
    spec = read_eagle3_spec(path, target_config)
    check_eagle3_target(spec, target_config)
    tensors = _read_tensors(path)
    shapes = expected_shapes(spec)
    for name in [n for n in tensors if n.endswith(_IGNORED_SUFFIXES)]:
        del tensors[name]
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        raise ConfigError(
            FIELD,
            f"the head has tensor(s) {unknown} that an EAGLE-3 Llama head does not have (expected: {sorted(shapes)})",
        )
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise ConfigError(FIELD, f"the head lacks tensor(s) {missing}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ConfigError(
                FIELD,
                f"tensor {name} of the head has shape {list(tensors[name].shape)}, "
                f"expected {list(shape)} from its config.json",
            )
    if not spec.own_embed and embedding is None:
        raise ValueError("a head without embed_tokens needs the target's input embedding")
    head = Eagle3Head(spec, embed=None if spec.own_embed else embedding)
    head.load_checkpoint_tensors(tensors)
    return head.to(device=device, dtype=dtype).eval()
