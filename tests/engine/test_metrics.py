"""Prometheus metrics (specdist.api.metrics) read from the scheduler's step events: over a known
workload the counters' deltas equal the per-request stats, and every histogram received one
observation per request or per step."""

from __future__ import annotations

import argparse
import logging
import socket
import urllib.request
from collections import Counter as Tally

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.helpers import LoopThread, model_drafter, tiny_config

from specdist import Engine, SamplingParams
from specdist.api.metrics import FINISH_REASONS, Metrics
from specdist.api.serve_command import run_serve
from specdist.api.serving import start_serving
from specdist.client import SpecDistClient
from specdist.cores.target import LocalVerifier
from specdist.engine.output_processor import PHASES, RequestFinished, StepEvent
from specdist.engine.prompts import EncodedPrompt
from specdist.engine.scheduler import Scheduler
from specdist.errors import ListenError

K = 3
TIME_TOL = 1e-9  # histogram sums against the same floats summed in another order


def parse(body: bytes | str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition body."""
    text = body.decode() if isinstance(body, bytes) else body
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def scrape(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=")  # the text exposition format
    return parse(body)


def value(samples: dict, name: str, **labels: str) -> float:
    """A sample's value (0 when absent: a labelled counter that was never incremented)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_counter_deltas_equal_the_per_request_stats(tiny_models) -> None:
    # batch 2: of the 4 requests two wait at first, so queue times and the waiting gauge are exercised
    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=K, max_batch_size=2))
    metrics = Metrics(eng)
    events: list[StepEvent] = []
    eng.listeners.append(lambda e: events.append(e) if isinstance(e, StepEvent) else None)
    # earlier traffic: the deltas must not depend on what the counters held before
    greedy = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[4]
    steps0, events0 = eng.stats.steps, len(events)
    before = scrape(metrics)

    reqs = [  # the first two are admitted at once, the others wait for their slots
        eng.add_request([4, 5], SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)),  # abort
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)),  # length
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at])),  # stop
        eng.add_request([2, 6, 1, 3], SamplingParams(max_tokens=9, temperature=0.8, seed=3)),
    ]
    eng.step()
    mid = scrape(metrics)
    assert value(mid, "specdist_num_requests_running") == 2 and value(mid, "specdist_num_requests_waiting") == 2
    assert value(mid, "specdist_target_kv_slots_used") == 2
    assert value(mid, "specdist_draft_kv_slots_used", replica="0") == 2
    eng.step()
    assert eng.abort(reqs[0].request_id)  # after two steps (40 tokens take more)
    while eng.has_unfinished():
        eng.step()
    after = scrape(metrics)

    ms = [r.metrics for r in reqs]
    reasons = Tally(r.output.finish_reason for r in reqs)
    assert reasons["length"] >= 1 and reasons["stop"] >= 1 and reasons["abort"] == 1
    for reason in FINISH_REASONS:
        assert delta(after, before, "specdist_request_success_total", finished_reason=reason) == reasons[reason]
    assert delta(after, before, "specdist_prompt_tokens_total") == sum(len(r.prompt_ids) for r in reqs)
    assert delta(after, before, "specdist_generation_tokens_total") == sum(len(r.output.token_ids) for r in reqs)

    # speculative decoding: one replica (label "0"), exact against the requests' own counts
    sd = "specdist_spec_decode_"
    assert sum(m.drafted for m in ms) > 0 and sum(m.accepted for m in ms) > 0  # the workload drafts and accepts
    assert delta(after, before, sd + "num_drafts_total", replica="0") == sum(m.drafts for m in ms)
    assert delta(after, before, sd + "num_draft_tokens_total", replica="0") == sum(m.drafted for m in ms)
    assert delta(after, before, sd + "num_accepted_tokens_total", replica="0") == sum(m.accepted for m in ms)
    for pos in range(K):
        expected = sum(m.accepted_per_pos[pos] for m in ms if len(m.accepted_per_pos) > pos)
        got = delta(after, before, sd + "num_accepted_tokens_per_pos_total", replica="0", position=str(pos))
        assert got == expected, pos
    for m in ms:  # acceptance is a prefix: per-position counts add up to the accepted total
        assert sum(m.accepted_per_pos) == m.accepted and len(m.accepted_per_pos) <= K

    # one observation per request
    def hist(name: str) -> tuple[float, float]:
        return delta(after, before, name + "_count"), delta(after, before, name + "_sum")

    count, total = hist("specdist_time_to_first_token_seconds")
    assert count == len(reqs) and total == pytest.approx(sum(m.time_to_first_token for m in ms), abs=TIME_TOL)
    count, total = hist("specdist_e2e_request_latency_seconds")
    assert count == len(reqs) and total == pytest.approx(sum(m.total_time for m in ms), abs=TIME_TOL)
    count, total = hist("specdist_request_queue_time_seconds")
    assert count == len(reqs) and total == pytest.approx(sum(m.queue_time for m in ms), abs=TIME_TOL)
    assert max(m.queue_time for m in ms) > 0  # two requests waited for a slot
    count, _ = hist("specdist_time_per_output_token_seconds")
    assert count == sum(1 for m in ms if m.output_tokens > 1)
    # every step gave each request tokens or finished it (no stop strings): steps - 1 gaps each
    count, _ = hist("specdist_inter_step_latency_seconds")
    assert count == sum(m.steps - 1 for m in ms)

    # one observation per step
    steps = events[events0:]
    assert len(steps) == eng.stats.steps - steps0 > 0
    assert hist("specdist_step_duration_seconds") == (
        len(steps),
        pytest.approx(sum(e.step_s for e in steps), abs=TIME_TOL),
    )
    for phase in PHASES:
        count, total = (
            delta(after, before, "specdist_step_phase_seconds_count", phase=phase),
            delta(after, before, "specdist_step_phase_seconds_sum", phase=phase),
        )
        assert count == len(steps) and total == pytest.approx(sum(e.phase_s[phase] for e in steps), abs=TIME_TOL)
    # every verified request-step is one step of one request
    assert hist("specdist_step_batch_size") == (len(steps), sum(m.steps for m in ms))
    assert sum(len(e.requests) for e in steps) == sum(m.steps for m in ms)
    assert value(after, "specdist_spec_decode_realized_speedup") > 0

    # everything released: the gauges are back to zero
    for name in ("specdist_num_requests_running", "specdist_num_requests_waiting", "specdist_target_kv_slots_used"):
        assert value(after, name) == 0, name
    assert value(after, "specdist_draft_kv_slots_used", replica="0") == 0


