"""CI compile check of the fused decoder-layer kernels: nvcc for sm_80 and sm_90 (no spills, no
stack frame) over every storage dtype, from the text NVRTC compiles, then NVRTC itself with the
launcher's name expressions (as CuPy's RawModule asks on a GPU machine)."""

from __future__ import annotations

import pytest

from cupy_kernels import fused_layers
from cupy_kernels.build import CUDA_TYPES, nvrtc_options, read_source
from testing.kernels.nvcc import compile_expressions
from testing.kernels.nvrtc import compile_source, find_library

# cosf/sinf keep a small stack frame for their exact range reduction of huge angles (|x| > 1e5
# rad, a branch never taken at real positions); anything else on the stack is a defect.
ROPE_FRAME_BYTES = 32
EXPRESSIONS = [fused_layers.expression(k, d) for k in fused_layers.KERNELS for d in CUDA_TYPES]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fused_kernels_compile_without_spills(tmp_path, arch):
    for k in compile_expressions(fused_layers.SOURCE, EXPRESSIONS, arch, tmp_path):
        allowed = ROPE_FRAME_BYTES if "rope_and_cache" in k.name else 0
        assert k.stack <= allowed and k.spill_stores == k.spill_loads == 0, k


def test_nvrtc_compiles_the_launchers_name_expressions():
    lib = find_library()
    assert lib is not None, "NVRTC library missing: pip install nvidia-cuda-nvrtc (a dev dependency)"
    options = [*nvrtc_options(), "--device-as-default-execution-space", "-ftz=true", "--gpu-architecture=sm_90"]
    res = compile_source(read_source(fused_layers.SOURCE), EXPRESSIONS, options, lib)
    assert res.ok, f"NVRTC failed:\n{res.log[-4000:]}"
    assert set(res.lowered) == set(EXPRESSIONS) and res.cubin_bytes > 0
