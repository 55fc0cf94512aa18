"""Tiny random-weight checkpoints of every model family the runner serves.

``save_tiny(path, family)`` writes a real Hugging Face checkpoint (safetensors via
``save_pretrained``) with a word-level tokenizer, so loading, tokenisation and
generation go through the same code as with real models. Every family has 2 layers,
hidden size 32, 4 query heads over 2 key/value heads of size 8 (2 tensor-parallel
ranks divide them), and weights drawn with a large standard deviation (norm weights
and biases too) so next-token distributions are peaked, greedy argmaxes sit far from
ties, and every weight the forward reads moves the logits. Sliding windows are small
(4-5 tokens) and soft-caps low, so sequences of a dozen tokens exercise them.
"""

from __future__ import annotations

import os

import torch

TINY_WORDS = ["a", "b", "c", "d", "e", "f", "g", "<eos>"]  # id 7 is EOS

FAMILIES = [
    "llama",
    "llama-linear",
    "llama3-rope",
    "llama-yarn",
    "llama-dynamic",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "phi3-longrope",
    "qwen3_moe",
]
# families whose RoPE frequencies transformers derives from the length of each call
LENGTH_DEPENDENT_ROPE = ("llama-dynamic", "phi3-longrope")

_LAYERS = 2
_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    eos_token_id=7,
    bos_token_id=0,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def _alternating(n: int, first: str = "sliding_attention") -> list[str]:
    other = "full_attention" if first == "sliding_attention" else "sliding_attention"
    return [first if i % 2 == 0 else other for i in range(n)]


def _family_config(family: str, vocab_size: int, overrides: dict):
    """(config class, model class, config kwargs) of one family."""
    import transformers as tf

    kw = dict(_COMMON, vocab_size=vocab_size)
    layers = overrides.get("num_hidden_layers", _LAYERS)
    if family == "llama":
        return tf.LlamaConfig, tf.LlamaForCausalLM, kw
    if family == "llama-linear":
        kw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
        return tf.LlamaConfig, tf.LlamaForCausalLM, kw
    if family == "llama3-rope":  # wavelengths 6.3 and 63 straddle the 4..16 band: smoothed and scaled both occur
        kw["rope_parameters"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "rope_theta": 10000.0,
        }
        return tf.LlamaConfig, tf.LlamaForCausalLM, kw
    if family == "llama-yarn":  # attention factor 1 + 0.1 ln 4: cos/sin scaled as well
        kw["rope_parameters"] = {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        }
        return tf.LlamaConfig, tf.LlamaForCausalLM, kw
    if family == "llama-dynamic":  # NTK scaling starts past 16 positions
        kw["max_position_embeddings"] = 16
        kw["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        return tf.LlamaConfig, tf.LlamaForCausalLM, kw
    if family == "mistral":
        kw.update(head_dim=8, sliding_window=4)
        return tf.MistralConfig, tf.MistralForCausalLM, kw
    if family == "qwen2":  # qkv bias; layers >= max_window_layers slide
        kw.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
        return tf.Qwen2Config, tf.Qwen2ForCausalLM, kw
    if family == "qwen3":  # q/k norm; layers >= max_window_layers slide
        kw.update(head_dim=8, use_sliding_window=True, sliding_window=5, max_window_layers=1)
        return tf.Qwen3Config, tf.Qwen3ForCausalLM, kw
    if family == "gemma2":  # soft-caps low enough that tanh bends; 1/sqrt(16) instead of 1/sqrt(head_dim)
        kw.update(
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            layer_types=_alternating(layers),
            hidden_activation="gelu_pytorch_tanh",
        )
        return tf.Gemma2Config, tf.Gemma2ForCausalLM, kw
    if family == "gemma3":  # q/k norm, local rope base on sliding layers, final soft-cap
        kw.update(
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=16,
            final_logit_softcapping=3.0,
            layer_types=_alternating(layers),
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
        return tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, kw
    if family == "phi3":  # fused qkv_proj and gate_up_proj; the window applies to every layer
        kw.update(sliding_window=5, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
        return tf.Phi3Config, tf.Phi3ForCausalLM, kw
    if family == "phi3-longrope":  # long factors past 16 positions, short ones before
        kw.update(
            max_position_embeddings=64,
            original_max_position_embeddings=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        )
        kw["rope_parameters"] = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        }
        return tf.Phi3Config, tf.Phi3ForCausalLM, kw
    if family == "qwen3_moe":  # layer 0 dense (mlp_only_layers), the others 4 experts, top-2
        kw.update(
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
        )
        return tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, kw
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over ``TINY_WORDS`` (then ``w8``, ``w9``, ...), saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = TINY_WORDS + [f"w{i}" for i in range(len(TINY_WORDS), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words[:vocab_size])}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>" if vocab_size > 7 else None)
    fast.save_pretrained(path)


def build_tiny(family: str, seed: int = 0, vocab_size: int = 16, std: float = 0.35, **config_overrides):
    """The random model in memory (fp32, eval mode), as :func:`save_tiny` writes it."""
    config_cls, model_cls, kw = _family_config(family, vocab_size, config_overrides)
    kw.update(config_overrides)
    if "layer_types" in kw and "layer_types" not in config_overrides:
        kw["layer_types"] = kw["layer_types"][: kw["num_hidden_layers"]]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, embeddings, stacked experts
                p.normal_(0.0, std)
            else:  # norm weights (about 1 for Llama-style, about 0 for Gemma's 1 + w) and biases
                p.add_(torch.randn(p.shape) * 0.3)
    return model.eval()


def save_tiny(path: str, family: str, seed: int = 0, **config_overrides) -> str:
    """Write a tiny random checkpoint of ``family`` (see ``FAMILIES``) with a tokenizer to ``path``.

    ``config_overrides`` go to the family's config class (e.g. ``num_hidden_layers=1`` for a
    draft; per-layer ``layer_types`` are cut to the layer count); ``vocab_size`` (default 16)
    and ``std`` (default 0.35) are taken here too.
    """
    model = build_tiny(family, seed, **config_overrides)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path, model.config.vocab_size)
    return path
