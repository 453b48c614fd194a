"""CI compile check of the batched LoRA kernels (``cupy_kernels/lora.cu``): nvcc for sm_80 and sm_90
over every activation dtype, from the text NVRTC compiles, failing on a spill or a stack frame;
then NVRTC itself with the launchers' name expressions (as CuPy's RawModule asks on a GPU)."""

from __future__ import annotations

import re

import pytest

from cupy_kernels import lora
from cupy_kernels.build import CUDA_TYPES, nvrtc_options, read_source
from testing.kernels.nvcc import compile_expressions
from testing.kernels.nvrtc import compile_source, find_library

EXPRESSIONS = [lora.expression(k, d, n) for k in lora.KERNELS for d in CUDA_TYPES for n in (1, lora.TILE)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_lora_kernels_compile_without_spills(tmp_path, arch):
    for k in compile_expressions(lora.SOURCE, EXPRESSIONS, arch, tmp_path):
        assert k.stack == k.spill_stores == k.spill_loads == 0, k


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
