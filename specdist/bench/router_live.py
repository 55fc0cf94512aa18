"""``specdist bench router`` on real replicas: one workload through each policy, the replicas brought up afresh
for each (``cluster.replicas`` of ``--config``, the policy set in its ``router:`` section), so no policy starts
with the caches another left.

The workload (:mod:`specdist.bench.router_workloads`) is cut to its first ``--requests`` requests in file order
(whole sessions, the last one cut short) and sized for the replicas' models:

- texts are tokenized by the target's tokenizer, without a chat template; a session's turn n is sent as turn
  n-1's prompt ids, the output ids the replica gave it and turn n's new text (its ``user`` part), so each
  prompt extends the last prompt and answer token for token, as a chat client's next turn does; with
  ``--max-text-words W`` each request's new text is cut to its first W words (small models' short contexts);
- a request asks for ``max(1, round(output_tokens x --output-scale))`` tokens (``ignore_eos``: each makes that
  many), seeded sampling at ``--temperature`` (the seed from its id: the same tokens on any replica, so every
  policy sends the same prompts); a turn that would not fit ``engine.max_model_len`` ends its session there;
- ``--clients`` concurrent clients, each taking the next session (or single request) when it finished its last,
  and sending a session's turns one after the other (a closed loop, no think time); sessions carry their id as
  the request's session (``ReplicaFront.open(session=...)``: the router's affinity key) and every request its
  workload kind (``open(kind=...)``: ``edit``, ``write``, ``chat``; the replicas measure tokens a step per kind,
  which the ``speculative`` policy reads), as the simulator's requests carry theirs;
- with ``--warmup W``, W requests after the measured ones (:func:`warmup_plan`) go first through the same router
  and clients, unmeasured: a steady state (replicas past their first-call costs, the router on measured costs)
  rather than a cold start.

Measured per request on the client side: TTFT and end to end from just before ``open`` to its first token and
its end; from the final delta's :class:`~specdist.engine.request.RequestMetrics`: verification steps, tokens
they emitted, drafts and accepted drafts. Prefix-cache hit tokens: prompt tokens whose K/V the replicas' target
ranks took from their prefix caches during the run (``prefix_reused_tokens`` of rank 0's health, which each
replica reports in its routing stats' counters; the difference over the run, summed over the replicas).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from specdist.bench.router_sim import PolicyResult, percentile
from specdist.bench.router_workloads import first_requests
from specdist.errors import SpecDistError

REPORT_WAIT_S = 120.0  # the longest wait for the replicas' routing reports (before and after a run)


@dataclass(frozen=True)
class LiveTurn:
    """One request of the cut workload: the text it adds (turn 0: its whole prompt) and the tokens it asks for."""

    rid: str
    session: str | None
    kind: str
    text: str
    max_tokens: int


@dataclass
class LiveResult:
    """One request as it ran."""

    rid: str
    replica: str
    prompt_tokens: int
    output_tokens: int
    sent: float
    first: float
    end: float
    steps: int
    emitted: int
    drafted: int
    accepted: int


@dataclass
class Plan:
    groups: list[list[LiveTurn]]
    skipped: list[str] = field(default_factory=list)  # turns not sent: their prompt would not fit


def plan(workload: str, requests: int, output_scale: float, max_words: int = 0) -> Plan:
    """The workload's first ``requests`` requests, grouped by session (module docstring); ``max_words``: each
    request's new text cut to its first that many words (0: whole)."""
    groups: list[list[LiveTurn]] = []
    for gi, group in enumerate(first_requests(workload, requests, output_scale)):
        turns, prev = [], None
        for t in group:
            new = t.prompt if prev is None else t.prompt[len(prev.prompt) + len(prev.answer) :]
            new = new[:max_words] if max_words else new
            rid = f"{t.session or f'r{gi:04d}'}-t{t.turn}"
            turns.append(LiveTurn(rid, t.session, t.kind, " ".join(new), t.max_tokens))
            prev = t
        groups.append(turns)
    return Plan(groups)


