"""The one place the cores a config describes are assembled, for the in-process engine
(:mod:`specdist.engine.local`) and the Ray workers (:mod:`workers.actors`) alike.

Each factory takes the config's sections whole, the ``engine:`` section (:class:`~specdist.config.EngineConfig`)
and the draft section checked once (:class:`~specdist.cores.proposers.ResolvedDraft`), and reads its keys itself:
a new engine key is read here or below, never unpacked and passed along by its callers.

- :func:`kv_options`: the runners' KV layout, and the measure of a paged cache left for a memory plan (GPUs);
- :func:`build_target_core`: the target's runner and its :class:`~specdist.cores.target.VerifierCore` (one rank
  of a tensor-parallel group, given its collectives);
- :func:`build_draft_core`: the draft method's :class:`~specdist.cores.draft.DrafterCore` over what it drafts with;
- :func:`prepare_passes`: a runner's compiled passes (``engine.compile``) and the capture of its CUDA graphs
  (``engine.cuda_graphs``), which the caller runs once the cache has its planned size;
- :func:`hosted_drafter`: the core as it is served, in a draft pipeline where ``draft.pipeline`` asks for one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from specdist.cores.draft import DrafterCore, build_drafter_core
from specdist.cores.draft_pipeline import pipelined
from specdist.cores.proposers import ResolvedDraft
from specdist.cores.target import VerifierCore
from specdist.models import memory_plan
from specdist.models.kv.options import KVOptions
from specdist.models.memory_plan import Measure
from specdist.models.runner import CausalLMRunner, compile_runner

if TYPE_CHECKING:
    from specdist.config import EngineConfig

# tokens a draft runner's pass holds: one, or two when it catches up after a fully accepted step
DRAFT_PASS_TOKENS = 2


def kv_options(ec: EngineConfig, device: torch.device) -> tuple[KVOptions, Measure | None]:
    """The KV layout of ``ec`` for runners on ``device``, and the measure of a paged cache deferred to a memory
    plan (:mod:`specdist.models.memory_plan`: on a device it measures, unless ``engine.kv_cache_tokens`` sizes
    the cache), else None: the runner then starts with one sequence's blocks and the caller plans the rest."""
    measure = memory_plan.measure_for(device)  # (looked up on the module: tests stand a GPU's in for it)
    kv = KVOptions.from_engine(ec, device, deferred=measure is not None)
    return kv, measure if kv.deferred else None


def build_target_core(
    model: torch.nn.Module,
    ec: EngineConfig,
    kv: KVOptions,
    hidden_layers=(),
    rank: int = 0,
    world_size: int = 1,
    broadcast: Callable[[Any], Any] | None = None,
    set_timeout: Callable[[float], None] | None = None,
    collective_timeout_s: float = 10.0,
) -> VerifierCore:
    """The target's runner over ``model`` (this rank's shard of it) with ``kv``, as ``ec`` sizes it, and its
    verifier core. ``hidden_layers``: the layers whose hidden states rank 0 keeps for an EAGLE-3 draft (also
    :meth:`VerifierCore.keep_hidden_layers`, before :func:`prepare_passes`); ``broadcast``, ``set_timeout``,
    ``collective_timeout_s``: a tensor-parallel group's (:mod:`workers.tensor_parallel`)."""
    runner = CausalLMRunner(model, ec.max_batch_size, ec.max_model_len, kv_cache_dtype=ec.kv_cache_dtype, kv=kv)
    if rank == 0:  # (the other ranks' forwards return nothing)
        runner.hidden_layers = tuple(hidden_layers)
    return VerifierCore(
        runner,
        rank=rank,
        world_size=world_size,
        broadcast=broadcast,
        set_timeout=set_timeout,
        collective_timeout_s=collective_timeout_s,
        prefix_caching=ec.prefix_caching,
        prefix_scope=ec.prefix_cache_scope,
    )


def build_draft_core(
    draft: ResolvedDraft,
    ec: EngineConfig,
    kv: KVOptions | None,
    vocab_size: int,
    model=None,
    prefix_source=None,
    defer_prefill: bool = False,
) -> DrafterCore | None:
    """The drafter core of ``draft`` (None for method none) over ``model`` (what
    :func:`~specdist.cores.draft.load_draft_model` loaded), sized and cached as ``ec`` says, a model's cache laid
    out by ``kv``. ``prefix_source``: the target's prompt K/V, for a copy of the target to take instead of its own
    prefill; ``defer_prefill``: a prompt's K/V computed at its first draft instead of in ``start``."""
    return build_drafter_core(
        draft.section,
        vocab_size,
        ec.max_batch_size,
        ec.max_model_len,
        model,
        prefix_source=prefix_source,
        defer_prefill=defer_prefill,
        prefix_caching=ec.prefix_caching,
        prefix_scope=ec.prefix_cache_scope,
        kv_cache_dtype=ec.kv_cache_dtype,
        kv=kv,
    )


def prepare_passes(
    runner: CausalLMRunner, role: str, k: int, ec: EngineConfig, world_size: int = 1
) -> tuple[float, Callable[[], float] | None]:
    """Compile ``runner``'s passes where ``engine.compile`` has them on its device (one rank only: collectives
    stay out of compiled code) and warm the buckets a step uses first; ``role``: ``target`` (verifying up to
    ``k`` drafts) or ``draft``. Returns the seconds that took, and the capture of its CUDA graphs where
    ``engine.cuda_graphs`` has them (a paged cache on CUDA, one rank), else None: the caller runs it once the
    cache has its planned size; it returns the seconds it took."""
    device = runner.device.type
    compile_s = 0.0
    if ec.compiled(device) and world_size == 1:
        compile_s = compile_runner(runner, role, k, ec.compile_cache_dir)
    if not (ec.graphs(device) and world_size == 1 and runner.attention is not None):
        return compile_s, None
    tokens = k + 1 if role == "target" else DRAFT_PASS_TOKENS
    return compile_s, lambda: runner.capture_graphs(max_tokens=tokens)


def hosted_drafter(core: DrafterCore, draft: ResolvedDraft):
    """``core`` as it is served: in a :class:`~specdist.cores.draft_pipeline.DraftPipeline` when ``draft.pipeline``
    asks for one and the method drafts ahead."""
    return pipelined(core, draft.traits.pipelined, draft.section.pipeline_miss)
