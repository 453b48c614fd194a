"""The code's layout rules, checked over every module: who may import whom, and no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("scheduler_svc", "executor_svc")


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Every module named by an import statement, including those under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_the_services_never_import_each_other():
    offenders = []
    for service in SERVICES:
        other = next(s for s in SERVICES if s != service)
        for module, path in _modules(service).items():
            bad = sorted(n for n in _imports(path, module) if n == other or n.startswith(other + "."))
            if bad:
                offenders.append(f"{module} imports {bad}")
    assert not offenders, "the services share only the neutral pagedserve package:\n" + "\n".join(offenders)


def test_the_neutral_package_imports_neither_service():
    offenders = [f"{m}: {sorted(n for n in _imports(p, m) if n.split('.')[0] in SERVICES)}"
                 for m, p in _modules("pagedserve").items()
                 if any(n.split(".")[0] in SERVICES for n in _imports(p, m))]
    assert not offenders, offenders


def test_no_import_cycles_within_a_package():
    for package in (*SERVICES, "pagedserve", "cupy_kernels"):
        mods = _modules(package)
        graph = {m: {n for n in _imports(p, m) if n in mods and n != m} for m, p in mods.items()}
        # A package's __init__ importing its submodules is not a cycle of responsibilities.
        for m in graph:
            graph[m] = {n for n in graph[m] if not m.startswith(n + ".")}
        cycle = _find_cycle(graph)
        assert cycle is None, f"import cycle in {package}: {' -> '.join(cycle)}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None
