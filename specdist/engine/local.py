"""The in-process engine: the scheduler over local transports.

:class:`Engine` builds a :class:`~specdist.cores.target.VerifierCore` and a
:class:`~specdist.cores.draft.DrafterCore` that live in this process, the very classes a
deployment's target and draft workers host, and holds the
:class:`~specdist.engine.scheduler.Scheduler` (the one speculative step) that drives them; its
API is the scheduler's (:class:`~specdist.engine.base.EngineBase`). A
``self-w8`` draft (the target's own int8 copy) copies the target's prompt K/V instead of a
second prefill.
"""

from __future__ import annotations

import torch

from specdist.config import Config, load_config
from specdist.cores import factory
from specdist.cores.draft import DrafterCore, LocalDrafter, load_draft_model
from specdist.cores.proposers import ResolvedDraft, resolve_draft
from specdist.cores.target import LocalVerifier
from specdist.cores.verify_batch import VerifyBatch
from specdist.engine.base import EngineBase
from specdist.engine.scheduler import Scheduler
from specdist.models.devices import device_for
from specdist.models.kernels import cpu_kernels
from specdist.models.loader import eos_token_ids
from specdist.models.memory_plan import Measure, MemoryPlan, plan_memory, runner_profile
from specdist.models.metadata import ModelSources
from specdist.models.quant import refuse_int8_on
from specdist.sampling_params import MAX_LOGPROBS, SamplingParams


