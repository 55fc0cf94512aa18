"""Command-line glue for the gRPC server and the remote ``generate``.

    specdist serve --config configs/local.yaml --port 50051     # until SIGINT/SIGTERM, then drains
    specdist generate --server 127.0.0.1:50051 "prompt"         # streams text; stats on stderr
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config (default: built-in model, self-w8 draft)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    parser.add_argument("--max-queued", type=int, default=256, help="most requests running + waiting at once")
    parser.add_argument("--drain-seconds", type=float, default=5.0, help="on shutdown, wait this long for requests")


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, drain, exit 0."""
    from specdist.engine import Engine

    if args.max_queued < 1:
        raise ValueError(f"--max-queued must be >= 1, got {args.max_queued}")
    if args.drain_seconds < 0:
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    engine = Engine.from_config(args.config)
    asyncio.run(_serve_until_signalled(engine, args))
    return 0


async def _serve_until_signalled(engine: Any, args: argparse.Namespace) -> None:
    from specdist.server import serve

    server, _ = await serve(engine, args.host, args.port, args.max_queued, args.drain_seconds)
    cfg = engine.config
    print(
        f"[specdist] serving {cfg.target.model} (draft={cfg.draft.method} k={engine.k}) on {args.host}:{server.port}",
        file=sys.stderr,
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    print(f"[specdist] draining (up to {args.drain_seconds:g}s)", file=sys.stderr, flush=True)
    await server.stop()
    print("[specdist] stopped", file=sys.stderr, flush=True)


def run_remote_generate(server: str, prompt: str | list[int], params_kwargs: dict[str, Any], raw: bool) -> int:
    """Stream one generation from a running server to stdout; stats on stderr.

    ``params_kwargs``: SpecDistClient.generate keywords (max_tokens, temperature, top_p,
    top_k, seed, stop, ...). Without ``raw`` a text prompt is wrapped in the model's
    chat template by the server. Server errors raise RemoteError (a SpecDistError).
    """
    import grpc

    from specdist.client import RemoteError, SpecDistClient

    t0 = time.perf_counter()
    last = None
    with SpecDistClient(server) as client:
        chat = not raw and isinstance(prompt, str)
        try:
            last = _stream_to_stdout(client.generate(prompt, apply_chat_template=chat, **params_kwargs))
        except RemoteError as e:  # like the local CLI: a model without a chat template gets the raw prompt
            if not (chat and e.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.message):
                raise
            last = _stream_to_stdout(client.generate(prompt, **params_kwargs))
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - t0
    if last is not None and last.stats is not None:
        s = last.stats
        print(
            f"[specdist] server={server} tokens={s.output_tokens} finish={last.finish_reason} steps={s.steps} "
            f"drafted={s.drafted} accepted={s.accepted} acceptance={s.acceptance_rate:.1%} "
            f"tokens/s={s.output_tokens / max(elapsed, 1e-9):.1f} ttft={s.time_to_first_token_s * 1000:.0f}ms",
            file=sys.stderr,
        )
    return 0


def _stream_to_stdout(chunks: Iterator[Any]) -> Any:
    """Write each chunk's text as it arrives; return the last chunk."""
    last = None
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    return last
