"""nvcc for the compile tests: find it, and a translation unit that instantiates given kernels."""

from __future__ import annotations

import os
import shutil

from cupy_kernels.build import KernelKey


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
