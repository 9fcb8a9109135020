"""What the router's two front ends (``http``, ``grpc``) share over its core: the
router protocol they call and the rules for ending its streams, request ids, API
keys, the errors a client may see, beam search."""