def test_two_draft_replicas_have_their_own_series(tiny_models) -> None:
    """The scheduler over one target and two in-process draft replicas (a copy of the draft each)."""
    from specdist.cores.draft import LocalDrafter
    from specdist.models.loader import load_model, resolve_model

    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=K))
    cfg = eng.config
    src = resolve_model(tiny_models["draft"], "draft.model")
    cores = [
        model_drafter(
            load_model(src, cfg.draft.dtype),
            cfg.engine.max_batch_size,
            cfg.engine.max_model_len,
            cfg.draft.confidence_threshold,
        )
        for _ in range(2)
    ]
    sched = Scheduler(
        cfg,
        LocalVerifier(eng.target_core),
        [LocalDrafter(c, f"draft/{i}") for i, c in enumerate(cores)],
        eng.tokenizer,
        eng.scheduler.eos_ids,
    )
    metrics = Metrics(sched)
    reqs = [
        sched.add_request(
            EncodedPrompt(None, [1 + i, 2, 3]), SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True)
        )
        for i in range(4)
    ]
    sched.step()
    mid = scrape(metrics)
    assert sorted(r.replica for r in reqs) == [0, 0, 1, 1]  # unmeasured replicas: spread by load
    for i in ("0", "1"):
        assert value(mid, "specdist_draft_kv_slots_used", replica=i) == 2
    while sched.has_unfinished():
        sched.step()
    after = scrape(metrics)
    sd = "specdist_spec_decode_"
    for i in (0, 1):
        mine = [r.metrics for r in reqs if r.replica == i]
        assert value(after, sd + "num_draft_tokens_total", replica=str(i)) == sum(m.drafted for m in mine) > 0
        assert value(after, sd + "num_accepted_tokens_total", replica=str(i)) == sum(m.accepted for m in mine)
        assert value(after, sd + "num_drafts_total", replica=str(i)) == sum(m.drafts for m in mine)
        assert value(after, "specdist_draft_kv_slots_used", replica=str(i)) == 0
    sched.close()


def test_a_failing_listener_is_logged_and_the_step_goes_on(tiny_models, caplog) -> None:
    eng = Engine.from_config(tiny_config(tiny_models, method="model", k=K))
    expected = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]

    def broken(event) -> None:
        raise RuntimeError("listener bug")

    seen: list = []
    eng.listeners += [broken, seen.append]
    with caplog.at_level(logging.ERROR, logger="specdist.engine.output_processor"):
        out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == expected.token_ids and out.finish_reason == "length"
    steps = [e for e in seen if isinstance(e, StepEvent)]
    finished = [e for e in seen if isinstance(e, RequestFinished)]
    assert len(steps) == out.metrics.steps and len(finished) == 1  # the listener after the broken one got them all
    assert finished[0].finish_reason == "length" and finished[0].metrics.output_tokens == 6
    assert "listener bug" in caplog.text


