"""The gRPC API: the pagedserve.v1.Generation servicer, its call gate and connection bounds."""
