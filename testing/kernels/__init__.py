"""What the tests and ``make gpu-check`` share about the CUDA kernels in cupy_kernels/: random paged
test cases and float64 references, the SIMT CPU emulator (``emu/``), compiling through NVRTC and
nvcc without a GPU, and the tensor-parallel check."""
