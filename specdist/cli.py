"""The ``specdist`` command line.

    specdist demo --config configs/default.yaml    # Ray deployment up, 3 gRPC streams, counters, clean stop
    specdist generate --config configs/local.yaml "Explain gravity."   # streams text; stats on stderr
    specdist serve --config configs/local.yaml --port 50051            # gRPC server (specdist.v1.SpecDecode)
    specdist generate --server 127.0.0.1:50051 "Explain gravity."      # stream from a running server
    specdist cost-model --alpha 0.8 --k 4 --draft-cost 0.1 [--plot out.png] [--pipeline --guess-hit 0.8]
    specdist bench engine [--quick] [--dtype float32,bfloat16]
    specdist bench runner                     # forward per dtype: what dtype auto means on the CPU
    specdist bench tasks [--quick] [--drafts none,self-w8,ngram]   # per task: acceptance, tokens/step, speedup
    specdist bench router --simulate 32 --workload sessions        # routing policies side by side

Bad input is a one-line ``specdist: error: ...`` on stderr and exit status 2 (a request the
server aborted or failed: exit status 1). Whatever can be checked without the weights (the
prompt against the tokenizer and the context limit, a free ``--port``, installed optional
dependencies) is checked before loading them. Progress (what loads, how big, how long; each
phase of a deployment's bring-up) goes to stderr as ``[specdist] ...`` lines: the ``specdist``
logger tree at INFO, configured here only, so library users stay quiet by default.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

from specdist.config import PIPELINE_MISS
from specdist.errors import SpecDistError


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless there is none to show or the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if not _shows_default(action) or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


def _shows_default(action: argparse.Action) -> bool:
    d = action.default
    return not (d is None or d is False or d == argparse.SUPPRESS or d == [] or d == ())


def _help_for_every_default(parser: argparse.ArgumentParser) -> None:
    """argparse prints no help line, hence no default, for options added without help: give them one."""
    # argparse lists a parser's actions, and types its subcommand action, only under private names
    for action in parser._actions:  # noqa: SLF001 - argparse's own list of the parser's actions
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001 - the subcommands action's type
            for child in action.choices.values():
                _help_for_every_default(child)
        elif action.option_strings and not action.help and _shows_default(action):
            action.help = "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    fmt = {"formatter_class": _HelpFormatter}
    parser = argparse.ArgumentParser(prog="specdist", description="Exact speculative decoding runtime", **fmt)
    sub = parser.add_subparsers(dest="command", required=True)

    from specdist.api.serve_args import add_serve_arguments, add_tls_arguments, default_config_help

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout", **fmt)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument(
        "--server",
        default=None,
        metavar="HOST:PORT",
        help="generate on a running `specdist serve` instead of loading the model here",
    )
    gen.add_argument(
        "--config",
        default=None,
        help=default_config_help() + "; with cluster.enabled it runs on a Ray deployment started here",
    )
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, 1 = off")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens, 0 = off")
    gen.add_argument("--seed", type=int, default=None, help="random seed of the request (default: drawn)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument(
        "--ray-address",
        default=None,
        help="cluster.enabled: join this Ray cluster (e.g. auto) instead of starting a local one",
    )
    add_tls_arguments(gen, ca=True)

    cm = sub.add_parser("cost-model", help="idealised speedup of speculative decoding (not a measurement)", **fmt)
    cm.add_argument("--alpha", type=float, required=True, help="per-position acceptance rate in [0, 1]")
    cm.add_argument("--k", type=int, required=True, help="draft length")
    cm.add_argument("--draft-cost", type=float, default=0.1, help="draft cost per token, verification = 1")
    cm.add_argument(
        "--pipeline",
        action="store_true",
        help="also compare pipelined drafting (next drafts prepared during verification)",
    )
    cm.add_argument(
        "--guess-hit",
        type=float,
        default=None,
        help="with --pipeline: probability that the draft's guess of the bonus token is right (default: alpha)",
    )
    cm.add_argument(
        "--miss",
        choices=PIPELINE_MISS,
        default="redraft",
        help="with --pipeline: what a request whose prepared prefix did not hold does (one request: "
        "auto redrafts, as redraft)",
    )
    cm.add_argument("--plot", default=None, help="also draw speedup vs alpha for several k into this PNG")

    srv = sub.add_parser(
        "serve",
        help="serve the gRPC API (specdist.v1.SpecDecode; with --http-port also the "
        "OpenAI-compatible HTTP API) until SIGINT/SIGTERM",
        **fmt,
    )
    add_serve_arguments(srv)

    demo = sub.add_parser("demo", help="bring the deployment up, stream a few requests through gRPC, stop", **fmt)
    from specdist import demo as demo_mod

    demo_mod.add_arguments(demo)

    bench = sub.add_parser("bench", help="benchmarks", **fmt)
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    be = bsub.add_parser("engine", help="batch-1 engine vs transformers generate / assisted generation", **fmt)
    from specdist.bench.engine_bench import add_arguments

    add_arguments(be)
    br = bsub.add_parser("runner", help="CausalLMRunner.forward per dtype (what dtype auto means on the CPU)", **fmt)
    from specdist.bench import runner_bench

    runner_bench.add_arguments(br)
    bc = bsub.add_parser("cluster", help="concurrent gRPC streams: TTFT, TPOT, ITL, tokens/s, spec on vs off", **fmt)
    from specdist.bench import cluster_bench

    cluster_bench.add_arguments(bc)
    bs = bsub.add_parser("soak", help="a long mixed load: memory, threads, fds and slots must stay flat", **fmt)
    from specdist.bench import soak

    soak.add_arguments(bs)
    bt = bsub.add_parser(
        "tasks",
        help="Spec-Bench-style tasks (chat, code edit, summarize, QA, multi-turn): "
        "acceptance, tokens/step and speedup per draft",
        **fmt,
    )
    from specdist.bench import tasks as tasks_bench

    tasks_bench.add_arguments(bt)
    brt = bsub.add_parser(
        "router", help="routing policies side by side on one workload (--simulate N: simulated replicas)", **fmt
    )
    from specdist.bench import router_bench

    router_bench.add_arguments(brt)
    _help_for_every_default(parser)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record (tests swap it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("[specdist] %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


@contextlib.contextmanager
def stderr_logging(level: int = logging.INFO) -> Iterator[None]:
    """Show the ``specdist`` logger tree on stderr as ``[specdist] message`` lines while inside."""
    logger = logging.getLogger("specdist")
    handler, previous = _StderrHandler(), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with stderr_logging():
        return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from specdist.api.serve_command import run_serve

            return run_serve(args)
        if args.command == "cost-model":
            return _cost_model(args)
        if args.command == "demo":
            from specdist.demo import run as run_demo

            return run_demo(args)
        if args.command == "bench" and args.bench_command == "engine":
            from specdist.bench.engine_bench import run

            return run(args)
        if args.command == "bench" and args.bench_command == "runner":
            from specdist.bench.runner_bench import run

            return run(args)
        if args.command == "bench" and args.bench_command == "cluster":
            from specdist.bench.cluster_bench import run

            return run(args)
        if args.command == "bench" and args.bench_command == "soak":
            from specdist.bench.soak import run

            return run(args)
        if args.command == "bench" and args.bench_command == "tasks":
            from specdist.bench.tasks import run

            return run(args)
        if args.command == "bench" and args.bench_command == "router":
            from specdist.bench.router_bench import run

            return run(args)
    except SpecDistError as e:
        parser.exit(getattr(e, "exit_status", 2), f"specdist: error: {e}\n")
    except ValueError as e:  # argument checks of the pure-maths helpers
        parser.exit(2, f"specdist: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    return 0


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    given = [f for f in ("tls_ca", "tls_cert", "tls_key", "auth_token_file") if getattr(args, f) is not None]
    if given:
        raise SpecDistError(f"--{given[0].replace('_', '-')} only applies with --server (a remote server)")
    from specdist.api.preflight import check_config
    from specdist.api.serve_command import shut_down
    from specdist.api.serving import describe, start_backend
    from specdist.config import load_config
    from specdist.sampling_params import SamplingParams

    params = SamplingParams(**_sampling_kwargs(args))
    cfg = load_config(args.config)
    check_config(cfg)
    if cfg.cluster.enabled:
        _log(
            f"running on a Ray deployment: TP={cfg.cluster.tensor_parallel_size}, "
            f"{cfg.cluster.num_draft_workers} draft worker(s) (bring-up takes a while)"
        )
    else:
        _log(f"running in process: {cfg.target.model}, draft={cfg.draft.method}")
    from specdist.models.metadata import resolve_sources

    sources = resolve_sources(cfg)  # the model specs, resolved once: the backend takes them (and the tokenizer)
    chat, tokenizer = _check_prompt(cfg, args.prompt, raw=args.raw, sources=sources)  # before any weights
    t0 = time.perf_counter()
    backend = start_backend(cfg, args.ray_address, log=_log, sources=sources)
    try:
        load_s = time.perf_counter() - t0
        engine = backend.engine
        _log(f"ready in {load_s:.1f}s ({describe(backend)})")
        elapsed = _stream_to_stdout(engine, args.prompt, params, chat)
        _print_stats(cfg.draft.method, engine, elapsed, load_s)
    finally:  # also on Ctrl-C: a deployment's actors and placement groups must not outlive the command
        shut_down(backend)
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    """``generate --server``: stream from a running server."""
    # before grpc loads: its C core would also log a failed TLS handshake on stderr, next to the error line
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from specdist.api.remote_generate import run_remote_generate

    return run_remote_generate(args.server, args.prompt, _sampling_kwargs(args), args.raw, _client_security(args))


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    """SamplingParams' keywords from ``generate``'s flags."""
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _stream_to_stdout(engine, prompt: str, params, chat: bool) -> float:
    """Generate, writing each piece of text as it comes; the seconds it took."""
    t1 = time.perf_counter()
    for piece in engine.stream(prompt, params, chat=chat):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return time.perf_counter() - t1


def _print_stats(draft_method: str, engine, elapsed: float, load_s: float) -> None:
    """The last request's counters as one ``[specdist]`` line on stderr."""
    out = engine.last_output
    m = out.metrics
    ttft = m.time_to_first_token or 0.0
    print(
        f"[specdist] draft={draft_method} k={engine.k} tokens={len(out.token_ids)} "
        f"finish={out.finish_reason} steps={m.steps} drafted={m.drafted} accepted={m.accepted} "
        f"acceptance={m.acceptance_rate:.1%} tokens/step={m.mean_accepted_length:.2f} "
        f"tokens/s={len(out.token_ids) / max(elapsed, 1e-9):.1f} ttft={ttft * 1000:.0f}ms load={load_s:.1f}s",
        file=sys.stderr,
    )


