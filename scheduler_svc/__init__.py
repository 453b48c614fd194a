"""The scheduler service (CPU only): gRPC API, request queues, KV block tables, preemption, routing."""

from pagedserve.extras import require

require("scheduler", ("tokenizers", "zmq", "msgspec", "prometheus_client", "grpc_reflection", "uvloop"))