class Engine(EngineBase):
    """The scheduler over a target and a draft in this process (``target_core``, ``draft_core``)."""

    compile_s: float = 0.0  # seconds spent compiling and warming compiled passes at load (engine.compile)
    graphs_s: float = 0.0  # seconds spent capturing CUDA graphs at load (engine.cuda_graphs)
    memory_plan: str = ""  # the paged caches' sizes and what they were planned from, one line (GPUs; GetServerInfo)

    def __init__(
        self,
        config: Config,
        target: torch.nn.Module,
        tokenizer=None,
        draft: torch.nn.Module | None = None,
        resolved: ResolvedDraft | None = None,
    ):
        """``resolved``: the config's draft section as :func:`~specdist.cores.proposers.resolve_draft` checked it,
        if the caller did (else checked here)."""
        ec = config.engine
        # refuses a draft section no method serves, before anything is built
        resolved = resolve_draft(config.draft, config.target.dtype) if resolved is None else resolved
        # engine.cpu_kernels in this process (from_config applied it before loading; the runners read it); the
        # backend it chose is GetServerInfo's cpu_kernels
        self.cpu_kernels = cpu_kernels.configure(ec.cpu_kernels)
        # on a GPU the paged caches start at one sequence each and take their size from the memory plan below
        kv, measure = factory.kv_options(ec, next(target.parameters()).device)
        self.target_core = factory.build_target_core(target, ec, kv)
        # self drafts (and hybrid's): the target's prompt K/V (same layout) stand in for the draft's own prefill
        share = self.target_core.prefix_kv if resolved.copy else None
        # in process a prompt's draft K/V wait for its first draft: a request that never drafts costs no draft forward
        self.draft_core: DrafterCore | None = factory.build_draft_core(
            resolved, ec, kv, self.target_core.vocab_size, draft, prefix_source=share, defer_prefill=True
        )
        if self.draft_core is not None and self.draft_core.hidden_layers:  # eagle3: the target keeps those states
            self.target_core.keep_hidden_layers(self.draft_core.hidden_layers)
        dc = config.draft
        k = dc.num_speculative_tokens if resolved.enabled else 0
        if measure is not None:
            self.memory_plan = self._plan_memory(ec, k, measure).line()
        runners = [(self.target_core.runner, "target")]
        if self.draft_core is not None and self.draft_core.runner is not None:
            runners.append((self.draft_core.runner, "draft"))
        captures = []
        for runner, role in runners:
            seconds, capture = factory.prepare_passes(runner, role, k, ec)
            self.compile_s += seconds
            captures += [capture] if capture is not None else []
        self.graphs_s = sum(capture() for capture in captures)
        drafters = [] if self.draft_core is None else [LocalDrafter(factory.hosted_drafter(self.draft_core, resolved))]
        self.scheduler = Scheduler(
            config,
            LocalVerifier(self.target_core),
            drafters,
            tokenizer,
            eos_token_ids(target, tokenizer),
            traits=resolved.traits,
        )

    def _plan_memory(self, ec, k: int, measure: Measure) -> MemoryPlan:
        """Size the paged caches of the target and of a draft model from a profile of the passes serving runs
        (:mod:`specdist.models.memory_plan`): each runner's graph buckets (held where they become CUDA graphs, as
        :func:`capture_graphs` takes them: verifying ``k`` drafts, drafting two tokens a pass) and its longest
        prefill, and the sampler of a verification at the largest batch."""
        graphed = ec.graphs(self.target_core.runner.device.type)
        runners = {"target": (self.target_core.runner, k + 1)}
        draft = self.draft_core.runner if self.draft_core is not None else None
        if draft is not None and draft.attention is not None:
            runners["draft"] = (draft, 2)
        profile = runner_profile(runners, graphed)
        profile.eager += sampler_passes(
            self.target_core.vocab_size, ec.max_batch_size, max(k, 1), self.target_core.runner.device
        )
        return plan_memory(
            {name: r.cache for name, (r, _) in runners.items()}, ec.gpu_memory_utilization, profile, measure
        )

    def kv_cache_usage(self) -> dict[str, dict[str, int]]:
        """Each core's KV cache usage (``usage()`` of its cache: blocks_total, blocks_used, block_size), by core
        name as :meth:`kv_slots_in_use` names them; a drafter without a cache (n-gram, suffix) has none."""
        out = {"target": self.target_core.cache.usage()}
        cache = self.draft_core.cache if self.draft_core is not None else None
        if cache is not None:
            out["draft"] = cache.usage()
        return out

    def suffix_index_size(self) -> dict[str, int] | None:
        """The draft's suffix index (methods suffix, hybrid): nodes, live and cached sequences, cached tokens; None
        without one."""
        return self.draft_core.proposer.index_stats() if self.draft_core is not None else None

    @classmethod
    def from_config(
        cls,
        source: str | dict | Config | None = None,
        tokenizer=None,
        target: torch.nn.Module | None = None,
        sources: ModelSources | None = None,
        resolved: ResolvedDraft | None = None,
    ) -> "Engine":
        """Load the models a config names. ``tokenizer``: the target's, if the caller already has it;
        ``target``: the target model as the config's ``target`` section loads it, if the caller
        already has it (engines over one model share its weights; each keeps its own KV cache);
        ``sources``: the config's models as :func:`~specdist.models.metadata.resolve_sources` resolved them, if
        the caller did (else resolved here, once: the target's spec, then ``draft.model``'s, before any weight
        is read). Nothing below resolves a spec again. ``resolved``: the config's draft section as
        :func:`~specdist.cores.proposers.resolve_draft` checked it, if the caller did (else checked here, once)."""
        from specdist.models.loader import gguf_parsed_once, load_model
        from specdist.models.metadata import resolve_sources

        cfg = load_config(source)
        # before anything resolves or loads (the one check of the draft section)
        resolved = resolve_draft(cfg.draft, cfg.target.dtype) if resolved is None else resolved
        if cfg.engine.num_threads:
            torch.set_num_threads(cfg.engine.num_threads)
        cpu_kernels.configure(cfg.engine.cpu_kernels)  # before the weights: native blocks are packed for the kernels
        device = device_for(cfg.engine.device)
        refuse_int8_on(resolved.copy, device.type)  # self-w8 on CUDA: refused before any weight loads
        sources = resolve_sources(cfg) if sources is None else sources
        with gguf_parsed_once():  # a GGUF model's tokenizer and weights: one parse of its header
            if tokenizer is None:
                tokenizer = sources.tokenizer()
            if target is None:
                target = load_model(sources.target, cfg.target.dtype, device, weights=cfg.target.weights)
            # a draft model checked against the target's vocabulary, or the target's own copy
            draft = load_draft_model(cfg.draft, sources, resolved.dtype, device, target, tokenizer)
        return cls(cfg, target, tokenizer, draft, resolved)


def sampler_passes(vocab: int, bsz: int, k: int, device: torch.device) -> list:
    """The verification sampler at its largest: ``bsz`` requests of ``k`` drafts each, sampled (top-k, top-p and
    the most log-probabilities), once all rejection-coupled with dense q rows (made inside the pass, as a drafter
    in the process makes them) and once all Gumbel-coupled (noise for every row)."""

    def run(coupling: str) -> None:
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=MAX_LOGPROBS)
        drafts = [[b % vocab] * k for b in range(bsz)]
        has_q = [coupling == "rejection"] * bsz
        batch = VerifyBatch([(1, params, b, coupling) for b in range(bsz)], drafts, list(range(bsz)), has_q, vocab)
        logits = torch.randn(bsz * (k + 1), vocab, device=device)  # [B * (K+1), V] as the target's pass packs them
        extra = torch.from_numpy(batch.words()).to(device)
        qs = [torch.softmax(torch.randn(k, vocab, device=device), -1) if q else None for q in has_q]  # [K, V] each
        batch.decide(logits, extra, qs)

    return [lambda: run("rejection"), lambda: run("gumbel")]
