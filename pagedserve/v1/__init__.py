"""pagedserve.v1 API stubs.

``generation_pb2`` / ``generation_pb2_grpc`` are generated from
``proto/pagedserve/v1/generation.proto`` by ``make proto`` (``make setup`` and
``make test`` run it); they are not committed. Import them as
``from pagedserve.v1 import generation_pb2, generation_pb2_grpc``.
"""
