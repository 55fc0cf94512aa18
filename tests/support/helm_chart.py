"""The Helm chart (helm/specdist) rendered offline, and the checks both its forms run: what tests/deploy/
test_helm_chart.py (the RayCluster form) and test_helm_rayservice.py (the RayService form, ``replicas`` set) share.

- Rendering: :func:`render` (Helm v4 as a library: helm-python-sdk; no cluster, no network), :func:`render_error`,
  :func:`lint`, and the objects of a rendering (:func:`one`, :func:`config_map`, :func:`all_pod_templates`).
- Schemas: :func:`core_errors` (kubernetes-validate, a pinned Kubernetes version), :func:`crd_errors` (the
  ``openAPIV3Schema`` of the CRDs vendored in ``tests/data/crds``, closed the way the API server prunes).
- The pods' security settings (:func:`pod_security_problems`) and the NetworkPolicies
  (:func:`network_policy_problems`).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specdist"
CRDS = REPO / "tests" / "data" / "crds"  # README.md there: where each comes from
K8S_VERSION = "1.33.0"  # kubernetes-validate's schemas of this Kubernetes version (chart: kubeVersion >= 1.27)
RELEASE, NAMESPACE = "specdist", "specdist-test"
CRD_FILES = {  # the custom resources the chart renders, and the CRD each validates against
    "RayCluster": "ray.io_rayclusters.yaml",
    "RayService": "ray.io_rayservices.yaml",
    "RayJob": "ray.io_rayjobs.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
}


@lru_cache(maxsize=None)
def chart() -> helm.Chart:
    """The chart, loaded once."""
    return helm.Chart.load(CHART)


def render(values: dict) -> list[dict]:
    """The chart's objects for ``values`` (NOTES.txt left out)."""
    out = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path in sorted(out):
        if path.endswith((".yaml", ".yml")):
            docs += [d for d in yaml.safe_load_all(out[path]) if d]
    return docs


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def config_map(docs: list[dict]) -> dict:
    """The ConfigMap holding the specdist config (the dashboard ConfigMap is another)."""
    return one([d for d in docs if "config.yaml" in d.get("data", {})], "ConfigMap")


def pod_templates(rc: dict) -> dict[str, dict]:
    """{group: pod template} of a RayCluster ("head" for the head group)."""
    out = {"head": rc["spec"]["headGroupSpec"]["template"]}
    for g in rc["spec"].get("workerGroupSpecs", []):
        out[g["groupName"]] = g["template"]
    return out


def all_pod_templates(docs: list[dict]) -> dict[str, dict]:
    """{name: pod template} of every pod the chart makes: the RayCluster's groups and, for each RayJob, its
    submitter ("<RayJob name>/submitter"; None when the RayJob leaves it to KubeRay's default)."""
    out = dict(pod_templates(one(docs, "RayCluster")))
    for job in (d for d in docs if d["kind"] == "RayJob"):
        out[f"{job['metadata']['name']}/submitter"] = job["spec"].get("submitterPodTemplate")
    return out


def container_env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


SERVICE_ACCOUNT_TOKEN = "automountServiceAccountToken"


def on_dirs(path: str, dirs: list[str]) -> bool:
    """Whether ``path`` is one of ``dirs`` or lies below one."""
    path = path.rstrip("/")
    return any(path == d or path.startswith(d + "/") for d in dirs)


def writable_dirs(pod_spec: dict, container: dict) -> list[str]:
    """Mount paths of the container's writable emptyDirs (the root filesystem is read-only)."""
    vols = {v["name"]: v for v in pod_spec.get("volumes", [])}
    return [
        m["mountPath"].rstrip("/")
        for m in container.get("volumeMounts", [])
        if "emptyDir" in vols.get(m["name"], {}) and not m.get("readOnly")
    ]


