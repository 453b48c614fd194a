"""Helpers for tests/deploy/test_k8s_*.py: render k8s/, find objects, resolve a container's
environment, evaluate NetworkPolicies, and locate the offline checkers (`make tools`); running the
rendered pods locally is testing/k8s_standin.py."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomllib
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
TOOLS_VENV = REPO / ".venv-tools"
NAMESPACE = "pagedserve"
SCHED, EXEC, FRONT = "pagedserve-scheduler", "pagedserve-executor", "pagedserve-front"
SCHED_LABELS = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "scheduler"}
EXEC_LABELS = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "executor"}
FRONT_LABELS = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "front"}
OTHER_LABELS = {"app": "something-else"}

Doc = dict[str, Any]


def tool(name: str) -> str:
    """Path of an offline checker: .venv-tools (`make tools`) first, then PATH."""
    candidate = TOOLS_VENV / "bin" / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found in {TOOLS_VENV}/bin or on PATH: run `make tools`")
    return found


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found on PATH: `kubectl kustomize` renders k8s/ for these tests")
    return found


def render(kustomization_dir: Path) -> list[Doc]:
    out = subprocess.run([kubectl(), "kustomize", str(kustomization_dir)], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {kustomization_dir} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_with_components(tmp: Path, overlay: str, components: list[str]) -> list[Doc]:
    """Render `overlay` plus optional components the way a user would: a kustomization of
    their own beside the overlays (kustomize refuses absolute paths, so k8s/ is copied)."""
    root = tmp / "k8s"
    if not root.exists():
        shutil.copytree(K8S, root)
    local = root / "overlays" / f"test-{overlay}-{'-'.join(components)}"
    local.mkdir()
    (local / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [f"../{overlay}"],
        "components": [f"../../components/{c}" for c in components],
    }))
    return render(local)


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    if len(hits) != 1:
        raise AssertionError(f"expected one {kind}/{name}, found {len(hits)}")
    return hits[0]


def pod_template(workload: Doc) -> Doc:
    """The pod template (a LeaderWorkerSet's is its workerTemplate, which its leaders use too)."""
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return workload["spec"]["template"]


def pod_spec(workload: Doc) -> Doc:
    return pod_template(workload)["spec"]


def container(workload: Doc, name: str | None = None) -> Doc:
    """The main container (the only one, or the one named `name`)."""
    cs = pod_spec(workload)["containers"]
    if name is None:
        assert len(cs) == 1, f"{workload['metadata']['name']}: expected one container"
        return cs[0]
    return next(c for c in cs if c["name"] == name)


def mounted(workload: Doc, c: Doc, path: str) -> tuple[Doc, Doc]:
    """The volume, and container ``c``'s mount of it, that ``path`` lies in (the deepest mount wins)."""
    mounts = [m for m in c.get("volumeMounts", []) if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    if not mounts:
        raise AssertionError(f"{c['name']}: {path} lies in no volume mount")
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return next(v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]), mount


def all_containers(workload: Doc) -> list[Doc]:
    spec = pod_spec(workload)
    return spec.get("initContainers", []) + spec["containers"]


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet", "LeaderWorkerSet")]


def configmap_data(docs: list[Doc], name: str) -> dict[str, str]:
    return dict(find(docs, "ConfigMap", name).get("data", {}))


def container_env(docs: list[Doc], c: Doc, pod_name: str = "pod-0", pod_labels: dict[str, str] | None = None,
                  injected: dict[str, str] | None = None) -> dict[str, str]:
    """The environment Kubernetes gives container `c`: what a controller puts first (`injected`,
    e.g. LeaderWorkerSet's LWS_* variables), envFrom ConfigMaps, then env entries, whose
    `$(VAR)` references expand to variables defined before them, as Kubernetes does (unknown
    ones stay as written); a fieldRef to metadata.name resolves to `pod_name`, one to
    metadata.namespace to the namespace, one to metadata.labels['key'] to `pod_labels[key]`."""
    env: dict[str, str] = dict(injected or {})
    for source in c.get("envFrom", []):
        if "configMapRef" not in source:
            raise AssertionError(f"{c['name']}: unsupported envFrom {source}")
        env.update(configmap_data(docs, source["configMapRef"]["name"]))
    for e in c.get("env", []):
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field or "")
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), e["value"])
        elif field == "metadata.name":
            env[e["name"]] = pod_name
        elif field == "metadata.namespace":
            env[e["name"]] = NAMESPACE
        elif label:
            env[e["name"]] = (pod_labels or {}).get(label[1], "")  # a missing label reads as empty
        else:
            raise AssertionError(f"{c['name']}: unsupported env source {e}")
    return env


