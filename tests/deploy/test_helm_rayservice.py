"""The chart's RayService form (helm/specdist, ``replicas`` set): rendered and validated offline.

- The RayService validates against KubeRay's CRD (``tests/data/crds``, closed as the API server prunes), its pod
  templates and Service against Kubernetes' schemas, and it keeps the KubeRay operator's own RayService rules; no
  RayCluster or Service of the chart's own is rendered beside it (the plain RayCluster form stays for
  ``replicas: null``).
- Its ``serveConfigV2`` is a config Ray Serve accepts (``ServeDeploySchema``); its one application imports
  ``cluster.serve:build_app`` with args build_app takes, and the specdist config in those args reads back through
  ``specdist.config.load_config`` to the ConfigMap's config, with ``cluster.replicas`` as the values set it. Serve's
  replica options come from that config alone (no ``deployments`` overrides), and they are the values'.
- The pods fit what Serve places: a replica pod holds one replica's placement group, the head offers the resource
  the front doors ask for and the ports they listen on; the Service reaches the head only.
- A change of the config changes the cluster spec, so KubeRay upgrades by a new cluster; bad values fail in one
  line naming the value.

Every checker has a negative control.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import math
import re
import shlex

import helm_python as helm
import pytest
import yaml
from support.helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    chart,
    config_map,
    core_errors,
    crd_errors,
    lint,
    network_policy_problems,
    one,
    pod_security_problems,
    pod_template_object,
    render,
    render_error,
)

from specdist import config as specdist_config
from specdist.cores.proposers import check_draft

pytestmark = pytest.mark.helm

COUNT = {"replicas": 2}
AUTOSCALING = {
    "replicas": {"min": 1, "max": 4, "targetOngoingRequests": 6, "upscaleDelaySeconds": 5, "downscaleDelaySeconds": 120}
}
CASES = {
    "count": COUNT,
    "autoscaling": AUTOSCALING,
    "secure": {
        **AUTOSCALING,
        "serve": {
            "http": {"enabled": True, "port": 8443},
            "tls": {"secretName": "specdist-tls", "clientCA": True},
            "auth": {"tokenSecretName": "specdist-token", "adminTokenKey": "admin"},
        },
    },
    "gpu": {
        "replicas": {"min": 2, "max": 3},
        "target": {"tensorParallelSize": 2, "gpusPerPod": 2},
        "draft": {"replicas": 2, "gpusPerReplica": 1},
        "replicaPod": {"resources": {"limits": {"cpu": "8", "memory": "32Gi"}}},
    },
}
FRONT_RESOURCE = "specdist_front"


def rendered(case: str) -> list[dict]:
    return render(CASES[case])


def rayservice(docs: list[dict]) -> dict:
    return one(docs, "RayService")


def serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def app_args(rs: dict) -> dict:
    (app,) = serve_config(rs)["applications"]
    return app["args"]


def groups(rs: dict) -> dict[str, dict]:
    """{group: group spec} of the RayService's cluster ("head" for the head group)."""
    spec = rs["spec"]["rayClusterConfig"]
    return {"head": spec["headGroupSpec"]} | {g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}


def head_container(rs: dict) -> dict:
    return groups(rs)["head"]["template"]["spec"]["containers"][0]


def as_raycluster(docs: list[dict]) -> list[dict]:
    """The rendering with the RayService replaced by what KubeRay makes of it: a RayCluster of its rayClusterConfig
    and the Service of its serveService (selector: the cluster's pods labelled ray.io/serve), so that the RayCluster
    form's checkers (pods' security, NetworkPolicies) run on it."""
    rs = rayservice(docs)
    svc = copy.deepcopy(rs["spec"]["serveService"])
    svc = {"apiVersion": "v1", "kind": "Service", **svc}
    svc["spec"]["selector"] = {"ray.io/cluster": RELEASE, "ray.io/serve": "true"}
    rc = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": RELEASE},
        "spec": copy.deepcopy(rs["spec"]["rayClusterConfig"]),
    }
    return [d for d in docs if d["kind"] != "RayService"] + [rc, svc]


