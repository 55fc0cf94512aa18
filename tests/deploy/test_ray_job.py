"""`python -m cluster.job` submitted as a real Ray job to a `ray start --head` cluster.

Ray 2.60 turns token authentication on by default (``ray start`` writes ~/.ray/auth_token);
the ``ray job`` commands then need ``RAY_AUTH_MODE=token`` in their environment. The cluster
is ``ray start --head --block``: SIGTERM to that process stops what it started, and nothing else
(``ray stop`` would also stop every other Ray cluster on the machine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid

# The jobs CLI/SDK and the dashboard that serves it come with ray[default] (the `distributed` extra).
import aiohttp  # noqa: F401,E402
import pytest
import ray.dashboard.modules.job.sdk  # noqa: F401,E402
import yaml
from support.helpers import tiny_config

from cluster.local import SINGLE_MACHINE_ENV

pytestmark = pytest.mark.ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = "http://127.0.0.1:8265"


def _ray_cli() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    return here if os.path.exists(here) else "ray"


def _free_port() -> int:
    """A free localhost port: the job agent's (its fixed default may be taken by another cluster here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # SINGLE_MACHINE_ENV: the cluster listens on loopback only (cluster/local.py says why)
    return {**os.environ, **SINGLE_MACHINE_ENV, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}


def _ray(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([_ray_cli(), *args], env=_env(), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"ray {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


@pytest.fixture
def ray_head():
    import ray

    if ray.is_initialized():  # an in-process cluster from another module would be in the way
        ray.shutdown()
    proc = subprocess.Popen(
        # one CPU: the deployment's 0.5 + 0.5. Ray prestarts an idle worker per CPU, which the job's actors (with
        # its working_dir) cannot reuse: more CPUs only start processes that compete with the bring-up
        [
            _ray_cli(),
            "start",
            "--head",
            "--block",
            "--num-cpus",
            "1",
            "--disable-usage-stats",
            "--dashboard-agent-listen-port",
            str(_free_port()),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        for line in proc.stdout:  # until the cluster is up (the same line plain `ray start` ends with)
            lines.append(line)
            if "Ray runtime started" in line:
                break
        else:
            raise AssertionError(f"ray start --head exited ({proc.wait()}):\n{''.join(lines)}")
        # the rest of its output is drained, so the blocked process never waits on a full pipe
        drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        drain.start()
        yield DASHBOARD
    finally:
        proc.send_signal(signal.SIGTERM)  # --block: stops the cluster's processes, then exits
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"ray start --block did not stop on SIGTERM:\n{''.join(lines)[-3000:]}")
        finally:
            # `ray start` records its cluster here and only `ray stop` removes the record; a later
            # ray.init() would otherwise try to join this stopped cluster instead of starting one
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster"))


def test_ray_job_brings_up_serves_and_tears_down(ray_head, tiny_models, tmp_path):
    cfg = tiny_config(tiny_models, method="model", k=3)  # checkpoint paths are absolute
    assert os.path.isabs(cfg["target"]["model"]) and os.path.isabs(cfg["draft"]["model"])
    # one target rank: tensor parallelism on Ray is test_worker_faults' and test_multinode's
    cfg["cluster"] = {
        "enabled": True,
        "tensor_parallel_size": 1,
        "num_draft_workers": 1,
        "cpus_per_rank": 0.5,
        "cpus_per_draft": 0.5,
        "bringup_timeout_s": 180,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sid = f"specdist-test-{uuid.uuid4().hex[:8]}"
    # without --no-wait the CLI follows the job to its end, printing the job's logs and then its final
    # status (one client process, instead of `ray job status` / `logs` processes competing with the job's
    # actors for the CPUs); its exit status is not the job's
    out = _ray(
        "job",
        "submit",
        "--address",
        ray_head,
        "--submission-id",
        sid,
        "--working-dir",
        REPO,
        "--",
        "python",
        "-m",
        "cluster.job",
        "--config",
        str(path),
        "--requests",
        "4",
        "--prompt",
        "a b c",
        "--max-tokens",
        "6",
        timeout=420,
        check=False,
    )
    logs = out.stdout
    assert f"Job '{sid}' succeeded" in logs, f"--- ray job submit ---\n{logs}\n{out.stderr}"
    assert "[specdist-job] done: requests=4 tensor_parallel_size=1 draft_replicas=1" in logs, logs
    assert "acceptance=" in logs and "tokens/s=" in logs, logs
    assert "tearing down the deployment" in logs, logs
