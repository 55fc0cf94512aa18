"""A distilled EAGLE-3 head for the tiny test target, so that its drafts are often accepted.

A random head's q is peaked on random tokens: nearly every draft is rejected, and a test of
exactness then neither accepts whole drafts nor rejects drafts the target finds likely, which
is what a wrong verifier gets wrong. :func:`fit_head` trains a head in the published layout
(written by :func:`specdist.bench.checkpoints.write_random_eagle3_head`) for a few seconds on
the target's own hidden states and next-token distributions, as EAGLE-3 training does: a first
step from the target's states and a second from the head's own outputs, attending to the first
step's keys as drafting does ("training-time test"), and writes it back in place.

A helper module of the tests (like gtest.py), not a test module. Seeded and fitted on one thread:
the same head every run, whatever thread count the suite runs with.
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


def head_forward(head: Eagle3Head, tokens: torch.Tensor, feats: torch.Tensor, prior=None):
    """Differentiable, cache-free forward over whole sequences: ``tokens`` [B, T] (the token after
    each position), ``feats`` [B, T, H] (fused target states, or the head's own outputs) -> draft-vocabulary
    logits [B, T, Vd], the prenorm outputs [B, T, H] and this step's keys and values ([B, nkv, T, hd] each).

    ``prior``: the keys and values of the step before, for a step from the head's own outputs (EAGLE-3's
    "training-time test"): row t is then at sequence position t + 1 and attends to the prior keys
    0..t (computed from the target's states, as while drafting) and to its own."""
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
    first = 0 if prior is None else 1  # sequence position of row 0
    cos, sin = head._rope_tables(n + first)  # noqa: SLF001 - the head's own RoPE tables, [n', hd]
    cos, sin = cos[first : first + n], sin[first : first + n]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    if prior is None:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)  # [B, nh, T, hd]
    else:
        t = torch.arange(n)
        mask = torch.cat([t[None, :] <= t[:, None], torch.eye(n, dtype=torch.bool)], 1)  # [T, 2T]
        a = F.scaled_dot_product_attention(
            q, torch.cat([prior[0], k], 2), torch.cat([prior[1], v], 2), attn_mask=mask, enable_gqa=nh != nkv
        )
    h = residual + head.o_proj(a.transpose(1, 2).reshape(bsz, n, nh * hd))
    m = head.post_attention_layernorm(h)
    out = h + head.down_proj(F.silu(head.gate_proj(m)) * head.up_proj(m))
    return head.lm_head(head.norm(out)), out, (k, v)


def fit_head(
    head_path: str, target: torch.nn.Module, steps: int = 200, seqs: int = 128, length: int = 12, seed: int = 0
) -> None:
    """Train the head at ``head_path`` for ``target`` (a loaded HF model) and save it in place.

    Data: ``seqs`` sequences of ``length`` tokens sampled from the target (temperature 1) after a
    random first token. At position i the head reads the fused target states at i and the token at
    i + 1, and is fitted (KL divergence) to the target's distribution of the token at i + 2,
    restricted to the draft vocabulary.

    Runs on one intra-op thread, restored afterwards: how a kernel splits its sums over threads
    changes their float rounding, which the training steps carry into a different head. Pinned, the head
    is the same whatever thread count the caller runs with (pytest-xdist workers take fewer)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fit(head_path, target, steps, seqs, length, seed)
    finally:
        torch.set_num_threads(before)


def _fit(head_path: str, target: torch.nn.Module, steps: int, seqs: int, length: int, seed: int) -> None:
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
        # p[:, t]: the target's law of token t + 1 (its logits at position t), over the draft vocabulary
        p = out.logits.float().softmax(-1)[..., head.draft_to_target]  # [S, L, Vd]
        p = p / p.sum(-1, keepdim=True)
    # position i: states at i, token i + 1 -> the law of token i + 2 (the target's logits at i + 1)
    tokens, feats, want = ids[:, 1:-1], states[:, :-2], p[:, 1:-1]
    params = [t for name, t in head.named_parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    torch.manual_seed(seed)
    for _ in range(steps):
        logits, own, (k, v) = head_forward(head, tokens, head.fc(feats))
        loss = F.kl_div(logits.log_softmax(-1), want, reduction="batchmean")
        # a second step from its own states, as it drafts past the verified positions: position i + 1
        # reads the head's output at i (instead of the target's states at i + 1) and the token at i + 2
        logits2, _, _ = head_forward(head, tokens[:, 1:], own[:, :-1], (k[:, :, :-1], v[:, :, :-1]))
        loss = loss + F.kl_div(logits2.log_softmax(-1), want[:, 1:], reduction="batchmean")
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