def project_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def parser_for(script: str):
    """Console script -> its service's build_arg_parser, via pyproject's [project.scripts]."""
    package = project_scripts()[script].split(":")[0].split(".")[0]
    flags = {"scheduler_svc": "scheduler_svc.entrypoints.service_flags", "executor_svc": "executor_svc.config"}[package]
    return importlib.import_module(flags).build_arg_parser


def parse_container(docs: list[Doc], c: Doc) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse the container's command + args + environment with its service's real parser."""
    from pagedserve.envargs import parse_with_env

    env = container_env(docs, c, pod_name=f"{c['name']}-7d9f8b6c5-x2x4z")
    build = parser_for(c["command"][0])
    return parse_with_env(build(), c["command"][1:] + c.get("args", []), env), env


def flag_env_names(build) -> set[str]:
    from pagedserve.envargs import env_name

    return {env_name(o) for a in build()._actions for o in a.option_strings if o.startswith("--")}


def service_target(docs: list[Doc], address: str) -> tuple[Doc, int]:
    """``tcp://SERVICE:PORT`` -> (the workload whose pods the Service selects, the container port)."""
    m = re.fullmatch(r"tcp://([\w-]+):(\d+)", address)
    assert m, address
    svc = find(docs, "Service", m.group(1))
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(m.group(2))]
    selected = [w for w in workloads(docs) if svc["spec"]["selector"].items() <= pod_template(w)["metadata"]["labels"].items()]
    assert len(selected) == 1, f"Service {m.group(1)} selects {[w['metadata']['name'] for w in selected]}"
    named = {p["name"]: p["containerPort"] for c in pod_spec(selected[0])["containers"] for p in c.get("ports", [])}
    return selected[0], named.get(port["targetPort"], port["targetPort"])


def probe_seconds(command: list[str]) -> int:
    """Seconds a `sleep N` preStop hook takes."""
    if command[:1] != ["sleep"] or len(command) != 2:
        raise AssertionError(f"expected a preStop `sleep N`, got {command}")
    return int(command[1])


# ------------------------------------------------------------------ NetworkPolicy semantics

def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    if set(selector) - {"matchLabels"}:
        raise AssertionError(f"selector form not modelled by this test: {selector}")
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _port_ok(ports: list[Doc] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    return any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports)


def _peer_ok(peers: list[Doc] | None, labels: dict[str, str], same_namespace: bool) -> bool:
    """A podSelector peer selects pods of the policy's namespace; with `namespaceSelector: {}` beside it,
    pods of any namespace (the only forms these manifests use)."""
    if not peers:
        return True
    for peer in peers:
        if set(peer) not in ({"podSelector"}, {"podSelector", "namespaceSelector"}) \
                or peer.get("namespaceSelector", {}) != {}:
            raise AssertionError(f"peer form not modelled by this test: {peer}")
        if (same_namespace or "namespaceSelector" in peer) and _selects(peer["podSelector"], labels):
            return True
    return False


def policy_allows(policies: list[Doc], direction: str, pod: dict[str, str], peer: dict[str, str],
                  port: int, protocol: str = "TCP", same_namespace: bool = True) -> bool:
    """Whether traffic to (Ingress) or from (Egress) a pod of the namespace labelled `pod` with a
    peer pod labelled `peer` (in the namespace, or another) on `port` is allowed, by the
    NetworkPolicy rules of Kubernetes."""
    key = "ingress" if direction == "Ingress" else "egress"
    peers_key = "from" if direction == "Ingress" else "to"
    selecting = [p for p in policies if direction in p["spec"].get("policyTypes", ["Ingress"])
                 and _selects(p["spec"]["podSelector"], pod)]
    if not selecting:
        return True
    return any(_port_ok(rule.get("ports"), port, protocol) and _peer_ok(rule.get(peers_key), peer, same_namespace)
               for p in selecting for rule in p["spec"].get(key) or [])


def connection_allowed(policies: list[Doc], src: dict[str, str], dst: dict[str, str], port: int,
                       protocol: str = "TCP") -> bool:
    """Between two pods of the namespace."""
    return (policy_allows(policies, "Egress", src, dst, port, protocol)
            and policy_allows(policies, "Ingress", dst, src, port, protocol))


# ------------------------------------------------------------------ imports of an entry point

def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_of(path: Path, package: str) -> set[str]:
    """Absolute names imported anywhere in the file (function-level too), except under
    `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def third_party_imports(entry: str, first_party: tuple[str, ...]) -> set[str]:
    """Top-level third-party modules reachable by static imports from module `entry`."""
    seen: set[str] = set()
    todo = [entry]
    found: set[str] = set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        if path is None:
            continue  # `from pkg import name` where name is not a module
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for name in _imports_of(path, package):
            top = name.split(".")[0]
            if top in first_party:
                todo.append(name)
            elif top and top not in sys.stdlib_module_names:
                found.add(top)
    return found
