"""The distributed engine: the same scheduler as :class:`~specdist.engine.local.Engine`, over gRPC transports.

:class:`RemoteEngine` holds a :class:`~specdist.engine.scheduler.Scheduler` driving a target worker
(the rank 0 of a possibly tensor-parallel target) and any number of draft workers through
:mod:`specdist.transport.remote`; its API is the scheduler's (:class:`~specdist.engine.base.EngineBase`).
It holds no model: :meth:`RemoteEngine.from_addresses` reads only the target's tokenizer and
config (vocabulary size, EOS ids), through the config's models resolved once
(:class:`~specdist.models.metadata.ModelSources`; a caller that resolved them passes ``sources``).
It imports ``specdist.v1`` and never ``workers/`` or ``cluster/``. ``worker_secret``: the deployment's worker secret
(:attr:`cluster.deployment.Deployment.worker_secret`), sent on every worker call; ``worker_tls``: its mutual TLS
(:class:`~specdist.transport.worker_tls.WorkerTLS`), every worker channel's.
``rpc_timeout_s``: the longest any worker call may take (a large prefill on a slow target);
hung workers are found sooner: drafts by their measured-latency deadlines, target ranks by a
deployment's supervisor and the collective timeouts. Worker calls may carry messages up to
:func:`specdist.transport.wire.message_limit_bytes` of the vocabulary, ``engine.max_batch_size`` and
``draft.num_speculative_tokens`` (the workers must be given at least that limit).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdist.config import Config, load_config
from specdist.cores.draft import draft_hidden_layers
from specdist.cores.proposers import ResolvedDraft, resolve_draft
from specdist.engine.base import EngineBase
from specdist.engine.scheduler import Scheduler
from specdist.errors import InvalidArgument
from specdist.models.metadata import ModelSources, resolve_sources
from specdist.transport.remote import RemoteDrafter, RemoteVerifier
from specdist.transport.wire import message_limit_bytes
from specdist.transport.worker_tls import WorkerTLS


class RemoteEngine(EngineBase):
    """The scheduler over a target worker and draft workers, by gRPC."""

    def __init__(
        self,
        config: str | dict | Config | None,
        target_address: str,
        draft_addresses: Sequence[str] = (),
        tokenizer=None,
        vocab_size: int | None = None,
        eos_ids: frozenset[int] | Sequence[int] = frozenset(),
        draft_max_batch_size: int | None = None,
        rpc_timeout_s: float = 600.0,
        worker_secret: str | None = None,
        sources: ModelSources | None = None,
        worker_tls: WorkerTLS | None = None,
        resolved: ResolvedDraft | None = None,
    ):
        """``sources``: the config's models (an EAGLE-3 draft's layers are read from the head and the target's
        config); None: resolved from the config if a draft method needs them. ``resolved``: the config's draft
        section as :func:`~specdist.cores.proposers.resolve_draft` checked it, if the caller did."""
        cfg = load_config(config)
        # refuses a draft section no method serves
        traits = (resolve_draft(cfg.draft, cfg.target.dtype) if resolved is None else resolved).traits
        if vocab_size is None:
            if tokenizer is None:
                raise InvalidArgument("vocab_size", "is required without a tokenizer")
            vocab_size = len(tokenizer)
        self.target_address = target_address
        self.tensor_parallel_size = cfg.cluster.tensor_parallel_size
        addresses = draft_addresses if cfg.draft.enabled else ()
        # eagle3: the target layers the head reads, and their values per position
        if addresses and sources is None:
            sources = ModelSources.of(cfg)  # each spec resolved only if the draft method reads its model
        layers, width = draft_hidden_layers(cfg.draft, sources) if addresses else ((), 0)
        # no call carries more than max_batch_size requests (a drafter's share of them included)
        limit = message_limit_bytes(
            vocab_size, cfg.engine.max_batch_size, cfg.draft.num_speculative_tokens, width, cfg.engine.max_model_len
        )
        verifier = RemoteVerifier(target_address, vocab_size, rpc_timeout_s, worker_secret, limit, worker_tls)
        drafters = [RemoteDrafter(a, rpc_timeout_s, worker_secret, limit, layers, worker_tls) for a in addresses]
        self.scheduler = Scheduler(cfg, verifier, drafters, tokenizer, eos_ids, draft_max_batch_size, traits)

    @classmethod
    def from_addresses(
        cls,
        config: str | dict | Config | None,
        target_address: str,
        draft_addresses: Sequence[str] = (),
        sources: ModelSources | None = None,
        **kwargs,
    ) -> "RemoteEngine":
        """Load only the target's tokenizer and config (vocabulary size, EOS ids); no weights. ``sources``: the
        config's models as :func:`~specdist.models.metadata.resolve_sources` resolved them (and what they read
        already is not read again); None: resolved here."""
        cfg = load_config(config)
        if kwargs.get("resolved") is None:  # before anything resolves
            kwargs["resolved"] = resolve_draft(cfg.draft, cfg.target.dtype)
        sources = resolve_sources(cfg) if sources is None else sources
        sources.read_target_metadata()
        return cls(
            cfg,
            target_address,
            draft_addresses,
            tokenizer=sources.tokenizer(),
            vocab_size=sources.vocab_size(),
            eos_ids=sources.eos_ids(),
            sources=sources,
            **kwargs,
        )
