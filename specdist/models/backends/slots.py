"""The slot cache's backends (:class:`~specdist.models.kv.slots.SlotKVCache`: a slot of ``max_len + 1``
positions a request, the last one the scratch column padded tokens write): ``sdpa``, torch's
scaled-dot-product attention in the cheapest form it accepts, and ``cpu``, specdist's C kernels, which read
each query's keys from the cache itself (rows independent of the batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdist.models.backends.base import AttentionBackend, SlotStep, register
from specdist.models.kernels import cpu_kernels
from specdist.models.kv.slots import SlotKVCache


class _SlotBackend(AttentionBackend):
    kv_layout = "slots"

    @classmethod
    def make_cache(
        cls, num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device, num_blocks=None, block_size=16
    ):
        return SlotKVCache(num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device)

    def plan(self, slots, tokens, starts, num_logits, bsz, t_pad, extra=None) -> SlotStep:
        """Host-side layout, then one copy of each index tensor: ``ids`` [B, T] (0-padded), ``write_pos``
        (padded tokens: the scratch column) and ``query_pos`` [B, T] (padded queries take their request's last
        position: their outputs are discarded, and every query sees at least one key whatever the window)."""
        dev = self.cache.k[0].device
        pad_b = bsz - len(slots)
        slots, tokens, starts = (
            list(slots) + [slots[0]] * pad_b,
            list(tokens) + [[]] * pad_b,
            list(starts) + [0] * pad_b,
        )
        ids = torch.tensor([list(t) + [0] * (t_pad - len(t)) for t in tokens], dtype=torch.long)  # [B, T]
        ar = torch.arange(t_pad)
        start_t = torch.tensor(starts, dtype=torch.long)
        n_t = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        positions = start_t[:, None] + ar[None, :]  # [B, T]
        valid = ar[None, :] < n_t[:, None]  # [B, T]
        write_pos = torch.where(valid, positions, torch.full_like(positions, self.cache.scratch))
        query_pos = torch.minimum(positions, (start_t + n_t - 1).clamp(min=0)[:, None])  # [B, T]
        words = None if extra is None else torch.from_numpy(extra).to(dev)
        return SlotStep(
            bsz,
            t_pad,
            ids.to(dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            write_pos.to(dev),
            query_pos.to(dev),
            slots,
            starts,
            [len(t) for t in tokens],
            words,
        )

    def _write(self, i: int, step: SlotStep, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's rotated keys and values [B, Hkv, T, hd] into each request's slot at its positions."""
        kc, vc = self.cache.k[i], self.cache.v[i]  # [slots, Hkv, L + 1, hd]
        kc[step.slots[:, None], :, step.write_pos] = k.transpose(1, 2).to(kc.dtype)  # [B, T, Hkv, hd]
        vc[step.slots[:, None], :, step.write_pos] = v.transpose(1, 2).to(vc.dtype)
        return kc, vc

    def _heads(self, i, q, k, v, step):  # rows -> rotated q, k [B, H, T, hd], v [B, Hkv, T, hd]
        bsz, t, hd = step.bsz, step.tokens, q.shape[-1]
        q, k = q.reshape(bsz, t, -1, hd).transpose(1, 2), k.reshape(bsz, t, -1, hd).transpose(1, 2)
        v = v.reshape(bsz, t, -1, hd).transpose(1, 2)
        cos, sin = self.rope_at(step, i)
        return *apply_rope(q, k, cos, sin), v


@register
class SdpaBackend(_SlotBackend):
    """torch's ``scaled_dot_product_attention`` over keys sliced to the longest sequence, in the form that lets
    PyTorch pick its fused kernels: no mask when every request has one query at one common position (a window
    then slices the keys), ``is_causal`` for a one-request prefill from position 0 that the window does not
    cut, a boolean mask otherwise. Soft-capped scores (Gemma 2) take an explicit attention: no fused kernel
    applies the cap."""

    name = "sdpa"

    def forward(self, i, q, k, v, step: SlotStep) -> torch.Tensor:
        q, k, v = self._heads(i, q, k, v, step)  # [B, Hq, T, hd], [B, Hkv, T, hd] x2
        kc, vc = self._write(i, step, k, v)
        window = self.windows[i]
        if step.masks is not None:  # a padded pass (compiled): keys padded to the masks' length, one mask a window
            s_pad = step.masks[0].shape[-1]
            keys = kc[:, :, :s_pad].index_select(0, step.slots)  # [B, Hkv, S, hd]
            vals = vc[:, :, :s_pad].index_select(0, step.slots)
            o = sdpa(q, keys, vals, step.masks[self.mask_of_layer[i]], False, self.scaling, self.softcap)
            return o.transpose(1, 2).reshape(step.bsz * step.tokens, -1, q.shape[-1])
        s_len = max(st + n for st, n in zip(step.starts, step.n_new))  # keys attended: [0, S)
        plan = step.plans.get(window)
        if plan is None:
            one_position = step.tokens == 1 and min(step.starts) == max(step.starts)
            prefill = step.bsz == 1 and step.starts[0] == 0 and (window is None or step.tokens <= window)
            plan = step.plans[window] = attention_plan(
                window, step.query_pos, min(step.starts), s_len, one_position, prefill
            )
        lo, mask, causal = plan
        if step.contiguous:
            first = step.slot_ids[0]
            keys = kc[first : first + step.bsz, :, lo:s_len]  # a view, no copy: [B, Hkv, S', hd]
            vals = vc[first : first + step.bsz, :, lo:s_len]
        else:
            keys = kc[:, :, lo:s_len].index_select(0, step.slots)  # copies only the attended keys
            vals = vc[:, :, lo:s_len].index_select(0, step.slots)
        o = sdpa(q, keys, vals, mask, causal, self.scaling, self.softcap)  # [B, Hq, T, hd]
        return o.transpose(1, 2).reshape(step.bsz * step.tokens, -1, q.shape[-1])


