"""k8s/components/engine-cores, checked offline: the scheduler pod runs two engine cores, and every
port a core listens on (its executor port, and with fronts of their own its front link) is a port
of the scheduler container, reachable through the Service its peers dial, from those peers only;
every front dials every core; and the cpu variant's pods, run with their rendered commands, spread
their executors over both cores and serve. (checkov, the schemas and the hardening rules run over
these variants in test_k8s_manifests.py.)

Needs kubectl (kustomize)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
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
    parse_container,
    pod_spec,
    render_with_components,
    service_target,
)
from testing.k8s_standin import StandIn, generate, operator_objects

VARIANTS = {"cpu+cores": ("cpu", ["engine-cores"]), "gpu+fronts+cores": ("gpu", ["fronts", "engine-cores"])}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[Doc]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {name: render_with_components(tmp, overlay, comps) for name, (overlay, comps) in VARIANTS.items()}


def _scheduler_args(docs: list[Doc]) -> argparse.Namespace:
    """The scheduler's rendered command, parsed and held to the parser's own port-range check."""
    from scheduler_svc.entrypoints import service_config as sc
    from scheduler_svc.entrypoints.service_flags import build_arg_parser

    args, _ = parse_container(docs, container(find(docs, "Deployment", SCHED)))
    sc._check_port_ranges(build_arg_parser(), args)  # (argparse exits on a clash)
    return args


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_cores_executor_port_is_reachable_by_executors_only(rendered, variant):
    docs = rendered[variant]
    args = _scheduler_args(docs)
    assert args.engine_cores == 2
    executor_env = container_env(docs, container(find(docs, "Deployment", EXEC)))
    directory = executor_env["PAGEDSERVE_SCHEDULER"]
    host = directory.rsplit(":", 1)[0]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for k in range(args.engine_cores):
        port = args.executor_port + k
        # The directory redirects an executor to core k's port on the host it dialled.
        target, container_port = service_target(docs, f"{host}:{port}")
        assert target["metadata"]["name"] == SCHED and container_port == port, (k, port)
        assert connection_allowed(policies, EXEC_LABELS, SCHED_LABELS, port)
        for other in (OTHER_LABELS, FRONT_LABELS):
            assert not connection_allowed(policies, other, SCHED_LABELS, port)
    assert not connection_allowed(policies, EXEC_LABELS, SCHED_LABELS, args.executor_port + args.engine_cores)


def test_fronts_of_their_own_dial_every_core_and_reach_only_the_front_links(rendered):
    docs = rendered["gpu+fronts+cores"]
    args = _scheduler_args(docs)
    links = container_env(docs, container(find(docs, "Deployment", FRONT)))["PAGEDSERVE_CORE"].split(",")
    assert len(links) == args.engine_cores
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for k, link in enumerate(links):
        target, container_port = service_target(docs, link)
        assert target["metadata"]["name"] == SCHED and container_port == args.front_link_port + k, link
        assert connection_allowed(policies, FRONT_LABELS, SCHED_LABELS, container_port)
        for other in (OTHER_LABELS, EXEC_LABELS):
            assert not connection_allowed(policies, other, SCHED_LABELS, container_port)
        assert not connection_allowed(policies, FRONT_LABELS, SCHED_LABELS, args.executor_port + k)


def test_without_fronts_of_their_own_no_front_link_is_opened(rendered):
    docs = rendered["cpu+cores"]
    assert not _scheduler_args(docs).front_link_port
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "pagedserve-scheduler-fronts"]


def test_cpu_overlay_with_engine_cores_spreads_its_executors_and_serves_on_loopback(rendered):
    """The scheduler pod and two executor pods, started with exactly their rendered commands and
    environment (test_k8s_manifests.py's stand-in): the directory sends one executor to core 1, on
    the container port the manifests give it, and requests are served."""
    import grpc

    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc

    docs = rendered["cpu+cores"]
    assert {c["name"] for c in pod_spec(find(docs, "Deployment", EXEC))["initContainers"]} >= {"build-tiny-model"}
    root = Path(tempfile.mkdtemp(prefix="k8s-", dir="/tmp"))  # short: the cores' ipc:// paths live under it
    cluster = StandIn(docs, root)
    try:
        volumes = operator_objects(root / "objects")
        sched = cluster.pod(SCHED, "pagedserve-scheduler-5d8f7c9b4-c0r3s", {
            "scheduler-key": volumes[keytool.SCHEDULER_KEY_SECRET], "enrollment-token": volumes[keytool.TOKEN_SECRET]})
        cluster.run_init(sched)
        shared = {"models": sched.volumes["models"], "enrollment-token": volumes[keytool.TOKEN_SECRET],
                  "scheduler-public-key": volumes[keytool.SCHEDULER_PUBLIC_CONFIGMAP]}
        executors = [cluster.pod(EXEC, f"pagedserve-executor-6c9d8f7b5-{s}", shared) for s in ("c0r30", "c0r31")]
        for ex in executors:
            cluster.run_init(ex, names=("make-key",))
        cluster.start(sched, {"PAGEDSERVE_EXECUTOR_HOST": "127.0.0.1"})
        cluster.wait_probe(sched, "startupProbe", 60)
        for ex in executors:
            cluster.start(ex)
        for ex in executors:
            cluster.wait_probe(ex, "startupProbe", 120)
            cluster.wait_probe(ex, "readinessProbe", 30)
        cluster.wait_probe(sched, "readinessProbe", 30)
        core_1 = f"scheduled by tcp://127.0.0.1:{sched.ports[5557]}"  # the port the manifests give core 1
        assert sum(core_1 in ex.log.read_text(errors="replace") for ex in executors) == 1, cluster.logs()
        with grpc.insecure_channel(f"127.0.0.1:{sched.ports[50051]}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_executors == 2
            for i in range(4):
                assert generate(channel, f"Question {i}: the quick brown fox", 8)[0] == 8, cluster.logs()
    finally:
        cluster.stop_all()
        shutil.rmtree(root, ignore_errors=True)
