"""Batched forward of a decoder-only HF model over a :class:`SlotKVCache`.

We keep the HF modules (so loading, GGUF de-quantisation, int8 replacement and
tensor-parallel sharding all act on the real ``nn.Module`` tree) and replace only
the outer loop: each request in the batch brings its own new tokens and its own
cache slot, tokens are written into the slot at the slot's current length, and
attention masks out everything past each request's own length. Ragged batches are
right-padded to ``[B, T]`` (padded positions write to the cache's scratch column), except
on the CPU attention kernels, where every token runs as a row of its own (``[N, 1]`` with
per-row slots, :meth:`CausalLMRunner._forward_rows`): a verification where one request
drafts 8 tokens and 15 draft none then computes 24 rows, not 144, and its logits too.

One loop serves every family of :mod:`specdist.models.families`. Where they differ is
read once in ``__init__``, from the config and the modules:

- q/k/v: three linears, one fused matmul (:mod:`specdist.models.fusion`, biases included),
  or Phi-3's own ``qkv_proj`` split in the config's q:kv head ratio.
- q/k norms over each head (Qwen3, Gemma 3) when the attention module has ``q_norm``.
- Gemma's sandwich norms (the layer has ``pre_feedforward_layernorm``): attention and MLP
  outputs are normed before their residual adds, the MLP input by the pre-feedforward norm.
- RMS norms: ``F.rms_norm`` for Llama-style modules, the module's own forward otherwise
  (Gemma's ``1 + w``). On the paged backends, where every norm is Llama-style and the layers pre-norm, a
  block's residual add is done by the next norm's call (:attr:`CausalLMRunner.add_norms`); on the Triton
  backend (CUDA) that call is one kernel, and so is SiLU(gate) * up of a fused gate/up projection
  (:mod:`specdist.models.kernels.triton_layer`): fewer kernels a layer where a decode step is bound by them.
- MLP: the fused gate/up matmul where fused, else the module's own forward (Phi-3's fused
  ``gate_up_proj``, a mixture-of-experts block with its router and 3D experts).
- The attention scale is the module's ``scaling`` (Gemma: ``query_pre_attn_scalar``); Gemma 2
  soft-caps attention scores and logits, Gemma 3 the logits (``tanh(x / cap) * cap``).
- Embeddings go through the model's own module (Gemma scales them by sqrt(hidden) there).
- RoPE: cos/sin for every position from the model's own rotary module, one table per layer
  type where the model has several (Gemma 3's local base on sliding layers).
- Sliding windows, per layer: key ``j`` is visible to the query at position ``p`` iff
  ``p - window < j <= p`` (transformers' ``sliding_window_overlay``). The cache keeps every
  position (a rollback stays a length change); the window is a mask, or a slice of the keys.

RoPE types whose frequencies transformers derives from the length of each call ("dynamic"
NTK scaling, "longrope") are computed per position: the query or key at position ``p`` is
rotated as transformers rotates it in a call whose last position is ``p``, i.e. in
token-by-token decoding with a cache. The logits at a position are then a function of the
tokens up to it alone, whatever the batch and however the sequence is cut into calls
(prefill, verification of k drafts, rollback), which exact speculative decoding needs. They
equal transformers' forward of the whole sequence while it fits in the original context
(dynamic: ``max_position_embeddings``; longrope: ``original_max_position_embeddings``); past
it, transformers' own results depend on how the sequence was cut into calls. Dynamic: equal
to its greedy ``generate`` whenever the prompt fits in the original context. Longrope (Phi-3):
its ``generate`` recomputes the whole sequence with the long factors once it passes the
original context, which a KV cache cannot follow; past that point the two differ.

Attention runs through ``F.scaled_dot_product_attention`` in forms that let PyTorch pick its
fused kernels: no mask when every request has one query at one common position (a window
then slices the keys), ``is_causal`` for a one-request prefill from position 0 that the window
does not cut, a boolean mask otherwise. Gemma 2's soft-capped scores take an explicit
attention (:func:`specdist.models.backends.slots.softcap_attention`): no fused kernel applies the cap. On an x86 CPU in
float32 the kernels of :mod:`specdist.models.kernels.cpu_kernels` attend instead (each row from the cache itself), and
in a family that declares its layers ``prenorm-swiglu`` (:class:`~specdist.models.families.Family`), a layer whose
matmuls all run on GGUF blocks is one call (:attr:`CausalLMRunner.layer_kernels`,
:func:`cpu_kernels.decoder_layer`): its norms, matmuls, attention, SiLU and residual adds without Python
between them (at batch 1 that Python is a large share of a forward). A layer of dense float32 weights is one
call too for calls of up to ``cpu_kernels.F32_MAX_ROWS`` tokens (:func:`cpu_kernels.f32_mm` reads the weights
once for all the rows, where torch's GEMM re-packs them at every call), and so is a float32 output head; larger
calls (prefills, large batches) take torch's GEMM op by op. Figures: docs/performance.md, "Figures moved from
docstrings".

Two passes share the decoder stack (:meth:`CausalLMRunner._layers`) and differ in how they
attend. The eager pass runs at the call's own shapes. The static pass (:meth:`CausalLMRunner.compile`,
``engine.compile``) pads a call to a bucket (batch, tokens per request, logits rows; keys to a
power of two from 64), gathers each row's slot and attends under one boolean mask per window,
so that ``torch.compile`` builds one graph per bucket (CUDA graphs on GPUs) in which only the key
length varies.

Works unchanged on tensor-parallel shards: local head counts are read off the
projections' output sizes, and the row-parallel ``o_proj`` / ``down_proj`` do
their own all-reduce.
"""

from __future__ import annotations

import copy
import itertools
import sys

import torch
import torch.nn.functional as F

from specdist.config import check_kv_cache_dtype
from specdist.errors import ConfigError
from specdist.models.backends import SlotStep, backend_class, choose_backend
from specdist.models.dtypes import HalfStoredEmbedding, HalfStoredLinear, store_half_width
from specdist.models.families import PRENORM_SWIGLU, SUPPORTED_MODEL_TYPES, Family, check_supported
from specdist.models.fusion import fuse_projections
from specdist.models.graphs import GRAPH_TOKENS, CudaGraphs, on_runner_device
from specdist.models.host_reads import HostReadError
from specdist.models.kernels import cpu_kernels
from specdist.models.kv.options import KVOptions
from specdist.models.kv.paged import PagedKVCache
from specdist.models.quant import BLOCK_KINDS, Int4GroupLinear, Int8WeightOnlyLinear, on_cpu_blocks, untie_lm_head

