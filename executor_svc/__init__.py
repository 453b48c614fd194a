"""The executor service: a Llama-family model on a paged KV cache, driven by the scheduler's plans."""

from pagedserve.extras import require

require("executor", ("torch", "safetensors", "numpy", "zmq", "msgspec"))
