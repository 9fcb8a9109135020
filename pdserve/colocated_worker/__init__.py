"""A colocated pool member: one engine that prefills (chunked) and decodes."""