__all__ = ["CausalLMRunner", "SUPPORTED_MODEL_TYPES"]

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Static-shape buckets of the compiled pass: tokens per request, and keys from 64 by powers of two
# (capped at the cache length); the batch is padded to a power of two (capped at the slot count).
STATIC_TOKENS = (1, 2, 4, 8, 16)
STATIC_MIN_KEYS = 64
STATIC_GRAPHS = 512  # graphs one runner may compile (dynamo's recompile limit for it)


def _bucket(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


class CausalLMRunner:
    """Owns one model and its KV cache. Not thread-safe; one step at a time."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_len: int,
        fuse: bool = True,
        kv_cache_dtype: str = "auto",
        half_storage: bool = True,
        kv: KVOptions | None = None,
        attention_backend: str | None = None,
    ):
        family = check_supported(model.config, "model")
        cfg = model.config
        odd = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
        if odd or getattr(cfg, "use_bidirectional_attention", False):
            raise ConfigError(
                "model",
                f"{cfg.model_type}: only causal full / sliding-window attention is "
                f"supported, got {'layer types ' + ', '.join(odd) if odd else 'bidirectional'}",
            )
        self.model = model.eval()
        if fuse:  # one matmul for q/k/v and one for gate/up; HF forward keeps working
            fuse_projections(model)
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.max_len = max_len
        base = model.model
        self.layers = list(base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = hd = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        probe = torch.zeros(1, cfg.hidden_size, dtype=self.dtype, device=self.device)  # [1, D]
        n_kv_local, self.qkv_split = _local_kv_heads(attn, cfg, probe)
        # The family's switches.
        self.qk_norm = hasattr(attn, "q_norm")
        self.sandwich = hasattr(self.layers[0], "pre_feedforward_layernorm")
        self.attn_softcap = cfg.attn_logit_softcapping if family.attn_softcap else None
        self.final_softcap = cfg.final_logit_softcapping if family.final_softcap else None
        self.windows = [_window(family, cfg, layer.self_attn) for layer in self.layers]
        self.compiled = None  # the compiled _static_pass, once compile() ran
        # Layers whose input hidden states every forward keeps (an EAGLE-3 head reads them,
        # specdist.models.eagle3; the number of layers: the last one's output): () keeps none. ``last_hidden`` is the
        # latest forward's [B, T, len(hidden_layers) * D] in call order, rows right-padded like its tokens.
        self.hidden_layers: tuple[int, ...] = ()
        self.last_hidden: torch.Tensor | None = None
        # RoPE cos/sin for every position, computed once: [max_len + 1, rd] each (last row: scratch),
        # one table per layer type where the rotary module keeps several (Gemma 3).
        rotary = base.rotary_emb
        typed = isinstance(getattr(rotary, "rope_type", None), dict)
        self.rope_keys = [cfg.layer_types[i] if typed else None for i in range(len(self.layers))]
        with torch.inference_mode():
            self.rope_tables = {
                key: _rope_table(rotary, probe, max_len + 1, key) for key in dict.fromkeys(self.rope_keys)
            }
        # float32 on an x86 CPU: attention by cpu_kernels (rows independent of the batch); where RoPE turns the
        # whole head, rotary, cache write and attention are one call per layer (after per-head q/k norms, if any)
        kv = kv or KVOptions()
        backend = _backend_for(attention_backend or kv.backend, kv, self.device, self.dtype)
        paged = backend.kv_layout == "paged"
        self.cpu_attention = backend.name == "cpu"
        cache_dtype = kv_dtype(kv_cache_dtype, self.dtype, self.cpu_attention, on_cpu_blocks(model))
        num_blocks = None
        if paged:
            per_token = 2 * len(self.layers) * n_kv_local * hd * torch.empty(0, dtype=cache_dtype).element_size()
            tokens = kv.tokens(self.device, num_slots, max_len, per_token)
            num_blocks = PagedKVCache.blocks_for(tokens, kv.block_size) + 1
        self.cache = backend.make_cache(
            len(self.layers), num_slots, n_kv_local, hd, max_len, cache_dtype, self.device, num_blocks, kv.block_size
        )
        # the attention backend (specdist.models.backends): every pass's attention goes through it
        self.backend = backend(
            self.cache, self.scaling, self.windows, self.attn_softcap, [self.rope_tables[key] for key in self.rope_keys]
        )
        self.attention = self.backend if paged else None  # the paged backend, which CUDA graphs replay
        self.graphs: CudaGraphs | None = None  # captured passes of the paged backend (capture_graphs)
        self.cpu_rope_attention = self.cpu_attention and all(
            cos.shape[-1] == hd for cos, _ in self.rope_tables.values()
        )
        # where that holds and the family declares its layers the shape cpu_kernels.decoder_layer computes, a layer
        # whose matmuls all run on blocks (or dense float32) is one C call; None for a layer that runs op by op
        fused = family.layer_kernel == PRENORM_SWIGLU and self.cpu_rope_attention
        self.layer_kernels = [_layer_kernel(layer) if fused else None for layer in self.layers]
        # the paged backends, pre-norm layers of Llama-style norms or Gemma's sandwich of 1 + w norms: a block's
        # residual add waits for the next norm and both run as one call (_add_norm); on the Triton kernels (CUDA)
        # that call is one kernel, and so is SiLU(gate) * up where gate and up are one matmul (_gate_up_linear):
        # docs/performance.md, GPU
        norms = [n for layer in self.layers for n in _layer_norms(layer, self.sandwich)]
        gemma = self.sandwich and all(type(n).__name__ in _GEMMA_NORMS and hasattr(n, "eps") for n in norms)
        self.add_norms = paged and (gemma or (not self.sandwich and all(_llama_norm(n) for n in norms)))
        self.norm_offset = 1.0 if gemma else 0.0  # the norms' weights: 1 + w (Gemma) or w
        self.layer_triton = self.add_norms and getattr(self.backend, "use_triton", False)
        self.silu_gate_up = [_gate_up_linear(layer.mlp) if self.layer_triton else None for layer in self.layers]
        if half_storage:
            self._store_half_width()

    def _store_half_width(self) -> None:
        """Hold the float32 weights of the dense layer kernels and of the output head in bfloat16 or float16
        where that dtype holds them exactly (a bf16 or fp16 checkpoint loaded in float32): the kernels read
        half the bytes and compute the same bits (:class:`~specdist.models.dtypes.HalfStoredLinear`); calls
        past the kernels' rows convert them back for torch's GEMM, as the float32 weights would run. An input
        embedding tied to the head reads its rows from the head's half-width table."""
        for i, (layer, kernel) in enumerate(zip(self.layers, self.layer_kernels)):
            if kernel is None or not kernel.dense:
                continue
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "fused_qkv"):
                qkv = [store_half_width(attn.fused_qkv, "inner", attn, ("q_proj", "k_proj", "v_proj"))]
            else:  # Phi-3's own qkv_proj, or three
                qkv = [
                    store_half_width(attn, n)
                    for n in (("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj"))
                ]
            gate_up = (
                store_half_width(mlp.fused_gate_up, "inner", mlp, ("gate_proj", "up_proj"))
                if hasattr(mlp, "fused_gate_up")
                else store_half_width(mlp, "gate_up_proj")
            )
            stored = qkv + [store_half_width(attn, "o_proj"), gate_up, store_half_width(mlp, "down_proj")]
            if any(stored):
                self.layer_kernels[i] = _layer_kernel(layer)
        head, embed = getattr(self.model, "lm_head", None), self.model.model.embed_tokens
        if self.cpu_attention and type(head) is torch.nn.Linear:
            tied = type(embed) is torch.nn.Embedding and head.weight is embed.weight
            if store_half_width(self.model, "lm_head"):
                untie_lm_head(self.model)
                if tied:  # the embedding looks its rows up in the head's half-width table: still one copy
                    self.model.model.embed_tokens = HalfStoredEmbedding(embed, self.model.lm_head.weight)

    def head_rows(self, hs: torch.Tensor) -> torch.Tensor:  # [N, n, D] -> [N, n, V] float32
        """The final norm and output head (and logit soft-cap) of hidden states."""
        return self._head(hs)

    def capture_graphs(
        self, max_batch_size: int | None = None, max_tokens: int = 1, log=None, eager_replay: bool = False
    ) -> float:
        """Capture CUDA graphs of the paged forward (:mod:`specdist.models.graphs`) for every batch bucket (powers
        of two up to ``max_batch_size``, default the slot count, and that count itself) times every token bucket
        up to the one holding ``max_tokens``; returns the seconds taken. Forwards outside every bucket (long
        prefills) run eagerly. ``eager_replay``: the buckets without graphs, on any device (the CPU tests). Where
        the pass reads the device on the host (:mod:`specdist.models.host_reads`), one line on stderr says so and
        this runner runs uncaptured."""
        if self.attention is None or (self.device.type != "cuda" and not eager_replay):
            raise ConfigError("engine.cuda_graphs", "CUDA graphs need a paged KV cache on a CUDA device")
        top = min(max_batch_size or self.cache.num_slots, self.cache.num_slots)
        batches = sorted({min(1 << i, top) for i in range(top.bit_length() + 1)})
        tokens = [t for t in GRAPH_TOKENS if t == 1 or t // 2 < max_tokens]
        graphs = CudaGraphs(self, eager_replay)
        self.graphs = None
        try:
            seconds = graphs.capture(batches, tokens, log)
        except HostReadError as e:
            print(
                f"cuda graphs: off for this {self.config.model_type} runner, its pass reads the device on the host: "
                f"{e}",
                file=sys.stderr,
                flush=True,
            )
            return 0.0
        self.graphs = graphs
        return seconds

    def compile(self, backend: str = "inductor") -> None:
        """Route calls of up to ``STATIC_TOKENS[-1]`` tokens per request through
        ``torch.compile`` of :meth:`_static_pass`: inductor on CPU, CUDA graphs on GPU
        (``reduce-overhead``; the cache tensors are marked static so the graphs write them in
        place). Each bucket compiles at its first call (:meth:`warm_up` does it ahead); the
        compiled code is cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``). ``backend``: the
        ``torch.compile`` backend (another one traces the same graphs without generating code)."""
        if self.attention is not None:
            raise ConfigError(
                "engine.compile",
                "the compiled static pass reads a slot cache; this runner's is paged "
                "(engine.kv_cache: slots, or cuda_graphs on GPUs)",
            )
        import torch._dynamo  # loaded only by processes that compile (its import takes seconds)

        cpu_kernels.available()  # known before tracing: traced code then reads it as a constant
        cuda = self.device.type == "cuda"
        if cuda:
            for t in self.cache.k + self.cache.v:
                torch._dynamo.mark_static_address(t)  # noqa: SLF001 - torch's compiler API lives in torch._dynamo
        # every bucket is one more graph of the one function: allow them all
        dyn = torch._dynamo.config  # noqa: SLF001 - the recompile limits exist only in torch._dynamo.config
        dyn.recompile_limit = max(dyn.recompile_limit, STATIC_GRAPHS)
        dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 4 * STATIC_GRAPHS)
        mode = "reduce-overhead" if cuda and backend == "inductor" else None
        self.compiled = torch.compile(self._static_pass, backend=backend, mode=mode)

    def warm_up(self, shapes: list[tuple[int, int, int]]) -> None:
        """Run one call of each ``(batch, tokens per request, logits per request)`` on free slots
        (released afterwards), so that the buckets a step needs first are compiled before serving."""
        cache = self.cache
        for bsz, n, n_logits in shapes:
            slots = [cache.allocate() for _ in range(min(bsz, cache.num_free))]
            try:
                if slots:
                    self.forward(slots, [[0] * n] * len(slots), [n_logits] * len(slots))
            finally:
                for s in slots:
                    cache.free(s)

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        tokens: list[list[int]],
        num_logits: list[int],
        packed: bool = False,
        extra=None,
    ) -> torch.Tensor:  # [B, max(num_logits), V] (packed: [sum(num_logits), V]) float32 logits, on the model's device
        """Append ``tokens[b]`` to ``slots[b]`` and return logits for the last ``num_logits[b]`` of them.

        Row ``b`` of the result holds its logits left-aligned; rows with fewer than the
        maximum are zero-padded on the right. ``packed``: request b's rows one after another
        instead, no padding (a ragged verification reads no zeros). Calls of at most
        ``STATIC_TOKENS[-1]`` tokens per request go through the compiled static-shape pass once
        :meth:`compile` was called.

        ``extra``: int32 words ([W] numpy) the caller needs on the device after the forward (its sampling inputs,
        :class:`specdist.cores.device_inputs.HostInputs`); they travel in the forward's own host-to-device copy,
        starting on an even word, and are :attr:`last_extra` [W] int32 after it.
        """
        cache = self.cache
        n_new = [len(t) for t in tokens]
        starts = [cache.lengths[s] for s in slots]
        for s, st, n in zip(slots, starts, n_new):
            if st + n > cache.max_len:
                raise ValueError(f"slot {s}: {st} + {n} tokens exceed the cache length {cache.max_len}")
        self.last_hidden = self.last_extra = None
        if self.attention is not None:
            logits = self._forward_paged(slots, tokens, starts, num_logits, packed, extra)
        elif self.compiled is not None and max(n_new) <= STATIC_TOKENS[-1] and max(num_logits) > 0:
            logits = self._forward_static(slots, tokens, starts, num_logits)
            logits = _packed(logits, num_logits) if packed else logits
        else:
            logits = self._forward_eager(slots, tokens, starts, num_logits, packed)
        if extra is not None and self.last_extra is None:  # the slot cache's passes make copies of their own
            self.last_extra = torch.from_numpy(extra).to(self.device)
        for s, st, n in zip(slots, starts, n_new):
            cache.lengths[s] = st + n
        return logits  # stays on the device: sampling and verification run there

    @on_runner_device
    def _forward_paged(self, slots, tokens, starts, num_logits, packed, extra):
        """The paged backend's forward: the blocks each request writes taken first (copy on write where
        shared), the step's one host-to-device copy, then a captured CUDA graph of the bucket when there
        is one (:mod:`specdist.models.graphs`), else the pass at the call's own shapes; on the runner's device (the
        current CUDA device for the Triton kernels, :func:`~specdist.models.graphs.device_guard`)."""
        if self.graphs is not None and max(num_logits) > 0:
            for s, st, t in zip(slots, starts, tokens):
                self.cache.ensure(s, st + len(t))
            out = self.graphs.run(slots, tokens, starts, num_logits, extra)
            if out is not None:
                logits, self.last_hidden, self.last_extra = out
                return logits if packed else self._left_aligned_rows(logits, num_logits)
        bsz, t_max = len(slots), max(len(t) for t in tokens)
        step = self.backend.plan(slots, tokens, starts, num_logits, bsz, t_max, extra)
        self.last_extra = step.extra
        h, self.last_hidden = self.paged_layers(step)  # [B, T, D]
        n_rows = sum(num_logits)
        if n_rows == 0:  # a prefill: no logits, in the layout asked for
            return torch.zeros(0 if packed else bsz, *(() if packed else (0,)), self.vocab_size, device=self.device)
        rows = h.reshape(bsz * t_max, 1, -1).index_select(0, step.logits_rows[:n_rows].long())  # [M, 1, D]
        logits = self._head(rows)[:, 0]  # [M, V]
        return logits if packed else self._left_aligned_rows(logits, num_logits, step.logits_dst[:n_rows])

    def paged_layers(self, step):  # -> ([B, T, D], [B, T, nD] or None)
        """The decoder stack over a :class:`~specdist.models.backends.paged.PagedStep` (the paged backend's forward
        per layer): device work only, what a captured graph replays."""
        return self._layers(step)

    def _left_aligned_rows(
        self, logits: torch.Tensor, num_logits: list[int], dst: torch.Tensor | None = None
    ) -> torch.Tensor:  # [M, V] -> [B, n_out, V]
        """Packed logits rows (request b's ``num_logits[b]`` rows one after another) in the left-aligned,
        zero-padded layout; ``dst``: each row's place in ``[B * n_out]`` when the device has it already."""
        bsz, n_out = len(num_logits), max(num_logits)
        if min(num_logits) == n_out:
            return logits.view(bsz, n_out, -1)
        if dst is None:
            dst = torch.tensor(
                [b * n_out + j for b, m in enumerate(num_logits) for j in range(m)], device=logits.device
            )
        out = logits.new_zeros(bsz * n_out, logits.shape[-1])
        return out.index_copy_(0, dst.long(), logits).view(bsz, n_out, -1)

    def _forward_eager(self, slots, tokens, starts, num_logits, packed=False):
        """The forward at the call's own shapes: keys sliced to the longest sequence, attention in
        the cheapest form SDPA accepts (no mask, ``is_causal``, or a mask)."""
        bsz, n_new = len(slots), [len(t) for t in tokens]
        t_max = max(n_new)
        if self.cpu_attention and sum(n_new) < bsz * t_max:
            return self._forward_rows(slots, tokens, starts, num_logits, packed)
        step = self.backend.plan(slots, tokens, starts, num_logits, bsz, t_max)
        h, self.last_hidden = self._layers(step)  # [B, T, D], [B, T, nD] or None
        logits = self._logits(h, n_new, num_logits)
        return _packed(logits, num_logits) if packed else logits

    def _forward_rows(self, slots, tokens, starts, num_logits, packed=False):
        """A ragged batch on the CPU attention kernels: every token is a row of its own ([N, 1], N the
        call's tokens, each with its request's slot), so no matmul and no attention computes padding.
        The kernels write every row's keys before any row attends, so a request's later tokens see its
        earlier ones as in the [B, T] layout, and each output row is the same bits (row-wise kernels)."""
        dev = self.device
        bsz, n_new = len(slots), [len(t) for t in tokens]
        offs = list(itertools.accumulate(n_new, initial=0))  # request b's rows: offs[b] .. offs[b + 1] - 1
        row_slots = [s for s, n in zip(slots, n_new) for _ in range(n)]
        step = self.backend.plan(
            row_slots,
            [[t] for ts in tokens for t in ts],
            [st + j for st, n in zip(starts, n_new) for j in range(n)],
            [0] * offs[-1],
            offs[-1],
            1,
        )
        h, hidden = self._layers(step)  # [N, 1, D], [N, 1, nD] or None
        t_max = max(n_new)
        pad = torch.tensor([b * t_max + j for b, n in enumerate(n_new) for j in range(n)], device=dev)  # [N]
        if hidden is not None:  # [B, T, nD] as the padded layout gives it (zeros past each request's tokens)
            self.last_hidden = (
                hidden.new_zeros(bsz * t_max, hidden.shape[-1]).index_copy_(0, pad, hidden[:, 0]).view(bsz, t_max, -1)
            )
        n_out = max(num_logits)
        if n_out == 0:  # a prefill: no logits, in the layout asked for
            return torch.zeros(0 if packed else bsz, *(() if packed else (0,)), self.vocab_size, device=dev)
        want = [offs[b + 1] - m + j for b, m in enumerate(num_logits) for j in range(m)]  # rows with logits [M]
        logits = self._head(h[:, 0].index_select(0, torch.tensor(want, device=dev))[None])[0]  # [M, V]
        if packed:
            return logits
        if len(want) == bsz * n_out:
            return logits.view(bsz, n_out, -1)
        dst = torch.tensor([b * n_out + j for b, m in enumerate(num_logits) for j in range(m)], device=dev)
        return logits.new_zeros(bsz * n_out, logits.shape[-1]).index_copy_(0, dst, logits).view(bsz, n_out, -1)

    def _forward_static(self, slots, tokens, starts, num_logits):
        """The forward padded to a bucket (batch, tokens, keys, logits) and run by the compiled
        :meth:`_static_pass`; each bucket is one static-shape graph, compiled at first use."""
        cache, dev = self.cache, self.device
        bsz, n_new = len(slots), [len(t) for t in tokens]
        b_pad = min(_bucket(bsz), max(bsz, cache.num_slots))
        t_pad = next(t for t in STATIC_TOKENS if t >= max(n_new))
        s_len = max(st + n for st, n in zip(starts, n_new))
        s_pad = min(max(STATIC_MIN_KEYS, _bucket(s_len)), cache.max_len)  # never the scratch column
        # Padded rows are empty requests on the first slot: every token writes the scratch column.
        step = self.backend.plan(slots, tokens, starts, num_logits, b_pad, t_pad)
        j = torch.arange(s_pad, device=dev)  # [S]
        p = step.query_pos[:, :, None]  # [B, T, 1]
        masks = []
        for window in self.backend.mask_windows:  # key j visible to a query at p iff p - window < j <= p
            visible = j <= p
            if window is not None:
                visible &= j > p - window
            masks.append(visible[:, None])  # [B, 1, T, S]
        n_out = max(num_logits)
        n_pad = next(t for t in STATIC_TOKENS if t >= n_out)  # logits rows come in buckets too (extra ones dropped)
        n_t = torch.tensor(n_new + [1] * (b_pad - bsz))
        offs = torch.tensor(list(num_logits) + [1] * (b_pad - bsz))
        out_idx = ((n_t - offs)[:, None] + torch.arange(n_pad)[None, :]).clamp(min=0, max=t_pad - 1)  # [B, n_pad]
        if self.cpu_attention:  # the kernel reads each query's keys itself: no masks, no key length
            masks = []
        args = (step.ids, step.write_pos, step.query_pos, step.slots, tuple(masks), out_idx.to(dev))
        # One graph per (batch, tokens, logits rows) bucket, each serving every key length (CUDA graphs:
        # recorded per keys bucket): the key length is dynamic, the rest static (not made dynamic when
        # a second bucket shows up, which measured slower than a graph of its own).
        ids_d, write_d, qpos_d, slot_d, masks_d, out_d = args
        for t, dims in [(ids_d, (0, 1)), (write_d, (0, 1)), (qpos_d, (0, 1)), (slot_d, (0,)), (out_d, (0, 1))] + [
            (m, (0, 2)) for m in masks_d
        ]:
            for d in dims:
                torch._dynamo.mark_static(t, d)  # noqa: SLF001 - torch's compiler API lives in torch._dynamo
        for m in masks_d:
            torch._dynamo.mark_dynamic(m, 3)  # noqa: SLF001 - as above; [B, 1, T, S]: S
        logits, hidden = self.compiled(*args)
        logits = logits[:bsz, :n_out]
        if hidden is not None:
            self.last_hidden = hidden[:bsz, : max(n_new)]
        if dev.type == "cuda":  # a CUDA graph's output buffer is overwritten by its next replay
            logits = logits.clone()
            self.last_hidden = self.last_hidden.clone() if hidden is not None else None
        return _left_aligned(logits, num_logits)

    def _static_pass(self, ids, write_pos, query_pos, slot_t, masks, out_idx):
        """Pure tensor work at fixed shapes (what :meth:`compile` compiles): ``ids`` [B, T],
        ``write_pos`` and ``query_pos`` [B, T], ``slot_t`` [B], ``masks`` one [B, 1, T, S] per distinct
        window (none where :func:`cpu_kernels.attention` attends), ``out_idx`` [B, n] -> logits [B, n, V] float32."""
        step = SlotStep(ids.shape[0], ids.shape[1], ids, slot_t, write_pos, query_pos, masks=masks)
        h, hidden = self._layers(step)
        return self._head(h.gather(1, out_idx[..., None].expand(-1, -1, h.shape[-1]))), hidden

    def _layers(self, step):  # -> ([B, T, D], [B, T, nD] or None)
        """The decoder stack over one step's metadata (the backend's ``plan``, ``step.ids`` [B, T]): the last
        layer's output and the inputs of :attr:`hidden_layers` (concatenated in that order; None when there
        are none). Each layer's attention is the backend's ``forward`` over the step's B * T rows; a layer with a
        :attr:`layer_kernels` entry (the CPU backend) is one C call instead."""
        ids = step.ids
        bsz, t_max = ids.shape
        h = self.model.model.embed_tokens(ids)  # [B, T, D]
        hd = self.head_dim
        taps = {}  # layer index -> its input [B, T, D]
        kernels = self.layer_kernels if not torch.compiler.is_compiling() else [None] * len(self.layers)
        if bsz * t_max > cpu_kernels.F32_MAX_ROWS:  # float32 layers: torch's GEMM is the faster one from there
            kernels = [None if w is not None and w.dense else w for w in kernels]
        scratch = None  # the layer kernels' activations, shared by the layers of this call
        # add_norms: the previous layer's MLP output, added to h by this layer's first norm (normed first by
        # pending_norm, Gemma's post-feedforward norm)
        pending = pending_norm = None
        for i, layer in enumerate(self.layers):
            x = None  # the layer's normed input, where its residual add computed it
            if self.add_norms:
                h, x = self._add_norm(layer.input_layernorm, h, pending, pending_norm)
            if i in self.hidden_layers:
                taps[i] = h if kernels[i] is None else h.clone()  # the layer kernel updates h in place
            attn = layer.self_attn
            if kernels[i] is not None:
                if scratch is None:
                    h = h.contiguous()
                    scratch = torch.empty(max(w.scratch(bsz * t_max) for w in kernels if w is not None))
                cos, sin = self.backend.rope_at(step, i)  # [B, T, hd]
                h = cpu_kernels.decoder_layer(
                    h,
                    kernels[i],
                    cos,
                    sin,
                    self.cache.k[i],
                    self.cache.v[i],
                    step.slots,
                    step.write_pos,
                    step.query_pos,
                    self.windows[i],
                    self.scaling,
                    self.attn_softcap,
                    scratch,
                )
                continue
            if x is None:
                x = _rms_norm(layer.input_layernorm, h)
            q, k, v = _qkv(attn, x, self.qkv_split)
            q = q.reshape(bsz, t_max, -1, hd)  # [B, T, Hq, hd]
            k = k.reshape(bsz, t_max, -1, hd)  # [B, T, Hkv, hd]
            if self.qk_norm:  # per-head RMS norm before RoPE (Qwen3, Gemma 3)
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            o = self.backend.forward(
                i, q.reshape(bsz * t_max, -1, hd), k.reshape(bsz * t_max, -1, hd), v.reshape(bsz * t_max, -1, hd), step
            )  # [B * T, Hq, hd]
            a = attn.o_proj(o.reshape(bsz, t_max, -1))  # [B, T, D]
            if self.add_norms and self.sandwich:  # Gemma: the attention output normed, added, the MLP input normed
                h, x = self._add_norm(layer.pre_feedforward_layernorm, h, a, layer.post_attention_layernorm)
                pending, pending_norm = self._layer_mlp(i, x), layer.post_feedforward_layernorm
            elif self.add_norms:
                h, x = self._add_norm(layer.post_attention_layernorm, h, a)
                pending = self._layer_mlp(i, x)
            else:
                h = self._residual(layer, h, a)
        if pending is not None:
            h = h + (pending if pending_norm is None else _rms_norm(pending_norm, pending))
        if len(self.layers) in self.hidden_layers:  # past the last layer: its output before the final norm
            taps[len(self.layers)] = h
        return h, torch.cat([taps[i] for i in self.hidden_layers], -1) if taps else None

    def _add_norm(self, norm, h, delta, delta_norm=None):  # [B, T, D], [B, T, D] or None -> ([B, T, D], [B, T, D])
        """``(s, norm(s))`` of ``s = h + delta`` (``delta_norm``: ``h + delta_norm(delta)``; ``delta`` None:
        ``s = h``): one Triton kernel on the Triton backend (:func:`specdist.models.kernels.triton_layer.
        add_rms_norm`), torch's add and norms elsewhere."""
        if self.layer_triton:
            from specdist.models.kernels.triton_layer import add_rms_norm

            dn = None if delta_norm is None else (delta_norm.weight, _norm_eps(delta_norm))
            return add_rms_norm(h, delta, norm.weight, _norm_eps(norm), dn, self.norm_offset)
        if delta is not None:
            h = h + (delta if delta_norm is None else _rms_norm(delta_norm, delta))
        return h, _rms_norm(norm, h)

    def _layer_mlp(self, i, x):  # [B, T, D] -> [B, T, D]
        """Layer i's MLP; where its gate and up are one matmul followed by SiLU (:attr:`silu_gate_up`), SiLU(gate)
        * up is one Triton kernel (:func:`specdist.models.kernels.triton_layer.silu_mul`)."""
        mlp, gate_up = self.layers[i].mlp, self.silu_gate_up[i]
        if gate_up is None:
            return _mlp(mlp, x)
        from specdist.models.kernels.triton_layer import silu_mul

        return mlp.down_proj(silu_mul(gate_up(x)))

    def _residual(self, layer, h, a):  # [B, T, D] x2 -> [B, T, D]
        """The rest of a decoder layer after its attention output ``a``: residual adds and the MLP."""
        if self.sandwich:  # Gemma: each block's output is normed before its residual add
            h = h + _rms_norm(layer.post_attention_layernorm, a)
            m = _mlp(layer.mlp, _rms_norm(layer.pre_feedforward_layernorm, h))
            return h + _rms_norm(layer.post_feedforward_layernorm, m)
        h = h + a
        return h + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, h))

    def _logits(self, h, n_new, num_logits):
        """Logits of the last ``num_logits[b]`` valid tokens of each row, left-aligned, zero-padded."""
        bsz, t_max, dev = h.shape[0], h.shape[1], h.device
        n_out = max(num_logits)
        if n_out == 0:
            return torch.zeros(bsz, 0, self.vocab_size, device=dev)
        offs = torch.tensor(num_logits, dtype=torch.long)
        idx = (torch.tensor(n_new) - offs)[:, None] + torch.arange(n_out)[None, :]  # [B, n_out]
        idx = idx.clamp(min=0, max=t_max - 1)
        logits = self._head(h.gather(1, idx.to(dev)[..., None].expand(-1, -1, h.shape[-1])))  # [B, n_out, V]
        return _left_aligned(logits, num_logits)

    def _head(self, hs):  # [B, n, D] -> [B, n, V] float32
        logits = _lm_head(self.model.lm_head, _rms_norm(self.model.model.norm, hs)).float()
        return _softcap(logits, self.final_softcap)  # Gemma: tanh soft-cap of the logits


