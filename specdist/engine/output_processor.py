"""What a step's verification does to the requests' output, and who hears of it.

:class:`OutputProcessor` applies the tokens the target emitted to a request: its output
(:class:`~specdist.engine.output_state.OutputState`: stop tokens and strings, ``max_tokens``,
incremental text) and the context limit, its log-probabilities, its
:class:`~specdist.engine.request.RequestMetrics` and the engine's :class:`EngineStats` (summed from
the same :class:`~specdist.engine.request.RequestStep` records); it ends requests with an error, and
hands the step events (:class:`StepEvent`, :class:`RequestFinished`) to the ``listeners``.

Step events: after every step that verified something, each listener gets one :class:`StepEvent`
(the step's phase times, batch, and per request a RequestStep), and once per finished request a
:class:`RequestFinished` (its final metrics), on the thread that runs the step. Prometheus
(:mod:`specdist.api.metrics`) and benchmarks read the events instead of timing anything
themselves. A listener that raises is logged and the step goes on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdist.clock import now
from specdist.engine.draft_length import StepCosts
from specdist.engine.output_state import OutputState
from specdist.engine.request import Request, RequestMetrics, RequestStep
from specdist.errors import ErrorCode, InvalidArgument
from specdist.sampling_params import SamplingParams

log = logging.getLogger(__name__)

PHASES = ("prefill", "draft", "verify", "sampling", "cache", "output", "network")


@dataclass
class EngineStats:
    """Wall time per phase (seconds), token counters and transport calls since the last reset."""

    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    calls: int = 0
    pipeline_hits: int = 0  # request steps whose drafts were prepared during the previous verification
    pipeline_misses: int = 0
    draft_hidden_s: float = 0.0  # pipelined drafting done under verification (not in phase_s: no step waited)

    def reset(self) -> None:
        self.__init__()

    def add_step(self, s: RequestStep) -> None:
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.emitted += s.kept
        self.pipeline_hits += s.pipeline == "hit"
        self.pipeline_misses += s.pipeline == "miss"


@dataclass
class StepEvent:
    """What one step did, emitted once after it (see the module docstring)."""

    batch_size: int  # requests verified
    phase_s: dict[str, float]  # seconds per phase (PHASES) spent in this step, its admissions included
    step_s: float  # wall seconds of the step after admission: choose, propose, verify, output, release
    # predicted seconds of a step without drafts for this batch: the draft-length rule's, set as it reads the event
    plain_step_s: float
    requests: list[RequestStep]  # the verified requests, in batch order
    draft_hidden_s: float = 0.0  # pipelined drafting for this step that ran under the previous verification
    costs: StepCosts = field(default_factory=StepCosts)  # what the draft-length rule learns from (its observe)


@dataclass
class RequestFinished:
    """A request ended (any finish reason) and was released; ``metrics`` are final."""

    request_id: str
    finish_reason: str
    metrics: RequestMetrics


Listener = Callable[[StepEvent | RequestFinished], None]


class OutputProcessor:
    """Applies verification results to requests' output, metrics and ``stats``, and emits the step
    events to ``listeners`` (both the scheduler's, shared). ``tokenizer`` and ``eos_ids``: what every
    request's OutputState detokenizes with and stops at; ``max_model_len``: the context limit."""

    def __init__(
        self, stats: EngineStats, listeners: list[Listener], tokenizer, eos_ids: frozenset[int], max_model_len: int
    ):
        self.stats = stats
        self.listeners = listeners
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def output_state(self, params: SamplingParams) -> OutputState:
        """A new request's output: its stop tokens, stop strings and incremental text."""
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop", "stop strings need a model with a tokenizer")
        return OutputState(params, self.eos_ids, self.tokenizer)

    def apply(self, r: Request, proposal, n_acc: int, next_token: int, logprobs: list | None = None) -> RequestStep:
        """Fold one verification of ``proposal`` (None: no drafts) into request r's output (with the kept
        tokens' log-probabilities when it asked), metrics and the stats. Returns the step's record."""
        drafted = list(proposal.token_ids) if proposal is not None else []
        out = r.output
        kept = out.append(drafted[:n_acc] + [next_token])
        if r.logprobs is not None and logprobs is not None:  # the kept tokens are the first ``kept`` emitted
            r.logprobs.extend(logprobs[:kept])
        # tokens of this step the output consumed: the kept ones, plus a stop token that ended it
        used = kept + (1 if out.finished and isinstance(out.stop_reason, int) else 0)
        # draft positions that counted: all of them, unless the output ended inside the draft
        tried = min(len(drafted), used) if out.finished else len(drafted)
        accepted = min(n_acc, used)
        m = r.metrics
        step = RequestStep(
            r.request_id,
            r.replica,
            tried,
            accepted,
            used,
            kept,
            pipeline=proposal.pipeline if proposal is not None else None,
        )
        if kept or r.finished:
            t = now()
            if m.first_token_time is None:
                m.first_token_time = t
                step.ttft_s = t - m.arrival_time
            elif m.last_token_time is not None:
                step.inter_step_s = t - m.last_token_time
            m.last_token_time = t
        m.add_step(step)
        self.stats.add_step(step)
        if not r.finished and r.seq_len >= self.max_model_len:
            out.finish("length")
        return step

    def fail(self, r: Request, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        """End request r with finish_reason "error" (unless it already ended)."""
        if not r.finished:
            r.error, r.error_code = message, code
            r.output.finish("error")
        log.warning("request %s failed: %s", r.request_id, message)

    def stamp_finish(self, reqs: Sequence[Request]) -> list[Request]:
        """Stamp the finish time of those of ``reqs`` without one (they leave the engine now): returns them."""
        ended = [r for r in reqs if r.metrics.finish_time is None]
        for r in ended:
            r.metrics.finish_time = now()
        return ended

    def report_finished(self, ended: Sequence[Request]) -> None:
        """A RequestFinished for each of ``ended`` that finished, with its final metrics."""
        for r in ended:
            if r.finished:
                r.metrics.output_tokens = len(r.output.token_ids)
                self.emit(RequestFinished(r.request_id, r.output.finish_reason, dataclasses.replace(r.metrics)))

    def emit(self, event: StepEvent | RequestFinished) -> None:
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # an observer must not break the step
                log.exception("step-event listener %r failed", listener)