@register
class CpuKernelBackend(_SlotBackend):
    """specdist's C kernels (:mod:`specdist.models.kernels.cpu_kernels`): each query over its own slot's visible keys,
    read from the cache; where the rotary turns the whole head, rotary, cache write and attention are one call a
    layer (:func:`cpu_kernels.rope_attention`). Every row the same bits whatever the batch."""

    name = "cpu"

    @classmethod
    def unavailable(cls, device, dtype):
        if device.type != "cpu" or dtype != torch.float32:
            return "the C kernels attend in float32 on the CPU"
        if not cpu_kernels.available():
            return "specdist's C kernels are not built here"
        return None

    def forward(self, i, q, k, v, step: SlotStep) -> torch.Tensor:
        bsz, t, hd = step.bsz, step.tokens, q.shape[-1]
        cos, sin = self.rope_at(step, i)  # [B, T, rd]
        if cos.shape[-1] == hd:  # one call: rotary, write, attention
            o = cpu_kernels.rope_attention(
                q.reshape(bsz, t, -1, hd),
                k.reshape(bsz, t, -1, hd),
                v.reshape(bsz, t, -1, hd),
                cos,
                sin,
                self.cache.k[i],
                self.cache.v[i],
                step.slots,
                step.write_pos,
                step.query_pos,
                self.windows[i],
                self.scaling,
                self.softcap,
            )  # [B, T, Hq, hd]
            return o.reshape(bsz * t, -1, hd)
        q, k, v = self._heads(i, q, k, v, step)
        kc, vc = self._write(i, step, k, v)
        o = cpu_kernels.attention(q, kc, vc, step.slots, step.query_pos, self.windows[i], self.scaling, self.softcap)
        return o.transpose(1, 2).reshape(bsz * t, -1, hd)  # [B, Hq, T, hd] (a view of [B, T, Hq, hd]) -> rows


def attention_plan(window, query_pos, first_query, s_len, one_position, causal_prefill):
    """How one call attends under one window: ``(lo, mask, is_causal)``, keys ``[lo, s_len)``.

    ``query_pos`` [B, T] (on the device) holds each query's position, ``first_query`` the lowest.
    No mask where slicing or ``is_causal`` expresses the visible keys; else a [B, 1, T, S - lo]
    boolean mask: key j visible iff ``p - window < j <= p``.
    """
    lo = 0 if window is None else max(0, first_query - window + 1)  # no query sees a key before lo
    if one_position:
        return lo, None, False  # one query per request at position s_len - 1: it sees all of [lo, s_len)
    if causal_prefill:
        return 0, None, True
    j = torch.arange(lo, s_len, device=query_pos.device)  # [S']
    p = query_pos[:, :, None]  # [B, T, 1]
    visible = j <= p
    if window is not None:
        visible &= j > p - window
    return lo, visible[:, None], False  # [B, 1, T, S']


def sdpa(q, keys, vals, mask, causal, scale: float, softcap: float | None):  # [B, Hq, T, hd], [B, Hkv, S, hd] x2
    """Attention of q over keys / vals under ``mask`` [B, 1, T, S] or ``causal`` -> [B, Hq, T, hd]."""
    if softcap is not None:
        return softcap_attention(q, keys, vals, mask, causal, scale, softcap)
    return F.scaled_dot_product_attention(
        q, keys, vals, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
    )


def softcap_attention(q, k, v, mask, causal, scale, cap):  # [B, Hq, T, hd], [B, Hkv, S, hd] -> [B, Hq, T, hd]
    """Attention whose scores are soft-capped (Gemma 2), computed as transformers' eager
    attention does: scores scaled, capped by ``tanh(s / cap) * cap``, masked, softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / cap) * cap  # [B, Hq, T, S]
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()  # [T, S], T == S
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)


def apply_rope(q, k, cos, sin):  # [B, H, T, hd] x2, [B, T, rd] x2
    """Rotary embedding (half-rotation convention of the HF models); a table narrower than the
    head rotates its first ``rd`` dims and passes the rest (partial rotary)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, rd]
    rd = cos.shape[-1]
    if rd == q.shape[-1]:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    return (
        torch.cat((_rotate(q[..., :rd], cos, sin), q[..., rd:]), dim=-1),
        torch.cat((_rotate(k[..., :rd], cos, sin), k[..., rd:]), dim=-1),
    )


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