def _backend_for(name: str, kv: KVOptions, device: torch.device, dtype: torch.dtype):
    """The attention backend class of ``engine.attention_backend`` (auto: by ``engine.kv_cache``, the device and
    the dtype) for a runner on ``device`` in ``dtype``; a named one must run there and read the cache asked for."""
    if name in (None, "auto"):
        return choose_backend(kv.kind, device, dtype)
    backend = backend_class(name)
    why = backend.unavailable(device, dtype)
    if why is None and kv.kind not in ("auto", backend.kv_layout):
        why = f"it reads a {backend.kv_layout} cache, engine.kv_cache is {kv.kind}"
    if why is not None:
        raise ConfigError("engine.attention_backend", f"{name}: {why}")
    return backend


@torch.inference_mode()
def _local_kv_heads(attn, cfg, probe: torch.Tensor) -> tuple[int, list[int] | None]:
    """The rank's (possibly sharded) key/value head count, read off the projections by running them on
    ``probe`` [1, D], and the q, k, v widths of a fused ``qkv_proj`` (Phi-3: the rank's rows in the
    config's q:kv ratio; None without one)."""
    hd = int(attn.head_dim)
    if hasattr(attn, "qkv_proj"):
        n_local = attn.qkv_proj(probe).shape[-1] // hd
        n_q, n_kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        n_kv_local = n_local * n_kv // (n_q + 2 * n_kv)
        return n_kv_local, [(n_local - 2 * n_kv_local) * hd, n_kv_local * hd, n_kv_local * hd]
    return attn.k_proj(probe).shape[-1] // hd, None


