"""The Ray job entrypoint: bring a deployment up on the running cluster, serve, exercise it, tear down.

    ray job submit --working-dir . -- python -m cluster.job --config configs/default.yaml --requests 4

Connects to the cluster the job runs in (``ray.init(address="auto")``), brings the deployment of
the config's ``cluster:`` section up (:func:`specdist.api.serving.start_backend`; ``cluster.enabled``
is implied), serves the public SpecDecode API on ``--port``, runs ``--requests`` requests through
:class:`specdist.client.SpecDistClient` (``--concurrency`` at a time), prints one line per request
and a final ``[specdist-job] done:`` line with acceptance and tokens/s, tears everything down and
exits 0. Any failure: ``cluster.job: error: ...`` on stderr, the deployment torn down, exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cluster.job", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config; its cluster: section shapes the deployment")
    p.add_argument("--requests", type=int, default=4, help="client requests to run (0: only bring up and down)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument("--prompt", default="Explain gravity in two sentences.", help="text prompt (raw, no chat template)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ray-address", default="auto", help="the Ray cluster (default: auto, the one the job runs in)")
    p.add_argument("--host", default="127.0.0.1", help="public server address")
    p.add_argument("--port", type=int, default=0, help="public server port (0: any free port)")
    p.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="address the workers listen on ('node': each worker its own Ray node's address)",
    )
    args = p.parse_args(argv)
    if args.requests < 0 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--requests must be >= 0, --concurrency and --max-tokens >= 1")
    return args


def _log(msg: str) -> None:
    print(f"[specdist-job] {msg}", flush=True)


async def _run(args: argparse.Namespace, backend) -> dict:
    from specdist.api.serving import start_serving
    from specdist.client import SpecDistClient

    serving = await start_serving(host=args.host, port=args.port, backend=backend)
    try:
        info_line = f"serving on {serving.address} (target {backend.target_address}, drafts {backend.draft_addresses})"
        _log(info_line)

        def one(i: int) -> tuple[int, float, object]:
            t0 = time.perf_counter()
            with SpecDistClient(serving.address, timeout=600) as c:
                _, ids, finish, stats = c.generate_text(
                    args.prompt,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=i,
                    apply_chat_template=args.chat,
                )
            dt = time.perf_counter() - t0
            _log(
                f"request {i}: tokens={len(ids)} finish={finish} acceptance={stats.acceptance_rate:.1%} "
                f"tokens/s={len(ids) / max(dt, 1e-9):.1f}"
            )
            return len(ids), dt, stats

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            results = await asyncio.gather(*(asyncio.wrap_future(pool.submit(one, i)) for i in range(args.requests)))
        wall = time.perf_counter() - t0

        def server_info():
            with SpecDistClient(serving.address, timeout=30) as c:
                return c.server_info()

        info = await asyncio.to_thread(server_info)  # never a blocking call on the server's own event loop
    finally:
        await serving.server.stop()
    tokens = sum(r[0] for r in results)
    drafted = sum(r[2].drafted for r in results)
    accepted = sum(r[2].accepted for r in results)
    return {
        "requests": len(results),
        "tokens": tokens,
        "drafted": drafted,
        "accepted": accepted,
        "wall": wall,
        "tp": info.tensor_parallel_size,
        "drafts": info.draft_replicas,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = None
    try:
        import ray

        from specdist.api.serving import start_backend
        from specdist.config import load_config

        cfg = load_config(args.config)
        cfg.cluster.enabled = True  # this entrypoint always deploys on Ray
        cfg.validate()
        _log(f"connecting to Ray at {args.ray_address}")
        ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
        backend = start_backend(cfg, worker_host=args.worker_host, log=_log)
        s = asyncio.run(_run(args, backend))
        acc = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        _log(
            f"done: requests={s['requests']} tensor_parallel_size={s['tp']} draft_replicas={s['drafts']} "
            f"tokens={s['tokens']} acceptance={acc:.1%} tokens/s={s['tokens'] / max(s['wall'], 1e-9):.1f} "
            f"wall={s['wall']:.2f}s"
        )
        return 0
    except KeyboardInterrupt:
        print("cluster.job: error: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # one clear line, then tear down
        print(f"cluster.job: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if backend is not None:
            _log("tearing down the deployment")
            t0 = time.perf_counter()
            backend.close()
            _log(f"deployment stopped ({time.perf_counter() - t0:.1f}s)")
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()  # disconnects from the job's cluster; does not stop it
        except Exception:
            pass


if __name__ == "__main__":
    sys.exit(main())