def operator_rule_problems(rs: dict) -> list[str]:
    """The KubeRay operator's own checks of a RayService (ray-operator/controllers/ray/utils/validation.go,
    ValidateRayServiceSpec) and what it needs of the pods to deploy and route (common/pod.go, common/service.go)."""
    p = []
    spec = rs["spec"]
    if (spec.get("upgradeStrategy") or {}).get("type") != "NewCluster":
        p.append("upgradeStrategy.type is not NewCluster (zero-downtime upgrades)")
    cluster = spec["rayClusterConfig"]
    if "upgradeStrategy" in cluster:
        p.append("rayClusterConfig.upgradeStrategy: KubeRay refuses it in a RayCluster a RayService makes")
    if (cluster["headGroupSpec"].get("headService") or {}).get("metadata", {}).get("name"):
        p.append("headGroupSpec.headService.metadata.name: KubeRay refuses it in a RayService")
    if not isinstance(spec.get("rayClusterDeletionDelaySeconds"), int) or spec["rayClusterDeletionDelaySeconds"] < 0:
        p.append("rayClusterDeletionDelaySeconds: not an integer >= 0")
    for name, g in groups(rs).items():
        if name == "head":
            continue
        if not g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]:
            p.append(f"worker group {name}: replicas outside [minReplicas, maxReplicas]")
        for c in g["template"]["spec"]["containers"]:
            if "readinessProbe" not in c:  # KubeRay injects a check of a Serve proxy, which runs on the head only
                p.append(f"worker group {name}: no readinessProbe of its own")
    ports = {pt["name"] for pt in head_container(rs).get("ports", [])}
    serving = sorted(n for n in ports if n == "serve" or n.startswith("serve-"))
    if serving:  # KubeRay would replace the serveService's ports by these
        p.append(f"head container ports {serving}: KubeRay puts them in the Service instead of serveService's")
    svc = spec.get("serveService") or {}
    if svc.get("spec", {}).get("selector"):
        p.append("serveService.spec.selector: KubeRay replaces it")
    for sp in svc.get("spec", {}).get("ports", []):
        if sp.get("targetPort") not in ports:
            p.append(
                f"serveService port {sp.get('name')}: targetPort {sp.get('targetPort')!r} is no named port of the "
                "head (the replica pods are labelled for the Service too: a named port only the head has keeps "
                "them out of its endpoints)"
            )
    for name, g in groups(rs).items():
        if name != "head" and ports & {
            pt["name"] for c in g["template"]["spec"]["containers"] for pt in c.get("ports", [])
        }:
            p.append(f"worker group {name} declares a public port name: the Service would reach its pods")
    return p


# ================================================================ forms


def test_replicas_switch_between_the_raycluster_and_the_rayservice_form():
    plain = {d["kind"] for d in render({})}
    assert {"RayCluster", "Service"} <= plain and "RayService" not in plain
    assert {d["kind"] for d in render({"replicas": None})} == plain
    for case in CASES:
        kinds = [d["kind"] for d in rendered(case)]
        assert kinds.count("RayService") == 1, case
        assert "RayCluster" not in kinds and "Service" not in kinds, case  # KubeRay makes both from the RayService


@pytest.mark.parametrize("case", CASES)
def test_rayservice_validates_against_kuberays_crd(case):
    docs = rendered(case)
    assert crd_errors(rayservice(docs)) == []
    assert operator_rule_problems(rayservice(docs)) == []


def test_crd_and_operator_checks_catch_bad_objects():
    rs = rayservice(rendered("autoscaling"))
    bad = copy.deepcopy(rs)
    bad["spec"]["upgradeStrategy"]["typ"] = "NewCluster"  # misspelt: the API server would drop it
    assert any("typ" in e for e in crd_errors(bad))
    bad = copy.deepcopy(rs)
    bad["spec"]["serveConfigV2"] = serve_config(rs)  # must be a string
    assert crd_errors(bad)
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 3  # a string
    assert crd_errors(bad)
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["upgradeStrategy"] = {"type": "Recreate"}
    assert any("rayClusterConfig.upgradeStrategy" in e for e in operator_rule_problems(bad))
    bad = copy.deepcopy(rs)
    bad["spec"]["upgradeStrategy"]["type"] = "None"
    assert operator_rule_problems(bad)
    bad = copy.deepcopy(rs)
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert any("readinessProbe" in e for e in operator_rule_problems(bad))
    bad = copy.deepcopy(rs)
    head_container(bad)["ports"][3]["name"] = "serve-grpc"
    assert any("serve-grpc" in e for e in operator_rule_problems(bad))
    bad = copy.deepcopy(rs)
    bad["spec"]["serveService"]["spec"]["ports"][0]["targetPort"] = 50051  # a number: every labelled pod
    assert any("targetPort" in e for e in operator_rule_problems(bad))