def warmup_plan(workload: str, requests: int, warmup: int, output_scale: float, max_words: int = 0) -> Plan:
    """The requests a warm-up sends before the measured ``requests``: the workload's next ``warmup`` requests
    after the sessions the measured ones belong to (the measured cut's session is skipped, not finished; the
    warm-up's last session is cut short; fewer where the workload ends), so that no warm-up turn extends a
    measured session and the measured requests are the same with or without it. What it is for: the replicas'
    first-call costs paid and each replica's step, prefill and tokens a step by kind measured before the run,
    so the run's first requests are routed on measurements (steady state), not on the router's cold-start
    priors, under every policy alike."""
    if warmup <= 0:
        return Plan([])
    measured = len(plan(workload, requests, output_scale, max_words).groups)
    whole = plan(workload, 1 << 30, output_scale, max_words).groups[:measured]  # (the cut session whole)
    skip = sum(len(g) for g in whole)
    return Plan(plan(workload, skip + warmup, output_scale, max_words).groups[measured:])


def request_seed(rid: str, salt: str = "") -> int:
    """A request's sampling seed, from its id (and ``salt``): the same on any replica and under any policy."""
    return zlib.crc32((salt + rid).encode()) & 0x7FFFFFFF


def extend_prompt(tokenizer: Any, ids: list[int], text: str) -> list[int]:
    """A session's next prompt: the ids so far (the last prompt and its output) and the new text's."""
    return ids + list(tokenizer.encode((" " if ids else "") + text, add_special_tokens=False))


async def run_clients(
    front: Any, tokenizer: Any, p: Plan, clients: int, temperature: float, max_model_len: int
) -> list[LiveResult]:
    """Send the plan's requests through ``front`` (a :class:`~specdist.api.replica_set.ReplicaFront`)."""
    from specdist.sampling_params import SamplingParams

    queue = list(reversed(p.groups))
    done: list[LiveResult] = []

    async def one(turn: LiveTurn, ids: list[int]) -> tuple[LiveResult, list[int]]:
        params = SamplingParams(
            temperature=temperature, max_tokens=turn.max_tokens, ignore_eos=True, seed=request_seed(turn.rid)
        )
        sent = time.perf_counter()
        stream = await front.open(ids, params, request_id=turn.rid, session=turn.session, kind=turn.kind)
        out: list[int] = []
        first = None
        final = None
        try:
            async for d in stream:
                if d.token_ids and first is None:
                    first = time.perf_counter()
                out += d.token_ids
                if d.finished:
                    final = d
        finally:
            stream.close()
        end = time.perf_counter()
        if final is None or final.finish_reason not in ("stop", "length"):
            why = "no final delta" if final is None else f"{final.finish_reason}: {final.error or final.message}"
            raise SpecDistError(f"request {turn.rid} failed ({why})")
        m = final.metrics
        return LiveResult(
            turn.rid,
            stream.replica_id,
            len(ids),
            len(out),
            sent,
            first or end,
            end,
            m.steps if m else 0,
            m.emitted if m else 0,
            m.drafted if m else 0,
            m.accepted if m else 0,
        ), out

    async def client() -> None:
        while queue:
            group = queue.pop()
            ids: list[int] = []
            for turn in group:
                ids = extend_prompt(tokenizer, ids, turn.text)
                if len(ids) + turn.max_tokens > max_model_len:
                    p.skipped += [t.rid for t in group[group.index(turn) :]]
                    break
                r, out = await one(turn, ids)
                done.append(r)
                ids = ids + out

    await asyncio.gather(*(client() for _ in range(clients)))
    return done


def reused_tokens(report: dict) -> int:
    """A replica's report's ``prefix_reused_tokens`` (rank 0's prefix-cache hits so far)."""
    return int((report.get("counters") or {}).get("prefix_reused_tokens", 0))


def describe_costs(rid: str, report: dict) -> str:
    """A replica's measured costs as its report gives them to the router (one line for the bench's log)."""
    tps = ", ".join(f"{k} {v:.2f}" for k, v in sorted(report.get("tokens_per_step", {}).items()))
    return (
        f"{rid}: step {1000 * report.get('step_s', 0.0):.1f} ms + {1000 * report.get('step_s_per_request', 0.0):.1f}"
        f" ms a request, prefill {1e6 * report.get('prefill_s_per_token', 0.0):.0f} us a token, tokens a step: {tps}"
    )


