"""``specdist bench router``: one workload through each routing policy in turn, on the same replicas.

    specdist bench router --simulate 32 --workload sessions --policies speculative,round-robin,least-loaded,prefix
    specdist bench router --config configs/replicas.yaml --workload sessions --requests 32

Per policy: tokens per target step (emitted / verification steps, over all requests), acceptance (accepted
/ drafted), prefix-cache hit tokens, TTFT p50 / p99, end-to-end p50 / p99 (seconds from arrival), output
tokens/s (all output tokens / first arrival to last finish); then each policy's ratios to ``round-robin``
and ``least-loaded`` (those in the run).

``--simulate N``: N simulated replicas (:mod:`specdist.bench.router_sim`) on a simulated clock, the router of
:mod:`specdist.api.router` deciding; the ``router:`` section of ``--config`` (if given) sets everything but the
policy; ``--cost-model``: the replicas' costs (``gpu``: an 8 B target on an H100-class GPU, assumed; ``cpu``: the
live replicas of configs/replicas.yaml as measured); sessions arrive at ``--load`` of the estimated capacity, or,
with ``--clients C``, as the live bench sends them (C closed-loop clients, ``--requests``, ``--output-scale``).
Without it: the real replicas of ``--config`` (``cluster.replicas``) on Ray Serve, brought up afresh for
each policy, ``--requests`` requests of the workload sent by ``--clients`` clients through the replicas' front
(:mod:`specdist.bench.router_live`; a local Ray cluster unless ``--ray-address``).

``--rounds R``: the whole comparison R times, each round side by side (live: the policies run in the given order
in even rounds and reversed in odd ones, so that neither always runs first on a drifting machine; simulated: seeds
``--seed`` + 0 ... R - 1), then each ratio's median and range over the rounds: one p99 of 32 requests is one
request, so a verdict on a ratio wants several rounds.

``--json PATH`` writes ``{"schema": "specdist.bench.router/2", "settings": {...}, "rounds": [{"order":
[policy ...], "results": [PolicyResult as a dict], "ratios": {"round-robin": {policy: {metric: ratio}},
"least-loaded": {...}}}], "median_ratios": {base: {policy: {metric: [median, min, max]}}}}`` (a metric not
measured, or whose reference is 0: null; ``median_ratios`` over the rounds where it was measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import NamedTuple

from specdist.config import ROUTER_POLICIES
from specdist.errors import SpecDistError

METRICS = (
    "tokens_per_step",
    "acceptance",
    "prefix_hit_tokens",
    "ttft_p50",
    "ttft_p99",
    "e2e_p50",
    "e2e_p99",
    "tokens_per_s",
)
BASES = ("round-robin", "least-loaded")  # the policies every other is compared with


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdist.bench.router_workloads import WORKLOADS

    p.add_argument("--config", default=None, help="config whose router: section is used (default: defaults)")
    p.add_argument(
        "--policies",
        default=",".join(("speculative", "round-robin", "least-loaded", "prefix")),
        help=f"comma-separated, of: {', '.join(ROUTER_POLICIES)}",
    )
    p.add_argument("--workload", choices=WORKLOADS, default="sessions")
    p.add_argument("--simulate", type=int, default=None, metavar="N", help="N simulated replicas")
    p.add_argument("--load", type=float, default=0.7, help="offered load, a share of the estimated capacity")
    p.add_argument(
        "--cost-model", choices=("gpu", "cpu"), default="gpu", help="the simulated replicas' costs (with --simulate)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the comparison this many times (live: alternating the policies' order; simulated: seeds --seed "
        "onwards) and print each ratio's median over the rounds",
    )
    live = p.add_argument_group("real replicas (without --simulate; with it and --clients, the same closed loop)")
    live.add_argument("--requests", type=int, default=32, help="the workload's first N requests (whole sessions)")
    live.add_argument(
        "--clients",
        type=int,
        default=None,
        help="concurrent clients, each sending a session's turns in turn (default 4; with --simulate: open loop)",
    )
    live.add_argument(
        "--output-scale",
        type=float,
        default=0.1,
        help="a request asks for this share of the workload's output tokens (at least 1)",
    )
    live.add_argument(
        "--max-text-words",
        type=int,
        default=0,
        metavar="W",
        help="cut each request's new text to its first W words (default 0: whole)",
    )
    live.add_argument(
        "--warmup",
        type=int,
        default=0,
        metavar="W",
        help="real replicas: first send about W of the workload's next requests through the same router, not measured",
    )
    live.add_argument("--temperature", type=float, default=0.8, help="seeded sampling (the seed from the request id)")
    live.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")


def parse_policies(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in ROUTER_POLICIES:
            raise SpecDistError(f"--policies: unknown policy {n!r} (expected: {', '.join(ROUTER_POLICIES)})")
    if not names or len(set(names)) != len(names):
        raise SpecDistError(f"--policies: give each policy once, got {text!r}")
    return names


def ratios(results: list, base: str) -> dict[str, dict[str, float | None]]:
    ref = next((r for r in results if r.policy == base), None)
    if ref is None:
        return {}

    def ratio(a, b) -> float | None:
        return a / b if a is not None and b else None

    return {r.policy: {m: ratio(getattr(r, m), getattr(ref, m)) for m in METRICS} for r in results}


def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    from specdist.config import load_config

    check_counts(args)
    if args.simulate is None:
        return run_live(args, policies)
    if args.simulate < 1:
        raise SpecDistError(f"--simulate must be >= 1, got {args.simulate}")
    if args.warmup:
        raise SpecDistError("--warmup is for real replicas (the simulated ones have no first-call costs)")
    if not 0 < args.load <= 4:
        raise SpecDistError(f"--load must be in (0, 4], got {args.load}")
    from specdist.bench.router_sim import COST_MODELS, simulate

    router_cfg = load_config(args.config).router
    closed = {"clients": args.clients, "requests": args.requests, "output_scale": args.output_scale}
    arrivals = (
        f"{args.clients} clients, output scale {args.output_scale:g}"
        if args.clients is not None
        else f"load {args.load:g}"
    )
    rounds = []
    for i in range(args.rounds):
        seed = args.seed + i
        results = [
            simulate(
                p,
                args.workload,
                args.simulate,
                seed=seed,
                load_factor=args.load,
                model=COST_MODELS[args.cost_model],
                router_config=router_cfg,
                **(closed if args.clients is not None else {}),
            )
            for p in policies
        ]
        header = (
            f"workload {args.workload}, {args.simulate} simulated replicas ({args.cost_model} costs), "
            f"{results[0].requests} requests, {arrivals}, seed {seed}"
        )
        rounds.append(Round(header, policies, results))
        print_round(rounds[-1], i, args.rounds)
    settings = {
        "workload": args.workload,
        "replicas": args.simulate,
        "policies": policies,
        "cost_model": args.cost_model,
        "load": args.load if args.clients is None else None,
        **(closed if args.clients is not None else {}),
        "seed": args.seed,
        "rounds": args.rounds,
        "config": args.config,
        "router": router_settings(router_cfg),
    }
    report(rounds, settings, args.json)
    return 0


def router_settings(router_cfg) -> dict:
    """The ``router:`` settings a run records (all but the policy, which each result names)."""
    return {
        "stats_period_s": router_cfg.stats_period_s,
        "session_blocks": router_cfg.session_blocks,
        "imbalance_threshold": vars(router_cfg.imbalance_threshold),
    }


def check_counts(args: argparse.Namespace) -> None:
    for flag, v, least in (
        ("--rounds", args.rounds, 1),
        ("--requests", args.requests, 1),
        ("--clients", args.clients, 1),
        ("--max-text-words", args.max_text_words, 0),
        ("--warmup", args.warmup, 0),
    ):
        if v is not None and v < least:
            raise SpecDistError(f"{flag} must be >= {least}, got {v}")
    if not args.output_scale > 0:
        raise SpecDistError(f"--output-scale must be > 0, got {args.output_scale}")


def run_live(args: argparse.Namespace, policies: list[str]) -> int:
    """Each policy on the real replicas of ``--config`` (:mod:`specdist.bench.router_live`)."""
    from specdist.bench.router_live import run_policy
    from specdist.config import load_config

    if args.config is None:
        raise SpecDistError("bench router: give --config with cluster.replicas (real replicas) or --simulate N")
    args.clients = 4 if args.clients is None else args.clients
    cfg = load_config(args.config)
    if not cfg.cluster.enabled or cfg.cluster.replicas is None:
        raise SpecDistError(
            f"{args.config}: bench router on real replicas needs cluster.enabled and cluster.replicas (or --simulate N)"
        )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    rounds, skipped = [], []
    for i in range(args.rounds):
        order = policies if i % 2 == 0 else policies[::-1]
        results = {}
        for p in order:  # (each policy's replicas on a local Ray cluster of their own, unless --ray-address)
            if args.rounds > 1:
                log(f"[bench router] round {i + 1} of {args.rounds}: {p}")
            results[p], skipped = run_policy(
                p,
                cfg.to_dict(),
                args.workload,
                args.requests,
                args.clients,
                args.output_scale,
                args.temperature,
                args.ray_address,
                log,
                args.max_text_words,
                args.warmup,
            )
        header = (
            f"workload {args.workload}, {cfg.cluster.replica_plan.min} replicas of {args.config}, "
            f"{results[policies[0]].requests} requests ({len(skipped)} turns too long for engine.max_model_len left "
            f"out), {args.clients} clients, output scale {args.output_scale:g}, temperature {args.temperature:g}"
            + (f", texts cut to {args.max_text_words} words" if args.max_text_words else "")
            + (f", after a warm-up of about {args.warmup} requests" if args.warmup else "")
        )
        rounds.append(Round(header, order, [results[p] for p in policies]))
        print_round(rounds[-1], i, args.rounds)  # (as it ends: a long run cut short keeps what it measured)
    settings = {
        "workload": args.workload,
        "replicas": cfg.cluster.replica_plan.min,
        "policies": policies,
        "config": args.config,
        "requests": args.requests,
        "clients": args.clients,
        "output_scale": args.output_scale,
        "temperature": args.temperature,
        "max_text_words": args.max_text_words,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "skipped": skipped,
        "router": router_settings(cfg.router),
    }
    report(rounds, settings, args.json)
    return 0


class Round(NamedTuple):
    """One side-by-side comparison: its header line, the order the policies ran in, their results (in
    ``--policies`` order)."""

    header: str
    order: list[str]
    results: list


def median_ratios(rounds: list[Round]) -> dict[str, dict[str, dict[str, list[float] | None]]]:
    """base -> policy -> metric -> [median, min, max] of that ratio over the rounds that measured it (None: none)."""
    out: dict[str, dict[str, dict[str, list[float] | None]]] = {}
    for base in BASES:
        tables = [ratios(r.results, base) for r in rounds]
        if not tables[0]:
            continue
        out[base] = {}
        for policy in tables[0]:
            if policy == base:
                continue
            row = {}
            for m in METRICS:
                xs = [t[policy][m] for t in tables if t[policy][m] is not None]
                row[m] = [statistics.median(xs), min(xs), max(xs)] if xs else None
            out[base][policy] = row
    return out


def report(rounds: list[Round], settings: dict, json_path: str | None) -> None:
    """After the rounds (each printed as it ended: :func:`print_round`): each ratio's median and range over them
    (more than one round); ``--json`` too."""
    medians = median_ratios(rounds)
    if len(rounds) > 1:
        for base, table in medians.items():
            print(f"ratios to {base} over {len(rounds)} rounds: median (min-max)")
            for policy, row in table.items():
                cells = (f"{m}=-" if v is None else f"{m}={v[0]:.2f}x ({v[1]:.2f}-{v[2]:.2f})" for m, v in row.items())
                print(f"  {policy:<13} " + " ".join(cells))
    if json_path:
        doc = {
            "schema": "specdist.bench.router/2",
            "settings": settings,
            "rounds": [
                {
                    "order": r.order,
                    "results": [x.to_dict() for x in r.results],
                    "ratios": {base: ratios(r.results, base) for base in BASES},
                }
                for r in rounds
            ],
            "median_ratios": medians,
        }
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        print(f"json: {json_path}", file=sys.stderr)


def print_round(rnd: Round, i: int, n: int) -> None:
    """Round ``i`` (from 0) of ``n``: its header, each policy's figures, and their ratios to round-robin and
    least-loaded."""
    if n > 1:
        print(f"round {i + 1} of {n} (policies run in the order {', '.join(rnd.order)})")
    print(rnd.header)
    print(
        f"{'policy':<13} {'tok/step':>8} {'accept':>7} {'hit tokens':>11} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'e2e p50':>8} {'e2e p99':>8} {'tok/s':>9}"
    )
    for r in rnd.results:
        hits = "-" if r.prefix_hit_tokens is None else f"{r.prefix_hit_tokens:d}"
        print(
            f"{r.policy:<13} {r.tokens_per_step:>8.2f} {r.acceptance:>7.1%} {hits:>11} "
            f"{r.ttft_p50 * 1e3:>7.0f}ms {r.ttft_p99 * 1e3:>7.0f}ms {r.e2e_p50:>7.2f}s {r.e2e_p99:>7.2f}s "
            f"{r.tokens_per_s:>9.1f}"
        )
    for base in BASES:
        table = ratios(rnd.results, base)
        if not table:
            continue
        print(f"ratios to {base}:")
        for policy, row in table.items():
            if policy != base:
                print(f"  {policy:<13} " + " ".join(f"{m}={'-' if v is None else f'{v:.2f}x'}" for m, v in row.items()))
    sys.stdout.flush()
