"""nvcc for the compile tests: find it, a translation unit that instantiates given kernels, and a
compile of kernel expressions with ptxas' report of each kernel's stack and spills."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cupy_kernels.build import KernelKey, read_source


def find_nvcc() -> str | None:
    """nvcc from PATH, else the usual install locations."""
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc", "/opt/cuda/bin/nvcc"):
        if os.access(cand, os.X_OK):
            return cand
    return None


def nvcc_unit(source: str, keys: list[KernelKey]) -> str:
    """A translation unit for nvcc that instantiates ``keys`` (taking a kernel's address in host
    code forces its instantiation without spelling its signature)."""
    lines = [f'#include "{source}"', "static void* ps_instances[] = {"]
    lines += [f"    (void*)&{k.expression()}," for k in keys]
    lines += ["};", "void* ps_keep() { return ps_instances; }", ""]
    return "\n".join(lines)


# ptxas -v's report of one kernel: its name, stack frame and spill bytes
_PTXAS_ENTRY = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")


@dataclass(frozen=True)
class KernelResources:
    name: str
    stack: int
    spill_stores: int
    spill_loads: int


def compile_expressions(source_name: str, expressions: list[str], arch: str, workdir: Path) -> list[KernelResources]:
    """nvcc -cubin of ``source_name`` (the text NVRTC compiles) instantiating ``expressions`` for
    ``arch``, with ptxas' report of every kernel. Fails the test on a compile error or on a report
    that does not name each expression once."""
    nvcc = find_nvcc()
    assert nvcc is not None, "nvcc not found on PATH or in /usr/local/cuda/bin: it is part of the toolchain"
    (workdir / "kernels.cu").write_text(read_source(source_name))
    unit = workdir / "unit.cu"
    unit.write_text('#include "kernels.cu"\nvoid* ps_instances[] = {\n'
                    + "".join(f"    (void*)&{e},\n" for e in expressions) + "};\n")
    proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-I", str(workdir),
                           "-o", str(workdir / "unit.cubin"), str(unit)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed ({arch}):\n{proc.stderr[-4000:]}"
    entries = [KernelResources(n, int(s), int(st), int(ld)) for n, s, st, ld in _PTXAS_ENTRY.findall(proc.stderr)]
    assert len(entries) == len(expressions), f"ptxas reported {len(entries)} kernels:\n{proc.stderr[-2000:]}"
    return entries
