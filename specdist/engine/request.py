"""A request's state inside the engine, and what the caller gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdist.engine.draft_length import Acceptance
from specdist.engine.output_state import OutputState
from specdist.errors import ErrorCode
from specdist.logprobs import TokenLogprob
from specdist.sampling_params import SamplingParams
from specdist.transport.protocol import Proposal


@dataclass
class RequestStep:
    """One request's part of one step: what RequestMetrics, EngineStats and the metrics add up."""

    request_id: str
    replica: int | None  # the draft replica that drafted for it; None: no drafts
    drafted: int  # draft positions verified that counted (none past the end of the output)
    accepted: int  # of those, accepted by the target: positions 0 .. accepted - 1
    emitted: int  # target tokens the output consumed, counting a stop token that ended it
    kept: int  # tokens added to the output
    pipeline: str | None = None  # pipelined drafting: "hit" (drafts prepared during the last verify) or "miss"
    ttft_s: float | None = None  # this step gave the request its first token: seconds since arrival
    inter_step_s: float | None = None  # seconds since the previous step that gave it tokens


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    output_tokens: int = 0
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # of those, accepted by the target
    steps: int = 0  # target verification steps
    emitted: int = 0  # tokens the target emitted into the output, counting a stop token that ended it
    drafts: int = 0  # steps that verified at least one draft token
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: steps that accepted draft position i
    pipeline_hits: int = 0  # steps whose drafts were prepared during the previous verification
    pipeline_misses: int = 0  # steps whose prepared drafts assumed a prefix that did not hold
    arrival_time: float = 0.0
    scheduled_time: float | None = None  # admitted on the target (out of the queue)
    first_token_time: float | None = None
    last_token_time: float | None = None  # the last step that gave it tokens
    finish_time: float | None = None

    def add_step(self, s: RequestStep) -> None:
        self.steps += 1
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.emitted += s.emitted
        self.drafts += s.drafted > 0
        self.pipeline_hits += s.pipeline == "hit"
        self.pipeline_misses += s.pipeline == "miss"
        if len(self.accepted_per_pos) < s.accepted:
            self.accepted_per_pos.extend([0] * (s.accepted - len(self.accepted_per_pos)))
        for i in range(s.accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the target's own token)."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    metrics: RequestMetrics
    # params.logprobs set: one per token_ids entry (specdist.logprobs); else None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)  # identity: queues and batches look requests up by object, in O(1) per comparison
class Request:
    """A request as the scheduler tracks it. The cores (target, drafts) know it by ``core_id``."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    output: OutputState
    seed: int = 0  # keys the target's uniforms; the draft's seed is specdist.randomness.draft_seed(seed)
    core_id: str = ""  # this request's id on the target and draft cores (unique per scheduler)
    tenant: str = ""  # who it belongs to (StartItem.tenant): the cores share state only within a tenant
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    acceptance: Acceptance = field(default_factory=Acceptance)  # observed, for the draft-length rule
    replica: int | None = None  # the draft replica it is assigned to; None: no drafts
    queued: bool = False  # in the scheduler's waiting queue
    on_target: bool = False  # holds target state (prefilled, not yet released)
    on_drafter: bool = False  # holds state on its draft replica
    num_accepted: int = 0  # of its drafter's last proposal, for the next ProposeItem
    new_tokens: list[int] = field(default_factory=list)  # target tokens since the last proposal
    # EAGLE-3 replicas: the target's hidden states since the last proposal ([m, nD] each), for the next ProposeItem
    pending_hidden: list = field(default_factory=list)
    proposal: Proposal | None = None  # this step's, until verified
    full_accept: bool = False  # its last verified proposal was accepted whole (pipelined drafting's guess test)
    error: str | None = None  # with finish_reason "error": what failed
    error_code: ErrorCode | None = None  # ... and its code (UNAVAILABLE: the target failed, a retry may succeed)
    logprobs: list[TokenLogprob] | None = None  # params.logprobs set: one per output.token_ids entry

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def seq_len(self) -> int:
        """Tokens so far (prompt + output); the last one is not yet in the target's cache."""
        return len(self.prompt_ids) + len(self.output.token_ids)

    @property
    def finished(self) -> bool:
        return self.output.finished

    def to_output(self) -> RequestOutput:
        self.metrics.output_tokens = len(self.output.token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids),
            text=self.output.text,
            token_ids=list(self.output.token_ids),
            finish_reason=self.output.finish_reason,
            stop_reason=self.output.stop_reason,
            metrics=self.metrics,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )
