"""k8s/components/fronts, checked offline: fronts as a Deployment of their own parse their rendered
command with the front's real parser into the scheduler's own settings, dial the scheduler's front
link with the fronts' key pair, read the model where the scheduler does, scale on CPU with an HPA,
drain one at a time, and reach nothing but the front link. (They serve requests in the stand-in of
test_k8s_manifests.py; checkov and the schemas are checked there too.)

Needs kubectl (kustomize)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import keytool
from testing.k8s_helpers import (
    EXEC,
    EXEC_LABELS,
    FRONT,
    FRONT_LABELS,
    OTHER_LABELS,
    SCHED,
    SCHED_LABELS,
    Doc,
    connection_allowed,
    container,
    container_env,
    find,
    mounted,
    pod_spec,
    pod_template,
    policy_allows,
    probe_seconds,
    render_with_components,
    service_target,
    workloads,
)
from testing.k8s_standin import StandIn

VARIANTS = {"gpu+fronts": "gpu", "cpu+fronts": "cpu"}
POD = "pagedserve-front-7f6d5c4b3-k9j8h"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[Doc]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {name: render_with_components(tmp, overlay, ["fronts"]) for name, overlay in VARIANTS.items()}


@pytest.fixture(scope="module")
def key_volumes(tmp_path_factory) -> dict[str, Path]:
    """`pagedserve keys kubernetes`'s objects, each as the directory a volume of it is."""
    root = tmp_path_factory.mktemp("objects")
    out = {}
    for obj in keytool.kubernetes_objects("pagedserve")["items"]:
        d = out[obj["metadata"]["name"]] = root / obj["metadata"]["name"]
        d.mkdir()
        for key, value in obj.get("stringData", obj.get("data", {})).items():
            (d / key).write_text(value)
    return out


