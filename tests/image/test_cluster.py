"""Two containers of the image form the chart's Ray cluster and run its bench RayJob (issue 52, must-show 3).

What runs is the chart's own: helm/specdist rendered (Helm's engine as a library, as tests/deploy/test_helm_chart.py
renders it) gives the RayCluster, the bench RayJob and the ConfigMap, and each pod's command line and environment
are made from them the way the KubeRay operator makes them (KubeRay feeaf72f, the commit whose CRDs tests/data/crds
holds: ray-operator/controllers/ray/common/pod.go and job.go): ``ray start`` from a group's ``rayStartParams`` and
the container's resources (:func:`ray_start`), the head's own command (``ray.io/overwrite-container-cmd``) with
that ``ray start`` in $KUBERAY_GEN_RAY_START_CMD, the workers' ``wait-gcs-ready`` init container and generated
command (:func:`pod`), token auth (``authOptions.mode: token``: RAY_AUTH_MODE and RAY_AUTH_TOKEN, the Secret
KubeRay generates), and the K8sJobMode submitter's ``ray job submit --no-wait`` + ``ray job logs --follow``
(:func:`submitter_command`). The values give a cluster of two pods: no draft workers (``draft.method: none``),
so the head waits for one worker, the target pod with its 3 tensor-parallel ranks.

Each pod is a container of the image (tests/image/conftest.py) in a network namespace of its own on a bridge of
private addresses with the host (the host plays the kubelet: it probes the pods); the host does not forward, so
nothing leaves the machine. Kubernetes' DNS is each container's /etc/hosts: the head Service's and the chart's
Service's names are the head's address. gRPC's own resolver (c-ares, what Ray's GCS clients use) asks DNS servers
only and never reads /etc/hosts, so every container here has GRPC_DNS_RESOLVER=native (getaddrinfo, which does):
the one setting that is not Kubernetes', standing in for its DNS server.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

# its own tier besides image (about 7 minutes on top of the image tier's: CI would pass its 30 minutes):
# python -m pytest -q -n 0 -m "image and cluster_image" tests/image/test_cluster.py
pytestmark = [pytest.mark.image, pytest.mark.cluster_image]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specdist"
RELEASE, NAMESPACE = "specdist", "image-test"
BRIDGE, HEAD, WORKER, SUBMITTER = "10.252.53.1", "10.252.53.2", "10.252.53.3", "10.252.53.4"
VALUES = {
    "draft": {"method": "none", "replicas": 0},  # two pods: the head and the target
    "bench": {"enabled": True, "concurrency": "1,2", "requests": 4, "maxTokens": 16, "temperature": 0.8},
}
# The second job: its second level is running when the worker's container is stopped.
LONG_BENCH = {"enabled": True, "run": "2", "concurrency": "1,2", "requests": 2, "maxTokens": 96, "temperature": 0.8}

HOSTS_DNS = {"GRPC_DNS_RESOLVER": "native"}  # the Service names resolve through /etc/hosts (module docstring)

# KubeRay's constants (ray-operator/controllers/ray/utils/constant.go)
GCS_PORT, DASHBOARD_PORT = 6379, 8265
HEAD_GROUP = "headgroup"


def render(values: dict) -> list[dict]:
    import helm_python as helm

    out = helm.Chart.load(CHART).render(values, name=RELEASE, namespace=NAMESPACE)
    return [d for path in sorted(out) if path.endswith(".yaml") for d in yaml.safe_load_all(out[path]) if d]


def one(docs: list[dict], kind: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


# ---------------------------------------------------------------- what the KubeRay operator makes of the spec


def quantity(q: str) -> int:
    """A Kubernetes resource quantity's ``Value()``: the number, rounded up to an integer."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    q = str(q)
    if q.endswith("m"):
        return -(-int(q[:-1]) // 1000)
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * factor)
    return int(float(q))


def ray_start(params: dict, resources: dict, head_fqdn: str | None) -> str:
    """The ``ray start`` line of a group (setMissingRayStartParams, generateRayStartCommand, convertParamMap):
    the head's when ``head_fqdn`` is None, else a worker's joining the head Service."""
    p = dict(params)
    if head_fqdn is None:
        p.setdefault("dashboard-host", "0.0.0.0")
    else:
        p.setdefault("address", f"{head_fqdn}:{GCS_PORT}")
    p.setdefault("metrics-export-port", "8080")
    p["block"] = "true"
    p.setdefault("dashboard-agent-listen-port", "52365")
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    cpu = limits.get("cpu") or requests.get("cpu")
    if "num-cpus" not in p and cpu:
        p["num-cpus"] = str(quantity(cpu))
    if "memory" not in p and limits.get("memory"):
        p["memory"] = str(quantity(limits["memory"]))
    gpus = [v for k, v in sorted(limits.items()) if k.endswith("/gpu") and quantity(v)]
    if "num-gpus" not in p and gpus:
        p["num-gpus"] = str(quantity(gpus[0]))
    flags = ""
    for k in sorted(p):
        v = p[k]
        if v.lower() in ("true", "false") and k not in ("log-color", "include-dashboard", "include-log-monitor"):
            flags += f" --{k} " if v.lower() == "true" else ""
        else:
            flags += f" --{k}={v} "
    return ("ray start --head " if head_fqdn is None else "ray start ") + flags


