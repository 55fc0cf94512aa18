"""Batched forward of a Llama-family HF model over a :class:`SlotKVCache`.

We keep the HF modules (so loading, GGUF de-quantisation, int8 replacement and
DeepSpeed AutoTP sharding all act on the real ``nn.Module`` tree) and replace only
the outer loop: each request in the batch brings its own new tokens and its own
cache slot, tokens are written into the slot at the slot's current length, and
attention masks out everything past each request's own length. Ragged batches are
right-padded; padded positions write to the cache's scratch column.

Works unchanged on tensor-parallel shards: local head counts are read off the
projections' output sizes, and the row-parallel ``o_proj`` / ``down_proj`` do
their own all-reduce.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdist.kv_cache import SlotKVCache
from specdist.models.fusion import fuse_projections

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ForwardTimings:
    cache_write_s: float = 0.0  # time spent writing new K/V into slots


class CausalLMRunner:
    """Owns one model and its KV cache. Not thread-safe; one step at a time."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, fuse: bool = True):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model.eval()
        if fuse:  # one matmul for q/k/v and one for gate/up; HF forward keeps working
            fuse_projections(model)
        self.config = model.config
        self.vocab_size = int(model.config.vocab_size)
        self.max_len = max_len
        base = model.model
        self.layers = list(base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        with torch.inference_mode():  # local (possibly sharded) kv-head count, read off the projection
            probe = torch.zeros(1, model.config.hidden_size, dtype=self.dtype, device=self.device)
            n_kv_local = attn.k_proj(probe).shape[-1] // self.head_dim
        # RoPE cos/sin for every position, computed once: [max_len + 1, hd] each (last row: scratch).
        with torch.inference_mode():
            pos = torch.arange(max_len + 1, device=self.device)[None]
            cos, sin = model.model.rotary_emb(probe[None], pos)
            self.rope_cos, self.rope_sin = cos[0], sin[0]
        self.cache = SlotKVCache(
            len(self.layers), num_slots, n_kv_local, self.head_dim, max_len, self.dtype, self.device
        )
        self.timings = ForwardTimings()

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        tokens: list[list[int]],
        num_logits: list[int],
    ) -> torch.Tensor:  # [B, max(num_logits), V] float32 logits of each request's last tokens, on the model's device
        """Append ``tokens[b]`` to ``slots[b]`` and return logits for the last ``num_logits[b]`` of them.

        Row ``b`` of the result holds its logits left-aligned; rows with fewer than the
        maximum are zero-padded on the right.
        """
        cache = self.cache
        bsz = len(slots)
        n_new = [len(t) for t in tokens]
        t_max = max(n_new)
        starts = [cache.lengths[s] for s in slots]
        for s, st, n in zip(slots, starts, n_new):
            if st + n > cache.max_len:
                raise ValueError(f"slot {s}: {st} + {n} tokens exceed the cache length {cache.max_len}")
        dev = self.device
        ids = torch.zeros(bsz, t_max, dtype=torch.long)
        for b, t in enumerate(tokens):
            ids[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        ar = torch.arange(t_max)
        start_t = torch.tensor(starts, dtype=torch.long)
        n_t = torch.tensor(n_new, dtype=torch.long)
        positions = start_t[:, None] + ar[None, :]  # [B, T]
        valid = ar[None, :] < n_t[:, None]  # [B, T]
        write_pos = torch.where(valid, positions, torch.full_like(positions, cache.scratch)).to(dev)  # [B, T]
        s_len = int((start_t + n_t).max())  # keys attended: [0, S)
        # Key j is visible to query (b, t) iff j <= position(b, t). Padded queries see a
        # superset, which is harmless (their outputs are discarded) and avoids empty rows.
        if bsz == 1 and t_max == 1:
            mask = None  # one query that sees every cached key
        else:
            mask = (torch.arange(s_len)[None, None, :] <= positions[:, :, None])[:, None].to(dev)  # [B, 1, T, S]
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        contiguous = slots == list(range(slots[0], slots[0] + bsz))

        h = self.model.model.embed_tokens(ids.to(dev))  # [B, T, D]
        rope_pos = write_pos  # padded tokens get the scratch row; their outputs are discarded
        cos, sin = self.rope_cos[rope_pos], self.rope_sin[rope_pos]  # [B, T, hd] each
        write_s = 0.0
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _rms_norm(layer.input_layernorm, h)
            q, k, v = _qkv(attn, x)
            q = q.reshape(bsz, t_max, -1, self.head_dim).transpose(1, 2)  # [B, Hq, T, hd]
            k = k.reshape(bsz, t_max, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
            v = v.reshape(bsz, t_max, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
            q, k = _apply_rope(q, k, cos, sin)
            t0 = time.perf_counter()
            kc, vc = cache.k[i], cache.v[i]  # [N, Hkv, L+1, hd]
            kc[slot_t[:, None], :, write_pos] = k.transpose(1, 2).to(kc.dtype)  # [B, T, Hkv, hd]
            vc[slot_t[:, None], :, write_pos] = v.transpose(1, 2).to(vc.dtype)
            if contiguous:
                keys = kc[slots[0] : slots[0] + bsz, :, :s_len]  # view, no copy: [B, Hkv, S, hd]
                vals = vc[slots[0] : slots[0] + bsz, :, :s_len]
            else:
                keys = kc[:, :, :s_len].index_select(0, slot_t)  # copies only the attended prefix
                vals = vc[:, :, :s_len].index_select(0, slot_t)
            write_s += time.perf_counter() - t0
            o = F.scaled_dot_product_attention(
                q, keys, vals, attn_mask=mask, scale=self.scaling, enable_gqa=q.shape[1] != keys.shape[1]
            )  # [B, Hq, T, hd]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(bsz, t_max, -1))
            h = h + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, h))
        self.timings.cache_write_s += write_s
        for s, st, n in zip(slots, starts, n_new):
            cache.lengths[s] = st + n

        n_out = max(num_logits)
        if n_out == 0:
            return torch.zeros(bsz, 0, self.vocab_size, device=dev)
        # Gather the hidden states whose logits are wanted: the last num_logits[b] valid tokens.
        offs = torch.tensor(num_logits, dtype=torch.long)
        idx = (n_t - offs)[:, None] + torch.arange(n_out)[None, :]  # [B, n_out]
        idx = idx.clamp(min=0, max=t_max - 1)
        hs = h.gather(1, idx.to(dev)[..., None].expand(-1, -1, h.shape[-1]))  # [B, n_out, D]
        logits = _lm_head(self.model.lm_head, _rms_norm(self.model.model.norm, hs)).float()  # [B, n_out, V]
        if min(num_logits) < n_out:
            keep = (torch.arange(n_out)[None, :] < offs[:, None]).to(dev)
            logits = logits * keep[..., None]
        return logits  # stays on the device: sampling and verification run there


def _lm_head(head: torch.nn.Module, hs: torch.Tensor) -> torch.Tensor:  # [B, n, D] -> [B, n, V]
    """The output projection. On CPU an fp32 GEMM whose row count is 2 or 3 mod 4 takes the
    row-by-row path: measured here for [M, 576] x [576, 49152], M = 1..8: 10.5, 22.6, 33.9, 17.3,
    17.4, 24.2, 35.2, 18.1 ms. Zero rows pad M to the next multiple of 4 (results sliced off)."""
    bsz, n, dim = hs.shape
    m = bsz * n
    if hs.device.type != "cpu" or type(head) is not torch.nn.Linear or m % 4 < 2:
        return head(hs)
    flat = torch.cat([hs.reshape(m, dim), hs.new_zeros(4 - m % 4, dim)])  # [M', D]
    return head(flat)[:m].reshape(bsz, n, -1)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The fused ``F.rms_norm`` for Llama-style RMSNorm modules; anything else runs its own forward."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or type(norm).__name__ not in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"):
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _qkv(attn, x):
    """q, k, v projections: one matmul when :mod:`specdist.models.fusion` fused them."""
    fused = getattr(attn, "fused_qkv", None)
    if fused is not None:
        return fused(x)
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def _mlp(mlp, x):
    fused = getattr(mlp, "fused_gate_up", None)
    if fused is not None:
        gate, up = fused(x)
        return mlp.down_proj(mlp.act_fn(gate) * up)
    return mlp(x)


def _apply_rope(q, k, cos, sin):
    """Rotary embedding (half-rotation convention used by Llama-family HF models)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, hd]

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin
