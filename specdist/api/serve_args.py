"""The flags of ``specdist serve`` and the TLS / token flags it shares with ``specdist generate --server``."""

from __future__ import annotations

import argparse


def default_config_help() -> str:
    """What running without ``--config`` means, read from the config defaults (so it stays true)."""
    from specdist.config import Config

    cfg = Config()
    d = cfg.draft
    if d.enabled:
        draft = f"{d.method} draft, {d.length_policy} draft length up to k={d.num_speculative_tokens}"
    else:
        draft = "no draft (target only)"
    where = "a Ray deployment" if cfg.cluster.enabled else "in process"
    return f"YAML config (default: the built-in {cfg.target.model} {where}, {draft})"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help=default_config_help())
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on this port (0: any free port; "
        "default: off; needs the [http] extra)",
    )
    parser.add_argument("--http-host", default=None, help="address the HTTP API listens on (default: --host)")
    parser.add_argument("--max-queued", type=int, default=256, help="most requests running + waiting at once")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (default: off)",
    )
    parser.add_argument("--drain-seconds", type=float, default=5.0, help="on shutdown, wait this long for requests")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="cluster.enabled: connect to this Ray cluster (e.g. auto, or ray://host:10001); "
        "default: start a local Ray cluster for the deployment and shut it down on exit",
    )
    parser.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="cluster.enabled: address the target/draft workers listen on (must be reachable from this process); "
        "'node': each worker its own Ray node's address; 0.0.0.0: all interfaces, advertising the node's",
    )
    add_tls_arguments(parser)
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PATH",
        help="require client certificates signed by this CA (PEM; needs --tls-cert)",
    )
    parser.add_argument(
        "--admin-token-file",
        default=None,
        metavar="PATH",
        help="the token that reads /metrics and GetServerInfo's counters (every tenant's traffic); "
        "with several tenants and none, nobody reads them",
    )


def add_tls_arguments(parser: argparse.ArgumentParser, ca: bool = False) -> None:
    """The TLS and token flags ``serve`` (the server's certificate) and ``generate --server`` (the client's) share."""
    who = "client" if ca else "server"
    if ca:
        parser.add_argument(
            "--tls-ca",
            default=None,
            metavar="PATH",
            help="with --server: TLS, trusting this CA (PEM; default: plaintext, or the system's "
            "roots with --tls-cert)",
        )
    parser.add_argument(
        "--tls-cert", default=None, metavar="PATH", help=f"TLS: the {who} certificate chain (PEM; with --tls-key)"
    )
    parser.add_argument("--tls-key", default=None, metavar="PATH", help=f"TLS: the {who} private key (PEM)")
    parser.add_argument(
        "--auth-token-file",
        default=None,
        metavar="PATH",
        help="bearer token file: " + ("sent with every call" if ca else "required on every call except health checks"),
    )