def pod(cluster: dict, group: dict | None, token: str, pod_name: str) -> tuple[dict, list[str], dict, str]:
    """The Ray container of the head (``group`` None) or of a worker group's pod, as KubeRay builds it (BuildPod,
    setContainerEnvVars, configureTokenAuth): (the container spec, its command line, its environment, the
    ``wait-gcs-ready`` init container's script or "" for the head)."""
    spec = cluster["spec"]
    name, head = cluster["metadata"]["name"], spec["headGroupSpec"]
    fqdn = f"{name}-head-svc.{NAMESPACE}.svc.cluster.local"
    g = head if group is None else group
    template = g["template"]
    (c,) = [x for x in template["spec"]["containers"] if x["name"].startswith("ray-")]
    start = ray_start(g["rayStartParams"], c.get("resources", {}), None if group is None else fqdn)
    given = " ".join(f" {x} " for x in c.get("command", [])) + " ".join(f" {x} " for x in c.get("args", []))
    overwrite = template["metadata"].get("annotations", {}).get("ray.io/overwrite-container-cmd", "") == "true"
    if overwrite or "ray start" in given:
        argv = c.get("command", []) + c.get("args", [])
    else:
        generated = f"ulimit -n ${{RAY_START_ULIMIT_OPEN_FILES:-65536}}; {start}"
        argv = ["/bin/bash", "-c", "--", f"{given} && {generated}" if given else generated]
    auth = (
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        if spec.get("authOptions", {}).get("mode") == "token"
        else {}
    )
    own = {e["name"]: e["value"] for e in c.get("env", [])}
    env = (
        own
        | {
            "RAY_CLUSTER_NAME": name,
            "RAY_CLUSTER_NAMESPACE": NAMESPACE,
            "RAY_CLOUD_INSTANCE_ID": pod_name,
            "RAY_NODE_TYPE_NAME": HEAD_GROUP if group is None else group["groupName"],
            "KUBERAY_GEN_RAY_START_CMD": start,
            "RAY_PORT": str(GCS_PORT),
            "RAY_ADDRESS": f"{'127.0.0.1' if group is None else fqdn}:{GCS_PORT}",
            "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
            "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
        }
        | ({"FQ_RAY_IP": fqdn, "RAY_IP": fqdn.split(".")[0]} if group is not None else {})
        | auth
    )
    init = (
        ""
        if group is None
        else (
            "SECONDS=0\nwhile true; do\n"
            "  if (( SECONDS <= 120 )); then\n"
            f"    if ray health-check --address {fqdn}:{GCS_PORT} > /dev/null 2>&1; then\n"
            '      echo "GCS is ready."\n      break\n    fi\n'
            '    echo "$SECONDS seconds elapsed: Waiting for GCS to be ready."\n'
            f"  else\n    if ray health-check --address {fqdn}:{GCS_PORT}; then\n"
            '      echo "GCS is ready. Any error messages above can be safely ignored."\n      break\n    fi\n'
            '    echo "$SECONDS seconds elapsed: Still waiting for GCS to be ready."\n  fi\n  sleep 5\ndone'
        )
    )
    return c, argv, env, init


def submitter_command(job: dict, job_id: str, dashboard: str) -> list[str]:
    """The K8sJobMode submitter's command line (BuildJobSubmitCommand, configureSubmitterContainer): wait for the
    dashboard, submit the entrypoint unless this id was submitted, follow its log."""
    health = (
        "python -c \"import urllib.request; r=urllib.request.urlopen('%s', timeout=%d); "
        "exit(0 if b'success' in r.read() else 1)\""
    ) % (f"{dashboard}/api/gcs_healthz", 10)
    cmd = [
        "until",
        health,
        ">/dev/null",
        "2>&1",
        ";",
        "do",
        "echo",
        json.dumps(f"Waiting for Ray Dashboard GCS to become healthy at {dashboard} ..."),
        ";",
        "sleep",
        "2",
        ";",
        "done",
        ";",
        "if",
        "!",
        "ray",
        "job",
        "status",
        "--address",
        dashboard,
        job_id,
        ">/dev/null",
        "2>&1",
        ";",
        "then",
        "ray",
        "job",
        "submit",
        "--address",
        dashboard,
        "--no-wait",
        "--submission-id",
        job_id,
        "--",
        job["spec"]["entrypoint"].strip(),
        ";",
        "fi",
        ";",
        "ray",
        "job",
        "logs",
        "--address",
        dashboard,
        "--follow",
        job_id,
    ]
    return ["/bin/bash", "-ce", "--", " ".join(cmd)]


