"""CI compile check of the batched LoRA kernels (``cupy_kernels/lora.cu``): nvcc for sm_80 and sm_90
over every activation dtype, from the text NVRTC compiles, failing on a spill or a stack frame;
then NVRTC itself with the launchers' name expressions (as CuPy's RawModule asks on a GPU)."""

from __future__ import annotations

import re
import subprocess

import pytest

from cupy_kernels import lora
from cupy_kernels.build import CUDA_TYPES, nvrtc_options, read_source
from testing.kernels.nvcc import find_nvcc
from testing.kernels.nvrtc import compile_source, find_library

_ENTRY = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                    r"(\d+) bytes spill loads")
EXPRESSIONS = [lora.expression(k, d, n) for k in lora.KERNELS for d in CUDA_TYPES for n in (1, lora.TILE)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_lora_kernels_compile_without_spills(tmp_path, arch):
    nvcc = find_nvcc()
    assert nvcc is not None, "nvcc not found on PATH or in /usr/local/cuda/bin: it is part of the toolchain"
    (tmp_path / "lora.cu").write_text(read_source(lora.SOURCE))
    unit = tmp_path / "unit.cu"
    unit.write_text('#include "lora.cu"\nvoid* ps_instances[] = {\n'
                    + "".join(f"    (void*)&{e},\n" for e in EXPRESSIONS) + "};\n")
    proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-I", str(tmp_path),
                           "-o", str(tmp_path / "unit.cubin"), str(unit)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"nvcc failed ({arch}):\n{proc.stderr[-4000:]}"
    entries = _ENTRY.findall(proc.stderr)
    assert len(entries) == len(EXPRESSIONS), f"ptxas reported {len(entries)} kernels:\n{proc.stderr[-2000:]}"
    for name, stack, stores, loads in entries:
        assert stack == stores == loads == "0", f"{name}: stack {stack} B, spills {stores}/{loads}"


def test_nvrtc_compiles_the_lora_name_expressions():
    lib = find_library()
    assert lib is not None, "NVRTC library missing: pip install nvidia-cuda-nvrtc (a dev dependency)"
    options = [*nvrtc_options(), "--device-as-default-execution-space", "-ftz=true", "--gpu-architecture=sm_90"]
    res = compile_source(read_source(lora.SOURCE), EXPRESSIONS, options, lib)
    assert res.ok, f"NVRTC failed:\n{res.log[-4000:]}"
    assert set(res.lowered) == set(EXPRESSIONS) and res.cubin_bytes > 0


def test_launcher_constants_match_the_source():
    """The launchers size grids and check R with these numbers: they must be the kernels' own."""
    src = read_source(lora.SOURCE, inline_header=False)
    for macro, value in (("PS_LORA_SHRINK_WARPS", lora.SHRINK_WARPS), ("PS_LORA_EXPAND_THREADS", lora.EXPAND_THREADS),
                         ("PS_LORA_MAX_R", lora.MAX_R), ("PS_LORA_TILE", lora.TILE)):
        assert re.search(rf"#define {macro} {value}\b", src), macro