def pod_security_problems(docs: list[dict]) -> list[str]:
    """What is wrong with the security settings of the chart's pods: each runs as a fixed non-root uid / gid,
    without privilege escalation, capabilities or a service account token, under the RuntimeDefault seccomp
    profile, on a read-only root filesystem with emptyDirs where it writes (/tmp with Ray's /tmp/ray, the
    caches its environment names); Secret files are neither writable by the group nor readable by others,
    mounted read-only, and readable by the non-root user (group read + fsGroup: the files belong to root)."""
    p = []
    for pod, tpl in all_pod_templates(docs).items():
        if tpl is None:
            p.append(f"{pod} pods: no pod template: KubeRay's default has no security context")
            continue
        spec = tpl.get("spec", {})
        psc = spec.get("securityContext") or {}
        if spec.get(SERVICE_ACCOUNT_TOKEN) is not False:
            p.append(f"{pod} pods: {SERVICE_ACCOUNT_TOKEN} is not false (nothing in them calls the Kubernetes API)")
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            csc = c.get("securityContext") or {}
            what = f"{pod} pods, container {c.get('name')}"

            def eff(key, csc=csc):
                return csc.get(key, psc.get(key))

            if eff("runAsNonRoot") is not True:
                p.append(f"{what}: runAsNonRoot is not true")
            for key in ("runAsUser", "runAsGroup"):
                v = eff(key)
                if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                    p.append(f"{what}: {key} {v!r} is not a fixed non-root id")
            if csc.get("allowPrivilegeEscalation") is not False:
                p.append(f"{what}: allowPrivilegeEscalation is not false")
            if csc.get("privileged"):
                p.append(f"{what}: privileged")
            caps = csc.get("capabilities") or {}
            if "ALL" not in (caps.get("drop") or []) or caps.get("add"):
                p.append(f"{what}: capabilities {caps} (want drop [ALL], nothing added)")
            if csc.get("readOnlyRootFilesystem") is not True:
                p.append(f"{what}: readOnlyRootFilesystem is not true")
            seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
            if seccomp != "RuntimeDefault":
                p.append(f"{what}: seccompProfile {seccomp!r}, not RuntimeDefault")
            env = container_env(c)
            if not env.get("XDG_CACHE_HOME"):
                p.append(f"{what}: XDG_CACHE_HOME unset: caches are written under $HOME on the read-only root")
            writable = writable_dirs(spec, c)
            cache_env = ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
            for path in ["/tmp", "/tmp/ray", *(env[k] for k in cache_env if env.get(k))]:
                if not on_dirs(path, writable):
                    p.append(f"{what}: {path} is not on a writable emptyDir (the root filesystem is read-only)")
        for name, vol in vols.items():
            sec = vol.get("secret")
            if sec is None:
                continue
            default = sec.get("defaultMode", 0o644)  # the API server's default
            for mode in [default, *(i["mode"] for i in sec.get("items", []) if "mode" in i)]:
                if mode & 0o022:
                    p.append(f"{pod} pods: Secret volume {name} has mode {mode:04o}: the group or others may write")
                if mode & 0o004:
                    p.append(f"{pod} pods: Secret volume {name} has mode {mode:04o}: others may read")
            if not (default & 0o040 and psc.get("fsGroup")):
                p.append(
                    f"{pod} pods: Secret volume {name}: the non-root user cannot read it (its files belong to "
                    f"root and fsGroup {psc.get('fsGroup')}; mode {default:04o})"
                )
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                for m in c.get("volumeMounts", []):
                    if m["name"] == name and not m.get("readOnly"):
                        p.append(f"{pod} pods: Secret volume {name} is mounted writable in {c.get('name')}")
    return p


