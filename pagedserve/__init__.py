"""pagedserve: the public gRPC API package (generated stubs in ``pagedserve.v1``) and the client CLI."""

__version__ = "0.1.0"
