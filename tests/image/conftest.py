"""The image tier: the container image helm/specdist runs, built by helm/image/build.sh and run without a Docker engine.

Deselected unless asked for by marker (``python -m pytest -q -n 0 -m image tests/image``; ``OPT_IN`` in
tests/conftest.py): the build takes minutes and needs root, buildah and mmdebstrap (Debian: ``apt-get install -y
buildah mmdebstrap``). The image is built once per run (``image``); ``SPECDIST_TEST_IMAGE=<tag>`` runs the tests
on an image already built instead (while iterating on the tests).

A container here is ``buildah run`` (chroot isolation: no daemon, no OCI runtime) of a working container made from
the image, started inside ``unshare --pid --fork --kill-child --mount-proc`` (its own PID namespace: stopping it
kills every process it started, and nothing can outlive it; its own /proc, so that a process finds itself there, as
psutil in Ray's dashboard does) and inside a network namespace of the test's (``ip netns``): only
loopback (no network), or a veth to the host on private addresses, or a bridge the host and other containers
share. Nothing is routed off this machine (no default route leaves the host: it does not forward).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "helm" / "image" / "build.sh"
BUILDAH = ["buildah", "--storage-driver", "vfs"]
TAG = "localhost/specdist:image-tier"  # what `image` builds


def _missing_tools() -> list[str]:
    return [t for t in ("buildah", "mmdebstrap", "ip", "unshare") if shutil.which(t) is None]


@pytest.fixture(scope="session")
def image(tmp_path_factory) -> str:
    """The image's tag: built here by helm/image/build.sh (once per run) unless SPECDIST_TEST_IMAGE names one."""
    missing = _missing_tools()
    if os.geteuid() != 0 or missing:
        pytest.fail(
            f"the image tier needs root and {', '.join(missing) or 'nothing more'} (apt-get install -y "
            "buildah mmdebstrap iproute2 util-linux)"
        )
    given = os.environ.get("SPECDIST_TEST_IMAGE")
    if given:
        subprocess.run([*BUILDAH, "inspect", "--type", "image", given], check=True, capture_output=True)
        yield given
        return
    log = tmp_path_factory.mktemp("build") / "build.log"
    with open(log, "w") as out:
        done = subprocess.run([str(BUILD), TAG], stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    text = log.read_text()
    assert done.returncode == 0, f"helm/image/build.sh failed ({done.returncode}):\n{text[-6000:]}"
    print(text.splitlines()[-1])  # the build time and the image size (-s shows it)
    yield TAG
    subprocess.run([*BUILDAH, "rmi", TAG], capture_output=True)  # 2-3 GB; the cached base stays


def _sh(*cmd: str, timeout: float = 120) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


class Netns:
    """A network namespace (``ip netns``) with loopback up; ``veth`` links it to the host or to a bridge."""

    def __init__(self):
        self.name = f"sdimg-{uuid.uuid4().hex[:8]}"
        _sh("ip", "netns", "add", self.name)
        _sh("ip", "-n", self.name, "link", "set", "lo", "up")

    def veth(
        self, address: str, host_address: str | None = None, bridge: str | None = None, gateway: str | None = None
    ) -> None:
        """A veth pair, ``address`` (CIDR) inside; the host end takes ``host_address`` (CIDR) or joins ``bridge``.
        ``gateway``: a default route through the host's address (Ray finds its node address by the route out)."""
        host_end, inner = f"h{self.name[6:]}", f"c{self.name[6:]}"
        _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", inner, "netns", self.name)
        _sh("ip", "-n", self.name, "addr", "add", address, "dev", inner)
        _sh("ip", "-n", self.name, "link", "set", inner, "up")
        if bridge is not None:
            _sh("ip", "link", "set", host_end, "master", bridge)
        elif host_address is not None:
            _sh("ip", "addr", "add", host_address, "dev", host_end)
        _sh("ip", "link", "set", host_end, "up")
        if gateway is not None:
            _sh("ip", "-n", self.name, "route", "add", "default", "via", gateway)

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # takes its veth ends along


class Container:
    """A working container of ``image`` (``buildah from``) whose commands run in ``netns`` and a PID namespace of
    their own. ``volumes``: ``host:container[:ro]`` bind mounts (the chart's config map, emptyDirs and model
    volume); ``hosts``: an /etc/hosts for it (names the chart's Services resolve to here); ``hostname``: its host
    name (a pod's is the pod's name; buildah's default is the container's id)."""

    def __init__(
        self,
        image: str,
        netns: Netns,
        volumes: tuple[str, ...] = (),
        env: dict | None = None,
        hosts: str | None = None,
        hostname: str | None = None,
    ):
        self.netns = netns
        self.id = _sh(
            *BUILDAH, "from", "--pull-never", "--name", f"sdimg-{uuid.uuid4().hex[:8]}", image, timeout=600
        ).strip()
        self.volumes = list(volumes) + ([f"{hosts}:/etc/hosts:ro"] if hosts else [])
        self.env = env or {}
        self.hostname = hostname
        self.procs: list[subprocess.Popen] = []

    def argv(self, command: str, user: str | None = None) -> list[str]:
        """``command`` (bash) run in the container: in the network namespace, in a PID namespace that dies with it."""
        run = [*BUILDAH, "run", "--isolation", "chroot", "--no-hosts"]
        for v in self.volumes:
            run += ["--volume", v]
        for k, v in self.env.items():
            run += ["--env", f"{k}={v}"]
        if user is not None:
            run += ["--user", user]
        if self.hostname is not None:
            run += ["--hostname", self.hostname]
        return [
            "ip",
            "netns",
            "exec",
            self.netns.name,
            "unshare",
            "--pid",
            "--fork",
            "--kill-child=SIGKILL",
            "--mount-proc",
            *run,
            self.id,
            "--",
            "bash",
            "-c",
            command,
        ]

    def run(self, command: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(self.argv(command), capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{command!r} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        return out

    def start(self, command: str, log: Path) -> subprocess.Popen:
        """``command`` in the background, its output into ``log``."""
        with open(log, "w") as f:
            proc = subprocess.Popen(self.argv(command), stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def popen(self, command: str) -> subprocess.Popen:
        """``command`` in the background, its output (stdout and stderr) a pipe to read."""
        proc = subprocess.Popen(self.argv(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def pid_namespaces(self) -> set[str]:
        """The PID namespaces of its running commands (``pid:[inode]``): those of the children of each ``unshare``."""
        out = set()
        for p in self.procs:
            with contextlib.suppress(OSError):
                for child in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split():
                    out.add(os.readlink(f"/proc/{child}/ns/pid"))
        return out

    def stop(self) -> None:
        """Kill every process of the container (SIGKILL to its PID namespace's first process: the kernel kills the
        rest), as a node that dies does."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)

    def remove(self) -> None:
        self.stop()
        subprocess.run([*BUILDAH, "rm", self.id], capture_output=True, timeout=600)


@pytest.fixture
def containers():
    """Made containers and namespaces, all stopped and removed after the test: ``containers.netns()``,
    ``containers.container(image, netns, ...)``."""

    class Made:
        def __init__(self):
            self.all: list[Container] = []
            self.namespaces: list[Netns] = []
            self.bridges: list[str] = []

        def netns(self) -> Netns:
            self.namespaces.append(Netns())
            return self.namespaces[-1]

        def container(self, image: str, netns: Netns, **kw) -> Container:
            self.all.append(Container(image, netns, **kw))
            return self.all[-1]

        def bridge(self, address: str) -> str:
            """A bridge on the host with ``address`` (CIDR, private): containers' veths join it."""
            name = f"sdbr{uuid.uuid4().hex[:6]}"
            _sh("ip", "link", "add", name, "type", "bridge")
            self.bridges.append(name)
            _sh("ip", "addr", "add", address, "dev", name)
            _sh("ip", "link", "set", name, "up")
            return name

        def close(self) -> None:
            """Stop and remove every container, namespace and bridge made (again: nothing more to do)."""
            for c in self.all:
                c.remove()
            for n in self.namespaces:
                n.delete()
            for b in self.bridges:
                subprocess.run(["ip", "link", "del", b], capture_output=True)

        def left(self) -> list[str]:
            """What of the made is still there: working containers, network namespaces, bridges."""
            ids = set(_sh(*BUILDAH, "containers", "--all", "--quiet", "--notruncate").split())
            netns = {line.split()[0] for line in _sh("ip", "netns", "list").splitlines() if line.strip()}
            links = _sh("ip", "-o", "link", "show")
            return (
                [f"container {c.id}" for c in self.all if c.id in ids]
                + [f"netns {n.name}" for n in self.namespaces if n.name in netns]
                + [f"bridge {b}" for b in self.bridges if f" {b}:" in links]
            )

    made = Made()
    yield made
    made.close()


def _wait_serving(address: str, service: str = "", timeout: float = 900) -> None:
    """Until gRPC health says ``service`` at ``address`` is SERVING: a Watch stream (it waits for the port to open,
    then for the status to change; no polling). What a readiness probe waits for."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
        )
        for status in stream:
            if status.status == health_pb2.HealthCheckResponse.SERVING:
                stream.cancel()
                return


@pytest.fixture
def wait_serving():
    return _wait_serving


def processes_in(namespaces: set[str]) -> list[str]:
    """The host's processes in any of these PID namespaces (``pid:[inode]``), as "pid command"."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(proc / "ns" / "pid") in namespaces:
                    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found.append(f"{proc.name} {command}")
    return found


@pytest.fixture
def leftovers():
    """``leftovers(namespaces)``: the processes still running in those PID namespaces."""
    return processes_in
