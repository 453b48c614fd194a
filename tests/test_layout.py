"""The code's layout rules, checked over every module: who may import whom, and no import cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
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


# The scheduler service's rooms, bottom to top. A room imports only from itself and the rooms it
# lists (and the neutral pagedserve package): the fronts never reach the engine or the scheduling
# state, the engine never reaches the fronts, and no room imports from a room above it.
ROOMS = {
    "scheduler_svc.sched": (),  # pure scheduling state, no I/O
    "scheduler_svc.telemetry": (),  # Prometheus metrics, shared by fronts and engine cores
    "scheduler_svc.engine": ("scheduler_svc.sched", "scheduler_svc.telemetry"),
    "scheduler_svc.front": ("scheduler_svc.telemetry",),
    # how each process starts: may wire every room below it
    "scheduler_svc.entrypoints": ("scheduler_svc.front", "scheduler_svc.engine", "scheduler_svc.sched",
                                  "scheduler_svc.telemetry"),
}


def _room(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


def test_each_room_of_the_scheduler_imports_only_the_rooms_below_it():
    mods = _modules("scheduler_svc")
    offenders = []
    for module, path in mods.items():
        room = _room(module)
        if room is None:
            continue
        allowed = (room, *ROOMS[room])
        for name in sorted(_imports(path, module)):
            if not name.startswith("scheduler_svc"):
                continue
            other = _room(name)
            if other is None and name in ("scheduler_svc", "scheduler_svc.__main__"):
                other = "scheduler_svc (the top)"
            if other is not None and other not in allowed:
                offenders.append(f"{module} ({room}) imports {name} ({other})")
    assert not offenders, "imports across the rooms of scheduler_svc:\n" + "\n".join(offenders)


def test_every_scheduler_module_lives_in_a_room():
    loose = [m for m in _modules("scheduler_svc") if _room(m) is None
             and m not in ("scheduler_svc", "scheduler_svc.__main__")]
    assert not loose, f"modules outside the rooms of scheduler_svc: {loose}"


def test_no_service_imports_the_test_support_or_the_benchmarks():
    offenders = []
    for package in (*SERVICES, "pagedserve", "cupy_kernels"):
        for module, path in _modules(package).items():
            bad = sorted(n for n in _imports(path, module) if n.split(".")[0] in ("testing", "tests", "benchmarks"))
            if bad:
                offenders.append(f"{module} imports {bad}")
    assert not offenders, offenders


def test_no_test_imports_from_the_benchmarks():
    """The tests' fakes and drivers live in testing/: a benchmark can change or go without a test
    noticing. (A test may still run a benchmark's command line, as a user does.)"""
    offenders = []
    for package in ("tests", "testing"):
        for module, path in _modules(package).items():
            bad = sorted(n for n in _imports(path, module) if n.split(".")[0] == "benchmarks" and n != "benchmarks")
            if bad:
                offenders.append(f"{module} imports {bad}")
    assert not offenders, "move what the tests need into testing/:\n" + "\n".join(offenders)


def _loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def test_an_engine_core_starts_without_the_web_stack():
    """An engine core serves no HTTP and no gRPC: it must not pay their imports (or their memory)."""
    loaded = _loaded_after_import("scheduler_svc.entrypoints.core")
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("uvicorn", "starlette", "jinja2", "grpc", "grpc_reflection"))
    assert not heavy, f"an engine core imports {heavy}"
    servers = ("scheduler_svc.front.http.app", "scheduler_svc.front.http.serve", "scheduler_svc.front.grpc.server",
               "scheduler_svc.front.grpc.servicer", "scheduler_svc.front.http.asgi_app",
               "scheduler_svc.front.streams")
    assert not loaded & set(servers), f"an engine core imports a front's servers: {sorted(loaded & set(servers))}"


def test_the_scheduling_state_loads_without_grpc_or_a_web_framework():
    loaded = _loaded_after_import("scheduler_svc.sched.scheduler")
    heavy = sorted(m for m in loaded
                   if m.split(".")[0] in ("uvicorn", "starlette", "jinja2", "grpc", "grpc_reflection", "torch"))
    assert not heavy, f"the scheduling state imports {heavy}"


def test_the_scheduling_state_loads_where_the_scheduler_extra_is_not_installed():
    """A GPU machine's tools (gpu-check, the executor's benchmarks) use the scheduler's data types
    without the scheduler extra; only its processes require it, and say so."""
    hide = "import sys; sys.modules['grpc_reflection'] = sys.modules['uvicorn'] = None; "
    ok = subprocess.run([sys.executable, "-c", hide + "import scheduler_svc.sched.scheduler, pagedserve.engine_api"],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    # gpu-check and every module its sections import (named as text: the tests import no benchmark)
    gpu_check = ("benchmarks.kernels.gpu_check", "benchmarks.kernels.bench", "testing.kernels.executor_steps",
                 "testing.device_idle", "testing.stack_throughput", "testing.kernels.tp_check",
                 "testing.kernels.gpu_report")
    ok = subprocess.run([sys.executable, "-c", hide + "import " + ", ".join(gpu_check)],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run([sys.executable, "-c", hide + "import scheduler_svc.entrypoints.core"],
                             capture_output=True, text=True, cwd=ROOT)
    assert "needs the 'scheduler' extra" in refused.stderr and "grpc_reflection" in refused.stderr
