"""LoRA adapters on the executor (issue #40): PEFT adapters in fixed slots, many per step.

- ``adapter.py``: read and validate one PEFT adapter directory (``load_adapter``, ``LoraError``).
- ``slots.py``: the fixed slots' stacked A/B tensors per layer and fused projection.
- ``apply.py``: the wrapper that adds each token's adapter delta to a projection (torch products on CPU,
  the batched kernels of ``cupy_kernels/lora.cu`` on CUDA).
- ``cache.py``: adapters kept parsed in host memory (``--max-cpu-loras``), least recently used first out.
- ``sharding.py``: a tensor-parallel rank's slice of an adapter.
- ``manager.py``: ``LoraManager``, what the runner calls.
"""

from executor_svc.lora.adapter import LoraAdapter, LoraError, load_adapter
from executor_svc.lora.apply import LoraBatch
from executor_svc.lora.manager import LoraManager
from executor_svc.lora.slots import LoraSlots

__all__ = ["LoraAdapter", "LoraBatch", "LoraError", "LoraManager", "LoraSlots", "load_adapter"]