# ---------------------------------------------------------------- the pods on this machine


def volumes(pod_spec: dict, container: dict, where: Path, files: dict[str, dict]) -> tuple[str, ...]:
    """The container's volumeMounts as bind mounts: a ConfigMap's files written out, an emptyDir a fresh directory
    the pods' user owns (securityContext runAsUser / fsGroup)."""
    out, by_name = [], {v["name"]: v for v in pod_spec["volumes"]}
    sc = pod_spec["securityContext"]
    for m in container.get("volumeMounts", []):
        vol, path = by_name[m["name"]], where / m["name"]
        path.mkdir(parents=True)
        if "configMap" in vol:
            for name, text in files[vol["configMap"]["name"]].items():
                (path / name).write_text(text)
        else:
            assert "emptyDir" in vol, f"the test mounts ConfigMaps and emptyDirs only, not {vol}"
            os.chown(path, sc["runAsUser"], sc["fsGroup"])
        out.append(f"{path}:{m['mountPath']}" + (":ro" if m.get("readOnly") else ""))
    return tuple(out)


def read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    """``proc``'s output until a line matches ``pattern`` (or it ends, or ``timeout`` passes): all read so far."""
    seen, sel = b"", selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while not re.search(pattern.encode(), seen) and time.monotonic() < deadline:
        if sel.select(timeout=deadline - time.monotonic()):
            chunk = proc.stdout.read1(65536)
            if not chunk:
                break
            seen += chunk
    sel.close()
    return seen.decode(errors="replace")


