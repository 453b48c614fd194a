"""pagedserve.v1 API stubs.

``generation_pb2`` / ``generation_pb2_grpc`` are generated from
``proto/pagedserve/v1/generation.proto`` and committed, so an installed wheel works
without a code-generation step; ``make proto`` regenerates them after a change to the
.proto, and tests/unit/wire/test_proto_stubs.py fails if they fall behind it. Import them as
``from pagedserve.v1 import generation_pb2, generation_pb2_grpc``.
"""
