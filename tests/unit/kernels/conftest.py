"""The site of the CUDA path's model tests (testing/kernels/cuda_site.py): ``where`` runs a test twice,
on the emulator (CI) and on a GPU (marked ``gpu``; ``make gpu-check``); ``emulated`` alone serves the
tests whose harness only the CPU stand-in can run (host-tensor metadata, several ranks)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

_HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


@pytest.fixture(scope="module", params=["emulator", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")])])
def where(request):
    from testing.kernels.cuda_site import KernelSite

    return request.getfixturevalue("emulated") if request.param == "emulator" else KernelSite("cuda")


@pytest.fixture(scope="module")
def emulated():
    from testing.kernels.cuda_site import KernelSite

    return KernelSite.emulator()
