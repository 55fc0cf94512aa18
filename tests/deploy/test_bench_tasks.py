"""`specdist bench tasks`: its prompt data is well-formed, a --quick run on the tiny models reports
every task x variant x concurrency with speedups over `none` (a smoke run: it measures, it does not
judge), and bad flags are one-line errors before any model loads."""

from __future__ import annotations

import ast
import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import yaml
from support.helpers import tiny_config

from specdist.bench import tasks as tasks_bench
from specdist.bench import tasks_data
from specdist.bench.tasks_data import CHAT, CODE_EDIT, MULTI_TURN, QA, SUMMARIZE, TASKS
from specdist.cli import main

TASK_NAMES = ["chat", "code-edit", "summarize", "qa", "multi-turn"]
TASK_COUNTS = {"chat": 64, "code-edit": 32, "summarize": 7, "qa": 7, "multi-turn": 7}
SOURCE_KEYS = {
    "code-edit": {"instruction", "code"},
    "summarize": {"instruction", "text"},
    "qa": {"passage", "question", "answer"},
}
ROW_KEYS = {
    "concurrency",
    "task",
    "variant",
    "requests",
    "tokens",
    "seconds",
    "tokens_per_s",
    "steps",
    "emitted",
    "drafted",
    "accepted",
    "acceptance",
    "tokens_per_step",
    "speedup",
    "same_tokens_as_none",
    "phase_s",
}
REQUEST_KEYS = {
    "prompt",
    "pass",
    "batch",
    "seed",
    "prompt_tokens",
    "tokens",
    "finish_reason",
    "steps",
    "emitted",
    "drafted",
    "accepted",
}


def _words(conversation: list[dict]) -> int:
    return sum(len(m["content"].split()) for m in conversation)


def test_task_data_is_well_formed():
    assert list(TASKS) == TASK_NAMES
    for name, prompts in TASKS.items():
        assert len(prompts) >= 6, name
        for conv in prompts:
            roles = [m["role"] for m in conv]
            assert all(set(m) == {"role", "content"} and m["content"].strip() for m in conv)
            assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], (name, roles)
            # 100-600 tokens rendered (the default model's tokenizer: about 1.3 tokens per word, plus the
            # template's ~25; measured 139-396): a word count keeps the test free of the 10 s tokenizer load
            assert 90 <= _words(conv) <= 400, (name, _words(conv))
        assert len({json.dumps(c) for c in prompts}) == len(prompts), f"{name}: a prompt is repeated"
    assert [len(c) for c in TASKS["chat"]] == [1] * len(CHAT)
    for (instruction, code), conv in zip(CODE_EDIT, TASKS["code-edit"], strict=True):
        ast.parse(code)  # real Python
        assert 20 <= len(code.strip().splitlines()) <= 40
        assert code.strip() in conv[0]["content"] and conv[0]["content"].startswith(instruction)
        assert "return the complete" in instruction.lower()  # the answer repeats the (changed) input
    for (_, text), conv in zip(SUMMARIZE, TASKS["summarize"], strict=True):
        assert text in conv[0]["content"] and len(text.split("\n\n")) >= 3  # a few paragraphs
    for (passage, question, answer), conv in zip(QA, TASKS["qa"], strict=True):
        assert answer in passage, answer  # extractive: the answer is a span of the passage
        assert passage in conv[0]["content"] and conv[0]["content"].endswith(question)
    assert [len(c) for c in TASKS["multi-turn"]] == [len(m) for m in MULTI_TURN]
    assert all(len(c) >= 5 for c in TASKS["multi-turn"])  # at least 2 exchanges before the last turn


def _is_prompt(prompt) -> bool:
    """A non-empty string, or a non-empty list of {role, content} messages with non-empty strings."""
    if isinstance(prompt, str):
        return bool(prompt.strip())
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(
            isinstance(m, dict)
            and set(m) == {"role", "content"}
            and isinstance(m["role"], str)
            and isinstance(m["content"], str)
            and m["role"]
            and m["content"].strip()
            for m in prompt
        )
    )


