"""A distilled EAGLE-3 head for the tiny test target, so that its drafts are often accepted.

A random head's q is peaked on random tokens: nearly every draft is rejected, and a test of
exactness then neither accepts whole drafts nor rejects drafts the target finds likely, which
is what a wrong verifier gets wrong. :func:`fit_head` trains a head in the published layout
(written by :func:`specdist.bench.checkpoints.write_random_eagle3_head`) for about 4 s on
the target's own hidden states and next-token distributions, as EAGLE-3 training does with
its first step (no "training-time test" steps: positions the head drafts from its own
outputs are accepted less often, which the tests want too), and writes it back in place.

A helper module of the tests (like gtest.py), not a test module. Seeded: the same head every run.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdist.models.eagle3 import Eagle3Head, load_eagle3_head


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def head_forward(head: Eagle3Head, tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Differentiable, cache-free forward over whole sequences: ``tokens`` [B, T] (the token after
    each position), ``feats`` [B, T, H] (fused target states) -> draft-vocabulary logits [B, T, Vd]."""
    spec = head.spec
    bsz, n = tokens.shape
    e = head.input_layernorm(head.embed(tokens))  # [B, T, H]
    if spec.norm_before_residual:
        g = residual = head.hidden_norm(feats)
    else:
        residual, g = feats, head.hidden_norm(feats)
    x = torch.cat([e, g], -1)  # [B, T, 2H]
    hd, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    q = head.q_proj(x).view(bsz, n, nh, hd).transpose(1, 2)  # [B, nh, T, hd]
    k = head.k_proj(x).view(bsz, n, nkv, hd).transpose(1, 2)
    v = head.v_proj(x).view(bsz, n, nkv, hd).transpose(1, 2)
    cos, sin = head._rope_tables(n)  # noqa: SLF001 - the head's own RoPE tables, [n', hd]
    cos, sin = cos[:n], sin[:n]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)  # [B, nh, T, hd]
    h = residual + head.o_proj(a.transpose(1, 2).reshape(bsz, n, nh * hd))
    m = head.post_attention_layernorm(h)
    out = h + head.down_proj(F.silu(head.gate_proj(m)) * head.up_proj(m))
    return head.lm_head(head.norm(out))  # [B, T, Vd]


def fit_head(head_path: str, target: torch.nn.Module, steps: int = 200, seqs: int = 128, length: int = 12,
             seed: int = 0) -> None:
    """Train the head at ``head_path`` for ``target`` (a loaded HF model) and save it in place.

    Data: ``seqs`` sequences of ``length`` tokens sampled from the target (temperature 1) after a
    random first token. At position i the head reads the fused target states at i and the token at
    i + 1, and is fitted (KL divergence) to the target's distribution of the token at i + 2,
    restricted to the draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    head = load_eagle3_head(head_path, target.config, target.get_input_embeddings(), torch.float32, "cpu")
    vocab = int(target.config.vocab_size)
    with torch.no_grad():
        ids = torch.randint(0, vocab, (seqs, 1), generator=gen)
        for _ in range(length - 1):
            logits = target(ids).logits[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=gen)], 1)
        out = target(ids, output_hidden_states=True)
        states = torch.cat([out.hidden_states[i] for i in head.spec.aux_layers], -1)  # [S, L, 3H]
        p = out.logits.float().softmax(-1)[:, 1:, head.draft_to_target]  # [S, L-1, Vd]: target's next-token law
        p = p / p.sum(-1, keepdim=True)
    # position i: states at i, token i + 1 -> the law of token i + 2 (the target's at i + 1)
    tokens, feats, want = ids[:, 1:-1], states[:, :-2], p[:, 1:]
    params = [t for name, t in head.named_parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    torch.manual_seed(seed)
    for _ in range(steps):
        logq = head_forward(head, tokens, head.fc(feats)).log_softmax(-1)
        loss = F.kl_div(logq, want, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
    _save(head, head_path)


def _save(head: Eagle3Head, path: str) -> None:
    """The head's parameters back into its checkpoint, under the published names."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    params = dict(head.named_parameters())
    for name in tensors:
        if name in ("d2t", "t2d"):
            continue
        tensors[name] = params[Eagle3Head.module_name(name)].detach().clone().contiguous()
    save_file(tensors, file)
