"""What the two engines share: the scheduler they hold, and its API.

:class:`~specdist.engine.local.Engine` (the cores in this process) and
:class:`~specdist.engine.remote.RemoteEngine` (the workers over gRPC) each build their transports
and one :class:`~specdist.engine.scheduler.Scheduler` over them, held as ``scheduler``. An engine
is not a scheduler: the names :class:`EngineBase` lists are those of the scheduler's that the layers above
use (the coordinator, the servers, a deployment's watcher, the metrics), read, written and called there
(``engine.step()``, ``engine.listeners.append(...)``, ``engine.target_diagnosis = ...``), and it adds where a
prompt is encoded (:meth:`EngineBase.add_request`: once, and the scheduler takes the ids) and the drivers that run
requests to completion over the step (:meth:`EngineBase.generate`, :meth:`EngineBase.stream`). What else a
scheduler holds (its transports, its draft replicas, its draft-length policy, its coupling) is reached through
``engine.scheduler``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from specdist.clock import now
from specdist.engine.prompts import EncodedPrompt, encode_prompt
from specdist.engine.request import Request, RequestOutput
from specdist.engine.scheduler import Scheduler
from specdist.errors import InvalidArgument
from specdist.sampling_params import SamplingParams


class _OfScheduler:
    """An engine attribute that is its scheduler's: read, written and called there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine, owner: type | None = None):
        return self if engine is None else getattr(engine.scheduler, self.name)

    def __set__(self, engine, value) -> None:
        setattr(engine.scheduler, self.name, value)


class EngineBase:
    """An engine: the :class:`Scheduler` it built (``scheduler``), its API, and the drivers of its step."""

    scheduler: Scheduler

    # requests and the step (add_request: below, where the prompt is encoded): the coordinator's engine thread
    abort = _OfScheduler()
    release = _OfScheduler()
    step = _OfScheduler()
    has_unfinished = _OfScheduler()
    waiting = _OfScheduler()
    running = _OfScheduler()
    # what it holds on the cores (the gauges), and their health as a deployment's supervisor reports it
    kv_slots_in_use = _OfScheduler()
    releases_pending = _OfScheduler()
    retarget = _OfScheduler()
    replica_down = _OfScheduler()
    readmit = _OfScheduler()
    num_draft_replicas = _OfScheduler()
    target_diagnosis = _OfScheduler()
    close = _OfScheduler()
    # observation (the metrics, the benchmarks)
    stats = _OfScheduler()
    listeners = _OfScheduler()
    # its settings, as the servers describe and check requests by them
    config = _OfScheduler()
    tokenizer = _OfScheduler()
    vocab_size = _OfScheduler()
    max_model_len = _OfScheduler()
    k = _OfScheduler()
    traits = _OfScheduler()

    last_output: RequestOutput  # the last :meth:`stream`'s final output (set when it ends)

    def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> EncodedPrompt:
        """Template (``chat``), tokenize and check a prompt (:func:`~specdist.engine.prompts.encode_prompt`:
        ``InvalidArgument`` naming the field); its arrival is now."""
        arrival = now()
        text, ids = encode_prompt(
            self.tokenizer, prompt, vocab_size=self.vocab_size, max_model_len=self.max_model_len, chat=chat
        )
        return EncodedPrompt(text, ids, arrival)

    def add_request(
        self,
        prompt: str | Sequence[int] | Sequence[dict] | EncodedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        tenant: str = "",
    ) -> Request:
        """Queue a request. ``prompt``: text, token ids or (``chat``) a conversation, encoded here once
        (:meth:`encode`; ``chat``: in the model's chat template), or an :class:`EncodedPrompt` encoded
        already (``chat`` is then ignored). ``tenant``: who it belongs to (the servers pass the caller's,
        :func:`specdist.transport.security.tenant_of`)."""
        if not isinstance(prompt, EncodedPrompt):
            prompt = self.encode(prompt, chat)
        return self.scheduler.add_request(prompt, params, request_id, tenant)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Run a batch of prompts together to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise InvalidArgument("prompts", "must be a list of prompts (text or token-id lists)")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidArgument("params", f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        reqs = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self.add_request(p, sp, chat=chat))
            done = 0  # reqs[:done] are finished (a scan of every request per step would be quadratic)
            while done < len(reqs):
                if reqs[done].finished:
                    done += 1
                else:
                    self.step()
        finally:  # an exception or interrupt mid-run must not leave slots or queue entries behind
            self.scheduler.abort_requests([r for r in reqs if not r.finished])
        return [r.to_output() for r in reqs]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, chat: bool = False
    ) -> Iterator[str]:
        """Yield text pieces as they are produced; the final output is then ``self.last_output``."""
        req = self.add_request(prompt, params, chat=chat)
        try:
            while not req.finished:
                self.step()
                delta = req.output.take_delta()
                if delta:
                    yield delta
            tail = req.output.take_delta()
            if tail:
                yield tail
        finally:
            if not req.finished:
                self.abort(req.request_id)
        self.last_output = req.to_output()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
