"""Does holding a session on one replica draft its turns better? Issue 51's "tokens per target step" of the
sessions workload, measured without the timing of a live run: the live bench's requests (:func:`plan`, the same
prompts, seeds and closed-loop clients) through N engines in this process that share one target model, each with
its own drafter, under two placements of the turns:

- ``held``: a session's first turn on the next engine in turn, its later turns on the same one (what the
  ``speculative`` and ``prefix`` routers do when nothing overrides affinity);
- ``round-robin``: every request on the next engine in turn.

    python -m specdist.bench.router_drafting --config configs/replicas.yaml --engines 8 --clients 4 --seeds 10

With the Gumbel coupling (``draft.coupling: gumbel``, the default) a seeded request's tokens do not depend on its
drafts, so both placements emit the same tokens and differ only in how many target steps those took: a ratio of
one run is the drafting's alone (with ``draft.length_policy: adaptive`` the draft lengths follow the measured step
times, so a rerun of one seed set differs a little: run nothing else beside it). ``--seeds S`` repeats it with S
seed sets (the requests' seeds salted) and prints each ratio and their mean. The engines step one after another
(a step is a batch of the requests on it). ``--retokenize``: each client sends an answer back as its text encoded
again, as a chat client over HTTP does (sampled ids often differ from their text's encoding in a token or two),
not as the ids it got.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from specdist.bench.router_live import LiveTurn, Plan, extend_prompt, plan, request_seed

PLACEMENTS = ("held", "round-robin")


@dataclass
class Drafting:
    """What one placement's run took: target steps, tokens they emitted, draft tokens verified and accepted."""

    steps: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> its output tokens
    engine_of: dict[str, int] = field(default_factory=dict)  # request id -> the engine it ran on

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / max(1, self.steps)

    @property
    def acceptance(self) -> float:
        return self.accepted / max(1, self.drafted)


def placement(name: str, engines: int) -> Callable[[str | None], int]:
    """``name``'s choice of an engine for a request of session ``session`` (None: no session)."""
    turn = [0]
    held: dict[str, int] = {}

    def next_engine() -> int:
        turn[0] += 1
        return (turn[0] - 1) % engines

    if name == "round-robin":
        return lambda session: next_engine()
    if name == "held":

        def stay(session: str | None) -> int:
            if session is None:
                return next_engine()
            if session not in held:
                held[session] = next_engine()
            return held[session]

        return stay
    raise ValueError(f"unknown placement {name!r} (expected one of: {', '.join(PLACEMENTS)})")


@dataclass
class Client:
    """A closed-loop client: its session's turns, the next one's index, the ids sent so far, its request."""

    turns: list[LiveTurn]
    next: int = 0
    ids: list[int] = field(default_factory=list)
    request: Any = None


def run(
    engines: list[Any], p: Plan, clients: int, temperature: float, salt: str, place: str, retokenize: bool = False
) -> Drafting:
    """The plan's requests through ``engines`` by placement ``place``: ``clients`` closed-loop clients, each sending
    a session's turns one after another. The drafters start empty. ``retokenize``: a client sends each answer back
    as its text encoded again (as a chat client over HTTP does), not as the ids it got."""
    from specdist.sampling_params import SamplingParams

    for e in engines:
        e.draft_core.forget_finished()
    choose = placement(place, len(engines))
    tokenizer, max_model_len = engines[0].tokenizer, engines[0].max_model_len
    queue = list(reversed(p.groups))
    out = Drafting()
    live: list[Client] = []

    def send(c: Client) -> bool:
        """Send the client's next turn; False: its session is over (or the turn would not fit)."""
        if c.next >= len(c.turns):
            return False
        t = c.turns[c.next]
        ids = extend_prompt(tokenizer, c.ids, t.text)
        if len(ids) + t.max_tokens > max_model_len:
            return False
        params = SamplingParams(
            temperature=temperature, max_tokens=t.max_tokens, ignore_eos=True, seed=request_seed(t.rid, salt)
        )
        i = out.engine_of[t.rid] = choose(t.session)
        c.ids, c.request = ids, engines[i].add_request(ids, params, request_id=t.rid)
        return True

    def take_session() -> None:
        while queue:
            c = Client(queue.pop())
            if send(c):
                live.append(c)
                return

    for _ in range(clients):
        take_session()
    while live:
        for e in engines:
            if e.scheduler.has_unfinished():
                e.step()
        for c in [c for c in live if c.request.finished]:
            o = c.request.to_output()
            m = o.metrics
            out.steps, out.emitted = out.steps + m.steps, out.emitted + m.emitted
            out.drafted, out.accepted = out.drafted + m.drafted, out.accepted + m.accepted
            out.tokens[o.request_id] = answer = list(o.token_ids)
            if retokenize:
                answer = list(tokenizer.encode(tokenizer.decode(answer), add_special_tokens=False))
            c.next, c.ids = c.next + 1, c.ids + answer
            if not send(c):
                live.remove(c)
                take_session()
    return out


def main(argv: list[str] | None = None) -> int:
    import yaml

    from specdist.config import load_config
    from specdist.engine.local import Engine

    ap = argparse.ArgumentParser(prog="python -m specdist.bench.router_drafting", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a replicas config (its cluster and router sections unused)")
    ap.add_argument("--workload", default="sessions")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-scale", type=float, default=0.1)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seeds", type=int, default=10, help="seed sets (the requests' seeds salted)")
    ap.add_argument("--retokenize", action="store_true", help="clients send answers back as text (encoded again)")
    args = ap.parse_args(argv)
    for name in ("requests", "engines", "clients", "seeds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    with open(args.config, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    raw.pop("cluster", None)  # one process: no Ray, no router
    raw.pop("router", None)
    cfg = load_config(raw)
    if cfg.draft.method not in ("suffix", "hybrid"):
        raise SystemExit(f"{args.config}: draft.method is {cfg.draft.method!r}; this compares suffix drafting")
    first = Engine.from_config(cfg)
    model = first.target_core.runner.model  # one set of weights; each engine its own KV cache and drafter
    engines = [first] + [
        Engine.from_config(cfg, tokenizer=first.tokenizer, target=model) for _ in range(args.engines - 1)
    ]
    p = plan(args.workload, args.requests, args.output_scale)
    print(
        f"{args.workload}: {args.requests} requests, {args.engines} engines, {args.clients} clients"
        + (", answers sent back re-tokenized" if args.retokenize else "")
    )
    ratios = []
    for s in range(args.seeds):
        held, rr = (run(engines, p, args.clients, args.temperature, f"s{s}", n, args.retokenize) for n in PLACEMENTS)
        if held.tokens != rr.tokens:  # the coupling makes the tokens the drafts' business no more
            raise SystemExit("the placements emitted different tokens: is draft.coupling gumbel?")
        ratios.append(held.tokens_per_step / rr.tokens_per_step)
        print(
            f"seeds {s}: tokens a step held {held.tokens_per_step:.4f} (acceptance {held.acceptance:.3f}),"
            f" round-robin {rr.tokens_per_step:.4f} ({rr.acceptance:.3f}): {ratios[-1]:.4f}x",
            flush=True,
        )
    print(f"held / round-robin: mean {statistics.mean(ratios):.4f}x, {min(ratios):.4f}-{max(ratios):.4f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
