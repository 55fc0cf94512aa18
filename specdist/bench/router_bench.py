"""``specdist bench router``: one workload through each routing policy in turn, on the same replicas.

    specdist bench router --simulate 32 --workload sessions --policies speculative,round-robin,least-loaded,prefix

Per policy: tokens per target step (emitted / verification steps, over all requests), acceptance (accepted
/ drafted), prefix-cache hit tokens, TTFT p50 / p99, end-to-end p50 / p99 (seconds from arrival), output
tokens/s (all output tokens / first arrival to last finish); then each policy's ratios to ``round-robin``
and ``least-loaded`` (those in the run). ``--simulate N``: N simulated replicas
(:mod:`specdist.bench.router_sim`) on a simulated clock, the router of :mod:`specdist.api.router`
deciding. The ``router:`` section of ``--config`` (if given) sets everything but the policy.

``--json PATH`` writes ``{"schema": "specdist.bench.router/1", "settings": {...}, "results": [PolicyResult
as a dict], "ratios": {"round-robin": {policy: {metric: ratio}}, "least-loaded": {...}}}``.
"""

from __future__ import annotations

import argparse
import json
import sys

from specdist.config import ROUTER_POLICIES
from specdist.errors import SpecDistError

METRICS = ("tokens_per_step", "acceptance", "prefix_hit_tokens", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99",
           "tokens_per_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdist.bench.router_workloads import WORKLOADS

    p.add_argument("--config", default=None, help="config whose router: section is used (default: defaults)")
    p.add_argument("--policies", default=",".join(("speculative", "round-robin", "least-loaded", "prefix")),
                   help=f"comma-separated, of: {', '.join(ROUTER_POLICIES)}")
    p.add_argument("--workload", choices=WORKLOADS, default="sessions")
    p.add_argument("--simulate", type=int, default=None, metavar="N", help="N simulated replicas")
    p.add_argument("--load", type=float, default=0.7, help="offered load, a share of the estimated capacity")
    p.add_argument("--seed", type=int, default=0)
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
    return {r.policy: {m: (getattr(r, m) / getattr(ref, m) if getattr(ref, m) else None) for m in METRICS}
            for r in results}


def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    if args.simulate is None:
        raise SpecDistError("bench router on real replicas needs the Ray Serve deployment (not built yet); "
                            "use --simulate N")
    if args.simulate < 1:
        raise SpecDistError(f"--simulate must be >= 1, got {args.simulate}")
    if not 0 < args.load <= 4:
        raise SpecDistError(f"--load must be in (0, 4], got {args.load}")
    from specdist.bench.router_sim import simulate
    from specdist.config import load_config

    router_cfg = load_config(args.config).router
    results = [simulate(p, args.workload, args.simulate, seed=args.seed, load_factor=args.load,
                        router_config=router_cfg) for p in policies]
    print(f"workload {args.workload}, {args.simulate} simulated replicas, {results[0].requests} requests, "
          f"load {args.load:g}, seed {args.seed}")
    print(f"{'policy':<13} {'tok/step':>8} {'accept':>7} {'hit tokens':>11} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'e2e p50':>8} {'e2e p99':>8} {'tok/s':>9}")
    for r in results:
        print(f"{r.policy:<13} {r.tokens_per_step:>8.2f} {r.acceptance:>7.1%} {r.prefix_hit_tokens:>11d} "
              f"{r.ttft_p50 * 1e3:>7.0f}ms {r.ttft_p99 * 1e3:>7.0f}ms {r.e2e_p50:>7.2f}s {r.e2e_p99:>7.2f}s "
              f"{r.tokens_per_s:>9.0f}")
    all_ratios = {base: ratios(results, base) for base in ("round-robin", "least-loaded")}
    for base, table in all_ratios.items():
        if not table:
            continue
        print(f"ratios to {base}:")
        for policy, row in table.items():
            if policy != base:
                print(f"  {policy:<13} " + " ".join(
                    f"{m}={'-' if v is None else f'{v:.2f}x'}" for m, v in row.items()))
    if args.json:
        doc = {"schema": "specdist.bench.router/1",
               "settings": {"workload": args.workload, "replicas": args.simulate, "policies": policies,
                            "load": args.load, "seed": args.seed, "config": args.config,
                            "router": {"stats_period_s": router_cfg.stats_period_s,
                                       "session_blocks": router_cfg.session_blocks,
                                       "imbalance_threshold": vars(router_cfg.imbalance_threshold)}},
               "results": [r.to_dict() for r in results], "ratios": all_ratios}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        print(f"json: {args.json}", file=sys.stderr)
    return 0
