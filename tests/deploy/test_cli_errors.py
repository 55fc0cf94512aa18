"""The command line fails early and in one line, says where it runs and what it loads.

Everything that can be checked without the weights is checked before loading them: a busy
``--port``, a missing optional dependency (Ray), an empty or over-long prompt.
Loading and bring-up report progress on stderr; a request the server aborted or failed
exits 1; ``--help`` shows every default. Slow parts (model loading, Ray) are replaced by
fakes that fail the test if the command reaches them too early.
"""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
import yaml
from support.helpers import tiny_config

import specdist.api.preflight as preflight
import specdist.api.serving as serving
import specdist.client
import specdist.models.loader as loader
from specdist.cli import main
from specdist.config import Config, load_config
from specdist.errors import ListenError


def _write_config(tmp_path, cfg: dict, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _cluster_config(tiny_models, tmp_path, tp: int = 1) -> str:
    cfg = tiny_config(tiny_models, "model", 3)
    cfg["cluster"] = {"enabled": True, "tensor_parallel_size": tp, "num_draft_workers": 1}
    return _write_config(tmp_path, cfg, "cluster.yaml")


def _one_line_error(capsys, code: int = 2) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specdist: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _never(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} must not be called")

    return fail


@pytest.fixture
def busy_port():
    """A port someone listens on (plain socket, no SO_REUSEPORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# ----------------------------------------------------------------- 1. busy port


def test_serve_on_busy_port_fails_before_loading(busy_port, monkeypatch, capsys):
    monkeypatch.setattr(serving, "start_backend", _never("start_backend"))
    with pytest.raises(SystemExit) as ei:
        main(["serve", "--port", str(busy_port)])
    assert ei.value.code == 2
    line = _one_line_error(capsys)
    assert line == f"specdist: error: cannot listen on 127.0.0.1:{busy_port}: the port is in use"


def test_serve_on_busy_port_subprocess_is_fast_and_one_line(busy_port):
    """The installed entry point: exit 2, one stderr line, no model load (well under its ~20 s)."""
    proc = subprocess.run(
        [sys.executable, "-m", "specdist.cli", "serve", "--port", str(busy_port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"specdist: error: cannot listen on 127.0.0.1:{busy_port}: the port is in use"


def test_port_of_a_running_grpc_server_is_refused():
    """grpc listens with SO_REUSEPORT; the check does not set it, so a second server is refused
    instead of silently sharing the port."""
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(ListenError, match="in use"):
            preflight.check_listen("127.0.0.1", port)
    finally:
        server.stop(0)


def test_check_listen_accepts_a_free_port_and_rejects_bad_ones():
    preflight.check_listen("127.0.0.1", 0)
    with pytest.raises(ListenError, match=r"\[0, 65535\]"):
        preflight.check_listen("127.0.0.1", 70000)
    with pytest.raises(ListenError, match="cannot listen on no-such-host.invalid:1"):
        preflight.check_listen("no-such-host.invalid", 1)


class _FakeDeployment:
    def __init__(self, n_targets: int = 2, n_drafts: int = 1):
        self.targets, self.drafts = [object()] * n_targets, [object()] * n_drafts
        self.stopped = False

    def stop(self) -> None:
        self.targets, self.drafts, self.stopped = [], [], True


def test_serve_bind_failure_after_loading_is_one_line(monkeypatch, capsys):
    """If the port is taken between the check and grpc's bind, grpc's RuntimeError becomes one
    line too, and the backend (here a fake deployment) is still torn down and reported."""
    dep = _FakeDeployment()
    engine = SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(preflight, "check_listen", lambda host, port: None)
    monkeypatch.setattr(serving, "start_backend", lambda *a, **k: serving.Backend(engine, deployment=dep))

    async def fail_to_bind(*args, **kwargs):
        raise RuntimeError(
            "Failed to bind to address 127.0.0.1:4242; set GRPC_VERBOSITY=debug environment "
            "variable to see detailed error message."
        )

    import specdist.api.grpc_server

    monkeypatch.setattr(specdist.api.grpc_server, "serve", fail_to_bind)
    with pytest.raises(SystemExit) as ei:
        main(["serve", "--port", "4242"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "specdist: error: cannot listen on 127.0.0.1:4242: Failed to bind to address 127.0.0.1:4242\n" in err
    assert dep.stopped and "deployment stopped" in err and "(3 actors, placement groups removed)" in err
    assert "Traceback" not in err
    # serve froze this process's start-up objects once the backend was up, and unfroze them as it ended
    assert "start-up objects frozen out of the garbage collector's walks" in err and gc.get_freeze_count() == 0


# ------------------------------------------------------- 2. optional dependencies


@pytest.mark.parametrize("command", [["serve"], ["generate", "hello"], ["demo"]])
def test_cluster_without_ray_names_the_extra(command, tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ModuleNotFoundError
    monkeypatch.setattr(preflight, "check_listen", _never("check_listen"))  # the dependency check comes first
    monkeypatch.setattr(loader, "load_model", _never("load_model"))
    monkeypatch.setattr(loader, "load_tokenizer", _never("load_tokenizer"))
    cfg = _cluster_config(tiny_models, tmp_path)
    with pytest.raises(SystemExit) as ei:
        main([command[0], "--config", cfg, *command[1:]])
    assert ei.value.code == 2
    assert _one_line_error(capsys) == 'specdist: error: cluster.enabled needs Ray: pip install -e ".[distributed]"'


@pytest.mark.parametrize("command", [["serve"], ["generate", "hello"], ["demo"]])
@pytest.mark.parametrize(
    "draft,message",
    [
        ({"method": "medusa"}, "config draft.method: no draft method 'medusa'; there are eagle3, hybrid, model, "),
        (
            {"method": "ngram", "ngram_mx": 3},
            "config draft.ngram_mx: unknown key (expected one of: confidence_threshold,",
        ),
        (
            {"method": "suffix", "suffix_min_prob": 2.0},
            "config draft.suffix_min_prob: must be a number in [0.0, 1.0], ",
        ),
        ({"method": "ngram", "model": "x"}, "config draft.model: is only used with methods 'eagle3' and 'model', not "),
    ],
)
def test_a_draft_section_no_method_serves_is_one_line_before_anything_loads(
    command, draft, message, tiny_models, tmp_path, monkeypatch, capsys
):
    """The draft methods check their names and settings (specdist.cores.proposers.check_draft) where load_config
    cannot: every command that serves a config calls them first, before the port, the models or Ray."""
    monkeypatch.setattr(preflight, "check_listen", _never("check_listen"))
    monkeypatch.setattr(loader, "load_model", _never("load_model"))
    monkeypatch.setattr(loader, "load_tokenizer", _never("load_tokenizer"))
    monkeypatch.setattr(loader, "resolve_model", _never("resolve_model"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": tiny_models["target"]}, "draft": draft}))
    with pytest.raises(SystemExit) as ei:
        main([command[0], "--config", str(path), *command[1:]])
    assert ei.value.code == 2
    assert _one_line_error(capsys).startswith(f"specdist: error: {message}")


def test_tensor_parallel_needs_only_ray(tiny_models, tmp_path, monkeypatch):
    """Tensor parallelism is plain torch.distributed: a 2-rank config passes the checks with Ray alone."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` would raise

    class BackendReached(Exception):
        pass

    def start_backend(config, *args, **kwargs):
        raise BackendReached(config)

    monkeypatch.setattr(serving, "start_backend", start_backend)
    cfg = _cluster_config(tiny_models, tmp_path, tp=2)
    with pytest.raises(BackendReached):
        main(["serve", "--config", cfg, "--port", "0"])


# ------------------------------------------- 3. generate on the deployment (faked)


class _FakeEngine:
    def __init__(self, config, pieces=("x ", "y"), interrupt_after: int | None = None):
        self.config, self.k = config, config.draft.num_speculative_tokens
        self.pieces, self.interrupt_after = pieces, interrupt_after
        self.calls, self.closed, self.last_output = [], False, None

    def stream(self, prompt, params, chat=False):
        self.calls.append((prompt, params, chat))
        for i, p in enumerate(self.pieces):
            if self.interrupt_after == i:
                raise KeyboardInterrupt
            yield p
        m = SimpleNamespace(
            steps=1, drafted=3, accepted=2, acceptance_rate=2 / 3, mean_accepted_length=2.0, time_to_first_token=0.01
        )
        self.last_output = SimpleNamespace(token_ids=[1, 2], finish_reason="length", metrics=m)

    def close(self) -> None:
        self.closed = True


def _fake_backend(monkeypatch, deployed: bool, **engine_kwargs):
    made = {}

    def start_backend(config, ray_address=None, worker_host="127.0.0.1", log=None, tokenizer=None, sources=None):
        cfg = load_config(config)
        made["engine"] = _FakeEngine(cfg, **engine_kwargs)
        made["deployment"] = _FakeDeployment() if deployed else None
        made["ray_address"] = ray_address
        made["backend"] = serving.Backend(
            made["engine"],
            deployment=made["deployment"],
            target_address="10.0.0.1:7000" if deployed else None,
            draft_addresses=["10.0.0.2:7001"] if deployed else [],
        )
        return made["backend"]

    monkeypatch.setattr(serving, "start_backend", start_backend)
    monkeypatch.setattr(preflight, "check_config", lambda cfg: None)
    return made


def test_generate_with_cluster_enabled_runs_on_the_deployment(tiny_models, tmp_path, monkeypatch, capsys):
    made = _fake_backend(monkeypatch, deployed=True)
    cfg = _cluster_config(tiny_models, tmp_path)
    rc = main(["generate", "--config", cfg, "--ray-address", "auto", "--max-tokens", "5", "a b"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == "x y\n"
    ((prompt, params, chat),) = made["engine"].calls
    assert prompt == "a b" and params.max_tokens == 5 and chat is False  # the tiny model has no chat template
    assert made["ray_address"] == "auto"
    assert "[specdist] running on a Ray deployment: TP=1, 1 draft worker(s)" in err
    assert "on a Ray deployment: TP=1 target at 10.0.0.1:7000, 1 draft worker(s)" in err
    assert made["engine"].closed and made["deployment"].stopped
    assert "deployment stopped" in err and "acceptance=66.7%" in err


def test_generate_interrupted_still_stops_the_deployment(tiny_models, tmp_path, monkeypatch, capsys):
    made = _fake_backend(monkeypatch, deployed=True, interrupt_after=1)
    cfg = _cluster_config(tiny_models, tmp_path)
    assert main(["generate", "--config", cfg, "a b"]) == 130
    assert made["engine"].closed and made["deployment"].stopped
    assert "deployment stopped" in capsys.readouterr().err


def test_generate_in_process_passes_raw_text_and_chat_flag(tiny_models, tmp_path, monkeypatch, capsys):
    """The engine gets the text as typed and chat=True when the model has a chat template
    (it applies the template itself), chat=False with --raw."""
    made = _fake_backend(monkeypatch, deployed=False)
    tok = loader.load_tokenizer(loader.ModelSource(tiny_models["target"], None))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    monkeypatch.setattr(loader, "load_tokenizer", lambda source, progress=None: tok)
    cfg = _write_config(tmp_path, tiny_config(tiny_models, "model", 3))
    assert main(["generate", "--config", cfg, "a b"]) == 0
    assert made["engine"].calls[0][0] == "a b" and made["engine"].calls[0][2] is True
    assert "[specdist] running in process" in capsys.readouterr().err
    assert main(["generate", "--config", cfg, "--raw", "a b"]) == 0
    assert made["engine"].calls[0][2] is False


# ------------------------------------------------- 4. prompt checks before weights


@pytest.mark.parametrize(
    "prompt,needle",
    [
        ("", "prompt: is empty"),
        ("a " * 100, "prompt: has 100 tokens; the context limit is 64"),
    ],
)
def test_bad_prompt_fails_before_loading_weights(prompt, needle, tiny_models, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loader, "load_model", _never("load_model"))
    monkeypatch.setattr(serving, "start_backend", _never("start_backend"))
    cfg = _write_config(tmp_path, tiny_config(tiny_models, "model", 3))
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--config", cfg, "--raw", prompt])
    assert ei.value.code == 2
    assert needle in _one_line_error(capsys)


# ------------------------------------------------------------ 5. progress lines


def test_generate_reports_loading_on_stderr(tiny_models, tmp_path, capsys):
    cfg = _write_config(tmp_path, tiny_config(tiny_models, "model", 3))
    assert main(["generate", "--config", cfg, "--max-tokens", "3", "--temperature", "0", "--raw", "a b"]) == 0
    err = capsys.readouterr().err
    assert "[specdist] running in process" in err
    assert "[specdist] loading target target (" in err and " kB safetensors, float32) ..." in err
    assert "[specdist] loaded target target in " in err
    assert "[specdist] loading draft draft (" in err and "[specdist] loaded draft draft in " in err
    assert "[specdist] ready in " in err
    # outside the command line the library is quiet again
    loader.log.info("not for stderr")
    assert "not for stderr" not in capsys.readouterr().err


def test_load_model_progress_callback(tiny_models):
    lines: list[str] = []
    src = loader.resolve_model(tiny_models["draft"], "draft.model")
    loader.load_model(src, "float32", progress=lines.append)
    assert len(lines) == 2
    assert lines[0].startswith("loading draft draft (") and lines[0].endswith(" safetensors, float32) ...")
    assert lines[1].startswith("loaded draft draft in ") and lines[1].endswith(" s")
    assert src == loader.ModelSource(src.directory, None)  # the labels are not part of its identity


def test_format_bytes():
    assert [loader.format_bytes(n) for n in (999, 1500, 105_000_000, 2_500_000_000)] == [
        "999 B",
        "1.5 kB",
        "105 MB",
        "2.5 GB",
    ]


# ------------------------------------------------------ 6. remote generate status


class _FakeClient:
    chunks: list = []
    error: Exception | None = None

    def __init__(self, target, timeout=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def generate(self, prompt, **kwargs):
        yield from self.chunks
        if self.error is not None:
            raise self.error


def _chunks(reason):
    stats = specdist.client.RequestStats(
        prompt_tokens=3, output_tokens=2, drafted=4, accepted=1, steps=2, time_to_first_token_s=0.01, total_time_s=0.1
    )
    return [
        specdist.client.GenerateChunk("r", [5], "hel"),
        specdist.client.GenerateChunk("r", [6], "lo", finish_reason=reason, stats=stats),
    ]


@pytest.mark.parametrize(
    "reason,message",
    [
        ("abort", "the request was aborted by the server (finish_reason=abort)"),
        ("error", "the request failed on the server (finish_reason=error)"),
        (None, "the request ended without a finish reason (finish_reason=none)"),
    ],
)
def test_remote_generate_unfinished_request_exits_1(reason, message, monkeypatch, capsys):
    monkeypatch.setattr(_FakeClient, "chunks", _chunks(reason))
    monkeypatch.setattr(specdist.client, "SpecDistClient", _FakeClient)
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--server", "127.0.0.1:1", "hi"])
    assert ei.value.code == 1
    assert _one_line_error(capsys) == f"specdist: error: {message}"


def test_remote_generate_internal_error_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(_FakeClient, "chunks", _chunks(None)[:1])
    monkeypatch.setattr(_FakeClient, "error", specdist.client.RemoteError(grpc.StatusCode.INTERNAL, "request failed"))
    monkeypatch.setattr(specdist.client, "SpecDistClient", _FakeClient)
    with pytest.raises(SystemExit) as ei:
        main(["generate", "--server", "127.0.0.1:1", "hi"])
    assert ei.value.code == 1
    assert (
        _one_line_error(capsys)
        == "specdist: error: the request failed on the server (finish_reason=error): request failed"
    )


def test_remote_generate_finished_request_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(_FakeClient, "chunks", _chunks("length"))
    monkeypatch.setattr(specdist.client, "SpecDistClient", _FakeClient)
    assert main(["generate", "--server", "127.0.0.1:1", "hi"]) == 0
    out, err = capsys.readouterr()
    assert out == "hello\n" and "finish=length" in err


def test_backend_close_reports_the_stopped_deployment(capsys):
    dep = _FakeDeployment(3, 1)
    serving.Backend(SimpleNamespace(close=lambda: None), deployment=dep).close_and_report()
    err = capsys.readouterr().err
    assert dep.stopped
    assert "[specdist] stopping the deployment" in err
    assert "deployment stopped in " in err and "(4 actors, placement groups removed)" in err


# ------------------------------------------------------------------- 6/7. help


def _help(argv, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no wrapping inside a default
    with pytest.raises(SystemExit) as ei:
        main([*argv, "--help"])
    assert ei.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["generate"], ["serve"], ["demo"], ["cost-model"], ["bench", "engine"], ["bench", "cluster"], ["bench", "soak"]],
)
def test_help_shows_every_default(argv, capsys, monkeypatch):
    from specdist.cli import _shows_default, build_parser

    text = _help(argv, capsys, monkeypatch)
    parser = build_parser()
    for name in argv:
        parser = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
    for action in parser._actions:
        if action.option_strings and _shows_default(action):
            assert f"default: {action.default}" in text or "default" in action.help, action.option_strings
    if argv == ["generate"]:
        assert "most tokens to generate (default: 128)" in text
        assert "0 = greedy (default: 0.8)" in text


def test_generate_help_describes_the_config_default(capsys, monkeypatch):
    """The --config help is built from the config defaults, so it follows them."""
    text = _help(["generate"], capsys, monkeypatch)
    d = Config().draft
    assert f"the built-in {Config().target.model}" in text
    if d.enabled:
        assert f"{d.method} draft, {d.length_policy} draft length" in text
    else:
        assert "no draft" in text