def _packed(logits: torch.Tensor, num_logits: list[int]) -> torch.Tensor:  # [B, n, V] -> [sum(num_logits), V]
    """Left-aligned rows (:func:`_left_aligned`) without their padding: request b's rows one after another."""
    bsz, n, vocab = logits.shape
    if min(num_logits) == n:
        return logits.reshape(bsz * n, vocab)
    keep = torch.tensor([b * n + j for b, m in enumerate(num_logits) for j in range(m)], device=logits.device)
    return logits.reshape(bsz * n, vocab).index_select(0, keep)


def _left_aligned(logits: torch.Tensor, num_logits: list[int]) -> torch.Tensor:  # [B, n, V], zero past num_logits[b]
    if min(num_logits) == logits.shape[1]:
        return logits
    keep = torch.arange(logits.shape[1])[None, :] < torch.tensor(num_logits)[:, None]  # [B, n]
    return logits * keep.to(logits.device)[..., None]


def compile_runner(runner: CausalLMRunner, role: str, k: int, cache_dir: str | None) -> float:
    """Compile ``runner`` (:meth:`CausalLMRunner.compile`) and warm the buckets a batch-1 step
    uses first; returns the seconds it took. ``role``: "target" verifies ``k + 1`` tokens
    (logits for each), a "draft" runner decodes one token, or two when it catches up after a
    fully accepted step (logits for the last)."""
    import time

    t0 = time.perf_counter()
    use_compile_cache(cache_dir)
    runner.compile()
    if role == "target":
        shapes = [(1, t, t) for t in STATIC_TOKENS if t == 1 or t // 2 < k + 1]
    else:
        shapes = [(1, 1, 1), (1, 2, 1)]
    runner.warm_up(shapes)
    return time.perf_counter() - t0


def capture_graphs(target: CausalLMRunner, draft: CausalLMRunner | None, k: int, log=None) -> float:
    """CUDA graphs of a target verifying up to ``k`` drafts (``k + 1`` tokens a request) and of its draft runner
    (one token a pass, two when it catches up), every batch bucket; returns the seconds taken."""
    seconds = target.capture_graphs(max_tokens=k + 1, log=log)
    if draft is not None and draft.attention is not None:
        seconds += draft.capture_graphs(max_tokens=2, log=log)
    return seconds


def use_compile_cache(path: str | None) -> str:
    """Point inductor's on-disk cache at ``path`` (None: ``~/.cache/specdist/inductor``) unless
    ``TORCHINDUCTOR_CACHE_DIR`` is already set; returns the directory in use. A later start
    loads the compiled code of a bucket from there instead of compiling it again."""
    import os

    default = path or os.path.join(os.path.expanduser("~"), ".cache", "specdist", "inductor")
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default)


