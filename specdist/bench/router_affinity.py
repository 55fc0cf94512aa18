"""How many prefix-cache hit tokens a router that ignores sessions can get on the live ``bench router --workload
sessions``, against the ceiling: the reach of issue 51's ">= 2x round-robin's hit tokens", whatever the timing.

    python -m specdist.bench.router_affinity --config configs/replicas.yaml --requests 32 --replicas 2,3,4,8

The requests are the live bench's (:func:`specdist.bench.router_live.plan`, the same token counts: each turn's
prompt is the last turn's prompt, its ``max_tokens`` output tokens and the new text). A replica's prefix cache is
taken to keep every turn it ran, prompt and output, in whole blocks (the replicas' caches are far larger than one
run's sessions), and a turn's hit is the longest of those that it extends (its last token is always computed).
Three assignments of the later turns to replicas:

- ``ceiling``: every turn where its session's last turn ran (what ``speculative`` and ``prefix`` do when nothing
  overrides affinity);
- ``random``: each turn on a replica drawn at random, the mean over many draws (round-robin's landing when the
  sessions' turns arrive independently of each other: open-loop arrivals, many clients);
- ``rotate``: turn k of a session on replica k mod N (never where its last turn ran: round-robin's worst case,
  e.g. 3 closed-loop clients in lock step on 2 replicas).

Round-robin's hits lie between ``rotate`` and ``ceiling``; against ``random`` the ceiling is the expected gain.
Even ``rotate`` keeps much of a turn's prefix: the replica that missed the last turn ran the one before, and a
session's prompt grows by each turn, so that older turn is most of it.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence

from specdist.bench.router_live import Plan, plan

Session = list[tuple[int, int]]  # per turn: (prompt tokens, prompt + output tokens)


def session_lengths(p: Plan, encode: Callable[[str], Sequence[int]]) -> list[Session]:
    """Each session's turns' token counts as the live bench builds its prompts (``encode``: text -> ids)."""
    out: list[Session] = []
    for group in p.groups:
        n, turns = 0, []
        for t in group:
            n += len(encode((" " if n else "") + t.text))
            turns.append((n, n + t.max_tokens))
            n += t.max_tokens
        out.append(turns)
    return out


def hit_tokens(sessions: Sequence[Session], assign: Sequence[Sequence[int]], block_size: int) -> int:
    """Prompt tokens the turns take from their replica's prefix cache; ``assign[s][k]``: session s's turn k's
    replica (module docstring)."""
    total = 0
    for s, turns in enumerate(sessions):
        for k in range(1, len(turns)):
            held = [turns[j][1] for j in range(k) if assign[s][j] == assign[s][k]]
            if held:
                total += min(max(held), turns[k][0] - 1) // block_size * block_size
    return total


def reach(sessions: Sequence[Session], replicas: int, block_size: int, draws: int = 2000, seed: int = 0) -> dict:
    """Hit tokens under each assignment (module docstring): ``ceiling``, ``random`` (mean of ``draws``), ``rotate``."""
    rng = random.Random(seed)
    drawn = sum(
        hit_tokens(sessions, [[rng.randrange(replicas) for _ in t] for t in sessions], block_size) for _ in range(draws)
    )
    return {
        "ceiling": hit_tokens(sessions, [[0] * len(t) for t in sessions], block_size),
        "random": drawn / draws,
        "rotate": hit_tokens(sessions, [[k % replicas for k in range(len(t))] for t in sessions], block_size),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/replicas.yaml", help="its target's tokenizer and KV block size")
    ap.add_argument("--workload", default="sessions")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-scale", type=float, default=0.1)
    ap.add_argument("--replicas", default="2,3,4,8", help="comma-separated replica counts")
    args = ap.parse_args(argv)
    from specdist.config import load_config
    from specdist.models.loader import load_tokenizer, resolve_model

    cfg = load_config(args.config)
    tok = load_tokenizer(resolve_model(cfg.target.model))
    sessions = session_lengths(
        plan(args.workload, args.requests, args.output_scale), lambda s: tok.encode(s, add_special_tokens=False)
    )
    print(f"{args.workload}, first {args.requests} requests, {len(sessions)} sessions; hit tokens:")
    print(f"{'replicas':>8}  {'ceiling':>7}  {'random':>8}  {'ceiling / it':>14}  {'rotate':>8}  {'ceiling / it':>14}")
    for n in (int(x) for x in args.replicas.split(",")):
        r = reach(sessions, n, cfg.engine.kv_block_size)
        c = r["ceiling"]

        def ratio(x: float) -> str:
            return f"({c / x:.2f}x)" if x else "(-)"

        print(
            f"{n:8d}  {c:7d}  {r['random']:8.0f}  {ratio(r['random']):>14}  {r['rotate']:8d}  {ratio(r['rotate']):>14}"
        )


if __name__ == "__main__":
    main()