def selects(selector: dict | None, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects an object with ``labels``."""
    selector = selector or {}
    if (selector.get("matchLabels") or {}).items() - labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def same_release(peer: dict) -> bool:
    """A NetworkPolicyPeer admitting only pods of this release: pods of the release namespace (no
    namespaceSelector, no ipBlock) labelled with the release's instance."""
    return (
        set(peer) == {"podSelector"}
        and (peer["podSelector"].get("matchLabels") or {}).get("app.kubernetes.io/instance") == RELEASE
    )


def network_policy_problems(docs: list[dict]) -> list[str]:
    """What is wrong with the NetworkPolicies ([] when none is rendered: networkPolicy.enabled false).

    Every pod of the chart is selected (isolated) and admits every pod of the chart on every port: the worker
    gRPC ports, the ranks' rendezvous and gloo / NCCL connections and Ray's ports are picked at run time.
    Anyone else (a peer that is not a pod of this release, or no ``from`` at all) is admitted only to listed
    ports of the head: its public ports (the Service's) and, with a RayJob, Ray's dashboard port (the KubeRay
    operator asks it for the job's status). Each public port is admitted from beyond the release."""
    pols = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if not pols:
        return []
    p = []
    templates = {k: v for k, v in all_pod_templates(docs).items() if v is not None}
    labels = {k: v.get("metadata", {}).get("labels", {}) for k, v in templates.items()}
    svc_ports = {sp["port"]: sp["name"] for sp in one(docs, "Service")["spec"].get("ports", [])}
    public = set(svc_ports) | ({8265} if any(d["kind"] == "RayJob" for d in docs) else set())
    for pol in pols:
        sel = pol["spec"].get("podSelector") or {}
        if (sel.get("matchLabels") or {}).get("app.kubernetes.io/instance") != RELEASE:
            p.append(f"NetworkPolicy {pol['metadata']['name']}: podSelector {sel} selects pods of other releases too")
    head_ports: set = set()
    for pod, lab in labels.items():
        selecting = [
            pol
            for pol in pols
            if "Ingress" in pol["spec"].get("policyTypes", ["Ingress"]) and selects(pol["spec"].get("podSelector"), lab)
        ]
        if not selecting:
            p.append(f"{pod} pods: no NetworkPolicy selects them: every port is open to the cluster")
            continue
        reached = set()
        for pol in selecting:
            pname = pol["metadata"]["name"]
            for rule in pol["spec"].get("ingress") or []:
                peers = rule.get("from") or []
                ports = rule.get("ports") or []
                if peers and all(same_release(peer) for peer in peers):
                    if not ports:
                        reached |= {
                            k
                            for k, other in labels.items()
                            if any(selects(peer["podSelector"], other) for peer in peers)
                        }
                    continue
                if pod == "head":  # the ports clients beyond the release reach (a rule without ports: all)
                    head_ports |= {pt.get("port") for pt in ports} if ports else set(svc_ports)
                if not ports:
                    p.append(f"NetworkPolicy {pname}: admits every port of the {pod} pods from outside the release")
                    continue
                for pt in ports:
                    num, end = pt.get("port"), pt.get("endPort")
                    if pod != "head" or end is not None or num not in public:
                        p.append(
                            f"NetworkPolicy {pname}: admits port {num}{'-' + str(end) if end else ''} of the "
                            f"{pod} pods from outside the release"
                        )
        missing = sorted(set(labels) - reached)
        if missing:
            p.append(f"{pod} pods: the NetworkPolicies do not admit the {missing} pods of the deployment on every port")
    for num, name in svc_ports.items():
        if num not in head_ports:
            p.append(f"NetworkPolicy: the head's public port {name} ({num}) is admitted by no rule beyond the release")
    return p


def closed_schema(node):
    """A CRD schema as the API server applies it: unknown fields are pruned (closed here, so a
    misspelt field fails instead of silently vanishing); ``nullable`` allows null."""
    if isinstance(node, dict):
        node = {k: closed_schema(v) for k, v in node.items()}
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        if node.pop("nullable", False) and "type" in node:
            node["type"] = [node["type"], "null"]
        return node
    if isinstance(node, list):
        return [closed_schema(v) for v in node]
    return node


@lru_cache(maxsize=None)
def crd_validator(kind: str) -> jsonschema.Draft4Validator:
    assert (CRDS / CRD_FILES[kind]).is_file(), f"the vendored CRD of {kind} is missing from {CRDS}"
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return jsonschema.Draft4Validator(closed_schema(version["schema"]["openAPIV3Schema"]))


def crd_errors(obj: dict) -> list[str]:
    return [
        f"{obj['kind']} {'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in crd_validator(obj["kind"]).iter_errors(obj)
    ]


def core_errors(obj: dict) -> list[str]:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{obj['kind']} {'.'.join(map(str, e.path))}: {e.message}"]
    return []


def pod_template_object(group: str, tpl: dict) -> dict:
    """A RayCluster group's pod template as a core v1 PodTemplate, for kubernetes-validate."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"specdist-{group}"}, "template": tpl}


def render_error(values: dict) -> str:
    """The message of the HelmError rendering ``values`` fails with (an AssertionError when it renders)."""
    try:
        render(values)
    except helm.HelmError as e:
        return str(e)
    raise AssertionError(f"the chart renders {values}")


def lint(values: dict) -> dict:
    """``helm lint --strict`` of the chart with ``values``, at the pinned Kubernetes version: its report."""
    return helm.lint(CHART, copy.deepcopy(values), strict=True, kube_version=f"v{K8S_VERSION}")
