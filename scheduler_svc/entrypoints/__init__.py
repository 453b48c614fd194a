"""How each process of the scheduler service starts: flags, the front and engine-core mains, children.

The one room that may wire all the others together.
"""

from pagedserve.extras import require

require("scheduler", ("tokenizers", "zmq", "msgspec", "prometheus_client", "grpc_reflection", "uvloop"))
