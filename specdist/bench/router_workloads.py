"""The workloads of ``specdist bench router``: package data files ``specdist/bench/data/router_<name>.jsonl``,
written by this module (``python -m specdist.bench.router_workloads``: the same files from the same seed).

- ``sessions``: multi-turn conversations (kind ``chat``) and repeated edits of one source file (kind
  ``edit``), 4 to 6 turns each. A line is one turn: ``{"session", "turn", "kind", "user", "answer",
  "max_tokens"}``; turn n's prompt is turn n-1's prompt, its answer and turn n's ``user`` text (turn 0's
  prompt: its ``user`` text), so each prompt extends the last one (:func:`load`).
- ``mixed``: half edits of a source file (kind ``edit``: the answer repeats the file, high acceptance),
  half free writing from a short brief with long outputs (kind ``write``, low acceptance): the
  heterogeneous-acceptance case. A line: ``{"id", "kind", "user", "output_tokens", "max_tokens"}``.
- ``chat``: independent questions (kind ``chat``), lines as ``mixed``'s.

The texts are synthetic (pseudo-words and pseudo-code from a seeded generator): the simulator reads a text
as whitespace-separated tokens, so what matters is their lengths and which texts repeat which.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

WORKLOADS = ("sessions", "mixed", "chat")
SEED = 51


@dataclass(frozen=True)
class Turn:
    """One request of a workload: its prompt and answer as words, its kind, its session (None: none) and
    the position of the request in its session (0 for a request without one)."""

    prompt: tuple[str, ...]
    output_tokens: int
    max_tokens: int
    kind: str
    session: str | None
    turn: int
    answer: tuple[str, ...] = ()


def load(name: str) -> list[list[Turn]]:
    """The workload's requests grouped by session, in the file's order (a request without a session is a
    group of one): turn n's prompt is the last prompt, its answer and turn n's user text."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r} (expected one of: {', '.join(WORKLOADS)})")
    text = (resources.files("specdist.bench") / "data" / f"router_{name}.jsonl").read_text(encoding="utf-8")
    groups: list[list[Turn]] = []
    by_session: dict[str, list[Turn]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        user = tuple(d["user"].split())
        if "session" not in d:
            groups.append([Turn(user, d["output_tokens"], d["max_tokens"], d["kind"], None, 0)])
            continue
        turns = by_session.get(d["session"])
        if turns is None:
            turns = by_session[d["session"]] = []
            groups.append(turns)
        assert d["turn"] == len(turns), f"{name}: session {d['session']} turns out of order"
        prompt = user if not turns else turns[-1].prompt + turns[-1].answer + user
        answer = tuple(d["answer"].split())
        turns.append(Turn(prompt, len(answer), d["max_tokens"], d["kind"], d["session"], d["turn"], answer))
    return groups


def first_requests(name: str, requests: int, output_scale: float) -> list[list[Turn]]:
    """The workload's first ``requests`` requests in the file's order, grouped by session (the last session cut
    short), as the bench router sends them: each asks for ``max(1, round(output_tokens x output_scale))`` tokens
    and makes that many (``ignore_eos``), so its ``output_tokens`` and ``max_tokens`` are both that."""
    groups: list[list[Turn]] = []
    n = 0
    for group in load(name):
        if n >= requests:
            break
        cut = []
        for t in group[: requests - n]:
            tokens = max(1, round(t.output_tokens * output_scale))
            cut.append(replace(t, output_tokens=tokens, max_tokens=tokens))
        groups.append(cut)
        n += len(cut)
    return groups


# ---- the generator ----------------------------------------------------------------------------------------

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "pe", "da", "gu", "zen", "ri", "mo", "fa", "el")


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))


def _prose(rng: random.Random, n: int) -> list[str]:
    return [_word(rng) for _ in range(n)]


def _source_file(rng: random.Random, n: int) -> list[str]:
    """About n tokens of pseudo-code: functions of statements over a few names."""
    names = [_word(rng) for _ in range(8)]
    out: list[str] = []
    while len(out) < n:
        out += ["def", rng.choice(names) + "_" + _word(rng), "(", rng.choice(names), ",", rng.choice(names), ")", ":"]
        for _ in range(rng.randint(3, 8)):
            out += [rng.choice(names), "=", rng.choice(names), rng.choice("+-*/"), str(rng.randint(0, 99)), ";"]
        out += ["return", rng.choice(names), ";"]
    return out[:n]


def _edit(rng: random.Random, code: list[str]) -> list[str]:
    """The file with a few tokens changed (a rename, a constant): what an edit's answer mostly repeats."""
    out = list(code)
    for _ in range(max(1, len(out) // 40)):
        out[rng.randrange(len(out))] = _word(rng)
    return out


def _sessions(rng: random.Random) -> list[dict]:
    lines = []
    for s in range(48):
        kind = "chat" if s % 2 == 0 else "edit"
        name = f"{kind}-{s // 2:02d}"
        turns = rng.randint(4, 6)
        code = _source_file(rng, rng.randint(150, 350))
        for t in range(turns):
            if kind == "chat":
                user = _prose(rng, rng.randint(20, 80) if t else rng.randint(60, 200))
                answer = _prose(rng, rng.randint(80, 250))
                max_tokens = 512
            else:
                ask = _prose(rng, rng.randint(8, 25))
                user = ask + code if t == 0 else ask
                code = _edit(rng, code)
                answer = code
                max_tokens = len(code) + 64
            lines.append(
                {
                    "session": name,
                    "turn": t,
                    "kind": kind,
                    "user": " ".join(user),
                    "answer": " ".join(answer),
                    "max_tokens": max_tokens,
                }
            )
    return lines


def _mixed(rng: random.Random) -> list[dict]:
    lines = []
    for i in range(200):
        if i % 2 == 0:
            code = _source_file(rng, rng.randint(150, 350))
            lines.append(
                {
                    "id": f"edit-{i // 2:03d}",
                    "kind": "edit",
                    "user": " ".join(_prose(rng, 15) + code),
                    "output_tokens": len(code),
                    "max_tokens": len(code) + 64,
                }
            )
        else:
            lines.append(
                {
                    "id": f"write-{i // 2:03d}",
                    "kind": "write",
                    "user": " ".join(_prose(rng, rng.randint(30, 80))),
                    "output_tokens": rng.randint(600, 1000),
                    "max_tokens": 1024,
                }
            )
    return lines


def _chat(rng: random.Random) -> list[dict]:
    return [
        {
            "id": f"chat-{i:03d}",
            "kind": "chat",
            "user": " ".join(_prose(rng, rng.randint(40, 250))),
            "output_tokens": rng.randint(80, 400),
            "max_tokens": 512,
        }
        for i in range(240)
    ]


def generate(name: str) -> list[dict]:
    """The workload's lines, the same for the same :data:`SEED`."""
    return {"sessions": _sessions, "mixed": _mixed, "chat": _chat}[name](random.Random(f"{SEED}-{name}"))


def write(directory: Path) -> list[Path]:
    paths = []
    for name in WORKLOADS:
        path = directory / f"router_{name}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in generate(name)), encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data"):
        print(p)