def kv_dtype(choice: str, model_dtype: torch.dtype, cpu_attention: bool, blocks: bool = False) -> torch.dtype:
    """The KV cache's dtype for ``engine.kv_cache_dtype``: ``model``: the model's own; ``float16``: half
    the bytes, read by the CPU attention kernels (their rows convert each element exactly); ``auto``:
    float16 where those kernels run attention for a model on quantized blocks (``blocks``: a GGUF target's
    own, a self draft's), whose numerics are llama.cpp's already (with many requests or long contexts
    attention reads the cache from memory, and half the bytes read are faster: docs/performance.md); the
    model's own elsewhere, so a float model keeps transformers' numerics. ConfigError for float16 where
    the kernels do not run (torch's attention would need a converted copy)."""
    check_kv_cache_dtype(choice)
    if choice == "model" or (choice == "auto" and not (cpu_attention and blocks)):
        return model_dtype
    if not cpu_attention:
        raise ConfigError(
            "engine.kv_cache_dtype",
            "float16 is read by the CPU attention kernels only (a float32 "
            f"model on an x86 CPU with AVX2); this model runs {model_dtype} "
            "attention in torch: use auto or model",
        )
    return torch.float16


def _lm_head(head: torch.nn.Module, hs: torch.Tensor) -> torch.Tensor:  # [B, n, D] -> [B, n, V]
    """The output projection. A float32 head on the CPU runs :func:`cpu_kernels.f32_mm` up to
    ``F32_MAX_ROWS`` rows (the weights read once for all the rows). Past that, torch's GEMM takes a slow
    row-by-row path when the row count is 2 or 3 mod 4, so zero rows pad M to the next multiple of 4 (results
    sliced off). Figures: docs/performance.md, "Figures moved from docstrings"."""
    bsz, n, dim = hs.shape
    m = bsz * n
    if hs.device.type != "cpu" or type(head) not in (torch.nn.Linear, HalfStoredLinear):
        return head(hs)
    dense = type(head) is HalfStoredLinear or head.weight.dtype == torch.float32
    if (
        m <= cpu_kernels.F32_MAX_ROWS
        and head.bias is None
        and dense
        and hs.dtype == torch.float32
        and cpu_kernels.available()
        and not torch.compiler.is_compiling()
    ):
        return cpu_kernels.f32_mm(hs.reshape(m, dim), head.weight.detach()).reshape(bsz, n, -1)
    if m % 4 < 2:
        return head(hs)
    flat = torch.cat([hs.reshape(m, dim), hs.new_zeros(4 - m % 4, dim)])  # [M', D]
    return head(flat)[:m].reshape(bsz, n, -1)