def _client_security(args: argparse.Namespace) -> dict:
    """SpecDistClient's TLS and token keywords from ``generate --server``'s flags (files read now)."""
    from specdist.transport.security import client_kwargs_from_files

    return client_kwargs_from_files(args.tls_ca, args.tls_cert, args.tls_key, args.auth_token_file)


def _check_prompt(cfg, prompt: str, raw: bool, sources=None):
    """Check the prompt with the target's tokenizer alone: (whether to apply the chat template, tokenizer).
    ``sources``: the config's models, resolved (:func:`specdist.models.metadata.resolve_sources`; None: here);
    the tokenizer loaded stays with them.

    A model without a chat template gets the raw prompt. Raises InvalidArgument (empty, too long).
    """
    from specdist.engine.prompts import encode_prompt
    from specdist.models.metadata import resolve_sources

    tokenizer = (resolve_sources(cfg) if sources is None else sources).tokenizer()
    chat = not raw and tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    encode_prompt(
        tokenizer,
        prompt,
        vocab_size=len(tokenizer) if tokenizer is not None else 0,
        max_model_len=cfg.engine.max_model_len,
        chat=chat,
    )
    return chat, tokenizer


def _log(msg: str) -> None:
    print(f"[specdist] {msg}", file=sys.stderr, flush=True)


def _cost_model(args: argparse.Namespace) -> int:
    from specdist.engine.cost_model import pipelined_report, report

    print(report(args.alpha, args.k, args.draft_cost).format())
    if args.pipeline:
        guess = args.alpha if args.guess_hit is None else args.guess_hit
        print()
        print(pipelined_report(args.alpha, args.k, args.draft_cost, guess, args.miss).format())
    if args.plot:
        from specdist.bench.cost_plot import plot_speedup

        print(f"plot: {plot_speedup(args.plot, draft_cost=args.draft_cost)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
