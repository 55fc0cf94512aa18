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

``--json PATH`` writes ``{"schema": "specdist.bench.router/1", "settings": {...}, "results": [PolicyResult
as a dict], "ratios": {"round-robin": {policy: {metric: ratio}}, "least-loaded": {...}}}`` (a metric not
measured, or whose reference is 0: null).
"""

from __future__ import annotations

import argparse
import json
import sys

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
    if not 0 < args.load <= 4:
        raise SpecDistError(f"--load must be in (0, 4], got {args.load}")
    from specdist.bench.router_sim import COST_MODELS, simulate

    router_cfg = load_config(args.config).router
    closed = {"clients": args.clients, "requests": args.requests, "output_scale": args.output_scale}
    results = [
        simulate(
            p,
            args.workload,
            args.simulate,
            seed=args.seed,
            load_factor=args.load,
            model=COST_MODELS[args.cost_model],
            router_config=router_cfg,
            **(closed if args.clients is not None else {}),
        )
        for p in policies
    ]
    arrivals = (
        f"{args.clients} clients, output scale {args.output_scale:g}"
        if args.clients is not None
        else f"load {args.load:g}"
    )
    header = (
        f"workload {args.workload}, {args.simulate} simulated replicas ({args.cost_model} costs), "
        f"{results[0].requests} requests, {arrivals}, seed {args.seed}"
    )
    settings = {
        "workload": args.workload,
        "replicas": args.simulate,
        "policies": policies,
        "cost_model": args.cost_model,
        "load": args.load if args.clients is None else None,
        **(closed if args.clients is not None else {}),
        "seed": args.seed,
        "config": args.config,
        "router": {
            "stats_period_s": router_cfg.stats_period_s,
            "session_blocks": router_cfg.session_blocks,
            "imbalance_threshold": vars(router_cfg.imbalance_threshold),
        },
    }
    report(results, header, settings, args.json)
    return 0


def check_counts(args: argparse.Namespace) -> None:
    for flag, v, least in (
        ("--requests", args.requests, 1),
        ("--clients", args.clients, 1),
        ("--max-text-words", args.max_text_words, 0),
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
    results, skipped = [], []
    for p in policies:  # (each policy's replicas on a local Ray cluster of their own, unless --ray-address)
        r, skipped = run_policy(
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
        )
        results.append(r)
    header = (
        f"workload {args.workload}, {cfg.cluster.replica_plan.min} replicas of {args.config}, "
        f"{results[0].requests} requests ({len(skipped)} turns too long for engine.max_model_len left out), "
        f"{args.clients} clients, output scale {args.output_scale:g}, temperature {args.temperature:g}"
        + (f", texts cut to {args.max_text_words} words" if args.max_text_words else "")
    )
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
        "skipped": skipped,
        "router": {
            "stats_period_s": cfg.router.stats_period_s,
            "session_blocks": cfg.router.session_blocks,
            "imbalance_threshold": vars(cfg.router.imbalance_threshold),
        },
    }
    report(results, header, settings, args.json)
    return 0


def report(results: list, header: str, settings: dict, json_path: str | None) -> None:
    """Print the policies' figures and their ratios to round-robin and least-loaded; ``--json`` too."""
    print(header)
    print(
        f"{'policy':<13} {'tok/step':>8} {'accept':>7} {'hit tokens':>11} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'e2e p50':>8} {'e2e p99':>8} {'tok/s':>9}"
    )
    for r in results:
        hits = "-" if r.prefix_hit_tokens is None else f"{r.prefix_hit_tokens:d}"
        print(
            f"{r.policy:<13} {r.tokens_per_step:>8.2f} {r.acceptance:>7.1%} {hits:>11} "
            f"{r.ttft_p50 * 1e3:>7.0f}ms {r.ttft_p99 * 1e3:>7.0f}ms {r.e2e_p50:>7.2f}s {r.e2e_p99:>7.2f}s "
            f"{r.tokens_per_s:>9.1f}"
        )
    all_ratios = {base: ratios(results, base) for base in ("round-robin", "least-loaded")}
    for base, table in all_ratios.items():
        if not table:
            continue
        print(f"ratios to {base}:")
        for policy, row in table.items():
            if policy != base:
                print(f"  {policy:<13} " + " ".join(f"{m}={'-' if v is None else f'{v:.2f}x'}" for m, v in row.items()))
    if json_path:
        doc = {
            "schema": "specdist.bench.router/1",
            "settings": settings,
            "results": [r.to_dict() for r in results],
            "ratios": all_ratios,
        }
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        print(f"json: {json_path}", file=sys.stderr)