def test_task_data_file_loads():
    """The prompts are package data (specdist/bench/data/tasks.jsonl): one JSON object per line, the tasks in
    order with their counts, each prompt well-formed; the module's names are read from it, and
    pyproject.toml ships it in the wheel."""
    data = resources.files("specdist.bench") / tasks_data.DATA_DIR / tasks_data.DATA_FILE
    lines = data.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert records == tasks_data.load_records()
    assert all(isinstance(r, dict) for r in records)
    names = [r["task"] for r in records]
    assert list(dict.fromkeys(names)) == TASK_NAMES
    assert names == sorted(names, key=TASK_NAMES.index)  # each task's lines together, in order
    assert {t: names.count(t) for t in TASK_NAMES} == TASK_COUNTS
    assert {t: len(p) for t, p in TASKS.items()} == TASK_COUNTS
    for r in records:
        assert set(r) == {"task", "prompt"} | ({"source"} if r["task"] in SOURCE_KEYS else set()), r.keys()
        assert _is_prompt(r["prompt"]), r
        if r["task"] in SOURCE_KEYS:
            assert set(r["source"]) == SOURCE_KEYS[r["task"]]
            assert all(isinstance(v, str) and v.strip() for v in r["source"].values())
    assert [r["prompt"] for r in records] == [p for t in TASK_NAMES for p in TASKS[t]]
    assert CHAT == [r["prompt"][0]["content"] for r in records if r["task"] == "chat"]
    assert MULTI_TURN == TASKS["multi-turn"]
    assert [len(CODE_EDIT), len(SUMMARIZE), len(QA)] == [TASK_COUNTS[t] for t in ("code-edit", "summarize", "qa")]
    assert all(type(x) is tuple for x in CODE_EDIT + SUMMARIZE + QA)
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "data/*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["specdist.bench"]


def test_plain_text_and_batches():
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    assert tasks_bench.plain_text(conv) == "User: hi\n\nAssistant: hello\n\nUser: bye\n\nAssistant:"
    assert tasks_bench.batches(3, 1) == [[0], [1], [2]]
    assert tasks_bench.batches(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]  # prompts repeat to fill a batch
    assert tasks_bench.batches(2, 5) == [[0, 1, 0, 1, 0]]
    assert tasks_bench.batches(3, 2, rounds=3) == [[0, 1, 2, 0, 1, 2]]  # sustained: one batch of C x R


class _FakeRequest:
    def __init__(self, prompt: str, steps: int):
        self.request_id, self.left = prompt, steps

    @property
    def finished(self) -> bool:
        return self.left <= 0

    def to_output(self) -> str:
        return self.request_id


class _FakeEngine:
    """The request of prompt p runs ``steps[p]`` steps; records which were in flight at each step."""

    def __init__(self, steps: dict[str, int], fail_at: int | None = None):
        self.steps, self.fail_at = steps, fail_at
        self.reqs: dict[str, _FakeRequest] = {}
        self.in_flight: list[list[str]] = []
        self.aborted: list[str] = []

    def add_request(self, prompt: str, params) -> _FakeRequest:
        self.reqs[prompt] = _FakeRequest(prompt, self.steps[prompt])
        return self.reqs[prompt]

    def step(self) -> None:
        if len(self.in_flight) == self.fail_at:
            raise KeyboardInterrupt
        live = [r for r in self.reqs.values() if not r.finished]
        self.in_flight.append([r.request_id for r in live])
        for r in live:
            r.left -= 1

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        self.reqs[rid].left = 0
        return True


def test_sustained_clients_queue_their_next_request_as_the_last_ends():
    """Two clients, six requests: client j % 2 sends request j once its request j - 2 has ended, so two
    are in flight until the last round; outputs in request order; an interrupt aborts what runs."""
    prompts = ["p0", "p1", "p2", "p3", "p4", "p5"]
    eng = _FakeEngine(dict(zip(prompts, [3, 1, 1, 2, 2, 1])))
    assert tasks_bench.run_clients(eng, prompts, [None] * 6, 2) == prompts
    assert eng.in_flight == [["p0", "p1"], ["p0", "p3"], ["p0", "p3"], ["p2", "p5"], ["p4"], ["p4"]]
    assert eng.aborted == []
    eng = _FakeEngine({"a": 5, "b": 5, "c": 5}, fail_at=2)
    with pytest.raises(KeyboardInterrupt):
        tasks_bench.run_clients(eng, ["a", "b", "c"], [None] * 3, 2)
    assert eng.aborted == ["a", "b"] and list(eng.reqs) == ["a", "b"]  # the third was never sent