@pytest.mark.parametrize("case", CASES)
def test_pods_and_service_validate_against_kubernetes(case):
    docs = rendered(case)
    rs = rayservice(docs)
    errors = []
    for name, g in groups(rs).items():
        errors += core_errors(pod_template_object(name, g["template"]))
    svc = {"apiVersion": "v1", "kind": "Service", **rs["spec"]["serveService"]}
    errors += core_errors(svc)
    for d in docs:
        if d["kind"] not in ("RayService",):
            errors += core_errors(d)
    assert errors == []
    bad = copy.deepcopy(svc)
    bad["spec"]["ports"][0]["port"] = "fifty"
    assert core_errors(bad)


@pytest.mark.parametrize("case", CASES)
def test_pods_are_locked_down_like_the_raycluster_forms(case):
    view = as_raycluster(rendered(case))
    assert pod_security_problems(view) == []
    bad = copy.deepcopy(view)
    one(bad, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["securityContext"]["runAsUser"] = 0
    assert pod_security_problems(bad)


@pytest.mark.parametrize("case", CASES)
def test_network_policies_admit_the_operator_to_the_dashboard_and_the_serve_proxy(case):
    """KubeRay submits the Serve config to the head's dashboard (8265) and checks Serve's proxy there (8000): the
    public policy admits the operator to those two ports and nobody else beyond the release; the rest is the
    RayCluster form's rule (every pod isolated, the deployment's pods admitted, the public ports open)."""
    docs = rendered(case)
    values = chart().values | {}
    public = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-public"))
    operator = [r for r in public["spec"]["ingress"] if {pt["port"] for pt in r.get("ports", [])} & {8265, 8000}]
    assert len(operator) == 1
    assert {pt["port"] for pt in operator[0]["ports"]} == {8265, 8000}
    assert operator[0]["from"] == [values["networkPolicy"]["kuberayOperator"]]
    public["spec"]["ingress"].remove(operator[0])
    assert network_policy_problems(as_raycluster(docs)) == []
    public["spec"]["ingress"].append({"ports": [{"port": 8265, "protocol": "TCP"}]})  # from anyone
    assert network_policy_problems(as_raycluster(docs))


# ================================================================ the Serve config


@pytest.mark.parametrize("case", CASES)
def test_serve_config_is_one_build_app_application_ray_serve_accepts(case):
    from ray.serve.schema import ServeDeploySchema

    sc = serve_config(rayservice(rendered(case)))
    parsed = ServeDeploySchema.model_validate(sc)
    (app,) = parsed.applications
    assert app.import_path == "cluster.serve:build_app"
    assert app.route_prefix is None  # clients use the front's own ports, not Serve's HTTP proxy
    assert parsed.proxy_location.value == "HeadOnly" and parsed.http_options.port == 8000
    # Serve's replica options are build_app's, from the config: nothing here overrides them
    assert "deployments" not in sc["applications"][0]
    bad = copy.deepcopy(sc)
    bad["applications"][0]["import_path"] = None
    with pytest.raises(ValueError, match="import_path"):
        ServeDeploySchema.model_validate(bad)


def test_import_path_resolves_to_build_app_and_the_args_are_its_own():
    serve_mod = importlib.import_module("cluster.serve")
    build_app = getattr(serve_mod, "build_app")
    assert callable(build_app)
    front = set(inspect.signature(serve_mod.SpecdistFront.__init__).parameters) - {"self", "config", "replicas"}
    # build_app passes every arg but these to SpecdistFront: the two sets cannot drift apart
    assert serve_mod.BUILD_APP_ARGS == front | {"config", "worker_host", "front_resource"}
    for case in CASES:
        args = app_args(rayservice(rendered(case)))
        assert set(args) <= serve_mod.BUILD_APP_ARGS, (case, set(args) - serve_mod.BUILD_APP_ARGS)
        for key in ("grpc_port", "max_queued", "drain_seconds") + (("http_port",) if "http_port" in args else ()):
            assert isinstance(args[key], int), (case, key)
    assert (
        set(app_args(rayservice(rendered("secure")))) == serve_mod.BUILD_APP_ARGS
    )  # every arg is rendered by some case
    with pytest.raises(serve_mod.ReplicasError, match="unknown args.*'num_replicas'"):
        build_app({**app_args(rayservice(rendered("count"))), "num_replicas": 3})  # checked before anything starts


def _load(data) -> specdist_config.Config:
    cfg = specdist_config.load_config(copy.deepcopy(data))
    check_draft(cfg.draft)
    return cfg


@pytest.mark.parametrize("case", CASES)
def test_serve_config_reads_back_into_specdists_config(case):
    """args.config is specdist's config: the ConfigMap's, with cluster.replicas as the values set it; and the Serve
    options build_app derives from it (cluster/serve.py deployment_options) carry the values' replica settings."""
    from cluster.serve import deployment_options

    docs = rendered(case)
    cfg = _load(app_args(rayservice(docs))["config"])
    assert cfg.to_dict() == _load(yaml.safe_load(config_map(docs)["data"]["config.yaml"])).to_dict()
    r = CASES[case]["replicas"]
    plan = cfg.cluster.replica_plan
    if isinstance(r, int):
        assert (plan.min, plan.max) == (r, r)
    else:
        assert (plan.min, plan.max) == (r["min"], r.get("max", r["min"]))
        for key, field in (
            ("targetOngoingRequests", "target_ongoing_requests"),
            ("upscaleDelaySeconds", "upscale_delay_s"),
            ("downscaleDelaySeconds", "downscale_delay_s"),
        ):
            if key in r:
                assert getattr(plan, field) == r[key], key
    opts = deployment_options(
        cfg, app_args(rayservice(docs))["max_queued"], app_args(rayservice(docs))["drain_seconds"], cfg.cluster.use_gpu
    )
    if plan.autoscaling:
        auto = opts["autoscaling_config"]
        assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (plan.min, plan.min, plan.max)
        assert auto["target_ongoing_requests"] == r.get("targetOngoingRequests", cfg.engine.max_batch_size)
        assert "num_replicas" not in opts
    else:
        assert opts["num_replicas"] == plan.min and "autoscaling_config" not in opts


def test_read_back_catches_a_config_that_differs():
    """Negative control: the comparison above sees one changed key of args.config."""
    docs = rendered("count")
    data = app_args(rayservice(docs))["config"]
    data["cluster"]["replicas"] = 3
    assert _load(data).to_dict() != _load(yaml.safe_load(config_map(docs)["data"]["config.yaml"])).to_dict()
    data["cluster"]["replicas"] = {"min": 3, "max": 2}
    with pytest.raises(specdist_config.ConfigError, match="cluster.replicas.max"):
        _load(data)


# ================================================================ pods, ports, upgrades


@pytest.mark.parametrize("case", CASES)
def test_pods_fit_what_serve_places(case):
    """A replica pod offers one replica's placement group (cluster/placement.py replica_bundles), and not two; the
    head offers the front's resource, which no replica pod has, and no CPU; the head waits for every replica pod."""
    from cluster.placement import replica_bundles

    rs = rayservice(rendered(case))
    cfg = _load(app_args(rs)["config"])
    cc = cfg.cluster
    bundles, strategy = replica_bundles(
        cc.tensor_parallel_size,
        cc.num_draft_workers,
        cc.use_gpu,
        cc.cpus_per_rank,
        cc.cpus_per_draft,
        cc.gpus_per_draft,
    )
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", "GPU")}
    g = groups(rs)
    assert set(g) == {"head", "replica"}
    replica = g["replica"]
    assert replica["replicas"] == replica["minReplicas"] == replica["maxReplicas"] == cc.replica_plan.max
    params = replica["rayStartParams"]
    assert int(params["num-cpus"]) == math.ceil(need["CPU"] - 1e-9) and int(params["num-cpus"]) < 2 * need["CPU"] + 1
    assert int(params["num-gpus"]) == need["GPU"]
    limits = replica["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    assert int(limits.get("nvidia.com/gpu", 0)) == need["GPU"]
    assert "resources" not in params
    head = g["head"]["rayStartParams"]
    assert head["num-cpus"] == "0" and json.loads(json.loads(head["resources"])) == {FRONT_RESOURCE: 1}
    assert app_args(rs)["front_resource"] == FRONT_RESOURCE
    cmd = head_container(rs)["args"][0]
    assert f"--workers {cc.replica_plan.max} " in cmd and "specdist serve" not in cmd


@pytest.mark.parametrize("case", CASES)
def test_front_args_match_the_head_ports_secrets_and_service(case):
    rs = rayservice(rendered(case))
    args = app_args(rs)
    head = head_container(rs)
    ports = {pt["name"]: pt["containerPort"] for pt in head["ports"]}
    values = chart().values
    assert args["grpc_port"] == ports["grpc"]
    assert args.get("http_port") == ports.get("http")
    assert args.get("metrics_port") == ports.get("http-metrics")
    assert 8000 not in (args["grpc_port"], args.get("http_port"), args.get("metrics_port"))  # Serve's proxy
    mounts = {m["mountPath"]: m for m in head.get("volumeMounts", [])}
    for key in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file", "admin_token_file"):
        if key in args:
            assert any(args[key].startswith(p + "/") and m.get("readOnly") for p, m in mounts.items()), key
    svc_ports = {sp["targetPort"]: sp["port"] for sp in rs["spec"]["serveService"]["spec"]["ports"]}
    assert svc_ports == {n: p for n, p in ports.items() if n in ("grpc", "http", "http-metrics")}
    assert rs["spec"]["serveService"]["metadata"]["name"] == RELEASE
    assert rs["spec"]["rayClusterDeletionDelaySeconds"] == values["serve"]["drainSeconds"]


def test_a_config_change_upgrades_by_a_new_cluster():
    """KubeRay brings up a new cluster when rayClusterConfig changes, and redeploys in place when only serveConfigV2
    does (the front's fixed ports would close): every change of the Serve config must change the cluster spec."""
    base = rayservice(render(COUNT))
    for change in ({"engine": {"maxBatchSize": 16}}, {"serve": {"maxQueued": 64}}, {"router": {"policy": "prefix"}}):
        other = rayservice(render(COUNT | change))
        assert other["spec"]["serveConfigV2"] != base["spec"]["serveConfigV2"], change
        assert other["spec"]["rayClusterConfig"] != base["spec"]["rayClusterConfig"], change


def test_lint_strict_passes_in_the_rayservice_form():
    for case in CASES:
        report = lint(CASES[case])
        assert report["errors"] == [], (case, report)


def test_notes_name_the_rayservice():
    out = chart().render(copy.deepcopy(AUTOSCALING), name=RELEASE, namespace=NAMESPACE)["specdist/templates/NOTES.txt"]
    assert f"specdist on RayService {RELEASE}: 1 to 4 Ray Serve replicas" in out
    assert f"get rayservice {RELEASE}" in out


# ================================================================ bad values


BAD_VALUES = {
    # name: (values, what the one-line message must say)
    "min above max": ({"replicas": {"min": 3, "max": 2}}, "replicas.max: must be >= replicas.min (3), got 2"),
    # the values schema's (Helm lists each alternative of the oneOf it tried)
    "no replicas": ({"replicas": 0}, "at '/replicas': minimum: got 0, want 1"),
    "max without min": ({"replicas": {"max": 2}}, "at '/replicas': missing property 'min'"),
    "misspelt autoscaling key": (
        {"replicas": {"min": 1, "max": 2, "targetOngoingRequest": 4}},
        "additional properties 'targetOngoingRequest' not allowed",
    ),
    "misspelt replica pod key": (
        {"replicas": 2, "replicaPod": {"resource": {}}},
        "at '/replicaPod': additional properties 'resource' not allowed",
    ),
    # the templates' (specdist.validateRayService): one line
    "bench job with replicas": ({"replicas": 2, "bench": {"enabled": True}}, "bench.enabled: the bench RayJob runs"),
    "HTTP on Serve's proxy port": (
        {"replicas": 2, "serve": {"http": {"enabled": True}}},
        "serve.http.port: port 8000 is Ray Serve's HTTP proxy",
    ),
    "gRPC on Serve's proxy port": ({"replicas": 2, "serve": {"port": 8000}}, "serve.port: port 8000"),
    "metrics on Serve's proxy port": ({"replicas": 2, "metrics": {"port": 8000}}, "metrics.port: port 8000"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_bad_values_fail_naming_the_value(name):
    values, says = BAD_VALUES[name]
    message = render_error(values)
    assert says in message, message
    if "schema" not in message:  # the templates' own checks: one line
        assert len(message.strip().splitlines()) == 1, message


def test_http_on_port_8000_stays_valid_in_the_raycluster_form():
    """Control for the proxy-port check: it applies to the RayService form only."""
    assert one(render({"serve": {"http": {"enabled": True}}}), "RayCluster")


def test_docs_commands_render_a_valid_rayservice():
    """The helm commands of docs/deployment.md's RayService section render a RayService that validates."""
    text = (CHART.parents[1] / "docs" / "deployment.md").read_text()
    start = text.index("### Replicas on Ray Serve (RayService)")
    section = text[start : text.index("\n## ", start)]
    cmds = [
        shlex.split(c)
        for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
        for c in block.splitlines()
        if c.startswith("helm install")
    ]
    assert len(cmds) == 2
    for argv in cmds:
        values = helm.parse_set_string(argv[argv.index("--set") + 1])
        rs = rayservice(render(values))
        assert crd_errors(rs) == [] and operator_rule_problems(rs) == []
        assert _load(app_args(rs)["config"]).cluster.replica_plan is not None
