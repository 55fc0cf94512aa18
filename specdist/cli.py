"""The ``specdist`` command line.

    specdist demo --config configs/default.yaml    # Ray deployment up, 3 gRPC streams, counters, clean stop
    specdist generate --config configs/local.yaml "Explain gravity."   # streams text; stats on stderr
    specdist serve --config configs/local.yaml --port 50051            # gRPC server (specdist.v1.SpecDecode)
    specdist generate --server 127.0.0.1:50051 "Explain gravity."      # stream from a running server
    specdist cost-model --alpha 0.8 --k 4 --draft-cost 0.1 [--plot out.png]
    specdist bench engine [--quick]

Bad input is a one-line ``specdist: error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

from specdist.errors import SpecDistError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdist", description="Exact speculative decoding runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--server", default=None, metavar="HOST:PORT",
                     help="generate on a running `specdist serve` instead of loading the model here")
    gen.add_argument("--config", default=None, help="YAML config (default: built-in model, self-w8 draft)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")

    cm = sub.add_parser("cost-model", help="idealised speedup of speculative decoding (not a measurement)")
    cm.add_argument("--alpha", type=float, required=True, help="per-position acceptance rate in [0, 1]")
    cm.add_argument("--k", type=int, required=True, help="draft length")
    cm.add_argument("--draft-cost", type=float, default=0.1, help="draft cost per token, verification = 1")
    cm.add_argument("--plot", default=None, help="also draw speedup vs alpha for several k into this PNG")

    srv = sub.add_parser("serve", help="serve the gRPC API (specdist.v1.SpecDecode) until SIGINT/SIGTERM")
    from specdist.serve_cli import add_serve_arguments

    add_serve_arguments(srv)

    demo = sub.add_parser("demo", help="bring the deployment up, stream a few requests through gRPC, stop")
    from specdist import demo as demo_mod

    demo_mod.add_arguments(demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    be = bsub.add_parser("engine", help="batch-1 engine vs transformers generate / assisted generation")
    from specdist.bench.engine_bench import add_arguments

    add_arguments(be)
    bc = bsub.add_parser("cluster", help="concurrent gRPC streams: TTFT, TPOT, ITL, tokens/s, spec on vs off")
    from specdist.bench import cluster_bench

    cluster_bench.add_arguments(bc)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from specdist.serve_cli import run_serve

            return run_serve(args)
        if args.command == "cost-model":
            return _cost_model(args)
        if args.command == "demo":
            from specdist.demo import run as run_demo

            return run_demo(args)
        if args.command == "bench" and args.bench_command == "engine":
            from specdist.bench.engine_bench import run

            return run(args)
        if args.command == "bench" and args.bench_command == "cluster":
            from specdist.bench.cluster_bench import run

            return run(args)
    except SpecDistError as e:
        parser.exit(2, f"specdist: error: {e}\n")
    except ValueError as e:  # argument checks of the pure-maths helpers
        parser.exit(2, f"specdist: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    return 0


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        from specdist.serve_cli import run_remote_generate

        kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
        return run_remote_generate(args.server, args.prompt, kwargs, args.raw)
    from specdist import Engine, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    t0 = time.perf_counter()
    engine = Engine.from_config(args.config)
    load_s = time.perf_counter() - t0
    prompt = args.prompt
    tok = engine.tokenizer
    if not args.raw and tok is not None and getattr(tok, "chat_template", None):
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    t1 = time.perf_counter()
    for piece in engine.stream(prompt, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - t1
    out = engine.last_output
    m = out.metrics
    cfg = engine.config.draft
    ttft = m.time_to_first_token or 0.0
    print(
        f"[specdist] draft={cfg.method} k={engine.k} tokens={len(out.token_ids)} finish={out.finish_reason} "
        f"steps={m.steps} drafted={m.drafted} accepted={m.accepted} acceptance={m.acceptance_rate:.1%} "
        f"tokens/step={m.mean_accepted_length:.2f} tokens/s={len(out.token_ids) / elapsed:.1f} "
        f"ttft={ttft * 1000:.0f}ms load={load_s:.1f}s",
        file=sys.stderr,
    )
    return 0


def _cost_model(args: argparse.Namespace) -> int:
    from specdist.cost_model import report

    print(report(args.alpha, args.k, args.draft_cost).format())
    if args.plot:
        from specdist.cost_plot import plot_speedup

        print(f"plot: {plot_speedup(args.plot, draft_cost=args.draft_cost)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
