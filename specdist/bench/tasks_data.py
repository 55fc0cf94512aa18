"""The prompts of ``specdist bench tasks`` (:mod:`specdist.bench.tasks`), read from the package data file
``specdist/bench/data/tasks.jsonl``: five workloads.

Every prompt is a conversation (a list of ``{"role", "content"}`` messages ending with a user
turn) for the model's chat template. The texts are original to this project (no downloads), in
English, 100 to 600 tokens each once rendered:

- ``chat``: open questions with some context (64 of them, so that 16 clients can send four rounds
  of distinct prompts);
- ``code-edit``: a Python function of 20-40 lines to rewrite with one change (rename a
  variable, add type hints, add a docstring, ...): the answer mostly repeats the input (32 of
  them, so that 16 clients can send two rounds of distinct prompts);
- ``summarize``: a text of a few paragraphs to summarize (7);
- ``qa``: a passage and a question whose answer is a span of the passage (extractive, 7);
- ``multi-turn``: a chat history of two or three exchanges, answer the last user turn (7).

The file has one JSON object per line, one line per prompt, the tasks in the order above and each
task's prompts in their order: ``{"task": NAME, "prompt": [MESSAGE, ...]}``, and for ``code-edit``,
``summarize`` and ``qa`` a ``"source"`` object, the parts the prompt was written from:
``{"instruction", "code"}`` (the prompt is the instruction, then the code in a fenced Python block),
``{"instruction", "text"}`` (the instruction, a blank line, the text) and ``{"passage", "question",
"answer"}`` (the answer a span of the passage). Those parts stay available as :data:`CODE_EDIT`,
:data:`SUMMARIZE` and :data:`QA` (with :data:`CHAT`, the questions, and :data:`MULTI_TURN`, the
histories) so tests can check them: each code-edit prompt holds the code it asks to edit, each QA
answer is in its passage.
"""

from __future__ import annotations

import json
from importlib import resources

DATA_DIR, DATA_FILE = "data", "tasks.jsonl"  # inside the specdist.bench package


def load_records() -> list[dict]:
    """The data file's lines, each a ``{"task", "prompt"[, "source"]}`` object, in the file's order."""
    text = (resources.files("specdist.bench") / DATA_DIR / DATA_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


_RECORDS = load_records()


def _by_task(records: list[dict]) -> dict[str, list[list[dict[str, str]]]]:
    tasks: dict[str, list[list[dict[str, str]]]] = {}
    for record in records:
        tasks.setdefault(record["task"], []).append(record["prompt"])
    return tasks


# task name -> its prompts, each a conversation (messages ending with a user turn), in a fixed order
TASKS = _by_task(_RECORDS)


def _sources(task: str, *keys: str) -> list[tuple[str, ...]]:
    return [tuple(r["source"][k] for k in keys) for r in _RECORDS if r["task"] == task]


CHAT: list[str] = [conv[0]["content"] for conv in TASKS["chat"]]  # the open questions
CODE_EDIT: list[tuple[str, str]] = _sources("code-edit", "instruction", "code")
SUMMARIZE: list[tuple[str, str]] = _sources("summarize", "instruction", "text")
QA: list[tuple[str, str, str]] = _sources("qa", "passage", "question", "answer")
MULTI_TURN: list[list[dict[str, str]]] = [list(conv) for conv in TASKS["multi-turn"]]
