"""Prometheus metrics, read from the scheduler's step events (:mod:`specdist.engine.scheduler`).

:class:`Metrics` subscribes to one engine's ``listeners`` (called on the engine thread) and
keeps its own ``CollectorRegistry``, so several servers (or tests) in one process do not
share series. ``render()`` is the ``/metrics`` body and content type. The coordinator holds
one as ``coordinator.metrics``; ``specdist serve --metrics-port`` serves its registry with
prometheus-client's own HTTP server, and the HTTP API serves it on ``GET /metrics``.

Names follow vLLM's (``vllm:x`` is ``specdist_x``) where vLLM has the metric, with its meaning:

- ``specdist_request_success_total{finished_reason}``: finished requests by finish reason
  (stop, length, abort, error); ``specdist_prompt_tokens_total``,
  ``specdist_generation_tokens_total``: prompt tokens of finished requests, output tokens;
- gauges ``specdist_num_requests_running``, ``specdist_num_requests_waiting``,
  ``specdist_target_kv_slots_used``, ``specdist_draft_kv_slots_used{replica}``: as of the
  coordinator's last pass (or the engine's state, without a coordinator);
- gauges ``specdist_kv_cache_usage_perc{core}``, ``specdist_kv_cache_blocks{core}``,
  ``specdist_kv_cache_block_tokens{core}`` (an in-process engine): the share of each KV cache's
  blocks in use, how many the requests can take and their size (a slot cache counts slots of
  ``max_model_len`` tokens), read at scrape time; ``specdist_suffix_index_nodes`` and
  ``specdist_suffix_index_cached_tokens``: the size of an in-process suffix drafter's index;
- gauges ``specdist_target_releases_pending``, ``specdist_draft_releases_pending{replica}``:
  requests whose release failed and is being retried (``Scheduler.releases_pending``; each may
  still hold a KV slot there), from the snapshot when it has ``releases``, else read from the
  engine at scrape time (counts only);
- ``specdist_spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}``, each
  labelled with the draft ``replica``: drafts (request-steps that verified a draft), draft
  tokens verified, accepted ones, and acceptances per draft position (0-based). Draft positions
  past the end of a request's output (after a stop) are not counted, as in the per-request stats;
- histograms ``specdist_time_to_first_token_seconds``, ``specdist_e2e_request_latency_seconds``,
  ``specdist_request_queue_time_seconds`` (arrival to admission on the target),
  ``specdist_time_per_output_token_seconds`` (per request: first to last token over the tokens
  after the first), ``specdist_inter_step_latency_seconds`` (between two steps that gave a
  request tokens: one step emits several tokens, so this is not vLLM's inter-token latency);
- pipelined drafting (``draft.pipeline``): ``specdist_spec_decode_pipeline_total{replica,outcome}``
  (request-steps whose drafts were prepared during the previous verification, ``hit``, or
  whose prepared prefix did not hold, ``miss``) and
  ``specdist_spec_decode_draft_hidden_seconds_total`` (draft worker time spent preparing
  under verification, which no step waited for);
- per step: ``specdist_step_duration_seconds``, ``specdist_step_phase_seconds{phase}`` (draft,
  verify, network, ... as ``EngineStats.phase_s``), ``specdist_step_batch_size``;
- ``specdist_spec_decode_realized_speedup``: over the last ``SPEEDUP_WINDOW`` steps, output
  tokens per second of step divided by the tokens per second the same batches would get
  without drafts, whose step time is the scheduler's measured cost of a non-speculative step
  (``DraftLengthPolicy.step_time`` with every draft length 0: the measured verification time of
  that batch and token count when one was seen, else the fit of verification time on tokens,
  plus the measured per-step overhead).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from specdist.engine.output_processor import PHASES, RequestFinished, StepEvent

FINISH_REASONS = ("stop", "length", "abort", "error")
SPEEDUP_WINDOW = 64  # steps
# request latencies (seconds), as vLLM's buckets
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """The Prometheus series of one engine (see the module docstring).

    ``snapshot``: returns an object with ``running``, ``waiting`` and ``kv`` (the engine's
    ``kv_slots_in_use()``) and optionally ``releases`` (its ``releases_pending()``), read at
    scrape time; default: the engine itself (then scrape only where the engine is not stepping
    concurrently, or accept a racy read).
    """

    def __init__(self, engine: Any, snapshot: Callable[[], Any] | None = None):
        self.engine = engine
        self.registry = CollectorRegistry()
        self.recording = True  # False: events are ignored (the coordinator's warm-up)
        releases = getattr(engine, "releases_pending", None)
        self._snapshot = snapshot or (
            lambda: SimpleNamespace(
                running=len(engine.running),
                waiting=len(engine.waiting),
                kv=engine.kv_slots_in_use(),
                releases=releases() if releases is not None else {},
            )
        )
        self._window: deque[tuple[int, float, int, float]] = deque(maxlen=SPEEDUP_WINDOW)
        self._speedup = 0.0
        r = self.registry
        p = "specdist_"
        self.requests = Counter(
            p + "request_success_total", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Output tokens generated", registry=r)
        sd = p + "spec_decode_"
        self.num_drafts = Counter(
            sd + "num_drafts_total", "Request-steps that verified a draft", ["replica"], registry=r
        )
        self.num_draft_tokens = Counter(sd + "num_draft_tokens_total", "Draft tokens verified", ["replica"], registry=r)
        self.num_accepted = Counter(sd + "num_accepted_tokens_total", "Draft tokens accepted", ["replica"], registry=r)
        self.accepted_per_pos = Counter(
            sd + "num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by draft position (0-based)",
            ["replica", "position"],
            registry=r,
        )
        self.pipeline = Counter(
            sd + "pipeline_total",
            "Pipelined drafting: request-steps whose drafts were prepared during the previous "
            "verification (hit) or whose prepared prefix did not hold (miss)",
            ["replica", "outcome"],
            registry=r,
        )
        self.draft_hidden = Counter(
            sd + "draft_hidden_seconds_total",
            "Seconds of pipelined drafting done while the target verified (no step waited)",
            registry=r,
        )
        self.speedup = Gauge(
            sd + "realized_speedup",
            f"Output tokens/s over the last {SPEEDUP_WINDOW} steps divided by the tokens/s "
            "of the same batches without drafts (the measured non-speculative step cost)",
            registry=r,
        )
        self.speedup.set_function(lambda: self._speedup)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "Per request: first to last token divided by the output tokens after the first",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_step = Histogram(
            p + "inter_step_latency_seconds",
            "Inter-step latency, not inter-token: time between two steps that gave a "
            "request tokens (one step emits several tokens)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Arrival to finish", buckets=REQUEST_BUCKETS, registry=r
        )
        self.queue = Histogram(
            p + "request_queue_time_seconds", "Arrival to admission on the target", buckets=REQUEST_BUCKETS, registry=r
        )
        self.step_duration = Histogram(
            p + "step_duration_seconds",
            "Wall time of a step after admission (draft, verify, output, release)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_phase = Histogram(
            p + "step_phase_seconds",
            "Time per phase in a step: prefill (admission), draft, verify (the target "
            "forward), sampling, cache, output, network (remote calls' wall minus compute)",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            p + "step_batch_size", "Requests verified in a step", buckets=BATCH_BUCKETS, registry=r
        )
        r.register(
            _Gauges(
                self._snapshot,
                releases,
                getattr(engine, "kv_cache_usage", None),
                getattr(engine, "suffix_index_size", None),
            )
        )
        self._listening = hasattr(engine, "listeners")  # a stand-in engine without step events
        if self._listening:
            engine.listeners.append(self.observe)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type (the text format)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        """Stop listening to the engine (the series stay readable)."""
        if self._listening and self.observe in self.engine.listeners:
            self.engine.listeners.remove(self.observe)
        self._listening = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ignore events inside the block (run it on the engine thread, which emits them)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    # ---------------------------------------------------------------- events (engine thread)
    def observe(self, event: StepEvent | RequestFinished) -> None:
        if not self.recording:
            return
        if isinstance(event, StepEvent):
            self._step(event)
        elif isinstance(event, RequestFinished):
            self._finished(event)

    def _step(self, e: StepEvent) -> None:
        self.step_duration.observe(e.step_s)
        self.batch_size.observe(e.batch_size)
        for phase in PHASES:
            self.step_phase.labels(phase).observe(e.phase_s.get(phase, 0.0))
        if e.draft_hidden_s:
            self.draft_hidden.inc(e.draft_hidden_s)
        kept = 0
        for s in e.requests:
            kept += s.kept
            if s.pipeline is not None:
                self.pipeline.labels(str(s.replica), s.pipeline).inc()
            if s.ttft_s is not None:
                self.ttft.observe(s.ttft_s)
            if s.inter_step_s is not None:
                self.inter_step.observe(s.inter_step_s)
            if s.drafted:
                rep = str(s.replica)
                self.num_drafts.labels(rep).inc()
                self.num_draft_tokens.labels(rep).inc(s.drafted)
                self.num_accepted.labels(rep).inc(s.accepted)
                for pos in range(s.accepted):
                    self.accepted_per_pos.labels(rep, str(pos)).inc()
        self.generation_tokens.inc(kept)
        self._window.append((kept, e.step_s, e.batch_size, e.plain_step_s))
        tokens = sum(w[0] for w in self._window)
        spent = sum(w[1] for w in self._window)
        plain_tokens = sum(w[2] for w in self._window)  # a step without drafts gives one token per request
        plain_spent = sum(w[3] for w in self._window)
        if spent > 0 and plain_spent > 0 and plain_tokens:
            self._speedup = (tokens / spent) / (plain_tokens / plain_spent)

    def _finished(self, e: RequestFinished) -> None:
        m = e.metrics
        self.requests.labels(e.finish_reason).inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        if m.total_time is not None:
            self.e2e.observe(m.total_time)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.output_tokens > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (m.output_tokens - 1))


class _Gauges:
    """Running / waiting requests, KV slots and pending releases, read from a snapshot at scrape time
    (pending releases from ``releases``, the engine's counts, when the snapshot has none)."""

    def __init__(
        self,
        snapshot: Callable[[], Any],
        releases: Callable[[], dict[str, int]] | None = None,
        kv_usage: Callable[[], dict[str, dict[str, int]]] | None = None,
        suffix_size: Callable[[], dict[str, int] | None] | None = None,
    ):
        self.snapshot = snapshot
        self.releases = releases
        self.kv_usage = kv_usage
        self.suffix_size = suffix_size

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.snapshot()
        yield GaugeMetricFamily("specdist_num_requests_running", "Requests in the running batch", value=s.running)
        yield GaugeMetricFamily("specdist_num_requests_waiting", "Requests waiting for admission", value=s.waiting)
        yield GaugeMetricFamily(
            "specdist_target_kv_slots_used", "Requests holding a KV slot on the target", value=s.kv.get("target", 0)
        )
        yield _per_replica(
            GaugeMetricFamily(
                "specdist_draft_kv_slots_used", "Requests holding draft state, per draft replica", labels=["replica"]
            ),
            s.kv,
        )
        releases = getattr(s, "releases", None)
        if releases is None:
            releases = self.releases() if self.releases is not None else {}
        yield GaugeMetricFamily(
            "specdist_target_releases_pending",
            "Requests whose release on the target failed and is retried (may hold a KV slot)",
            value=releases.get("target", 0),
        )
        yield _per_replica(
            GaugeMetricFamily(
                "specdist_draft_releases_pending",
                "Requests whose release on a draft replica failed and is retried",
                labels=["replica"],
            ),
            releases,
        )
        if self.kv_usage is not None:  # an in-process engine: its caches' counters (ints: a racy read is harmless)
            usage = self.kv_usage()
            perc = GaugeMetricFamily(
                "specdist_kv_cache_usage_perc",
                "Share of the KV cache's blocks in use (a slot cache: slots)",
                labels=["core"],
            )
            blocks = GaugeMetricFamily(
                "specdist_kv_cache_blocks",
                "KV cache blocks (a slot cache: slots) the requests can take",
                labels=["core"],
            )
            block = GaugeMetricFamily(
                "specdist_kv_cache_block_tokens", "Tokens a KV cache block holds", labels=["core"]
            )
            for core, u in usage.items():
                perc.add_metric([core], u["blocks_used"] / max(1, u["blocks_total"]))
                blocks.add_metric([core], u["blocks_total"])
                block.add_metric([core], u["block_size"])
            yield perc
            yield blocks
            yield block
        size = self.suffix_size() if self.suffix_size is not None else None
        if size is not None:  # the in-process drafter's suffix index (bounded by draft.suffix_cache_*)
            yield GaugeMetricFamily(
                "specdist_suffix_index_nodes", "Nodes of the draft's suffix index", value=size["nodes"]
            )
            yield GaugeMetricFamily(
                "specdist_suffix_index_cached_tokens",
                "Tokens of the finished requests the suffix index keeps",
                value=size["cached_tokens"],
            )


def _per_replica(gauge: GaugeMetricFamily, counts: dict[str, int]) -> GaugeMetricFamily:
    """``gauge`` with one sample per draft replica of ``counts`` (keys as ``kv_slots_in_use()``)."""
    per_replica = {k.split("/", 1)[1]: v for k, v in counts.items() if k.startswith("draft/")}
    if not per_replica and "draft" in counts:  # one replica: the engine reports only the total
        per_replica = {"0": counts["draft"]}
    for rep, v in sorted(per_replica.items()):
        gauge.add_metric([rep], v)
    return gauge
