"""``specdist generate --server``: one generation streamed from a running server to stdout, its stats on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from specdist.errors import SpecDistError


class RequestFailed(SpecDistError):
    """The server ended the request without finishing it (finish reason abort or error)."""

    exit_status = 1


def run_remote_generate(
    server: str,
    prompt: str | list[int],
    params_kwargs: dict[str, Any],
    raw: bool,
    client_kwargs: dict[str, Any] | None = None,
) -> int:
    """Stream one generation from a running server to stdout; stats on stderr.

    ``params_kwargs``: SpecDistClient.generate keywords (max_tokens, temperature, top_p,
    top_k, seed, stop, ...). Without ``raw`` a text prompt is wrapped in the model's
    chat template by the server. Server errors raise RemoteError (a SpecDistError); a request
    the server aborted or failed raises RequestFailed (exit status 1) naming the finish reason.
    ``client_kwargs``: SpecDistClient's TLS and token keywords.
    """
    import grpc

    from specdist.client import RemoteError, SpecDistClient

    t0 = time.perf_counter()
    last = None
    with SpecDistClient(server, **(client_kwargs or {})) as client:
        chat = not raw and isinstance(prompt, str)
        try:
            try:
                last = _stream_to_stdout(client.generate(prompt, apply_chat_template=chat, **params_kwargs))
            except RemoteError as e:  # like the local CLI: a model without a chat template gets the raw prompt
                if not (chat and e.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.message):
                    raise
                last = _stream_to_stdout(client.generate(prompt, **params_kwargs))
        except RemoteError as e:
            if e.code != grpc.StatusCode.INTERNAL:  # bad input, unreachable, overloaded: exit 2 as before
                raise
            sys.stdout.write("\n")
            raise RequestFailed(f"the request failed on the server (finish_reason=error): {e.message}") from None
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
    reason = last.finish_reason if last is not None else None
    if reason not in ("stop", "length"):
        what = {"abort": "was aborted by the server", "error": "failed on the server"}.get(
            reason, "ended without a finish reason"
        )
        raise RequestFailed(f"the request {what} (finish_reason={reason or 'none'})")
    return 0


def _stream_to_stdout(chunks: Iterator[Any]) -> Any:
    """Write each chunk's text as it arrives; return the last chunk."""
    last = None
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    return last
