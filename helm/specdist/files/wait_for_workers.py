"""Wait until the Ray cluster has its worker nodes: the target pod and every draft pod.

The head pod runs this between starting Ray and ``specdist serve --ray-address auto``, so that
the deployment's placement groups are created when every pod of the RayCluster has joined:
the target's STRICT_PACK group then finds the target pod, and a draft bundle cannot take room
on it first because the draft pods are there too. On timeout it warns and returns 0 anyway:
``specdist serve`` then fails its bring-up with a message naming the bundles it asked for and
what the cluster has free.

    python wait_for_workers.py --workers 3 --timeout 600
"""

from __future__ import annotations

import argparse
import sys
import time

HEAD_RESOURCE = "node:__internal_head__"  # a resource only the head node has


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="wait_for_workers.py", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, required=True, help="worker nodes to wait for (the head not counted)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds; then go on with a warning")
    p.add_argument("--address", default="auto", help="the Ray cluster (default: auto, the local one)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between checks")
    args = p.parse_args(argv)
    if args.workers < 0 or args.timeout < 0 or args.interval <= 0:
        p.error("--workers and --timeout must be >= 0, --interval > 0")
    return args


def alive_workers(nodes: list[dict]) -> int:
    """Alive nodes of ``ray.nodes()`` that are not the head."""
    return sum(1 for n in nodes if n.get("Alive") and HEAD_RESOURCE not in n.get("Resources", {}))


def _log(msg: str) -> None:
    print(f"[wait_for_workers] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    deadline = time.monotonic() + args.timeout
    while True:  # the head's GCS may still be starting
        try:
            ray.init(address=args.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            break
        except Exception as e:  # noqa: BLE001  (ConnectionError until the GCS answers)
            if time.monotonic() >= deadline:
                _log(f"warning: no Ray cluster at {args.address} after {args.timeout:g}s ({e}); going on")
                return 0
            time.sleep(args.interval)
    try:
        last = -1
        while True:
            n = alive_workers(ray.nodes())
            if n >= args.workers:
                _log(f"{n} worker node(s) joined")
                return 0
            if n != last:
                _log(f"{n} of {args.workers} worker node(s) joined; waiting")
                last = n
            if time.monotonic() >= deadline:
                _log(f"warning: only {n} of {args.workers} worker node(s) after {args.timeout:g}s; going on")
                return 0
            time.sleep(args.interval)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