def test_served_metrics_count_the_grpc_requests_and_not_the_warm_up(tiny_models) -> None:
    lt = LoopThread()
    serving = lt.run(start_serving(tiny_config(tiny_models, method="model", k=K), port=0, metrics_port=0))
    try:
        coordinator = serving.server.coordinator
        url = f"http://127.0.0.1:{serving.metrics_port}/metrics"
        before = parse(urllib.request.urlopen(url, timeout=10).read())
        assert parse(coordinator.metrics.render()[0]).keys() == before.keys()  # the same registry
        for reason in FINISH_REASONS:  # the warm-up request is not counted
            assert value(before, "specdist_request_success_total", finished_reason=reason) == 0
        assert value(before, "specdist_time_to_first_token_seconds_count") == 0
        with SpecDistClient(serving.address) as client:
            stats = [client.generate_text([1, 2, 3], max_tokens=n, temperature=0, ignore_eos=True)[3] for n in (4, 7)]
        # the counters were updated on the engine thread before the last message was posted
        after = parse(urllib.request.urlopen(url, timeout=10).read())
        assert delta(after, before, "specdist_request_success_total", finished_reason="length") == 2
        sd = "specdist_spec_decode_"
        assert delta(after, before, sd + "num_draft_tokens_total", replica="0") == sum(s.drafted for s in stats)
        assert delta(after, before, sd + "num_accepted_tokens_total", replica="0") == sum(s.accepted for s in stats)
        assert delta(after, before, "specdist_generation_tokens_total") == 4 + 7
        for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
            assert delta(after, before, f"specdist_{name}_seconds_count") == 2, name
        assert value(after, "specdist_num_requests_running") == 0
        assert value(after, "specdist_target_kv_slots_used") == 0
    finally:
        lt.run(serving.stop(0))
        lt.close()
    assert serving.metrics_server is None  # stopped with the server


def test_serve_refuses_a_busy_metrics_port_before_loading(tiny_models) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        args = argparse.Namespace(
            config=tiny_config(tiny_models),
            host="127.0.0.1",
            port=0,
            metrics_port=busy,
            max_queued=4,
            drain_seconds=0.0,
        )
        with pytest.raises(ListenError, match=f"127.0.0.1:{busy}: the port is in use"):
            run_serve(args)


def test_kv_cache_gauges_report_blocks_and_their_use(tiny_models) -> None:
    """An in-process engine's KV caches in the metrics: a paged target's blocks (the scratch block aside), their
    size and the share in use while requests run; a slot draft cache in slots."""
    eng = Engine.from_config(
        tiny_config(
            tiny_models, method="model", k=K, max_batch_size=4, kv_cache="paged", kv_block_size=4, prefix_caching=False
        )
    )
    metrics = Metrics(eng)
    idle = scrape(metrics)
    blocks = eng.target_core.cache.num_blocks - 1
    assert value(idle, "specdist_kv_cache_blocks", core="target") == blocks
    assert value(idle, "specdist_kv_cache_block_tokens", core="target") == 4
    assert value(idle, "specdist_kv_cache_usage_perc", core="target") == 0
    assert value(idle, "specdist_kv_cache_blocks", core="draft") == eng.draft_core.cache.usage()["blocks_total"]
    eng.add_request([1, 2, 3, 4, 5, 6, 1, 2, 3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.step()
    busy = scrape(metrics)
    used = eng.target_core.cache.blocks_in_use
    assert used >= 3 and value(busy, "specdist_kv_cache_usage_perc", core="target") == pytest.approx(used / blocks)
    while eng.has_unfinished():
        eng.step()
    assert value(scrape(metrics), "specdist_kv_cache_usage_perc", core="target") == 0
    health = eng.target_core.health()
    assert (health["kv_blocks_total"], health["kv_block_size"], health["kv_blocks_used"]) == (blocks, 4, 0)


def test_the_suffix_index_size_is_reported(tiny_models) -> None:
    eng = Engine.from_config(tiny_config(tiny_models, method="suffix", k=K))
    metrics = Metrics(eng)
    assert value(scrape(metrics), "specdist_suffix_index_cached_tokens") == 0
    eng.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    after = scrape(metrics)
    size = eng.suffix_index_size()  # the finished request: its prompt and the output the drafter was told of
    assert value(after, "specdist_suffix_index_cached_tokens") == size["cached_tokens"] >= 6
    assert value(after, "specdist_suffix_index_nodes") == size["nodes"] > 0
