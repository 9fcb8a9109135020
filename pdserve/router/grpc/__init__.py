"""The router's gRPC front end (``pdserve.v1.Generation`` and ``grpc.health.v1``)."""