def test_chart_cluster_runs_the_bench_job_and_fails_it_when_the_worker_dies(
    image, containers, tmp_path, wait_serving, leftovers
):
    docs = render(VALUES)
    cluster, job = one(docs, "RayCluster"), one(docs, "RayJob")
    service = one([d for d in docs if d["kind"] == "Service"], "Service")  # the chart's; KubeRay makes the head's
    (target,) = cluster["spec"]["workerGroupSpecs"]
    files = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    name = cluster["metadata"]["name"]
    head_svc = f"{name}-head-svc.{NAMESPACE}.svc.cluster.local"
    dashboard = f"http://{head_svc}:{DASHBOARD_PORT}"  # the RayJob's status.dashboardURL
    token = secrets.token_hex(16)  # the Secret KubeRay generates for authOptions.mode token

    head_pod, worker_pod = cluster["spec"]["headGroupSpec"]["template"]["spec"], target["template"]["spec"]
    pods = {
        "head": (f"{name}-head-x1", HEAD),
        "worker": (f"{name}-target-worker-x1", WORKER),
        "submitter": (f"{job['metadata']['name']}-x1", SUBMITTER),
    }  # each pod's name and address
    head_c, head_argv, head_env, _ = pod(cluster, None, token, pods["head"][0])
    worker_c, worker_argv, worker_env, gcs_wait = pod(cluster, target, token, pods["worker"][0])
    assert head_argv[:3] == ["/bin/bash", "-c", "--"] and '"$KUBERAY_GEN_RAY_START_CMD" &' in head_argv[3]
    assert worker_argv[3].startswith("ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start  --address=")

    bridge = containers.bridge(f"{BRIDGE}/24")

    def container(role: str, env: dict, pod_spec: dict, c: dict):
        """A pod's container: its name as host name, its network namespace on the bridge, its /etc/hosts as the
        kubelet writes it (localhost, the pod's name) with Kubernetes' DNS names of the head Service (the GCS, the
        dashboard) and the chart's Service."""
        pod_name, address = pods[role]
        ns = containers.netns()
        ns.veth(f"{address}/24", bridge=bridge, gateway=BRIDGE)  # Ray finds its node's address by the route out
        hosts = tmp_path / f"{role}.hosts"
        hosts.write_text(
            f"127.0.0.1 localhost\n{address} {pod_name}\n{HEAD} {head_svc} "
            f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local\n"
        )
        return containers.container(
            image,
            ns,
            hosts=str(hosts),
            hostname=pod_name,
            env=env | HOSTS_DNS,
            volumes=volumes(pod_spec, c, tmp_path / role, files),
        )

    head = container("head", head_env, head_pod, head_c)
    worker = container("worker", worker_env, worker_pod, worker_c)
    logs = {n: tmp_path / f"{n}.log" for n in ("head", "worker")}
    head.start("exec " + shlex.join(head_argv), logs["head"])

    def tails() -> str:
        return "".join(f"\n--- {n}\n{p.read_text()[-4000:]}" for n, p in logs.items() if p.exists())

    init = worker.run(gcs_wait, timeout=300, check=False)  # the wait-gcs-ready init container
    assert init.returncode == 0 and "GCS is ready." in init.stdout, (
        f"{init.stdout[-2000:]}{init.stderr[-2000:]}{tails()}"
    )
    worker.start("exec " + shlex.join(worker_argv), logs["worker"])

    ready = head_c["readinessProbe"]["grpc"]  # the head's readiness probe: gRPC health of the API
    try:
        wait_serving(f"{HEAD}:{ready['port']}", ready["service"], timeout=900)
    except Exception as e:
        pytest.fail(f"the head did not turn ready ({e}):{tails()}")
    assert "1 worker node(s) joined" in logs["head"].read_text(), tails()
    probe = worker_c["readinessProbe"]["httpGet"]  # the worker's readiness probe, as the kubelet sends it
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://{WORKER}:{probe['port']}{probe['path']}", timeout=30
    ) as r:
        assert r.status == 200, r.read()

    # KubeRay's submitter pod: the RayJob's own template, its own network namespace.
    (sub_c,) = job["spec"]["submitterPodTemplate"]["spec"]["containers"]
    sub_env = {e["name"]: e["value"] for e in sub_c["env"]} | {
        "PYTHONUNBUFFERED": "1",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
    }
    submitter = container("submitter", sub_env, job["spec"]["submitterPodTemplate"]["spec"], sub_c)

    def submit(rayjob: dict, job_id: str) -> subprocess.Popen:
        return submitter.popen("exec " + shlex.join(submitter_command(rayjob, job_id, dashboard)))

    def job_status(job_id: str) -> str:
        out = submitter.run(f"ray job status --address {dashboard} {job_id}", timeout=120, check=False)
        return out.stdout + out.stderr

    first_id = f"{job['metadata']['name']}-{secrets.token_hex(3)}"
    t0 = time.monotonic()
    follow = submit(job, first_id)
    out, _ = follow.communicate(timeout=600)
    out = out.decode(errors="replace")
    print(f"bench job: {time.monotonic() - t0:.0f} s\n{out[-2500:]}")
    assert follow.returncode == 0, f"{out[-4000:]}{tails()}"
    status = job_status(first_id)
    assert f"Job '{first_id}' succeeded" in status, f"{status}\n{out[-3000:]}{tails()}"
    server = job["spec"]["entrypoint"].split("--server ")[1].split()[0]
    for level in ("C=1", "C=2"):  # the bench's results table: each level's 4 requests done
        assert re.search(rf"\| {re.escape(server)} \| {level} \| 4 \| [\d.]+ \| [1-9]", out), out[-3000:]

    # The longer job: once its first level is done, the worker's container is stopped (every process in it killed).
    long_job = one(render(VALUES | {"bench": LONG_BENCH}), "RayJob")
    long_id = f"{long_job['metadata']['name']}-{secrets.token_hex(3)}"
    follow = submit(long_job, long_id)
    seen = read_until(follow, r"\[\S+ C=1\] 2 requests in", timeout=600)
    assert re.search(r"\[\S+ C=1\] 2 requests in", seen), f"{seen[-3000:]}{tails()}"
    worker_namespaces = worker.pid_namespaces()
    t_stop = time.monotonic()
    worker.stop()
    assert worker_namespaces  # its processes are checked gone at the end (the kernel reaps them meanwhile)
    rest, _ = follow.communicate(timeout=600)  # the log's --follow ends with the job
    job_log = seen + rest.decode(errors="replace")
    status = job_status(long_id)
    print(f"the job ended {time.monotonic() - t_stop:.0f} s after the worker stopped:\n{job_log[-1500:]}\n{status}")
    assert f"Job '{long_id}' failed" in status, f"{status}\n{job_log[-3000:]}{tails()}"
    error = [ln for ln in job_log.splitlines() if ln.startswith("specdist: error: ")]
    assert error and "UNAVAILABLE" in error[0] and "target" in error[0], job_log[-3000:]
    assert "Traceback" not in job_log, job_log[-5000:]
    assert "C=2 |" not in job_log  # no results table: the level did not finish

    # Nothing is left running: every process of the pods, their namespaces and working containers.
    namespaces = head.pid_namespaces() | submitter.pid_namespaces()
    containers.close()
    assert not leftovers(namespaces | worker_namespaces)
    assert containers.left() == [], containers.left()
