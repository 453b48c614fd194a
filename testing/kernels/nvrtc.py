"""A minimal ctypes binding of NVRTC, for checking on machines without a GPU (CI) that the
kernel sources compile exactly the way CuPy's RawModule compiles them at run time: NVRTC, the
same options, template instantiations requested by name expression. Needs only the NVRTC
library (the ``nvidia-cuda-nvrtc`` wheel or a CUDA toolkit), no driver and no device."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class NvrtcResult:
    ok: bool
    log: str
    lowered: dict[str, str]  # name expression -> mangled kernel name
    cubin_bytes: int


def find_library() -> str | None:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (cu13 or cu12 layout) or a CUDA toolkit."""
    roots = [Path(p) for p in sys.path if p]
    patterns = [str(r / "nvidia" / sub / "lib" / "libnvrtc.so*") for r in roots for sub in ("cu13", "cuda_nvrtc")]
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            patterns.append(str(Path(root) / "lib64" / "libnvrtc.so*"))
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if "builtins" not in path and "alt" not in path:
                return path
    return None


def compile_source(source: str, name_expressions: list[str], options: list[str],
                   library: str | None = None) -> NvrtcResult:
    path = library or find_library()
    if path is None:
        raise RuntimeError("NVRTC library not found (pip install nvidia-cuda-nvrtc, or a CUDA toolkit)")
    lib = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"pagedserve.cu", 0, None, None))
    try:
        for expr in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, expr.encode()))
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetProgramLog(prog, buf))
        log = buf.value.decode(errors="replace")
        if status != 0:
            return NvrtcResult(False, log, {}, 0)
        lowered = {}
        for expr in name_expressions:
            name = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(name)))
            lowered[expr] = name.value.decode()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        return NvrtcResult(True, log, lowered, size.value)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {status}: {lib.nvrtcGetErrorString(status).decode()}")
