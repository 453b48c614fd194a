"""benchmarks/README.md (the index), the files in benchmarks/ and ``make bench`` (run_all) agree.

run_all is read through its ``--list`` command line: the tests import nothing from benchmarks/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _rows(section: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]


def readme_index() -> dict[str, str]:
    """Label (``executor_cpu roofline``) -> what it needs (CPU, llama.cpp, GPU)."""
    rows = _rows(_section((BENCH / "README.md").read_text(), "Index"))
    assert rows, "the README has no index table"
    for row in rows:
        assert len(row) == 6 and all(row), f"an index row needs its six columns filled: {row}"
    return {row[0].strip("`"): row[4] for row in rows}


def readme_support_files() -> set[str]:
    rows = _rows(_section((BENCH / "README.md").read_text(), "Support modules"))
    for row in rows:
        assert len(row) == 2 and all(row), f"a support row names a file and what it is: {row}"
    return {name for row in rows for name in re.findall(r"`([\w/]+\.(?:py|sh))`", row[0])}


def run_all_index() -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--list"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def _module_file(label: str) -> str:
    return label.split()[0].replace(".", "/") + ".py"


def test_every_file_in_benchmarks_is_indexed_or_a_support_module():
    index_files = {_module_file(label) for label in readme_index()}
    support = readme_support_files()
    files = {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*")
             if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
    assert not files - index_files - support, "files in benchmarks/ the README does not list"
    assert not (index_files | support) - files, "files the README lists that are gone"
    assert not index_files & support, "a file is both a benchmark and a support module"


def test_run_all_lists_the_index_and_runs_every_cpu_entry_quickly():
    readme = readme_index()
    listed = run_all_index()
    assert {e["label"]: e["needs"] for e in listed} == readme
    for entry in listed:
        assert entry["quick"][0] == f"benchmarks.{entry['module']}"
        assert (BENCH / _module_file(entry["module"])).is_file()
    # what make bench leaves out: the GPU entries always, a llama.cpp one only where it is not built
    assert {e["needs"] for e in listed} <= {"CPU", "llama.cpp", "GPU"}
    assert all(e["skipped"] is None for e in listed if e["needs"] == "CPU")
    assert all(e["skipped"] for e in listed if e["needs"] == "GPU")