def _window(family: Family, config, attn) -> int | None:
    """A layer's sliding window as transformers applies it (None: full attention)."""
    if family.window == "config":
        window = getattr(config, "sliding_window", None)
    elif family.window == "layer":
        window = getattr(attn, "sliding_window", None)
    else:
        window = None
    return int(window) if window else None


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def _rope_table(rotary, probe, n: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rd] of positions 0..n-1 from the model's own rotary module.

    Length-dependent types (see the module docstring) give position ``p`` what transformers
    computes in a call whose last position is ``p``: the original frequencies up to the original
    context; past it, "longrope" its long factors and "dynamic" one NTK base per length.
    """
    rope_type = rotary.rope_type if layer_type is None else rotary.rope_type[layer_type]
    length_dependent = "dynamic" in rope_type or rope_type == "longrope"
    module = copy.deepcopy(rotary) if length_dependent else rotary  # those forwards update their module
    extra = () if layer_type is None else (layer_type,)

    def call(first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:  # positions [first, stop), one call
        cos, sin = module(probe[None], torch.arange(first, stop, device=probe.device)[None], *extra)
        return cos[0], sin[0]

    if not length_dependent:
        return call(0, n)
    if rope_type == "longrope":
        params = module.config.rope_parameters
        short = int((params if layer_type is None else params[layer_type])["original_max_position_embeddings"])
        parts = [call(0, min(short, n))] + ([call(short, n)] if n > short else [])
    else:
        short = int(module.original_max_seq_len)
        call(0, 1)  # a short call resets frequencies that an earlier long call grew
        parts = [call(0, min(short, n))] + [call(p, p + 1) for p in range(short, n)]
    return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])


# RMS norms computing weight * normalize(x) (transformers' LlamaRMSNorm and its copies)
_LLAMA_STYLE_NORMS = frozenset(
    ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm")
)


def _block_linear(
    linear: torch.nn.Module,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int, torch.Tensor | None] | None:
    """``(codes, scales, rows, kind, bias)`` of a linear that :func:`cpu_kernels.decoder_layer` runs (GGUF blocks,
    or a dense float32 weight on the CPU, held in float32 or a half-width dtype; a float32 bias or none), else
    None."""
    bias = getattr(linear, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_cpu):
        return None
    bias = bias.detach() if bias is not None else None
    if type(linear) is Int4GroupLinear and linear.blocks in BLOCK_KINDS:
        return linear.packed, linear.scales_and_zeros, linear.out_features, BLOCK_KINDS[linear.blocks], bias
    if type(linear) is Int8WeightOnlyLinear and linear.block_codes is not None:
        return linear.block_codes, linear.block_scales, linear.out_features, cpu_kernels.LIN_Q8, bias
    w = getattr(linear, "weight", None)
    if type(linear) is torch.nn.Linear and w.dtype == torch.float32 and w.is_cpu and w.is_contiguous():
        return w.detach(), None, linear.out_features, cpu_kernels.LIN_F32, bias
    if type(linear) is HalfStoredLinear:
        return w.detach(), None, linear.out_features, _HALF_KINDS[w.dtype], bias
    return None


_HALF_KINDS = {torch.bfloat16: cpu_kernels.LIN_BF16, torch.float16: cpu_kernels.LIN_F16}


def _layer_kernel(layer: torch.nn.Module) -> cpu_kernels.LayerWeights | None:
    """The weights :func:`cpu_kernels.decoder_layer` reads for a Llama-style decoder layer (Llama-style RMS
    norms, per-head q/k norms of that style or none, q/k/v fused or not, fused gate/up projections, SiLU, every matmul
    on blocks or dense, float32 biases or none), else None."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, getattr(layer, "post_attention_layernorm", None))
    qk = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else ()
    if any(type(n).__name__ not in _LLAMA_STYLE_NORMS or n.weight.dtype != torch.float32 for n in norms + qk):
        return None
    if norms[0].variance_epsilon != norms[1].variance_epsilon or (
        qk and qk[0].variance_epsilon != qk[1].variance_epsilon
    ):
        return None
    # q/k/v as one matmul (fused at load, or Phi-3's own qkv_proj: q rows, then k, then v) or three; gate/up as one
    # (fused at load, or Phi-3's own gate_up_proj: gate rows, then up), halves of equal size
    qkv = attn.fused_qkv.inner if hasattr(attn, "fused_qkv") else getattr(attn, "qkv_proj", None)
    if hasattr(mlp, "fused_gate_up"):
        gate_up, halves = mlp.fused_gate_up.inner, mlp.fused_gate_up.split_sizes
    elif hasattr(mlp, "gate_up_proj"):
        gate_up = mlp.gate_up_proj
        halves = [gate_up.out_features // 2] * 2 if gate_up.out_features % 2 == 0 else [0, 1]
    else:
        return None
    act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
    if type(act).__name__ not in ("SiLUActivation", "SiLU") or halves[0] != halves[1]:
        return None
    if qkv is None and not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
        return None
    # q, k and v fused, or three matmuls where their kinds differ (a Q4_K_M file's Q6_K v_proj)
    parts = (
        [_block_linear(qkv)] if qkv is not None else [_block_linear(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
    )
    # a tensor-parallel rank: o and down hold its input columns on blocks, their partial outputs summed over the
    # group between the layer's two calls (cpu_kernels.decoder_layer's reduce)
    row_parallel = [
        getattr(m, "blocks", None) is not None and hasattr(m, "group") for m in (attn.o_proj, mlp.down_proj)
    ]
    if any(row_parallel) and not all(row_parallel):
        return None
    o, down = (attn.o_proj.blocks, mlp.down_proj.blocks) if all(row_parallel) else (attn.o_proj, mlp.down_proj)
    linears = [_block_linear(m) for m in (o, gate_up, down)]
    if any(w is None for w in parts + linears):
        return None
    linears = [parts if len(parts) == 3 else parts[0]] + linears
    qk_norms = (qk[0].weight, qk[1].weight, qk[0].variance_epsilon) if qk else None
    reduce = None
    if all(row_parallel):
        from specdist.models.sharding import sum_over_ranks

        group = attn.o_proj.group
        reduce = (lambda t: sum_over_ranks(t, group), attn.o_proj.bias, mlp.down_proj.bias)
    return cpu_kernels.LayerWeights(
        norms[0].weight, norms[1].weight, norms[0].variance_epsilon, linears, qk_norms, reduce
    )


_GEMMA_NORMS = frozenset(("Gemma2RMSNorm", "Gemma3RMSNorm"))  # (1 + w) * normalize(x), in float32 then rounded


def _layer_norms(layer, sandwich: bool) -> list:
    names = ("input_layernorm", "post_attention_layernorm")
    names += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if sandwich else ()
    return [getattr(layer, n) for n in names]


def _norm_eps(norm) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def _llama_norm(norm) -> bool:
    """A Llama-style RMS norm (``weight * normalize(x)``, :data:`_LLAMA_STYLE_NORMS`)."""
    return type(norm).__name__ in _LLAMA_STYLE_NORMS and hasattr(norm, "variance_epsilon")


def _gate_up_linear(mlp) -> torch.nn.Module | None:
    """The one linear whose output is ``[gate | up]`` in halves of equal size, in an MLP that computes
    ``down(silu(gate) * up)`` (fused at load, or Phi-3's own ``gate_up_proj``); None for any other MLP (a mixture
    of experts, another activation, parts of unequal size)."""
    act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
    if type(act).__name__ not in ("SiLUActivation", "SiLU") or not hasattr(mlp, "down_proj"):
        return None
    fused = getattr(mlp, "fused_gate_up", None)
    if fused is not None:
        sizes = fused.split_sizes
        return fused.inner if len(sizes) == 2 and sizes[0] == sizes[1] else None
    gate_up = getattr(mlp, "gate_up_proj", None)
    if isinstance(gate_up, torch.nn.Module) and getattr(gate_up, "out_features", 1) % 2 == 0:
        return gate_up
    return None


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The fused ``F.rms_norm`` for Llama-style RMSNorm modules; anything else (Gemma's
    ``(1 + w)`` norm) runs its own forward."""
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or type(norm).__name__ not in _LLAMA_STYLE_NORMS:
        return norm(x)
    if x.is_cpu and x.dtype == torch.float32 and cpu_kernels.available():  # one call, not six ops
        return cpu_kernels.rms_norm(x, norm.weight, eps)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _qkv(attn, x, split: list[int] | None):
    """q, k, v projections: one matmul when :mod:`specdist.models.fusion` fused them, or the
    model's own fused ``qkv_proj`` cut at ``split`` (Phi-3)."""
    fused = getattr(attn, "fused_qkv", None)
    if fused is not None:
        return fused(x)
    if split is not None:
        return attn.qkv_proj(x).split(split, dim=-1)
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def _mlp(mlp, x):
    fused = getattr(mlp, "fused_gate_up", None)
    if fused is not None:
        gate, up = fused(x)
        return mlp.down_proj(mlp.act_fn(gate) * up)
    return mlp(x)