@pytest.fixture
def chat_model(tiny_models, tmp_path):
    """The tiny target with a chat template (conversations, multi-turn included, go through it)."""
    from transformers import AutoTokenizer

    path = tmp_path / "chat-target"
    shutil.copytree(tiny_models["target"], path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def chat_config(tiny_models, chat_model, tmp_path) -> str:
    """A config file: the chat-template target, a model draft of k = 3."""
    cfg = tiny_config(tiny_models, "model", 3)
    cfg["target"]["model"] = chat_model
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_quick_run_reports_every_task_and_variant(chat_config, tmp_path, capsys):
    path = chat_config
    out_json = tmp_path / "r.json"
    drafts = ["none", "ngram", "model", "self-w8"]
    assert (
        main(
            [
                "bench",
                "tasks",
                "--config",
                str(path),
                "--drafts",
                ",".join(drafts),
                "--quick",
                "--concurrency",
                "1",
                "--concurrency",
                "3",
                "--ignore-eos",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "specdist.bench.tasks/1"
    s = doc["settings"]
    assert (s["tasks"], s["drafts"], s["concurrency"], s["max_tokens"], s["prompts_per_task"], s["quick"]) == (
        TASK_NAMES,
        drafts,
        [1, 3],
        16,
        1,
        True,
    )
    assert s["chat_template"] is True and s["temperature"] == 0 and s["ignore_eos"] is True
    assert s["max_batch_size"] == 8  # the config's, already >= 3
    assert [v["name"] for v in doc["variants"]] == drafts
    assert [v["config"]["draft"]["method"] for v in doc["variants"]] == drafts
    assert [v["config"]["draft"]["model"] is not None for v in doc["variants"]] == [False, False, True, False]
    assert all(v["config"]["engine"]["max_model_len"] == s["max_model_len"] for v in doc["variants"])
    assert set(doc["tasks"]) == set(TASK_NAMES) and all(t["prompts"] == 1 for t in doc["tasks"].values())
    assert s["max_model_len"] == max(t["prompt_tokens"][0] for t in doc["tasks"].values()) + 16 + 8
    rows = doc["results"]
    assert [(r["concurrency"], r["task"], r["variant"]) for r in rows] == [
        (c, t, v) for c in (1, 3) for t in TASK_NAMES + ["all"] for v in drafts
    ]
    by = {(r["concurrency"], r["task"], r["variant"]): r for r in rows}
    for r in rows:
        c, task = r["concurrency"], r["task"]
        assert ROW_KEYS <= set(r)
        assert r["requests"] == (c if task != "all" else c * len(TASK_NAMES))
        assert r["tokens"] == 16 * r["requests"] and r["tokens_per_s"] > 0  # EOS ignored: equal work
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-12)
        none = by[(c, task, "none")]
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / none["tokens_per_s"], rel=1e-12)
        assert r["tokens_per_step"] == pytest.approx(r["emitted"] / r["steps"], rel=1e-12)
        if r["variant"] == "none":
            assert r["drafted"] == 0 and r["acceptance"] is None and r["tokens_per_step"] == 1.0
        else:
            assert r["drafted"] > 0 and r["acceptance"] == pytest.approx(r["accepted"] / r["drafted"], rel=1e-12)
        assert r["same_tokens_as_none"] == r["requests"]  # greedy exact speculative decoding: the same tokens
        # one prompt per task: C = 3 sends it three times; each level counts anew (its draft indexes forgot)
        assert r["repeated_prompts"] == (0 if c == 1 else 2) * (len(TASK_NAMES) if task == "all" else 1)
        if task == "all":
            parts = [by[(c, t, r["variant"])] for t in TASK_NAMES]
            assert r["tokens"] == sum(p["tokens"] for p in parts)
            assert r["seconds"] == pytest.approx(sum(p["seconds"] for p in parts), rel=1e-9)
        else:
            assert len(r["batch_s"]) == 1 and r["seconds"] == pytest.approx(sum(r["batch_s"]), rel=1e-12)
            reqs = r["per_request"]
            assert len(reqs) == c and all(set(q) == REQUEST_KEYS for q in reqs)
            assert [q["seed"] for q in reqs] == [1000 + i for i in range(c)]  # the same in every variant
            assert sum(q["tokens"] for q in reqs) == r["tokens"] and sum(q["steps"] for q in reqs) == r["steps"]
            assert all(q["prompt_tokens"] == doc["tasks"][task]["prompt_tokens"][0] for q in reqs)
    out = capsys.readouterr()
    assert "Concurrency 1 (one request at a time):" in out.out
    assert "Concurrency 3 (3 requests submitted at once, aggregate tokens/s):" in out.out
    assert "| code-edit | ngram | 1 | 16 |" in out.out and "| all tasks | model | 15 | 240 |" in out.out
    assert "Greedy, same tokens as none: ngram 5/5, model 5/5, self-w8 5/5" in out.out
    assert "[bench tasks] C=3 multi-turn: none " in out.err


def test_sustained_load_runs_rounds_of_client_requests(chat_config, tmp_path, capsys):
    """--rounds 3 at C = 2: six requests per task, seeds 1000-1005, every variant the same tokens."""
    path = chat_config
    out_json = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "tasks",
                "--config",
                str(path),
                "--drafts",
                "none,ngram",
                "--tasks",
                "qa,chat",
                "--quick",
                "--concurrency",
                "2",
                "--rounds",
                "3",
                "--ignore-eos",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["rounds"] == 3
    for r in doc["results"]:
        assert r["requests"] == (6 if r["task"] != "all" else 12) and r["tokens"] == 16 * r["requests"]
        # one prompt per task: all six requests but the first repeat it
        assert r["repeated_prompts"] == {"qa": 5, "chat": 5, "all": 10}[r["task"]]
        assert r["same_tokens_as_none"] == r["requests"]
        if r["task"] != "all":
            assert len(r["batch_s"]) == 1
            assert [q["seed"] for q in r["per_request"]] == [1000 + j for j in range(6)]
            assert {q["prompt"] for q in r["per_request"]} == {0}  # --quick: one prompt per task, repeated
    out = capsys.readouterr().out
    assert "Concurrency 2 (2 clients sending 3 requests each back to back, aggregate tokens/s):" in out
    assert "10 of 12 requests repeat a prompt the engines were sent before in the same pass" in out


def test_repeated_passes_are_pooled(chat_config, tmp_path, capsys):
    """--repeat 2: every batch twice, the same seeds, pooled; each pass counts its own repeats. A variant
    METHOD:K drafts at most K."""
    out_json = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "tasks",
                "--config",
                chat_config,
                "--drafts",
                "none,ngram:2",
                "--tasks",
                "qa",
                "--quick",
                "--concurrency",
                "2",
                "--repeat",
                "2",
                "--ignore-eos",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    doc = json.loads(out_json.read_text())
    assert doc["settings"]["repeat"] == 2
    assert [
        (v["name"], v["config"]["draft"]["method"], v["config"]["draft"]["num_speculative_tokens"])
        for v in doc["variants"]
    ][1] == ("ngram:2", "ngram", 2)
    for r in doc["results"]:
        assert r["requests"] == 4 and r["same_tokens_as_none"] == 4
        assert r["repeated_prompts"] == 2  # one prompt, sent twice in each pass
        if r["task"] == "qa":
            assert len(r["batch_s"]) == 2 and r["seconds"] == pytest.approx(sum(r["batch_s"]), rel=1e-12)
            assert [(q["pass"], q["seed"]) for q in r["per_request"]] == [(0, 1000), (0, 1001), (1, 1000), (1, 1001)]
    captured = capsys.readouterr()
    assert "Concurrency 2 (2 requests submitted at once, aggregate tokens/s; 2 passes pooled):" in captured.out
    assert "[bench tasks] C=2 qa (pass 2 of 2, pooled so far): none " in captured.err


def test_without_a_chat_template_prompts_are_plain_text(tiny_models, tmp_path):
    """The tiny tokenizer has no chat template: conversations become User:/Assistant: text."""
    from specdist.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(tiny_models["target"]))
    prompts, chat = tasks_bench.encode_tasks(tok, ["multi-turn", "qa"], 2)
    assert chat is False and [len(prompts[t]) for t in ("multi-turn", "qa")] == [2, 2]
    want = tok.encode(tasks_bench.plain_text(TASKS["multi-turn"][1]), add_special_tokens=True)
    assert prompts["multi-turn"][1] == list(want)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--tasks", "chat,poetry"],
            "--tasks: unknown task 'poetry'; choose from chat, code-edit, summarize, qa, multi-turn",
        ),
        (
            ["--drafts", "none,eagle"],
            "--drafts 'eagle': config draft.method: no draft method 'eagle'; there are eagle3, ",
        ),
        (["--drafts", "none,model"], "--drafts 'model': config draft.model: must be a non-empty string"),
        (["--drafts", "none,ngram,none"], "--drafts: a draft is named twice"),
        (["--drafts", "none,suffix:0"], "--drafts 'suffix:0': K in METHOD:K must be a positive integer"),
        (["--drafts", "none,suffix:99"], "--drafts 'suffix:99': config draft.num_speculative_tokens: "),
        (["--concurrency", "0"], "--concurrency: need positive integers"),
        (["--rounds", "0"], "--rounds: must be >= 1, got 0"),
        (["--repeat", "0"], "--repeat: must be >= 1, got 0"),
        (["--tasks", "chat,,qa"], "--tasks: a comma-separated list without empty items"),
        (["--json", "/nonexistent/dir/r.json"], "--json: the directory of '/nonexistent/dir/r.json' does not exist"),
    ],
)
def test_bad_flags_are_one_line_errors_before_loading(flags, message, capsys, monkeypatch):
    from specdist.engine.local import Engine

    def never(*args, **kwargs):
        raise AssertionError("no engine may be built")

    monkeypatch.setattr(Engine, "from_config", never)
    with pytest.raises(SystemExit) as e:
        main(["bench", "tasks", "--quick", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdist: error: {message}") and err.count("\n") == 1, err


def test_help_shows_every_default(capsys, monkeypatch):
    from specdist.cli import _shows_default, build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit) as e:
        main(["bench", "tasks", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices["bench"]
    sub = next(a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction").choices["tasks"]
    for action in sub._actions:
        if action.option_strings and _shows_default(action):
            assert f"default: {action.default}" in text or "default" in action.help, action.option_strings
    assert "(default: none,self-w8,ngram)" in text and "most new tokens per request (default: 128)" in text