def _parse_pods(docs: list[Doc], key_volumes: dict[str, Path], tmp: Path, monkeypatch):
    """The scheduler's and a front's main containers parsed with their real parsers, as StandIn would
    run them: volumes are local directories (the key ones holding what `pagedserve keys kubernetes`
    makes), addresses of Services the local ports behind them. -> (scheduler config, front config,
    front's FrontConfig)."""
    from scheduler_svc.entrypoints.front import parse_front_args
    from scheduler_svc.entrypoints.service_config import load_config

    cluster = StandIn(docs, tmp)
    parsed = []
    for deployment, pod in ((SCHED, "pagedserve-scheduler-5d8f7c9b4-q7x2m"), (FRONT, POD)):
        objects = {v["name"]: v.get("secret", {}).get("secretName") or v.get("configMap", {}).get("name")
                   for v in pod_spec(find(docs, "Deployment", deployment))["volumes"]}
        local = cluster.pod(deployment, pod, {name: key_volumes[o] for name, o in objects.items() if o in key_volumes})
        c = container(local.workload)
        env = {k: v for k, v in cluster.env(local, c).items() if k.startswith("PAGEDSERVE_")}
        Path(env["PAGEDSERVE_MODEL"]).mkdir(parents=True, exist_ok=True)
        (Path(env["PAGEDSERVE_MODEL"]) / "config.json").write_text("{}")
        for name in [k for k in os.environ if k.startswith("PAGEDSERVE_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        args = c["command"][1:] + c.get("args", [])
        parsed.append(parse_front_args(args) if deployment == FRONT else load_config(args))
    return parsed[0], *parsed[1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_fronts_get_a_deployment_services_an_autoscaler_and_a_disruption_budget(rendered, variant):
    docs = rendered[variant]
    deploy = find(docs, "Deployment", FRONT)
    for kind, name in [("Service", FRONT), ("Service", "pagedserve-scheduler-fronts"), ("ServiceAccount", FRONT),
                       ("HorizontalPodAutoscaler", FRONT), ("PodDisruptionBudget", FRONT),
                       ("NetworkPolicy", FRONT), ("NetworkPolicy", "pagedserve-scheduler-fronts")]:
        assert find(docs, kind, name)["metadata"]["namespace"] == "pagedserve"
    assert "replicas" not in deploy["spec"]  # the HPA owns the count: `kubectl apply` must not reset it
    assert pod_template(deploy)["metadata"]["labels"] == FRONT_LABELS
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # The scheduler and its executors are the overlay's, untouched but for the front link.
    assert find(docs, "Deployment", SCHED)["spec"]["replicas"] == 1 and find(docs, "Deployment", EXEC)


@pytest.mark.parametrize("variant", VARIANTS)
def test_front_parses_into_the_schedulers_settings_and_dials_its_front_link_with_keys(
        rendered, variant, key_volumes, tmp_path, monkeypatch):
    from pagedserve import wire

    docs = rendered[variant]
    sched_cfg, cfg, fc = _parse_pods(docs, key_volumes, tmp_path, monkeypatch)
    c = container(find(docs, "Deployment", FRONT))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": cfg.port, "http": cfg.http_port} and cfg.host == cfg.http_host == "0.0.0.0"
    for probe, service in [("startupProbe", wire.HEALTH_LIVENESS), ("livenessProbe", wire.HEALTH_LIVENESS),
                           ("readinessProbe", wire.HEALTH_SCHEDULER_READY)]:
        assert c[probe]["grpc"] == {"port": cfg.port, "service": service}, probe
    client = {p["name"]: p for p in find(docs, "Service", FRONT)["spec"]["ports"]}
    assert {name: ports[p["targetPort"]] for name, p in client.items()} == {"grpc": cfg.port, "http": cfg.http_port}
    assert fc.front_id == POD  # the pod name: unique among the core's fronts
    # What the front checks and how it streams is what the scheduler's own fronts do.
    for field in ("limits", "http_limits", "grpc_limits", "api_keys", "tls", "shutdown_grace_seconds"):
        assert getattr(cfg, field) == getattr(sched_cfg, field), field
    assert cfg.engine.stream_interval == sched_cfg.engine.stream_interval
    assert cfg.model_dir.name == sched_cfg.model_dir.name
    # It dials the scheduler's front link, through a Service that publishes it before it is ready (the
    # front learns the core's readiness over that link), with the fronts' key pair, which the
    # scheduler admits; the link's server key is the scheduler's own.
    assert len(fc.core_endpoints) == 1  # (one engine core: its link)
    target, port = service_target(docs, container_env(docs, c)["PAGEDSERVE_CORE"])
    assert target["metadata"]["name"] == SCHED and port == sched_cfg.front_link_port
    assert find(docs, "Service", "pagedserve-scheduler-fronts")["spec"]["publishNotReadyAddresses"] is True
    assert sched_cfg.front_link_host == "0.0.0.0" and sched_cfg.engine.executor_link is not None
    from pagedserve.wire.key_files import read_key_set

    assert fc.keys is not None and fc.keys.server_public == sched_cfg.engine.executor_link.server.public
    assert fc.keys.own.public in read_key_set(sched_cfg.trusted_front_keys, "trusted")


@pytest.mark.parametrize("variant", VARIANTS)
def test_front_key_pair_is_one_secret_of_the_fronts_and_the_scheduler_trusts_its_public_key(rendered, variant):
    docs = rendered[variant]
    front, sched = find(docs, "Deployment", FRONT), find(docs, "Deployment", SCHED)
    env = container_env(docs, container(front))
    volume, mount = mounted(front, container(front), env["PAGEDSERVE_CURVE_KEY_FILE"])
    assert volume["secret"]["secretName"] == keytool.FRONT_KEY_SECRET and mount["readOnly"] is True
    assert env["PAGEDSERVE_CURVE_KEY_FILE"].endswith("/" + keytool.FRONT_KEY_FILE)
    volume, _ = mounted(front, container(front), env["PAGEDSERVE_SCHEDULER_PUBLIC_KEY_FILE"])
    assert volume["configMap"]["name"] == keytool.SCHEDULER_PUBLIC_CONFIGMAP
    sched_env = container_env(docs, container(sched))
    volume, mount = mounted(sched, container(sched), sched_env["PAGEDSERVE_TRUSTED_FRONT_KEYS"])
    assert volume["configMap"]["name"] == keytool.TRUSTED_FRONTS_CONFIGMAP and mount["mountPath"] == \
        sched_env["PAGEDSERVE_TRUSTED_FRONT_KEYS"] and "subPath" not in mount  # (changes show: re-read)
    # The fronts hold no key of the scheduler's, nor the executors' enrollment token; nobody else holds
    # the fronts' key.
    assert {v["secret"]["secretName"] for v in pod_spec(front)["volumes"] if "secret" in v} == {keytool.FRONT_KEY_SECRET}
    for w in workloads(docs):
        if w is not front:
            assert keytool.FRONT_KEY_SECRET not in json.dumps(pod_spec(w)), w["metadata"]["name"]


def test_keys_kubernetes_makes_the_fronts_key_pair_also_alone(tmp_path):
    from pagedserve.wire.key_files import load_key_pair, load_public_key

    for flags, expected in [([], 5), (["--fronts-only"], 2)]:
        out = subprocess.run([str(Path(sys.executable).parent / "pagedserve"), "keys", "kubernetes", *flags],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        items = {o["metadata"]["name"]: o for o in json.loads(out)["items"]}
        assert len(items) == expected
        (tmp_path / "secret").write_text(items[keytool.FRONT_KEY_SECRET]["stringData"][keytool.FRONT_KEY_FILE])
        (tmp_path / "public").write_text(items[keytool.TRUSTED_FRONTS_CONFIGMAP]["data"][keytool.FRONT_PUBLIC_FILE])
        pair = load_key_pair(tmp_path / "secret", "secret")
        assert load_public_key(tmp_path / "public", "public") == pair.public
        assert pair.secret.decode() not in items[keytool.TRUSTED_FRONTS_CONFIGMAP]["data"][keytool.FRONT_PUBLIC_FILE]


@pytest.mark.parametrize("variant", VARIANTS)
def test_fronts_read_the_model_where_the_scheduler_does_from_its_image(rendered, variant):
    docs = rendered[variant]
    front, sched = find(docs, "Deployment", FRONT), find(docs, "Deployment", SCHED)
    assert pod_spec(front)["initContainers"] == pod_spec(sched)["initContainers"]
    models = [[v for v in pod_spec(w)["volumes"] if v["name"] == "models"] for w in (front, sched)]
    assert models[0] == models[1]
    for key in ("image", "imagePullPolicy"):
        assert container(front)[key] == container(sched)[key], key
    assert container_env(docs, container(front))["PAGEDSERVE_MODEL"] == \
        container_env(docs, container(sched))["PAGEDSERVE_MODEL"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_front_drain_fits_its_grace_period(rendered, variant):
    docs = rendered[variant]
    front = find(docs, "Deployment", FRONT)
    env = container_env(docs, container(front))
    pre_stop = probe_seconds(container(front)["lifecycle"]["preStop"]["exec"]["command"])
    grace = float(env["PAGEDSERVE_SHUTDOWN_GRACE_SECONDS"])
    assert pod_spec(front)["terminationGracePeriodSeconds"] >= pre_stop + grace + 5


def test_fronts_scale_on_their_cpu_two_at_least_one_down_at_a_time(rendered):
    docs = rendered["gpu+fronts"]
    hpa = find(docs, "HorizontalPodAutoscaler", FRONT)["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FRONT}
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert 0 < metric["resource"]["target"]["averageUtilization"] < 100
    assert "cpu" in container(find(docs, "Deployment", FRONT))["resources"]["requests"]  # (utilization of it)
    pdb = find(docs, "PodDisruptionBudget", FRONT)["spec"]
    assert pdb["selector"]["matchLabels"] == FRONT_LABELS and pdb["maxUnavailable"] == 1
    assert hpa["minReplicas"] > pdb["maxUnavailable"]  # a node drain leaves a front serving


def test_network_policies_let_only_fronts_reach_the_front_link(rendered):
    policies = [d for d in rendered["gpu+fronts"] if d["kind"] == "NetworkPolicy"]

    def allowed(src, dst, port, proto="TCP"):
        return connection_allowed(policies, src, dst, port, proto)

    assert allowed(FRONT_LABELS, SCHED_LABELS, 5600)
    for src in (OTHER_LABELS, EXEC_LABELS):
        assert not allowed(src, SCHED_LABELS, 5600)
    for port in (50051, 8000):  # the public APIs (and /metrics on 8000), from anywhere in the cluster
        assert allowed(OTHER_LABELS, FRONT_LABELS, port)
    assert not allowed(OTHER_LABELS, FRONT_LABELS, 5600)
    # A front reaches the front link only (and DNS): not the executor link, no executor, nothing else.
    assert not allowed(FRONT_LABELS, SCHED_LABELS, 5556) and not allowed(FRONT_LABELS, SCHED_LABELS, 9100)
    assert not allowed(FRONT_LABELS, EXEC_LABELS, 8090) and not allowed(FRONT_LABELS, OTHER_LABELS, 443)
    assert policy_allows(policies, "Egress", FRONT_LABELS, {"k8s-app": "kube-dns"}, 53, "UDP")
    assert not allowed(EXEC_LABELS, FRONT_LABELS, 8000)  # executors reach the scheduler only, as before
    assert allowed(EXEC_LABELS, SCHED_LABELS, 5556)
