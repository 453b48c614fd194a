"""k8s/overlays/inference-gateway, checked offline: its custom resources (InferencePool,
InferenceObjective, HTTPRoute) validate against the CRDs of the pinned releases in k8s/crds, as the
API server would check them (schema, unknown fields, CEL rules); the pool's endpoints are every
deployment's fronts on the port where they serve the OpenAI API and the /metrics the endpoint picker
reads, under names pagedserve exports; each deployment's executors and fronts dial its own
scheduler only. (checkov, the built-in schemas and the hardening rules: test_k8s_manifests.py.)

Needs kubectl (kustomize) and `make tools` (.venv-tools: jsonschema, cel-python)."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest
import yaml

from testing.k8s_helpers import (
    EXEC_LABELS,
    FRONT_LABELS,
    K8S,
    OTHER_LABELS,
    SCHED_LABELS,
    TOOLS_VENV,
    Doc,
    configmap_data,
    connection_allowed,
    container,
    container_env,
    find,
    mounted,
    pod_spec,
    pod_template,
    policy_allows,
    render,
    service_target,
    workloads,
)

OVERLAY = K8S / "overlays" / "inference-gateway"
DEPLOYMENTS = ("a", "b")
CUSTOM = {("inference.networking.k8s.io/v1", "InferencePool"), ("inference.networking.x-k8s.io/v1alpha2",
          "InferenceObjective"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}
GATEWAY_POD = {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
EPP_LABELS = {"app.kubernetes.io/name": "pagedserve-epp", "app.kubernetes.io/component": "endpoint-picker"}


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(OVERLAY)


def crd_errors(objects: list[Doc]) -> list[list[str]]:
    """Each object's errors against its CRD (testing/k8s_crd_check.py, run by .venv-tools' python)."""
    python = TOOLS_VENV / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} not found: run `make tools`")
    out = subprocess.run([str(python), str(K8S.parent / "testing" / "k8s_crd_check.py"), str(K8S / "crds")],
                         input=json.dumps(objects), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _custom(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if (d["apiVersion"], d["kind"]) in CUSTOM]


def test_custom_resources_validate_against_the_pinned_crds(docs):
    objects = _custom(docs)
    assert {(d["apiVersion"], d["kind"]) for d in objects} == CUSTOM
    assert crd_errors(objects) == [[] for _ in objects]


def test_crd_check_refuses_what_the_api_server_would(docs):
    """The check is not vacuous: an unknown field, a CEL rule broken, a required field missing and a
    bad label each fail it, naming what is wrong."""
    route, pool = copy.deepcopy(find(docs, "HTTPRoute", "pagedserve")), copy.deepcopy(find(docs, "InferencePool",
                                                                                          "pagedserve"))
    route["spec"]["rules"][0]["timeout"] = "1s"  # (timeouts)
    route["spec"]["rules"][0]["matches"][0]["path"]["value"] = "v1/"  # CEL: must start with '/'
    del pool["spec"]["endpointPickerRef"]["port"]  # CEL: a Service needs its port
    pool["spec"]["targetPorts"].append({"number": 8000})  # CEL: unique ports
    pool["metadata"]["labels"]["bad label"] = "x"
    objective = copy.deepcopy(find(docs, "InferenceObjective", "interactive"))
    del objective["spec"]["poolRef"]
    errors = crd_errors([route, pool, objective])
    assert any("'timeout' was unexpected" in e for e in errors[0]), errors[0]
    assert any("start with '/'" in e for e in errors[0]), errors[0]
    assert any("port is required" in e for e in errors[1]) and any("must be unique" in e for e in errors[1])
    assert any("bad label" in e for e in errors[1]), errors[1]
    assert any("'poolRef' is a required property" in e for e in errors[2]), errors[2]


def test_the_crds_are_the_pinned_releases():
    readme = (K8S / "crds" / "README.md").read_text()
    for path in (K8S / "crds").rglob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        version = next(v for k, v in crd["metadata"]["annotations"].items() if k.endswith("/bundle-version"))
        assert path.parent.name.endswith("-" + version), path  # the directory names the release
        assert f"`{path.parent.name}/`" in readme
    image = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())["images"][0]
    assert (K8S / "crds" / f"gateway-api-inference-extension-{image['newTag']}").is_dir()  # picker = CRDs' release


def test_pool_endpoints_are_every_deployments_fronts_on_their_http_port(docs):
    pool = find(docs, "InferencePool", "pagedserve")["spec"]
    selected = [w for w in workloads(docs)
                if pool["selector"]["matchLabels"].items() <= pod_template(w)["metadata"]["labels"].items()]
    assert sorted(w["metadata"]["name"] for w in selected) == [f"pagedserve-front-{x}" for x in DEPLOYMENTS]
    for front in selected:
        ports = {p["name"]: p["containerPort"] for p in container(front)["ports"]}
        assert [p["number"] for p in pool["targetPorts"]] == [ports["http"]]
        args = container(front)["args"]
        assert args[args.index("--http-port") + 1] == str(ports["http"])
    # The endpoint picker: the Service and port the pool names lead to it, and it serves this pool.
    ref = pool["endpointPickerRef"]
    assert (ref["kind"], ref["group"]) == ("Service", "")
    epp, port = service_target(docs, f"tcp://{ref['name']}:{ref['port']['number']}")
    assert port == {p["name"]: p["containerPort"] for p in container(epp)["ports"]}["grpc-ext-proc"]
    args = dict(a.lstrip("-").split("=", 1) for a in container(epp)["args"])
    env = container_env(docs, container(epp))
    assert args["pool-name"] == "pagedserve" and args["pool-group"] == "inference.networking.k8s.io"
    assert re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], args["pool-namespace"]) == "pagedserve"
    for objective in (d for d in docs if d["kind"] == "InferenceObjective"):
        assert objective["spec"]["poolRef"] == {"group": "inference.networking.k8s.io", "name": "pagedserve"}
    assert {d["spec"]["priority"] for d in docs if d["kind"] == "InferenceObjective"} >= {1, -1}  # one sheddable
    (rule,) = find(docs, "HTTPRoute", "pagedserve")["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "pagedserve"}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]  # not /metrics, not /health


def test_endpoint_picker_reads_metrics_pagedserve_serves(docs):
    """Its metrics extractor reads the names the fronts serve on /metrics (test_k8s_manifests.py's
    stand-in fetches them from a front), and only those: no LoRA or cache-config metric."""
    from scheduler_svc.telemetry.metrics import Metrics

    epp = find(docs, "Deployment", "pagedserve-epp")
    c = container(epp)
    config_file = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--config-file="))
    volume, _ = mounted(epp, c, config_file)
    config = yaml.safe_load(configmap_data(docs, volume["configMap"]["name"])[config_file.rsplit("/", 1)[1]])
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]} <= plugins.keys()
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    specs = {k: v for k, v in engine.items() if k.endswith("Spec")}
    exported = {family.name for family in Metrics().registry.collect()}
    assert {v for v in specs.values() if v} == {"vllm:num_requests_waiting", "vllm:num_requests_running",
                                                "vllm:kv_cache_usage_perc"}
    assert {v for v in specs.values() if v} <= exported
    assert {k for k, v in specs.items() if not v} == {"loraSpec", "cacheInfoSpec"}


@pytest.mark.parametrize("x", DEPLOYMENTS)
def test_each_deployment_dials_its_own_scheduler_only(docs, x):
    executor, front = find(docs, "Deployment", f"pagedserve-executor-{x}"), find(docs, "Deployment",
                                                                                 f"pagedserve-front-{x}")
    for workload, variable, port_name in ((executor, "PAGEDSERVE_SCHEDULER", "executors"),
                                          (front, "PAGEDSERVE_CORE", "fronts")):
        target, port = service_target(docs, container_env(docs, container(workload))[variable])
        assert target["metadata"]["name"] == f"pagedserve-scheduler-{x}"
        assert port == {p["name"]: p["containerPort"] for p in container(target)["ports"]}[port_name]
    assert find(docs, "HorizontalPodAutoscaler", f"pagedserve-front-{x}")["spec"]["scaleTargetRef"]["name"] == \
        f"pagedserve-front-{x}"
    for kind in ("PodDisruptionBudget",):
        for w in (executor, front):
            pdb = find(docs, kind, w["metadata"]["name"])["spec"]["selector"]["matchLabels"]
            assert [v["metadata"]["name"] for v in workloads(docs)
                    if pdb.items() <= pod_template(v)["metadata"]["labels"].items()] == [w["metadata"]["name"]]
    # One namespace, one default deny, for every deployment.
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"] == ["pagedserve"]
    assert len([d for d in docs if d["kind"] == "NetworkPolicy" and not d["spec"]["podSelector"]]) == 1
    assert pod_spec(front)["initContainers"] == pod_spec(find(docs, "Deployment", f"pagedserve-scheduler-{x}"))[
        "initContainers"]


def test_network_policies_keep_deployments_apart_and_admit_the_gateway(docs):
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]

    def labels(base: dict[str, str], x: str) -> dict[str, str]:
        return {**base, "pagedserve.io/deployment": x}

    for x, y in (("a", "b"), ("b", "a")):
        assert connection_allowed(policies, labels(FRONT_LABELS, x), labels(SCHED_LABELS, x), 5600)
        assert not connection_allowed(policies, labels(FRONT_LABELS, x), labels(SCHED_LABELS, y), 5600)
        assert connection_allowed(policies, labels(EXEC_LABELS, x), labels(SCHED_LABELS, x), 5556)
        assert not connection_allowed(policies, labels(EXEC_LABELS, x), labels(SCHED_LABELS, y), 5556)
        # The picker scrapes each front's /metrics; the gateway's proxies reach the fronts.
        assert connection_allowed(policies, EPP_LABELS, labels(FRONT_LABELS, x), 8000)
        assert connection_allowed(policies, GATEWAY_POD, labels(FRONT_LABELS, x), 8000)
        assert not connection_allowed(policies, EPP_LABELS, labels(SCHED_LABELS, x), 5600)
    # Only the gateway's proxies (in any namespace) ask the picker.
    assert policy_allows(policies, "Ingress", EPP_LABELS, GATEWAY_POD, 9002, same_namespace=False)
    assert not policy_allows(policies, "Ingress", EPP_LABELS, OTHER_LABELS, 9002, same_namespace=False)
    assert not connection_allowed(policies, OTHER_LABELS, EPP_LABELS, 9002)
    assert policy_allows(policies, "Egress", EPP_LABELS, {"component": "apiserver"}, 443, same_namespace=False)
