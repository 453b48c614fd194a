"""k8s/components/engine-cores, checked offline: the scheduler pod runs two engine cores, and every
port a core listens on (its executor port, and with fronts of their own its front link) is a port
of the scheduler container, reachable through the Service its peers dial, from those peers only;
every front dials every core. (checkov, the schemas and the hardening rules run over these variants
in test_k8s_manifests.py.)

Needs kubectl (kustomize)."""

from __future__ import annotations

import argparse

import pytest
from k8s_helpers import (
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
    render_with_components,
    service_target,
)

VARIANTS = {"cpu+cores": ("cpu", ["engine-cores"]), "gpu+fronts+cores": ("gpu", ["fronts", "engine-cores"])}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[Doc]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {name: render_with_components(tmp, overlay, comps) for name, (overlay, comps) in VARIANTS.items()}


def _scheduler_args(docs: list[Doc]) -> argparse.Namespace:
    """The scheduler's rendered command, parsed and held to the parser's own port-range check."""
    from scheduler_svc import config as sc

    args, _ = parse_container(docs, container(find(docs, "Deployment", SCHED)))
    sc._check_port_ranges(sc.build_arg_parser(), args)  # (argparse exits on a clash)
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
