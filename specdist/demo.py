"""``specdist demo``: the distributed runtime end to end, in one command.

Brings the deployment of ``--config`` up (with ``cluster.enabled``: a local Ray cluster,
the tensor-parallel target ranks and the draft workers; otherwise the in-process engine),
serves the public gRPC API on a free local port, streams a few requests through
:class:`~specdist.client.SpecDistClient` at once, prints each answer with its acceptance,
tokens/s and time to first token, then the server's live counters (all back to zero),
and stops: drain, tear the deployment down, shut Ray down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor

DEMO_PROMPTS = (
    "Explain gravity in two sentences.",
    "Write a haiku about the sea.",
    "What is the capital of France, and why is it famous?",
    "Give three tips for learning a new language.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/default.yaml", help="deployment config")
    p.add_argument("--requests", type=int, default=3, help="concurrent client requests")
    p.add_argument("--max-tokens", type=int, default=48, help="most tokens generated per request")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy")
    p.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (e.g. auto) instead of starting a local one"
    )
    p.add_argument("--raw", action="store_true", help="send prompts without the chat template")


def run(args: argparse.Namespace) -> int:
    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    from specdist.api.serve_command import shut_down
    from specdist.api.serving import start_backend

    t0 = time.perf_counter()
    backend = start_backend(args.config, args.ray_address, log=_log)
    _log(f"up in {time.perf_counter() - t0:.1f}s")
    try:
        asyncio.run(_serve_and_query(backend, args))
    finally:
        shut_down(backend, log=_log)
    _log("stopped cleanly")
    return 0


async def _serve_and_query(backend, args: argparse.Namespace) -> None:
    from specdist.api.serving import start_serving

    serving = await start_serving(backend=backend)
    try:
        _log(f"serving specdist.v1.SpecDecode on {serving.address}; {args.requests} concurrent streams")
        prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.requests)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.requests) as pool:
            results = await asyncio.gather(
                *[asyncio.wrap_future(pool.submit(_one, serving.address, p, i, args)) for i, p in enumerate(prompts)]
            )
        wall = time.perf_counter() - t0
        total = drafted = accepted = 0
        for i, (prompt, text, s, elapsed) in enumerate(results):
            print(f"\n[{i}] {prompt}\n{text.strip()}")
            print(
                f"    tokens={s.output_tokens} steps={s.steps} acceptance={s.acceptance_rate:.1%} "
                f"tokens/s={s.output_tokens / max(elapsed, 1e-9):.1f} ttft={s.time_to_first_token_s * 1e3:.0f}ms"
            )
            total += s.output_tokens
            drafted += s.drafted
            accepted += s.accepted
        acc = f"{accepted / drafted:.1%}" if drafted else "-"
        print(
            f"\n{len(results)} requests, {total} tokens in {wall:.1f}s: {total / wall:.1f} tokens/s, acceptance {acc}"
        )
        info = await asyncio.to_thread(_server_info, serving.address)  # off the loop that runs the server
        c = info.counters
        print(
            f"server: target={info.target_model} draft={info.draft_method} tensor_parallel={info.tensor_parallel_size} "
            f"draft_replicas={info.draft_replicas}; after the run: running={c['running_requests']} "
            f"queued={c['queued_requests']} target_kv_slots={c['target_kv_slots_used']} "
            f"draft_kv_slots={c['draft_kv_slots_used']}"
        )
        print(f"server: CPU kernels of the target: {info.cpu_kernels or 'unknown'}")
    finally:
        await serving.server.stop()  # the backend is closed by run()


def _server_info(address: str):
    from specdist.client import SpecDistClient

    with SpecDistClient(address) as client:
        return client.server_info()


def _one(address: str, prompt: str, i: int, args: argparse.Namespace):
    from specdist.client import SpecDistClient

    t0 = time.perf_counter()
    parts, last = [], None
    with SpecDistClient(address) as client:
        for chunk in client.generate(
            prompt, max_tokens=args.max_tokens, temperature=args.temperature, seed=i, apply_chat_template=not args.raw
        ):
            parts.append(chunk.text)
            last = chunk
    return prompt, "".join(parts), last.stats, time.perf_counter() - t0


def _log(msg: str) -> None:
    print(f"[specdist demo] {msg}", file=sys.stderr, flush=True)
