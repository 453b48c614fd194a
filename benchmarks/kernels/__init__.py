"""Timing of the CUDA kernels in cupy_kernels/ and ``make gpu-check`` (not shipped). Their test cases,
references, emulator and compile helpers, which the tests use too, are in testing/kernels/."""
