"""Which attention backend serves a device: the one place that knows every implementation.

Kept apart from ``attention.py`` (the interface and the torch reference) so the
interface never imports its implementations (``attention_cpu``, ``attention_cupy``).
"""

from __future__ import annotations

from executor_svc.attention import AttentionBackend, TorchAttentionBackend
from executor_svc.config import CPU_ATTENTION


def make_attention_backend(device: str, cpu_attention: str = "auto") -> AttentionBackend:
    """The backend for a device: the CuPy PagedAttention kernels on CUDA; on CPU the fused C decode
    kernel (executor_svc/attention_cpu.py) when it builds, else torch.

    ``cpu_attention``: ``auto`` falls back to torch (with one warning) when the kernel cannot be
    built or loaded; ``fused`` makes that an error; ``torch`` never builds it.
    """
    if cpu_attention not in CPU_ATTENTION:
        raise ValueError(f"cpu_attention: expected one of {CPU_ATTENTION}, got {cpu_attention!r}")
    if device == "cpu":
        if cpu_attention == "torch":
            return TorchAttentionBackend()
        from executor_svc.attention_cpu import FusedCpuAttentionBackend
        from executor_svc.cpu_kernels import load_decode_kernel

        kernel = load_decode_kernel()
        if kernel is not None:
            return FusedCpuAttentionBackend(kernel)
        if cpu_attention == "fused":
            raise ValueError("--cpu-attention fused: the CPU decode kernel did not build (see the warning)")
        return TorchAttentionBackend()
    if device == "cuda":
        from executor_svc.attention_cupy import CupyAttentionBackend  # needs cupy; import only here

        return CupyAttentionBackend()
    raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
