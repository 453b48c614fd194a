"""Tooling for the CUDA kernels in cupy_kernels/ (not shipped: the executor wheel carries the
kernels and their launchers only): test cases and float64 references, the SIMT CPU emulator,
compiling through NVRTC and nvcc without a GPU, the decode timing bench and ``make gpu-check``."""
