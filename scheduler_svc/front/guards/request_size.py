"""The largest request a legitimate client of the served model can need, in bytes.

Room for a prompt of ``max_model_len`` tokens at BYTES_PER_TOKEN each (a token id is at most 7
bytes of JSON with its comma, 5 as a protobuf varint; text averages about 4 bytes a token,
JSON-escaped non-ASCII up to 12), plus ALLOWANCE_BYTES for everything else a request carries:
chat messages' structure, tools, a JSON schema, stop strings (each also has its own count or
size cap: request_caps.py). 131,072 tokens: 3 MiB. Both fronts refuse a larger request before
parsing it: HTTP from its Content-Length (http/limits.py), gRPC from its message's size
(grpc/call_gate.py).
"""

from __future__ import annotations

BYTES_PER_TOKEN = 16
ALLOWANCE_BYTES = 1 << 20


def request_bytes_for(max_model_len: int) -> int:
    return max_model_len * BYTES_PER_TOKEN + ALLOWANCE_BYTES
