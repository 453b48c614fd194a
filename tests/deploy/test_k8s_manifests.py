"""k8s/ and docker/, checked offline: every overlay renders, validates against the Kubernetes
schemas (strict), passes checkov, and its commands, ports, env names and probe service names
match what the services really parse and serve; and a stand-in for the cluster runs the cpu
overlay's pods (with fronts of their own) as local processes on loopback. The fronts component
and the inference-gateway overlay have their own test modules (test_k8s_fronts.py,
test_k8s_gateway.py); checkov and the schema checks run here over everything.

Needs kubectl (kustomize) and `make tools` (.venv-tools: checkov, kubernetes-validate)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import tomllib  # Python >= 3.11, as on the dev machines and CI
import yaml

from pagedserve import keytool
from testing.k8s_helpers import (
    EXEC,
    EXEC_LABELS,
    FRONT,
    NAMESPACE,
    OTHER_LABELS,
    REPO,
    SCHED,
    SCHED_LABELS,
    Doc,
    all_containers,
    configmap_data,
    connection_allowed,
    container,
    container_env,
    find,
    flag_env_names,
    mounted,
    parse_container,
    pod_spec,
    pod_template,
    policy_allows,
    probe_seconds,
    project_scripts,
    render,
    render_with_components,
    third_party_imports,
    tool,
    workloads,
)
from testing.k8s_standin import StandIn, generate, operator_objects

OVERLAYS = ("gpu", "cpu")
# Overlay + optional components, rendered as a user would add them.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "gpu": ("gpu", []),
    "cpu": ("cpu", []),
    "gpu+keda": ("gpu", ["keda-autoscaling", "servicemonitor"]),
    "gpu+hpa": ("gpu", ["hpa-autoscaling"]),
    "cpu+keda": ("cpu", ["keda-autoscaling"]),
    "gpu-tp": ("gpu-tensor-parallel", []),  # executors of N GPUs in one pod (components/tensor-parallel)
    "gpu-multinode": ("gpu-multinode", []),  # executors of N one-GPU pods (LeaderWorkerSet)
    "gpu+fronts": ("gpu", ["fronts"]),  # fronts as a Deployment of their own, with an HPA
    "cpu+fronts": ("cpu", ["fronts"]),
    "cpu+cores": ("cpu", ["engine-cores"]),  # two engine cores in the scheduler pod (test_k8s_engine_cores.py)
    "gpu+fronts+cores": ("gpu", ["fronts", "engine-cores"]),
    "gpu+lora": ("gpu", ["lora-adapters"]),  # LoRA adapters from a read-only volume
}
# Several deployments (names suffixed -a, -b) behind the inference gateway: checked here by checkov,
# the schemas and the hardening rules, the rest in test_k8s_gateway.py.
GATEWAY = "inference-gateway"
RENDERED = {**VARIANTS, GATEWAY: (GATEWAY, [])}
# Custom resources: kubernetes-validate has schemas for built-in kinds only.
CRD_CHECKED = "validated against the CRDs in k8s/crds by test_k8s_gateway.py"
CUSTOM_RESOURCES = {
    ("keda.sh/v1alpha1", "ScaledObject"): "KEDA CRD; no schema ships with kubernetes-validate",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "Prometheus Operator CRD; no schema ships with kubernetes-validate",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "LeaderWorkerSet CRD; its pod template is checked by "
                                                        "the tests here instead",
    ("inference.networking.k8s.io/v1", "InferencePool"): CRD_CHECKED,
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"): CRD_CHECKED,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): CRD_CHECKED,
}
QUEUE_METRIC = "pagedserve:num_requests_waiting"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[Doc]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {name: render(REPO / "k8s" / "overlays" / overlay) if not comps
            else render_with_components(tmp, overlay, comps)
            for name, (overlay, comps) in RENDERED.items()}


@pytest.fixture(scope="module")
def rendered_dir(rendered, tmp_path_factory) -> Path:
    """Each variant as one multi-document file, plus the Dockerfiles (for checkov)."""
    out = tmp_path_factory.mktemp("rendered")
    for name, docs in rendered.items():
        (out / f"{name}.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
    for dockerfile in (REPO / "docker").glob("Dockerfile.*"):
        (out / dockerfile.name).write_text(dockerfile.read_text())
    return out


@pytest.fixture(scope="module")
def checkov_reports(rendered_dir) -> dict[str, dict[str, Any]]:
    """One checkov run over every variant and both Dockerfiles (checkov is the slow part)."""
    out = subprocess.run([tool("checkov"), "--framework", "kubernetes", "dockerfile", "--skip-download",
                          "-d", str(rendered_dir), "-o", "json"],
                         capture_output=True, text=True, timeout=300, cwd=rendered_dir)
    try:
        reports = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"checkov gave no JSON (rc {out.returncode}):\n{out.stderr[-3000:]}") from None
    reports = reports if isinstance(reports, list) else [reports]
    return {r["check_type"]: r for r in reports}


# ------------------------------------------------------------------ rendering and schemas

def executor_workload(docs: list[Doc]) -> Doc:
    """The executors' Deployment, or the LeaderWorkerSet that replaces it (gpu-multinode)."""
    lws = [d for d in docs if d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"] == EXEC]
    return lws[0] if lws else find(docs, "Deployment", EXEC)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_renders_the_whole_deployment_in_its_namespace(rendered, variant):
    docs = rendered[variant]
    executor_workload(docs)
    for kind, name in [("Namespace", NAMESPACE), ("Deployment", SCHED),
                       ("Service", SCHED), ("Service", "pagedserve-scheduler-executors"),
                       ("PodDisruptionBudget", EXEC), ("NetworkPolicy", "default-deny-ingress"),
                       ("ServiceAccount", SCHED), ("ServiceAccount", EXEC)]:
        find(docs, kind, name)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']}"
    for w in workloads(docs):  # every image is a registry path with a pinned tag
        for c in all_containers(w):
            assert re.fullmatch(r"[\w.-]+(/[\w.-]+)+:[\w.-]+", c["image"]), c["image"]
            assert not c["image"].endswith(":latest")


def test_kubernetes_validate_strict_accepts_every_builtin_object(rendered, tmp_path):
    unique: dict[str, Doc] = {}  # (the variants share most objects: each is validated once)
    for docs in rendered.values():
        builtin = [d for d in docs if (d["apiVersion"], d["kind"]) not in CUSTOM_RESOURCES]
        custom = {(d["apiVersion"], d["kind"]) for d in docs} - {(d["apiVersion"], d["kind"]) for d in builtin}
        assert custom <= CUSTOM_RESOURCES.keys()
        unique.update((json.dumps(d, sort_keys=True), d) for d in builtin)
    path = tmp_path / "builtin.yaml"
    path.write_text(yaml.safe_dump_all(list(unique.values())))
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_kubernetes_validate_strict_rejects_an_unknown_field(rendered, tmp_path):
    """The validator really is strict: a misspelt field in the executor fails it."""
    bad = copy.deepcopy(find(rendered["gpu"], "Deployment", EXEC))
    container(bad)["terminationGracePeriod"] = 60
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "terminationGracePeriod" in out.stdout + out.stderr


def test_custom_resources_target_the_executors(rendered):
    scaled = find(rendered["gpu+keda"], "ScaledObject", EXEC)["spec"]
    assert scaled["scaleTargetRef"]["name"] == EXEC and scaled["minReplicaCount"] >= 1
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and QUEUE_METRIC in trigger["metadata"]["query"]
    monitor = find(rendered["gpu+keda"], "ServiceMonitor", SCHED)["spec"]
    client = find(rendered["gpu+keda"], "Service", SCHED)
    assert monitor["selector"]["matchLabels"].items() <= client["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in client["spec"]["ports"]}


# ------------------------------------------------------------------ checkov

def _annotation_skips(doc: Doc) -> dict[str, str]:
    out = {}
    for key, value in doc["metadata"].get("annotations", {}).items():
        if key.startswith("checkov.io/skip"):
            check, _, reason = value.partition("=")
            out[check] = reason
    return out


def test_checkov_passes_every_variant_with_reasoned_skips_only(checkov_reports, rendered):
    report = checkov_reports["kubernetes"]
    results = report["results"]
    assert report["summary"]["parsing_errors"] == 0 and not results["parsing_errors"]
    failed = [(c["check_id"], c["file_path"], c["resource"]) for c in results["failed_checks"]]
    assert not failed
    scanned = {c["file_path"].lstrip("/") for c in results["passed_checks"]}
    assert scanned == {f"{v}.yaml" for v in RENDERED}
    for c in results["skipped_checks"]:
        variant = c["file_path"].lstrip("/").removesuffix(".yaml")
        kind, _ns, name = c["resource"].split(".", 2)
        skips = _annotation_skips(find(rendered[variant], kind, name))
        assert skips.get(c["check_id"]), f"{c['check_id']} skipped on {c['resource']} without an annotation"
        assert c["check_result"]["suppress_comment"].strip() == skips[c["check_id"]].strip()


def test_checkov_passes_the_dockerfiles_with_reasoned_skips_only(checkov_reports):
    report = checkov_reports["dockerfile"]
    assert not report["results"]["failed_checks"] and report["summary"]["passed"] > 0
    for c in report["results"]["skipped_checks"]:
        text = (REPO / "docker" / c["file_path"].lstrip("/")).read_text()
        assert re.search(rf"# checkov:skip={c['check_id']}: \S", text), c["check_id"]


# ------------------------------------------------------------------ commands, ports, probes

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scheduler_command_parses_and_matches_ports_and_probes(rendered, overlay):
    from pagedserve import wire
    from scheduler_svc.entrypoints import service_flags as flags

    docs = rendered[overlay]
    deploy = find(docs, "Deployment", SCHED)
    c = container(deploy)
    args, env = parse_container(docs, c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "http": args.http_port, "executors": args.executor_port,
                     "metrics": args.metrics_port}
    assert (args.port, args.http_port, args.executor_port, args.metrics_port) == (
        flags.DEFAULT_GRPC_PORT, flags.DEFAULT_HTTP_PORT, flags.DEFAULT_EXECUTOR_PORT, flags.DEFAULT_METRICS_PORT)
    # Reachable from other pods.
    assert args.host == "0.0.0.0" and args.http_host == "0.0.0.0"
    # The executor link is keyed by the scheduler's own key pair, from a Secret only it mounts (see
    # test_each_executor_pod_makes_its_own_key_pair...), so it listens on every interface.
    volume, mount = mounted(deploy, c, env["PAGEDSERVE_CURVE_SECRET_KEY_FILE"])
    assert volume["secret"]["secretName"] == keytool.SCHEDULER_KEY_SECRET and mount["readOnly"]
    assert env["PAGEDSERVE_CURVE_SECRET_KEY_FILE"].endswith("/" + keytool.SCHEDULER_KEY_FILE)
    volume, mount = mounted(deploy, c, env["PAGEDSERVE_ENROLLMENT_TOKEN_FILE"])
    assert volume["secret"]["secretName"] == keytool.TOKEN_SECRET and "subPath" not in mount  # rotations show
    assert args.trusted_executor_keys is None  # executors enroll: no list of keys to keep by hand
    # Revocations: a ConfigMap the operator owns, read whole; optional (none yet), and never rendered
    # here, so `kubectl apply -k` cannot undo one.
    volume, mount = mounted(deploy, c, env["PAGEDSERVE_REVOKED_EXECUTOR_KEYS"])
    assert mount["mountPath"] == env["PAGEDSERVE_REVOKED_EXECUTOR_KEYS"] and volume["configMap"]["optional"] is True
    assert not [d for d in docs if d["metadata"]["name"] == volume["configMap"]["name"]]
    assert args.executor_host in (None, "0.0.0.0")
    # The client Service exposes both APIs (and metrics), each on the container port that serves it.
    client = {p["name"]: p for p in find(docs, "Service", SCHED)["spec"]["ports"]}
    assert {name: ports[p["targetPort"]] for name, p in client.items()} == {
        "grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    for probe, service in [("startupProbe", wire.HEALTH_LIVENESS), ("livenessProbe", wire.HEALTH_LIVENESS),
                           ("readinessProbe", wire.HEALTH_SCHEDULER_READY)]:
        assert c[probe]["grpc"] == {"port": args.port, "service": service}, probe
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    # Every PAGEDSERVE_* variable it gets is one of its flags (a typo would be ignored silently).
    unknown = {k for k in env if k.startswith("PAGEDSERVE_")} - flag_env_names(flags.build_arg_parser)
    assert not unknown
    assert str(args.model).startswith(c["volumeMounts"][0]["mountPath"] + "/")
    # Exactly one scheduler, never two at once (they would split the executors).
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    grace = pod_spec(deploy)["terminationGracePeriodSeconds"]
    pre_stop = probe_seconds(c["lifecycle"]["preStop"]["exec"]["command"])
    assert grace >= pre_stop + args.shutdown_grace_seconds + 5


@pytest.mark.parametrize("overlay", [*OVERLAYS, "gpu-tp"])
def test_executor_command_parses_and_matches_health_scheduler_and_drain(rendered, overlay):
    from executor_svc import config as ec
    from pagedserve import wire

    docs = rendered[overlay]
    deploy = find(docs, "Deployment", EXEC)
    c = container(deploy)
    args, env = parse_container(docs, c)
    assert [p["containerPort"] for p in c["ports"]] == [args.health_port]
    assert args.health_port == ec.build_arg_parser().get_default("health_port")
    for probe, service in [("startupProbe", wire.HEALTH_EXECUTOR_READY), ("livenessProbe", wire.HEALTH_LIVENESS),
                           ("readinessProbe", wire.HEALTH_EXECUTOR_READY)]:
        assert c[probe]["grpc"] == {"port": args.health_port, "service": service}, probe
    unknown = {k for k in env if k.startswith("PAGEDSERVE_")} - flag_env_names(ec.build_arg_parser)
    assert not unknown
    assert args.executor_id == env["PAGEDSERVE_EXECUTOR_ID"]  # the pod name, via the downward API
    # It dials the internal Service, which leads to the scheduler's executor port.
    sched_args, _ = parse_container(docs, container(find(docs, "Deployment", SCHED)))
    m = re.fullmatch(r"tcp://([\w-]+):(\d+)", args.scheduler)
    assert m, args.scheduler
    svc = find(docs, "Service", m.group(1))
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(m.group(2))]
    sched_ports = {p["name"]: p["containerPort"] for p in container(find(docs, "Deployment", SCHED))["ports"]}
    assert sched_ports[port["targetPort"]] == sched_args.executor_port
    # The scheduler turns ready only after an executor registered through this Service.
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == SCHED_LABELS
    # Both services read the same model and block size.
    assert (str(args.model), args.block_size) == (str(sched_args.model), sched_args.block_size)
    # The drain fits the grace period: preStop, then SIGTERM -> drain -> exit.
    grace = pod_spec(deploy)["terminationGracePeriodSeconds"]
    pre_stop = probe_seconds(c["lifecycle"]["preStop"]["exec"]["command"])
    assert grace >= pre_stop + args.drain_timeout + 10
    # Long enough for loading a model before liveness takes over.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_console_scripts_in_the_manifests_exist(rendered):
    scripts = project_scripts()
    for name, docs in rendered.items():
        workloads_here = [executor_workload(docs)] if name != GATEWAY else []
        workloads_here += [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith(
            (SCHED, FRONT))]
        assert workloads_here
        for workload in workloads_here:
            assert container(workload)["command"][0] in scripts
    assert container(find(rendered["gpu+fronts"], "Deployment", FRONT))["command"] == ["pagedserve-front"]


# ------------------------------------------------------------------ per-overlay specifics

def test_gpu_executors_get_one_gpu_shm_and_the_model_read_only(rendered):
    docs = rendered["gpu"]
    deploy = find(docs, "Deployment", EXEC)
    c, spec = container(deploy), pod_spec(deploy)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    model = volumes[mounts["/models"]["name"]]
    assert model["persistentVolumeClaim"] == {"claimName": "pagedserve-models", "readOnly": True}
    assert mounts["/models"]["readOnly"] is True
    find(docs, "PersistentVolumeClaim", "pagedserve-models")
    assert container_env(docs, c)["PAGEDSERVE_DEVICE"] == "cuda"


def test_gpu_model_download_job_fills_what_the_pods_wait_for(rendered):
    docs = rendered["gpu"]
    job = find(docs, "Job", "pagedserve-model-download")
    download = container(job)
    script = download["command"][-1]
    dl_env = container_env(docs, download)
    model_dir = container_env(docs, container(find(docs, "Deployment", EXEC)))["PAGEDSERVE_MODEL"]
    assert dl_env["MODEL_DIR"] == model_dir
    marker = re.search(r'touch "\$MODEL_DIR/([^"]+)"\s*$', script).group(1)
    for name in (SCHED, EXEC):
        (wait,) = [c for c in pod_spec(find(docs, "Deployment", name))["initContainers"] if c["name"] == "wait-for-model"]
        assert f"$PAGEDSERVE_MODEL/{marker}" in wait["command"][-1]
        assert container_env(docs, wait)["PAGEDSERVE_MODEL"] == model_dir
    volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "pagedserve-models"
    assert volumes["hf-token"]["secret"]["optional"] is True


def test_model_download_job_uses_options_the_hf_cli_has():
    """The executor image's `hf` comes from huggingface_hub (a transformers dependency), as here."""
    docs = render(REPO / "k8s" / "overlays" / "gpu")
    script = container(find(docs, "Job", "pagedserve-model-download"))["command"][-1]
    assert re.search(r"(^|;)\s*hf download ", script)
    hf = Path(sys.executable).parent / "hf"
    out = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ.get("PATH", ""), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"})
    assert out.returncode == 0, out.stderr
    for option in set(re.findall(r"\s(--[a-z-]+)", script)):
        assert option in out.stdout, option


def test_cpu_overlay_builds_the_tiny_model_where_the_services_read_it(rendered):
    docs = rendered["cpu"]
    for name in (SCHED, EXEC):
        deploy = find(docs, "Deployment", name)
        (init,) = [c for c in pod_spec(deploy)["initContainers"] if c["name"] == "build-tiny-model"]
        assert init["command"][:3] == ["python", "-m", "executor_svc.tiny_model"]
        out = init["command"][init["command"].index("--out") + 1]
        assert container_env(docs, container(deploy))["PAGEDSERVE_MODEL"] == out
        assert "nvidia.com/gpu" not in str(deploy)
    executor = container(find(docs, "Deployment", EXEC))
    assert container_env(docs, executor)["PAGEDSERVE_DEVICE"] == "cpu"


@pytest.mark.parametrize("variant", ["gpu+keda", "gpu+hpa", "cpu+keda"])
def test_autoscaled_executors_leave_replicas_to_the_autoscaler(rendered, variant):
    docs = rendered[variant]
    assert "replicas" not in find(docs, "Deployment", EXEC)["spec"]
    assert find(docs, "Deployment", SCHED)["spec"]["replicas"] == 1


def test_hpa_metric_is_what_the_adapter_serves_and_the_scheduler_exports(rendered):
    from scheduler_svc.telemetry.metrics import Metrics

    exported = {family.name for family in Metrics().registry.collect()}
    assert QUEUE_METRIC in exported
    hpa = find(rendered["gpu+hpa"], "HorizontalPodAutoscaler", EXEC)["spec"]
    assert hpa["scaleTargetRef"]["name"] == EXEC and hpa["minReplicas"] >= 1
    (metric,) = hpa["metrics"]
    values = yaml.safe_load((REPO / "k8s/components/hpa-autoscaling/prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["external"]
    assert rule["seriesQuery"].startswith(QUEUE_METRIC)
    # prometheus-adapter's `name: {matches, as}` rename, with Go's ${1} syntax.
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${", "\\g<").replace("}", ">"),
                    QUEUE_METRIC)
    assert metric["external"]["metric"]["name"] == served


# ------------------------------------------------------------------ security and policies

@pytest.mark.parametrize("variant", RENDERED)
def test_every_container_is_hardened_with_resources(rendered, variant):
    for w in workloads(rendered[variant]):
        spec = pod_spec(w)
        # No API token, but in a workload that talks to the Kubernetes API, saying so to checkov.
        assert spec["automountServiceAccountToken"] is ("CKV_K8S_38" in _annotation_skips(w))
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in all_containers(w):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] == 10001
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= c["resources"][kind].keys(), (c["name"], kind)
        # Read-only root: /tmp and $HOME (caches) are writable emptyDirs in every main container.
        emptydirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for c in spec["containers"]:
            writable = {m["mountPath"] for m in c["volumeMounts"]
                        if m["name"] in emptydirs and not m.get("readOnly")}
            home = container_env(rendered[variant], c)["HOME"]
            assert "/tmp" in writable and any(home == w or home.startswith(w + "/") for w in writable)


@pytest.mark.parametrize("variant", RENDERED)
def test_every_path_a_container_is_given_lies_in_a_volume_it_mounts(rendered, variant):
    """A file flag names a file the container can read: fronts read the scheduler's own ConfigMaps, so
    those must name no file only the scheduler mounts (its keys are in pagedserve-scheduler-keys)."""
    docs = rendered[variant]
    for w in workloads(docs):
        for c in all_containers(w):
            values = list(container_env(docs, c).values()) + [a.partition("=")[2] or a for a in c.get("args", [])]
            for path in (v for v in values if v.startswith("/")):
                mounted(w, c, path)  # raises, naming the container and the path


def test_lora_adapters_come_from_a_read_only_volume_both_services_mount(rendered):
    """components/lora-adapters: the scheduler and every executor serve LoRA with as many slots, and
    each adapter the scheduler lists lies on a read-only volume both mount."""
    from pagedserve.lora_modules import parse_lora_module, split_lora_modules

    docs = rendered["gpu+lora"]
    sched, execs = find(docs, "Deployment", SCHED), find(docs, "Deployment", EXEC)
    sargs, _ = parse_container(docs, container(sched))
    eargs, _ = parse_container(docs, container(execs))
    assert sargs.enable_lora and eargs.enable_lora and sargs.max_loras == eargs.max_loras == 4
    assert sargs.max_lora_rank == eargs.max_lora_rank
    paths = [str(parse_lora_module(e)[1]) for e in split_lora_modules(sargs.lora_modules)]
    assert len(paths) == 2
    for w in (sched, execs):
        for path in paths:
            volume, mount = mounted(w, container(w), path)
            assert mount.get("readOnly") and volume["persistentVolumeClaim"]["readOnly"], (w["metadata"]["name"], path)


def test_dockerfiles_run_as_the_uid_the_manifests_expect():
    for name in ("scheduler", "executor"):
        text = (REPO / "docker" / f"Dockerfile.{name}").read_text()
        assert re.search(r"^USER 10001:10001$", text, re.M), name


def test_network_policies_let_only_executors_reach_the_executor_port(rendered):
    policies = [d for d in rendered["gpu"] if d["kind"] == "NetworkPolicy"]
    allowed = lambda src, dst, port, proto="TCP": connection_allowed(policies, src, dst, port, proto)  # noqa: E731
    assert allowed(EXEC_LABELS, SCHED_LABELS, 5556)
    assert not allowed(OTHER_LABELS, SCHED_LABELS, 5556)
    assert allowed(OTHER_LABELS, SCHED_LABELS, 50051) and allowed(OTHER_LABELS, SCHED_LABELS, 9100)
    assert allowed(OTHER_LABELS, SCHED_LABELS, 8000)  # the OpenAI-compatible API
    for src in (OTHER_LABELS, SCHED_LABELS, EXEC_LABELS):  # nothing dials an executor
        assert not allowed(src, EXEC_LABELS, 8090)
    assert not allowed(EXEC_LABELS, OTHER_LABELS, 443)  # executors reach the scheduler only
    # ... and DNS (kube-dns lives in another namespace: only the egress side applies here).
    assert policy_allows(policies, "Egress", EXEC_LABELS, {"k8s-app": "kube-dns"}, 53, "UDP")
    assert policy_allows(policies, "Egress", SCHED_LABELS, {"k8s-app": "kube-dns"}, 53, "UDP")
    assert not allowed(SCHED_LABELS, EXEC_LABELS, 8090) and not allowed(SCHED_LABELS, OTHER_LABELS, 443)
    assert not allowed(OTHER_LABELS, {"app": "another"}, 80)  # default deny for the namespace


def test_pdb_covers_the_executors(rendered):
    pdb = find(rendered["gpu"], "PodDisruptionBudget", EXEC)["spec"]
    assert pdb["selector"]["matchLabels"] == EXEC_LABELS and pdb["maxUnavailable"] == 1
    executor = find(rendered["gpu"], "Deployment", EXEC)
    assert executor["spec"]["template"]["metadata"]["labels"].items() >= EXEC_LABELS.items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_executor_pod_makes_its_own_key_pair_and_holds_nothing_of_the_schedulers(rendered, variant):
    """No Secret shared by the replicas holds a key: each pod's init container makes its key pair into a
    memory emptyDir of that pod; the pod gets the scheduler's public key (a ConfigMap) and the
    enrollment token, and the scheduler's secret key is in a Secret only the scheduler mounts."""
    from pagedserve.cli import _build_parser

    docs = rendered[variant]
    executors = executor_workload(docs)
    c, spec = container(executors), pod_spec(executors)
    env = container_env(docs, c)
    volume, mount = mounted(executors, c, env["PAGEDSERVE_CURVE_KEY_FILE"])
    assert volume["emptyDir"]["medium"] == "Memory" and mount["readOnly"] is True
    (make,) = [i for i in spec["initContainers"] if i["name"] == "make-key"]
    assert make["command"][0] in project_scripts()
    args = _build_parser().parse_args(make["command"][1:])  # what the real CLI makes of it
    assert (args.command, args.keys_command, args.keep_existing) == ("keys", "executor", True)
    assert env["PAGEDSERVE_CURVE_KEY_FILE"] == f"{mount['mountPath']}/{args.name}.key_secret"
    assert str(args.out) == mount["mountPath"] and mounted(executors, make, str(args.out))[0] is volume
    volume, _ = mounted(executors, c, env["PAGEDSERVE_SCHEDULER_PUBLIC_KEY_FILE"])
    assert volume["configMap"]["name"] == keytool.SCHEDULER_PUBLIC_CONFIGMAP
    assert env["PAGEDSERVE_SCHEDULER_PUBLIC_KEY_FILE"].endswith("/" + keytool.SCHEDULER_PUBLIC_FILE)
    volume, mount = mounted(executors, c, env["PAGEDSERVE_ENROLLMENT_TOKEN_FILE"])
    assert volume["secret"]["secretName"] == keytool.TOKEN_SECRET and "subPath" not in mount
    assert env["PAGEDSERVE_ENROLLMENT_TOKEN_FILE"].endswith("/" + keytool.TOKEN_FILE)
    secrets = {v["secret"]["secretName"] for w in workloads(docs) for v in pod_spec(w)["volumes"] if "secret" in v
               and w is not find(docs, "Deployment", SCHED)}
    assert keytool.SCHEDULER_KEY_SECRET not in secrets and not [k for k in env if "CLUSTER_SECRET" in k]
    assert {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} == {keytool.TOKEN_SECRET}


# ------------------------------------------------------------------ tensor-parallel executors

def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity with a binary suffix (16Gi) in bytes."""
    value, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", quantity).groups()
    return int(value) * 2 ** (10 * ("Ki", "Mi", "Gi", "Ti").index(unit) + 10)


def _keys_mounted(env: dict[str, str], tmp_path) -> dict[str, str]:
    """``env`` with the key files' mount paths replaced by local files: the executor reads its key
    pair, the scheduler's public key and its token while parsing its flags."""
    from pagedserve.wire.key_files import write_key_pair

    keys = tmp_path / "keys"
    if not keys.exists():
        write_key_pair(keys, "executor")
        write_key_pair(keys, "scheduler")
        (keys / "token").write_text(keytool.kubernetes_objects(NAMESPACE)["items"][2]["stringData"][keytool.TOKEN_FILE])
    local = {"PAGEDSERVE_CURVE_KEY_FILE": keys / "executor.key_secret",
             "PAGEDSERVE_SCHEDULER_PUBLIC_KEY_FILE": keys / "scheduler.key",
             "PAGEDSERVE_ENROLLMENT_TOKEN_FILE": keys / "token"}
    assert all(env[name].startswith("/etc/pagedserve/") for name in local)
    return {**env, **{name: str(path) for name, path in local.items()}}


def test_tensor_parallel_executors_get_n_gpus_and_shared_memory_for_nccl(rendered, tmp_path):
    from executor_svc.config import parse_config

    docs = rendered["gpu-tp"]
    deploy = find(docs, "Deployment", EXEC)
    c, spec = container(deploy), pod_spec(deploy)
    cfg = parse_config(c["args"], _keys_mounted(container_env(docs, c, pod_name="pagedserve-executor-7d9f8b6c5-x2x4z"),
                                                tmp_path))
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert cfg.tensor_parallel_size == gpus == 2 and cfg.rank_env is None  # this pod starts all N ranks
    assert cfg.device == "cuda"
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[{m["mountPath"]: m for m in c["volumeMounts"]}["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory" and _bytes(shm["sizeLimit"]) >= gpus * 4 * 2**30
    assert _bytes(c["resources"]["limits"]["memory"]) >= _bytes(shm["sizeLimit"])  # shm counts here
    # Everything else is the gpu overlay's executor.
    base = container(find(rendered["gpu"], "Deployment", EXEC))
    assert {k: v for k, v in c.items() if k not in ("resources", "envFrom")} == \
        {k: v for k, v in base.items() if k not in ("resources", "envFrom")}


def _lws_env(docs: list[Doc], lws: Doc, worker_index: int) -> dict[str, str]:
    """A rank pod's environment: LeaderWorkerSet's injected variables first, then the template's."""
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    name, leader = lws["metadata"]["name"], f"{lws['metadata']['name']}-0.{lws['metadata']['name']}.{NAMESPACE}"
    labels = {"leaderworkerset.sigs.k8s.io/worker-index": str(worker_index)}
    return container_env(docs, container(lws), pod_name=f"{name}-0-{worker_index}" if worker_index else f"{name}-0",
                         pod_labels=labels, injected={"LWS_LEADER_ADDRESS": leader, "LWS_GROUP_SIZE": str(size)})


def test_multinode_executors_are_leaderworkerset_groups_of_ranks(rendered, tmp_path):
    from executor_svc.config import parse_config

    docs = rendered["gpu-multinode"]
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == EXEC]  # replaced
    lws = find(docs, "LeaderWorkerSet", EXEC)
    template = lws["spec"]["leaderWorkerTemplate"]
    size, c = template["size"], container(lws)
    assert size >= 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert pod_template(lws)["metadata"]["labels"].items() >= EXEC_LABELS.items()  # the PDB and policies apply
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    rendezvous = {p["name"]: p["containerPort"] for p in c["ports"]}["rendezvous"]
    for index in range(size):
        env = _lws_env(docs, lws, index)
        cfg = parse_config(c["command"][1:] + c["args"], _keys_mounted(env, tmp_path))
        ranks = cfg.rank_env
        assert cfg.tensor_parallel_size == size and (ranks.rank, ranks.world_size, ranks.local_rank) == (index, size, 0)
        assert ranks.master_addr == env["LWS_LEADER_ADDRESS"] and ranks.master_port == rendezvous
        if index == 0:
            assert cfg.executor_id == f"{EXEC}-0"  # the leader pod's name: the executor the scheduler sees
    # The rest of the pod is the gpu overlay's executor: probes, hardening, volumes, drain budget.
    base = find(rendered["gpu"], "Deployment", EXEC)
    for key in ("startupProbe", "livenessProbe", "readinessProbe", "lifecycle", "securityContext", "volumeMounts",
                "command", "args"):
        assert c[key] == container(base)[key], key
    assert {k: v for k, v in pod_spec(lws).items() if k not in ("containers", "initContainers")} == \
        {k: v for k, v in pod_spec(base).items() if k not in ("containers", "initContainers")}
    assert pod_spec(lws)["initContainers"] == pod_spec(base)["initContainers"]
    # Ranks reach each other on any port (store, gloo, NCCL); nothing else new is allowed.
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for port in (rendezvous, 41234):
        assert connection_allowed(policies, EXEC_LABELS, EXEC_LABELS, port)
        assert not connection_allowed(policies, OTHER_LABELS, EXEC_LABELS, port)
        assert not connection_allowed(policies, SCHED_LABELS, EXEC_LABELS, port)
    assert connection_allowed(policies, EXEC_LABELS, SCHED_LABELS, 5556)
    assert not connection_allowed(policies, EXEC_LABELS, OTHER_LABELS, 443)


def _requirements(*extras: str) -> set[str]:
    """Distribution names of pyproject.toml's dependencies plus these extras (self-references expanded)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs, todo, seen = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for r in project["optional-dependencies"][extra]:
            m = re.fullmatch(r"pagedserve\[([^\]]+)\]", r)
            if m:
                todo += m.group(1).split(",")
            else:
                reqs.append(r)
    return {re.split(r"[<>=!~\[ ;]", r)[0].lower().replace("_", "-") for r in reqs}


@pytest.mark.parametrize("entry,extras,optional", [
    ("scheduler_svc.__main__", ("scheduler",), ()),
    ("scheduler_svc.entrypoints.front", ("scheduler",), ()),  # pagedserve-front, from the scheduler's image
    ("executor_svc.__main__", ("executor",), ("cupy",)),  # CuPy: the gpu extra, imported only on CUDA
])
def test_each_service_extra_covers_every_import_of_the_service(entry, extras, optional):
    from importlib.metadata import packages_distributions

    listed = _requirements(*extras)
    dists = packages_distributions()
    service = entry.split(".")[0]
    imports = third_party_imports(entry, ("scheduler_svc", "pagedserve", "executor_svc", "cupy_kernels"))
    for module in sorted(imports - set(optional)):
        provided = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        assert provided & listed, f"{service} imports {module} ({provided}); pyproject's {extras} lack it"


def test_the_scheduler_installs_no_torch_and_its_image_uses_its_extra():
    assert not _requirements("scheduler") & {"torch", "transformers", "cupy-cuda12x", "safetensors"}
    assert "torch" not in third_party_imports("scheduler_svc.__main__", ("scheduler_svc", "pagedserve"))
    scheduler_image = (REPO / "docker" / "Dockerfile.scheduler").read_text()
    assert '"${whl}[scheduler]"' in scheduler_image
    executor_image = (REPO / "docker" / "Dockerfile.executor").read_text()
    assert '"${whl}[executor,tiny-model${EXTRAS:+,${EXTRAS}}]"' in executor_image


def test_configmaps_split_shared_and_per_service_settings(rendered):
    from executor_svc import config as ec
    from scheduler_svc.entrypoints import service_flags as flags

    both = flag_env_names(flags.build_arg_parser) & flag_env_names(ec.build_arg_parser)
    for docs in rendered.values():
        common = next(d for d in docs if d["kind"] == "ConfigMap"
                      and d["metadata"]["name"].startswith("pagedserve-common-"))
        assert set(common["data"]) <= both  # every shared key means something to both services
        assert configmap_data(docs, common["metadata"]["name"])["PAGEDSERVE_MODEL"].startswith("/models/")


# ------------------------------------------------------------------ a stand-in for the cluster

def _complete(port: int, prompt: str, max_tokens: int) -> int:
    """One greedy OpenAI-compatible completion: its completion tokens."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["usage"]["completion_tokens"]


POOL_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_overlay_serves_on_loopback_and_survives_a_front_and_an_executor_sigterm(rendered):
    """The cpu overlay with fronts of their own: its scheduler, two executors and a front, started
    with exactly their rendered commands and environment (see StandIn for the rewrites), serve
    requests, the front through the scheduler's front link with the fronts' key; then the front and
    one executor are deleted as Kubernetes does it (preStop, SIGTERM, grace period) while requests
    run, and every request still completes and the scheduler stays ready."""
    import grpc

    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc

    docs = rendered["cpu+fronts"]
    # Each pod's init container builds the same seeded tiny model; build it once and share it.
    inits = {json.dumps([c for c in pod_spec(find(docs, "Deployment", d))["initContainers"]
                         if c["name"] == "build-tiny-model"]) for d in (SCHED, EXEC, FRONT)}
    assert len(inits) == 1
    # A short root: the scheduler's local links are ipc:// paths under the pod's /tmp (107 bytes at most).
    root = Path(tempfile.mkdtemp(prefix="k8s-", dir="/tmp"))
    cluster = StandIn(docs, root)
    try:
        # What the operator creates once (README): `pagedserve keys kubernetes | kubectl create -f -`,
        # mounted as the kubelet would, one directory per Secret or ConfigMap.
        volumes = operator_objects(root / "objects")
        sched = cluster.pod(SCHED, "pagedserve-scheduler-5d8f7c9b4-q7x2m", {
            "scheduler-key": volumes[keytool.SCHEDULER_KEY_SECRET], "enrollment-token": volumes[keytool.TOKEN_SECRET],
            "trusted-front-keys": volumes[keytool.TRUSTED_FRONTS_CONFIGMAP]})
        cluster.run_init(sched)
        shared = {"models": sched.volumes["models"], "enrollment-token": volumes[keytool.TOKEN_SECRET],
                  "scheduler-public-key": volumes[keytool.SCHEDULER_PUBLIC_CONFIGMAP]}
        executors = [cluster.pod(EXEC, f"pagedserve-executor-6c9d8f7b5-{s}", shared) for s in ("a1b2c", "d3e4f")]
        for ex in executors:  # each pod makes its own key pair (the model is already built and shared)
            cluster.run_init(ex, names=("make-key",))
        front = cluster.pod(FRONT, "pagedserve-front-7f6d5c4b3-k9j8h", {
            "models": sched.volumes["models"], "front-key": volumes[keytool.FRONT_KEY_SECRET],
            "scheduler-public-key": volumes[keytool.SCHEDULER_PUBLIC_CONFIGMAP]})
        # The link hosts are not in the rendered args; their wildcard defaults become loopback too.
        cluster.start(sched, {"PAGEDSERVE_EXECUTOR_HOST": "127.0.0.1", "PAGEDSERVE_FRONT_LINK_HOST": "127.0.0.1"})
        cluster.wait_probe(sched, "startupProbe", 60)
        for pod in (*executors, front):
            cluster.start(pod)
        for ex in executors:
            cluster.wait_probe(ex, "startupProbe", 120)
            cluster.wait_probe(ex, "readinessProbe", 10)
        cluster.wait_probe(sched, "readinessProbe", 30)
        cluster.wait_probe(front, "startupProbe", 60)
        cluster.wait_probe(front, "readinessProbe", 30)
        channel = grpc.insecure_channel(f"127.0.0.1:{sched.ports[50051]}")
        stub = pb_grpc.GenerationStub(channel)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_executors == 2
        assert generate(channel, "The quick brown fox", 8)[0] == 8, cluster.logs()
        # The OpenAI-compatible API on its containerPort serves the same engine.
        assert _complete(sched.ports[8000], "The quick brown fox", 8) == 8
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{sched.ports[9100]}/metrics", timeout=5).read()
        assert QUEUE_METRIC.encode() in metrics

        _front_serves_through_the_front_link(cluster, front)
        _delete_front_while_it_streams(cluster, sched, front, channel)
        _delete_executor_under_traffic(cluster, sched, executors, channel)
        channel.close()
        _check_pod_keys(cluster, sched, executors, volumes)
        log = sched.log.read_text(errors="replace")
        assert f"front {front.name} joined" in log, log[-3000:]
        for path in front.volumes.values():  # the fronts' pods hold nothing of the scheduler's secret
            for f in path.rglob("*"):
                assert not f.is_file() or keytool.SCHEDULER_KEY_FILE not in f.name
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)


def _front_serves_through_the_front_link(cluster: StandIn, front) -> None:
    """The front's own ports serve both APIs, and /metrics on its HTTP port is the deployment's, with the
    names the inference gateway's endpoint picker reads."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{front.ports[50051]}") as channel:
        assert generate(channel, "Once upon a time", 12)[0] == 12, cluster.logs()
    assert _complete(front.ports[8000], "Once upon a time", 12) == 12
    text = urllib.request.urlopen(f"http://127.0.0.1:{front.ports[8000]}/metrics", timeout=10).read().decode()
    for name in POOL_METRICS:
        assert re.search(rf'^{re.escape(name)}\{{model_name="[^"]+"\}} [0-9.e+-]+$', text, re.M), name
    assert QUEUE_METRIC in text  # the engine core's own gauges too: one text for the whole deployment


def _delete_front_while_it_streams(cluster: StandIn, sched, front, sched_channel) -> None:
    """A front deleted as the kubelet does it finishes the stream it has, exits 0 within its grace
    period, and the engine core, once it has dropped the front, is still ready and serving."""
    import grpc
    from grpc_health.v1 import health_pb2

    with grpc.insecure_channel(f"127.0.0.1:{front.ports[50051]}") as channel, ThreadPoolExecutor(1) as pool:
        stream = pool.submit(generate, channel, "A stream in flight when its front is deleted", 48)
        time.sleep(0.3)
        code, killed = cluster.terminate(front)
        assert stream.result(timeout=60)[0] == 48, cluster.logs()
    assert not killed and code == 0, cluster.logs()
    deadline = time.monotonic() + 10
    while f"front {front.name} dropped" not in sched.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    assert cluster.probe(sched, "readinessProbe") == health_pb2.HealthCheckResponse.SERVING
    assert generate(sched_channel, "After the front left", 8)[0] == 8


def _delete_executor_under_traffic(cluster: StandIn, sched, executors, channel) -> None:
    """Steady traffic from three clients while one executor's pod is deleted: some requests are in
    flight on it when SIGTERM arrives, some start while it drains, some after. Every one completes."""
    from grpc_health.v1 import health_pb2

    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc

    stop = threading.Event()

    def client(i: int) -> list[int]:
        done = []
        while not stop.is_set():
            done.append(generate(channel, f"Client {i} asks question {len(done)}", 24)[0])
        return done

    with ThreadPoolExecutor(max_workers=3) as pool:
        clients = [pool.submit(client, i) for i in range(3)]
        time.sleep(1.0)
        code, killed = cluster.terminate(executors[0])
        time.sleep(1.0)
        stop.set()
        errors = [c.exception() for c in clients]
    assert errors == [None] * 3, f"{errors}\n{cluster.logs()}"
    assert not killed and code == 0, cluster.logs()
    served = [n for c in clients for n in c.result()]
    assert len(served) >= 6 and set(served) == {24}, served
    assert cluster.probe(sched, "readinessProbe") == health_pb2.HealthCheckResponse.SERVING
    assert cluster.probe(executors[1], "readinessProbe") == health_pb2.HealthCheckResponse.SERVING
    assert pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_executors == 1


def _check_pod_keys(cluster: StandIn, sched, executors, volumes: dict[str, Path]) -> None:
    """Each executor pod enrolled a key pair of its own, made in the pod, secret key owner-only, and
    no executor pod's volumes hold the scheduler's secret key."""
    from pagedserve.wire.key_files import load_key_pair

    scheduler = load_key_pair(volumes[keytool.SCHEDULER_KEY_SECRET] / keytool.SCHEDULER_KEY_FILE, "scheduler")
    log = sched.log.read_text(errors="replace")
    keys = []
    for ex in executors:
        secret = ex.volumes["executor-key"] / "executor.key_secret"
        assert secret.stat().st_mode & 0o777 == 0o600
        keys.append(load_key_pair(secret, ex.name).public)
        assert f"executor {ex.name} joined" in log and f"key {keys[-1].decode()} (enrolled)" in log, log[-3000:]
        for path in ex.volumes.values():
            for f in path.rglob("*"):
                assert not f.is_file() or scheduler.secret not in f.read_bytes(), f
    assert len(set(keys)) == len(executors)