async def wait_reports(reports: Any, replicas: int, after: float, rounds: int) -> dict[str, dict]:
    """Each replica's latest report once ``replicas`` replicas each reported ``rounds`` times after ``after``
    (``time.time()``): a report carries rank 0's answer to the question the report before it asked."""
    seen: dict[str, set] = {}
    deadline = time.monotonic() + REPORT_WAIT_S
    while True:
        for rid, (_, r) in list(reports.reports.items()):
            if r.get("reported_at", 0.0) > after:
                seen.setdefault(rid, set()).add(r["reported_at"])
        ready = [rid for rid, ts in seen.items() if len(ts) >= rounds]
        if len(ready) >= replicas:
            return {rid: reports.reports[rid][1] for rid in ready}
        if time.monotonic() > deadline:
            raise SpecDistError(
                f"{len(ready)} of {replicas} replicas reported {rounds} times within {REPORT_WAIT_S:g}s"
            )
        await asyncio.sleep(0.05)


def run_policy(
    policy: str,
    config: dict,
    workload: str,
    requests: int,
    clients: int,
    output_scale: float,
    temperature: float,
    ray_address: str | None,
    log: Callable[[str], None],
    max_words: int = 0,
    warmup: int = 0,
) -> tuple[PolicyResult, list[str]]:
    """Bring ``config``'s replicas up with ``policy``, run the cut workload through them, take them down:
    the policy's figures and the turns not sent. ``warmup``: first run about that many requests
    (:func:`warmup_plan`) through the same router and clients, not measured."""
    from specdist.api.serving import start_backend
    from specdist.bench.cluster_bench import apply_overrides
    from specdist.config import load_config

    cfg = load_config(apply_overrides(config, {"router": {"policy": policy}}))
    if cfg.cluster.replicas is None or not cfg.cluster.enabled:
        raise SpecDistError("bench router without --simulate needs cluster.enabled and cluster.replicas in --config")
    replicas = cfg.cluster.replica_plan.min
    log(f"[{policy}] bringing up {replicas} replica(s)")
    backend = start_backend(cfg, ray_address, log=log)
    try:
        front, reports = backend.replicas.front, backend.replicas.reports
        p = plan(workload, requests, output_scale, max_words)
        warm = warmup_plan(workload, requests, warmup, output_scale, max_words)

        async def drive() -> tuple[list[LiveResult], int]:
            try:
                if warm.groups:
                    await wait_reports(reports, replicas, time.time(), 1)
                    w = await run_clients(
                        front, front.engine.tokenizer, warm, clients, temperature, cfg.engine.max_model_len
                    )
                    log(f"[{policy}] warm-up: {len(w)} requests, not measured")
                before = await wait_reports(reports, replicas, time.time(), 2)
                t0 = time.perf_counter()
                done = await run_clients(
                    front, front.engine.tokenizer, p, clients, temperature, cfg.engine.max_model_len
                )
                log(f"[{policy}] {len(done)} requests in {time.perf_counter() - t0:.1f}s")
                after = await wait_reports(reports, replicas, time.time(), 2)
                for rid, report in sorted(after.items()):
                    log(f"[{policy}] {describe_costs(rid, report)}")
                hits = sum(reused_tokens(r) for r in after.values())
                return done, hits - sum(reused_tokens(before[rid]) for rid in after if rid in before)
            finally:
                await front.close()

        done, hits = asyncio.run(drive())
    finally:
        backend.close()
    return summarize(policy, done, hits), p.skipped


def summarize(policy: str, done: list[LiveResult], hit_tokens: int | None) -> PolicyResult:
    """The requests' figures as :class:`~specdist.bench.router_sim.PolicyResult` (the simulated bench's)."""
    if not done:
        raise SpecDistError(f"[{policy}] no request ran (every prompt longer than engine.max_model_len?)")
    out = sum(r.output_tokens for r in done)
    t0, t1 = min(r.sent for r in done), max(r.end for r in done)
    steps, drafted = sum(r.steps for r in done), sum(r.drafted for r in done)
    choices: dict[str, int] = {}
    for r in done:
        choices[r.replica] = choices.get(r.replica, 0) + 1
    ttft = [r.first - r.sent for r in done]
    e2e = [r.end - r.sent for r in done]
    return PolicyResult(
        policy,
        len(done),
        out,
        sum(r.emitted for r in done) / max(1, steps),
        sum(r.accepted for r in done) / max(1, drafted),
        hit_tokens,
        sum(r.prompt_tokens for r in done),
        percentile(ttft, 50),
        percentile(ttft, 99),
        percentile(e2e, 50),
        percentile(e2e, 99),
        out / (t1 - t0),
        t1 - t0,
        dict(sorted(choices.items())),
    )
